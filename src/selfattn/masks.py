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

Tile classification is *sound* for every mask: EMPTY means no pair of the tile attends and FULL
means every pair does, for each ``(b, h)``. For each built-in leaf it is also *tight* (a tile is
PARTIAL only when it really is mixed); a combination (``&``, ``|``) may call a tile PARTIAL that is
in fact empty or full, which costs a backend some mask work but never a wrong answer.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
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
    """How a tile of the (query, key) grid is masked. Ordered: ``&`` is min and ``|`` is max."""

    EMPTY = 0  # no pair attends: skip the tile
    PARTIAL = 1  # some pairs attend: evaluate the mask elementwise
    FULL = 2  # every pair attends: no mask work at all


EMPTY, PARTIAL, FULL = TileKind.EMPTY, TileKind.PARTIAL, TileKind.FULL

# Above this many (tile pair × distinct id) products, documents() with unsorted ids falls back
# from the exact set-intersection test to the (sound, looser) id-interval test.
_DOCUMENTS_EXACT_BUDGET = 1 << 24


# Every position (query ``q_offset + row``, key ``kv_offset + column``) and every mask size must lie
# in [-POSITION_LIMIT, POSITION_LIMIT]: positions are int64 tensors and masks add and subtract two
# of them (a window's ``q_idx - size``, a tile's ``q_last - kv_first``), which then never wraps.
_POSITION_LIMIT = 1 << 62


def _check_position_span(first: int, count: int, name: str) -> None:
    """ValueError unless positions ``first .. first + count - 1`` lie in ±``_POSITION_LIMIT``.

    ``name`` says where ``first`` came from (``"q_offset"``); a silent int64 wrap would move
    queries to the other end of the sequence and mask them all."""
    last = first + max(count, 1) - 1
    if -_POSITION_LIMIT <= first and last <= _POSITION_LIMIT:
        return
    span = f"position {first}" if last == first else f"positions {first}..{last}"
    raise ValueError(
        f"{name}={first} puts {span} outside the supported range "
        f"[-2**62, 2**62] = [{-_POSITION_LIMIT}, {_POSITION_LIMIT}] (positions are int64 and "
        "masks take differences of two of them); count positions from the start of the sequence"
    )


def _check_int(value, name: str, minimum: int | None = None) -> int:
    """``value`` as an int (bools and floats rejected), at least ``minimum`` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class TileGrid:
    """A tiling of the ``(Sq, Sk)`` score matrix of one call, in absolute positions.

    Query tile ``t`` covers rows ``[t·block_q, min((t+1)·block_q, Sq))``, i.e. positions
    ``q_offset + row``; key tile ``u`` covers key columns ``[u·block_k, min((u+1)·block_k, Sk))``,
    i.e. positions ``kv_offset + column`` (``kv_offset`` is 0 except for a shard of a longer
    sequence, as in ring attention). The last tile of each axis is ragged when the block does not
    divide the length; ``Sq = 0`` or ``Sk = 0`` gives no tiles on that axis.

    ``row_offset`` is the absolute position of query row 0 *of the call* when this grid covers only
    part of the call's queries (``classify`` builds such grids); only masks given in row order
    (bool tensors) read it. ``None`` means ``q_offset``: the grid starts at the call's row 0.
    """

    Sq: int
    Sk: int
    block_q: int
    block_k: int
    q_offset: int = 0
    kv_offset: int = 0
    device: torch.device | str | None = None
    row_offset: int | None = None

    def __post_init__(self):
        for name in ("Sq", "Sk"):
            _check_int(getattr(self, name), f"TileGrid {name}", 0)
        for name in ("block_q", "block_k"):
            _check_int(getattr(self, name), f"TileGrid {name}", 1)
        for name in ("q_offset", "kv_offset"):
            _check_int(getattr(self, name), f"TileGrid {name}")
        if self.row_offset is not None:
            _check_int(self.row_offset, "TileGrid row_offset")
        _check_position_span(self.q_offset, self.Sq, "TileGrid q_offset")
        _check_position_span(self.kv_offset, self.Sk, "TileGrid kv_offset")

    @property
    def n_q(self) -> int:
        return math.ceil(self.Sq / self.block_q)

    @property
    def n_k(self) -> int:
        return math.ceil(self.Sk / self.block_k)

    @property
    def first_row(self) -> int:
        """Row (in the call's row order) of this grid's first query."""
        return 0 if self.row_offset is None else self.q_offset - self.row_offset

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


def _kinds(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """int8 tile kinds from bool full / empty tensors (empty wins if both, which never happens)."""
    shape = torch.broadcast_shapes(full.shape, empty.shape)
    out = torch.full(shape, int(PARTIAL), dtype=torch.int8, device=full.device)
    out[full.expand(shape)] = int(FULL)
    out[empty.expand(shape)] = int(EMPTY)
    return out


def _index_grids(B: int, H: int, Sq: int, Sk: int, q_offset: int, device, kv_offset: int = 0):
    """Broadcastable index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q (1,1,Sq,1)`` (absolute
    positions ``q_offset + row``), ``kv (1,1,1,Sk)`` (positions ``kv_offset + column``)."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = (torch.arange(Sq, device=device) + q_offset).view(1, 1, Sq, 1)
    kv = (torch.arange(Sk, device=device) + kv_offset).view(1, 1, 1, Sk)
    return b, h, q, kv


class _CallableError(Exception):
    """Mixin for our verdicts on a user callable; the vmap fallback re-raises them untouched."""


class _ReturnTypeError(_CallableError, TypeError):
    pass


class _ReturnShapeError(_CallableError, ValueError):
    pass


def _fn_name(fn) -> str:
    if isinstance(fn, functools.partial):
        return _fn_name(fn.func)
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        return f"{owner!r}.{fn.__name__}"
    return getattr(fn, "__name__", type(fn).__name__)


def _check_arity(fn: Callable, n: int, what: str, params: str, fix: str) -> None:
    """TypeError unless ``fn`` can be called with ``n`` positional arguments (when inspectable)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return
    try:
        sig.bind(*range(n))
    except TypeError:
        raise TypeError(
            f"{what} {_fn_name(fn)}{sig} cannot be called as {what}({params}); {fix}"
        ) from None


# What a callable written for 0-d tensors raises on broadcast index tensors: the ambiguous truth
# value of a Python `if`/`and`/`or` (RuntimeError), `.item()`/`int()`/`math.*` of a many-element
# tensor (RuntimeError, ValueError), a tensor used as a Python list index (TypeError), shape
# mismatches of stack/cat/view (RuntimeError) and tensor indexing (IndexError). Only these exact
# types mean "this code does not broadcast": a subclass (torch.OutOfMemoryError is a RuntimeError,
# the user's own error classes) and every other exception (MemoryError, KeyboardInterrupt) is the
# callable's real failure and propagates as it is, after one call.
_NOT_BROADCASTING = (RuntimeError, ValueError, TypeError, IndexError)
# Exceptions from these packages may be a backend's own failure (a compiler, a kernel); any other
# class was defined by the user's code.
_LIBRARY_PACKAGES = frozenset({"builtins", "torch", "triton", "sympy", "selfattn"})


def _callable_failure(error: BaseException) -> bool:
    """Whether ``error`` is out of memory or of the user's own exception class: what a backend
    that traces a callable (flex's compiler) must pass on untouched instead of retrying or
    falling back, so that the callable fails once and with its own error."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return type(error).__module__.partition(".")[0] not in _LIBRARY_PACKAGES


def _call_elementwise(fn: Callable, args: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """``fn(*args)`` on broadcastable tensors, falling back to ``torch.vmap`` over every element.

    User callables are written for FlexAttention, which calls them on 0-d tensors under vmap;
    most also broadcast, which is much faster, so that is tried first. When the broadcast call
    fails the way code written for 0-d tensors fails (see ``_NOT_BROADCASTING``) or returns a
    shape that is not the broadcast shape of the arguments, ``fn`` is vmapped once per dimension
    (every argument expanded to the broadcast shape, a free view). The result has as many
    dimensions as that shape. Any other exception (out of memory, the callable's own error types)
    propagates unchanged from the first call.
    """
    shape = torch.broadcast_shapes(*(a.shape for a in args))
    first_error: Exception | None = None
    try:
        out = fn(*args)
        if not isinstance(out, torch.Tensor):
            out = torch.tensor(out, device=args[-1].device)
        if torch.broadcast_shapes(out.shape, shape) == shape:
            if out.dim() < len(shape):  # (only then: keep traced graphs free of no-op views)
                out = out.reshape((1,) * (len(shape) - out.dim()) + tuple(out.shape))
            return out
        bad_shape = tuple(out.shape)
    except Exception as e:
        if type(e) not in _NOT_BROADCASTING:
            raise
        first_error, bad_shape = e, None
    if len(shape) == 0:  # already elementwise: nothing to vmap over
        if first_error is not None:
            raise first_error
        raise _ReturnShapeError(
            f"{what} {_fn_name(fn)} returned shape {bad_shape} for 0-d index tensors; "
            "it must return one value per element"
        )
    f = fn
    for _ in shape:  # each level peels the leading dim of every argument
        f = torch.vmap(f, in_dims=0, out_dims=0)
    try:
        out = f(*(a.expand(shape) for a in args))
    except Exception as e:
        if type(e) not in _NOT_BROADCASTING:
            raise
        got = (
            f"raised {type(first_error).__name__}: {first_error}"
            if first_error
            else f"returned shape {bad_shape}"
        )
        raise _ReturnShapeError(
            f"{what} {_fn_name(fn)} failed: on broadcast index tensors of shape {tuple(shape)} it "
            f"{got}; element by element under torch.vmap it raised {type(e).__name__}: {e}. "
            "Write it with tensor operations (torch.where, &, |, comparisons) rather than Python "
            "`if`/`and`/`or` on tensors"
        ) from e
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise _ReturnShapeError(
            f"{what} {_fn_name(fn)} returned {got} for index tensors of shape {tuple(shape)}; "
            "it must return one value per (b, h, q_idx, kv_idx) element"
        )
    return out


def _check_bool(out: torch.Tensor, fn) -> torch.Tensor:
    if out.dtype != torch.bool:
        raise _ReturnTypeError(
            f"mask_mod {_fn_name(fn)} must return a bool tensor (True = attend), got {out.dtype}; "
            "return a comparison such as `q_idx >= kv_idx`, or `.bool()` a 0/1 tensor "
            "(additive float biases belong in score_mod=)"
        )
    return out


def _evaluate(fn, B, H, Sq, Sk, q_offset, device, mask_q_offset=None, kv_offset=0):
    """Evaluate a mask_mod on the whole grid -> bool, 4-D, broadcastable to ``(B, H, Sq, Sk)``.

    Broadcasting is tried first, then FlexAttention-style vmap (see :func:`_call_elementwise`).
    ``mask_q_offset`` is passed to ``fn`` as ``q_offset=`` when given (a :meth:`Mask.mask_mod`).
    """
    b, h, q, kv = _index_grids(B, H, Sq, Sk, q_offset, device, kv_offset)
    f = fn if mask_q_offset is None else functools.partial(fn, q_offset=mask_q_offset)
    out = _check_bool(_call_elementwise(f, (b, h, q, kv), "mask_mod"), fn)
    return out.to(q.device)


# Elements the elementwise tile classification evaluates at once (bounds its memory).
_BAND_ELEMENTS = 1 << 24


def _reduce_tiles(dense: torch.Tensor, grid: TileGrid) -> torch.Tensor:
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
    return _kinds(all_t, ~any_t)


def _tile_kinds_elementwise(mask: Mask, grid: TileGrid, B: int, H: int) -> torch.Tensor:
    """Elementwise fallback: evaluate the mask on the grid and reduce each tile with any/all.

    Exact (tight), but costs one mask evaluation per element. The grid is evaluated in bands of
    whole query tiles of at most ``_BAND_ELEMENTS`` elements, so memory stays bounded at any length.
    """
    row0 = grid.q_offset if grid.row_offset is None else grid.row_offset
    per_row = max(1, B * H * grid.Sk)
    band = max(1, _BAND_ELEMENTS // (per_row * grid.block_q)) * grid.block_q  # whole tiles
    if grid.Sq <= band:
        dense = _evaluate(
            mask.mask_mod, B, H, grid.Sq, grid.Sk, grid.q_offset, grid.device, row0, grid.kv_offset
        )
        return _reduce_tiles(dense, grid)
    parts = []
    for r in range(0, grid.Sq, band):
        n = min(band, grid.Sq - r)
        sub = TileGrid(
            n, grid.Sk, grid.block_q, grid.block_k, grid.q_offset + r, grid.kv_offset,
            grid.device, row0,
        )  # fmt: skip
        dense = _evaluate(
            mask.mask_mod, B, H, n, grid.Sk, sub.q_offset, grid.device, row0, grid.kv_offset
        )
        parts.append(_reduce_tiles(dense, sub))
    lead = (max(t.shape[0] for t in parts), max(t.shape[1] for t in parts))
    return torch.cat([t.expand(*lead, *t.shape[2:]) for t in parts], dim=-2)


def _as_index_tensor(x, name: str, device=None) -> torch.Tensor:
    """Integer tensor (int64) from a tensor, list or number; bool/float/complex raise TypeError."""
    if not isinstance(x, torch.Tensor) and isinstance(x, (list, tuple)) and len(x) == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(
            f"{name} must hold integers, got dtype {t.dtype} ({_preview(t)}); "
            "convert with .long() after rounding"
        )
    return t.long()


def _preview(t: torch.Tensor, n: int = 8) -> str:
    """A short text of a tensor's values for error messages."""
    flat = t.detach().flatten()
    vals = flat[:n].tolist()
    more = ", ..." if flat.numel() > n else ""
    return f"values {vals}{more}" if t.dim() else f"value {t.item()}"


def _check_positive_int(value, name: str, fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}; pass a whole number"
            + (f" ({fix})" if fix else "")
        )
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}" + (f"; {fix}" if fix else ""))
    if value > _POSITION_LIMIT:  # positions minus a size must stay in int64
        raise ValueError(f"{name} must be <= 2**62 ({_POSITION_LIMIT}), got {value}")
    return value


# ----------------------------------------------------------------------------------------------
# The base class
# ----------------------------------------------------------------------------------------------


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
        *,
        q_offset: int = 0,
    ) -> TileKind:
        """Kind of one tile given half-open absolute ranges ``[q_lo, q_hi)`` and ``[kv_lo, kv_hi)``.

        Over all batches and heads: FULL only if full for every (b, h), EMPTY only if empty for
        all. ``q_offset`` is the position of the call's query row 0; only masks given as tensors in
        row order need it (the default 0 makes rows and positions the same).
        """
        (q_lo, q_hi), (kv_lo, kv_hi) = q_range, kv_range
        for name, x in (("q_range", q_lo), ("q_range", q_hi), ("kv_range", kv_lo)):
            _check_int(x, f"classify {name} bound")
        _check_int(kv_hi, "classify kv_range bound")
        if q_hi <= q_lo or kv_hi <= kv_lo:
            raise ValueError(
                f"empty tile ranges q_range={q_range}, kv_range={kv_range}; "
                "pass half-open ranges (lo, hi) with lo < hi"
            )
        nq, nk = q_hi - q_lo, kv_hi - kv_lo
        grid = TileGrid(nq, nk, nq, nk, q_offset=q_lo, kv_offset=kv_lo, row_offset=q_offset)
        kinds = self.tile_kinds(grid, B, H)
        lo, hi = int(kinds.min()), int(kinds.max())
        return TileKind(lo) if lo == hi else PARTIAL

    # -- checks --------------------------------------------------------------------------------
    def validate(self, B: int, H: int, Sq: int, Sk: int, q_offset: int) -> None:
        """Raise ``ValueError`` naming the values if this mask cannot describe such a call."""

    def _batch_heads(self) -> tuple[int, int]:
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
            _check_int(x, f"to_dense {name}", 0)
        q_offset = Sk - Sq if q_offset is None else _check_int(q_offset, "to_dense q_offset")
        _check_position_span(q_offset, Sq, "to_dense q_offset")
        self.validate(B, H, Sq, Sk, q_offset)
        dense = _evaluate(self.mask_mod, B, H, Sq, Sk, q_offset, device, mask_q_offset=q_offset)
        return dense.expand(B, H, Sq, Sk)

    def render(
        self, Sq: int, Sk: int | None = None, *, q_offset: int | None = None, b=0, h=0
    ) -> str:
        """Text picture of batch ``b``, head ``h``: rows = queries, columns = keys, ``█`` attend,
        ``·`` masked. ``Sk`` defaults to ``Sq``, ``q_offset`` to ``Sk - Sq``."""
        Sk = Sq if Sk is None else Sk
        nb, nh = self._batch_heads()
        B, H = max(_check_int(b, "render b", 0) + 1, nb), max(_check_int(h, "render h", 0) + 1, nh)
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


# ----------------------------------------------------------------------------------------------
# Built-in masks. Each tile rule below is exact: a tile covers the positions
# [qf, ql] × [kf, kl] (all integer pairs in that rectangle), and the conditions are the
# "for all pairs" (FULL) and "for no pair" (EMPTY) versions of the mask's formula.
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
        self.size = _check_positive_int(
            size, "sliding_window size", "size counts the query's own token: 1 = only itself"
        )

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - self.size)

    def tile_kinds(self, grid, B=1, H=1):
        # The differences i - j over a tile are the whole interval [qf - kl, ql - kf]; a pair
        # attends iff 0 <= i - j < size.
        qf, ql, kf, kl = grid.q_first(), grid.q_last(), grid.kv_first(), grid.kv_last()
        full = (kl <= qf) & (kf > ql - self.size)
        empty = (kf > ql) | (kl <= qf - self.size)
        return _kinds(full, empty)

    def __repr__(self) -> str:
        return f"sliding_window({self.size})"


def sliding_window(size: int) -> Mask:
    """Causal local window of ``size`` keys, the query's own token included: ``i - size < j <= i``.

    This is the Mistral / transformers convention (flash-attention's ``window_size=(size-1, 0)``).
    ``size=1`` attends only to itself; ``size >= Sk`` equals :func:`causal` under the default
    bottom-right alignment (in general: ``size`` beyond the last query position). With ``size=2``::

        keys  0 1 2 3
        q0    █ · · ·
        q1    █ █ · ·
        q2    · █ █ ·
        q3    · · █ █
    """
    return SlidingWindow(size)


class Chunked(Mask):
    def __init__(self, size: int, causal: bool = True):
        self.size = _check_positive_int(size, "chunked size", "it is the chunk length")
        if not isinstance(causal, bool):
            raise TypeError(f"chunked causal must be True or False, got {causal!r}")
        self.causal = causal

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        same = torch.div(q_idx, self.size, rounding_mode="floor") == torch.div(
            kv_idx, self.size, rounding_mode="floor"
        )
        return same & (kv_idx <= q_idx) if self.causal else same

    def tile_kinds(self, grid, B=1, H=1):
        # Chunk ids of the tile's queries and keys are intervals; with causal=True any chunk the
        # two share holds an attending pair as soon as kf <= ql (take j = max(kf, chunk start),
        # i = min(ql, chunk end)), so the "no pair" test stays exact.
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
    bidirectional chunks. Chunks are on absolute positions (chunk 0 is positions ``0..size-1``).
    """
    return Chunked(size, causal)


def _per_batch_values(x, name: str) -> tuple[torch.Tensor, bool]:
    """Non-negative integer values as a 1-D tensor, and whether they are per batch (1-D input)
    rather than one value for every sequence (an int or a 0-d tensor)."""
    t = _as_index_tensor(x, name)
    if t.dim() > 1:
        raise ValueError(
            f"{name} must be an int or a 1-D (B,) tensor, got shape {tuple(t.shape)}; "
            "pass one value per sequence"
        )
    if bool((t < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {_preview(t)}")
    return t.reshape(-1), t.dim() == 1


class Padding(Mask):
    def __init__(self, lengths):
        self.lengths, self.per_batch = _per_batch_values(lengths, "padding lengths")

    def _n(self, b, device) -> torch.Tensor:
        n = self.lengths.to(device)
        return n[b] if self.per_batch else n[0]

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return kv_idx < self._n(b, kv_idx.device)

    def tile_kinds(self, grid, B=1, H=1):
        n = self.lengths.to(grid.device).view(-1, 1, 1, 1)  # (B or 1, 1, 1, 1)
        return _kinds(grid.kv_last() < n, grid.kv_first() >= n)

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.per_batch and self.lengths.numel() != B:
            raise ValueError(
                f"padding(lengths) has {self.lengths.numel()} lengths {self.lengths.tolist()} but "
                f"the batch has B={B}; pass one valid-key count per sequence"
            )
        if bool((self.lengths > Sk).any()):
            raise ValueError(
                f"padding lengths {self.lengths.tolist()} exceed the key length Sk={Sk}; "
                "a length counts valid keys, at most Sk"
            )

    def _batch_heads(self):
        return (self.lengths.numel() if self.per_batch else 1), 1

    def __repr__(self) -> str:
        n = self.lengths.tolist()
        return f"padding({n if self.per_batch else n[0]})"


def padding(lengths) -> Mask:
    """Key padding: sequence ``b`` has ``lengths[b]`` valid keys ``0 .. lengths[b]-1``.

    ``lengths``: ``(B,)`` ints (tensor or list), or one int for every sequence. Keys at or past the
    length are masked for every query (right padding; left padding is ``~padding(starts)``).
    """
    return Padding(lengths)


class Documents(Mask):
    def __init__(self, ids):
        ids = _as_index_tensor(ids, "documents ids")
        if ids.dim() not in (1, 2):
            raise ValueError(
                f"documents ids must be (S,) or (B, S), got shape {tuple(ids.shape)}; "
                "pass one document id per position"
            )
        self.ids = ids if ids.dim() == 2 else ids.unsqueeze(0)  # (B or 1, S)
        d = self.ids.diff(dim=-1)
        # Sorted ids (the packing case) make the cheap interval test exact (see tile_kinds).
        self._monotone = bool(((d >= 0).all(-1) | (d <= 0).all(-1)).all())

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        ids = self.ids.to(q_idx.device)
        bi = b if ids.shape[0] > 1 else torch.zeros_like(b)
        return ids[bi, q_idx] == ids[bi, kv_idx]

    def _cover_error(self, first: int, last: int, what: str) -> ValueError:
        return ValueError(
            f"documents ids cover positions 0..{self.ids.shape[1] - 1} but the {what} needs "
            f"positions {first}..{last}; pass one id per position (q_offset >= 0)"
        )

    def _ids_at(self, first: int, count: int, device) -> torch.Tensor:
        """ids of positions ``[first, first + count)``: ``(B', count)``."""
        if count and (first < 0 or first + count > self.ids.shape[1]):
            raise self._cover_error(first, first + count - 1, "tile grid")
        return self.ids.to(device)[:, first : first + count]

    def tile_kinds(self, grid, B=1, H=1):
        dev = grid.device
        qi = self._ids_at(grid.q_offset, grid.Sq, dev)  # (B', Sq)
        ki = self._ids_at(grid.kv_offset, grid.Sk, dev)  # (B', Sk)
        qmin, qmax = _tile_min_max(qi, grid.n_q, grid.block_q)  # (B', n_q) each
        kmin, kmax = _tile_min_max(ki, grid.n_k, grid.block_k)
        qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]
        kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        overlap = (qmin <= kmax) & (kmin <= qmax)
        Bi = self.ids.shape[0]
        if self._monotone:
            # Sorted ids: two tiles either share a position or lie apart; apart, the id
            # intervals can only meet at the id of the boundary, which both tiles then hold.
            share = overlap
        else:
            labels = torch.unique(torch.cat([qi, ki], dim=1), return_inverse=True)[1]
            n_ids = int(labels.max()) + 1 if labels.numel() else 1
            if Bi * grid.n_q * grid.n_k * n_ids > _DOCUMENTS_EXACT_BUDGET:
                share = overlap  # sound: an empty intersection is reported as PARTIAL
            else:
                pq = _presence(labels[:, : grid.Sq], grid.n_q, grid.block_q, n_ids)
                pk = _presence(labels[:, grid.Sq :], grid.n_k, grid.block_k, n_ids)
                share = (pq @ pk.transpose(-1, -2) > 0)[:, None]  # (B', 1, n_q, n_k)
        return _kinds(full, ~share)

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.ids.shape[0] not in (1, B):
            raise ValueError(
                f"documents ids have batch {self.ids.shape[0]} (shape {tuple(self.ids.shape)}) "
                f"but the call has B={B}; pass ids of shape (S,) or (B, S)"
            )
        first, last = min(0, q_offset), max(Sk, q_offset + Sq) - 1
        if first < 0 or last >= self.ids.shape[1]:
            raise self._cover_error(first, last, f"call (Sq={Sq}, Sk={Sk}, q_offset={q_offset})")

    def _batch_heads(self):
        return self.ids.shape[0], 1

    def __repr__(self) -> str:
        return f"documents(<ids {tuple(self.ids.shape)}>)"


def _tile_min_max(x: torch.Tensor, n_tiles: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile min and max of ``x (B', S)`` cut into tiles of ``block``: ``(B', n_tiles)`` each."""
    pad = n_tiles * block - x.shape[1]
    if pad:  # repeat the last id: neutral for both min and max of the ragged tile
        x = torch.cat([x, x[:, -1:].expand(x.shape[0], pad)], dim=1)
    x = x.view(x.shape[0], n_tiles, block)
    return x.amin(-1), x.amax(-1)


def _presence(labels: torch.Tensor, n_tiles: int, block: int, n_ids: int) -> torch.Tensor:
    """float ``(B', n_tiles, n_ids)``: 1 where tile ``t`` holds id label ``l``."""
    Bi, S = labels.shape
    tile = torch.arange(S, device=labels.device) // block
    flat = (tile * n_ids).unsqueeze(0) + labels  # (B', S)
    out = torch.zeros(Bi, n_tiles * n_ids, dtype=torch.float32, device=labels.device)
    out.scatter_(1, flat, 1.0)
    return out.view(Bi, n_tiles, n_ids)


def documents(ids) -> Mask:
    """Packed sequences: attend only within the same document id.

    ``ids``: ``(S,)`` or ``(B, S)`` integer document id per absolute position (``S`` at least
    ``max(Sk, q_offset + Sq)``). Combine with :func:`causal` for packed causal LM training:
    ``causal() & documents(ids)``.
    """
    return Documents(ids)


class PrefixLM(Mask):
    def __init__(self, length):
        self.length, self.per_batch = _per_batch_values(length, "prefix_lm length")

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        n = self.length.to(kv_idx.device)
        n = n[b] if self.per_batch else n[0]
        return (kv_idx <= q_idx) | (kv_idx < n)

    def tile_kinds(self, grid, B=1, H=1):
        # attend iff j < max(n, i + 1): full iff kl < max(n, qf + 1), empty iff kf >= max(n, ql + 1)
        n = self.length.to(grid.device).view(-1, 1, 1, 1)  # (B or 1, 1, 1, 1)
        qf, ql, kf, kl = grid.q_first(), grid.q_last(), grid.kv_first(), grid.kv_last()
        return _kinds((kl <= qf) | (kl < n), (kf > ql) & (kf >= n))

    def validate(self, B, H, Sq, Sk, q_offset):
        if self.per_batch and self.length.numel() != B:
            raise ValueError(
                f"prefix_lm has {self.length.numel()} lengths {self.length.tolist()} but the "
                f"batch has B={B}; pass an int or one length per sequence"
            )

    def _batch_heads(self):
        return (self.length.numel() if self.per_batch else 1), 1

    def __repr__(self) -> str:
        n = self.length.tolist()
        return f"prefix_lm({n if self.per_batch else n[0]})"


def prefix_lm(length) -> Mask:
    """Prefix-LM: the first ``length`` positions are visible to everyone, the rest causally.

    ``length``: an int, or ``(B,)`` ints for a per-sequence prefix. Query ``i`` sees key ``j``
    when ``j < length`` or ``j <= i``.
    """
    return PrefixLM(length)


class BlockSparse(Mask):
    def __init__(self, layout, block_size):
        if not isinstance(layout, torch.Tensor):
            layout = torch.as_tensor(layout)
        if layout.dtype != torch.bool:
            raise TypeError(
                f"block_sparse layout must be a bool tensor (True = the blocks attend), got "
                f"{layout.dtype}; convert 0/1 layouts with .bool()"
            )
        if layout.dim() < 2 or layout.dim() > 4:
            raise ValueError(
                f"block_sparse layout must be (nQ, nK), (H, nQ, nK) or (B, H, nQ, nK), "
                f"got shape {tuple(layout.shape)}"
            )
        while layout.dim() < 4:
            layout = layout.unsqueeze(0)
        self.layout = layout  # (B or 1, H or 1, nQ, nK)
        if isinstance(block_size, int) and not isinstance(block_size, bool):
            bs = (block_size, block_size)
        elif isinstance(block_size, (tuple, list)) and len(block_size) == 2:
            bs = tuple(block_size)
        else:
            raise TypeError(
                f"block_sparse block_size must be an int or (block_q, block_k), got {block_size!r}"
            )
        self.block_q = _check_positive_int(bs[0], "block_sparse block_size")
        self.block_k = _check_positive_int(bs[1], "block_sparse block_size")

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        lay = self.layout.to(q_idx.device)
        bi = b if lay.shape[0] > 1 else torch.zeros_like(b)
        hi = h if lay.shape[1] > 1 else torch.zeros_like(h)
        qb = torch.div(q_idx, self.block_q, rounding_mode="floor")
        kb = torch.div(kv_idx, self.block_k, rounding_mode="floor")
        return lay[bi, hi, qb, kb]

    def _check_cover(self, q_first: int, q_last: int, k_first: int, k_last: int, what: str):
        nq, nk = self.layout.shape[2], self.layout.shape[3]
        if q_first < 0 or k_first < 0 or q_last >= nq * self.block_q or k_last >= nk * self.block_k:
            raise ValueError(
                f"block_sparse layout of {nq}x{nk} blocks of {self.block_q}x{self.block_k} covers "
                f"query positions 0..{nq * self.block_q - 1} and keys 0..{nk * self.block_k - 1}, "
                f"but the {what} needs query positions {q_first}..{q_last} and keys "
                f"{k_first}..{k_last}; build the layout for the full length"
            )

    def tile_kinds(self, grid, B=1, H=1):
        if grid.n_q == 0 or grid.n_k == 0:
            return torch.zeros(1, 1, grid.n_q, grid.n_k, dtype=torch.int8, device=grid.device)
        self._check_cover(
            grid.q_offset,
            grid.q_offset + grid.Sq - 1,
            grid.kv_offset,
            grid.kv_offset + grid.Sk - 1,
            "tile grid",
        )
        lay = self.layout.to(grid.device).long()
        # 2-D prefix sums so that each tile counts its covered blocks in O(1). A tile covers the
        # rectangle of blocks [q0, q1) × [k0, k1), each of which holds some pair of the tile.
        cs = torch.nn.functional.pad(lay.cumsum(-1).cumsum(-2), (1, 0, 1, 0))
        q0 = torch.div(grid.q_first(), self.block_q, rounding_mode="floor").view(-1)
        q1 = torch.div(grid.q_last(), self.block_q, rounding_mode="floor").view(-1) + 1
        k0 = torch.div(grid.kv_first(), self.block_k, rounding_mode="floor").view(-1)
        k1 = torch.div(grid.kv_last(), self.block_k, rounding_mode="floor").view(-1) + 1

        def at(qi, ki):
            return cs[:, :, qi][:, :, :, ki]

        count = at(q1, k1) - at(q0, k1) - at(q1, k0) + at(q0, k0)  # (B', H', n_q, n_k)
        total = (q1 - q0).view(1, 1, -1, 1) * (k1 - k0).view(1, 1, 1, -1)
        return _kinds(count == total, count == 0)

    def validate(self, B, H, Sq, Sk, q_offset):
        lb, lh = self.layout.shape[:2]
        if lb not in (1, B) or lh not in (1, H):
            raise ValueError(
                f"block_sparse layout shape {tuple(self.layout.shape)} does not broadcast to "
                f"B={B}, Hq={H}; its leading dims must be 1 or (B, Hq)"
            )
        if Sq and Sk:
            self._check_cover(q_offset, q_offset + Sq - 1, 0, Sk - 1, f"call (q_offset={q_offset})")

    def _batch_heads(self):
        return self.layout.shape[0], self.layout.shape[1]

    def __repr__(self) -> str:
        return (
            f"block_sparse(<layout {tuple(self.layout.shape)}>, ({self.block_q}, {self.block_k}))"
        )


def block_sparse(layout, block_size) -> Mask:
    """Block-sparse: query block ``⌊i/bq⌋`` sees key block ``⌊j/bk⌋`` where ``layout`` is True.

    ``layout``: bool ``(nQ, nK)``, ``(H, nQ, nK)`` or ``(B, H, nQ, nK)``; ``block_size``: int or
    ``(bq, bk)``. Blocks are on absolute positions and must cover every position of a call.
    """
    return BlockSparse(layout, block_size)


class TensorMask(Mask):
    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"from_tensor expects a bool torch.Tensor, got {type(tensor).__name__}; "
                "wrap it with torch.as_tensor(..., dtype=torch.bool)"
            )
        if tensor.dtype != torch.bool:
            raise TypeError(
                f"a tensor mask must be bool (True = attend), got {tensor.dtype}; pass additive "
                "float biases as score_mod= instead, or convert a 0/1 mask with .bool()"
            )
        if tensor.dim() > 4:
            raise ValueError(
                f"a tensor mask must broadcast to (B, Hq, Sq, Sk), got {tensor.dim()}-D shape "
                f"{tuple(tensor.shape)}"
            )
        self.tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        t = self.tensor.to(q_idx.device)
        idx = [
            x if n > 1 else torch.zeros_like(x)
            for x, n in zip((b, h, q_idx - q_offset, kv_idx), t.shape)
        ]
        return t[idx[0], idx[1], idx[2], idx[3]]

    def tile_kinds(self, grid, B=1, H=1):
        # Slice the covered rows and columns instead of gathering element by element.
        t = self.tensor.to(grid.device) if grid.device is not None else self.tensor
        r0, c0 = grid.first_row, grid.kv_offset
        rows, cols = t.shape[2], t.shape[3]
        ok_r = rows == 1 or (r0 >= 0 and r0 + grid.Sq <= rows)
        ok_c = cols == 1 or (c0 >= 0 and c0 + grid.Sk <= cols)
        if not (ok_r and ok_c):
            raise ValueError(
                f"tensor mask of shape {tuple(self.tensor.shape)} has no rows {r0}.."
                f"{r0 + grid.Sq - 1} / key columns {c0}..{c0 + grid.Sk - 1} asked for by the "
                "tile grid; a tensor mask is indexed by query row and key position"
            )
        if rows > 1:
            t = t[:, :, r0 : r0 + grid.Sq]
        if cols > 1:
            t = t[:, :, :, c0 : c0 + grid.Sk]
        return _reduce_tiles(t, grid)

    def to_dense(self, Sq, Sk, *, B=1, H=1, q_offset=None, device=None):
        self.validate(B, H, Sq, Sk, 0)
        return self.tensor.to(device if device is not None else self.tensor.device).expand(
            B, H, Sq, Sk
        )

    def validate(self, B, H, Sq, Sk, q_offset):
        if not all(n in (1, want) for n, want in zip(self.tensor.shape, (B, H, Sq, Sk))):
            raise ValueError(
                f"mask of shape {tuple(self.tensor.shape)} does not broadcast to "
                f"(B, Hq, Sq, Sk) = ({B}, {H}, {Sq}, {Sk}); each dim must be 1 or the call's size"
            )

    def _batch_heads(self):
        return self.tensor.shape[0], self.tensor.shape[1]

    def __repr__(self) -> str:
        return f"from_tensor(<bool {tuple(self.tensor.shape)}>)"


def from_tensor(tensor: torch.Tensor) -> Mask:
    """A bool tensor broadcastable to ``(B, Hq, Sq, Sk)`` (True = attend), in row order.

    Row ``i`` of the tensor is query row ``i`` of the call, whatever its ``q_offset``; column
    ``j`` is key position ``j``.
    """
    return TensorMask(tensor)


class CallableMask(Mask):
    """Wraps a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (absolute
    positions).

    ``mask_mod`` calls it on broadcast index tensors when it broadcasts and falls back to
    ``torch.vmap`` when it does not (FlexAttention calls it on 0-d tensors), and checks that it
    returns bool. Tile classification is elementwise (exact, O(elements)).
    """

    def __init__(self, fn: Callable):
        if not callable(fn):
            raise TypeError(f"mask must be callable, got {type(fn).__name__}")
        _check_arity(
            fn,
            4,
            "mask_mod",
            "b, h, q_idx, kv_idx",
            "a 5-argument score function goes in score_mod=",
        )
        self.fn = fn

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return _check_bool(_call_elementwise(self.fn, (b, h, q_idx, kv_idx), "mask_mod"), self.fn)

    def as_mask_mod(self, q_offset: int = 0) -> Callable:
        return self.fn

    def __repr__(self) -> str:
        return f"mask_mod({_fn_name(self.fn)})"


class And(Mask):
    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.a.mask_mod(b, h, q_idx, kv_idx, q_offset) & self.b.mask_mod(
            b, h, q_idx, kv_idx, q_offset
        )

    def tile_kinds(self, grid, B=1, H=1):
        # sound: EMPTY if either side is, FULL only if both are (per (b, h))
        return torch.minimum(self.a.tile_kinds(grid, B, H), self.b.tile_kinds(grid, B, H))

    def validate(self, B, H, Sq, Sk, q_offset):
        self.a.validate(B, H, Sq, Sk, q_offset)
        self.b.validate(B, H, Sq, Sk, q_offset)

    def _batch_heads(self):
        (ba, ha), (bb, hb) = self.a._batch_heads(), self.b._batch_heads()
        return max(ba, bb), max(ha, hb)

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


class Or(And):
    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.a.mask_mod(b, h, q_idx, kv_idx, q_offset) | self.b.mask_mod(
            b, h, q_idx, kv_idx, q_offset
        )

    def tile_kinds(self, grid, B=1, H=1):
        # sound: FULL if either side is, EMPTY only if both are (per (b, h))
        return torch.maximum(self.a.tile_kinds(grid, B, H), self.b.tile_kinds(grid, B, H))

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class Not(Mask):
    def __init__(self, a: Mask):
        self.a = a

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return ~self.a.mask_mod(b, h, q_idx, kv_idx, q_offset)

    def tile_kinds(self, grid, B=1, H=1):
        # exact: swaps EMPTY and FULL, keeps PARTIAL
        return int(FULL) - self.a.tile_kinds(grid, B, H)

    def validate(self, B, H, Sq, Sk, q_offset):
        self.a.validate(B, H, Sq, Sk, q_offset)

    def _batch_heads(self):
        return self.a._batch_heads()

    def __repr__(self) -> str:
        return f"~{self.a!r}"


def as_mask(mask) -> Mask:
    """Normalise ``mask=``: a :class:`Mask`, a bool tensor, or a mask_mod callable."""
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
