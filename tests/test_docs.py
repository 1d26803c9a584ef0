"""The documentation stays true: its generated tables are the registry's, and its examples run.

Every ```python and ```pycon block of README.md and docs/**/*.md runs. The blocks of one page run
in order in one namespace, in a fresh temporary folder, as a reader pastes them: a page's later
blocks may use what its earlier ones defined, and each page stands alone. A ```python block is
executed; a ```pycon block is a doctest, its printed output compared. Three markers:

- ``<!-- not-run: REASON -->`` on the line before a block skips it (it needs the network, a GPU,
  several machines); the reason is required and the count is held low.
- a block whose first line is ``# on every rank of a process group`` runs on 2 gloo ranks, each in
  a fresh namespace, instead of in the page's namespace.
- a block naming ``http://127.0.0.1:8000`` talks to `selfattn serve`: the test serves a tiny
  checkpoint on a free port and points the block there.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib
import pytest

from selfattn import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RANKS_MARK = "# on every rank of a process group"
SERVER_URL = "http://127.0.0.1:8000"
# A block that cannot run in the suite says why in this comment on the line before it.
NOT_RUN = re.compile(r"<!-- not-run: (?P<reason>[^>]+?) -->")
FENCE = re.compile(r"^```(?P<lang>python|pycon)\n(?P<source>.*?)^```", re.S | re.M)
# Skipped blocks stay the exception: raise this only for a block that truly cannot run here.
MAX_NOT_RUN = 4


@dataclass(frozen=True)
class Block:
    page: Path  # the Markdown file holding the block
    line: int  # the block's first line in that file (1-based), for failure messages
    lang: str  # "python" (executed) or "pycon" (a doctest)
    source: str  # the code between the fences
    not_run: str | None  # the reason of a <!-- not-run: ... --> marker, or None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The page's ```python and ```pycon blocks, in order."""
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].splitlines()
        marker = NOT_RUN.fullmatch(before[-1].strip()) if before else None
        line = len(before) + 1
        reason = marker.group("reason") if marker else None
        found.append(Block(page, line, m.group("lang"), m.group("source"), reason))
    return found


def _runnable(page: Path, on_ranks: bool = False) -> list[Block]:
    return [
        b
        for b in blocks_of(page)
        if b.not_run is None and b.source.startswith(RANKS_MARK) == on_ranks
    ]


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


PAGES_WITH_CODE = [p for p in PAGES if _runnable(p)]


def _run_doctest(block: Block, namespace: dict) -> None:
    """A ```pycon block as a doctest in the page's namespace; mismatches fail with the diff."""
    test = doctest.DocTestParser().get_doctest(block.source, namespace, block.name, None, 0)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=flags)
    runner.run(test, out=out.write, clear_globs=False)
    assert not runner.failures, f"{block.name}: the doctest's output differs:\n{out.getvalue()}"


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_page_id)
def test_page_examples_run(page, tmp_path, monkeypatch):
    """Each runnable block of the page, in order, in one namespace."""
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    blocks = _runnable(page)
    namespace: dict = {"__name__": "__docs__"}
    with contextlib.ExitStack() as stack:
        if any(SERVER_URL in b.source for b in blocks):
            from tests._serving_helpers import tiny_llama_server

            url = stack.enter_context(tiny_llama_server(tmp_path / "served"))
            blocks = [replace(b, source=b.source.replace(SERVER_URL, url)) for b in blocks]
        for block in blocks:
            if block.lang == "pycon":
                _run_doctest(block, namespace)
                continue
            try:
                exec(compile(block.source, block.name, "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{block.name} failed:\n{block.source}") from e


def test_examples_are_many_and_skipped_ones_few():
    """The docs keep their examples, and the ones the suite cannot run stay the exception."""
    blocks = [b for page in PAGES for b in blocks_of(page)]
    skipped = [b.name for b in blocks if b.not_run]
    assert len(blocks) - len(skipped) >= 40, f"only {len(blocks) - len(skipped)} examples run"
    assert len(skipped) <= MAX_NOT_RUN, f"too many blocks marked not-run: {skipped}"
    readme = [b for b in blocks_of(ROOT / "README.md") if not b.not_run]
    assert readme, "README.md lost its runnable Python examples"


def test_context_parallel_examples_run_on_two_ranks(tmp_path):
    """A block starting with RANKS_MARK runs for real on 2 gloo ranks (its own asserts check it
    against one process): sharding (B, H, S, D) along the wrong dimension would fail it."""
    from tests import _dist_helpers as helpers

    blocks = [b for page in PAGES for b in _runnable(page, on_ranks=True)]
    assert blocks, f"the docs lost their context-parallel example (a block starting {RANKS_MARK!r})"
    cases = [(b.name, helpers.exec_block, {"source": b.source, "name": b.name}) for b in blocks]
    errors = [
        value
        for results in helpers.run_group(2, cases, tmp_path).values()
        for status, value, _ in results
        if status != "ok"
    ]
    assert not errors, "\n".join(errors)


def _check_generated(name: str, flag: str) -> None:
    """The table between ``<!-- name:start -->`` and ``<!-- name:end -->`` (on whichever page
    holds it, exactly one) is the output of ``selfattn backends <flag> --markdown``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    holders = [p for p in PAGES if start in p.read_text()]
    assert len(holders) == 1, f"{name} markers expected on one page, found on {holders}"
    text = holders[0].read_text()
    assert end in text, f"{holders[0]} lost its {name} end marker"
    in_page = text.split(start)[1].split(end)[0].strip()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["backends", flag, "--markdown"]) == 0
    assert in_page == buf.getvalue().strip(), (
        f"{_page_id(holders[0])}'s {name} is stale: paste the output of "
        f"`selfattn backends {flag} --markdown` between its markers"
    )


def test_backend_matrix_matches_the_registry(monkeypatch):
    """As a user's CPU sees it: without the Triton interpreter the tests run Triton kernels in."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check_generated("backend-matrix", "--matrix")


def test_variants_matrix_matches_the_registry(monkeypatch):
    """The "Variants" table is generated (which backend runs which variant), like the backend
    matrix (as a user's CPU sees it: without the Triton interpreter the tests run the paged
    Triton kernel in)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check_generated("variants-matrix", "--variants")
