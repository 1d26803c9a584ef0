"""A mask per query row over a paged cache: which pages hold an allowed key, and the one key
interval per row that the paged kernels take. Private to the paged backends; the masks answer
both questions themselves (``Mask.analytic`` / ``tile_kinds``, ``Mask.key_interval``).
"""

from __future__ import annotations

import math

import torch

from selfattn.masks.tiles import TileGrid, classify

# Most key intervals per query row the C kernel takes (its per-page masking and weighted V
# sums loop over them): StreamingLLM's paged mask is 3, one of them always empty.
MAX_KEY_INTERVALS = 4


def page_ranges(mask, lens: list[int], Sq: int, P: int, Hq: int):
    """Per sequence, the logical pages ``[first, last)`` that hold an allowed key.

    Every used page without a mask; with a mask whose tiles classify analytically, the tile
    classification at page granularity (one ``(Sq × P)`` tile per page) trims pages that are
    EMPTY for every head, so a sliding window reads only the pages of its window.
    """
    first, last = [], []
    for b, n in enumerate(lens):
        used = math.ceil(n / P)
        if mask is None or Sq == 0 or used == 0 or not mask.analytic:
            first.append(0)
            last.append(used)
            continue
        grid = TileGrid(Sq, n, Sq, P, q_offset=n - Sq)
        kinds = classify(mask, grid, len(lens), Hq)  # (B', H', 1, used)
        row = kinds[b if kinds.shape[0] > 1 else 0].amax(dim=(0, 1)).cpu()  # (used,)
        hit = (row > 0).nonzero().flatten().tolist()
        first.append(hit[0] if hit else 0)
        last.append(hit[-1] + 1 if hit else 0)
    return first, last


def key_intervals(mask, lens: torch.Tensor, Sq: int):
    """Per query row, the allowed keys as one interval ``[lo, hi)``, or None if the mask is not one.

    ``lo, hi (B, Sq)`` int64 within ``[0, seq_lens[b]]`` (``hi <= lo``: no allowed key): the
    union of one interval (:func:`key_interval_union`). Exact for no mask and every mask whose
    ``is_interval`` holds; any other mask is evaluated elementwise on the PyTorch path.
    """
    if mask is not None and not mask.is_interval:
        return None
    lo, hi = key_interval_union(mask, lens, Sq)
    return lo[..., 0], hi[..., 0]


def interval_count(mask) -> int | None:
    """How many key intervals per row :func:`key_interval_union` gives for ``mask``, or None
    (the mask answers: ``Mask.key_interval_count``)."""
    return mask.key_interval_count()


def key_interval_union(mask, lens: torch.Tensor, Sq: int):
    """Per query row, the allowed keys as ``NI`` disjoint intervals, sorted: ``lo, hi (B, Sq,
    NI)`` int64 within ``[0, seq_lens[b]]`` (``hi <= lo``: an empty one), for a mask with an
    :func:`interval_count` (None: every key, ``NI = 1``). Overlaps are cut off the later
    interval (sorted by ``lo``, each starts at or after every earlier end), so no key is
    counted twice."""
    pos = lens.view(-1, 1) - Sq + torch.arange(Sq, device=lens.device)  # (B, Sq) absolute
    if mask is None or mask.is_causal:  # [0, end) or [0, position + 1): a decode step's case
        hi = (pos + 1).clamp(min=0) if mask is not None else lens.view(-1, 1).expand_as(pos)
        hi = hi.unsqueeze(-1)
        return torch.zeros_like(hi), hi
    b = torch.arange(len(lens), device=lens.device).view(-1, 1)
    end = lens.view(-1, 1, 1)
    parts = [(0, end[..., 0])] if mask is None else mask.key_intervals(b, pos)
    lo = torch.stack([torch.broadcast_to(torch.as_tensor(x[0]), pos.shape) for x in parts], -1)
    hi = torch.stack([torch.broadcast_to(x[1], pos.shape) for x in parts], -1)
    lo, hi = lo.clamp(min=0).minimum(end), hi.minimum(end)
    hi = torch.maximum(hi, lo)
    if len(parts) == 1:  # one interval: nothing overlaps
        return lo, hi
    lo, order = lo.sort(dim=-1)
    hi = hi.gather(-1, order)
    ends = torch.cat([torch.zeros_like(hi[..., :1]), hi.cummax(dim=-1).values[..., :-1]], -1)
    lo = torch.maximum(lo, ends)
    return lo, torch.maximum(hi, lo)
