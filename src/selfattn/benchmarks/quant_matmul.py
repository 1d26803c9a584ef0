"""Quantised matmuls at decode sizes: our C kernel per instruction set against PyTorch's CPU
int4/int8 ops, torchao (when installed) and dense fp32/bf16 matmuls; and SmolLM2 decode speed
and perplexity with its GGUF weights kept quantised and with ``quantize="int8" | "int4"``.

    python -m selfattn.benchmarks.quant_matmul                 # every part, 3 rounds
    python -m selfattn.benchmarks.quant_matmul --quick --json  # a smoke run: one shape, M=1
    python -m selfattn.benchmarks.quant_matmul --only kernel --threads 1 2

kernel: ``y = x · Wᵀ`` for SmolLM2-135M's weight shapes (N, K) and M input rows, each path on
the same random weights: ``ours q4_1`` / ``ours q8_0`` (:mod:`selfattn.kernels.quant_matmul`:
GGML's blocks, int8 activations; bf16 input), ``aten int4`` (``_weight_int4pack_mm_for_cpu``
on the Q4_1 codes repacked to its layout, bf16), ``aten int8`` (``_weight_int8pack_mm``: one
scale per output channel, bf16), ``torchao`` (``Int8WeightOnlyConfig`` when torchao imports),
``dense fp32`` / ``dense bf16`` (``F.linear``), and ``dequantise q4_1`` (the layer's path
without the kernel: chunks dequantised to fp32, then ``F.linear``). Per path the median time
of calls timed interleaved (each timing a loop of calls of at least ~2 ms; thread CPU time with
one thread, which leaves out the host's descheduling, wall time with more) and the weight bytes
read per second (the bytes the path reads: codes plus scales), also as a fraction of this
machine's copy rate (``dst.copy_(src)`` of 256 MiB: bytes read plus written per second). The
instruction-set rows (``ours q4_1 <isa>``) run at M=1 on one thread.

model: the bundled SmolLM2-135M-Instruct GGUF (Q4_1 layers, Q8_0 tied head), ``generate`` of
``--new`` tokens after a ``--prompt``-token prompt, greedy, for each of: the GGUF kept
quantised, its weights dequantised (``quantized=False``) and then ``quantize="int8"`` /
``"int4"`` (:func:`selfattn.nn.quant.quantize_`), and the dequantised model itself, each in
float32 and bfloat16: decode tokens/s (medians of rounds interleaved). Perplexity of a fixed
text (the package's own module docstrings, ``--ppl-tokens`` tokens) in float32 with every
linear layer on the path decode takes (the kernel for kept-quantised layers, its int8
activations included), against the dequantised model's; target for int8: within 1 %.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
import torch.nn.functional as F

from selfattn.benchmarks import _util
from selfattn.kernels import quant_matmul as qmm
from selfattn.nn import quant

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # SmolLM2-135M (N, K)
ROWS = (1, 4, 16)
PPL_TARGET = 0.01  # int8's perplexity within 1 % of the dequantised model's
MIN_LOOP_S = 2e-3  # a timed call loops the op at least this long


def copy_gbs() -> float:
    """Bytes read plus written per second of a 256 MiB tensor copy (the best of a few)."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    best = min(_once(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best / 1e9


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _loop(fn):
    """``fn`` repeated enough times for a call of at least :data:`MIN_LOOP_S`; ``(loop, n)``."""
    fn()
    n = max(1, int(MIN_LOOP_S / max(_once(fn), 1e-7)))

    def loop():
        for _ in range(n):
            fn()

    return loop, n


def _paths(N: int, K: int, M: int, g: torch.Generator) -> dict:
    """``{name: (fn, weight bytes)}`` of every path on one random weight ``(N, K)``."""
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(M, K, generator=g)
    xb = x.bfloat16()
    q41 = quant.QuantizedLinear.from_float(w, "q4_1")
    q80 = quant.QuantizedLinear.from_float(w, "q8_0")

    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    paths = {
        "ours q4_1": (lambda: q41(xb), nbytes(*q41.stored())),
        "ours q8_0": (lambda: q80(xb), nbytes(*q80.stored())),
        "dense fp32": (lambda: F.linear(x, w), nbytes(w)),
    }
    wb = w.bfloat16()
    paths["dense bf16"] = (lambda: F.linear(xb, wb), nbytes(wb))
    with contextlib.suppress(RuntimeError, AttributeError):  # torch without the CPU int4 op
        codes = qmm.codes(q41.qs, "u4_min").to(torch.int32)
        n64 = -(-N // 64) * 64
        codes = F.pad(codes, (0, 0, 0, n64 - N))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        d = q41.d.view(torch.float16).float().T
        zero = q41.m.view(torch.float16).float().T + 8 * d
        sz = F.pad(torch.stack((d, zero), -1), (0, 0, 0, n64 - N)).bfloat16().contiguous()
        paths["aten int4"] = (
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, sz),
            nbytes(packed, sz),
        )
    with contextlib.suppress(RuntimeError, AttributeError):
        scale = w.abs().amax(1) / 127
        w8 = torch.round(w / scale[:, None]).to(torch.int8)
        sb = scale.bfloat16()
        paths["aten int8"] = (
            lambda: torch.ops.aten._weight_int8pack_mm(xb, w8, sb),
            nbytes(w8, sb),
        )
    try:
        import torchao  # noqa: F401
        from torchao.quantization import Int8WeightOnlyConfig
        from torchao.quantization import quantize_ as ao_quantize

        lin = torch.nn.Linear(K, N, bias=False).bfloat16()
        lin.weight.data = wb.clone()
        ao_quantize(lin, Int8WeightOnlyConfig())
        paths["torchao int8"] = (lambda: lin(xb), N * K + 2 * N)
    except ImportError:
        pass
    paths["dequantise q4_1"] = (lambda: _dequantised(q41, x), nbytes(*q41.stored()))
    return paths


def _dequantised(layer, x):
    saved, quant.KERNEL_ROWS = quant.KERNEL_ROWS, 0
    try:
        return layer(x)
    finally:
        quant.KERNEL_ROWS = saved


def _time(fns: dict, threads: int, repeat: int) -> dict:
    loops = {name: _loop(fn) for name, (fn, _) in fns.items()}
    clock = time.thread_time if threads == 1 else time.perf_counter
    timings = _util.time_interleaved(
        [loop for loop, _ in loops.values()], repeat=repeat, budget_s=5.0, clock=clock
    )
    return {name: t.median_s / n for (name, (_, n)), t in zip(loops.items(), timings)}


def kernel_rows(shapes, rows, threads_list, repeat: int, copy_rate: float) -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        for threads in threads_list:
            torch.set_num_threads(threads)
            for N, K in shapes:
                for M in rows:
                    paths = _paths(N, K, M, g)
                    if threads == 1 and M == 1 and qmm.library() is not None:
                        for name in qmm.supported_isas():
                            paths[f"ours q4_1 {name}"] = (_forced(paths["ours q4_1"][0], name),
                                                          paths["ours q4_1"][1])  # fmt: skip
                    secs = _time(paths, threads, repeat)
                    for name, s in secs.items():
                        gbs = paths[name][1] / s / 1e9
                        out.append({
                            "shape": f"{N}x{K}", "M": M, "threads": threads, "path": name,
                            "us": round(s * 1e6, 1), "gbs": round(gbs, 2),
                            "of_copy": round(gbs / copy_rate, 3),
                        })  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return out


def _forced(fn, isa: str):
    import os

    def call():
        saved = os.environ.get("SELFATTN_QUANT_ISA")
        os.environ["SELFATTN_QUANT_ISA"] = isa
        try:
            return fn()
        finally:
            if saved is None:
                del os.environ["SELFATTN_QUANT_ISA"]
            else:
                os.environ["SELFATTN_QUANT_ISA"] = saved

    return call


# -- the model part --------------------------------------------------------------------------------
def _fixed_text() -> str:
    """A fixed English text that ships with the package: module docstrings."""
    import selfattn.cache.quant
    import selfattn.kernels.paged_decode
    import selfattn.kernels.threads
    import selfattn.nn.quant

    mods = (selfattn.nn.quant, selfattn.kernels.paged_decode, selfattn.kernels.threads,
            selfattn.cache.quant)  # fmt: skip
    return "\n\n".join(m.__doc__ for m in mods)


def _models(dtype: torch.dtype, quick: bool) -> dict:
    from selfattn.models import from_pretrained
    from selfattn.models.bundled import chat_model_path

    path = chat_model_path()
    kept = from_pretrained(path, dtype=dtype).eval()
    dense = from_pretrained(path, dtype=dtype, quantized=False).eval()
    models = {"GGUF kept quantised": kept}
    if not quick:
        models["dequantised + int8"] = quant.quantize_(copy.deepcopy(dense), "int8").eval()
        models["dequantised + int4"] = quant.quantize_(copy.deepcopy(dense), "int4").eval()
    models["dequantised (dense)"] = dense
    return models


def perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean cross entropy) of ``ids (1, S)``, every layer on its decode path."""
    saved, quant.KERNEL_ROWS = quant.KERNEL_ROWS, 1 << 30
    try:
        with torch.no_grad():
            logits = model(ids)[0, :-1].float()
    finally:
        quant.KERNEL_ROWS = saved
    return float(F.cross_entropy(logits, ids[0, 1:]).exp())


def model_rows(args) -> tuple[list[dict], list[dict]]:
    from selfattn.models import load_tokenizer
    from selfattn.models.bundled import chat_model_path
    from selfattn.models.generate import generate

    tok = load_tokenizer(chat_model_path())
    text_ids = tok.encode(_fixed_text())
    prompt = torch.tensor([(text_ids * 8)[: args.prompt]])
    decode, ppl = [], []
    dtypes = (torch.float32,) if args.quick else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        models = _models(dtype, args.quick)

        def run(model):
            def once():
                with torch.no_grad():
                    t = time.perf_counter()
                    generate(model, prompt, 1, ignore_eos=True)
                    t1 = time.perf_counter() - t
                    t = time.perf_counter()
                    generate(model, prompt, args.new + 1, ignore_eos=True)
                    return args.new / max(time.perf_counter() - t - t1, 1e-9)

            return once

        fns = [run(m) for m in models.values()]
        rates = {name: [] for name in models}
        for r in range(args.repeat):
            for i in [(r + j) % len(fns) for j in range(len(fns))]:
                rates[list(models)[i]].append(fns[i]())
        for name in models:
            rate = sorted(rates[name])[len(rates[name]) // 2]
            dt = str(dtype).removeprefix("torch.")
            decode.append({"model": name, "dtype": dt, "decode_tok_s": round(rate, 1)})
        if dtype == torch.float32:
            ids = torch.tensor([text_ids[: args.ppl_tokens]])
            base = perplexity(models["dequantised (dense)"], ids)
            for name, model in models.items():
                p = perplexity(model, ids)
                row = {"model": name, "tokens": ids.shape[1], "ppl": round(p, 4),
                       "ours": p, "peer_value": base, "ratio": p / base}  # fmt: skip
                if name == "dequantised + int8":
                    row["met"] = abs(p / base - 1) <= PPL_TARGET
                ppl.append(row)
        del models
    return decode, ppl


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one shape at M=1, a short decode")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--repeat", type=int, default=3, help="rounds (3)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="kernel: threads (1 2)")
    p.add_argument("--only", choices=("kernel", "model"), help="run one part")
    p.add_argument("--new", type=int, default=128, help="model: new tokens (128)")
    p.add_argument("--prompt", type=int, default=512, help="model: prompt tokens (512)")
    p.add_argument("--ppl-tokens", type=int, default=512, help="model: perplexity tokens (512)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat, args.threads, args.new, args.prompt, args.ppl_tokens = 1, [1], 4, 16, 32
    rate = copy_gbs()
    report = {"machine": _util.machine(), "setup": {"copy_gbs": round(rate, 1),
              "kernel_isa": qmm.isa(), "isas": list(qmm.supported_isas())}}  # fmt: skip
    if args.only in (None, "kernel"):
        shapes, rows = (SHAPES[:1], ROWS[:1]) if args.quick else (SHAPES, ROWS)
        report["kernel"] = kernel_rows(shapes, rows, args.threads, args.repeat, rate)
    if args.only in (None, "model"):
        report["decode"], report["perplexity"] = model_rows(args)
    if args.json:
        import json
        import sys

        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(report["setup"])
    if "kernel" in report:
        _util.print_table(
            ["shape", "M", "threads", "path", "µs", "GB/s", "of copy"],
            [
                [
                    r["shape"],
                    str(r["M"]),
                    str(r["threads"]),
                    r["path"],
                    f"{r['us']:.1f}",
                    f"{r['gbs']:.2f}",
                    f"{r['of_copy']:.2f}",
                ]
                for r in report["kernel"]
            ],
            title="quantised matmul (weight bytes read per second)",
        )
    if "decode" in report:
        _util.print_table(
            ["model", "dtype", "decode tok/s"],
            [[r["model"], r["dtype"], f"{r['decode_tok_s']:.1f}"] for r in report["decode"]],
            title=f"SmolLM2-135M generate, {args.prompt}-token prompt, {args.new} new",
        )
        _util.print_table(
            ["model", "tokens", "perplexity", "/ dequantised", "int8 within 1 %"],
            [
                [
                    r["model"],
                    str(r["tokens"]),
                    f"{r['ppl']:.3f}",
                    f"{r['ratio']:.4f}",
                    _util.verdict(r),
                ]
                for r in report["perplexity"]
            ],
            title="perplexity of a fixed text, fp32",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
