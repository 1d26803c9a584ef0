"""``selfattn bench``: run the benchmarks (the package's :mod:`selfattn.benchmarks`, plus the
scripts of a source checkout's ``benchmarks/`` folder that are not packaged), with a progress bar,
and print their ratio tables or collect their JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "bench",
        help="run the benchmarks (selfattn.benchmarks) and print their ratio tables",
        description=(
            "Run each benchmark with --quick (default) or at full size, with a progress bar; "
            "print their tables, or collect their JSON. The benchmarks ship with the package; "
            "in a source checkout the scripts of benchmarks/ that are not packaged run too."
        ),
    )
    p.add_argument("--full", action="store_true", help="full sizes (minutes each)")
    p.add_argument(
        "--only", action="append", metavar="NAME", help="run this benchmark only (repeatable)"
    )
    p.add_argument(
        "--dir",
        metavar="PATH",
        help="run the scripts of this folder instead (default: the packaged benchmarks, and "
        "./benchmarks where it exists)",
    )
    p.add_argument(
        "--timeout",
        type=_common.positive_int,
        metavar="S",
        help="seconds per benchmark (default none)",
    )
    p.add_argument("--json", action="store_true", help="collect the benchmarks' JSON results")
    p.set_defaults(run=run, subparser=p)
    return p


@dataclass(frozen=True)
class _Bench:
    name: str
    command: tuple[str, ...]  # after the interpreter: ("-m", module) or (script path,)
    cwd: Path | None = None


def _scripts(folder: Path) -> list[_Bench]:
    """The benchmark scripts of ``folder`` (``_helpers.py`` are not benchmarks)."""
    return [
        _Bench(p.stem, (str(p),), p.parent.parent)
        for p in sorted(folder.glob("*.py"))
        if not p.name.startswith("_")
    ]


def _checkout_folder() -> Path | None:
    """``./benchmarks``, else the folder beside the source tree this package runs from (an
    editable install); None for an installed wheel run elsewhere."""
    import selfattn

    for c in (
        Path.cwd() / "benchmarks",
        Path(selfattn.__file__).resolve().parents[2] / "benchmarks",
    ):
        if c.is_dir() and any(c.glob("*.py")):
            return c
    return None


def _benchmarks(given: str | None) -> tuple[list[_Bench], Path | None]:
    """What ``selfattn bench`` runs, and the scripts folder it read (None: packaged only)."""
    from selfattn.benchmarks import NAMES

    if given:
        folder = Path(given)
        if not (folder.is_dir() and any(folder.glob("*.py"))):
            raise FileNotFoundError(
                f"no benchmarks folder at {str(folder)!r}: --dir takes a folder of benchmark "
                "scripts (without --dir the packaged benchmarks run)"
            )
        return _scripts(folder), folder
    packaged = [_Bench(n, ("-m", f"selfattn.benchmarks.{n}")) for n in NAMES]
    folder = _checkout_folder()
    extra = [] if folder is None else [b for b in _scripts(folder) if b.name not in NAMES]
    return sorted(packaged + extra, key=lambda b: b.name), folder


def _select(benches: list[_Bench], only: list[str] | None) -> tuple[list[_Bench], list[str]]:
    """The benchmarks to run and notes on those skipped (``gpu`` without CUDA)."""
    import torch

    names = [b.name for b in benches]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"unknown benchmark(s) {unknown}; choose from {names}")
        benches = [b for b in benches if b.name in only]
    notes = []
    if not torch.cuda.is_available() and any(b.name == "gpu" for b in benches):
        benches = [b for b in benches if b.name != "gpu"]
        notes.append("gpu: skipped, no CUDA device (torch.cuda.is_available() is False)")
    return benches, notes


def _run_one(bench: _Bench, argv: list[str], timeout: float | None) -> dict:
    import subprocess
    import time

    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, *bench.command, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=bench.cwd,
        )
    except subprocess.TimeoutExpired:
        return {"returncode": None, "seconds": timeout, "stdout": "", "stderr": "timed out"}
    seconds = time.perf_counter() - start
    return {
        "returncode": done.returncode,
        "seconds": seconds,
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


def _progress(console, total: int):
    """A rich progress bar on a terminal (``[cli]`` extra), else a stand-in that shows nothing."""
    if console is None or not console.is_terminal:
        return _NoProgress()
    p = _common.rich_module("progress")
    columns = (p.SpinnerColumn(), p.TextColumn("{task.description}"), p.BarColumn())
    return p.Progress(*columns, p.TimeElapsedColumn(), console=console)


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, description: str, total: int) -> int:
        return 0

    def update(self, task: int, description: str) -> None:
        pass

    def advance(self, task: int) -> None:
        pass


def run(args) -> int:
    try:
        benches, folder = _benchmarks(args.dir)
        benches, notes = _select(benches, args.only)
    except ValueError as e:
        args.subparser.error(str(e))
    argv = ([] if args.full else ["--quick"]) + (["--json"] if args.json else [])
    runs = []
    with _progress(_common.stderr_console(), len(benches)) as progress:
        task = progress.add_task("benchmarks", total=len(benches))
        for b in benches:
            progress.update(task, description=f"{b.name} ({'full' if args.full else 'quick'})")
            runs.append({"name": b.name, **_run_one(b, argv, args.timeout)})
            progress.advance(task)
    failed = [r["name"] for r in runs if r["returncode"] != 0]
    if args.json:
        for r in runs:
            try:
                r["result"] = json.loads(r.pop("stdout")) if r["returncode"] == 0 else None
            except json.JSONDecodeError:
                r["result"] = None
        where = None if folder is None else str(folder)
        _common.print_json({"folder": where, "quick": not args.full, "notes": notes, "runs": runs})
    else:
        out = _common.Printer()
        for r in runs:
            out.heading(f"{r['name']} ({r['seconds']:.1f} s)")
            out.line(r["stdout"].rstrip())
        for note in notes:
            out.line(f"note: {note}")
    for name in failed:
        failure = next(r for r in runs if r["name"] == name)
        tail = "\n".join(failure["stderr"].strip().splitlines()[-5:])
        code = failure["returncode"]
        _common.print_error(f"benchmark {name} failed ({code}):\n{tail}")
    return _common.EXIT_FAILURE if failed else _common.EXIT_OK
