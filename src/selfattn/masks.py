"""Masks: which (query, key) pairs may attend, in one vocabulary every backend understands.

A mask is a predicate over absolute positions. Query row ``i`` of a call sits at position
``q_offset + i`` and key ``j`` at position ``j`` (see :func:`selfattn.attention`), so the same
``causal()`` means "no peeking ahead" for a full forward and for a cached decode step alike.

Every :class:`Mask` can

- evaluate elementwise: ``mask.mask_mod(b, h, q_idx, kv_idx)`` on broadcastable index tensors
  (FlexAttention's signature; ``h`` is the *query* head);
- classify tiles analytically: ``mask.tile_kinds(grid)`` gives EMPTY / PARTIAL / FULL per
  ``(block_q × block_k)`` tile without evaluating the n² elements, so a backend can skip empty tiles
  and drop the mask on full ones;
- materialise: ``mask.to_dense(Sq, Sk, B=, H=)`` -> bool ``(B, H, Sq, Sk)``;
- print: ``mask.render(Sq, Sk)`` (█ attend, · masked).

Masks combine with ``&``, ``|`` and ``~``. Plain callables ``mask_mod(b, h, q_idx, kv_idx) -> bool``
and bool tensors are accepted wherever a mask is (see :func:`as_mask`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "CallableMask",
    "Mask",
    "TileGrid",
    "TileKind",
    "as_mask",
    "block_sparse",
    "causal",
    "chunked",
    "documents",
    "from_tensor",
    "padding",
    "prefix_lm",
    "sliding_window",
]


class TileKind(IntEnum):
    """How a tile of the (query, key) grid is masked. Ordered so that ``&`` is min and ``|`` is max."""

    EMPTY = 0  # no pair attends: skip the tile
    PARTIAL = 1  # some pairs attend: evaluate the mask elementwise
    FULL = 2  # every pair attends: no mask work at all


EMPTY, PARTIAL, FULL = TileKind.EMPTY, TileKind.PARTIAL, TileKind.FULL


@dataclass(frozen=True)
class TileGrid:
    """A tiling of the ``(Sq, Sk)`` score matrix of one call, in absolute positions.

    Query tile ``t`` covers rows ``[t·block_q, min((t+1)·block_q, Sq))``, i.e. positions
    ``q_offset + row``; key tile ``u`` covers key columns ``[u·block_k, min((u+1)·block_k, Sk))``,
    i.e. positions ``kv_offset + column`` (``kv_offset`` is 0 except for a shard of a longer
    sequence, as in ring attention).
    """

    Sq: int
    Sk: int
    block_q: int
    block_k: int
    q_offset: int = 0
    kv_offset: int = 0
    device: torch.device | str | None = None

    @property
    def n_q(self) -> int:
        return max(1, math.ceil(self.Sq / self.block_q))

    @property
    def n_k(self) -> int:
        return max(1, math.ceil(self.Sk / self.block_k))

    def q_first(self) -> torch.Tensor:
        """First absolute query position of each query tile, shape ``(1, 1, n_q, 1)``."""
        t = torch.arange(self.n_q, device=self.device) * self.block_q + self.q_offset
        return t.view(1, 1, -1, 1)

    def q_last(self) -> torch.Tensor:
        """Last (inclusive) absolute query position of each query tile, shape ``(1, 1, n_q, 1)``."""
        t = torch.arange(1, self.n_q + 1, device=self.device) * self.block_q
        return (t.clamp(max=max(self.Sq, 1)) - 1 + self.q_offset).view(1, 1, -1, 1)

    def kv_first(self) -> torch.Tensor:
        """First key position of each key tile, shape ``(1, 1, 1, n_k)``."""
        t = torch.arange(self.n_k, device=self.device) * self.block_k + self.kv_offset
        return t.view(1, 1, 1, -1)

    def kv_last(self) -> torch.Tensor:
        """Last (inclusive) key position of each key tile, shape ``(1, 1, 1, n_k)``."""
        t = torch.arange(1, self.n_k + 1, device=self.device) * self.block_k
        return (t.clamp(max=max(self.Sk, 1)) - 1 + self.kv_offset).view(1, 1, 1, -1)


def _kinds(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """int8 tile kinds from boolean full / empty tensors (empty wins if both, which never happens)."""
    out = torch.full(
        torch.broadcast_shapes(full.shape, empty.shape), int(PARTIAL), dtype=torch.int8
    )
    out = out.to(full.device)
    out[full.expand_as(out)] = int(FULL)
    out[empty.expand_as(out)] = int(EMPTY)
    return out


def _index_grids(B: int, H: int, Sq: int, Sk: int, q_offset: int, device, kv_offset: int = 0):
    """Broadcastable index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q (1,1,Sq,1)``, ``kv (1,1,1,Sk)``."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = (torch.arange(Sq, device=device) + q_offset).view(1, 1, Sq, 1)
    kv = (torch.arange(Sk, device=device) + kv_offset).view(1, 1, 1, Sk)
    return b, h, q, kv


class Mask:
    """Base class of all masks. Subclasses implement ``mask_mod`` and, ideally, ``tile_kinds``."""

    # -- elementwise ---------------------------------------------------------------------------
    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0) -> torch.Tensor:
        """True where query at absolute position ``q_idx`` may attend key ``kv_idx``.

        Arguments are integer tensors that broadcast against each other (``b (B,1,1,1)``,
        ``h (1,H,1,1)``, ``q_idx (1,1,Sq,1)``, ``kv_idx (1,1,1,Sk)`` for a whole call, or 0-d
        tensors under FlexAttention's vmap). ``q_offset`` is only needed by masks given as tensors
        in row order (``from_tensor``), which index row ``q_idx - q_offset``.
        """
        raise NotImplementedError

    def as_mask_mod(self, q_offset: int = 0) -> Callable:
        """This mask as a 4-argument FlexAttention ``mask_mod`` for a call with ``q_offset``."""
        return functools.partial(self.mask_mod, q_offset=q_offset)

    # -- tiles ---------------------------------------------------------------------------------
    def tile_kinds(self, grid: TileGrid, B: int = 1, H: int = 1) -> torch.Tensor:
        """int8 :class:`TileKind` per tile, broadcastable to ``(B, H, grid.n_q, grid.n_k)``.

        The default evaluates the mask elementwise (fine for user callables on modest sizes);
        built-ins override it with an analytic rule that costs O(tiles).
        """
        return _tile_kinds_elementwise(self, grid, B, H)

    def classify(
        self,
        q_range: tuple[int, int],
        kv_range: tuple[int, int],
        B: int = 1,
        H: int = 1,
    ) -> TileKind:
        """Kind of one tile given half-open absolute ranges ``[q_lo, q_hi)`` and ``[kv_lo, kv_hi)``.

        Over all batches and heads: FULL only if full for every (b, h), EMPTY only if empty for all.
        """
        (q_lo, q_hi), (kv_lo, kv_hi) = q_range, kv_range
        if q_hi <= q_lo or kv_hi <= kv_lo:
            raise ValueError(f"empty tile ranges q_range={q_range}, kv_range={kv_range}")
        nq, nk = q_hi - q_lo, kv_hi - kv_lo
        grid = TileGrid(nq, nk, nq, nk, q_offset=q_lo, kv_offset=kv_lo)
        kinds = self.tile_kinds(grid, B, H)
        lo, hi = int(kinds.min()), int(kinds.max())
        return TileKind(lo) if lo == hi else PARTIAL

    # -- checks --------------------------------------------------------------------------------
    def validate(self, B: int, H: int, Sq: int, Sk: int, q_offset: int) -> None:
        """Raise ``ValueError`` naming the values if this mask cannot describe such a call."""

    # -- materialise / print -------------------------------------------------------------------
    def to_dense(
        self,
        Sq: int,
        Sk: int,
        *,
        B: int = 1,
        H: int = 1,
        q_offset: int | None = None,
        device=None,
    ) -> torch.Tensor:
        """Bool ``(B, H, Sq, Sk)`` (an expanded view where the mask does not vary), True = attend.

        ``q_offset`` defaults to ``Sk - Sq``, the bottom-right alignment of :func:`selfattn.attention`.
        """
        q_offset = Sk - Sq if q_offset is None else q_offset
        self.validate(B, H, Sq, Sk, q_offset)
        dense = _evaluate(self.mask_mod, B, H, Sq, Sk, q_offset, device, mask_q_offset=q_offset)
        return dense.expand(B, H, Sq, Sk)

    def render(
        self, Sq: int, Sk: int | None = None, *, q_offset: int | None = None, b=0, h=0
    ) -> str:
        """Text picture, rows = queries, columns = keys: ``█`` attend, ``·`` masked."""
        Sk = Sq if Sk is None else Sk
        dense = self.to_dense(Sq, Sk, B=b + 1, H=h + 1, q_offset=q_offset)[b, h]
        return "\n".join("".join("█" if x else "·" for x in row.tolist()) for row in dense)

    def __str__(self) -> str:
        return repr(self)

    # -- algebra -------------------------------------------------------------------------------
    def __and__(self, other) -> Mask:
        return And(self, as_mask(other))

    def __rand__(self, other) -> Mask:
        return And(as_mask(other), self)

    def __or__(self, other) -> Mask:
        return Or(self, as_mask(other))

    def __ror__(self, other) -> Mask:
        return Or(as_mask(other), self)

    def __invert__(self) -> Mask:
        return Not(self)


def _evaluate(fn, B, H, Sq, Sk, q_offset, device, mask_q_offset=None, kv_offset=0):
    """Evaluate a mask_mod on the whole grid, by broadcasting, else by FlexAttention-style vmap."""
    b, h, q, kv = _index_grids(B, H, Sq, Sk, q_offset, device, kv_offset)
    kwargs = {} if mask_q_offset is None else {"q_offset": mask_q_offset}
    try:
        out = fn(b, h, q, kv, **kwargs)
        out = torch.as_tensor(out, device=q.device)
        torch.broadcast_shapes(out.shape, (B, H, Sq, Sk))
    except Exception:
        f = functools.partial(fn, **kwargs)
        for dim in (3, 2, 1, 0):  # vmap innermost dim first, like FlexAttention's create_mask
            in_dims = [None] * 4
            in_dims[dim] = 0
            f = torch.vmap(f, in_dims=tuple(in_dims), out_dims=0)
        out = f(b.flatten(), h.flatten(), q.flatten(), kv.flatten())
    if out.dtype != torch.bool:
        raise TypeError(
            f"mask_mod must return a bool tensor, got {out.dtype}; "
            "write a comparison such as `q_idx >= kv_idx`"
        )
    while out.dim() < 4:
        out = out.unsqueeze(0)
    return out


def _tile_kinds_elementwise(mask: Mask, grid: TileGrid, B: int, H: int) -> torch.Tensor:
    """Elementwise fallback: evaluate the mask and reduce each tile with any/all."""
    Sq, Sk = max(grid.Sq, 1), max(grid.Sk, 1)
    dense = _evaluate(
        mask.mask_mod, B, H, Sq, Sk, grid.q_offset, grid.device, grid.q_offset, grid.kv_offset
    )
    # Collapse broadcast dims back to size 1 so that the reduction is not repeated per (b, h).
    pad_q, pad_k = grid.n_q * grid.block_q - Sq, grid.n_k * grid.block_k - Sk
    d = dense.contiguous()
    anyv = torch.nn.functional.pad(d, (0, pad_k, 0, pad_q), value=False)
    allv = torch.nn.functional.pad(d, (0, pad_k, 0, pad_q), value=True)
    shape = (d.shape[0], d.shape[1], grid.n_q, grid.block_q, grid.n_k, grid.block_k)
    any_t = anyv.view(shape).any(dim=5).any(dim=3)
    all_t = allv.view(shape).all(dim=5).all(dim=3)
    return _kinds(all_t, ~any_t)


def _as_index_tensor(x, name: str, device=None) -> torch.Tensor:
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    return t.long()


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


# ----------------------------------------------------------------------------------------------
# Built-in masks
# ----------------------------------------------------------------------------------------------


class Causal(Mask):
    """Key ``j`` is visible from query position ``i`` when ``j <= i``."""

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return kv_idx <= q_idx

    def tile_kinds(self, grid, B=1, H=1):
        return _kinds(grid.kv_last() <= grid.q_first(), grid.kv_first() > grid.q_last())

    def __repr__(self) -> str:
        return "causal()"


def causal() -> Mask:
    """Causal mask: query at position ``i`` sees keys ``j <= i`` (bottom-right aligned by default).

    With ``Sq=2, Sk=5`` and the default ``q_offset = Sk - Sq = 3``::

        keys  0 1 2 3 4
        q0    █ █ █ █ ·     (position 3)
        q1    █ █ █ █ █     (position 4)
    """
    return Causal()


class SlidingWindow(Mask):
    def __init__(self, size: int):
        self.size = _check_positive_int(size, "sliding_window size")

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - self.size)

    def tile_kinds(self, grid, B=1, H=1):
        qf, ql, kf, kl = grid.q_first(), grid.q_last(), grid.kv_first(), grid.kv_last()
        full = (kl <= qf) & (kf > ql - self.size)
        empty = (kf > ql) | (kl <= qf - self.size)
        return _kinds(full, empty)

    def __repr__(self) -> str:
        return f"sliding_window({self.size})"


def sliding_window(size: int) -> Mask:
    """Causal local window of ``size`` keys, the query's own token included: ``i - size < j <= i``.

    This is the Mistral / transformers convention (flash-attention's ``window_size=(size-1, 0)``).
    ``size=1`` attends only to itself; ``size >= Sk`` equals :func:`causal`.
    """
    return SlidingWindow(size)


class Chunked(Mask):
    def __init__(self, size: int, causal: bool = True):
        self.size = _check_positive_int(size, "chunked size")
        self.causal = bool(causal)

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        same = torch.div(q_idx, self.size, rounding_mode="floor") == torch.div(
            kv_idx, self.size, rounding_mode="floor"
        )
        return same & (kv_idx <= q_idx) if self.causal else same

    def tile_kinds(self, grid, B=1, H=1):
        s = self.size
        qf, ql, kf, kl = grid.q_first(), grid.q_last(), grid.kv_first(), grid.kv_last()
        cqf, cql = torch.div(qf, s, rounding_mode="floor"), torch.div(ql, s, rounding_mode="floor")
        ckf, ckl = torch.div(kf, s, rounding_mode="floor"), torch.div(kl, s, rounding_mode="floor")
        full = (cqf == cql) & (ckf == ckl) & (cqf == ckf)
        empty = (cql < ckf) | (ckl < cqf)
        if self.causal:
            full = full & (kl <= qf)
            empty = empty | (kf > ql)
        return _kinds(full, empty)

    def __repr__(self) -> str:
        return f"chunked({self.size})" if self.causal else f"chunked({self.size}, causal=False)"


def chunked(size: int, causal: bool = True) -> Mask:
    """Local attention in fixed chunks of ``size`` positions (Llama-4's chunked attention).

    Query ``i`` sees key ``j`` when both fall in the same chunk ``⌊i/size⌋ == ⌊j/size⌋`` and, with
    ``causal=True`` (the Llama-4 default), ``j <= i``. ``causal=False`` gives block-diagonal
    bidirectional chunks.
    """
    return Chunked(size, causal)


class Padding(Mask):
    def __init__(self, lengths):
        self.lengths = _as_index_tensor(lengths, "padding lengths").reshape(-1)
        if bool((self.lengths < 0).any()):
            raise ValueError(f"padding lengths must be >= 0, got {self.lengths.tolist()}")

    def _len(self, device) -> torch.Tensor:
        return self.lengths.to(device).view(-1, 1, 1, 1)

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return kv_idx < self.lengths.to(kv_idx.device)[b]

    def tile_kinds(self, grid, B=1, H=1):
        n = self._len(grid.device)
        return _kinds(grid.kv_last() < n, grid.kv_first() >= n)

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.lengths.numel() != B:
            raise ValueError(
                f"padding(lengths) has {self.lengths.numel()} lengths but the batch has B={B}; "
                "pass one valid-key count per sequence"
            )
        if bool((self.lengths > Sk).any()):
            raise ValueError(
                f"padding lengths {self.lengths.tolist()} exceed the key length Sk={Sk}"
            )

    def __repr__(self) -> str:
        return f"padding({self.lengths.tolist()})"


def padding(lengths) -> Mask:
    """Key padding: sequence ``b`` has ``lengths[b]`` valid keys ``0 .. lengths[b]-1``.

    ``lengths``: ``(B,)`` ints (tensor or list). Keys at or past the length are masked for every query.
    """
    return Padding(lengths)


class Documents(Mask):
    def __init__(self, ids):
        ids = _as_index_tensor(ids, "documents ids")
        if ids.dim() not in (1, 2):
            raise ValueError(f"documents ids must be (S,) or (B, S), got shape {tuple(ids.shape)}")
        self.ids = ids if ids.dim() == 2 else ids.unsqueeze(0)  # (B or 1, S)

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        ids = self.ids.to(q_idx.device)
        bi = b if ids.shape[0] > 1 else torch.zeros_like(b)
        return ids[bi, q_idx] == ids[bi, kv_idx]

    def _tile_range(self, n_tiles, block, first, count, device):
        """Per-tile min and max of ids over positions ``[first, first+count)``: (B', n_tiles) each."""
        ids = self.ids.to(device)[:, first : first + count]
        pad = n_tiles * block - ids.shape[1]
        big = torch.iinfo(torch.int64).max
        lo = torch.nn.functional.pad(ids, (0, pad), value=big).view(ids.shape[0], n_tiles, block)
        hi = torch.nn.functional.pad(ids, (0, pad), value=-big).view(ids.shape[0], n_tiles, block)
        return lo.amin(-1), hi.amax(-1)

    def tile_kinds(self, grid, B=1, H=1):
        d = grid.device
        qmin, qmax = self._tile_range(grid.n_q, grid.block_q, grid.q_offset, grid.Sq, d)
        kmin, kmax = self._tile_range(grid.n_k, grid.block_k, grid.kv_offset, grid.Sk, d)
        qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]
        kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        empty = (qmax < kmin) | (kmax < qmin)
        return _kinds(full, empty)

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.ids.shape[0] not in (1, B):
            raise ValueError(
                f"documents ids have batch {self.ids.shape[0]} but the call has B={B}; "
                "pass ids of shape (S,) or (B, S)"
            )
        need = max(Sk, q_offset + Sq)
        if q_offset < 0 or self.ids.shape[1] < need:
            raise ValueError(
                f"documents ids cover positions 0..{self.ids.shape[1] - 1} but the call needs "
                f"0..{need - 1} (Sq={Sq}, Sk={Sk}, q_offset={q_offset}); pass one id per position"
            )

    def __repr__(self) -> str:
        return f"documents(<ids {tuple(self.ids.shape)}>)"


def documents(ids) -> Mask:
    """Packed sequences: attend only within the same document id.

    ``ids``: ``(S,)`` or ``(B, S)`` integer document id per absolute position. Combine with
    :func:`causal` for packed causal LM training: ``causal() & documents(ids)``.
    """
    return Documents(ids)


class PrefixLM(Mask):
    def __init__(self, length):
        if isinstance(length, int) and not isinstance(length, bool):
            if length < 0:
                raise ValueError(f"prefix_lm length must be >= 0, got {length}")
            self.length = torch.tensor([length])
        else:
            self.length = _as_index_tensor(length, "prefix_lm length").reshape(-1)

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        n = self.length.to(kv_idx.device)
        n = n[b] if n.numel() > 1 else n[0]
        return (kv_idx <= q_idx) | (kv_idx < n)

    def tile_kinds(self, grid, B=1, H=1):
        n = self.length.to(grid.device).view(-1, 1, 1, 1)
        qf, ql, kf, kl = grid.q_first(), grid.q_last(), grid.kv_first(), grid.kv_last()
        return _kinds((kl <= qf) | (kl < n), (kf > ql) & (kf >= n))

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.length.numel() not in (1, B):
            raise ValueError(
                f"prefix_lm has {self.length.numel()} lengths but the batch has B={B}; "
                "pass an int or one length per sequence"
            )

    def __repr__(self) -> str:
        n = self.length.tolist()
        return f"prefix_lm({n[0] if len(n) == 1 else n})"


def prefix_lm(length) -> Mask:
    """Prefix-LM: the first ``length`` positions are visible to everyone, the rest causally.

    ``length``: an int, or ``(B,)`` ints for a per-sequence prefix.
    """
    return PrefixLM(length)


class BlockSparse(Mask):
    def __init__(self, layout, block_size):
        layout = torch.as_tensor(layout)
        if layout.dtype != torch.bool:
            raise TypeError(f"block_sparse layout must be a bool tensor, got {layout.dtype}")
        if layout.dim() < 2 or layout.dim() > 4:
            raise ValueError(
                f"block_sparse layout must be (nQ, nK), (H, nQ, nK) or (B, H, nQ, nK), "
                f"got shape {tuple(layout.shape)}"
            )
        while layout.dim() < 4:
            layout = layout.unsqueeze(0)
        self.layout = layout
        bs = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        if len(bs) != 2:
            raise ValueError(f"block_size must be an int or (block_q, block_k), got {block_size}")
        self.block_q = _check_positive_int(bs[0], "block_sparse block_size")
        self.block_k = _check_positive_int(bs[1], "block_sparse block_size")

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        lay = self.layout.to(q_idx.device)
        bi = b if lay.shape[0] > 1 else torch.zeros_like(b)
        hi = h if lay.shape[1] > 1 else torch.zeros_like(h)
        qb = torch.div(q_idx, self.block_q, rounding_mode="floor")
        kb = torch.div(kv_idx, self.block_k, rounding_mode="floor")
        return lay[bi, hi, qb, kb]

    def tile_kinds(self, grid, B=1, H=1):
        lay = self.layout.to(grid.device).long()
        # 2-D prefix sums so that each tile counts its covered blocks in O(1).
        cs = torch.nn.functional.pad(lay.cumsum(-1).cumsum(-2), (1, 0, 1, 0))
        q0 = torch.div(grid.q_first(), self.block_q, rounding_mode="floor").view(-1)
        q1 = torch.div(grid.q_last(), self.block_q, rounding_mode="floor").view(-1) + 1
        k0 = torch.div(grid.kv_first(), self.block_k, rounding_mode="floor").view(-1)
        k1 = torch.div(grid.kv_last(), self.block_k, rounding_mode="floor").view(-1) + 1

        def at(qi, ki):
            return cs[:, :, qi][:, :, :, ki]

        count = at(q1, k1) - at(q0, k1) - at(q1, k0) + at(q0, k0)
        total = (q1 - q0).view(1, 1, -1, 1) * (k1 - k0).view(1, 1, 1, -1)
        return _kinds(count == total, count == 0)

    def validate(self, B, H, Sq, Sk, q_offset):
        lb, lh, nq, nk = self.layout.shape
        if lb not in (1, B) or lh not in (1, H):
            raise ValueError(
                f"block_sparse layout shape {tuple(self.layout.shape)} does not broadcast to "
                f"B={B}, H={H}"
            )
        if q_offset < 0 or nq * self.block_q < q_offset + Sq or nk * self.block_k < Sk:
            raise ValueError(
                f"block_sparse layout {nq}x{nk} blocks of {self.block_q}x{self.block_k} covers "
                f"{nq * self.block_q} query and {nk * self.block_k} key positions, but the call "
                f"needs query positions {q_offset}..{q_offset + Sq - 1} and {Sk} keys"
            )

    def __repr__(self) -> str:
        return (
            f"block_sparse(<layout {tuple(self.layout.shape)}>, ({self.block_q}, {self.block_k}))"
        )


def block_sparse(layout, block_size) -> Mask:
    """Block-sparse pattern: query block ``⌊i/bq⌋`` sees key block ``⌊j/bk⌋`` where ``layout`` is True.

    ``layout``: bool ``(nQ, nK)``, ``(H, nQ, nK)`` or ``(B, H, nQ, nK)``; ``block_size``: int or
    ``(bq, bk)``. Blocks are on absolute positions.
    """
    return BlockSparse(layout, block_size)


class TensorMask(Mask):
    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"from_tensor expects a bool tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.bool:
            raise TypeError(
                f"a tensor mask must be bool (True = attend), got {tensor.dtype}; "
                "pass additive float biases as score_mod instead"
            )
        if tensor.dim() < 2 or tensor.dim() > 4:
            raise ValueError(
                f"a tensor mask must broadcast to (B, Hq, Sq, Sk), got shape {tuple(tensor.shape)}"
            )
        while tensor.dim() < 4:
            tensor = tensor.unsqueeze(0)
        self.tensor = tensor

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        t = self.tensor.to(q_idx.device)
        idx = [
            x if n > 1 else torch.zeros_like(x)
            for x, n in zip((b, h, q_idx - q_offset, kv_idx), t.shape)
        ]
        return t[idx[0], idx[1], idx[2], idx[3]]

    def to_dense(self, Sq, Sk, *, B=1, H=1, q_offset=None, device=None):
        self.validate(B, H, Sq, Sk, 0)
        return self.tensor.to(device if device is not None else self.tensor.device).expand(
            B, H, Sq, Sk
        )

    def validate(self, B, H, Sq, Sk, q_offset):
        try:
            torch.broadcast_shapes(self.tensor.shape, (B, H, Sq, Sk))
            ok = all(n in (1, want) for n, want in zip(self.tensor.shape, (B, H, Sq, Sk)))
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"mask of shape {tuple(self.tensor.shape)} does not broadcast to "
                f"(B, Hq, Sq, Sk) = ({B}, {H}, {Sq}, {Sk})"
            )

    def __repr__(self) -> str:
        return f"from_tensor(<bool {tuple(self.tensor.shape)}>)"


def from_tensor(tensor: torch.Tensor) -> Mask:
    """A bool tensor broadcastable to ``(B, Hq, Sq, Sk)`` (True = attend), in row order.

    Row ``i`` of the tensor is query row ``i`` of the call, whatever its ``q_offset``.
    """
    return TensorMask(tensor)


class CallableMask(Mask):
    """Wraps a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (absolute positions)."""

    def __init__(self, fn: Callable):
        if not callable(fn):
            raise TypeError(f"mask must be callable, got {type(fn).__name__}")
        self.fn = fn

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.fn(b, h, q_idx, kv_idx)

    def as_mask_mod(self, q_offset: int = 0) -> Callable:
        return self.fn

    def __repr__(self) -> str:
        return f"mask_mod({getattr(self.fn, '__name__', type(self.fn).__name__)})"


class And(Mask):
    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.a.mask_mod(b, h, q_idx, kv_idx, q_offset) & self.b.mask_mod(
            b, h, q_idx, kv_idx, q_offset
        )

    def tile_kinds(self, grid, B=1, H=1):
        return torch.minimum(self.a.tile_kinds(grid, B, H), self.b.tile_kinds(grid, B, H))

    def validate(self, B, H, Sq, Sk, q_offset):
        self.a.validate(B, H, Sq, Sk, q_offset)
        self.b.validate(B, H, Sq, Sk, q_offset)

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


class Or(And):
    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.a.mask_mod(b, h, q_idx, kv_idx, q_offset) | self.b.mask_mod(
            b, h, q_idx, kv_idx, q_offset
        )

    def tile_kinds(self, grid, B=1, H=1):
        return torch.maximum(self.a.tile_kinds(grid, B, H), self.b.tile_kinds(grid, B, H))

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class Not(Mask):
    def __init__(self, a: Mask):
        self.a = a

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return ~self.a.mask_mod(b, h, q_idx, kv_idx, q_offset)

    def tile_kinds(self, grid, B=1, H=1):
        return int(FULL) - self.a.tile_kinds(grid, B, H)

    def validate(self, B, H, Sq, Sk, q_offset):
        self.a.validate(B, H, Sq, Sk, q_offset)

    def __repr__(self) -> str:
        return f"~{self.a!r}"


def as_mask(mask) -> Mask:
    """Normalise what users pass as ``mask=``: a :class:`Mask`, a bool tensor, or a mask_mod callable."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        return TensorMask(mask)
    if callable(mask):
        return CallableMask(mask)
    raise TypeError(
        f"mask must be a selfattn.masks.Mask, a bool tensor or a mask_mod(b, h, q_idx, kv_idx) "
        f"callable, got {type(mask).__name__}"
    )
