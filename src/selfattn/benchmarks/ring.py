"""Ring attention on W local processes against one process: time, bytes, memory, balance.

    python -m selfattn.benchmarks.ring                 # gloo on CPU, W = 2 and 4, S = 16384
    python -m selfattn.benchmarks.ring --quick         # S = 1024, ring and allgather: a smoke
    python -m selfattn.benchmarks.ring --methods ring allgather     # both methods at full size
    python -m selfattn.benchmarks.ring --backend nccl  # one GPU per rank (cuda:rank)

The script runs unchanged with ``--backend nccl`` on a multi-GPU machine (ranks use ``cuda:rank``,
memory is ``torch.cuda.max_memory_allocated``, timings synchronise the device); all ranks run on
this machine (a FileStore in a temporary folder), so W is at most the number of GPUs there.

Every configuration runs in fresh processes: one call measures memory and bytes, ``--repeat``
more are timed. On a 2-core CPU one S = 16384 causal forward + backward takes about a minute, so
the full run (5 configurations) takes 10-20 minutes.

Each row is one causal self-attention forward + backward of ``(B, H, S, D)`` fp32 q, k, v cut
across W processes by ``shard_sequence`` and computed by ``ring_attention``; ``W = 1`` is
``selfattn.attention`` on the whole sequence in one process, measured in the same run. Columns:

- ``fwd+bwd s``: median wall time over ranks' slowest (the ring is as fast as its slowest rank);
  CPU ranks get ``cores // W`` threads each, so the total is the same machine.
- ``sent/rank``: bytes each rank posts in the forward, over the bytes of the whole K/V; the
  theory is ``(W-1)/W`` (every shard but its own passes through). The backward sends K/V once
  more and dK/dV (float32) W times.
- ``peak act/rank``: peak memory of forward + backward above the inputs (peak RSS on CPU); the
  target is about ``1/W`` of one process.
- ``spread``: ``(max - min) / mean`` over ranks of the time spent computing attention blocks
  (target <= 10% for zigzag), and the same for the causal work (allowed pairs) each rank does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from selfattn.benchmarks import _util


def _theory_work(layout: str, S: int, W: int, rank: int) -> int:
    """Allowed causal (query, key) pairs in the blocks ``rank`` computes."""
    from selfattn.distributed import segments

    total = 0
    for gq, n in segments(S, layout, rank, W):
        rows = torch.arange(gq, gq + n)
        total += int((rows + 1).sum())  # causal: row i sees keys 0..i, wherever they live
    return total


def _rank_main(rank: int, args, W: int, method: str, layout: str, store: str, out: str) -> None:
    """One rank of one configuration, in a fresh process (so that its peak memory is its own)."""
    import selfattn as sa
    import selfattn.distributed.ring as ring_mod
    from selfattn.distributed import ring_attention, shard_sequence

    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // W))
        device = torch.device("cpu")
    dist.init_process_group(args.backend, init_method=f"file://{store}", rank=rank, world_size=W)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # -- spies: the bytes the ring posts and the time spent in attention blocks ----------------
    sent, compute = [0], [0.0]
    post, attend, all_gather = ring_mod._post, ring_mod.attend, dist.all_gather

    def counting_post(ops, group, batched):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                       if op.op is dist.isend)  # fmt: skip
        return post(ops, group, batched)

    def counting_all_gather(parts, t, group=None, **kw):
        sent[0] += t.numel() * t.element_size() * (W - 1)  # each shard reaches W - 1 peers
        return all_gather(parts, t, group=group, **kw)

    def timed_attend(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = attend(*a, **kw)
        sync()
        compute[0] += time.perf_counter() - t0
        return out

    ring_mod._post, ring_mod.attend = counting_post, timed_attend
    dist.all_gather = counting_all_gather  # this process only runs this benchmark

    g = torch.Generator().manual_seed(0)
    shape = (args.B, args.H, args.S, args.D)
    ql, kl, vl, dl = (
        shard_sequence(torch.randn(shape, generator=g), layout, dim=2).to(device).contiguous()
        for _ in range(4)
    )
    for t in (ql, kl, vl):
        t.requires_grad_(True)

    def step():
        out = ring_attention(ql, kl, vl, mask=sa.masks.causal(), layout=layout, method=method)
        fwd_bytes = sent[0]
        out.backward(dl)
        sync()
        return fwd_bytes

    # A tiny call first: lazy imports and first-use set-up would otherwise count as activations.
    tiny = [t[:, :, :2].detach().requires_grad_(True) for t in (ql, kl, vl)]
    ring_attention(*tiny, mask=sa.masks.causal(), layout=layout, method=method).sum().backward()
    sent[0] = 0
    # The first real call measures memory and bytes: a fresh process, so its peak is its own.
    dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _util.reset_peak_rss()
    fwd_bytes = step()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _util.peak_rss_mib()
    times, computes = [], []
    for _ in range(args.repeat):
        for t in (ql, kl, vl):
            t.grad = None
        dist.barrier()
        compute[0] = 0.0
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        computes.append(compute[0])
    results = {
        "time_s": statistics.median(times),
        "compute_s": statistics.median(computes),
        "peak_mib": peak - base,
        "fwd_bytes": fwd_bytes,
        "work": _theory_work(layout, args.S, W, rank) * args.B * args.H,
    }
    gathered = [None] * W
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()


def _spread(values) -> float:
    mean = statistics.mean(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def _configs(args):
    yield 1, "ring", "contiguous"  # one process: selfattn.attention on the whole sequence
    for W in args.world:
        for method in args.methods:
            for layout in args.layouts:
                yield W, method, layout


# Imported once by the forkserver that starts every rank (a fresh process per configuration, so
# that each peak memory is its own, without paying torch's import each time). It runs no torch
# op, so CUDA is not initialised before the fork.
_PRELOAD = [
    "torch",
    "selfattn.distributed",
    "selfattn.backends.chunked",
    "selfattn.backends.sdpa",
    "selfattn.backends.flex",
    "torch.fx.experimental.symbolic_shapes",
]


def run(args) -> list[list[str]]:
    mp.set_forkserver_preload(_PRELOAD)
    kv_bytes = 2 * args.B * args.H * args.S * args.D * 4  # fp32 K and V, whole sequence
    res = {}
    with tempfile.TemporaryDirectory(prefix="selfattn-ring-") as tmp:
        for i, (W, method, layout) in enumerate(_configs(args)):
            store, out = os.path.join(tmp, f"store{i}"), os.path.join(tmp, f"result{i}.pt")
            mp.start_processes(
                _rank_main,
                args=(args, W, method, layout, store, out),
                nprocs=W,
                start_method="forkserver",
            )
            res[W, method, layout] = torch.load(out, weights_only=False)
    one = res[1, "ring", "contiguous"][0]
    rows = [["1", "—", "attention", f"{one['time_s']:.3f}", "1.00", "0", "0", "—",
             f"{one['peak_mib']:.0f}", "1.00", "1", "—", "—"]]  # fmt: skip
    for W, method, layout in list(_configs(args))[1:]:
        rs = res[W, method, layout]
        t = max(r["time_s"] for r in rs)
        sent = max(r["fwd_bytes"] for r in rs)
        peak = max(r["peak_mib"] for r in rs)
        rows.append(
            [
                str(W),
                layout,
                method,
                f"{t:.3f}",
                f"{t / one['time_s']:.2f}",
                f"{sent / 2**20:.1f} MiB",
                f"{sent / kv_bytes:.3f}",
                f"{(W - 1) / W:.3f}",
                f"{peak:.0f}",
                f"{peak / one['peak_mib']:.2f}" if one["peak_mib"] > 0 else "—",
                f"{1 / W:.2f}",
                f"{_spread([r['compute_s'] for r in rs]):.0%}",
                f"{_spread([r['work'] for r in rs]):.0%}",
            ]
        )
    return rows


COLUMNS = [
    "W",
    "layout",
    "method",
    "fwd+bwd s",
    "vs 1 proc",
    "sent/rank (fwd)",
    "÷ K/V bytes",
    "theory (W-1)/W",
    "peak act MiB/rank",
    "vs 1 proc",
    "target 1/W",
    "compute spread",
    "work spread",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="S = 1024, one timed call: a smoke run")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="process counts (2 4)")
    p.add_argument("--S", type=int, default=16384, help="global sequence length (16384)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1, help="timed calls per row, after the first")
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"])
    p.add_argument(
        "--methods", nargs="+", default=None, help="ring and/or allgather (ring; both with --quick)"
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON on stdout")
    args = p.parse_args(argv)
    if args.quick:
        args.S = 1024
    if args.methods is None:
        args.methods = ["ring", "allgather"] if args.quick else ["ring"]
    if args.backend == "nccl" and max(args.world) > torch.cuda.device_count():
        p.error(f"--world {max(args.world)} needs that many GPUs; {torch.cuda.device_count()} here")
    for W in args.world:
        if args.S % (2 * W):
            p.error(f"--S {args.S} must be divisible by 2·W = {2 * W} (zigzag)")
    rows = run(args)
    info = _util.machine()
    if args.json:  # the table's cells as printed (two columns share a name: rows are lists)
        print(json.dumps({"machine": info, "columns": COLUMNS, "rows": rows}, indent=2))
        return 0
    quick = " [--quick]" if args.quick else ""
    print(
        f"\nring attention: causal fwd+bwd, B={args.B} H={args.H} S={args.S} "
        f"D={args.D} fp32, backend {args.backend}{quick}"
    )
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['date']}\n")
    for r in (COLUMNS, ["---"] * len(COLUMNS), *rows):
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
