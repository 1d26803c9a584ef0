"""``selfattn kv-size``: KV cache memory of a model shape (:func:`selfattn.cache.kv_cache_bytes`)
per token, per sequence, with MHA/GQA/MQA and other storage dtypes."""

from __future__ import annotations

import argparse

from selfattn.cli import _common

# Shapes from each model's public config.json: (layers, query heads, KV heads, head_dim).
_KV_PRESETS = {
    "gpt2": (12, 12, 12, 64),
    "llama-2-7b": (32, 32, 32, 128),
    "llama-2-70b": (80, 64, 8, 128),
    "llama-3-8b": (32, 32, 8, 128),
    "mistral-7b": (32, 32, 8, 128),
    "qwen2-7b": (28, 28, 4, 128),
}


def _kv_dtype(text: str) -> str:
    from selfattn.cache.size import dtype_name

    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_preset(text: str) -> str:
    if text.lower() not in _KV_PRESETS:
        raise argparse.ArgumentTypeError(
            f"unknown preset {text!r}; choose one of {', '.join(_KV_PRESETS)}"
        )
    return text.lower()


def add_parser(subparsers):
    positive = _common.positive_int
    p = subparsers.add_parser(
        "kv-size",
        help="KV cache memory of a model shape: per token, per sequence, MHA/GQA/MQA, int8/fp8",
        description=(
            "Bytes of the KV cache, 2 x layers x kv_heads x head_dim x tokens x bytes x batch "
            "(selfattn.cache.kv_cache_bytes), for a preset or explicit shape (default: a "
            "Llama-2-7B shape, 32 layers, 32 KV heads of dimension 128, bf16, 4096 tokens)."
        ),
    )
    p.add_argument(
        "--preset", type=_kv_preset, metavar="NAME", help=f"one of {', '.join(_KV_PRESETS)}"
    )
    p.add_argument("--layers", type=positive, metavar="L", help="default 32")
    p.add_argument("--heads", type=positive, metavar="Hq", help="query heads (default Hkv)")
    p.add_argument("--kv-heads", type=positive, metavar="Hkv", help="default 32")
    p.add_argument("--head-dim", type=positive, metavar="D", help="default 128")
    p.add_argument("--tokens", type=positive, default=4096, metavar="T", help="default 4096")
    p.add_argument("--batch", type=positive, default=1, metavar="B", help="default 1")
    p.add_argument(
        "--dtype", type=_kv_dtype, default="bf16", help="fp32, bf16 (default), fp16, int8, fp8"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run, subparser=p)
    return p


def run(args) -> int:
    from selfattn.cache import format_bytes, kv_cache_bytes

    L, Hq, Hkv, D = _KV_PRESETS[args.preset] if args.preset else (32, None, 32, 128)
    L = args.layers if args.layers is not None else L
    Hkv = args.kv_heads if args.kv_heads is not None else Hkv
    D = args.head_dim if args.head_dim is not None else D
    Hq = args.heads if args.heads is not None else Hq if Hq is not None else Hkv
    if Hq % Hkv:
        args.subparser.error(
            f"--heads ({Hq}) must be divisible by --kv-heads ({Hkv}); pick a divisor of {Hq}"
        )
    T, B, dtype = args.tokens, args.batch, args.dtype

    def size(kv_heads=Hkv, tokens=T, dt=dtype, batch=B) -> int:
        return kv_cache_bytes(L, kv_heads, D, tokens, dt, batch=batch)

    model = {"preset": args.preset, "layers": L, "heads": Hq, "kv_heads": Hkv, "head_dim": D}
    total = size()
    # The same model with MHA (one KV head per query head), GQA (Hq / 4 KV heads), MQA (one).
    heads = [("MHA", Hq), ("GQA", Hq // 4 if Hq % 4 == 0 else None), ("MQA", 1)]
    attention = [
        {"kind": kind, "kv_heads": h, "bytes": size(h), "ratio": h} for kind, h in heads if h
    ]
    storage = [
        {"dtype": d, "bytes": size(dt=d), "vs_16bit": size(dt=d) / size(dt="bf16")}
        for d in ("fp32", "bf16", "int8", "fp8")
    ]
    result = {
        "model": model,
        "tokens": T,
        "batch": B,
        "dtype": dtype,
        "bytes_per_token": size(tokens=1, batch=1),
        "bytes": total,
        "attention": attention,
        "storage": storage,
    }
    if args.json:
        _common.print_json(result)
        return _common.EXIT_OK
    fmt = format_bytes
    out = _common.Printer()
    name = f"{args.preset}: " if args.preset else ""
    out.line(
        f"{name}{L} layers, {Hkv} KV heads of dimension {D} ({Hq} query heads), {dtype}: "
        f"{fmt(result['bytes_per_token'])} per token"
    )
    seqs = f"{B} sequences" if B > 1 else "one sequence"
    out.line(f"{T:,} tokens x {seqs}: {fmt(total)} ({total:,} bytes)")
    out.line()
    ratio = " : ".join(str(a["ratio"]) for a in attention)
    out.table(
        ["attention", "KV heads", "cache", "bytes"],
        [[a["kind"], str(a["kv_heads"]), fmt(a["bytes"]), f"{a['bytes']:,}"] for a in attention],
        title=f"same model, {Hq} query heads ({' : '.join(a['kind'] for a in attention)} = "
        f"{ratio})",
    )
    out.line()
    out.table(
        ["storage", "cache", "vs bf16"],
        [[s["dtype"], fmt(s["bytes"]), f"{s['vs_16bit']:.3f}x"] for s in storage],
        title="same model, other storage (int8 adds per-token scales, fp8 per-head scales)",
    )
    return _common.EXIT_OK
