"""Holes: the slots a compacted sequence's layer and KV head skip.

:meth:`~selfattn.cache.PagedKV.compact` with ragged per-(layer, KV head) kept counts ``n[l, h]``
(PyramidKV's per-layer budgets, AdaKV's per-head ones) moves layer ``l``, head ``h``'s kept
tokens to slots ``0 .. n[l, h] - 1`` of the sequence's one page list and leaves slots
``[n[l, h], n_max)`` as its *hole*; the sequence's length becomes ``n_max = max n``, and new
tokens go after it as usual::

    slots      0 1 2 3 4 5 | 6 7 ...       n_max = 6
    layer 0 h0 k k k k k k | new            hole [6, 6): none
    layer 0 h1 k k k . . . | new            hole [3, 6)
    layer 1 h0 k k . . . . | new            hole [2, 6)

Every layer shares the page list, so the pages saved are those past ``n_max``: PyramidKV saves
by its largest layer budget, AdaKV (whose layer total is the uniform one) by its largest head.
The hole's rows are zeroed (the C kernel's V sum then adds ``0 · 0`` where it reads them).
A step carries each layer's holes per attention row (:func:`step_holes`), which the paged
backends skip (``paged_attention(holes=)``); a long chunk's dense attention masks them
(:func:`selfattn.cache.base.hole_mask`).
"""

from __future__ import annotations

import torch

__all__ = ["step_holes"]


def step_holes(found: list[torch.Tensor | None], rows=None, device=None) -> torch.Tensor:
    """``(L, R, Hkv, 2)`` int64 on ``device``: the holes of each attention row of a step, from
    each sequence's ``(L, Hkv, 2)`` holes or None (``found``, one per sequence; None entries
    skip nothing); ``rows``: each row's sequence index into ``found`` (default: one row each)."""
    like = next(h for h in found if h is not None)
    empty = torch.zeros_like(like)
    stacked = torch.stack([empty if h is None else h for h in found])  # (B, L, Hkv, 2)
    if rows is not None:
        stacked = stacked[torch.as_tensor(rows, dtype=torch.long)]  # (R, L, Hkv, 2)
    return stacked.transpose(0, 1).contiguous().to(device)  # (L, R, Hkv, 2)
