"""A mask per query row over a paged cache: which pages hold an allowed key, and the one key
interval per row that the paged kernels take. Private to the paged backends; the masks answer
both questions themselves (``Mask.analytic`` / ``tile_kinds``, ``Mask.key_interval``).
"""

from __future__ import annotations

import math

import torch

from selfattn.masks import TileGrid


def _page_ranges(mask, lens: list[int], Sq: int, P: int, Hq: int):
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
    for no mask and every mask whose ``is_interval`` holds; any other mask is evaluated
    elementwise on the PyTorch path.
    """
    pos = lens.view(-1, 1) - Sq + torch.arange(Sq, device=lens.device)  # (B, Sq) absolute
    lo, hi = torch.zeros_like(pos), lens.view(-1, 1).expand_as(pos).clone()
    if mask is not None:
        interval = mask.key_interval(torch.arange(len(lens), device=lens.device).view(-1, 1), pos)
        if interval is None:
            return None
        lo, hi = torch.maximum(lo, interval[0]), torch.minimum(hi, interval[1])
    return lo, torch.maximum(hi, lo)
