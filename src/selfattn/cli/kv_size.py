"""``selfattn kv-size``: KV cache memory of a model shape (:func:`selfattn.cache.kv_cache_bytes`)
per token, per sequence, with MHA/GQA/MQA and other storage dtypes; for multi-head latent
attention (a ``kv_lora_rank`` config, or ``--kv-lora-rank``/``--rope-dim``) the latent cache
(:func:`selfattn.cache.latent_cache_bytes`) and its ratio to the per-head caches; DiffLlama's
paired values (``value_dim = 2 · head_dim``); a StreamingLLM cache (``--streaming W``,
``--n-sink N``: ``N + W`` tokens per layer at any length)."""

from __future__ import annotations

import argparse
import dataclasses

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
# Multi-head latent attention: (layers, query heads, kv_lora_rank, qk_rope_head_dim,
# qk_nope_head_dim, v_head_dim), from the same configs.
_MLA_PRESETS = {
    "deepseek-v2-lite": (27, 16, 512, 64, 128, 128),
    "deepseek-v3": (61, 128, 512, 64, 128, 128),
}


_MLA_ROPE_DIM = 64  # DeepSeek-V2/V3's qk_rope_head_dim
_STREAM_SINKS = 4  # make_cache("streaming")'s n_sink, the paper's


def _kv_dtype(text: str) -> str:
    from selfattn.cache.size import dtype_name

    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_preset(text: str) -> str:
    if text.lower() not in _KV_PRESETS | _MLA_PRESETS:
        raise argparse.ArgumentTypeError(
            f"unknown preset {text!r}; choose one of {', '.join(_KV_PRESETS | _MLA_PRESETS)}"
        )
    return text.lower()


def _config(text: str) -> dict:
    """``--config``: a ``config.json`` (or the folder holding one) -> its parsed object; a GGUF
    file -> the transformers-style config of its metadata."""
    import json
    from pathlib import Path

    path = Path(text)
    if path.suffix.lower() == ".gguf" or (path.is_dir() and not (path / "config.json").exists()):
        from selfattn.models.gguf import GGUFError, gguf_config, gguf_source, open_gguf

        try:
            file = gguf_source(path)
            if file is not None:
                return {"__file__": str(file), **gguf_config(open_gguf(file, arrays=False))}
        except (GGUFError, OSError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if path.is_dir():
        path = path / "config.json"
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {str(path)!r}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{str(path)!r} holds no JSON object")
    return {"__file__": str(path), **config}


def add_parser(subparsers):
    positive = _common.positive_int
    p = subparsers.add_parser(
        "kv-size",
        help="KV cache memory of a model shape: per token, per sequence, MHA/GQA/MQA, int8/fp8",
        description=(
            "Bytes of the KV cache, 2 x layers x kv_heads x head_dim x tokens x bytes x batch "
            "(selfattn.cache.kv_cache_bytes), for a model's config.json, a preset or an "
            "explicit shape (default: a Llama-2-7B shape, 32 layers, 32 KV heads of dimension "
            "128, bf16, 4096 tokens). Explicit flags override the config or preset."
        ),
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        type=_kv_preset,
        metavar="NAME",
        help=f"one of {', '.join(_KV_PRESETS | _MLA_PRESETS)}",
    )
    source.add_argument(
        "--config",
        type=_config,
        metavar="PATH",
        help="a transformers-style config.json (or its folder), or a GGUF file: layers, KV "
        "heads, head_dim, sliding window, dtype",
    )
    p.add_argument("--layers", type=positive, metavar="L", help="default 32")
    p.add_argument("--heads", type=positive, metavar="Hq", help="query heads (default Hkv)")
    p.add_argument("--kv-heads", type=positive, metavar="Hkv", help="default 32")
    p.add_argument("--head-dim", type=positive, metavar="D", help="default 128")
    p.add_argument(
        "--kv-lora-rank",
        type=positive,
        metavar="R",
        help="multi-head latent attention: cache one latent of R (+ --rope-dim) per token",
    )
    p.add_argument("--rope-dim", type=positive, metavar="DR", help="MLA's rope key (default 64)")
    p.add_argument(
        "--streaming",
        type=positive,
        metavar="W",
        help="a StreamingLLM cache on every layer: --n-sink sink tokens plus a window of W, "
        "whatever --tokens (make_cache('streaming'))",
    )
    p.add_argument(
        "--n-sink",
        type=_common.int_at_least(0),
        metavar="N",
        help=f"StreamingLLM's sink tokens (default {_STREAM_SINKS}; needs --streaming)",
    )
    p.add_argument("--tokens", type=positive, default=4096, metavar="T", help="default 4096")
    p.add_argument("--batch", type=positive, default=1, metavar="B", help="default 1")
    p.add_argument(
        "--dtype",
        type=_kv_dtype,
        help="fp32, bf16 (default, or the config's dtype), fp16, int8, fp8",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run, subparser=p)
    return p


def _shape(args):
    """The model's :class:`~selfattn.cache.size.KVShape`: config or preset, then the flags."""
    import dataclasses

    from selfattn.cache.size import KVShape, kv_shape_from_config

    if args.config is not None:
        try:
            shape = kv_shape_from_config(args.config)
        except (TypeError, ValueError) as e:
            args.subparser.error(f"--config {args.config['__file__']}: {e}")
    elif args.preset in _MLA_PRESETS:
        L, Hq, rank, rope, nope, dv = _MLA_PRESETS[args.preset]
        shape = KVShape(layers=L, kv_heads=Hq, head_dim=nope + rope, heads=Hq, value_dim=dv,
                        kv_lora_rank=rank, rope_dim=rope)  # fmt: skip
    else:
        L, Hq, Hkv, D = _KV_PRESETS[args.preset] if args.preset else (32, None, 32, 128)
        shape = KVShape(layers=L, kv_heads=Hkv, head_dim=D, heads=Hq or Hkv)
    flags = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    shape = dataclasses.replace(shape, **{k: v for k, v in flags.items() if v is not None})
    if args.heads is not None:
        shape = dataclasses.replace(shape, heads=args.heads)
    elif args.config is None and args.kv_heads is not None and not args.preset:
        shape = dataclasses.replace(shape, heads=shape.kv_heads)  # default Hq: Hkv
    if args.kv_lora_rank is not None or (args.rope_dim is not None and shape.latent):
        rank = args.kv_lora_rank or shape.kv_lora_rank
        rope = args.rope_dim or shape.rope_dim or _MLA_ROPE_DIM
        shape = dataclasses.replace(shape, kv_lora_rank=rank, rope_dim=rope)
    elif args.rope_dim is not None:
        args.subparser.error("--rope-dim sizes a latent cache: give --kv-lora-rank too")
    if shape.sliding_layers > shape.layers:  # --layers below the config's windowed layers
        shape = dataclasses.replace(shape, sliding_layers=shape.layers)
    if args.streaming is not None:
        if shape.latent:
            args.subparser.error(
                "--streaming: the latent (MLA) caches have no StreamingLLM policy; drop "
                "--streaming or --kv-lora-rank"
            )
        sinks = _STREAM_SINKS if args.n_sink is None else args.n_sink
        shape = dataclasses.replace(shape, stream_sinks=sinks, stream_window=args.streaming)
    elif args.n_sink is not None:
        args.subparser.error("--n-sink sizes a StreamingLLM cache: give --streaming W too")
    return shape


def run(args) -> int:
    from selfattn.cache import format_bytes

    shape = _shape(args)
    state = None
    if args.config is not None:  # a recurrent or hybrid model: KV only on its attention layers
        from selfattn.cache.state import state_shape_from_config

        state = state_shape_from_config(args.config)
        if state is not None and args.layers is None:
            shape = dataclasses.replace(shape, layers=state.attention_layers)
    L, Hq, Hkv, D = shape.layers, shape.heads, shape.kv_heads, shape.head_dim
    if Hq % Hkv:
        args.subparser.error(
            f"--heads ({Hq}) must be divisible by --kv-heads ({Hkv}); pick a divisor of {Hq}"
        )
    T, B = args.tokens, args.batch
    dtype = args.dtype or shape.dtype or "bf16"

    def size(kv_heads=Hkv, tokens=T, dt=dtype, batch=B, latent=shape.latent, stream=True) -> int:
        if not L:  # every layer recurrent (Mamba-2): no KV cache at all
            return 0
        s = dataclasses.replace(shape, kv_heads=kv_heads)
        if not stream:  # what one cached token costs
            s = dataclasses.replace(s, stream_sinks=None, stream_window=None)
        return s.bytes(tokens, dt, batch=batch) if latent else s.mha_bytes(tokens, dt, batch)

    model = {"preset": args.preset, "layers": L, "heads": Hq, "kv_heads": Hkv, "head_dim": D}
    if args.config is not None:
        model |= {"config": args.config["__file__"], "model_type": args.config.get("model_type")}
        model |= {"sliding_window": shape.sliding_window, "sliding_layers": shape.sliding_layers}
    total = size()
    # The same model with MHA (one KV head per query head), GQA (Hq / 4 KV heads), MQA (one).
    heads = [("MHA", Hq), ("GQA", Hq // 4 if Hq % 4 == 0 else None), ("MQA", 1)]
    attention = [
        {"kind": kind, "kv_heads": h, "bytes": size(h, latent=False), "ratio": h}
        for kind, h in heads
        if h
    ]
    if shape.latent:  # the latent first; each per-head cache's ratio is to it
        latent = {"kind": "MLA", "kv_heads": 1, "bytes": total, "ratio": 1.0}
        for a in attention:
            a["ratio"] = a["bytes"] / total
        attention.insert(0, latent)
        model |= {"kv_lora_rank": shape.kv_lora_rank, "rope_dim": shape.rope_dim}
    if shape.value_dim is not None:
        model |= {"value_dim": shape.value_dim}
    if shape.streaming:
        model |= {"n_sink": shape.stream_sinks, "streaming_window": shape.stream_window}
    storage = [
        {"dtype": d, "bytes": size(dt=d), "vs_16bit": size(dt=d) / max(size(dt="bf16"), 1)}
        for d in ("fp32", "bf16", "int8", "fp8")
    ]
    result = {
        "model": model,
        "tokens": T,
        "batch": B,
        "dtype": dtype,
        "bytes_per_token": size(tokens=1, batch=1, stream=False),
        "bytes": total,
        "attention": attention,
        "storage": storage,
    }
    if state is not None:  # fixed per sequence, whatever the tokens
        state_total = state.bytes(dtype, batch=B)
        result["state"] = dataclasses.asdict(state) | {
            "bytes_per_sequence": state.bytes(dtype),
            "bytes": state_total,
        }
        result["total_bytes"] = total + state_total
    if args.json:
        _common.print_json(result)
        return _common.EXIT_OK
    fmt = format_bytes
    out = _common.Printer()
    name = f"{args.preset}: " if args.preset else ""
    if args.config is not None:
        name = f"{args.config.get('model_type') or args.config['__file__']}: "
    if not L:
        out.line(f"{name}no attention layers: no KV cache")
    elif shape.latent:
        r, dr = shape.kv_lora_rank, shape.rope_dim
        out.line(
            f"{name}{L} layers, multi-head latent attention: one latent of {r} + rope key of "
            f"{dr} per token and layer ({Hq} query heads), {dtype}: "
            f"{fmt(result['bytes_per_token'])} per token"
        )
    else:
        dv = "" if shape.value_dim is None else f", values of {shape.value_dim}"
        out.line(
            f"{name}{L} layers, {Hkv} KV heads of dimension {D}{dv} ({Hq} query heads), "
            f"{dtype}: {fmt(result['bytes_per_token'])} per token"
        )
    if args.config is not None and args.config.get("model_type") == "diffllama":
        out.line(
            "DiffLlama: selfattn caches the paired values (2 x head_dim wide) its one attention "
            "call reads: 1.5x the cache of transformers' layer, which keeps V of head_dim"
        )
    if shape.streaming:
        out.line(
            f"StreamingLLM: every layer keeps {shape.stream_sinks} sink tokens + the last "
            f"{shape.stream_window:,} tokens, whatever the length"
        )
    elif shape.sliding_layers:
        out.line(
            f"{shape.sliding_layers} of the {L} layers keep only the last "
            f"{shape.sliding_window:,} tokens (sliding window)"
        )
    seqs = f"{B} sequences" if B > 1 else "one sequence"
    out.line(f"{T:,} tokens x {seqs}: {fmt(total)} ({total:,} bytes)")
    if state is not None:
        st = result["state"]
        out.line(
            f"recurrent state: {state.layers} layers x ({state.heads} heads x {state.key_dim} x "
            f"{state.value_dim} fp32 + conv {state.conv_dim} x {state.conv_width - 1} {dtype}) = "
            f"{fmt(st['bytes_per_sequence'])} per sequence at any length; with the KV cache: "
            f"{fmt(result['total_bytes'])}"
        )
    if not L:
        return _common.EXIT_OK
    out.line()
    rows = [[a["kind"], str(a["kv_heads"]), fmt(a["bytes"]), f"{a['bytes']:,}"] for a in attention]
    if shape.latent:
        dv = shape.value_dim or D
        out.table(
            ["attention", "KV heads", "cache", "bytes", "vs MLA"],
            [[*row, f"{a['ratio']:.1f}x"] for row, a in zip(rows, attention)],
            title=f"same model, {Hq} query heads; per-head caches hold K of {D} and V of {dv}",
        )
    else:
        ratio = " : ".join(str(a["ratio"]) for a in attention)
        out.table(
            ["attention", "KV heads", "cache", "bytes"],
            rows,
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
