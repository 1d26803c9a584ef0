"""The mask protocol: :class:`Mask`, the combinators ``&``, ``|``, ``~``, and :func:`as_mask`.

Every question a backend, cache or ring step asks of a mask is a method or property of
:class:`Mask` with a default that composes: a leaf answers for itself, :class:`And`, :class:`Or`
and :class:`Not` answer from their parts. No module outside ``selfattn.masks`` walks a mask tree
or switches on mask classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from selfattn._validate import checked_int
from selfattn.masks.block_mask import FLEX_BLOCK, build_block_mask
from selfattn.masks.elementwise import evaluate
from selfattn.masks.tiles import (
    FULL,
    KEY_UNBOUNDED,
    PARTIAL,
    TileGrid,
    TileKind,
    check_position_span,
    tile_kinds_elementwise,
)

# ----------------------------------------------------------------------------------------------
# The base class
# ----------------------------------------------------------------------------------------------


class Mask:
    """Base class of all masks. Subclasses implement ``mask_mod`` and, ideally, ``tile_kinds``."""

    # -- elementwise ---------------------------------------------------------------------------
    def mask_mod(self, b, h, q_idx, kv_idx) -> torch.Tensor:
        """True where query at absolute position ``q_idx`` may attend key ``kv_idx``
        (FlexAttention's signature, on absolute positions).

        Arguments are integer tensors that broadcast against each other (``b (B,1,1,1)``,
        ``h (1,H,1,1)``, ``q_idx (1,1,Sq,1)``, ``kv_idx (1,1,1,Sk)`` for a whole call, or 0-d
        tensors under FlexAttention's vmap). Masks given as tensors in row order
        (``from_tensor``) answer once bound to the call's positions (:meth:`bind`).
        """
        raise NotImplementedError

    def as_mask_mod(self) -> Callable:
        """This mask as a 4-argument FlexAttention ``mask_mod`` on absolute positions (a user
        callable is returned as it is)."""
        return self.mask_mod

    # -- tiles ---------------------------------------------------------------------------------
    def tile_kinds(self, grid: TileGrid, B: int = 1, H: int = 1) -> torch.Tensor:
        """int8 :class:`TileKind` per tile, broadcastable to ``(B, H, grid.n_q, grid.n_k)``.

        The default evaluates the mask elementwise (fine for user callables on modest sizes);
        built-ins override it with an analytic rule that costs O(tiles).
        """
        return tile_kinds_elementwise(self, grid, B, H)

    def classify(
        self,
        q_range: tuple[int, int],
        kv_range: tuple[int, int],
        B: int = 1,
        H: int = 1,
        *,
        q_offset: int = 0,
    ) -> TileKind:
        """Kind of one tile given half-open absolute ranges ``[q_lo, q_hi)`` and ``[kv_lo, kv_hi)``.

        Over all batches and heads: FULL only if full for every (b, h), EMPTY only if empty for
        all. ``q_offset`` is the position of the call's query row 0: masks given as tensors in
        row order are bound there (:meth:`bind`; the default 0 makes rows and positions the same).
        """
        (q_lo, q_hi), (kv_lo, kv_hi) = q_range, kv_range
        for name, x in (("q_range", q_lo), ("q_range", q_hi), ("kv_range", kv_lo)):
            checked_int(x, f"classify {name} bound")
        checked_int(kv_hi, "classify kv_range bound")
        if q_hi <= q_lo or kv_hi <= kv_lo:
            raise ValueError(
                f"empty tile ranges q_range={q_range}, kv_range={kv_range}; "
                "pass half-open ranges (lo, hi) with lo < hi"
            )
        nq, nk = q_hi - q_lo, kv_hi - kv_lo
        grid = TileGrid(nq, nk, nq, nk, q_offset=q_lo, kv_offset=kv_lo)
        kinds = self.bind(q_offset).tile_kinds(grid, B, H)
        lo, hi = int(kinds.min()), int(kinds.max())
        return TileKind(lo) if lo == hi else PARTIAL

    # -- what consumers ask -----------------------------------------------------------------
    # Each answer has a default that composes: a leaf without an override gives the safe answer
    # (not analytic, no key interval, not relative, not causal, no row-ordered tensor), and a mask
    # built from parts (``children``) answers from them.

    def children(self) -> tuple[Mask, ...]:
        """The masks this one is built from (``&``, ``|``, ``~``, wrappers); ``()`` for a leaf."""
        return ()

    def _with_children(self, parts: tuple[Mask, ...]) -> Mask:
        """This mask built from ``parts`` instead of :meth:`children` (same structure)."""
        raise NotImplementedError(
            f"{type(self).__name__} has parts but no _with_children; implement it so that "
            "bind() can rebuild the mask"
        )

    @property
    def analytic(self) -> bool:
        """True when :meth:`tile_kinds` costs O(tiles), not one evaluation per element: the mask
        overrides it with a rule, and so do all its parts. A paged cache then trims pages by it."""
        overrides = type(self).tile_kinds is not Mask.tile_kinds
        return overrides and all(c.analytic for c in self.children())

    @property
    def row_ordered(self) -> bool:
        """True when the mask reads a tensor by query *row* (``from_tensor``): its meaning depends
        on the call's ``q_offset`` until :meth:`bind` anchors it, and a per-call tensor makes
        the mask a poor cache key."""
        return any(c.row_ordered for c in self.children())

    @property
    def relative(self) -> bool:
        """True when the mask depends on positions only through ``q_idx - kv_idx`` (and not on
        ``b`` or ``h``), so shifting queries and keys by the same amount leaves it unchanged."""
        parts = self.children()
        return bool(parts) and all(c.relative for c in parts)

    @property
    def is_causal(self) -> bool:
        """True when the mask is exactly :func:`causal` (``kv_idx <= q_idx``) for every ``b, h``,
        so a backend may use its own causal kernel instead of any mask."""
        return False

    def key_interval(self, b: torch.Tensor, q_idx: torch.Tensor):
        """The keys query position ``q_idx`` of sequence ``b`` attends, as one half-open
        interval ``(lo, hi)`` of key positions, or None when the mask is not one interval per
        row (for every head).

        ``b`` and ``q_idx`` are int64 tensors that broadcast (``(B, 1)`` and ``(B, Sq)``); ``lo``
        and ``hi`` broadcast to their shape. An unbounded side is ``-KEY_UNBOUNDED`` or
        ``KEY_UNBOUNDED``, beyond every position. Exact where it answers: key ``j`` is attended
        iff ``lo <= j < hi``.
        """
        return None

    @property
    def is_interval(self) -> bool:
        """True when :meth:`key_interval` answers (it never returns None for this mask)."""
        overrides = type(self).key_interval is not Mask.key_interval
        return overrides and all(c.is_interval for c in self.children())

    def key_interval_count(self) -> int | None:
        """How many intervals :meth:`key_intervals` gives per row, or None when it gives none
        (the mask is not a union of a few intervals)."""
        return 1 if self.is_interval else None

    def key_intervals(self, b: torch.Tensor, q_idx: torch.Tensor) -> list | None:
        """The keys row ``q_idx`` of sequence ``b`` attends as a union of
        :meth:`key_interval_count` half-open intervals ``[(lo, hi), ...]`` (possibly empty or
        overlapping), or None: what a kernel that takes a few intervals per row reads (the C
        paged-decode kernel, for StreamingLLM's sinks | window). Same conventions as
        :meth:`key_interval`."""
        return [self.key_interval(b, q_idx)] if self.is_interval else None

    def kernel_form(self) -> tuple[Mask | None, torch.Tensor | None] | None:
        """The mask as data a kernel evaluates per row, or None when it has no such form:
        ``(interval, ids)`` such that key ``j`` is attended from query position ``i`` of
        sequence ``b`` iff ``j`` lies in ``interval.key_interval(b, i)`` (``interval`` None:
        every key) and, with ``ids`` (``(B or 1, S)`` int document ids by absolute position),
        ``ids[b, i] == ids[b, j]``. The Triton kernel reads both as tensors, so a new window,
        document layout or length needs no new kernel."""
        return (self, None) if self.is_interval else None

    # -- positions -----------------------------------------------------------------------------
    def bind(self, q_offset) -> Mask:
        """This mask with its row-ordered tensors anchored to absolute positions: row ``i`` at
        ``q_offset + i`` (an int, or a ``(B,)`` tensor with one offset per sequence).

        :func:`selfattn.call.prepare` binds every call's mask, so ``mask_mod(b, h, q_idx,
        kv_idx)`` takes absolute positions whatever the mask holds. The mask itself when it holds
        no row-ordered tensor (a built-in's analytic tiles stay as they are); parts already bound
        stay bound, so binding twice is binding once. A leaf that reads data by query row
        (``row_ordered``) overrides it, as :class:`~selfattn.masks.TensorMask` does.
        """
        if not self.row_ordered:
            return self
        parts = self.children()
        bound = tuple(p.bind(q_offset) for p in parts)
        if all(a is b for a, b in zip(bound, parts)):
            return self
        return self._with_children(bound)

    def shifted(self, kv: int = 0, *, batch: int = 0) -> Mask:
        """This mask for a call over part of its keys and sequences: the call's key column ``j``
        sits at position ``j + kv`` and its batch row ``b`` is row ``b + batch`` of the mask's.

        A cache that keeps the keys from ``kv`` on (a sliding window), a ring-attention block of
        keys from global position ``kv``, one sequence of a batch. Query positions are the
        call's ``q_offset + i`` as ever. Analytic tile classification and key intervals carry
        over (the shift moves the grid). The shifted mask cannot know where the whole call's
        keys or rows end, so its :meth:`validate` checks nothing: the caller validates this
        mask for the whole call first.
        """
        check_position_span(checked_int(kv, "shifted kv"), 1, "shifted kv")
        checked_int(batch, "shifted batch", 0)
        return _Shifted(self, kv, batch)

    # -- checks --------------------------------------------------------------------------------
    def validate(self, B: int, H: int, Sq: int, Sk: int, q_offset: int) -> None:
        """Raise ``ValueError`` naming the values if this mask cannot describe such a call."""

    def batch_heads(self) -> tuple[int, int]:
        """The ``(B, H)`` this mask was built for (1 where it does not vary); used by render."""
        return 1, 1

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

        ``q_offset`` defaults to ``Sk - Sq``, the bottom-right alignment of
        :func:`selfattn.attention`.
        """
        for name, x in (("Sq", Sq), ("Sk", Sk), ("B", B), ("H", H)):
            checked_int(x, f"to_dense {name}", 0)
        q_offset = Sk - Sq if q_offset is None else checked_int(q_offset, "to_dense q_offset")
        check_position_span(q_offset, Sq, "to_dense q_offset")
        mask = self.bind(q_offset)
        mask.validate(B, H, Sq, Sk, q_offset)
        dense = evaluate(mask.mask_mod, B, H, Sq, Sk, q_offset, device)
        return dense.expand(B, H, Sq, Sk)

    def to_block_mask(
        self,
        B: int | None,
        H: int | None,
        Sq: int,
        Sk: int,
        *,
        q_offset: int | None = None,
        device=None,
        block_size: int | tuple[int, int] | None = None,
    ):
        """This mask as a FlexAttention ``BlockMask``, for ``flex_attention(q, k, v,
        block_mask=...)`` called directly: the same result as ``selfattn.attention(q, k, v,
        mask=self)``.

        Arguments as ``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE)``
        (``B``/``H`` None or 1: the same for every batch / head). ``q_offset`` defaults to
        ``Sk - Sq``, selfattn's bottom-right alignment; FlexAttention's own masks are top-left
        (``q_offset=0``). Blocks come from :meth:`tile_kinds` (O(tiles) for the built-ins),
        ``block_size`` defaults to FlexAttention's 128.
        """
        B, H = 1 if B is None else B, 1 if H is None else H
        for name, x in (("B", B), ("H", H), ("Sq", Sq), ("Sk", Sk)):
            checked_int(x, f"to_block_mask {name}", 0)
        q_offset = Sk - Sq if q_offset is None else checked_int(q_offset, "to_block_mask q_offset")
        check_position_span(q_offset, Sq, "to_block_mask q_offset")
        self.validate(B, H, Sq, Sk, q_offset)
        block_size = FLEX_BLOCK if block_size is None else block_size
        return build_block_mask(self, B, H, Sq, Sk, q_offset, device, block_size)

    def render(
        self, Sq: int, Sk: int | None = None, *, q_offset: int | None = None, b=0, h=0
    ) -> str:
        """Text picture of batch ``b``, head ``h``: rows = queries, columns = keys, ``█`` attend,
        ``·`` masked. ``Sk`` defaults to ``Sq``, ``q_offset`` to ``Sk - Sq``."""
        Sk = Sq if Sk is None else Sk
        nb, nh = self.batch_heads()
        B, H = (
            max(checked_int(b, "render b", 0) + 1, nb),
            max(checked_int(h, "render h", 0) + 1, nh),
        )
        dense = self.to_dense(Sq, Sk, B=B, H=H, q_offset=q_offset)[b, h]
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


class _Combine(Mask):
    """A mask built from ``parts`` by a logical operator (``&``, ``|``, ``~``): what the three
    share (their parts, checks, batch and head sizes, and printing)."""

    _symbol: str

    def __init__(self, *parts: Mask):
        self.parts = parts

    def children(self) -> tuple[Mask, ...]:
        return self.parts

    def _with_children(self, parts):
        return type(self)(*parts)

    def validate(self, B, H, Sq, Sk, q_offset):
        for part in self.parts:
            part.validate(B, H, Sq, Sk, q_offset)

    def batch_heads(self):
        sizes = [part.batch_heads() for part in self.parts]
        return max(b for b, _ in sizes), max(h for _, h in sizes)

    def __repr__(self) -> str:
        if len(self.parts) == 1:
            return f"{self._symbol}{self.parts[0]!r}"
        return "(" + f" {self._symbol} ".join(repr(p) for p in self.parts) + ")"


class And(_Combine):
    _symbol = "&"

    def __init__(self, a: Mask, b: Mask):
        super().__init__(a, b)
        self.a, self.b = a, b

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.a.mask_mod(b, h, q_idx, kv_idx) & self.b.mask_mod(b, h, q_idx, kv_idx)

    def tile_kinds(self, grid, B=1, H=1):
        # sound: EMPTY if either side is, FULL only if both are (per (b, h))
        return torch.minimum(self.a.tile_kinds(grid, B, H), self.b.tile_kinds(grid, B, H))

    def key_interval(self, b, q_idx):
        # an intersection of intervals is an interval
        a, other = self.a.key_interval(b, q_idx), self.b.key_interval(b, q_idx)
        if a is None or other is None:
            return None
        return torch.maximum(a[0], other[0]), torch.minimum(a[1], other[1])

    @property
    def is_causal(self) -> bool:
        return self.a.is_causal and self.b.is_causal

    def key_interval_count(self):
        a, other = self.a.key_interval_count(), self.b.key_interval_count()
        return None if a is None or other is None else a * other  # pairwise intersections

    def key_intervals(self, b, q_idx):
        a, other = self.a.key_intervals(b, q_idx), self.b.key_intervals(b, q_idx)
        if a is None or other is None:
            return None
        return [(torch.maximum(x[0], y[0]), torch.minimum(x[1], y[1])) for x in a for y in other]

    def kernel_form(self):
        # an interval and one set of document ids on either side (two id sets: no form)
        a, other = self.a.kernel_form(), self.b.kernel_form()
        if a is None or other is None or (a[1] is not None and other[1] is not None):
            return None
        parts = [m for m in (a[0], other[0]) if m is not None]
        interval = parts[0] if len(parts) == 1 else (And(*parts) if parts else None)
        return interval, a[1] if a[1] is not None else other[1]


class Or(_Combine):
    _symbol = "|"

    def __init__(self, a: Mask, b: Mask):
        super().__init__(a, b)
        self.a, self.b = a, b

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.a.mask_mod(b, h, q_idx, kv_idx) | self.b.mask_mod(b, h, q_idx, kv_idx)

    def tile_kinds(self, grid, B=1, H=1):
        # sound: FULL if either side is, EMPTY only if both are (per (b, h))
        return torch.maximum(self.a.tile_kinds(grid, B, H), self.b.tile_kinds(grid, B, H))

    # key_interval: a union of intervals need not be one (the default None)

    @property
    def is_causal(self) -> bool:
        return self.a.is_causal and self.b.is_causal

    def key_interval_count(self):
        a, other = self.a.key_interval_count(), self.b.key_interval_count()
        return None if a is None or other is None else a + other

    def key_intervals(self, b, q_idx):
        a, other = self.a.key_intervals(b, q_idx), self.b.key_intervals(b, q_idx)
        return None if a is None or other is None else a + other


class Not(_Combine):
    _symbol = "~"

    def __init__(self, a: Mask):
        super().__init__(a)
        self.a = a

    def mask_mod(self, b, h, q_idx, kv_idx):
        return ~self.a.mask_mod(b, h, q_idx, kv_idx)

    def tile_kinds(self, grid, B=1, H=1):
        # exact: swaps EMPTY and FULL, keeps PARTIAL
        return int(FULL) - self.a.tile_kinds(grid, B, H)

    # key_interval: a complement of an interval is two (the default None)

    def key_interval_count(self):
        return 2 if self.a.is_interval else None

    def key_intervals(self, b, q_idx):
        if not self.a.is_interval:
            return None
        lo, hi = self.a.key_interval(b, q_idx)  # the keys below lo and those from hi on
        return [
            (torch.full_like(lo, -KEY_UNBOUNDED), lo),
            (hi, torch.full_like(hi, KEY_UNBOUNDED)),
        ]


def _shift_bound(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x - by`` for an interval bound, keeping the unbounded sentinels as they are (and int64
    from wrapping)."""
    return torch.where(x.abs() >= KEY_UNBOUNDED, x, x - by)


class _Shifted(Mask):
    """``inner`` seen from a call whose key ``j`` is at position ``j + kv`` and whose batch row
    ``b`` is ``inner``'s row ``b + batch`` (:meth:`Mask.shifted`)."""

    def __init__(self, inner: Mask, kv: int, batch: int):
        self.inner, self.kv, self.batch = inner, kv, batch

    def children(self) -> tuple[Mask, ...]:
        return (self.inner,)

    def _with_children(self, parts):
        return _Shifted(parts[0], self.kv, self.batch)

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.inner.mask_mod(b + self.batch, h, q_idx, kv_idx + self.kv)

    def tile_kinds(self, grid, B=1, H=1):
        moved = dataclasses.replace(grid, kv_offset=grid.kv_offset + self.kv)
        kinds = self.inner.tile_kinds(moved, B + self.batch, H)
        if self.batch and kinds.dim() == 4 and kinds.shape[0] > 1:
            kinds = kinds[self.batch : self.batch + B]
        return kinds

    def key_interval(self, b, q_idx):
        interval = self.inner.key_interval(b + self.batch, q_idx)
        if interval is None:
            return None
        return _shift_bound(interval[0], self.kv), _shift_bound(interval[1], self.kv)

    @property
    def is_causal(self) -> bool:
        return self.kv == 0 and self.inner.is_causal

    def validate(self, B, H, Sq, Sk, q_offset):
        """Nothing to add: the call is part of a larger one (keys from ``kv`` on, a ring block
        in the middle of the sequence, one row of a batch) that its caller checks as a whole;
        the shifted mask cannot know where that call's keys or rows end."""

    def batch_heads(self):
        b, h = self.inner.batch_heads()
        return max(b - self.batch, 1), h

    def __repr__(self) -> str:
        args = [f"kv={self.kv}"] if self.kv else []
        args += [f"batch={self.batch}"] if self.batch else []
        return f"{self.inner!r}.shifted({', '.join(args)})"


# How as_mask turns what is not a Mask into one: ``(accepts, build)`` pairs in the order the
# mask kinds register them (tensor.py, flex.py: each registers itself on import, which the
# package's __init__ does before anyone can call as_mask), and last the plain callable.
_CONVERSIONS: list[tuple[Callable[[object], bool], Callable[[object], Mask]]] = []
_CALLABLE: list[Callable[[object], Mask]] = []


def register_conversion(accepts: Callable[[object], bool], build: Callable, *, last=False) -> None:
    """Let :func:`as_mask` turn objects that ``accepts`` into ``build(obj)``. ``last``: the
    catch-all for plain callables, tried after every other kind (a tensor or ``BlockMask``
    first)."""
    if last:
        _CALLABLE[:] = [build]
    else:
        _CONVERSIONS.append((accepts, build))


def as_mask(mask) -> Mask:
    """Normalise ``mask=``: a :class:`Mask`, a bool tensor, a FlexAttention ``BlockMask``
    (:class:`~selfattn.masks.flex.FlexBlockMask`) or a mask_mod callable."""
    if isinstance(mask, Mask):
        return mask
    for accepts, build in _CONVERSIONS:
        if accepts(mask):
            return build(mask)
    if callable(mask) and _CALLABLE:
        return _CALLABLE[0](mask)
    raise TypeError(
        f"mask must be a selfattn.masks.Mask, a bool tensor, a FlexAttention BlockMask or a "
        f"mask_mod(b, h, q_idx, kv_idx) callable, got {type(mask).__name__}"
    )
