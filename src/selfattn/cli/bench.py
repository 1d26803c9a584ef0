"""``selfattn bench``: run the benchmark scripts of a checkout (benchmarks/*.py), with a progress
bar, and print their ratio tables or collect their JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "bench",
        help="run the benchmark scripts (benchmarks/*.py) and print their ratio tables",
        description=(
            "Run each script of the checkout's benchmarks/ folder with --quick (default) or at "
            "full size, with a progress bar; print their tables, or collect their JSON."
        ),
    )
    p.add_argument("--full", action="store_true", help="the issues' sizes (minutes each)")
    p.add_argument(
        "--only", action="append", metavar="NAME", help="run this script only (repeatable)"
    )
    p.add_argument("--dir", metavar="PATH", help="the benchmarks folder (default ./benchmarks)")
    p.add_argument(
        "--timeout",
        type=_common.positive_int,
        metavar="S",
        help="seconds per script (default none)",
    )
    p.add_argument("--json", action="store_true", help="collect the scripts' JSON results")
    p.set_defaults(run=run, subparser=p)
    return p


def _benchmarks_dir(given: str | None) -> Path:
    """``--dir``, else ``./benchmarks``, else the checkout this package is installed from."""
    import selfattn

    candidates = [Path(given)] if given else [Path.cwd() / "benchmarks"]
    if not given:
        candidates.append(Path(selfattn.__file__).resolve().parents[2] / "benchmarks")
    for c in candidates:
        if c.is_dir() and any(c.glob("*.py")):
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"no benchmarks folder found (tried {tried}); the benchmark scripts live in the selfattn "
        "source checkout: run from its root or pass --dir PATH/benchmarks"
    )


def _bench_scripts(folder: Path, only: list[str] | None) -> tuple[list[Path], list[str]]:
    """The scripts to run and notes on those skipped (``gpu.py`` without CUDA)."""
    import torch

    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    names = [p.stem for p in scripts]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"unknown benchmark(s) {unknown}; {folder} has {names}")
        scripts = [p for p in scripts if p.stem in only]
    notes = []
    if not torch.cuda.is_available() and any(p.stem == "gpu" for p in scripts):
        scripts = [p for p in scripts if p.stem != "gpu"]
        notes.append("gpu: skipped, no CUDA device (torch.cuda.is_available() is False)")
    return scripts, notes


def _run_script(path: Path, argv: list[str], timeout: float | None) -> dict:
    import subprocess
    import time

    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(path), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=path.parent.parent,
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


def run(args) -> int:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    try:
        folder = _benchmarks_dir(args.dir)
        scripts, notes = _bench_scripts(folder, args.only)
    except ValueError as e:
        args.subparser.error(str(e))
    argv = ([] if args.full else ["--quick"]) + (["--json"] if args.json else [])
    runs = []
    console = _common.stderr_console()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("benchmarks", total=len(scripts))
        for path in scripts:
            progress.update(task, description=f"{path.stem} ({'full' if args.full else 'quick'})")
            runs.append({"name": path.stem, **_run_script(path, argv, args.timeout)})
            progress.advance(task)
    failed = [r["name"] for r in runs if r["returncode"] != 0]
    if args.json:
        for r in runs:
            try:
                r["result"] = json.loads(r.pop("stdout")) if r["returncode"] == 0 else None
            except json.JSONDecodeError:
                r["result"] = None
        _common.print_json(
            {"folder": str(folder), "quick": not args.full, "notes": notes, "runs": runs}
        )
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
