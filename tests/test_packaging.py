"""selfattn as a package: what its wheel declares and holds, and a core that runs without extras.

``pip install selfattn`` must give a working ``sa.attention`` and ``selfattn explain`` with torch
alone; every optional dependency is an extra whose absence is named in the error
(``pip install 'selfattn[plot]'``).
"""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from selfattn import _optional
from selfattn.benchmarks import NAMES
from tests._no_extras import EXTRAS, last_json, run_without

ROOT = Path(__file__).resolve().parents[1]
# Building a wheel of this tree takes 2-4 s; a stuck build is stopped long before the suite's.
BUILD_TIMEOUT_S = 300
NOT_CORE = {"matplotlib", "rich", "tokenizers", "safetensors", "jinja2", "tqdm", "numpy"}


def _name(requirement: str) -> str:
    """``"torch>=2.5"`` -> ``"torch"`` (PEP 503-normalised)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel of this tree, built from a copy (the checkout gets no build/ or egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    done = subprocess.run(
        [*cmd, "-w", str(tmp / "dist"), str(tree)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = (tmp / "dist").glob("selfattn-*.whl")
    with zipfile.ZipFile(path) as z:
        yield z


def _metadata(wheel: zipfile.ZipFile):
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(wheel.read(name).decode())


def test_wheel_declares_only_torch_as_a_core_dependency(wheel):
    requires = _metadata(wheel).get_all("Requires-Dist")
    core = {_name(r) for r in requires if "extra ==" not in r}
    assert core == {"torch"}, requires
    assert not core & NOT_CORE


def test_every_optional_import_has_its_extra(wheel):
    """Each package ``selfattn._optional`` names is declared by the extra its message names."""
    requires = _metadata(wheel).get_all("Requires-Dist")
    by_extra: dict[str, set[str]] = {}
    for r in requires:
        if m := re.search(r'extra == "([^"]+)"', r):
            by_extra.setdefault(m[1], set()).add(_name(r))
    for module, (dist, extra) in _optional.EXTRAS.items():
        assert _name(dist) in by_extra.get(extra, set()), (module, dist, extra, by_extra)
    assert {"cli", "plot", "models", "serve", "triton", "all", "test"} <= set(
        _metadata(wheel).get_all("Provides-Extra")
    )


def test_wheel_ships_sources_types_benchmarks_and_licence(wheel):
    names = set(wheel.namelist())
    from selfattn.kernels import fused_attention, paged_decode

    for spec in (paged_decode.SPEC, fused_attention.SPEC):  # built on first use: every file
        for path in spec.input_paths():
            assert f"selfattn/kernels/csrc/{path.name}" in names
    assert "selfattn/inspect/view.html" in names  # the explorer page's template
    assert "selfattn/backends/cpu_fused_fits.json" in names  # auto's measured costs
    assert "selfattn/py.typed" in names
    for bench in ("__init__", "_util", *NAMES):
        assert f"selfattn/benchmarks/{bench}.py" in names
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    [licence] = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    text = wheel.read(licence).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    [entry] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "selfattn = selfattn.cli:main" in wheel.read(entry).decode()


def test_core_runs_without_the_extras():
    """Attention, masks, backends' explanations and ``selfattn explain``/``backends``/``kv-size``
    where no optional package can be imported; the extras' features say what to install."""
    done = run_without(
        """
        import contextlib, io, json
        import torch
        import selfattn as sa
        from selfattn.cli import main
        from selfattn.inspect import plot_mask
        from selfattn.models.encoder import SentenceEncoder

        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(2, 4, 13, 8, generator=g, dtype=torch.float64) for _ in range(3))
        mask = sa.masks.causal() & sa.masks.sliding_window(5)
        diff = max(
            (sa.attention(q, k, v, mask=mask, backend=b)
             - sa.attention(q, k, v, mask=mask, backend="reference")).abs().max().item()
            for b in ("auto", "chunked", "sdpa")
        )
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            codes = [main(["explain"]), main(["backends", "--seq", "64"]), main(["kv-size"])]
        errors = {}
        for what, call in {
            "plot": lambda: plot_mask("causal", 4),
            "models": lambda: SentenceEncoder.from_pretrained(),
            "serve": lambda: __import__("selfattn.serving.server"),
        }.items():
            try:
                call()
            except ImportError as e:
                errors[what] = str(e)
        print(json.dumps({"diff": diff, "codes": codes, "out": buf.getvalue(), "errors": errors}))
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = last_json(done.stdout)
    assert result["diff"] < 1e-12
    assert result["codes"] == [0, 0, 0]
    assert "Scaled dot-product attention by hand" in result["out"]
    assert "512 KiB per token" in result["out"]
    assert "pip install 'selfattn[plot]'" in result["errors"]["plot"]
    assert "pip install 'selfattn[models]'" in result["errors"]["models"]
    assert "pip install 'selfattn[serve]'" in result["errors"]["serve"]


def test_require_names_the_extra():
    with pytest.raises(_optional.MissingDependencyError, match=r"pip install 'selfattn\[plot\]'"):
        _optional.require("matplotlib_not_installed_here", extra="plot", purpose="plotting")
    assert _optional.require("json").dumps([]) == "[]"
    assert not _optional.available("matplotlib_not_installed_here")


def test_require_lets_a_broken_install_speak(tmp_path, monkeypatch):
    """An ImportError from inside an installed package (not the package missing) is not ours
    to reword: it arrives as it is."""
    (tmp_path / "broken_pkg_for_test").mkdir()
    (tmp_path / "broken_pkg_for_test" / "__init__.py").write_text("import missing_inner_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as e:
        _optional.require("broken_pkg_for_test", extra="plot")
    assert e.value.name == "missing_inner_dep" and "selfattn[" not in str(e.value)


def test_hidden_packages_are_the_extras():
    assert set(_optional.EXTRAS) <= set(EXTRAS)  # the subprocess hides every optional package
