"""Score mods: functions of the scaled score ``s = q·k · scale``, applied before mask and softmax.

A :class:`ScoreMod` maps ``(score, b, h, q_idx, kv_idx) -> new score`` elementwise, with the same
broadcastable index tensors and absolute positions as :mod:`selfattn.masks` (``h`` is the query
head). Built-ins: :func:`alibi`, :func:`softcap`, :func:`bias` and :class:`RelativePositionBias`
(T5). Compose with ``>>`` (``alibi(8) >> softcap(30.0)`` adds ALiBi, then caps) or
:func:`compose`. FlexAttention-style callables and float tensors are accepted wherever a score mod
is (see :func:`as_score_mod`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from selfattn._validate import checked_int
from selfattn.masks.elementwise import ReturnTypeError, call_elementwise, check_arity, fn_name
from selfattn.masks.tensor import RowTensor
from selfattn.masks.tiles import check_position_span

__all__ = [
    "CallableScoreMod",
    "RelativePositionBias",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "as_score_mod",
    "bias",
    "compose",
    "softcap",
]


class ScoreMod:
    """Base class. Subclasses implement :meth:`score_mod`; additive ones also :meth:`bias`."""

    #: True when the mod is ``score + bias(b, h, q, kv)`` with a bias independent of the score,
    #: so that a backend may materialise it as an additive float mask.
    additive: bool = False
    #: True when the mod depends on positions only through ``q_idx - kv_idx`` (and not on ``b``),
    #: so shifting queries and keys by the same amount leaves it unchanged (ring attention).
    relative: bool = False
    #: True when the mod reads a tensor by query *row* (:func:`bias`), so its meaning depends on
    #: the call's ``q_offset`` until :meth:`bind` anchors it (like
    #: :attr:`selfattn.masks.Mask.row_ordered`).
    row_ordered: bool = False

    def score_mod(self, score, b, h, q_idx, kv_idx) -> torch.Tensor:
        """The modified score (FlexAttention's signature, on absolute positions); all arguments
        broadcast (see module docstring)."""
        raise NotImplementedError

    def bias(self, b, h, q_idx, kv_idx) -> torch.Tensor:
        """The additive term of an ``additive`` mod (float, broadcastable)."""
        raise TypeError(f"{self!r} is not an additive score mod")

    def __call__(self, score, b, h, q_idx, kv_idx) -> torch.Tensor:
        return self.score_mod(score, b, h, q_idx, kv_idx)

    def as_score_mod(self) -> Callable:
        """This mod as a 5-argument FlexAttention ``score_mod`` on absolute positions (a user
        callable is returned as it is)."""
        return self.score_mod

    def bind(self, q_offset) -> ScoreMod:
        """This mod with its row-ordered tensors anchored: row ``i`` at position ``q_offset + i``
        (an int or a ``(B,)`` tensor); see :meth:`selfattn.masks.Mask.bind`. Every call binds its
        score mod (:func:`selfattn.call.prepare`); the mod itself when it holds no such tensor. A
        mod that reads data by query row (``row_ordered``) overrides it, as :func:`bias` does."""
        return self

    def shifted(self, kv: int = 0, *, batch: int = 0) -> ScoreMod:
        """This mod for a call over part of its keys and sequences: key column ``j`` at position
        ``j + kv``, batch row ``b`` the mod's row ``b + batch``; the caller validates the whole
        call (see :meth:`selfattn.masks.Mask.shifted`)."""
        check_position_span(checked_int(kv, "shifted kv"), 1, "shifted kv")
        checked_int(batch, "shifted batch", 0)
        return _Shifted(self, kv, batch)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Tensors the mod reads that may require gradients (backends route their gradients)."""
        return ()

    def kernel_terms(
        self, q_offset: int, Sq: int, Sk: int
    ) -> tuple[tuple[str, object], ...] | None:
        """The mod as data a kernel applies, in order, for a call's ``(Sq, Sk)`` scores with query
        row 0 at ``q_offset``: ``("alibi", slopes (Hq,) or (B, Hq))``, ``("bias", a view
        broadcast to (B, Hq, Sq, Sk))`` or ``("softcap", cap)`` terms; None when the mod is not
        made of them (a callable, a table read by bucket)."""
        return None

    def to(self, device) -> ScoreMod:
        """This mod with the constant tensors it reads on ``device`` (compiled kernels cannot
        move a captured tensor between devices). The same object is returned for a device on
        every call, so compiled kernels keyed on it are reused."""
        return self

    def _on_device(self, device, build: Callable[[], ScoreMod]) -> ScoreMod:
        """``build()``'s mod for ``device``, built once and kept (see :meth:`to`)."""
        copies = self.__dict__.setdefault("_device_copies", {})
        key = str(torch.device(device))
        if key not in copies:
            copies[key] = build()
        return copies[key]

    def validate(self, B: int, H: int, Sq: int, Sk: int, q_offset: int) -> None:
        """Raise ``ValueError`` naming the values if this mod cannot serve such a call."""

    def __rshift__(self, other) -> ScoreMod:
        return Compose(self, as_score_mod(other))

    def __rrshift__(self, other) -> ScoreMod:
        return Compose(as_score_mod(other), self)


class Compose(ScoreMod):
    def __init__(self, *mods: ScoreMod):
        flat: list[ScoreMod] = []
        for m in mods:
            flat.extend(m.mods if isinstance(m, Compose) else [m])
        self.mods = tuple(flat)
        self.additive = all(m.additive for m in self.mods)
        self.relative = all(m.relative for m in self.mods)
        self.row_ordered = any(m.row_ordered for m in self.mods)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        for m in self.mods:
            score = m.score_mod(score, b, h, q_idx, kv_idx)
        return score

    def bias(self, b, h, q_idx, kv_idx):
        if not self.additive:
            return super().bias(b, h, q_idx, kv_idx)
        out = self.mods[0].bias(b, h, q_idx, kv_idx)
        for m in self.mods[1:]:
            out = out + m.bias(b, h, q_idx, kv_idx)
        return out

    def bind(self, q_offset) -> ScoreMod:
        bound = tuple(m.bind(q_offset) for m in self.mods)
        return self if all(a is b for a, b in zip(bound, self.mods)) else Compose(*bound)

    def kernel_terms(self, q_offset, Sq, Sk):
        terms = [m.kernel_terms(q_offset, Sq, Sk) for m in self.mods]
        return None if any(t is None for t in terms) else tuple(x for t in terms for x in t)

    def tensors(self):
        return tuple(t for m in self.mods for t in m.tensors())

    def to(self, device) -> ScoreMod:
        moved = tuple(m.to(device) for m in self.mods)
        if all(a is b for a, b in zip(moved, self.mods)):
            return self
        return self._on_device(device, lambda: Compose(*moved))

    def validate(self, B, H, Sq, Sk, q_offset):
        for m in self.mods:
            m.validate(B, H, Sq, Sk, q_offset)

    def __repr__(self) -> str:
        return " >> ".join(repr(m) for m in self.mods)


def compose(*mods) -> ScoreMod:
    """Apply score mods left to right: ``compose(a, b)(s) == b(a(s))``."""
    if not mods:
        raise ValueError("compose() needs at least one score mod")
    return Compose(*(as_score_mod(m) for m in mods))


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al., 2021), float32 ``(n_heads,)``, for any head count.

    For a power of two ``n``, slope ``i`` is ``2^(-8(i+1)/n)``. Otherwise the slopes of the closest
    lower power of two ``m`` are followed by every other slope of ``2m`` (the paper's
    ``get_slopes``).
    """
    checked_int(n_heads, "alibi n_heads", 1, "pass the number of query heads")

    def pow2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    m = 1 << (n_heads.bit_length() - 1)  # the largest power of two <= n_heads, exactly
    slopes = pow2(m)
    if m < n_heads:
        slopes += pow2(2 * m)[0::2][: n_heads - m]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(ScoreMod):
    additive = True
    relative = True  # -slope[h] · |i - j|

    def __init__(self, n_heads: int):
        self.n_heads = n_heads
        self.slopes = alibi_slopes(n_heads)

    def to(self, device) -> ScoreMod:
        if self.slopes.device == torch.device(device):
            return self
        return self._on_device(device, lambda: self._with_slopes(self.slopes.to(device)))

    def _with_slopes(self, slopes: torch.Tensor) -> ALiBi:
        moved = ALiBi(self.n_heads)
        moved.slopes = slopes
        return moved

    def _bias(self, h, q_idx, kv_idx, dtype: torch.dtype) -> torch.Tensor:
        slopes = self.slopes.to(device=h.device, dtype=dtype)[h]
        return -slopes * (q_idx - kv_idx).abs().to(dtype)

    def bias(self, b, h, q_idx, kv_idx):
        return self._bias(h, q_idx, kv_idx, torch.float32)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        # fp64 scores get the (float32) slopes times the distance in fp64, so the fp64 oracle
        # computes exactly what a float32 kernel approximates; half scores still add a fp32 bias.
        dtype = torch.float64 if score.dtype == torch.float64 else torch.float32
        return score + self._bias(h, q_idx, kv_idx, dtype).to(score.dtype)

    def kernel_terms(self, q_offset, Sq, Sk):
        return (("alibi", self.slopes),)

    def validate(self, B, H, Sq, Sk, q_offset):
        if H != self.n_heads:
            raise ValueError(
                f"alibi was built for n_heads={self.n_heads} but the call has Hq={H} query heads; "
                f"build it with alibi({H})"
            )

    def __repr__(self) -> str:
        return f"alibi({self.n_heads})"


def alibi(n_heads: int) -> ScoreMod:
    """ALiBi: add ``-slope[h] · |i - j|`` to the score of query position ``i`` and key ``j``.

    Under a causal mask this is Press et al.'s ``slope · (j - i)``; without one it is the symmetric
    form flash-attention uses. Distances are between absolute positions, so padding and caches keep
    them right.
    """
    return ALiBi(n_heads)


class SoftCap(ScoreMod):
    relative = True  # reads no position at all

    def __init__(self, cap: float):
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise TypeError(
                f"softcap cap must be a number, got {type(cap).__name__} {cap!r}; "
                "pass a float such as 30.0"
            )
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(
                f"softcap cap must be a positive finite number, got {cap!r}; "
                "for no capping pass no softcap"
            )
        self.cap = float(cap)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)

    def kernel_terms(self, q_offset, Sq, Sk):
        return (("softcap", self.cap),)

    def __repr__(self) -> str:
        return f"softcap({self.cap:g})"


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping ``cap · tanh(s / cap)`` (Gemma 2, Grok): scores stay in ``[-cap, cap]``.

    (Open interval in exact arithmetic; in floating point ``tanh`` saturates to ±1.)
    """
    return SoftCap(cap)


class Bias(ScoreMod):
    additive = True
    row_ordered = True

    def __init__(self, tensor: torch.Tensor, *, _rows: RowTensor | None = None):
        if _rows is not None:  # a bound copy (bind): the same tensor, gradients included
            self.rows, self.tensor = _rows, _rows.tensor
            return
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"bias must be a float torch.Tensor, got {type(tensor).__name__}; "
                "wrap it with torch.as_tensor(..., dtype=torch.float32)"
            )
        if tensor.dtype == torch.bool:
            raise TypeError(
                "bias must be a floating-point tensor, got torch.bool; pass bool masks as mask="
            )
        if tensor.dtype.is_complex:
            raise TypeError(
                f"bias must be a real floating-point tensor, got {tensor.dtype}; "
                "pass its real part (tensor.real) if that is what you mean"
            )
        if not tensor.dtype.is_floating_point:
            raise TypeError(
                f"bias must be a floating-point tensor, got {tensor.dtype}; "
                "cast it with .float() (or pass a bool mask as mask=)"
            )
        if tensor.dim() > 4:
            raise ValueError(
                f"bias must broadcast to (B, Hq, Sq, Sk), got {tensor.dim()}-D shape "
                f"{tuple(tensor.shape)}"
            )
        # (…) -> (B or 1, Hq or 1, Sq or 1, Sk or 1); reshape keeps the autograd link to `tensor`
        self.tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))
        self.rows = RowTensor(self.tensor)

    def bind(self, q_offset) -> ScoreMod:
        rows = self.rows.bind(q_offset)
        return self if rows is self.rows else Bias(self.tensor, _rows=rows)

    def dense(self, q_offset: int, Sq: int, Sk: int) -> torch.Tensor:
        """The bias of a call's ``(Sq, Sk)`` scores with query row 0 at ``q_offset``: a view of
        the tensor, ``(B or 1, Hq or 1, Sq or 1, Sk or 1)``."""
        return self.rows.window(q_offset, Sq, 0, Sk, "bias")

    def bias(self, b, h, q_idx, kv_idx):
        return self.rows.at(b, h, q_idx, kv_idx, self)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(b, h, q_idx, kv_idx).to(score.dtype)

    def tensors(self):
        return (self.tensor,)

    def kernel_terms(self, q_offset, Sq, Sk):
        if isinstance(self.rows.rows_at, torch.Tensor):
            return None  # one row offset per sequence: no single strided view
        return (("bias", self.dense(q_offset, Sq, Sk)),)

    def validate(self, B, H, Sq, Sk, q_offset):
        self.rows.validate(B, H, Sq, Sk, q_offset, "bias")

    def __repr__(self) -> str:
        return f"bias(<{self.tensor.dtype} {tuple(self.tensor.shape)}>)"


def bias(tensor: torch.Tensor) -> ScoreMod:
    """Add a float tensor broadcastable to ``(B, Hq, Sq, Sk)`` (row ``i`` = query row ``i``).

    Gradients flow into ``tensor`` when it requires them. ``-inf`` entries act as a mask.
    """
    return Bias(tensor)


class RelativePositionBias(torch.nn.Module, ScoreMod):
    """T5-style learned relative-position bias: a ``(num_buckets, n_heads)`` table read by bucket.

    The relative position ``j - i`` is bucketed exactly (one bucket per offset) below
    ``num_buckets // 2`` (halved again when ``bidirectional``) and logarithmically up to
    ``max_distance``, beyond which all offsets share the last bucket (Raffel et al., 2020).
    """

    additive = True
    relative = True  # a table read by the bucket of j - i

    def __init__(
        self,
        n_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
    ):
        torch.nn.Module.__init__(self)
        for name, value in (
            ("n_heads", n_heads),
            ("num_buckets", num_buckets),
            ("max_distance", max_distance),
        ):
            checked_int(value, f"RelativePositionBias {name}", 1)
        if not isinstance(bidirectional, bool):
            raise TypeError(f"bidirectional must be True or False, got {bidirectional!r}")
        # Half the buckets (per direction when bidirectional) are exact offsets 0..max_exact-1.
        min_buckets = 4 if bidirectional else 2
        if num_buckets < min_buckets:
            raise ValueError(
                f"num_buckets must be >= {min_buckets} (bidirectional={bidirectional}), got "
                f"{num_buckets}; T5 uses 32"
            )
        max_exact = num_buckets // (4 if bidirectional else 2)
        if max_distance <= max_exact:
            raise ValueError(
                f"max_distance ({max_distance}) must exceed the exact-bucket range ({max_exact} "
                f"for num_buckets={num_buckets}, bidirectional={bidirectional}); T5 uses 128"
            )
        self.n_heads, self.num_buckets = n_heads, num_buckets
        self.max_distance, self.bidirectional = max_distance, bidirectional
        self.weight = torch.nn.Parameter(torch.randn(num_buckets, n_heads) * 0.02)

    def bucket(self, relative_position: torch.Tensor) -> torch.Tensor:
        """Bucket id of each relative position ``j - i`` (int64, same shape)."""
        n_buckets, rel = self.num_buckets, relative_position.long()
        out = torch.zeros_like(rel)
        if self.bidirectional:
            n_buckets //= 2
            out = out + (rel > 0).long() * n_buckets
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        max_exact = n_buckets // 2
        is_small = rel < max_exact
        # log-spaced buckets for larger distances; clamp avoids log(0) on the exact branch
        large = (
            max_exact
            + (
                torch.log(rel.clamp(min=1).float() / max_exact)
                / math.log(self.max_distance / max_exact)
                * (n_buckets - max_exact)
            ).long()
        )
        large = large.clamp(max=n_buckets - 1)
        return out + torch.where(is_small, rel, large)

    def bias(self, b, h, q_idx, kv_idx):
        buckets = self.bucket(kv_idx - q_idx)
        return self.weight[buckets.to(self.weight.device), h.to(self.weight.device)]

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(b, h, q_idx, kv_idx).to(score.dtype)

    def tensors(self):
        return (self.weight,)

    def validate(self, B, H, Sq, Sk, q_offset):
        if H != self.n_heads:
            raise ValueError(
                f"RelativePositionBias has n_heads={self.n_heads} but the call has Hq={H} heads; "
                f"build it with RelativePositionBias({H}, ...)"
            )

    def forward(self, Sq: int, Sk: int | None = None, q_offset: int | None = None) -> torch.Tensor:
        """The dense bias ``(1, n_heads, Sq, Sk)`` (T5's ``compute_bias``), bottom-right aligned."""
        Sk = Sq if Sk is None else Sk
        q_offset = Sk - Sq if q_offset is None else q_offset
        dev = self.weight.device
        q = (torch.arange(Sq, device=dev) + q_offset).view(1, 1, -1, 1)
        kv = torch.arange(Sk, device=dev).view(1, 1, 1, -1)
        h = torch.arange(self.n_heads, device=dev).view(1, -1, 1, 1)
        return self.bias(None, h, q, kv)

    def __repr__(self) -> str:
        return (
            f"RelativePositionBias(n_heads={self.n_heads}, num_buckets={self.num_buckets}, "
            f"max_distance={self.max_distance}, bidirectional={self.bidirectional})"
        )


class CallableScoreMod(ScoreMod):
    """Wraps a FlexAttention-style ``score_mod(score, b, h, q_idx, kv_idx) -> score``.

    Called on broadcast tensors when it broadcasts, else under ``torch.vmap`` element by element
    (FlexAttention calls it on 0-d tensors); it must return a floating-point score per element.
    """

    def __init__(self, fn: Callable):
        if not callable(fn):
            raise TypeError(f"score_mod must be callable, got {type(fn).__name__}")
        check_arity(
            fn,
            5,
            "score_mod",
            "score, b, h, q_idx, kv_idx",
            "a 4-argument mask function goes in mask=",
        )
        self.fn = fn

    def score_mod(self, score, b, h, q_idx, kv_idx):
        out = call_elementwise(self.fn, (score, b, h, q_idx, kv_idx), "score_mod")
        if not out.dtype.is_floating_point:
            raise ReturnTypeError(
                f"score_mod {fn_name(self.fn)} must return a floating-point score, got "
                f"{out.dtype}; masks (bool) belong in mask="
            )
        # a mod that ignores `score` may return a smaller, broadcastable tensor. Only touch
        # `out` when needed: under FlexAttention's compile every shape is 0-d.
        if out.shape != score.shape:
            out = out.expand(torch.broadcast_shapes(out.shape, score.shape))
        return out

    def as_score_mod(self) -> Callable:
        return self.fn

    def __repr__(self) -> str:
        return f"score_mod({fn_name(self.fn)})"


class _Shifted(ScoreMod):
    """``inner`` seen from a call whose key ``j`` is at position ``j + kv`` and whose batch row
    ``b`` is ``inner``'s row ``b + batch`` (:meth:`ScoreMod.shifted`)."""

    def __init__(self, inner: ScoreMod, kv: int, batch: int):
        self.inner, self.kv, self.batch = inner, kv, batch
        self.additive, self.row_ordered = inner.additive, inner.row_ordered
        self.relative = inner.relative  # f(q - kv - shift) still depends on q - kv alone

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return self.inner.score_mod(score, b + self.batch, h, q_idx, kv_idx + self.kv)

    def bias(self, b, h, q_idx, kv_idx):
        return self.inner.bias(b + self.batch, h, q_idx, kv_idx + self.kv)

    def bind(self, q_offset) -> ScoreMod:
        inner = self.inner.bind(q_offset)
        return self if inner is self.inner else _Shifted(inner, self.kv, self.batch)

    def tensors(self):
        return self.inner.tensors()

    def to(self, device) -> ScoreMod:
        moved = self.inner.to(device)
        if moved is self.inner:
            return self
        return self._on_device(device, lambda: _Shifted(moved, self.kv, self.batch))

    # validate: nothing to add, the caller checks the whole call (see selfattn.masks.Mask.shifted)

    def __repr__(self) -> str:
        args = [f"kv={self.kv}"] if self.kv else []
        args += [f"batch={self.batch}"] if self.batch else []
        return f"{self.inner!r}.shifted({', '.join(args)})"


def as_score_mod(mod) -> ScoreMod:
    """Normalise ``score_mod=``: a :class:`ScoreMod`, a float tensor (added) or a 5-arg callable."""
    if isinstance(mod, ScoreMod):
        return mod
    if isinstance(mod, torch.Tensor):
        return Bias(mod)
    if callable(mod):
        return CallableScoreMod(mod)
    raise TypeError(
        f"score_mod must be a selfattn.scores.ScoreMod, a float tensor or a "
        f"score_mod(score, b, h, q_idx, kv_idx) callable, got {type(mod).__name__}"
    )
