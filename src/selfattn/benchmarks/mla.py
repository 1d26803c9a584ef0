"""Multi-head latent attention decode: the absorbed order vs the naive one, and the cache size.

    python -m selfattn.benchmarks.mla           # 4,096 cached tokens, DeepSeek-V2-Lite's layer
    python -m selfattn.benchmarks.mla --quick   # 512 cached tokens: a smoke run
    python -m selfattn.benchmarks.mla --json

One :class:`selfattn.nn.LatentAttention` layer of DeepSeek-V2-Lite's shape (d_model 2048, 16
heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), fp32, B = 1,
over a :class:`~selfattn.cache.LatentCache` holding ``S`` tokens; one decode step (Sq = 1) in
each order, timed interleaved (medians). The naive order decompresses every cached latent into
per-head K/V at each step; the absorbed one attends over the latents as one shared head.

Cache rows: the latent cache's bytes per token and layer against per-head caches of the same
model width (``d_model / 128`` heads of 128: MHA, GQA with a quarter of the heads as KV heads,
as ``selfattn kv-size`` shows), at DeepSeek-V2-Lite's width and at DeepSeek-V3's (7168, arithmetic
only: :func:`selfattn.cache.latent_cache_bytes`, :func:`selfattn.cache.kv_cache_bytes`).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from selfattn import masks
from selfattn.benchmarks import _util
from selfattn.cache import LatentCache, kv_cache_bytes, latent_cache_bytes
from selfattn.nn import LatentAttention
from selfattn.positions import RoPE

# DeepSeek-V2-Lite's attention (its config.json); the GQA peer uses heads of this width.
D_MODEL, HEADS, RANK, ROPE, NOPE, V = 2048, 16, 512, 64, 128, 128
GQA_HEAD_DIM, GQA_GROUP = 128, 4
V3_WIDTH = 7168  # DeepSeek-V3's d_model, with the same latent (512 + 64)
TARGET_SPEEDUP, TARGET_SMALLER = 2.0, 4.0


def decode_rows(S: int, repeat: int) -> dict:
    """Median seconds of one decode step over ``S`` cached tokens in each order."""
    torch.manual_seed(0)
    layer = LatentAttention(
        D_MODEL, HEADS, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, rope=RoPE(ROPE),
    ).eval()  # fmt: skip
    cache = LatentCache(1, S + 1, RANK, ROPE)
    cache.k[:, :, :S] = torch.randn(1, 1, S, RANK + ROPE)
    x = torch.randn(1, 1, D_MODEL)
    causal = masks.causal()

    def step(order: str):
        def run():
            cache.length = S  # the same S cached tokens every call
            layer.order = order
            with torch.no_grad():
                return layer(x, mask=causal, cache=cache)

        return run

    naive, absorbed = _util.time_pair(step("naive"), step("absorbed"), repeat=repeat)
    diff = (naive.result - absorbed.result).abs().max().item()
    speedup = naive.median_s / absorbed.median_s
    return {
        "case": f"decode, {S} cached tokens",
        "naive_s": naive.median_s,
        "absorbed_s": absorbed.median_s,
        "speedup": speedup,
        "target": f">= {TARGET_SPEEDUP}",
        "met": speedup >= TARGET_SPEEDUP,
        "max_abs_diff": diff,
    }


def cache_rows() -> list[dict]:
    """Bytes per token and layer (bf16): the latent vs per-head caches of the same width."""
    latent = latent_cache_bytes(1, RANK, ROPE, 1, "bf16")
    rows = []
    for name, width in (("DeepSeek-V2-Lite width", D_MODEL), ("DeepSeek-V3 width", V3_WIDTH)):
        heads = width // GQA_HEAD_DIM
        for kind, kv_heads in (("MHA", heads), ("GQA", heads // GQA_GROUP)):
            other = kv_cache_bytes(1, kv_heads, GQA_HEAD_DIM, 1, "bf16")
            smaller = other / latent
            rows.append(
                {
                    "case": f"{name} ({width}): {kind}, {kv_heads} KV heads of {GQA_HEAD_DIM}",
                    "latent_bytes": latent,
                    "per_head_bytes": other,
                    "smaller": smaller,
                    "target": f">= {TARGET_SMALLER}" if kind == "GQA" else "-",
                    "met": smaller >= TARGET_SMALLER if kind == "GQA" else None,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="512 cached tokens: a smoke run")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per side (5)")
    p.add_argument(
        "--threads", type=int, help="torch threads (default torch's); 1 steadies a shared machine"
    )
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    S = 512 if args.quick else 4096
    decode = decode_rows(S, args.repeat)
    sizes = cache_rows()
    if args.json:
        out = {"machine": _util.machine(), "threads": torch.get_num_threads()}
        out |= {"decode": [decode], "cache": sizes}
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    _util.print_table(
        ["case", "naive ms", "absorbed ms", "speedup", "target", "verdict", "max |diff|"],
        [
            [
                decode["case"],
                f"{decode['naive_s'] * 1e3:.2f}",
                f"{decode['absorbed_s'] * 1e3:.2f}",
                f"{decode['speedup']:.1f}x",
                decode["target"],
                "met" if decode["met"] else "missed",
                f"{decode['max_abs_diff']:.1e}",
            ]
        ],
        title=f"MLA decode, one layer, fp32, B = 1, {torch.get_num_threads()} thread(s)",
    )
    print()
    _util.print_table(
        ["per-head cache", "latent B/token", "per-head B/token", "latent smaller", "target"],
        [
            [
                r["case"],
                str(r["latent_bytes"]),
                str(r["per_head_bytes"]),
                f"{r['smaller']:.2f}x",
                r["target"],
            ]
            for r in sizes
        ],
        title="cache per token and layer, bf16",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
