"""Pieces every backend shares: index grids, GQA views, the counter-based dropout and NaN guards."""

from __future__ import annotations

import torch

from selfattn.masks import _index_grids

__all__ = [
    "accumulation_dtype",
    "dropout_keep",
    "index_grids",
    "unattended_columns_zeroed",
]

index_grids = _index_grids

_M32 = 0xFFFFFFFF
# murmur3's 32-bit finaliser constants (Appleby): a cheap, well-mixing integer hash.
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio, separates the hashed coordinates


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16/fp32 accumulate in fp32; fp64 stays fp64 (DESIGN.md)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * _FMIX1) & _M32
    x = x ^ (x >> 13)
    x = (x * _FMIX2) & _M32
    return x ^ (x >> 16)


def dropout_keep(seed: int, p: float, b, h, q_idx, kv_idx) -> torch.Tensor:
    """Bool keep-mask for attention dropout, a pure function of ``(seed, b, h, q_idx, kv_idx)``.

    Counter-based (like Philox in fused kernels) rather than drawn from a generator stream, so that
    a tiled forward, its recomputing backward and the reference all drop exactly the same
    (query, key) pairs for the same seed, whatever their tiling. Each coordinate is hashed in turn
    with murmur3's finaliser; the top 24 bits give a uniform ``u`` in [0, 1) and ``u >= p`` keeps.
    """
    x = _fmix32(torch.as_tensor(seed & _M32, device=q_idx.device) ^ ((seed >> 32) * _GOLDEN))
    for coord in (b, h, q_idx, kv_idx):
        x = _fmix32(x ^ ((coord.long() + _GOLDEN) & _M32))
    u = (x >> 8).to(torch.float32) * (1.0 / (1 << 24))
    return u >= p


def unattended_columns_zeroed(
    k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, Hq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero K/V rows that no query of their group attends, so NaN/Inf there cannot leak.

    ``allowed`` is a bool mask broadcastable to ``(B, Hq, Sq, Sk)``. A masked key's weight is 0, but
    ``0 · NaN = NaN`` in ``P @ V``; uninitialised cache slots and padding must not poison it.
    """
    Hkv, Sk = k.shape[1], k.shape[2]
    cols = allowed.any(dim=-2)  # (B', Hq', Sk)
    if cols.shape[1] == Hq and Hq != Hkv:
        cols = cols.view(cols.shape[0], Hkv, Hq // Hkv, Sk).any(dim=2)
    if bool(cols.all()):
        return k, v
    keep = cols.unsqueeze(-1)  # (B', Hkv', Sk, 1)
    return k.masked_fill(~keep, 0), v.masked_fill(~keep, 0)
