"""Where the fused C kernel beats SDPA on CPU: cpu_fused, sdpa and chunked on no-mask and causal
calls over a grid of shapes, forward and forward + backward, and what ``auto`` picks for each.

    python -m selfattn.benchmarks.crossover --threads 1     # one thread, CPU time (~10 min)
    python -m selfattn.benchmarks.crossover --threads 2     # two threads, wall time
    python -m selfattn.benchmarks.crossover --full          # also D=128 and B=8 (~1 h)
    python -m selfattn.benchmarks.crossover --quick --json  # a smoke run

Each row times the three backends on the same inputs (``backend=`` forced), interleaved with
the order rotated every round, and keeps each one's best and median; ``ratio`` is cpu_fused's
best over sdpa's. With one thread the clock is the thread's CPU time (``time.thread_time``: the
work alone, steady on a loaded shared host); with more, wall time. ``auto`` is the backend
``sa.backends.explain`` names for the same call (forward + backward rows: q, k, v require grad),
and ``auto ok`` says whether its best time is within ``--margin`` of the fastest's (the setup's
``auto_misses`` counts the rows where it is not, per thread count): the cost model in
``backends/cpu_fused.py`` is fitted to these rows.

The grid (``--S``, ``--chunks``, ``--D``, ``--heads``, ``--B``, ``--dtypes``, ``--threads``;
D=64 and B=1 unless ``--full``):
square calls ``Sq = Sk = S``; decode and prefill chunks ``Sq < Sk`` (a chunk of queries against
a longer cache, causal bottom-right); MHA 8/8 and GQA 32/8 heads. Cases over ``--max-pairs``
(B·Hq·Sq·Sk) are left out.

``--write [PATH]`` fits cpu_fused's cost model to the rows and writes it with the machine's
description (default: the package's ``backends/cpu_fused_fits.json``, which ``auto`` reads).
The rule, per regime (dtype, forward or forward + backward, decode step ``Sq <=
cpu_fused.DECODE_ROWS`` or not): ``per_pair`` is the worst cpu_fused/sdpa ratio among the
regime's large calls (``LARGE_PAIRS`` pairs or more; its largest call where none is) times
``PER_PAIR_MARGIN``, so that a call goes to cpu_fused only where it wins by that margin;
``fixed`` is the median over the regime's other calls of the set-up that ratio leaves
unexplained, ``(ratio - per_pair) · pairs`` in sdpa's pairs (at least 0), which puts the
crossover where the small calls measured it. A regime the run did not measure keeps the file's
fit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import selfattn as sa
from selfattn.benchmarks import _util

BACKENDS = ("cpu_fused", "sdpa", "chunked")
# square S, and (Sq, Sk) prefill chunks / decode steps against a longer cache
SIZES = (16, 64, 128, 256, 512, 1024, 2048, 4096)
CHUNKS = ((1, 256), (1, 1024), (1, 4096), (16, 1024), (64, 4096), (256, 4096))
QUICK_SIZES, QUICK_CHUNKS = (16, 128), ((1, 128), (16, 128))
# B·Hq·Sq·Sk past which a case is left out: 2^28 pairs is B=1, 16 heads, S=4096, the largest
# case whose fp32 forward + backward takes about a second of one thread's time.
MAX_PAIRS = 1 << 28
MARGIN = 0.1  # auto's pick is "ok" within 10 % of the fastest
# --write: calls of at least this many pairs set a regime's per_pair (2^22: S=1024 with 4 heads)
LARGE_PAIRS = 1 << 22
PER_PAIR_MARGIN = 1.05  # per_pair = the worst large-call ratio times this
# the CPU flags that decide which regimes the kernel's fits apply to (cpu_fused.fit)
FIT_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Case:
    mask: str  # "none" or "causal"
    Sq: int
    Sk: int
    D: int
    Hq: int
    Hkv: int
    B: int
    dtype: str  # "fp32" or "bf16"
    backward: bool

    @property
    def pairs(self) -> int:
        return self.B * self.Hq * self.Sq * self.Sk

    def label(self) -> str:
        heads = f"H={self.Hq}" if self.Hq == self.Hkv else f"GQA {self.Hq}/{self.Hkv}"
        return (
            f"{self.dtype} {'fwd+bwd' if self.backward else 'fwd'} {self.mask} B={self.B} "
            f"{heads} Sq={self.Sq} Sk={self.Sk} D={self.D}"
        )


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dt = _DTYPES[case.dtype]
    q = torch.randn(case.B, case.Hq, case.Sq, case.D, generator=g).to(dt)
    k, v = (torch.randn(case.B, case.Hkv, case.Sk, case.D, generator=g).to(dt) for _ in "kv")
    go = torch.randn(case.B, case.Hq, case.Sq, case.D, generator=g).to(dt)
    if case.backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, go


def caller(case: Case, q, k, v, go, backend: str):
    """One timed call: the forward (under no_grad) or the forward and its backward."""
    mask = sa.masks.causal() if case.mask == "causal" else None

    def forward():
        with torch.no_grad():
            return sa.attention(q, k, v, mask=mask, backend=backend)

    def forward_backward():
        for t in (q, k, v):
            t.grad = None
        out = sa.attention(q, k, v, mask=mask, backend=backend)
        out.backward(go)
        return out.detach()

    return forward_backward if case.backward else forward


def measure(case: Case, repeat: int, budget_s: float, clock, margin: float) -> dict:
    q, k, v, go = inputs(case)
    mask = sa.masks.causal() if case.mask == "causal" else None
    auto = sa.backends.explain(q, k, v, mask=mask, print_table=False).chosen
    row = {"case": case.label(), **vars(case), "pairs": case.pairs, "auto": auto}
    timings = _util.time_interleaved(
        [caller(case, q, k, v, go, b) for b in BACKENDS], repeat, budget_s, clock
    )
    for b, t in zip(BACKENDS, timings):
        row[f"{b}_ms"], row[f"{b}_median_ms"] = t.best_s * 1e3, t.median_s * 1e3
    out = {b: t.result.float() for b, t in zip(BACKENDS, timings)}
    row["max_abs_diff"] = float((out["cpu_fused"] - out["sdpa"]).abs().max())
    row["ours_ms"], row["peer_ms"] = row["cpu_fused_ms"], row["sdpa_ms"]
    row["ratio"] = row["ours_ms"] / row["peer_ms"]
    best = min(BACKENDS, key=lambda b: row[f"{b}_ms"])
    row["fastest"] = best
    row["auto_ok"] = auto not in BACKENDS or row[f"{auto}_ms"] <= (1 + margin) * row[f"{best}_ms"]
    return row


def grid(args) -> list[Case]:
    shapes = [(S, S) for S in args.S] + list(args.chunks)
    cases = []
    for dtype, backward, (Hq, Hkv), D, B, (Sq, Sk), mask in itertools.product(
        args.dtypes, args.passes, args.heads, args.D, args.B, shapes, ("none", "causal")
    ):
        c = Case(mask, Sq, Sk, D, Hq, Hkv, B, dtype, backward)
        if c.pairs <= args.max_pairs:
            cases.append(c)
    return cases


def run(args) -> dict:
    rows = []
    start = time.perf_counter()
    for threads in args.threads:
        torch.set_num_threads(threads)
        # one thread: its CPU time is the whole of the work; more: wall time
        clock = time.thread_time if threads == 1 else time.perf_counter
        for case in grid(args):
            row = measure(case, args.repeat, args.budget_s, clock, args.margin)
            row["threads"], row["clock"] = threads, clock.__name__
            rows.append(row)
            print(
                f"[{time.perf_counter() - start:6.1f} s] {threads}t {row['case']}: "
                f"ratio {row['ratio']:.2f}, auto {row['auto']}, fastest {row['fastest']}",
                file=sys.stderr,
                flush=True,
            )
    setup = {
        "repeat": args.repeat,
        "margin": args.margin,
        "timing": "best of interleaved rounds; thread_time with 1 thread, wall time with more",
        "auto_misses": misses(rows),
    }
    return {"machine": _util.machine(), "setup": setup, "rows": rows}


def misses(rows: list[dict]) -> dict[str, str]:
    """Per thread count: on how many rows auto's pick is slower than the fastest by more than
    the margin (the number a cost-model change is judged by)."""
    return {
        f"threads={t}": f"{sum(not r['auto_ok'] for r in rows if r['threads'] == t)} of "
        f"{sum(r['threads'] == t for r in rows)} rows"
        for t in dict.fromkeys(r["threads"] for r in rows)
    }


def table(report: dict) -> list[list[str]]:
    return [
        [str(r["threads"]), r["case"], *(f"{r[f'{b}_ms']:.3f}" for b in BACKENDS),
         f"{r['ratio']:.2f}", r["fastest"], r["auto"], "yes" if r["auto_ok"] else "NO"]
        for r in report["rows"]
    ]  # fmt: skip


def fit_regime(rows: list[dict]) -> tuple[float, float]:
    """``(per_pair, fixed)`` of one regime's rows (module docstring)."""
    large = [r for r in rows if r["pairs"] >= LARGE_PAIRS]
    large = large or [max(rows, key=lambda r: r["pairs"])]
    per_pair = float(f"{max(r['ratio'] for r in large) * PER_PAIR_MARGIN:.2g}")
    small = [r for r in rows if r not in large]
    unexplained = [max(0.0, (r["ratio"] - per_pair) * r["pairs"]) for r in small]
    return per_pair, float(f"{statistics.median(unexplained) if small else 0.0:.2g}")


def fits(rows: list[dict], decode_rows: int) -> dict[tuple[str, bool, bool], dict]:
    """The fit of every regime the rows measured, keyed ``(dtype name, backward, decode)``."""
    regimes: dict[tuple[str, bool, bool], list[dict]] = {}
    for r in rows:
        key = (DTYPE_NAMES[r["dtype"]], r["backward"], r["Sq"] <= decode_rows)
        regimes.setdefault(key, []).append(r)
    found = {}
    for (dtype, backward, decode), group in regimes.items():
        per_pair, fixed = fit_regime(group)
        what = (
            f"{dtype.replace('float', 'fp').replace('bfloat', 'bf')} "
            + ("decode-step " if decode else "")
            + ("forward + backward" if backward else "forward")
        )
        ratios = [
            round(min(r["ratio"] for r in group), 2),
            round(max(r["ratio"] for r in group), 2),
        ]
        found[dtype, backward, decode] = {
            "dtype": dtype, "backward": backward, "decode": decode, "per_pair": per_pair,
            "fixed": fixed, "what": what, "measured_ratios": ratios,
        }  # fmt: skip
    return found


def write_fits(report: dict, path: Path, command: str) -> None:
    """Fit the report's rows and write them, with the machine, over the fits file at ``path``
    (regimes not measured keep the fit ``path`` had, or the package's where it has none)."""
    from selfattn.backends import cpu_fused
    from selfattn.kernels import build

    old = json.loads((path if path.is_file() else cpu_fused.FITS_FILE).read_text())
    merged = {(f["dtype"], f["backward"], f["decode"]): f for f in old["fits"]}
    merged.update(fits(report["rows"], old["decode_rows"]))
    flags = build.cpu_flags()
    machine = report["machine"]
    old["machine"] = {
        "cpu": f"{machine['cpu']}, {machine['cores']} cores",
        "flags": [f for f in FIT_FLAGS if f in flags],
        "no_flags": [f for f in FIT_FLAGS if f not in flags],
        "torch": machine["torch"],
        "date": machine["date"],
        "command": command,
    }
    old["fits"] = list(merged.values())
    path.write_text(json.dumps(old, indent=1) + "\n")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    """``"1x256,16x1024"`` -> ((1, 256), (16, 1024)); empty: none."""
    return tuple(_ints(p.replace("x", ",")) for p in text.split(",") if p)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two small sizes: a smoke run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--repeat", type=int, default=3, help="rounds per case (3)")
    p.add_argument("--budget-s", type=float, default=3.0, help="per backend and case (3 s)")
    p.add_argument("--full", action="store_true", help="D 64,128 and B 1,8 (default 64 and 1)")
    p.add_argument("--threads", type=_ints, default=(1,), help="torch threads, e.g. 1,2 (1)")
    p.add_argument("--S", type=_ints, default=SIZES, help="square sizes Sq = Sk")
    p.add_argument("--chunks", type=str, default=None, help="Sq x Sk cases, e.g. 1x4096,64x4096")
    p.add_argument("--D", type=_ints, default=None, help="head dims (64; --full 64,128)")
    p.add_argument("--heads", type=str, default="8/8,32/8", help="Hq/Hkv pairs (8/8,32/8)")
    p.add_argument("--B", type=_ints, default=None, help="batch sizes (1; --full 1,8)")
    p.add_argument("--dtypes", type=str, default="fp32,bf16", help="fp32,bf16")
    p.add_argument("--passes", type=str, default="fwd,fwdbwd", help="fwd,fwdbwd")
    p.add_argument("--max-pairs", type=int, default=MAX_PAIRS, help="B·Hq·Sq·Sk cap (2^28)")
    p.add_argument("--margin", type=float, default=MARGIN, help="auto ok within (0.1)")
    p.add_argument("--write", nargs="?", const="", default=None, metavar="PATH",
                   help="fit cpu_fused's costs to the rows and write them to PATH (default: the "
                   "package's backends/cpu_fused_fits.json, which auto reads)")  # fmt: skip
    args = p.parse_args(argv)
    if args.D is None:
        args.D = (64, 128) if args.full else (64,)
    if args.B is None:
        args.B = (1, 8) if args.full else (1,)
    args.heads = tuple(tuple(int(h) for h in x.split("/")) for x in args.heads.split(","))
    args.dtypes = tuple(args.dtypes.split(","))
    args.passes = tuple(x == "fwdbwd" for x in args.passes.split(","))
    if args.quick:
        args.S, chunks, args.D, args.B, args.repeat = QUICK_SIZES, QUICK_CHUNKS, (64,), (1,), 2
        args.heads = ((4, 2),)
    else:
        chunks = CHUNKS
    args.chunks = chunks if args.chunks is None else _pairs(args.chunks)
    report = run(args)
    columns = ["threads", "case", *(f"{b} ms" for b in BACKENDS), "fused/sdpa", "fastest",
               "auto", "auto ok"]  # fmt: skip
    _util.print_report(report, args.json, columns, table, "cpu_fused vs sdpa vs chunked")
    if args.write is not None:
        from selfattn.backends import cpu_fused

        path = Path(args.write) if args.write else cpu_fused.FITS_FILE
        command = " ".join(["python -m selfattn.benchmarks.crossover", *(argv or sys.argv[1:])])
        write_fits(report, path, command)
        print(f"fits written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
