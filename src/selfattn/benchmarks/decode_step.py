"""Where one decode step of our decoder spends its time: matrix products, attention, the rest.

    .venv/bin/python benchmarks/decode_step.py                       # paged and static, B=1 and 8
    .venv/bin/python benchmarks/decode_step.py --cache paged --batch 8 --json
    .venv/bin/python benchmarks/decode_step.py --quick               # tiny model: a smoke run

The Llama-shaped decoder of ``benchmarks/models.py`` (12 layers, d=768, GQA 12/4; random weights,
our model only) prefills a random 512-token prompt through ``model.make_cache(kind, B, ...)``,
then runs single-token decode steps. Per step (median of ``--steps``):

- ``step``: wall time of ``model(token, cache=cache)`` without a profiler;
- ``cpu``: the same steps' CPU time on the calling thread: with ``--threads 1`` every op runs
  there, so this is the step's work without the time the host took the CPU away (this
  session's host stalls for seconds at random, which inflates every wall-clock column);
- ``matmul``: self time of the matrix-product ops (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``)
  under ``torch.profiler``;
- ``ops``: self time of every other op (aten ops and the C decode kernel): elementwise work,
  copies, the attention kernels;
- ``python``: the profiled step's wall time minus all op time: the interpreter running our
  Python (cache bookkeeping, argument checks, mask objects) between ops. Planning the paged KV
  once per step cuts this part;
- ``attention``: inclusive time of the attention calls (``selfattn.functional.attention`` and
  ``paged_attention``: kernels, their ops and their Python), for reference.

Comparing two versions of the library: run this script with each on ``PYTHONPATH``, interleaved,
and compare the medians (the machine is noisy: repeat).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time

import torch

from selfattn.benchmarks import _util

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION_LABEL = "attention call"
KERNEL_LABEL = "decode kernel"  # the C kernel runs through ctypes: no aten op records it

LLAMA = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}
QUICK = {**LLAMA, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 172}
QUICK.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@contextlib.contextmanager
def labelled_attention():
    """Wrap the attention entry points in a profiler label (restored on exit)."""
    try:  # where the paged layers call paged_attention (a module of its own in newer trees)
        paged_mod = importlib.import_module("selfattn.cache.paged.layer")
    except ImportError:
        paged_mod = importlib.import_module("selfattn.cache.paged")
    import selfattn.nn.attention as nn_mod

    patched = [
        (paged_mod, "paged_attention", ATTENTION_LABEL),
        (nn_mod, "attention", ATTENTION_LABEL),
    ]
    # The C kernel's call: ``_launch`` (the ctypes call itself, which decode() and a planned
    # step's Launch both make), else the older trees' Python entry point ``decode`` (its module
    # moved from cache/ to kernels/).
    for name in ("selfattn.kernels.paged_decode", "selfattn.cache._decode_kernels"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        entry = "_launch" if hasattr(module, "_launch") else "decode"
        patched.append((module, entry, KERNEL_LABEL))
        break
    originals = [getattr(m, name) for m, name, _ in patched]

    def labelled(fn, label):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return call

    for (m, name, label), fn in zip(patched, originals):
        setattr(m, name, labelled(fn, label))
    try:
        yield
    finally:
        for (m, name, _), fn in zip(patched, originals):
            setattr(m, name, fn)


def build(quick: bool):
    from selfattn.models.decoder import Llama

    torch.manual_seed(0)
    return Llama.from_config(QUICK if quick else LLAMA).eval()


@torch.no_grad()
def measure(model, kind: str, B: int, prompt: int, steps: int, page_size: int) -> dict:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(B)
    ids = torch.randint(0, vocab, (B, prompt), generator=g)
    tokens = torch.randint(0, vocab, (B, 2 * steps + 2), generator=g)
    cache = model.make_cache(kind, B, prompt + 2 * steps + 2, page_size=page_size)
    model(ids, cache=cache, logits_to_keep=1)
    model(tokens[:, :1], cache=cache)  # warm-up decode step
    walls, cpus = [], []
    for t in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        model(tokens[:, t + 1 : t + 2], cache=cache)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    step_s = statistics.median(walls)
    acts = [torch.profiler.ProfilerActivity.CPU]
    with labelled_attention(), torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for t in range(steps):
            model(tokens[:, steps + t + 1 : steps + t + 2], cache=cache)
        profiled_s = (time.perf_counter() - t0) / steps
    events = prof.key_averages()

    def per_step(total_us: float) -> float:
        return total_us / 1e6 / steps * 1e3  # ms

    matmul = per_step(sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS))
    ops = [e for e in events if e.key.startswith("aten::") and e.key not in MATMUL_OPS]
    kernel = [e for e in events if e.key == KERNEL_LABEL]
    other = per_step(
        sum(e.self_cpu_time_total for e in ops) + sum(e.cpu_time_total for e in kernel)
    )
    attn = per_step(sum(e.cpu_time_total for e in events if e.key == ATTENTION_LABEL))
    return {
        "cache": kind,
        "batch": B,
        "prompt": prompt,
        "step_ms": step_s * 1e3,
        "cpu_ms": statistics.median(cpus) * 1e3,
        "matmul_ms": matmul,
        "ops_ms": other,
        "python_ms": profiled_s * 1e3 - matmul - other,
        "attention_ms": attn,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", choices=("static", "paged", "window"), action="append")
    p.add_argument("--batch", type=int, action="append")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="decode steps per measurement (20)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="tiny model, short prompt: smoke run")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = 16 if args.quick else args.prompt
    steps = 3 if args.quick else args.steps
    model = build(args.quick)
    rows = [
        measure(model, kind, B, prompt, steps, args.page_size)
        for kind in args.cache or ("paged", "static")
        for B in args.batch or (1, 8)
    ]
    if args.json:
        json.dump({"machine": _util.machine(), "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    cols = ["cache", "B", "step", "cpu", "matmul", "ops", "python", "attention"]
    keys = ("step_ms", "cpu_ms", "matmul_ms", "ops_ms", "python_ms", "attention_ms")
    table = [[r["cache"], str(r["batch"])] + [f"{r[k]:.2f} ms" for k in keys] for r in rows]
    m = _util.machine()
    title = f"decode step, prompt {prompt}, fp32 ({m['cpu']}, {m['torch_threads']} threads)"
    _util.print_table(cols, table, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
