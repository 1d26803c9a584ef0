"""Walking a mask per query row over a paged cache: which pages hold an allowed key, and the
one key interval per row of the interval masks (``causal``, ``sliding_window``, ``chunked`` and
their ``&``) that the paged kernels take. Private to the paged backends; these become methods of
the masks themselves (DESIGN: masks answer for themselves).
"""

from __future__ import annotations

import math

import torch

from selfattn.masks import (
    And,
    CallableMask,
    Causal,
    Chunked,
    Mask,
    Not,
    SlidingWindow,
    TensorMask,
    TileGrid,
)


def _analytic(mask) -> bool:
    """True when ``mask.tile_kinds`` is O(tiles) (built-ins and their combinations)."""
    if isinstance(mask, (And, Not)):  # Or subclasses And
        return all(_analytic(c) for c in ((mask.a, mask.b) if isinstance(mask, And) else (mask.a,)))
    if isinstance(mask, (CallableMask, TensorMask)):
        return False
    return type(mask).tile_kinds is not Mask.tile_kinds


def _page_ranges(mask, lens: list[int], Sq: int, P: int, Hq: int):
    """Per sequence, the logical pages ``[first, last)`` that hold an allowed key.

    Every used page without a mask; with a mask whose tiles classify analytically, the tile
    classification at page granularity (one ``(Sq × P)`` tile per page) trims pages that are
    EMPTY for every head, so a sliding window reads only the pages of its window.
    """
    first, last = [], []
    for b, n in enumerate(lens):
        used = math.ceil(n / P)
        if mask is None or Sq == 0 or used == 0 or not _analytic(mask):
            first.append(0)
            last.append(used)
            continue
        grid = TileGrid(Sq, n, Sq, P, q_offset=n - Sq)
        kinds = torch.as_tensor(mask.tile_kinds(grid, len(lens), Hq))
        while kinds.dim() < 4:
            kinds = kinds.unsqueeze(0)
        row = kinds[b if kinds.shape[0] > 1 else 0].amax(dim=(0, 1)).cpu()  # (used,)
        hit = (row > 0).nonzero().flatten().tolist()
        first.append(hit[0] if hit else 0)
        last.append(hit[-1] + 1 if hit else 0)
    return first, last


def _key_intervals(mask, lens: torch.Tensor, Sq: int):
    """Per query row, the allowed keys as one interval ``[lo, hi)``, or None if the mask is not one.

    ``lo, hi (B, Sq)`` int64 within ``[0, seq_lens[b]]`` (``hi <= lo``: no allowed key). Exact
    for no mask, ``causal``, ``sliding_window``, ``chunked`` and their ``&`` (an intersection of
    intervals is an interval); any other mask is evaluated elementwise on the PyTorch path.
    """
    pos = lens.view(-1, 1) - Sq + torch.arange(Sq, device=lens.device)  # (B, Sq) absolute
    lo, hi = torch.zeros_like(pos), lens.view(-1, 1).expand_as(pos).clone()
    for m in _interval_terms(mask):
        if m is None:
            return None
        if type(m) is Causal:
            m_lo, m_hi = torch.zeros_like(pos), pos + 1
        elif type(m) is SlidingWindow:
            m_lo, m_hi = pos - m.size + 1, pos + 1
        else:  # Chunked: the query's own chunk, up to itself when causal
            m_lo = torch.div(pos, m.size, rounding_mode="floor") * m.size
            m_hi = pos + 1 if m.causal else m_lo + m.size
        lo, hi = torch.maximum(lo, m_lo), torch.minimum(hi, m_hi)
    return lo.clamp(min=0), torch.maximum(hi, lo.clamp(min=0))


def _interval_terms(mask) -> list:
    """The factors of ``mask`` as a list of interval masks, with None for any other factor."""
    if mask is None:
        return []
    if type(mask) is And:  # not Or, which subclasses And
        return _interval_terms(mask.a) + _interval_terms(mask.b)
    return [mask if type(mask) in (Causal, SlidingWindow, Chunked) else None]
