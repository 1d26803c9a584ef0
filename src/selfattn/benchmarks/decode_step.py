"""Where one decode step of our decoder spends its time: matrix products, attention, the rest.

    python -m selfattn.benchmarks.decode_step                         # paged and static, B=1, 8
    python -m selfattn.benchmarks.decode_step --cache paged --batch 8 --json
    python -m selfattn.benchmarks.decode_step --quick                 # tiny model: a smoke run
    python -m selfattn.benchmarks.decode_step --model smollm2 --cache paged --cache engine \
        --batch 1 --dtype bf16 [--dequantize]                         # the bundled chat model
    python -m selfattn.benchmarks.decode_step --model smollm2 --single-stream 3

The Llama-shaped decoder of ``benchmarks/models.py`` (12 layers, d=768, GQA 12/4; random weights,
our model only) prefills a random 512-token prompt through ``model.make_cache(kind, B, ...)``,
then runs single-token decode steps. Per step (median of ``--steps``):

- ``step``: wall time of ``model(token, cache=cache)`` without a profiler;
- ``cpu``: the same steps' CPU time on the calling thread: with ``--threads 1`` every op runs
  there, so this is the step's work without the time the host took the CPU away (a shared
  host can stall for seconds at random, which inflates every wall-clock column);
- ``matmul``: self time of the matrix-product ops (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``)
  under ``torch.profiler``;
- ``ops``: self time of every other op (aten ops and the C decode kernel): elementwise work,
  copies, the attention kernels;
- ``python``: the profiled step's wall time minus all op time: the interpreter running our
  Python (cache bookkeeping, argument checks, mask objects) between ops. Planning the paged KV
  once per step cuts this part;
- ``attention``: inclusive time of the attention calls (``selfattn.functional.attention`` and
  ``paged_attention``: kernels, their ops and their Python), for reference.

- ``overhead``: the step's time outside the matrix products (``aten::linear`` / ``mm`` /
  ``addmm`` / ``bmm`` and a quantised linear's forward, inclusive) and the attention kernel (the
  C decode kernel's call, or PyTorch's attention ops), as a share of the fastest profiled step
  (the least disturbed: a loaded host only adds time; the profiler's own cost per op counts as
  overhead, so this is an upper bound): Python, small ops, the cache's bookkeeping, sampling
  (``engine`` rows). The target is <= 15 %. ``matmul (incl)``, ``attn kernel``: that step's.
- ``overhead (cpu)``: the same share in thread CPU time (with ``--threads 1``: a loaded host's
  preemption left out): the step's CPU time less the model's projections replayed alone
  (``matmul (cpu)``) and every layer's attention replayed alone (``attn (cpu)``: the paged
  kernel over the step's context, its call included). The one measure where the blocks run as
  one C call, which the profiler cannot split.
- ``ops``: the aten ops a step dispatches (outermost ones: each costs its dispatch however
  small its work).

``--cache engine`` times a single-stream decode step of :class:`~selfattn.serving.Engine`
(``engine.step()``: planning the packed step, the model, sampling, the request's bookkeeping).
``--single-stream N``: decode tokens per second of one request, ``generate`` (static and paged
cache) against the Engine, ``N`` interleaved rounds, medians.

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
STEP_LABEL = "decode step"  # one profiled step
QUANT_LABEL = "quantised linear"  # QuantizedLinear.forward: its kernel and any dequantising
# Every block of a step as one C call (decode_fast.native_blocks): the projections with their
# fused norms, RoPE, SwiGLU and residuals, and the attention kernel; counted as matrix products
BLOCKS_LABEL = "blocks kernel"
# the outermost of these events is a matrix product (inclusive time), of these attention
MATMUL_EVENTS = frozenset(
    (*MATMUL_OPS, "aten::linear", "aten::matmul", "aten::_weight_int4pack_mm_for_cpu",
     "aten::_weight_int8pack_mm", QUANT_LABEL, BLOCKS_LABEL)
)  # fmt: skip
ATTENTION_EVENTS = frozenset(
    (KERNEL_LABEL, "aten::scaled_dot_product_attention",
     "aten::_scaled_dot_product_flash_attention_for_cpu")
)  # fmt: skip

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
    quant = importlib.import_module("selfattn.nn.quant")
    if hasattr(quant, "QuantizedLinear"):  # a class attribute: looked up at each call
        patched.append((quant.QuantizedLinear, "forward", QUANT_LABEL))
    fast = importlib.import_module("selfattn.models.decode_fast")
    if hasattr(fast, "native_blocks"):  # the call it returns is labelled, not the preparing
        patched.append((fast, "native_blocks", None))
    originals = [getattr(m, name) for m, name, _ in patched]

    def labelled(fn, label):
        if label is None:  # a maker of the step's call: label what it makes

            def make(*args, **kwargs):
                run = fn(*args, **kwargs)
                return None if run is None else labelled(run, BLOCKS_LABEL)

            return make

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


def build(quick: bool, model: str = "llama", dtype: str = "fp32", dequantize: bool = False):
    """The benchmark's model: the random Llama shape, or the bundled SmolLM2 chat model (kept
    quantised unless ``dequantize``) in ``dtype``."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if model == "smollm2":
        from selfattn.models.bundled import chat_model_path
        from selfattn.models.hub import from_pretrained

        return from_pretrained(chat_model_path(), dtype=dt, quantized=not dequantize).eval()
    from selfattn.models.decoder import Llama

    torch.manual_seed(0)
    return Llama.from_config(QUICK if quick else LLAMA).eval().to(dt)


def split_steps(events) -> list[tuple[float, float, float, int]]:
    """``(step, matmul, attention, ops)`` of each profiled step (a :data:`STEP_LABEL` event of
    ``prof.events()``): the step's inclusive µs, that of each outermost event of
    :data:`MATMUL_EVENTS` / :data:`ATTENTION_EVENTS` inside it, and its outermost aten ops (the
    ops the step dispatches from Python)."""

    def walk(e, totals):
        if e.name.startswith("aten::"):
            totals[2] += 1
        if e.name in MATMUL_EVENTS:
            totals[0] += e.cpu_time_total
        elif e.name in ATTENTION_EVENTS:
            totals[1] += e.cpu_time_total
        elif not e.name.startswith("aten::"):
            for c in e.cpu_children:
                walk(c, totals)
        return totals

    return [(e.cpu_time_total, *walk(e, [0.0, 0.0, 0]))
            for e in events if e.name == STEP_LABEL]  # fmt: skip


class _EngineSteps:
    """Single-stream decode steps of an Engine: one greedy request, prefilled; ``step()`` is
    one ``engine.step()``, the request renewed when it ends."""

    def __init__(self, model, prompt: int, page_size: int, seed: int):
        from selfattn.serving import Engine, SamplingParams

        c = model.config
        self.engine = Engine(model, page_size=page_size, kv_cache_bytes=_pool_bytes(c, 4096))
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, c.vocab_size, (prompt,), generator=g).tolist()
        self.params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
        self._start()

    def _start(self):
        self.engine.add_request(self.ids, self.params)
        while not self.engine.scheduler.running or self._prefilling():
            self.engine.step()

    def _prefilling(self) -> bool:
        return any(s.num_computed < len(s.tokens) - 1 for s in self.engine.scheduler.running)

    def step(self, _token=None):
        if not self.engine.has_unfinished():
            self._start()
        self.engine.step()


def _pool_bytes(c, tokens: int) -> int:
    from selfattn.cache import kv_cache_bytes

    return kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, tokens, "fp32")


@torch.no_grad()
def measure(model, kind: str, B: int, prompt: int, steps: int, page_size: int) -> dict:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(B)
    ids = torch.randint(0, vocab, (B, prompt), generator=g)
    tokens = torch.randint(0, vocab, (B, 2 * steps + 2), generator=g)
    if kind == "engine":  # one request: the engine's own step, sampling included
        if B != 1:
            raise SystemExit("--cache engine times a single stream: pass --batch 1")
        run = _EngineSteps(model, prompt, page_size, seed=B).step
    else:
        cache = model.make_cache(kind, B, prompt + 2 * steps + 2, page_size=page_size)
        model(ids, cache=cache, logits_to_keep=1)

        def run(token):
            model(token, cache=cache)

    run(tokens[:, :1])  # warm-up decode step
    walls, cpus = [], []
    for t in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        run(tokens[:, t + 1 : t + 2])
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    step_s = statistics.median(walls)
    acts = [torch.profiler.ProfilerActivity.CPU]
    with labelled_attention(), torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for t in range(steps):
            with torch.profiler.record_function(STEP_LABEL):
                run(tokens[:, steps + t + 1 : steps + t + 2])
        profiled_s = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    # The least disturbed profiled step (a loaded host only adds time): its shares
    least = min(split_steps(prof.events()))
    step_ms, mm_ms, kernel_ms = (x / 1e3 for x in least[:3])
    overhead_ms = step_ms - mm_ms - kernel_ms
    # In CPU time (a loaded host's preemption left out; --threads 1 runs every op on this
    # thread): the step's projections replayed alone, attention at the profiled step's ratio
    # to them, and the rest of the step's CPU time.
    cpu_ms = statistics.median(cpus) * 1e3
    mm_cpu = projections_cpu_ms(model, B)
    att_cpu = attention_cpu_ms(model, B, prompt + steps, page_size)

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
        "matmul_incl_ms": mm_ms,
        "kernel_ms": kernel_ms,
        "overhead_ms": overhead_ms,
        "profiled_step_ms": step_ms,
        "overhead_pct": 100 * overhead_ms / step_ms,
        "matmul_cpu_ms": mm_cpu,
        "aten_ops": least[3],
        "attention_cpu_ms": att_cpu,
        "overhead_cpu_pct": 100 * (cpu_ms - mm_cpu - att_cpu) / cpu_ms,
    }


def projections_cpu_ms(model, B: int, repeat: int = 5) -> float:
    """Thread CPU time of one token through every projection of ``model`` (each block's
    linears and the LM head, ``nn.Linear`` or quantised) replayed alone: the least of
    ``repeat`` passes."""
    from selfattn.nn import QuantizedLinear

    dtype = model.norm.weight.dtype
    lins = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    xs = [torch.randn(B, 1, m.in_features, dtype=dtype) for m in lins]
    best = float("inf")
    for _ in range(repeat):
        c0 = time.thread_time()
        for m, x in zip(lins, xs):
            m(x)
        best = min(best, time.thread_time() - c0)
    return best * 1e3


def attention_cpu_ms(model, B: int, context: int, page_size: int, repeat: int = 5) -> float:
    """Thread CPU time of one decode token's attention in every layer of ``model`` replayed
    alone: ``paged_attention`` over ``context`` keys per sequence (random pages of the model's
    dtype and shapes, one pool per layer, a shuffled block table, causal) through one plan, as a
    planned step's layers call it: the least of ``repeat`` passes. Its Python call counts, so
    this is an upper bound on the kernel's time."""
    from selfattn import masks
    from selfattn.cache import PagedAttentionPlan
    from selfattn.functional import paged_attention

    c, dtype = model.config, model.norm.weight.dtype
    g = torch.Generator().manual_seed(context)
    n = -(-context // page_size)  # pages a sequence
    pools = [
        tuple(torch.randn(B * n, page_size, c.n_kv_heads, dim, generator=g).to(dtype)
              for dim in (c.head_dim, c.value_dim))
        for _ in range(c.n_layers)
    ]  # fmt: skip
    table = torch.randperm(B * n, generator=g).to(torch.int32).view(B, n)
    lens = torch.full((B,), context, dtype=torch.int32)
    q = torch.randn(B, c.n_heads, 1, c.head_dim, generator=g).to(dtype)
    plan, mask = PagedAttentionPlan(table, lens), masks.causal()
    best = float("inf")
    for _ in range(repeat):
        c0 = time.thread_time()
        for kp, vp in pools:
            paged_attention(q, kp, vp, table, lens, mask=mask, plan=plan)
        best = min(best, time.thread_time() - c0)
    return best * 1e3


@torch.no_grad()
def single_stream(model, prompt: int, new: int, rounds: int, page_size: int) -> dict:
    """Decode tokens per second of one greedy request: ``generate`` with its static and its
    paged cache, and the Engine; ``rounds`` interleaved rounds, medians. A round times
    ``new + 1`` tokens less one token (the prefill and first token cancel out)."""
    from selfattn.models.generate import generate
    from selfattn.serving import Engine, SamplingParams

    c = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (1, prompt), generator=g)
    engine = Engine(model, page_size=page_size, kv_cache_bytes=_pool_bytes(c, 4 * (prompt + new)))

    def gen(cache):
        return lambda n: generate(model, ids, n, cache=cache, ignore_eos=True, page_size=page_size)

    def serve(n):
        engine.generate([ids[0].tolist()], SamplingParams(max_tokens=n, temperature=0.0,
                                                          ignore_eos=True))  # fmt: skip

    runs = {"generate, static cache": gen("static"), "generate, paged cache": gen("paged"),
            "engine": serve}  # fmt: skip
    rates = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for fn in runs.values():  # warm-up: kernels built, caches planned
        fn(2)
    for _ in range(rounds):
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn(1)
            t1, c1 = time.perf_counter(), time.thread_time()
            fn(new + 1)
            t2, c2 = time.perf_counter(), time.thread_time()
            rates[name].append(new / max((t2 - t1) - (t1 - t0), 1e-9))
            cpu[name].append(new / max((c2 - c1) - (c1 - c0), 1e-9))
    return {
        "wall": {name: statistics.median(r) for name, r in rates.items()},
        # with --threads 1 every op runs on this thread: its CPU time is the work, without
        # the time a loaded host took the CPU away
        "cpu": {name: statistics.median(r) for name, r in cpu.items()},
        "rounds": {"wall": rates, "cpu": cpu},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", choices=("static", "paged", "window", "engine"), action="append")
    p.add_argument("--batch", type=int, action="append")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="decode steps per measurement (20)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="tiny model, short prompt: smoke run")
    p.add_argument(
        "--model",
        choices=("llama", "smollm2"),
        default="llama",
        help="the random Llama shape, or the bundled SmolLM2 chat model",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="smollm2: dequantise the GGUF weights (default: kept quantised)",
    )
    p.add_argument(
        "--single-stream",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="decode tok/s of one request: generate against the Engine",
    )
    p.add_argument("--new", type=int, default=64, help="--single-stream: new tokens (64)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = 16 if args.quick else args.prompt
    steps = 3 if args.quick else args.steps
    model = build(args.quick, args.model, args.dtype, args.dequantize)
    if args.single_stream:
        new = 4 if args.quick else args.new
        rates = single_stream(model, prompt, new, args.single_stream, args.page_size)
        if args.json:
            json.dump({"machine": _util.machine(), **rates}, sys.stdout, indent=2)
            print()
            return 0
        rows = [
            [name, f"{rate:.1f} tok/s", f"{rates['cpu'][name]:.1f} tok/s"]
            for name, rate in rates["wall"].items()
        ]
        m = _util.machine()
        title = (
            f"single-stream decode, {args.model} {args.dtype}, prompt {prompt}, {new} new "
            f"tokens, {args.single_stream} rounds ({m['cpu']}, {m['torch_threads']} threads)"
        )
        _util.print_table(["path", "decode (wall)", "decode (thread CPU)"], rows, title=title)
        return 0
    rows = [
        measure(model, kind, B, prompt, steps, args.page_size)
        for kind in args.cache or ("paged", "static")
        for B in args.batch or (1, 8)
    ]
    if args.json:
        json.dump({"machine": _util.machine(), "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    cols = ["cache", "B", "step", "cpu", "matmul", "ops", "python", "attention", "matmul (incl)",
            "attn kernel", "overhead", "matmul (cpu)", "attn (cpu)", "overhead (cpu)",
            "ops"]  # fmt: skip
    keys = ("step_ms", "cpu_ms", "matmul_ms", "ops_ms", "python_ms", "attention_ms",
            "matmul_incl_ms", "kernel_ms")  # fmt: skip
    table = [
        [r["cache"], str(r["batch"])]
        + [f"{r[k]:.2f} ms" for k in keys]
        + [f"{r['overhead_ms']:.2f} ms ({r['overhead_pct']:.0f} %)"]
        + [f"{r['matmul_cpu_ms']:.2f} ms", f"{r['attention_cpu_ms']:.2f} ms"]
        + [f"{r['overhead_cpu_pct']:.0f} %", str(r["aten_ops"])]
        for r in rows
    ]
    m = _util.machine()
    what = args.model + (" dequantised" if args.dequantize else "")
    title = (f"decode step, {what}, prompt {prompt}, {args.dtype} ({m['cpu']}, "
             f"{m['torch_threads']} threads)")  # fmt: skip
    _util.print_table(cols, table, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
