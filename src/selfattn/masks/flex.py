"""A FlexAttention ``BlockMask`` as a selfattn mask (:class:`FlexBlockMask`).

What :func:`~selfattn.masks.as_mask` makes of a ``BlockMask``. Its meaning is FlexAttention's: a
pair attends when its block is a full block, or a partial block whose
``mask_mod(b, h, q_idx, kv_idx)`` is True, with ``q_idx`` the query *row* (FlexAttention has no
query offset). The flex backend runs the ``BlockMask`` itself; the other backends read its blocks
and ``mask_mod``. The other way, a mask as a ``BlockMask``, is
:func:`~selfattn.masks.block_mask.build_block_mask`.
"""

from __future__ import annotations

import math

import torch

from selfattn.masks.base import Mask, register_conversion
from selfattn.masks.block_mask import block_sizes, is_block_mask
from selfattn.masks.elementwise import call_elementwise, check_bool
from selfattn.masks.tiles import EMPTY, FULL, PARTIAL

# -- a BlockMask as a selfattn mask --------------------------------------------------------------


def _dense_blocks(num: torch.Tensor, idx: torch.Tensor, n_k: int) -> torch.Tensor:
    """bool ``(B', H', n_q, n_k)``: the blocks listed by ``num (B', H', n_q)``, ``idx (..., m)``."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1).long()
    # unlisted slots are scattered into a spare column n_k, dropped afterwards
    cols = torch.where(listed, idx.long(), n_k).clamp(max=n_k)
    out = torch.zeros(*idx.shape[:-1], n_k + 1, dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, cols, True)[..., :n_k]


def _range_min_max(kinds, dim: int, first: int, count: int, tile: int, block: int):
    """Min and max of ``kinds`` along ``dim`` (blocks of ``block``) over each tile of ``tile``
    elements covering elements ``[first, first + count)``: two tensors with ``ceil(count/tile)``
    entries along ``dim``."""
    n = math.ceil(count / tile)
    start = torch.arange(n, device=kinds.device) * tile
    lo = (first + start) // block
    hi = (first + torch.clamp(start + tile, max=count) - 1) // block
    lo, hi = lo.clamp(max=kinds.shape[dim] - 1), hi.clamp(max=kinds.shape[dim] - 1)
    low = high = None
    for step in range(int((hi - lo).max()) + 1 if n else 0):  # a tile spans few blocks
        part = kinds.index_select(dim, torch.minimum(lo + step, hi))
        low = part if low is None else torch.minimum(low, part)
        high = part if high is None else torch.maximum(high, part)
    return low, high


class FlexBlockMask(Mask):
    """A FlexAttention ``BlockMask`` (``create_block_mask`` or ``BlockMask.from_kv_blocks``) as a
    mask, with FlexAttention's meaning (module docstring): read by query row, like a bool tensor
    mask, so the call's ``q_offset`` moves score mods but not this mask."""

    row_ordered = True

    def __init__(self, block_mask, *, rows_at=None):
        if not is_block_mask(block_mask):
            raise TypeError(f"expected a FlexAttention BlockMask, got {type(block_mask).__name__}")
        # query position of row 0: None until bound (Mask.bind), an int or a (B,) tensor
        self.rows_at = rows_at
        self.block_mask = block_mask
        self.fn = block_mask.mask_mod  # what the flex backend keys its compiled kernels on
        self.block_q, self.block_k = block_sizes(block_mask.BLOCK_SIZE)
        self.Sq, self.Sk = block_mask.seq_lengths
        self._kinds_on: dict = {}

    def kinds(self, device=None) -> torch.Tensor:
        """int8 :class:`~selfattn.masks.TileKind` of each block, ``(B', H', n_q, n_k)``."""
        bm = self.block_mask
        key = str(torch.device(device) if device is not None else bm.kv_num_blocks.device)
        if key not in self._kinds_on:
            n_k = max(math.ceil(self.Sk / self.block_k), 1)
            partial = _dense_blocks(bm.kv_num_blocks, bm.kv_indices, n_k)
            kinds = partial.to(torch.int8) * int(PARTIAL)
            if bm.full_kv_num_blocks is not None:
                full = _dense_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, n_k)
                kinds = kinds.masked_fill(full, int(FULL))
            self._kinds_on[key] = kinds.to(key)
        return self._kinds_on[key]

    def bind(self, q_offset) -> Mask:
        if self.rows_at is not None:
            return self
        bound = FlexBlockMask(self.block_mask, rows_at=q_offset)
        bound._kinds_on = self._kinds_on  # the same blocks
        return bound

    def _first_row(self, b) -> torch.Tensor | int:
        if self.rows_at is None:
            raise RuntimeError(
                f"{self!r} is read by query row, so it needs the call's positions: bind it with "
                ".bind(q_offset) (row 0 at position q_offset; attention() binds it itself)"
            )
        if isinstance(self.rows_at, torch.Tensor):
            return self.rows_at.to(b.device)[b]  # one offset per sequence; b broadcasts
        return self.rows_at

    def mask_mod(self, b, h, q_idx, kv_idx):
        row = q_idx - self._first_row(b)
        kinds = self.kinds(q_idx.device)
        bi = b if kinds.shape[0] > 1 else torch.zeros_like(b)
        hi = h if kinds.shape[1] > 1 else torch.zeros_like(h)
        block = kinds[bi, hi, row // self.block_q, kv_idx // self.block_k]
        inner = check_bool(
            call_elementwise(self.block_mask.mask_mod, (b, h, row, kv_idx), "mask_mod"), self.fn
        )
        return (block == int(FULL)) | ((block == int(PARTIAL)) & inner)

    def tile_kinds(self, grid, B=1, H=1):
        # A tile is FULL when every block it touches is full, EMPTY when every one is empty;
        # partial blocks (mask_mod decides) make it PARTIAL, which is always sound.
        if isinstance(self.rows_at, torch.Tensor):  # per-sequence rows: no single slice
            return super().tile_kinds(grid, B, H)
        first_row = grid.q_offset - (0 if self.rows_at is None else self.rows_at)
        kinds = self.kinds(grid.device)
        lo, hi = _range_min_max(kinds, 2, first_row, grid.Sq, grid.block_q, self.block_q)
        lo, _ = _range_min_max(lo, 3, grid.kv_offset, grid.Sk, grid.block_k, self.block_k)
        _, hi = _range_min_max(hi, 3, grid.kv_offset, grid.Sk, grid.block_k, self.block_k)
        out = torch.full_like(lo, int(PARTIAL))
        return out.masked_fill(lo == int(FULL), int(FULL)).masked_fill(hi == int(EMPTY), int(EMPTY))

    def to_block_mask(self, B, H, Sq, Sk, *, q_offset=None, device=None, block_size=None):
        """The ``BlockMask`` itself (on ``device``), after checking it fits the call."""
        self.validate(1 if B is None else B, 1 if H is None else H, Sq, Sk, 0)
        if block_size is not None and block_sizes(block_size) != (self.block_q, self.block_k):
            raise ValueError(
                f"this mask is a BlockMask with BLOCK_SIZE={(self.block_q, self.block_k)}; it "
                f"is used as it is, not re-blocked to {block_size!r}"
            )
        return self.block_mask if device is None else self.block_mask.to(device)

    def validate(self, B, H, Sq, Sk, q_offset):
        Bm, Hm = self.block_mask.kv_num_blocks.shape[:2]
        if (Sq, Sk) != (self.Sq, self.Sk) or Bm not in (1, B) or Hm not in (1, H):
            raise ValueError(
                f"BlockMask built for (B, H, Q_LEN, KV_LEN) = ({Bm}, {Hm}, {self.Sq}, {self.Sk}) "
                f"cannot mask a call with (B, Hq, Sq, Sk) = ({B}, {H}, {Sq}, {Sk}); build it with "
                f"create_block_mask(mask_mod, B, Hq, Sq, Sk) (B or H may be 1)"
            )

    def batch_heads(self):
        return tuple(self.block_mask.kv_num_blocks.shape[:2])

    def __repr__(self) -> str:
        Bm, Hm = self.block_mask.kv_num_blocks.shape[:2]
        return (
            f"block_mask(<BlockMask ({Bm}, {Hm}, {self.Sq}, {self.Sk}), "
            f"BLOCK_SIZE={(self.block_q, self.block_k)}>)"
        )


register_conversion(is_block_mask, FlexBlockMask)
