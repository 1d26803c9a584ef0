"""Timing, memory and printing helpers shared by the benchmarks."""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from selfattn.cache.memory import memory_available_bytes  # re-exported: the benchmarks read it here

__all__ = [
    "Timing",
    "child_env",
    "copy_rate_gbs",
    "machine",
    "matmul_gflops",
    "memory_available_bytes",
    "model_bytes",
    "peak_rss_mib",
    "print_table",
    "reset_peak_rss",
    "run_in_fresh_process",
    "stop_process",
    "time_call",
    "time_interleaved",
    "time_pair",
]


@dataclass
class Timing:
    """Steady-state median of ``runs`` timed calls and the first call's extra cost (compiles)."""

    median_s: float
    first_call_s: float
    runs: int
    result: object = None  # what the last timed call returned
    best_s: float | None = None  # the fastest timed call: on a loaded host, noise only adds time

    @property
    def warmup_s(self) -> float:
        """What the first call cost beyond a steady one: compilation, caches, lazy set-up."""
        return max(0.0, self.first_call_s - self.median_s)


def time_call(fn: Callable[[], object], repeat: int = 5, budget_s: float = 30.0) -> Timing:
    """Median wall time of ``fn()`` over up to ``repeat`` calls after one untimed warm-up call.

    The warm-up call is timed separately (it carries compilation). Timed calls stop early, after at
    least two, once they have used ``budget_s`` seconds, so that a slow peer does not dominate.
    """
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times: list[float] = []
    result = None
    while len(times) < repeat:
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 2 and sum(times) > budget_s:
            break
    return Timing(statistics.median(times), first, len(times), result)


def time_pair(
    fn_a: Callable[[], object],
    fn_b: Callable[[], object],
    repeat: int = 5,
    budget_s: float = 30.0,
    clock: Callable[[], float] = time.perf_counter,
    min_s: float = 0.0,
) -> tuple[Timing, Timing]:
    """:func:`time_interleaved` of two calls (a, b, b, a, a, b, ...)."""
    return tuple(time_interleaved((fn_a, fn_b), repeat, budget_s, clock, min_s))


def time_interleaved(
    fns: Sequence[Callable[[], object]],
    repeat: int = 5,
    budget_s: float = 30.0,
    clock: Callable[[], float] = time.perf_counter,
    min_s: float = 0.0,
) -> list[Timing]:
    """Time calls interleaved, each round's order rotated by one (a, b, c, then b, c, a, ...) so
    that drifting machine load hits them alike.

    Each gets one untimed warm-up call first (its compile cost is reported as ``warmup_s``).
    Rounds stop early, after at least two, once they have used ``len(fns) · budget_s`` seconds.
    ``min_s``: past ``repeat`` rounds, more until each call has run ``min_s`` seconds in all
    (within the budget), so that calls of a few ms get a median over many rounds rather than a
    burst of the host's memory or CPU contention over five.
    ``clock``: wall time by default; ``time.thread_time`` with one torch thread times the work
    alone, which a loaded shared machine's descheduling leaves out.
    """
    n = len(fns)
    firsts, results = [], [None] * n
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        firsts.append(time.perf_counter() - t0)
    times: list[list[float]] = [[] for _ in fns]
    while len(times[0]) < repeat or min(map(sum, times)) < min_s:
        r = len(times[0])
        for i in [(r + j) % n for j in range(n)]:
            t0 = clock()
            results[i] = fns[i]()
            times[i].append(clock() - t0)
        if len(times[0]) >= 2 and sum(map(sum, times)) > n * budget_s:
            break
    return [
        Timing(statistics.median(ts), first, len(ts), res, best_s=min(ts))
        for ts, first, res in zip(times, firsts, results)
    ]


def matmul_gflops(n: int, repeat: int = 3, dtype=torch.float32) -> float:
    """Best ``n × n`` matmul throughput in GFLOP/s (``2 n³`` FLOPs per product): the ceiling."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g, dtype=dtype)
    b = torch.randn(n, n, generator=g, dtype=dtype)
    with torch.inference_mode():
        a @ b  # warm-up: thread pool, BLAS dispatch
        best = min(_once(lambda: a @ b) for _ in range(repeat))
    return 2 * n**3 / best / 1e9


def copy_rate_gbs(threads: int, mib: int = 512, repeat: int = 5) -> float:
    """This machine's copy rate on ``threads`` torch threads: bytes read plus written per second
    of ``dst.copy_(src)`` over ``mib`` MiB of float32 (preallocated), the fastest of ``repeat``
    (on a loaded host, noise only adds time): the yardstick a memory-bound kernel's bytes per
    second is held against."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * 2**18)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: pages mapped
        times = [_once(lambda: dst.copy_(src)) for _ in range(repeat)]
    finally:
        torch.set_num_threads(before)
    return 2 * src.numel() * src.element_size() / min(times) / 1e9


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's tensors, each storage once (a tied head counts once)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def child_env(threads: int) -> dict:
    """The environment of a benchmark's child process (a server, a worker): ``threads``
    OpenMP threads and this selfattn on its path (also when run from a checkout)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _proc_status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # reported in kB
    except OSError:
        return None
    return None


def reset_peak_rss() -> float:
    """Reset this process's peak RSS to its current RSS where Linux allows; return that RSS (MiB).

    ``ru_maxrss`` cannot serve as a baseline: Linux carries it across ``exec``, so a spawned child
    starts with its parent's peak. ``VmHWM`` in /proc/self/status can be reset (clear_refs "5").
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    rss = _proc_status_mib("VmRSS")
    return rss if rss is not None else peak_rss_mib()


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB (``VmHWM``, else ``ru_maxrss``)."""
    hwm = _proc_status_mib("VmHWM")
    if hwm is not None:
        return hwm
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20  # macOS reports bytes


def _child(conn, fn, args) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()


def run_in_fresh_process(fn: Callable, *args, timeout_s: float = 900.0):
    """``fn(*args)`` in a new spawned interpreter; its return value, or RuntimeError on failure.

    A fresh process gives a clean peak-RSS baseline for each memory measurement and keeps an
    out-of-memory kill from taking the whole benchmark run down with it. ``fn`` must be importable
    (a module-level function).
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            proc.kill()
            raise RuntimeError(f"timed out after {timeout_s:.0f} s")
        status, *payload = parent.recv()
    except EOFError:
        status, payload = "died", []
    proc.join()
    if status == "ok":
        return payload[0]
    if status == "error":
        raise RuntimeError(payload[0])
    hint = " (killed: out of memory?)" if proc.exitcode and proc.exitcode < 0 else ""
    raise RuntimeError(f"child process exited with code {proc.exitcode}{hint}")


def start_server(folder, name: str, threads: int, args=(), *, api_key: str | None = None,
                 timeout_s: float = 180.0):  # fmt: skip
    """``selfattn serve`` of ``folder`` as ``name`` in a process of its own (``threads`` torch
    threads, a free loopback port, ``args`` more flags; ``api_key``: served with that key, which
    the health poll sends); returns ``(process, base URL)`` once ``/health`` answers."""
    import socket
    import subprocess

    from selfattn.serving.server import DEFAULT_HOST, wait_until_healthy

    with socket.socket() as s:
        s.bind((DEFAULT_HOST, 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "selfattn", "serve", str(folder), "--port", str(port),
            "--served-model-name", name, "--log-level", "warning", *args]  # fmt: skip
    if api_key is not None:
        argv += ["--api-key", api_key]
    proc = subprocess.Popen(argv, env=child_env(threads), stdout=subprocess.DEVNULL)
    url = f"http://{DEFAULT_HOST}:{port}"
    try:
        wait_until_healthy(url, timeout_s, proc, api_key=api_key)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url


def stop_process(proc, grace_s: float = 30.0) -> None:
    """End a child process (a server): SIGTERM, then SIGKILL if it has not exited in
    ``grace_s`` seconds; returns once it has exited."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def machine() -> dict:
    """CPU model, cores, torch threads and versions: the header of every benchmark table."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    cpu_capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": cpu_capability,
        "memory_gib": round((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> None:
    """A rich table when stdout is a terminal, aligned plain text otherwise (the CLI's printer)."""
    from selfattn._console import Printer

    Printer().table(columns, rows, title=title)


def verdict(row: dict) -> str:
    """A row's target column: "met", "missed", or "-" where the row has no target."""
    return "-" if "met" not in row else ("met" if row["met"] else "missed")


def print_report(report: dict, as_json: bool, columns: Sequence[str], table, title: str) -> None:
    """Print a benchmark's report: the whole of it as JSON, or its ``setup`` and then the table
    (``table`` is a function of the report giving the rows, so JSON runs skip building it)."""
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return
    print(json.dumps(report["setup"], indent=2))
    print_table(columns, table(report), title=title)
