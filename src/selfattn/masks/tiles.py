"""Tiles: the vocabulary every tiled consumer of a mask shares.

A call's ``(Sq, Sk)`` score matrix cut into ``block_q × block_k`` tiles (:class:`TileGrid`, in
absolute positions), each tile EMPTY, PARTIAL or FULL (:class:`TileKind`). Masks classify tiles
(``Mask.tile_kinds``); backends plan their work from the classification (:func:`classify`: the
kinds of every tile, whole, for chunked, cpu_fused, flex and the paged page ranges); the helpers
here reduce dense blocks and per-position values to tiles. Also the position range every mask and
grid checks (:data:`POSITION_LIMIT`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from selfattn._validate import checked_int
from selfattn.masks.elementwise import evaluate


class TileKind(IntEnum):
    """How a tile of the (query, key) grid is masked. Ordered: ``&`` is min and ``|`` is max."""

    EMPTY = 0  # no pair attends: skip the tile
    PARTIAL = 1  # some pairs attend: evaluate the mask elementwise
    FULL = 2  # every pair attends: no mask work at all


EMPTY, PARTIAL, FULL = TileKind.EMPTY, TileKind.PARTIAL, TileKind.FULL

# Every position (query ``q_offset + row``, key ``kv_offset + column``) and every mask size must lie
# in [-POSITION_LIMIT, POSITION_LIMIT]: positions are int64 tensors and masks add and subtract two
# of them (a window's ``q_idx - size``, a tile's ``q_last - kv_first``), which then never wraps.
POSITION_LIMIT = 1 << 62
# An unbounded side of a key interval (Mask.key_interval): beyond every legal position.
KEY_UNBOUNDED = POSITION_LIMIT + 1


def check_position_span(first: int, count: int, name: str) -> None:
    """ValueError unless positions ``first .. first + count - 1`` lie in ±``POSITION_LIMIT``.

    ``name`` says where ``first`` came from (``"q_offset"``); a silent int64 wrap would move
    queries to the other end of the sequence and mask them all."""
    last = first + max(count, 1) - 1
    if -POSITION_LIMIT <= first and last <= POSITION_LIMIT:
        return
    span = f"position {first}" if last == first else f"positions {first}..{last}"
    raise ValueError(
        f"{name}={first} puts {span} outside the supported range "
        f"[-2**62, 2**62] = [{-POSITION_LIMIT}, {POSITION_LIMIT}] (positions are int64 and "
        "masks take differences of two of them); count positions from the start of the sequence"
    )


@dataclass(frozen=True)
class TileGrid:
    """A tiling of the ``(Sq, Sk)`` score matrix of one call, in absolute positions.

    Query tile ``t`` covers rows ``[t·block_q, min((t+1)·block_q, Sq))``, i.e. positions
    ``q_offset + row``; key tile ``u`` covers key columns ``[u·block_k, min((u+1)·block_k, Sk))``,
    i.e. positions ``kv_offset + column`` (``kv_offset`` is 0 except for a shard of a longer
    sequence, as in ring attention). The last tile of each axis is ragged when the block does not
    divide the length; ``Sq = 0`` or ``Sk = 0`` gives no tiles on that axis.
    """

    Sq: int
    Sk: int
    block_q: int
    block_k: int
    q_offset: int = 0
    kv_offset: int = 0
    device: torch.device | str | None = None

    def __post_init__(self):
        for name in ("Sq", "Sk"):
            checked_int(getattr(self, name), f"TileGrid {name}", 0)
        for name in ("block_q", "block_k"):
            checked_int(getattr(self, name), f"TileGrid {name}", 1)
        for name in ("q_offset", "kv_offset"):
            checked_int(getattr(self, name), f"TileGrid {name}")
        check_position_span(self.q_offset, self.Sq, "TileGrid q_offset")
        check_position_span(self.kv_offset, self.Sk, "TileGrid kv_offset")

    @property
    def n_q(self) -> int:
        return math.ceil(self.Sq / self.block_q)

    @property
    def n_k(self) -> int:
        return math.ceil(self.Sk / self.block_k)

    def q_first(self) -> torch.Tensor:
        """First absolute query position of each query tile, shape ``(1, 1, n_q, 1)``."""
        t = torch.arange(self.n_q, device=self.device) * self.block_q + self.q_offset
        return t.view(1, 1, -1, 1)

    def q_last(self) -> torch.Tensor:
        """Last (inclusive) absolute query position of each query tile, shape ``(1, 1, n_q, 1)``."""
        t = torch.arange(1, self.n_q + 1, device=self.device) * self.block_q
        return (t.clamp(max=self.Sq) - 1 + self.q_offset).view(1, 1, -1, 1)

    def kv_first(self) -> torch.Tensor:
        """First key position of each key tile, shape ``(1, 1, 1, n_k)``."""
        t = torch.arange(self.n_k, device=self.device) * self.block_k + self.kv_offset
        return t.view(1, 1, 1, -1)

    def kv_last(self) -> torch.Tensor:
        """Last (inclusive) key position of each key tile, shape ``(1, 1, 1, n_k)``."""
        t = torch.arange(1, self.n_k + 1, device=self.device) * self.block_k
        return (t.clamp(max=self.Sk) - 1 + self.kv_offset).view(1, 1, 1, -1)


def check_positive_int(value, name: str, fix: str = "") -> int:
    checked_int(value, name, 1, fix)
    if value > POSITION_LIMIT:  # positions minus a size must stay in int64
        raise ValueError(f"{name} must be <= 2**62 ({POSITION_LIMIT}), got {value}")
    return value


def kinds_from(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """int8 tile kinds from bool full / empty tensors (empty wins if both, which never happens)."""
    shape = torch.broadcast_shapes(full.shape, empty.shape)
    out = torch.full(shape, int(PARTIAL), dtype=torch.int8, device=full.device)
    out[full.expand(shape)] = int(FULL)
    out[empty.expand(shape)] = int(EMPTY)
    return out


# Elements the elementwise tile classification evaluates at once (bounds its memory).
_BAND_ELEMENTS = 1 << 24


def reduce_tiles(dense: torch.Tensor, grid: TileGrid) -> torch.Tensor:
    """Tile kinds of a bool ``(B', H', Sq', Sk')`` matrix (``Sq'`` is ``grid.Sq`` or 1, same for
    keys) by any/all over each tile; the ragged last tiles are padded neutrally."""
    B_, H_ = dense.shape[0], dense.shape[1]
    d = dense.expand(B_, H_, grid.Sq, grid.Sk)
    pad_q, pad_k = grid.n_q * grid.block_q - grid.Sq, grid.n_k * grid.block_k - grid.Sk
    anyv = torch.nn.functional.pad(d, (0, pad_k, 0, pad_q), value=False)
    allv = torch.nn.functional.pad(d, (0, pad_k, 0, pad_q), value=True)
    shape = (B_, H_, grid.n_q, grid.block_q, grid.n_k, grid.block_k)
    any_t = anyv.view(shape).any(dim=5).any(dim=3)
    all_t = allv.view(shape).all(dim=5).all(dim=3)
    return kinds_from(all_t, ~any_t)


def tile_kinds_elementwise(mask, grid: TileGrid, B: int, H: int) -> torch.Tensor:
    """Elementwise fallback: evaluate the mask on the grid and reduce each tile with any/all.

    Exact (tight), but costs one mask evaluation per element. The grid is evaluated in bands of
    whole query tiles of at most ``_BAND_ELEMENTS`` elements, so memory stays bounded at any length.
    """
    per_row = max(1, B * H * grid.Sk)
    band = max(1, _BAND_ELEMENTS // (per_row * grid.block_q)) * grid.block_q  # whole tiles
    if grid.Sq <= band:
        dense = evaluate(
            mask.mask_mod, B, H, grid.Sq, grid.Sk, grid.q_offset, grid.device, grid.kv_offset
        )
        return reduce_tiles(dense, grid)
    parts = []
    for r in range(0, grid.Sq, band):
        n = min(band, grid.Sq - r)
        sub = dataclasses.replace(grid, Sq=n, q_offset=grid.q_offset + r)
        dense = evaluate(mask.mask_mod, B, H, n, grid.Sk, sub.q_offset, grid.device, grid.kv_offset)
        parts.append(reduce_tiles(dense, sub))
    lead = (max(t.shape[0] for t in parts), max(t.shape[1] for t in parts))
    return torch.cat([t.expand(*lead, *t.shape[2:]) for t in parts], dim=-2)


def tile_min_max(x: torch.Tensor, n_tiles: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile min and max of ``x (B', S)`` cut into tiles of ``block``: ``(B', n_tiles)`` each."""
    pad = n_tiles * block - x.shape[1]
    if pad:  # repeat the last id: neutral for both min and max of the ragged tile
        x = torch.cat([x, x[:, -1:].expand(x.shape[0], pad)], dim=1)
    x = x.view(x.shape[0], n_tiles, block)
    return x.amin(-1), x.amax(-1)


def classify(mask, grid: TileGrid, B: int = 1, H: int = 1) -> torch.Tensor:
    """The kinds of every tile of ``grid``, whole: int8 ``(B', H', n_q, n_k)`` with ``B'`` in
    ``{1, B}`` and ``H'`` in ``{1, H}`` (dims where the mask does not vary stay 1), however many
    dims ``mask.tile_kinds`` returned. What a backend plans its tiles from."""
    kinds = torch.as_tensor(mask.tile_kinds(grid, B, H))
    kinds = kinds.reshape((1,) * (4 - kinds.dim()) + tuple(kinds.shape))
    return kinds.expand(kinds.shape[0], kinds.shape[1], grid.n_q, grid.n_k)
