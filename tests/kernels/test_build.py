"""Where a C compiler is here, every C kernel builds and loads: a kernel that fails to compile is a
failure, never "no compiler here" (the library itself logs it once and falls back, for users).

The build specs are found, not listed: every :class:`~selfattn.kernels.build.CLibrary` a module of
``selfattn.kernels`` defines, and every C source under ``kernels/csrc/`` must belong to one.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest
import torch

import selfattn.kernels
from selfattn.kernels import build, fused_attention, paged_decode, quant_matmul, rows_linear
from tests._kernel_helpers import c_kernel

# The modules whose library() a test may need: each has ENV_VAR, SPEC and library().
KERNEL_MODULES = [paged_decode, quant_matmul, fused_attention, rows_linear]


def _specs() -> dict[str, build.CLibrary]:
    """Every build spec the kernel modules define, by library name."""
    found = {}
    for info in pkgutil.iter_modules(selfattn.kernels.__path__):
        if info.ispkg:  # triton/: Python kernels, an optional import
            continue
        module = importlib.import_module(f"selfattn.kernels.{info.name}")
        found |= {v.name: v for v in vars(module).values() if isinstance(v, build.CLibrary)}
    return found


SPECS = _specs()


def _needs_compiler() -> str:
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler here ($CC, cc, gcc, clang): the kernels cannot be built")
    return cc


def test_every_c_source_belongs_to_a_build_spec():
    sources = {s for spec in SPECS.values() for s in spec.sources}
    on_disk = {p.name for p in build.CSRC.glob("*.c")}
    assert on_disk, f"no C sources under {build.CSRC}"
    assert on_disk <= sources, f"C sources no build spec compiles: {sorted(on_disk - sources)}"
    assert {spec.name for spec in SPECS.values()} >= {m.SPEC.name for m in KERNEL_MODULES}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_c_kernel_builds_and_loads(name):
    """Through the cache, as a user's first call does; on failure, every target's compiler
    stderr from a fresh build."""
    _needs_compiler()
    spec = SPECS[name]
    if spec is fused_attention.AVX2_SPEC and torch.backends.cpu.get_cpu_capability() not in (
        "AVX2",
        "AVX512",
    ):
        pytest.skip("the avx2 build runs only on AVX2 CPUs (elsewhere the generic one does)")
    lib = build.load(spec)
    errors = "\n\n".join(build.build_errors(spec)) if lib is None else ""
    assert lib is not None, f"the {name} C kernel did not build or load:\n{errors}"
    assert all(hasattr(lib, f.name) for f in spec.functions)


@pytest.mark.parametrize("module", KERNEL_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_kernel_module_loads_its_library(module):
    """library() itself (the module's own checks included, e.g. the fused kernel's tile size):
    not None wherever a compiler is here and the kernel is not switched off."""
    assert c_kernel(module) is not None


def _broken(spec: build.CLibrary, tmp_path) -> build.CLibrary:
    """``spec`` compiling a copy of its first source with an ``#error`` planted at the top."""
    source = build.CSRC / spec.sources[0]
    copy = tmp_path / source.name
    copy.write_text(f'#error "planted by the test"\n{source.read_text()}')
    # Path / an absolute path is that path: the copy's quoted includes are copied beside it.
    for header in spec.input_paths()[1:]:
        (tmp_path / header.name).write_text(header.read_text())
    return dataclasses.replace(spec, sources=(str(copy), *spec.sources[1:]))


@pytest.fixture
def broken_paged_decode(monkeypatch, tmp_path):
    """paged_decode with an #error in its source; its library cache cleared before and after."""
    monkeypatch.setattr(paged_decode, "SPEC", _broken(paged_decode.SPEC, tmp_path))
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(tmp_path / "cache"))
    paged_decode._library_once.cache_clear()
    yield
    paged_decode._library_once.cache_clear()


def test_a_kernel_that_does_not_compile_fails_its_tests(broken_paged_decode, caplog):
    """The hole this guards: an #error in the source made library() None, which the kernel's
    tests read as "no compiler here" and skipped."""
    cc = _needs_compiler()
    assert paged_decode.library() is None  # users: logged once, the PyTorch path runs
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "selfattn"]
    assert "could not be built" in warning and "planted by the test" in warning, warning
    errors = build.build_errors(paged_decode.SPEC)
    assert errors and all("planted by the test" in e for e in errors), errors
    with pytest.raises(pytest.fail.Exception) as failed:
        c_kernel(paged_decode)
    message = str(failed.value)
    assert "paged_decode" in message and cc in message and "planted by the test" in message


def test_a_kernel_skips_without_a_compiler_or_when_switched_off(broken_paged_decode, monkeypatch):
    monkeypatch.setenv(paged_decode.ENV_VAR, "0")
    with pytest.raises(pytest.skip.Exception, match="SELFATTN_DECODE_KERNEL=0"):
        c_kernel(paged_decode)
    monkeypatch.delenv(paged_decode.ENV_VAR)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(pytest.skip.Exception, match="no C compiler here"):
        c_kernel(paged_decode)
