"""Where a C compiler is here, every C kernel builds and loads: a kernel that fails to compile is a
failure, never "no compiler here" (the library itself logs it once and falls back, for users).

The build specs are found, not listed: every :class:`~selfattn.kernels.build.CLibrary` a module of
``selfattn.kernels`` defines, and every C source under ``kernels/csrc/`` must belong to one.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import platform
import re
import shutil
import subprocess
from pathlib import Path

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


def _load_time_functions(lib: Path) -> dict[str, str]:
    """The disassembly of each function ``lib``'s ``.init_array`` runs when it is loaded, by
    name (the constructors; objdump's AT&T syntax)."""
    sections = subprocess.run(["readelf", "-SW", str(lib)], capture_output=True, text=True)
    row = r"\.init_array\s+\S+\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)"  # name type addr off size
    found = re.search(row, sections.stdout)
    assert found, f"no .init_array in {lib}"
    start, size = int(found[1], 16), int(found[2], 16)
    relocs = subprocess.run(["readelf", "-rW", str(lib)], capture_output=True, text=True).stdout
    entries = set()
    for line in relocs.splitlines():  # offset info type [symbol] addend: relative relocations
        fields = line.split()
        at = int(fields[0], 16) if fields and re.fullmatch(r"[0-9a-f]{8,16}", fields[0]) else -1
        if start <= at < start + size and len(fields) >= 4 and "RELATIVE" in fields[2]:
            entries.add(int(fields[-1], 16))
    dis = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    functions = {}  # address -> (name, disassembly), one per "<name>:" header
    for block in re.split(r"\n(?=[0-9a-f]+ <[^>]+>:\n)", dis):
        head = re.match(r"([0-9a-f]+) <([^>]+)>:\n", block)
        if head:
            functions[int(head[1], 16)] = (head[2], block)
    missing = entries - functions.keys()
    assert not missing, f"constructors at {sorted(missing)} have no symbol in {lib}"
    out = dict(functions[a] for a in entries)
    return out


def _constructors_in_widened_code(text: str) -> list[int]:
    """Line numbers of ``__attribute__((constructor))`` functions that a ``#pragma GCC target``
    region (between push_options and pop_options) or their own target attribute widens."""
    widened, bad = [False], []
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(r"\s*#\s*pragma GCC push_options", line):
            widened.append(widened[-1])
        elif re.match(r"\s*#\s*pragma GCC pop_options", line):
            widened.pop()
        elif re.match(r"\s*#\s*pragma GCC target", line):
            widened[-1] = True
        elif re.search(r"__attribute__\(\(.*constructor", line):
            bad += [number] if widened[-1] or "target(" in line else []
    return bad


@pytest.mark.parametrize("source", sorted(p.name for p in build.CSRC.glob("*.[ch]")))
def test_no_constructor_is_compiled_for_a_wider_instruction_set(source):
    """Code that runs when a library loads runs on every CPU that loads it, before any dispatch
    chooses a path: a constructor inside a region a ``#pragma GCC target`` widens may be
    vectorised with AVX-512, and a CPU without it then faults as the library loads."""
    assert not _constructors_in_widened_code((build.CSRC / source).read_text()), source


def test_the_lint_finds_a_constructor_in_a_widened_region():
    text = (build.CSRC / "paged_decode.c").read_text()
    planted = text.replace(
        '#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")\n',
        '#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")\n'
        "__attribute__((constructor)) static void planted(void) {}\n",
    )
    assert planted != text and len(_constructors_in_widened_code(planted)) == 1


@pytest.mark.parametrize("name", sorted(SPECS))
def test_code_that_runs_at_load_has_no_avx512_where_the_cpu_lacks_it(name):
    """The cached library this CPU loads: its constructors (the functions ``.init_array``
    lists) use no AVX-512 register where the CPU has no AVX-512."""
    _needs_compiler()
    if platform.machine() != "x86_64" or "avx512f" in build.cpu_flags():
        pytest.skip("an x86-64 CPU without AVX-512 only: elsewhere the source check covers it")
    if not all(shutil.which(t) for t in ("readelf", "objdump")):
        pytest.skip("needs binutils (readelf, objdump)")
    lib = build.load(SPECS[name])
    if lib is None:
        pytest.skip(f"{name} did not build here (test_every_c_kernel_builds_and_loads says why)")
    wide = re.compile(r"%[xy]mm(1[6-9]|2\d|3[01])\b|%zmm|%k[0-7]\b")
    for function, text in _load_time_functions(Path(lib._name)).items():
        bad = [ln.strip() for ln in text.splitlines() if wide.search(ln)]
        assert not bad, f"{name}: {function} runs at load with {bad[:3]}"


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
