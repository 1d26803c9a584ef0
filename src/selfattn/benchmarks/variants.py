"""The cost of the attention variants (sinks, MLA, ...) against the same call without them, on CPU.

    python -m selfattn.benchmarks.variants            # every section
    python -m selfattn.benchmarks.variants --quick    # smaller shapes: a smoke run
    python -m selfattn.benchmarks.variants --only sinks --json
    python -m selfattn.benchmarks.variants --cpu-time # one thread, its CPU time: a loaded host

One function per variant (``SECTIONS``), each returning its rows: ``section``, ``case``,
``peer`` (the same call without the variant), ``ours_ms`` / ``peer_ms`` (the best of the timed
calls, interleaved with each side first in every other round after one warm-up each: on a loaded
host noise only adds time, so the best is the steadiest figure of a small ratio), their medians
``ours_median_ms`` / ``peer_median_ms``, ``ratio`` = ours / peer (best), ``target`` and ``met``.

``sinks``: learned attention sinks (gpt-oss) on the chunked path (forward, and forward +
backward), on sdpa (inference: sinks run through its CPU flash kernel's lse) and in the paged
decode kernel. Targets: <= 1.05x on the dense paths, <= 1.1x in the decode kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import selfattn as sa
from selfattn.benchmarks import _util
from selfattn.benchmarks.decode import make_cache
from selfattn.cache import paged_attention
from selfattn.testing import make_qkv

DENSE_TARGET, DECODE_TARGET = "<= 1.05", "<= 1.1"


def _row(section, case, peer, ours: _util.Timing, theirs: _util.Timing, target) -> dict:
    ratio = ours.best_s / theirs.best_s
    op, limit = target.split()
    met = ratio <= float(limit) if op == "<=" else ratio >= float(limit)
    return dict(
        section=section, case=case, peer=peer, ours_ms=ours.best_s * 1e3,
        peer_ms=theirs.best_s * 1e3, ours_median_ms=ours.median_s * 1e3,
        peer_median_ms=theirs.median_s * 1e3, ratio=ratio, target=target, met=met,
    )  # fmt: skip


def sinks(quick: bool, repeat: int, clock=time.perf_counter) -> list[dict]:
    """Sinks vs the same call without: chunked fwd and fwd+bwd, sdpa inference, the C decode
    kernel (fp32; causal prefill B=1, Hq=16, Hkv=4, D=64, S=2048, quick 512)."""
    S = 512 if quick else 2048
    q, k, v = make_qkv(1, 16, S, 64, Hkv=4, seed=0)
    s = torch.randn(16)
    causal = sa.masks.causal()
    rows = []
    for backend in ("chunked", "sdpa"):
        with torch.inference_mode():
            a, b = _util.time_pair(
                lambda be=backend: sa.attention(q, k, v, mask=causal, sinks=s, backend=be),
                lambda be=backend: sa.attention(q, k, v, mask=causal, backend=be),
                repeat,
                clock=clock,
            )
        rows.append(_row("sinks", f"{backend} forward, causal S={S}", "no sinks", a, b,
                         DENSE_TARGET))  # fmt: skip
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    sg = s.clone().requires_grad_(True)

    def step(with_sinks):
        out = sa.attention(qg, kg, vg, mask=causal, sinks=sg if with_sinks else None,
                           backend="chunked")  # fmt: skip
        out.sum().backward()

    a, b = _util.time_pair(lambda: step(True), lambda: step(False), repeat, clock=clock)
    rows.append(_row("sinks", f"chunked forward+backward, causal S={S}", "no sinks", a, b,
                     DENSE_TARGET))  # fmt: skip
    B, ctx = (4, 512) if quick else (32, 4096)
    qd, kp, vp, table, lens, _, _ = make_cache(B, ctx, torch.float32)
    sd = torch.randn(qd.shape[1])
    with torch.inference_mode():
        a, b = _util.time_pair(
            lambda: paged_attention(qd, kp, vp, table, lens, sinks=sd),
            lambda: paged_attention(qd, kp, vp, table, lens),
            repeat,
            clock=clock,
        )
    rows.append(_row("sinks", f"paged decode B={B}, {ctx} tokens", "no sinks", a, b,
                     DECODE_TARGET))  # fmt: skip
    return rows


SECTIONS = {"sinks": sinks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes: a smoke run")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--repeat", type=int, default=15, help="timed calls per side (15)")
    p.add_argument("--only", choices=sorted(SECTIONS), action="append", help="sections to run")
    p.add_argument(
        "--threads", type=int, help="torch threads (default torch's); 1 steadies a shared machine"
    )
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="one torch thread, timed by its CPU time (time.thread_time): the work alone, "
        "steady on a loaded shared machine",
    )
    args = p.parse_args(argv)
    clock = time.perf_counter
    if args.cpu_time:
        args.threads, clock = 1, time.thread_time  # one thread: its CPU time is all the work
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = [
        r for name in args.only or SECTIONS for r in SECTIONS[name](args.quick, args.repeat, clock)
    ]
    if args.json:
        json.dump({"machine": _util.machine(), "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    table = [
        [r["section"], r["case"], f"{r['ours_ms']:.2f}", r["peer"], f"{r['peer_ms']:.2f}",
         f"{r['ratio']:.3f}", r["target"], "met" if r["met"] else "missed"]
        for r in rows
    ]  # fmt: skip
    m = _util.machine()
    _util.print_table(
        ["section", "case", "ours ms", "peer", "peer ms", "ratio", "target", "met?"],
        table,
        title=f"variants vs the same call without ({m['cpu']}, torch {m['torch']}, "
        f"{torch.get_num_threads()} thread(s), {'CPU' if args.cpu_time else 'wall'} time)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
