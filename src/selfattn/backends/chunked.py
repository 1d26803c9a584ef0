"""The chunked backend: online softmax over tiles, ``O(S·tile)`` memory, a recomputing backward.

This is FlashAttention's algorithm (Dao et al., 2022; Milakov & Gimelshein's online softmax) written
with PyTorch ops, so it runs wherever torch does. The ``(Sq, Sk)`` score matrix is cut into
``block_q × block_k`` tiles that the mask classifies analytically (``Mask.tile_kinds``)::

    keys →      tile 0   tile 1   tile 2          (causal, Sq = Sk = 3 tiles)
    q tile 0    PARTIAL  EMPTY    EMPTY           EMPTY:   never touched
    q tile 1    FULL     PARTIAL  EMPTY           FULL:    no mask work at all
    q tile 2    FULL     FULL     PARTIAL         PARTIAL: mask_mod evaluated on the tile only

For each query tile, consecutive non-empty key tiles form a *chunk* (at most ``max_chunk`` keys):
one batched matmul gives the chunk's scores, the running row max ``m``, row sum ``l`` and output
accumulator are rescaled once per chunk, and nothing of size ``Sq × Sk`` ever exists. PARTIAL
tiles get their mask from one vectorised ``mask_mod`` call per group of tiles, as an additive
0 / -inf bias. Scores are kept in base 2 (``scale · log2(e)`` rides on the matmul) because
``exp2`` is ~3× faster than ``exp`` on CPU; ``lse`` is converted back to natural log.

Tiles adapt to the mask: 64-row query tiles waste little work on PARTIAL tiles (a sliding
window), while masks with few PARTIAL tiles (causal, packed documents, none) get 128- or 256-row
tiles: fewer, larger matmuls. A call whose output comes out non-finite (NaN/Inf in the inputs, a
``q·k`` overflowing at a masked entry) is redone on an exact (slower) path that masks with
``masked_fill``, zeroes K/V columns no query of a tile attends and adds V's NaN/Inf only to the
rows that attend them (``_common``'s rule for NaN/Inf); finite inputs pay one reduction.

GQA/MQA without repeating K/V: the ``G = Hq // Hkv`` query heads of a kv head are stacked into one
``(G·block_q)``-row operand, so every matmul is batched over ``B·Hkv``. The backward saves ``q, k,
v, out`` and each row's (base-2) max and sum (never the weights) and recomputes each tile's
weights from them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from selfattn._validate import positive_int
from selfattn.backends._common import (
    accumulation_dtype,
    all_finite,
    dropout_keep,
    grad_needed,
    nonfinite_v_part,
    run_with_sinks,
    setup_per_pair,
    unattended_columns_zeroed,
)
from selfattn.backends.base import BASE_FIELDS, Backend, Cost, register
from selfattn.call import AttentionCall
from selfattn.kernels.fused_attention import base2
from selfattn.masks.elementwise import callable_failure
from selfattn.masks.tiles import FULL, TileGrid, classify

__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "MASK_BATCH_ELEMENTS",
    "SCORE_ELEMENTS",
    "density",
    "partial_masks",
    "run",
    "tile_sizes",
]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts a base-2 lse back to natural log

# Tile defaults, measured on a 2-thread CPU (fp32, D = 64, 8 heads, S up to 16384).
# BLOCK_Q: rows of the fine query tiles; a mask with few PARTIAL tiles gets coarser ones (see
# _choose_rows). BLOCK_K: keys per tile of the mask classification (granularity of skipping).
# SCORE_ELEMENTS: rows · keys of one chunk's score buffer per (b, kv head); bounds memory and
# sets max_chunk (2048 keys for 64-row tiles, 512 for 256-row ones, the whole key range when
# decoding one query).
BLOCK_Q = 64
BLOCK_K = 64
SCORE_ELEMENTS = 1 << 17
MAX_ROWS = 256  # the coarsest query tile (G·block_q rows)
# Partial-tile masks are evaluated for many tiles in one vectorised mask_mod call; this caps the
# elements (tiles · block_q · block_k · mask batch · mask heads) evaluated at once.
MASK_BATCH_ELEMENTS = 1 << 19


def tile_sizes(Sq: int, Sk: int, G: int = 1) -> tuple[int, int, int]:
    """The fine ``(block_q, block_k, max_chunk)`` for a call with ``G`` query heads per kv head.

    ``block_q`` is balanced so that query tiles have near-equal sizes (``Sq = 97`` gives tiles of
    49 and 48 rows, not 64 and 33: every tile costs a fixed number of ops, and a thin last tile
    wastes them). :func:`run` may then merge 2 or 4 fine query tiles into one when the mask has
    few PARTIAL tiles; ``max_chunk`` here is for the fine tiles.
    """
    n_q = max(1, math.ceil(Sq / BLOCK_Q))
    block_q = max(1, math.ceil(Sq / n_q))
    return block_q, BLOCK_K, _max_chunk(G * block_q, Sk)


def _max_chunk(rows: int, Sk: int) -> int:
    """Keys per chunk for tiles of ``rows`` stacked rows: the score buffer stays SCORE_ELEMENTS."""
    keys = max(BLOCK_K, SCORE_ELEMENTS // max(rows, 1) // BLOCK_K * BLOCK_K)
    return min(keys, max(BLOCK_K, math.ceil(Sk / BLOCK_K) * BLOCK_K))


# ----------------------------------------------------------------------------------------------
# The plan: which key ranges each query tile visits and where the mask must be evaluated
# ----------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """The tiling of one call, shared by the forward and the recomputing backward.

    ``chunks[i]`` lists, for query tile ``i``, ``(c0, c1, parts)``: the keys ``[c0, c1)`` of one
    matmul and its PARTIAL tiles ``(a, b, p)`` = columns ``[a, b)`` relative to ``c0`` and index
    ``p`` into ``partial_tiles``. ``groups`` are ranges of query tiles ``(i0, i1, p0, p1)`` whose
    partial tiles ``[p0, p1)`` get their mask evaluated in one call. ``keyed[i]``: the first chunk
    of tile ``i`` holds a FULL tile, so every row has a key there (no empty-row guard needed).
    """

    block_q: int
    block_k: int
    n_q: int
    chunks: list
    partial_tiles: torch.Tensor  # (n_partial, 2) int64: (query tile, key tile)
    groups: list
    keyed: list


@dataclass
class _Grid:
    """Tile classification reduced over (b, h): ``nonempty`` and ``full`` bool ``(n_q, n_k)``.

    A tile is skipped only if EMPTY for every (b, h), mask-free only if FULL for every one.
    ``mask_b`` / ``mask_h``: the batch and head extent of the mask (1 when it does not vary).
    """

    block_q: int
    nonempty: torch.Tensor
    full: torch.Tensor
    mask_b: int = 1
    mask_h: int = 1

    def coarsen(self, factor: int) -> _Grid:
        """Merge ``factor`` consecutive query tiles: EMPTY iff all are, FULL iff all are."""
        n_q, n_k = self.nonempty.shape
        pad = -n_q % factor
        ne = F.pad(self.nonempty, (0, 0, 0, pad), value=False).view(-1, factor, n_k).any(1)
        fu = F.pad(self.full, (0, 0, 0, pad), value=True).view(-1, factor, n_k).all(1)
        return _Grid(self.block_q * factor, ne, fu, self.mask_b, self.mask_h)


def _grid(call: AttentionCall, B, Hq, Sq, Sk, block_q, block_k, device) -> _Grid:
    n_q, n_k = math.ceil(Sq / block_q), math.ceil(Sk / block_k)
    if call.mask is None:
        ones = torch.ones(n_q, n_k, dtype=torch.bool)
        return _Grid(block_q, ones, ones.clone())
    grid = TileGrid(Sq, Sk, block_q, block_k, q_offset=call.q_offset, device=device)
    kinds = classify(call.mask, grid, B, Hq).cpu()  # (B', H', n_q, n_k)
    mask_b, mask_h = kinds.shape[0], kinds.shape[1]
    nonempty = kinds.amax(dim=(0, 1)) > 0
    full = kinds.amin(dim=(0, 1)) == int(FULL)
    return _Grid(block_q, nonempty, full, mask_b, mask_h)


def fine_grid(call: AttentionCall, B, Hq, Sq, Sk, G, device) -> _Grid:
    """The classification at the automatic fine tiling, computed once per call.

    ``auto`` asks for it to measure the mask's density and ``run`` then reuses it, so a mask whose
    tiles must be classified elementwise (a user callable) is evaluated once, not twice.
    """
    block_q, block_k, _ = tile_sizes(Sq, Sk, G)
    key = ("chunked-grid", B, Hq, Sq, Sk, block_q, block_k)
    if key not in call.tile_kinds_cache:
        call.tile_kinds_cache[key] = _grid(call, B, Hq, Sq, Sk, min(block_q, Sq), block_k, device)
    return call.tile_kinds_cache[key]


def density(q, k, call) -> float:
    """Fraction of the tiles (chunked's own fine tiling) the mask does not classify as EMPTY.

    The classification is cached on the call, so the chunked backend reuses it when picked.
    """
    if call.mask is None:
        return 1.0
    B, Hq, Sq, _ = q.shape
    Sk, G = k.shape[2], Hq // k.shape[1]
    return float(fine_grid(call, B, Hq, Sq, Sk, G, q.device).nonempty.float().mean())


def _choose_rows(grid: _Grid, G: int) -> int:
    """How many fine query tiles to merge (1, 2 or 4), from the share of PARTIAL tiles.

    Coarser tiles mean fewer ops and bigger matmuls (dense and causal run ~20-30% faster with
    256-row tiles) but compute the masked part of PARTIAL tiles in bigger blocks: a sliding
    window of 256 is fastest with 64-row tiles, where 40% of its tiles are PARTIAL.
    """
    n_nonempty = int(grid.nonempty.sum())
    if n_nonempty == 0:
        return 1
    share = int((grid.nonempty & ~grid.full).sum()) / n_nonempty
    factor = 1 if share > 0.25 else (2 if share > 0.05 else 4)
    n_q = grid.nonempty.shape[0]
    while factor > 1 and (factor > n_q or G * grid.block_q * factor > MAX_ROWS):
        factor //= 2
    return factor


def _plan(grid: _Grid, Sq, Sk, block_k, max_chunk) -> _Plan:
    block_q, nonempty = grid.block_q, grid.nonempty
    n_q = nonempty.shape[0]
    partial = nonempty & ~grid.full
    # Runs of consecutive non-empty key tiles per query tile, found with one diff over the grid.
    edges = torch.diff(F.pad(nonempty.to(torch.int8), (1, 1)), dim=1)  # (n_q, n_k + 1)
    starts = (edges == 1).nonzero().tolist()
    ends = (edges == -1).nonzero()[:, 1].tolist()
    partial_tiles = partial.nonzero()  # (n_partial, 2), row-major: sorted by query tile
    ptiles = partial_tiles.tolist()
    step = max(1, max_chunk // block_k)

    chunks: list[list] = [[] for _ in range(n_q)]
    p = 0
    for (i, j0), j1 in zip(starts, ends):
        for a in range(j0, j1, step):
            b = min(a + step, j1)
            c0, c1 = a * block_k, min(b * block_k, Sk)
            while p < len(ptiles) and (ptiles[p][0], ptiles[p][1]) < (i, a):
                p += 1  # a partial tile outside every run (an inconsistent tile_kinds)
            parts = []
            while p < len(ptiles) and ptiles[p][0] == i and ptiles[p][1] < b:
                j = ptiles[p][1]
                parts.append((j * block_k - c0, min((j + 1) * block_k, Sk) - c0, p))
                p += 1
            chunks[i].append((c0, c1, parts))

    # Group query tiles so that each group's partial-tile masks are evaluated in one call.
    per_tile = torch.bincount(partial_tiles[:, 0], minlength=n_q).tolist() if ptiles else [0] * n_q
    cap = max(1, MASK_BATCH_ELEMENTS // (block_q * block_k * grid.mask_b * grid.mask_h))
    groups, i0, p0, count = [], 0, 0, 0
    for i in range(n_q):
        if count and count + per_tile[i] > cap:
            groups.append((i0, i, p0, p0 + count))
            i0, p0, count = i, p0 + count, 0
        count += per_tile[i]
    groups.append((i0, n_q, p0, p0 + count))
    keyed = [
        bool(ch) and len(ch[0][2]) < math.ceil((ch[0][1] - ch[0][0]) / block_k) for ch in chunks
    ]
    return _Plan(block_q, block_k, n_q, chunks, partial_tiles, groups, keyed)


def partial_masks(call, tiles, B, Hq, Hkv, Sq, Sk, bq, bk, device, dtype, safe):
    """Evaluate the mask on a batch of PARTIAL tiles in one ``mask_mod`` call.

    ``tiles (n, 2)``: (query tile, key tile). Returns ``(n, Bm, Hk', G', bq, bk)`` with
    ``Bm ∈ {1, B}`` and ``(Hk', G') ∈ {(1, 1), (Hkv, G)}`` so that entry ``p`` broadcasts against a
    chunk's scores viewed as ``(B, Hkv, G, bq, span)``: an additive bias (0 / -inf) in ``dtype``,
    or with ``safe`` the bool "masked" tensor for ``masked_fill`` (exact even for NaN/Inf scores).
    Rows and columns past ``Sq``/``Sk`` (the padding of edge tiles) repeat the last valid position.
    """
    n = tiles.shape[0]
    tiles = tiles.to(device)
    q_pos = (tiles[:, :1] * bq + torch.arange(bq, device=device)).clamp_(max=Sq - 1)  # (n, bq)
    kv_pos = (tiles[:, 1:] * bk + torch.arange(bk, device=device)).clamp_(max=Sk - 1)  # (n, bk)
    q_idx = (q_pos + call.q_offset).view(1, 1, n * bq, 1)
    # Each row carries the key positions of its own tile: one 4-D call covers all n tiles.
    kv_idx = kv_pos.unsqueeze(1).expand(n, bq, bk).reshape(1, 1, n * bq, bk)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(Hq, device=device).view(1, Hq, 1, 1)
    allowed = torch.as_tensor(call.mask.mask_mod(b, h, q_idx, kv_idx), device=device)
    if allowed.dtype != torch.bool:
        raise TypeError(
            f"mask_mod must return a bool tensor, got {allowed.dtype}; "
            "write a comparison such as `q_idx >= kv_idx`"
        )
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    Bm, Hm = allowed.shape[0], allowed.shape[1]
    allowed = allowed.expand(Bm, Hm, n * bq, bk).reshape(Bm, Hm, n, bq, bk)
    allowed = allowed.permute(2, 0, 1, 3, 4)  # (n, Bm, Hm, bq, bk)
    if Hm == Hq and Hq != Hkv:
        allowed = allowed.reshape(n, Bm, Hkv, Hq // Hkv, bq, bk)
    else:
        allowed = allowed.unsqueeze(3)  # (n, Bm, Hm, 1, bq, bk)
    if safe:
        return ~allowed
    return _neg_inf_where_false(allowed, dtype)


# IEEE-754 -inf as a signed int of the float's width, for building 0 / -inf biases bitwise.
_NEG_INF_BITS = {torch.float32: (torch.int32, -0x800000), torch.float64: (torch.int64, -(1 << 52))}


def _neg_inf_where_false(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``0.0`` where ``allowed``, ``-inf`` elsewhere, in ``dtype`` (fp32 or fp64).

    Equal to ``torch.where(allowed, 0.0, -inf)`` but ~10× faster on CPU (where's scalar path is
    not vectorised): ``allowed - 1`` is 0 or all ones, and ``& bits(-inf)`` picks the pattern.
    """
    int_dtype, bits = _NEG_INF_BITS[dtype]
    return allowed.to(int_dtype).sub_(1).bitwise_and_(bits).view(dtype)


# ----------------------------------------------------------------------------------------------
# Per-call state
# ----------------------------------------------------------------------------------------------


class _Setup:
    """Per-call constants and scratch buffers shared by the forward and the backward.

    Query tile ``i`` covers rows ``[r0, r1)``; its ``G`` heads of a kv head are stacked into
    ``R = G·(r1 - r0)`` rows, so every matmul is batched over ``B·Hkv`` and K/V are never repeated.
    """

    def __init__(self, q, k, v, call: AttentionCall, plan: _Plan, safe: bool):
        self.B, self.Hq, self.Sq, self.D = q.shape
        self.Hkv, self.Sk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.Hq // self.Hkv
        self.BH = self.B * self.Hkv
        self.bq = plan.block_q
        self.cd = accumulation_dtype(q.dtype)
        self.device = q.device
        self.q, self._q_tiles = q, None
        self.k3 = k.to(self.cd).reshape(self.BH, self.Sk, self.D)  # (B·Hkv, Sk, D)
        self.v3 = v.to(self.cd).reshape(self.BH, self.Sk, self.Dv)  # (B·Hkv, Sk, Dv)
        # The exact path (see run): masks by masked_fill, zeroes K/V columns no query of a tile
        # attends, and keeps NaN/Inf of V out of the rows that do not attend them.
        self.safe = safe
        self.v_pv, self.bad_keys = self.v3, None
        if safe and not all_finite(self.v3):
            # P V runs on V with its non-finite entries zeroed; what they contribute to the rows
            # that attend them is added back per chunk (_common.nonfinite_v_part)
            self.v_pv = self.v3.masked_fill(~torch.isfinite(self.v3), 0)
            self.bad_keys = (~torch.isfinite(self.v3)).any(-1).any(0).nonzero().squeeze(1).cpu()
        self.b_idx = torch.arange(self.B, device=self.device).view(-1, 1, 1, 1)
        self.h_idx = torch.arange(self.Hq, device=self.device).view(1, -1, 1, 1)
        self.q_pos = torch.arange(self.Sq, device=self.device) + call.q_offset
        self.kv_pos = torch.arange(self.Sk, device=self.device)
        max_span = max((c1 - c0 for ch in plan.chunks for c0, c1, _ in ch), default=1)
        rows = self.BH * self.G * self.bq
        self._bufs, self._views, self._c = {}, {}, None
        self._sizes = {"s": rows * max_span, "dp": rows * max_span, "q": rows * self.D}
        self._sizes.update({"o": rows * self.Dv, "do": rows * self.Dv, "dq": rows * self.D})
        self._sizes["dol"] = rows * self.Dv
        self._sizes.update({"m": rows, "l": rows})
        self.masked, self.modded = call.mask is not None, call.score_mod is not None
        self.keyed = plan.keyed
        # base-2 sink logit of each query head (None: no sinks), and its (B·Hkv, R, 1) row views
        self.sink2 = None if call.sinks is None else call.sinks.detach().to(self.cd) * LOG2E
        self._sink_rows = {}

    def sink_rows(self, tq):
        """The base-2 sink of each row of a ``tq``-row query tile as ``(B·Hkv, G·tq, 1)``."""
        rows = self._sink_rows.get(tq)
        if rows is None:
            s5 = self.sink2.view(1, self.Hkv, self.G, 1, 1)
            rows = s5.expand(self.B, self.Hkv, self.G, tq, 1).reshape(self.BH, self.G * tq, 1)
            self._sink_rows[tq] = rows
        return rows

    def guarded(self, i) -> bool:
        """Whether a row of query tile ``i`` may see only ``-inf`` scores in its first chunk.

        A mask empties rows only where the first chunk holds no FULL tile (``plan.keyed``); a score
        mod (or an Inf in K on the exact path) can give ``-inf`` anywhere. Such rows keep a finite
        running max and a zero sum: output 0 and lse ``-inf``, as a row the mask empties.
        """
        return self.modded or self.safe or (self.masked and not self.keyed[i])

    def buf(self, name, *shape):
        """``shape`` view of a scratch buffer reused by every tile (no per-tile allocation)."""
        view = self._views.get((name, shape))
        if view is None:
            if name not in self._bufs:
                n = self._sizes[name]
                self._bufs[name] = torch.empty(n, dtype=self.cd, device=self.device)
            view = self._views[name, shape] = self._bufs[name][: math.prod(shape)].view(shape)
        return view

    def row_tiles(self, x, name):
        """A function ``i -> (rows of tile i of x (B, Hq, Sq, E) as (B·Hkv, R, E), is_view)``.

        Views, all made by one ``split``, when the layout allows (G = 1, the accumulation dtype,
        B and Hkv mergeable); else each call copies the tile into the scratch buffer ``name``
        (the caller may scale it on the way, see :meth:`q_tile`).
        """
        B, Hkv, G, E = self.B, self.Hkv, self.G, x.shape[-1]
        x5 = x.reshape(B, Hkv, G, self.Sq, E)
        if G == 1 and x5.dtype == self.cd and x5.stride(0) == Hkv * x5.stride(1):
            views = x5[:, :, 0].view(self.BH, self.Sq, E).split(self.bq, dim=1)
            return lambda i, scale=None: (views[i], True)
        slabs = x5.split(self.bq, dim=3)  # (B, Hkv, G, tq, E) each

        def copy(i, scale=None):
            tq = slabs[i].shape[3]
            t = self.buf(name, B, Hkv, G, tq, E)
            if scale is None:
                t.copy_(slabs[i])
            elif slabs[i].dtype == t.dtype:
                torch.mul(slabs[i], scale, out=t)
            else:
                # fp16/bf16 q: ``torch.mul`` computes in the tensor's dtype (a 0-d fp32 scale
                # does not promote it), so ``q · c`` would be rounded to half precision before
                # the fp32 matmul: a relative error of 2^-11 on every score (issue: the lse
                # error of one-key rows was 5x the naive fp16 one). Widen first, then scale.
                t.copy_(slabs[i]).mul_(scale)
            return self.buf(name, self.BH, G * tq, E), False

        return copy

    def q_tile(self, i, c):
        """``(qt, k)``: the ``q`` rows of tile ``i`` as ``(B·Hkv, R, D)``, equal to ``q · k``.

        A view with ``k = 1`` when the layout allows (the scale then rides on the matmul's alpha),
        else a copy into a scratch buffer pre-multiplied by ``k = c`` in the same pass.
        """
        if self._q_tiles is None:
            self._q_tiles = self.row_tiles(self.q, "q")
        if self._c is None or self._c[0] != c:  # a 0-d tensor: no per-call scalar wrapping
            self._c = (c, torch.tensor(c, dtype=self.cd, device=self.device))
        qt, is_view = self._q_tiles(i, self._c[1])
        return qt, (1.0 if is_view else c)

    def rows(self, i):
        r0 = i * self.bq
        return r0, min(r0 + self.bq, self.Sq)

    def positions(self, i, c0, c1):
        r0, r1 = self.rows(i)
        q_idx = self.q_pos[r0:r1].view(1, 1, -1, 1)
        return self.b_idx, self.h_idx, q_idx, self.kv_pos[c0:c1].view(1, 1, 1, -1)

    def group_masks(self, call, plan, p0, p1):
        if p1 == p0:
            return None
        masks = partial_masks(
            call, plan.partial_tiles[p0:p1], self.B, self.Hq, self.Hkv, self.Sq, self.Sk,
            self.bq, plan.block_k, self.device, self.cd, self.safe,
        )  # fmt: skip
        return masks.unbind(0)  # one view per tile, made in one call

    def chunk_kv(self, i, c0, c1, parts, masks, p0):
        """K and V of keys ``[c0, c1)``, with unattended columns zeroed on the safe path (V with
        its non-finite entries zeroed: :meth:`nonfinite_part` adds what they contribute)."""
        kc, vc = self.k3[:, c0:c1], self.v_pv[:, c0:c1]
        if not (self.safe and parts):
            return kc, vc
        r0, r1 = self.rows(i)
        span = c1 - c0
        k4, v4 = kc.reshape(self.B, self.Hkv, span, self.D), vc.reshape(self.B, self.Hkv, span, -1)
        copied = False
        for a, b, p in parts:
            na = masks[p - p0][..., : r1 - r0, : b - a]  # (Bm, Hk', G', tq, pk)
            allowed = ~na.reshape(na.shape[0], -1, r1 - r0, b - a)  # (Bm, 1 or Hq, tq, pk)
            ks, vs = k4[:, :, a:b], v4[:, :, a:b]
            kz, vz = unattended_columns_zeroed(ks, vs, allowed, self.Hq)
            if kz is ks:
                continue  # every column is attended by some query of the tile
            if not copied:  # copy the chunk once; the caller's K/V stay untouched
                k4, v4, copied = k4.clone(), v4.clone(), True
            k4[:, :, a:b], v4[:, :, a:b] = kz, vz
        return k4.view(self.BH, span, self.D), v4.view(self.BH, span, -1)

    def apply_masks(self, s, i, parts, masks, p0, cached=False, value=-math.inf):
        """Mask the PARTIAL tiles of one chunk's scores ``s (B·Hkv, R, span)`` in place.

        ``cached``: ``s`` is the scratch buffer's view, so its column slices can be reused.
        ``value``: what masked entries become on the safe path (the backward zeroes ``dS`` there).
        """
        r0, r1 = self.rows(i)
        tq, span = r1 - r0, s.shape[-1]
        s5 = None
        for a, b, p in parts:
            m = masks[p - p0]  # (Bm, Hk', G', bq, bk)
            if tq != self.bq or b - a != m.shape[-1]:
                m = m[..., :tq, : b - a]  # an edge tile: (Bm, Hk', G', tq, pk)
            key = (tq, span, a, b)
            part = self._views.get(key) if cached else None
            if part is None:
                if s5 is None:
                    s5 = s.view(self.B, self.Hkv, self.G, tq, span)
                part = s5[..., a:b]
                if cached:
                    self._views[key] = part
            if self.safe:
                part.masked_fill_(m, value)
            else:
                part.add_(m)

    def dropout_scale(self, call, i, c0, c1):
        """``keep / (1 - p)`` for query tile ``i`` × keys ``[c0, c1)`` as ``(B·Hkv, R, span)``."""
        b, h, q_idx, kv_idx = self.positions(i, c0, c1)
        keep = dropout_keep(call.dropout_seed, call.dropout_p, b, h, q_idx, kv_idx)
        keep = keep.expand(self.B, self.Hq, q_idx.shape[2], c1 - c0)
        keep = keep.reshape(self.BH, -1, c1 - c0)
        return keep.to(self.cd).mul_(1.0 / (1.0 - call.dropout_p))

    def bad_columns(self, c0, c1):
        """Columns (relative to ``c0``) of keys in ``[c0, c1)`` whose V holds NaN/Inf, or None."""
        if self.bad_keys is None:
            return None
        cols = self.bad_keys[(self.bad_keys >= c0) & (self.bad_keys < c1)] - c0
        return cols.to(self.device) if cols.numel() else None

    def nonfinite_part(self, p, attended, c0, cols):
        """What V's non-finite entries at columns ``cols`` add to ``P V`` for the rows that attend
        them: ``p, attended (B·Hkv, R, n)`` on those columns -> ``(B·Hkv, R, Dv)``."""
        return nonfinite_v_part(p, attended, self.v3[:, c0 + cols])

    def scores(self, qt, alpha, kc, call, i, c0, c1, leaf=False):
        """Base-2 scores of query tile ``i`` against keys ``[c0, c1)``: ``(B·Hkv, R, span)``.

        ``alpha · qt kᵀ`` is ``q kᵀ · scale · LOG2E`` without a score mod: one matmul. With one,
        it is the natural-unit scaled score, which goes through the mod first. With ``leaf`` it
        also returns ``(s_nat, s_mod)`` for the backward's autograd through the mod.
        """
        R, span = qt.shape[1], c1 - c0
        s = self.buf("s", self.BH, R, span)
        if alpha == 1.0:
            torch.bmm(qt, kc.transpose(1, 2), out=s)  # (B·Hkv, R, D) @ (B·Hkv, D, span)
        else:  # beta = 0: the stale buffer is ignored, NaN included
            torch.baddbmm(s, qt, kc.transpose(1, 2), beta=0.0, alpha=alpha, out=s)
        if call.score_mod is None:
            return s, None
        tq = R // self.G
        s_nat = s.view(self.B, self.Hq, tq, span)
        if leaf:
            s_nat = s_nat.detach().requires_grad_(True)
        b, h, q_idx, kv_idx = self.positions(i, c0, c1)
        with torch.enable_grad() if leaf else torch.no_grad():
            s_mod = call.score_mod.score_mod(s_nat, b, h, q_idx, kv_idx)
            s_mod = s_mod.expand(self.B, self.Hq, tq, span)
        s2 = base2(s_mod.detach(), self.cd).reshape(self.BH, R, span)  # finfo.min stays finite
        return s2, ((s_nat, s_mod) if leaf else None)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def _forward(q, k, v, call: AttentionCall, plan: _Plan, need_lse: bool = True, safe=False):
    """``out (B, Hq, Sq, Dv)`` in q's dtype, the base-2 ``lse2 (B, Hq, Sq)`` = ``lse · LOG2E``
    and the row statistics ``(m2, l)`` the backward recomputes P from (accumulation dtype; all
    three ``None`` unless ``need_lse``): the base-2 row max and the row sum ``Σ 2^(s - m2)`` (at
    least 1, also for empty rows, whose scores are all ``-inf``).

    Each tile works in small scratch buffers (cache-resident) and is normalised into ``out`` at
    its end; measured faster than letting the matmuls write into strided views of ``out``.
    """
    st = _Setup(q, k, v, call, plan, safe)
    B, Hkv, G, BH, cd, Dv, Sq = st.B, st.Hkv, st.G, st.BH, st.cd, st.Dv, st.Sq
    c = call.scale * (LOG2E if call.score_mod is None else 1.0)
    lowest = torch.finfo(cd).min
    fast = call.score_mod is None and call.dropout_p == 0 and not st.safe
    # zeros, not empty: tiles with no key stay 0, and the page faults of a fresh output are taken
    # by one parallel fill instead of by every tile's write
    out = torch.zeros(B, st.Hq, Sq, Dv, dtype=q.dtype, device=st.device)
    out_tiles = out.view(B, Hkv, G, Sq, Dv).split(st.bq, dim=3)  # (B, Hkv, G, tq, Dv) each
    lse = stats = None
    if need_lse:
        lse = torch.full((B, st.Hq, Sq), -math.inf, dtype=cd, device=st.device)
        stats = (torch.zeros_like(lse), torch.ones_like(lse))  # (m2, l) of rows with no key
        if st.sink2 is not None:  # a row with no key: lse = sink, m2 = sink (0 if -inf), l = 1
            lse.copy_(st.sink2.view(1, -1, 1).expand_as(lse))
            stats[0].copy_(lse.masked_fill(lse == -math.inf, 0.0))
        tiles = [t.view(B, Hkv, G, Sq).split(st.bq, dim=3) for t in (lse, *stats)]

    for i0, i1, p0, p1 in plan.groups:
        masks = st.group_masks(call, plan, p0, p1)
        for i in range(i0, i1):
            chunks = plan.chunks[i]
            if not chunks:  # a query tile with no key: out 0, lse -inf
                continue
            qt, qk = st.q_tile(i, c)
            alpha = 1.0 if qk == c else c / qk
            R = qt.shape[1]
            ot = st.buf("o", BH, R, Dv)
            mt, lt = st.buf("m", BH, R, 1), st.buf("l", BH, R, 1)
            # The sink starts each row's online softmax (m0 = sink, l0 = 1, o0 = 0: it is one
            # more key with no value), so no pass over the output merges it afterwards.
            sink = None if st.sink2 is None else st.sink_rows(R // G)
            for n, (c0, c1, parts) in enumerate(chunks):
                if fast:
                    kc, vc = st.k3.narrow(1, c0, c1 - c0), st.v3.narrow(1, c0, c1 - c0)
                else:
                    kc, vc = st.chunk_kv(i, c0, c1, parts, masks, p0)
                s, _ = st.scores(qt, alpha, kc, call, i, c0, c1)
                if parts:
                    st.apply_masks(s, i, parts, masks, p0, cached=fast)
                bad = st.bad_columns(c0, c1)
                if bad is not None:  # which rows attend the keys whose V is not finite
                    attended = s[:, :, bad] != -math.inf
                # -- update running max; a row that saw only -inf keeps m = lowest (finite), so
                #    that s - m and m_old - m_new never compute -inf - -inf
                if n == 0:
                    torch.amax(s, -1, keepdim=True, out=mt)
                    if sink is not None:
                        torch.maximum(mt, sink, out=mt)
                    if st.guarded(i):
                        mt.clamp_min_(lowest)
                    s.sub_(mt).exp2_()
                    torch.sum(s, -1, keepdim=True, out=lt)
                    if sink is not None:  # a -inf sink adds 0
                        lt.add_(torch.sub(sink, mt).exp2_())
                else:
                    m_new = torch.maximum(s.amax(-1, keepdim=True), mt)
                    rescale = torch.sub(mt, m_new).exp2_()
                    s.sub_(m_new).exp2_()
                    lt.mul_(rescale).add_(s.sum(-1, keepdim=True))
                    ot.mul_(rescale)
                    mt.copy_(m_new)
                if call.dropout_p > 0:  # l (and so lse) is the undropped normaliser
                    s.mul_(st.dropout_scale(call, i, c0, c1))
                if n == 0:
                    torch.bmm(s, vc, out=ot)  # (B·Hkv, R, span) @ (B·Hkv, span, Dv)
                else:
                    ot.baddbmm_(s, vc)
                if bad is not None:
                    ot.add_(st.nonfinite_part(s[:, :, bad], attended, c0, bad))
            tq = R // G
            m5, l5 = st.buf("m", B, Hkv, G, tq, 1), st.buf("l", B, Hkv, G, tq, 1)
            if lse is not None:  # -inf where l = 0
                torch.add(m5, torch.log2(l5), out=tiles[0][i].unsqueeze(-1))
            # An empty row has l = 0 and o = 0; a non-empty one has l >= 1 (its max gives 2^0).
            if st.guarded(i):
                lt.clamp_min_(1.0)
            if stats is not None:
                tiles[1][i].copy_(m5.squeeze(-1))
                tiles[2][i].copy_(l5.squeeze(-1))
            o5 = st.buf("o", B, Hkv, G, tq, Dv)
            torch.div(o5, l5, out=out_tiles[i])
    return out, lse, stats


def _forward_exact(q, k, v, call: AttentionCall, plan: _Plan, need_lse: bool, safe: bool):
    """:func:`_forward`, redone on the exact path when the cheap one gives NaN/Inf.

    The cheap path adds 0 / -inf masks and multiplies every weight by every V row, which is exact
    for finite inputs whose scores do not overflow; NaN/Inf in the inputs, a score mod's NaN at a
    masked entry or a ``q·k`` overflowing there show up as non-finite output. One reduction of
    the output checks it: finite inputs pay nothing else. Returns ``(out, lse2, stats, safe)``.
    """
    result = _forward(q, k, v, call, plan, need_lse, safe)
    if not safe and not all_finite(result[0]):
        safe = True
        result = _forward(q, k, v, call, plan, need_lse, safe)
    return (*result, safe)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _backward(dout, dlse, q, k, v, out, stats, call: AttentionCall, plan: _Plan, mod_inputs, safe):
    """Gradients ``dq, dk, dv`` and those of ``mod_inputs`` (None where not needed).

    Per tile, with ``P = E / l``, ``E = 2^(s - m2)`` recomputed from the forward's row max ``m2``
    and row sum ``l`` (``stats``): ``dP = dO Vᵀ`` (times ``keep/(1-p)`` under dropout),
    ``dS = P ∘ (dP − Δ)`` with ``Δ = rowsum(dO ∘ O) − dlse``, ``dV += P_dropᵀ dO``,
    ``dQ += dS K · scale``, ``dK += dSᵀ Q · scale`` (the G query heads of a kv head are rows of
    the same matmul, so dK/dV sum over them for free). ``1/l`` rides on ``dO`` and ``Δ``
    (``dS = E ∘ (dO/l Vᵀ − Δ/l)``, ``dV += Eᵀ dO/l``): no pass over the tile for it. Keeping
    ``m2`` and ``l`` apart, not as one fp32 ``lse2 = m2 + log2 l``, keeps ``s - m2`` exact: with
    scores near 70 the rounding of ``lse2`` alone made dQ/dK errors 3.5-6.3x the naive fp32 ones
    (flash-attention's backward-overflow inputs); now they are ~1x.
    """
    st = _Setup(q, k, v, call, plan, safe)
    B, Hkv, G, BH, cd, D, Dv, Sq = st.B, st.Hkv, st.G, st.BH, st.cd, st.D, st.Dv, st.Sq
    has_mod = call.score_mod is not None
    c = call.scale * (1.0 if has_mod else LOG2E)
    do_tiles = st.row_tiles(dout, "do")
    out5 = out.reshape(B, Hkv, G, Sq, Dv)
    m5, inv_l5 = (t.view(B, Hkv, G, Sq, 1) for t in (stats[0], stats[1].reciprocal()))
    dlse5 = None if dlse is None else dlse.to(cd).reshape(B, Hkv, G, Sq, 1)
    dq = torch.empty(B, st.Hq, Sq, D, dtype=q.dtype, device=st.device)
    dq5 = dq.view(B, Hkv, G, Sq, D)
    dk3 = torch.zeros(BH, st.Sk, D, dtype=cd, device=st.device)
    dv3 = torch.zeros(BH, st.Sk, Dv, dtype=cd, device=st.device)
    mod_grads: list = [None] * len(mod_inputs)
    want = [i for i, t in enumerate(mod_inputs) if t is not None and t.requires_grad]

    for i0, i1, p0, p1 in plan.groups:
        masks = st.group_masks(call, plan, p0, p1)
        for i in range(i0, i1):
            r0, r1 = st.rows(i)
            tq, R = r1 - r0, G * (r1 - r0)
            if not plan.chunks[i]:
                dq5[:, :, :, r0:r1].zero_()
                continue
            qt, qk = st.q_tile(i, c)
            alpha = 1.0 if qk == c else c / qk
            dk_alpha = call.scale / qk if qk != 0 else 0.0  # dK needs q · scale = qt · scale / qk
            dot = do_tiles(i)[0]  # (B·Hkv, R, Dv)
            mt = m5[:, :, :, r0:r1].reshape(BH, R, 1)
            inv_lt = inv_l5[:, :, :, r0:r1].reshape(BH, R, 1)
            dot_l = torch.mul(dot, inv_lt, out=st.buf("dol", BH, R, Dv))  # dO / l
            dlt = None if dlse5 is None else dlse5[:, :, :, r0:r1].reshape(BH, R, 1)
            # Δ = rowsum(dO ∘ O) − dlse. A tile whose keys fit one chunk recomputes rowsum(P ∘ dP)
            # instead (equal in exact arithmetic) from the very dP it is subtracted from: then
            # dP − Δ cancels exactly where it should (a row with a single key has dS = 0).
            one_chunk = len(plan.chunks[i]) == 1
            if not one_chunk:
                dt = (dot * out5[:, :, :, r0:r1].reshape(BH, R, Dv).to(cd)).sum(-1, keepdim=True)
                if dlt is not None:
                    dt.sub_(dlt)
                dt.mul_(inv_lt)  # Δ / l
            dqt = st.buf("dq", BH, R, D)
            first = True
            for c0, c1, parts in plan.chunks[i]:
                span = c1 - c0
                kc, vc = st.chunk_kv(i, c0, c1, parts, masks, p0)
                s, leaves = st.scores(qt, alpha, kc, call, i, c0, c1, leaf=has_mod)
                if parts:
                    st.apply_masks(s, i, parts, masks, p0)
                bad = st.bad_columns(c0, c1)
                if bad is not None:
                    attended = s[:, :, bad] != -math.inf
                e = s.sub_(mt).exp2_()  # (B·Hkv, R, span): the weights times l, recomputed
                dp = st.buf("dp", BH, R, span)
                torch.bmm(dot_l, vc.transpose(1, 2), out=dp)  # dO Vᵀ / l
                if bad is not None:  # dO · v at the non-finite V entries a row attends
                    vb = st.v3[:, c0 + bad].transpose(1, 2)
                    dp[:, :, bad] = torch.where(attended, dot_l @ vb, dp[:, :, bad])
                if call.dropout_p > 0:
                    keep = st.dropout_scale(call, i, c0, c1)
                    dp.mul_(keep)
                    dv3[:, c0:c1].baddbmm_((e * keep).transpose(1, 2), dot_l)
                else:
                    dv3[:, c0:c1].baddbmm_(e.transpose(1, 2), dot_l)
                # dS = P ∘ (dP − Δ) = E ∘ (dP/l − Δ/l), w.r.t. the (modded) score
                if one_chunk:
                    dp.mul_(e)
                    dt = dp.sum(-1, keepdim=True)  # rowsum(P ∘ dP) = rowsum(dO ∘ O)
                    if dlt is not None:
                        dt.sub_(dlt)
                    ds = dp.addcmul_(e, dt.mul_(inv_lt), value=-1.0)
                else:
                    ds = dp.sub_(dt).mul_(e)
                if st.safe and parts:  # a NaN row (0 · NaN) must not reach the keys it masks
                    st.apply_masks(ds, i, parts, masks, p0, value=0.0)
                if has_mod:
                    ds = _through_mod(ds, leaves, mod_inputs, want, mod_grads, st, cd)
                if first:
                    torch.bmm(ds, kc, out=dqt)  # times scale once per tile, below
                else:
                    dqt.baddbmm_(ds, kc)
                dk3[:, c0:c1].baddbmm_(ds.transpose(1, 2), qt, alpha=dk_alpha)
                first = False
            torch.mul(dqt.view(B, Hkv, G, tq, D), call.scale, out=dq5[:, :, :, r0:r1])

    dk = dk3.view(B, Hkv, st.Sk, D).to(k.dtype)
    dv = dv3.view(B, Hkv, st.Sk, Dv).to(v.dtype)
    for j in want:
        if mod_grads[j] is None:
            mod_grads[j] = torch.zeros_like(mod_inputs[j])
        else:
            mod_grads[j] = mod_grads[j].to(mod_inputs[j].dtype)
    return dq, dk, dv, mod_grads


def _through_mod(ds, leaves, mod_inputs, want, mod_grads, st: _Setup, cd):
    """Chain ``dS`` (w.r.t. the modded score) through the score mod by autograd on this tile.

    Returns ``dS`` w.r.t. the natural-unit scaled score and accumulates the mod tensors' grads.
    """
    s_nat, s_mod = leaves
    inputs = [s_nat] + [mod_inputs[j] for j in want]
    grads = [None] * len(inputs)
    if s_mod.requires_grad:  # a mod may ignore the score (and every tensor)
        grads = torch.autograd.grad(
            s_mod, inputs, ds.view(s_mod.shape).to(s_mod.dtype), allow_unused=True
        )
    for j, g in zip(want, grads[1:]):
        if g is not None:
            mod_grads[j] = g if mod_grads[j] is None else mod_grads[j] + g
    if grads[0] is None:
        return torch.zeros_like(ds)
    return grads[0].to(cd).reshape(ds.shape)


class _ChunkedAttention(torch.autograd.Function):
    """Forward by tiles; backward by recomputed tiles from the saved ``q, k, v, out`` and row
    statistics. ``safe``: start on the exact path (else it is taken when the cheap one gives
    NaN/Inf); the backward takes the path the forward ended on.

    The score mod's tensors come in as extra inputs so that their gradients are routed back.
    """

    @staticmethod
    def forward(ctx, q, k, v, call, plan, safe, sinks, *mod_inputs):
        out, lse2, (m2, l), safe = _forward_exact(q, k, v, call, plan, True, safe)
        ctx.call, ctx.plan, ctx.safe = call, plan, safe
        ctx.save_for_backward(q, k, v, out, m2, l, *mod_inputs)
        return out, lse2 * LN2

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, m2, l, *mod_inputs = ctx.saved_tensors
        mod_inputs = [t if ctx.needs_input_grad[7 + j] else None for j, t in enumerate(mod_inputs)]
        call = ctx.call
        dq, dk, dv, mod_grads = _backward(
            dout, dlse, q, k, v, out, (m2, l), call, ctx.plan, mod_inputs, ctx.safe
        )
        dsinks = None
        if ctx.needs_input_grad[6]:
            dsinks = _sink_grad(dout, dlse, out, m2, l, call.sinks)
        return dq, dk, dv, None, None, None, dsinks, *mod_grads


def _sink_grad(dout, dlse, out, m2, l, sinks):
    """``d sinks (Hq,) = -Σ_{b, rows} p_sink · Δ``: the sink is a key with no value, so its score
    gets ``dS = P ∘ (dP − Δ)`` with ``dP = 0``; ``p_sink = 2^(sink2 - m2) / l`` from the row
    statistics the sink started (``Δ = rowsum(dO ∘ O) − dlse``)."""
    cd = m2.dtype
    delta = (dout.to(cd) * out.to(cd)).sum(-1)  # (B, Hq, Sq)
    if dlse is not None:
        delta = delta - dlse.to(cd)
    p_sink = torch.exp2(sinks.detach().to(cd).view(1, -1, 1) * LOG2E - m2) / l
    return (-(p_sink * delta).sum((0, 2))).to(sinks.dtype)


def _mod_inputs(call: AttentionCall) -> tuple[torch.Tensor, ...]:
    if call.score_mod is None:
        return ()
    seen, out = set(), []
    for t in call.score_mod.tensors():
        if isinstance(t, torch.Tensor) and id(t) not in seen:  # a tensor listed twice counts once
            seen.add(id(t))
            out.append(t)
    return tuple(out)


def run(q, k, v, call: AttentionCall, block_q=None, block_k=None, max_chunk=None, exact=False):
    """``(out, lse or None)`` by tiles; see the module docstring.

    ``block_q`` / ``block_k`` / ``max_chunk`` override the automatic tiling (:func:`tile_sizes`,
    then merging of query tiles for masks with few PARTIAL tiles); tests use small tiles to cross
    tile boundaries at small sizes. Any positive ints are valid. ``exact``: go straight to the
    exact path for NaN/Inf (other backends hand such inputs here, known to be non-finite).
    """
    if call.sinks is not None and not bool((call.sinks < math.inf).all()):
        # +inf / NaN sinks: merged after the tiles, from the lse (_common.merge_sinks states
        # what they give); finite and -inf sinks start each row's softmax (_forward)
        tiles = {"block_q": block_q, "block_k": block_k, "max_chunk": max_chunk}
        return run_with_sinks(functools.partial(run, **tiles, exact=exact), q, k, v, call)
    B, Hq, Sq, _ = q.shape
    Sk, G = k.shape[2], Hq // k.shape[1]
    if 0 in (B, Hq, Sq, Sk):  # nothing to tile (attention() handles these before dispatch)
        zero = q.sum() * 0 + k.sum() * 0 + v.sum() * 0  # keeps gradients 0, not None
        out = q.new_zeros(B, Hq, Sq, v.shape[3]) + zero
        lse = torch.full((B, Hq, Sq), -math.inf, dtype=accumulation_dtype(q.dtype))
        return out, (lse.to(q.device) if call.return_lse else None)
    for name, value in (("block_q", block_q), ("block_k", block_k), ("max_chunk", max_chunk)):
        if value is not None:
            positive_int(value, name)
    fine_q, fine_k, _ = tile_sizes(Sq, Sk, G)
    bk = block_k or fine_k
    if block_q is None and block_k is None:
        grid = fine_grid(call, B, Hq, Sq, Sk, G, q.device)
    else:
        grid = _grid(call, B, Hq, Sq, Sk, min(block_q or fine_q, Sq), bk, q.device)
    if block_q is None:
        factor = _choose_rows(grid, G)
        if factor > 1:
            grid = grid.coarsen(factor)
    kc = max(max_chunk or _max_chunk(G * grid.block_q, Sk), bk)
    plan = _plan(grid, Sq, Sk, bk, kc)
    mod_inputs = _mod_inputs(call)
    if grad_needed(q, k, v, call):
        out, lse = _ChunkedAttention.apply(q, k, v, call, plan, exact, call.sinks, *mod_inputs)
    else:
        out, lse2, _, _ = _forward_exact(q, k, v, call, plan, call.return_lse, exact)
        lse = None if lse2 is None else lse2 * LN2
    return out, (lse if call.return_lse else None)


# ----------------------------------------------------------------------------------------------
# Capability
# ----------------------------------------------------------------------------------------------


def _unlisted_grad_source(mod, call: AttentionCall, q) -> bool:
    """Does ``mod`` read a tensor requiring grad that its ``tensors()`` does not list?

    Probes the mod once on a 1-element score that does not require grad and walks the autograd
    graph of the result, stopping at the listed tensors; any other leaf is a gradient this
    backend could not route.
    """
    score = torch.zeros(1, 1, 1, 1, dtype=accumulation_dtype(q.dtype), device=q.device)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
    try:
        with torch.enable_grad():
            r = mod.score_mod(score, zero, zero, zero + call.q_offset, zero)
    except Exception as e:
        if callable_failure(e):  # out of memory or the user's own error: raise it once, here
            raise
        return False  # let the real call raise its error with the full-size arguments
    if not isinstance(r, torch.Tensor) or not r.requires_grad:
        return False
    listed = {id(t) for t in mod.tensors() if isinstance(t, torch.Tensor)}
    stops = {t.grad_fn for t in mod.tensors() if isinstance(t, torch.Tensor) and t.grad_fn}
    todo, seen = [r.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf tensor
            if id(node.variable) not in listed:
                return True
            continue
        todo.extend(nxt for nxt, _ in node.next_functions)
    return False


def reject(q, k, v, call: AttentionCall) -> str | None:
    if (
        call.score_mod is not None
        and torch.is_grad_enabled()
        and _unlisted_grad_source(call.score_mod, call, q)
    ):
        return (
            f"score_mod {call.score_mod!r} reads a tensor that requires grad but is not listed in "
            "its tensors(), so its gradient cannot be routed through the recomputing backward; "
            "wrap it in a selfattn.scores.ScoreMod subclass whose tensors() returns that tensor, "
            "or use backend='reference'"
        )
    return None


# Per pair against sdpa's 1 (backends/_auto.py): chunked on the non-empty tiles and sdpa with a
# dense mask on every pair take about the same time at half the tiles empty.
_COST = Cost(2.0, "online softmax over tiles, skipping empty ones", sparse=True)
# Under torch.compile its tile plan reads the mask's values (a graph break), and the density
# estimate that would rank it does too: it goes after every fused kernel, before the last resorts
# (flex on CPU, reference).
_TRACED = Cost(10.0, "under torch.compile its tile plan reads mask values")


# Its per-call set-up (tile plan, partial-tile masks, per-tile dispatch) in sdpa-pairs: ~0.4 ms
# more than sdpa for a decode step of 4 heads over 513 keys with a window mask (0.51 against 0.125
# ms, one thread), i.e. sdpa's time for ~1e5 pairs (cpu_fused's figure).
_OVERHEAD_PAIRS = 1e5


# A one-row call whose backward follows, on CPU: sdpa's decode backward takes ~80 ns a pair
# (against 2-7 on prefills) and cpu_fused packs all of K/V for the row, while chunked's tile
# matmuls stay cheap: crossover --threads 2 measured chunked at 0.30-0.90x sdpa's
# time on all 5 such rows (fp32/bf16, 8 and GQA 32/8 heads, Sk=4096, none/causal), the
# fastest of the three on each. Its set-up is small next to that backward: no fixed term.
_DECODE_BACKWARD = Cost(
    0.5, "online softmax over tiles: a one-row forward + backward on CPU", sparse=True
)


def cost(q, k, v, call: AttentionCall) -> Cost:
    if torch.compiler.is_compiling():
        return _TRACED
    if q.shape[2] == 1 and q.device.type == "cpu" and grad_needed(q, k, v, call):
        return _DECODE_BACKWARD
    return dataclasses.replace(_COST, fixed=setup_per_pair(_OVERHEAD_PAIRS, q, k))


register(
    Backend(
        "chunked",
        run,
        reject,
        cost=cost,
        supports=BASE_FIELDS["dense"] | {"sinks"},
        doc=(
            "online softmax over tiles (FlashAttention's algorithm in PyTorch ops): skips empty "
            "tiles, no mask work on full ones; O(S·tile) memory; recomputing backward; any device"
        ),
    )
)
