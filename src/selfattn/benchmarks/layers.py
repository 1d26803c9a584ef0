"""Attention layer on CPU: ``selfattn.nn.MultiHeadAttention`` vs ``torch.nn.MultiheadAttention``.

    python -m selfattn.benchmarks.layers           # B=8, S=1024, d_model=512, 8 heads, fp32
    python -m selfattn.benchmarks.layers --quick   # S / 8: a smoke run
    python -m selfattn.benchmarks.layers --json

Both layers get the same weights (ours is built with ``MultiHeadAttention.from_torch``) and the same
input; each timed call is a forward plus a backward of ``out.sum()``. Ours and the peer are timed
interleaved (ours, peer, ours, ...) after one warm-up call each; the table shows medians. Causal
rows give torch the float causal mask with ``is_causal=True`` (its fastest documented form) and ours
``selfattn.masks.causal()``. The RoPE row reports the share of a RoPE layer's forward time spent
rotating q and k (reported, not bounded).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import selfattn as sa
from selfattn.benchmarks import _util


def _layers(d_model: int, heads: int, seed: int = 0):
    torch.manual_seed(seed)
    peer = torch.nn.MultiheadAttention(d_model, heads, batch_first=True)
    ours = sa.nn.MultiHeadAttention.from_torch(peer)
    return ours, peer


def fwd_bwd(layer, x, **kwargs):
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x, x, x, need_weights=False, **kwargs)[0]
        out.sum().backward()
        return out.detach()

    return step


def speed_rows(B: int, S: int, d_model: int, heads: int, repeat: int) -> list[dict]:
    rows = []
    ours, peer = _layers(d_model, heads)
    x = torch.randn(B, S, d_model, requires_grad=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(S)
    for name, kwargs in (
        ("no mask", {}),
        ("causal", {"attn_mask": causal, "is_causal": True}),
    ):
        mine, theirs = _util.time_pair(
            fwd_bwd(ours, x, **kwargs), fwd_bwd(peer, x, **kwargs), repeat
        )
        rows.append(
            {
                "case": f"MHA fwd+bwd B={B} S={S} d={d_model} H={heads} fp32, {name}",
                "ours_ms": mine.median_s * 1e3,
                "peer": "torch.nn.MultiheadAttention",
                "peer_ms": theirs.median_s * 1e3,
                "ratio": mine.median_s / theirs.median_s,
                "target": "<= 1.0",
                "max_abs_diff": float((mine.result - theirs.result).abs().max()),
            }
        )
    return rows


def rope_row(B: int, S: int, d_model: int, heads: int, repeat: int) -> dict | None:
    try:
        from selfattn.positions import RoPE
    except ImportError:
        return None
    head_dim = d_model // heads
    rope = RoPE(head_dim)
    layer = sa.nn.MultiHeadAttention(d_model, heads, rope=rope)
    x = torch.randn(B, S, d_model)
    q = torch.randn(B, heads, S, head_dim)
    pos = torch.arange(S)
    with torch.inference_mode():
        layer_t = _util.time_call(lambda: layer(x, mask=sa.masks.causal()), repeat)
        rope_t = _util.time_call(lambda: (rope(q, pos), rope(q, pos)), repeat)  # q and k
    return {
        "case": f"RoPE share of a causal RoPE layer's forward, B={B} S={S} d={d_model} H={heads}",
        "ours_ms": rope_t.median_s * 1e3,
        "peer": "the layer's forward",
        "peer_ms": layer_t.median_s * 1e3,
        "ratio": rope_t.median_s / layer_t.median_s,
        "target": "report",
        "max_abs_diff": None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="S / 8: a smoke run")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per side (5)")
    args = p.parse_args(argv)
    B, S, d_model, heads = 8, 1024 // (8 if args.quick else 1), 512, 8
    rows = speed_rows(B, S, d_model, heads, args.repeat)
    rope = rope_row(B, S, d_model, heads, args.repeat)
    if rope is not None:
        rows.append(rope)
    if args.json:
        json.dump({"machine": _util.machine(), "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    table = []
    for r in rows:
        met = "-" if r["target"] == "report" else ("met" if r["ratio"] <= 1.0 else "missed")
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        table.append(
            [
                r["case"],
                f"{r['ours_ms']:.1f} ms",
                r["peer"],
                f"{r['peer_ms']:.1f} ms",
                f"{r['ratio']:.2f}",
                r["target"],
                met,
                diff,
            ]
        )
    cols = ["case", "ours", "peer", "peer value", "ours/peer", "target", "met?", "max |Δ|"]
    _util.print_table(cols, table, title="attention layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
