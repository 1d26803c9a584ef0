"""Rotary position embeddings (RoPE) and their context-extension scalings.

RoPE (Su et al. 2021, RoFormer, arXiv:2104.09864) rotates each pair of q/k dims ``(x_a, x_b)``
by the angle ``position * inv_freq[i]`` with ``inv_freq[i] = base^(-2i / r)`` for the ``r =
rotary_dim`` rotated dims, so that ``q·k`` after rotation depends only on the relative offset.

Two pair layouts exist and hold the same rotation up to a permutation of the dims::

    half-split (GPT-NeoX, Llama; default)   pair i = (x[i], x[i + r/2])
    interleaved (GPT-J, RoFormer)           pair i = (x[2i], x[2i + 1])

Dims ``rotary_dim .. head_dim`` (partial rotary, e.g. GPT-NeoX's 25 %) pass through unchanged.

Precision: angles are computed in float64 (``position * inv_freq``) and the cos/sin table is stored
in float32 (float64 for float64 inputs); the rotation runs in that precision and the result is cast
back to ``x.dtype``. Computing angles in bf16/fp16 is a known bug elsewhere: bf16 cannot even
represent position 2^17 + 1, and a float32 product loses ~1e-2 rad at such positions.

Scalings (frozen dataclasses, passed as ``RoPE(..., scaling=...)``) change ``inv_freq`` and may set
an attention factor by which cos and sin are multiplied (as transformers does):

* :class:`Linear` — position interpolation (Chen et al. 2023, arXiv:2306.15595).
* :class:`NTK` — NTK-aware base change (bloc97, 2023, reddit r/LocalLLaMA).
* :class:`DynamicNTK` — NTK with a factor that grows with the current length (emozilla, 2023).
* :class:`YaRN` — NTK-by-parts + attention temperature (Peng et al. 2023, arXiv:2309.00071).
* :class:`Llama3` — Meta Llama 3.1's wavelength-banded interpolation (Meta, 2024).
* :class:`LongRoPE` — searched per-frequency factors (Ding et al. 2024, arXiv:2402.13753).

Frequencies of :class:`DynamicNTK` and :class:`LongRoPE` depend on the sequence length ``L = max
position + 1`` of the call (over the whole batch), so the same token rotates differently in a
call whose positions reach past ``original_max_position``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from selfattn._validate import checked_int, int_at_least, positive_int
from selfattn.positions.sinusoidal import check_position_values

__all__ = [
    "NTK",
    "DynamicNTK",
    "Linear",
    "Llama3",
    "LongRoPE",
    "RoPE",
    "RoPE2D",
    "YaRN",
    "memoisable",
]


def _check_number(owner: str, name: str, value, *, minimum: float, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner} {name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{owner} {name} must be >= {minimum}, got {value}; {fix}")


def _check_factor(owner: str, factor) -> None:
    _check_number(
        owner,
        "factor",
        factor,
        minimum=1.0,
        fix="a factor < 1 would shrink the context; use factor >= 1 (1 = no scaling)",
    )


def _check_length(owner: str, name: str, value) -> None:
    fix = "pass the context length the model was pre-trained with (e.g. 4096)"
    positive_int(value, f"{owner} {name}", fix)


# Frequencies are host data derived from the config, made on the CPU even under a
# ``torch.device("meta")`` context: a model built on meta for loading keeps real tables, the only
# state a checkpoint does not hold.
_HOST = torch.device("cpu")


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """``base^(-2i/dim)`` for ``i < dim/2``, float64 ``(dim/2,)``."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=_HOST) / dim)


@dataclass(frozen=True)
class Linear:
    """Position interpolation (Chen et al. 2023): every frequency divided by ``factor``."""

    factor: float

    def __post_init__(self):
        _check_factor("Linear", self.factor)

    def frequencies(self, base: float, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
        return _default_inv_freq(base, dim) / self.factor, 1.0


@dataclass(frozen=True)
class NTK:
    """NTK-aware scaling (bloc97, 2023): ``base' = base * factor^(d / (d - 2))``, ``d`` rotary dim.

    High frequencies stay nearly unchanged, the lowest one is divided by exactly ``factor``.
    """

    factor: float

    def __post_init__(self):
        _check_factor("NTK", self.factor)

    def frequencies(self, base: float, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
        return _default_inv_freq(base * self.factor ** (dim / (dim - 2)), dim), 1.0


@dataclass(frozen=True)
class DynamicNTK:
    """Dynamic NTK (emozilla, 2023; transformers' ``"dynamic"``).

    With ``L`` the current length (max position + 1) and ``L0 = original_max_position``:
    ``base' = base * ((factor * L / L0) - (factor - 1))^(d / (d - 2))`` when ``L > L0``; the plain
    frequencies otherwise. Frequencies therefore depend on the sequence length of each call.
    """

    factor: float
    original_max_position: int

    def __post_init__(self):
        _check_factor("DynamicNTK", self.factor)
        _check_length("DynamicNTK", "original_max_position", self.original_max_position)

    def frequencies(self, base: float, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
        length = max(seq_len, self.original_max_position)
        ratio = self.factor * length / self.original_max_position - (self.factor - 1)
        return _default_inv_freq(base * ratio ** (dim / (dim - 2)), dim), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # YaRN's attention temperature sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22).
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YaRN:
    """YaRN (Peng et al. 2023): NTK-by-parts interpolation plus an attention factor.

    Dims that turn more than ``beta_fast`` times over ``original_max_position`` keep their
    frequency, dims turning fewer than ``beta_slow`` times are divided by ``factor``, with a linear
    ramp between (the correction range is rounded outwards, as in the paper's code). The
    attention factor is ``attention_factor`` if given, else ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are set (DeepSeek), else ``0.1 ln(factor) + 1``.
    """

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True  # round the correction range outwards (gpt-oss: False, kept exact)

    def __post_init__(self):
        _check_factor("YaRN", self.factor)
        _check_length("YaRN", "original_max_position", self.original_max_position)
        fix = "beta_fast (rotations of the fastest kept dim) must exceed beta_slow; defaults 32, 1"
        _check_ordered("YaRN", ("beta_slow", self.beta_slow), ("beta_fast", self.beta_fast), fix)
        if self.attention_factor is not None:
            _check_number(
                "YaRN", "attention_factor", self.attention_factor, minimum=1e-9, fix="pass > 0"
            )

    def frequencies(self, base: float, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
        if self.attention_factor is not None:
            attn = float(self.attention_factor)
        elif self.mscale and self.mscale_all_dim:
            attn = _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        else:
            attn = _yarn_mscale(self.factor)

        def dim_of(rotations: float) -> float:
            # The dim index whose wavelength fits `rotations` times into the original context.
            return (
                dim
                * math.log(self.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(base))
            )

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = (
            (torch.arange(dim // 2, dtype=torch.float64, device=_HOST) - low) / (high - low)
        ).clamp(0, 1)
        extrapolation = _default_inv_freq(base, dim)
        interpolation = extrapolation / self.factor
        # ramp 0 (fast dims): keep; ramp 1 (slow dims): interpolate.
        return extrapolation * (1 - ramp) + interpolation * ramp, attn


def _check_ordered(owner: str, low: tuple[str, float], high: tuple[str, float], fix: str) -> None:
    """Both positive and ``high > low`` (YaRN's betas, Llama 3.1's frequency factors)."""
    for name, value in (low, high):
        _check_number(owner, name, value, minimum=1e-9, fix=fix)
    if high[1] <= low[1]:
        raise ValueError(f"{owner} {high[0]} ({high[1]}) must be > {low[0]} ({low[1]}); {fix}")


@dataclass(frozen=True)
class Llama3:
    """Llama 3.1 scaling (Meta, 2024): by wavelength ``λ = 2π / inv_freq``.

    ``λ < L0 / high_freq_factor``: kept; ``λ > L0 / low_freq_factor``: divided by ``factor``;
    between: a smooth mix with weight ``(L0 / λ - low_freq_factor) / (high - low)`` on the kept one.
    """

    factor: float
    original_max_position: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        _check_factor("Llama3", self.factor)
        _check_length("Llama3", "original_max_position", self.original_max_position)
        fix = "Llama 3.1 uses low_freq_factor=1, high_freq_factor=4"
        low, high = (
            ("low_freq_factor", self.low_freq_factor),
            ("high_freq_factor", self.high_freq_factor),
        )
        _check_ordered("Llama3", low, high, fix)

    def frequencies(self, base: float, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
        inv_freq = _default_inv_freq(base, dim)
        wavelen = 2 * math.pi / inv_freq
        old = self.original_max_position
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        mixed = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = torch.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor, inv_freq)
        medium = (wavelen >= old / self.high_freq_factor) & (wavelen <= old / self.low_freq_factor)
        return torch.where(medium, mixed, out), 1.0


@dataclass(frozen=True)
class LongRoPE:
    """LongRoPE (Ding et al. 2024; Phi-3): per-frequency divisors found by search.

    ``inv_freq[i] = base^(-2i/d) / f[i]`` with ``f = short_factor`` when the call's length ``L = max
    position + 1 <= original_max_position`` and ``long_factor`` otherwise (so frequencies depend on
    the sequence length). Each list has ``rotary_dim / 2`` entries. The attention factor is
    ``attention_factor`` if given, else ``sqrt(1 + ln(s) / ln(original_max_position))`` with
    ``s = max_position / original_max_position`` (1 when ``max_position`` is None or ``s <= 1``),
    as Phi-3 and transformers compute it from ``max_position_embeddings``.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position: int
    attention_factor: float | None = None
    max_position: int | None = None

    def __post_init__(self):
        _check_length("LongRoPE", "original_max_position", self.original_max_position)
        for name in ("short_factor", "long_factor"):
            values = tuple(float(v) for v in getattr(self, name))
            bad = [v for v in values if not (math.isfinite(v) and v > 0)]
            if bad:
                raise ValueError(
                    f"LongRoPE {name} entries must be finite and > 0, got {bad}; they divide the "
                    "frequencies"
                )
            object.__setattr__(self, name, values)  # lists become hashable tuples
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"LongRoPE short_factor ({len(self.short_factor)} entries) and long_factor "
                f"({len(self.long_factor)}) must have the same length, rotary_dim / 2"
            )
        if self.max_position is not None:
            _check_length("LongRoPE", "max_position", self.max_position)
        if self.attention_factor is not None:
            _check_number(
                "LongRoPE", "attention_factor", self.attention_factor, minimum=1e-9, fix="pass > 0"
            )

    def frequencies(self, base: float, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
        if len(self.short_factor) != dim // 2:
            raise ValueError(
                f"LongRoPE has {len(self.short_factor)} factors but rotary_dim {dim} needs "
                f"{dim // 2}; give one factor per rotated pair"
            )
        if self.attention_factor is not None:
            attn = float(self.attention_factor)
        else:
            s = (self.max_position or 0) / self.original_max_position
            attn = (
                math.sqrt(1 + math.log(s) / math.log(self.original_max_position)) if s > 1 else 1.0
            )
        factors = self.long_factor if seq_len > self.original_max_position else self.short_factor
        return _default_inv_freq(base, dim) / torch.tensor(
            factors, dtype=torch.float64, device=_HOST
        ), attn


_LENGTH_DEPENDENT = (DynamicNTK, LongRoPE)
# Positions past this are rotated from angles computed on the fly (still in float64): a table
# covering them would cost 2^17 * rotary_dim * 4 bytes per dtype and more.
_MAX_CACHED = 1 << 17
Scaling = Linear | NTK | DynamicNTK | YaRN | Llama3 | LongRoPE


def _check_positions(
    positions, x: torch.Tensor, trailing: tuple[int, ...] = (), tokens_first: bool = False
) -> None:
    """TypeError / ValueError unless ``positions`` are integer ``(S,)`` or ``(B, S)`` (plus
    ``trailing``) for ``x (B, H, S, D)``, or ``x (B, S, H, D)`` with ``tokens_first``."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(
            f"positions must be an int tensor, got {type(positions).__name__}; "
            "pass torch.arange(S) or a (B, S) tensor"
        )
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(
            f"positions must be an integer tensor, got {positions.dtype}; "
            "pass positions.long() (float positions lose precision past 2^24)"
        )
    B, S = (x.shape[0], x.shape[1]) if tokens_first else (x.shape[0], x.shape[2])
    ok_shape = positions.shape in (
        torch.Size((S, *trailing)),
        torch.Size((B, S, *trailing)),
    )
    if not ok_shape:
        expected = " or ".join(str(s) for s in [(S, *trailing), (B, S, *trailing)])
        raise ValueError(
            f"positions shape {tuple(positions.shape)} does not match x (B={B}, S={S}); "
            f"expected {expected}"
        )
    check_position_values("RoPE", positions)


def memoisable(positions: torch.Tensor) -> torch.Tensor:
    """``positions`` as a tensor RoPE's factor memo can key on: under ``torch.inference_mode``
    (the server, ``selfattn generate``) tensors have no version counter, so a model that passes
    one positions tensor to every layer would have the factors recomputed per layer; a normal
    copy (made outside inference mode, a few µs) has one. Other tensors are returned as they are.
    """
    if torch.compiler.is_compiling() or not positions.is_inference():  # Dynamo: no is_inference
        return positions
    with torch.inference_mode(False):
        return positions.clone()


class RoPE(nn.Module):
    """Rotary position embedding for ``x (B, H, S, D)`` with ``D = head_dim``.

    ``rope(x, positions)`` returns x rotated, same shape and dtype; ``positions`` is an int tensor
    ``(S,)`` shared by the batch or ``(B, S)`` per sequence (left padding, packed decode).
    Apply it to q and to k with their own positions. See the module docstring for layouts, precision
    and the scalings.

    Attributes: ``inv_freq`` float32 ``(rotary_dim/2,)`` and ``attention_factor`` (float) at
    lengths within the original context; :meth:`frequencies` gives them at any length.
    The cos/sin cache covers positions ``< cached_length`` and grows (to a power of two) on demand.
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        scaling: Scaling | None = None,
        interleaved: bool = False,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        int_at_least(head_dim, "RoPE head_dim", 2)
        rotary_dim = head_dim if rotary_dim is None else checked_int(rotary_dim, "RoPE rotary_dim")
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(
                f"RoPE rotary_dim ({rotary_dim}) must be even and in 2..head_dim ({head_dim}); "
                "dims rotate in pairs, so pass an even rotary_dim <= head_dim"
            )
        if isinstance(base, bool) or not isinstance(base, (int, float)):
            raise TypeError(f"RoPE base must be a number, got {type(base).__name__} {base!r}")
        if not (math.isfinite(base) and base > 1):
            raise ValueError(f"RoPE base must be > 1, got {base}; use e.g. 10000.0")
        if scaling is not None and not isinstance(scaling, Scaling):
            raise TypeError(
                f"RoPE scaling must be one of Linear, NTK, DynamicNTK, YaRN, Llama3, LongRoPE or "
                f"None, got {type(scaling).__name__}"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.scaling = scaling
        self.interleaved = bool(interleaved)
        inv64, attn = self.frequencies(1)
        self.attention_factor = attn
        self.register_buffer("inv_freq", inv64.float(), persistent=False)
        self._inv64 = inv64
        self._cache: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
            f"interleaved={self.interleaved}, scaling={self.scaling}"
        )

    def frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """``(inv_freq float64 (rotary_dim/2,), attention_factor)`` for a call of length seq_len.

        Only :class:`DynamicNTK` and :class:`LongRoPE` depend on ``seq_len`` (max position + 1).
        """
        if self.scaling is None:
            return _default_inv_freq(self.base, self.rotary_dim), 1.0
        return self.scaling.frequencies(self.base, self.rotary_dim, seq_len)

    @property
    def cached_length(self) -> int:
        """Positions ``0 .. cached_length - 1`` have cos/sin cached (0 before the first call)."""
        return max((c.shape[0] for c, _ in self._cache.values()), default=0)

    def _table(self, length: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._cache.get(dtype)
        if cached is None or cached[0].shape[0] < length or cached[0].device != device:
            size = min(max(1 << max(length - 1, 0).bit_length(), 16), _MAX_CACHED)
            cos, sin = self._angles(torch.arange(size, dtype=torch.float64), self._inv64, dtype)
            self._cache[dtype] = (cos.to(device), sin.to(device))
        return self._cache[dtype]

    def _angles(self, pos: torch.Tensor, inv64: torch.Tensor, dtype: torch.dtype):
        # Angles in float64 whatever the model dtype: pos * inv_freq reaches 1e5 rad at 2^17.
        angles = pos.to(torch.float64)[..., None] * inv64.to(pos.device)  # (...) -> (..., r/2)
        return (
            (angles.cos() * self.attention_factor).to(dtype),
            (angles.sin() * self.attention_factor).to(dtype),
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
        """cos and sin (attention factor included), each ``positions.shape + (rotary_dim/2,)``.

        Under ``torch.compile`` the angles are computed from the positions in the graph (the
        table's size would read the largest position, a graph break), in the same float64 steps
        as the table; scalings whose frequencies depend on the length (DynamicNTK, LongRoPE)
        still read it.
        """
        scaling = self.scaling
        if torch.compiler.is_compiling() and not isinstance(scaling, _LENGTH_DEPENDENT):
            return self._angles(positions, self._inv64, dtype)
        length = int(positions.max()) + 1 if positions.numel() else 1
        if isinstance(scaling, _LENGTH_DEPENDENT) and length > scaling.original_max_position:
            inv64, attn = self.frequencies(length)
        elif length > _MAX_CACHED:
            inv64, attn = self._inv64, self.attention_factor
        else:
            cos, sin = self._table(length, dtype, positions.device)
            return cos[positions], sin[positions]  # (S,) or (B, S) -> (..., r/2)
        angles = positions.to(torch.float64)[..., None] * inv64.to(positions.device)
        return (angles.cos() * attn).to(dtype), (angles.sin() * attn).to(dtype)

    def _factors(self, positions, x: torch.Tensor, work: torch.dtype, tokens_first=False):
        """The rotation's factors for ``positions``, memoised for the last positions tensor seen.

        Half-split layout: ``cos2 = [cos, cos]`` and ``sin2 = [-sin, sin]`` over the ``r``
        rotated dims, so that the rotation is ``rot · cos2 + swap(rot) · sin2`` with ``swap``
        exchanging the halves (the same products and sums as ``[a·cos - b·sin, b·cos + a·sin]``,
        bit for bit, in four ops instead of seven). Interleaved: ``cos``, ``sin``. Each
        ``(1, S, ·)`` or ``(B, 1, S, ·)``, broadcasting over heads.

        A layer rotates q and k at the same positions, and a model passes one positions tensor
        to every layer: the checks and the table lookup (a device sync for the max) then run once
        per step instead of twice per layer. The memo is keyed on the tensor object and its
        version counter, so an in-place change of the positions is never missed.

        ``tokens_first``: for ``x (B, S, H, D)``, the factors as ``(S, 1, ·)`` or ``(B, S, 1, ·)``.
        """
        if torch.compiler.is_compiling():  # the graph computes them once; no memo to trace
            _check_positions(positions, x, tokens_first=tokens_first)
            return self._rotation(*self.cos_sin(positions.to(x.device), work), tokens_first)
        # Inference-mode tensors have no version counter: they are never memoised.
        tensor = isinstance(positions, torch.Tensor)
        version = positions._version if tensor and not positions.is_inference() else None
        key = (version, x.device, work, x.shape[0], x.shape[2 - tokens_first], tokens_first)
        memo = getattr(self, "_memo", None)
        if version is not None and memo is not None and memo[0] is positions and memo[1] == key:
            return memo[2]
        _check_positions(positions, x, tokens_first=tokens_first)
        factors = self._rotation(*self.cos_sin(positions.to(x.device), work), tokens_first)
        self._memo = (positions, key, factors) if version is not None else None
        return factors

    def _rotation(self, cos: torch.Tensor, sin: torch.Tensor, tokens_first: bool = False):
        # (S, r/2) -> (1, S, r/2), (B, S, r/2) -> (B, 1, S, r/2); tokens first (S, 1, r/2) ...
        at = -2 if tokens_first else -3
        cos, sin = cos.unsqueeze(at), sin.unsqueeze(at)
        if self.interleaved:
            return cos, sin
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)  # (..., r/2) -> (..., r)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x (B, H, S, D)`` at int ``positions (S,)`` or ``(B, S)``; same shape, dtype."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"RoPE expects x (B, H, S, D={self.head_dim}), got shape {tuple(x.shape)}"
            )
        return self._rotate(x, positions)

    def rotate_tokens_first(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x (B, S, H, D)`` (tokens before heads: a fused q/k projection's layout, so
        that q and k rotate in one call) at ``positions (S,)`` or ``(B, S)``: bitwise
        ``forward(x.transpose(1, 2), positions).transpose(1, 2)``."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"RoPE expects x (B, S, H, D={self.head_dim}), got shape {tuple(x.shape)}"
            )
        return self._rotate(x, positions, tokens_first=True)

    def rotation_factors(self, positions, x: torch.Tensor):
        """The half-split factors ``(cos2, sin2)`` that :meth:`rotate_tokens_first` multiplies
        ``x (B, S, ...)`` by at ``positions``, float32 ``(rows, rotary_dim)``: token ``s`` of
        sequence ``b`` (row ``b·S + s`` of x's tokens) takes row ``(b·S + s) % rows``. None for
        an interleaved rotation. A fused kernel's RoPE
        (:class:`selfattn.kernels.quant_matmul.Step`) multiplies by them."""
        if self.interleaved:
            return None
        cos2, sin2 = self._factors(positions, x, torch.float32, tokens_first=True)
        r = self.rotary_dim
        return cos2.reshape(-1, r), sin2.reshape(-1, r)

    def _rotate(self, x, positions, tokens_first: bool = False):
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self._factors(positions, x, work, tokens_first)
        r = self.rotary_dim
        rot = x[..., :r] if r < self.head_dim else x
        # A decode step rotates twice per layer: the dtype tests skip no-op ``to`` calls (~2 µs
        # each), roll swaps the halves in one op where slicing twice and cat take three.
        rot = rot if rot.dtype == work else rot.to(work)
        if self.interleaved:
            pairs = rot.unflatten(-1, (r // 2, 2))  # (B, H, S, r) -> (B, H, S, r/2, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            out = torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
        else:
            swapped = rot.roll(r // 2, -1)  # [a, b] -> [b, a]
            out = rot * cos + swapped * sin  # [a·cos - b·sin, b·cos + a·sin]
        out = out if out.dtype == x.dtype else out.to(x.dtype)
        return out if r == self.head_dim else torch.cat((out, x[..., r:]), -1)


class RoPE2D(nn.Module):
    """2-D RoPE for image patches: rows rotate the first half of the dims, columns the second.

    ``rope2d(x, positions)`` with ``x (B, H, S, D)`` and int ``positions (S, 2)`` or ``(B, S, 2)``
    holding ``(row, col)`` per patch; :meth:`grid` builds row-major positions for an image. Each
    half is a half-split :class:`RoPE` of ``D/2`` dims (as in EVA-02 / FiT style axial RoPE), so
    ``q·k`` depends only on the 2-D offset. ``head_dim`` must be divisible by 4.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim % 4:
            raise ValueError(
                f"RoPE2D head_dim must be an int divisible by 4, got {head_dim!r}; each of the "
                "row and column halves rotates in pairs"
            )
        self.head_dim = head_dim
        self.rows = RoPE(head_dim // 2, base)
        self.cols = RoPE(head_dim // 2, base)

    @staticmethod
    def grid(height: int, width: int, device=None) -> torch.Tensor:
        """``(height * width, 2)`` int64 ``(row, col)`` of each patch, row-major."""
        rows = torch.arange(height, device=device).repeat_interleave(width)
        cols = torch.arange(width, device=device).repeat(height)
        return torch.stack((rows, cols), -1)  # (H_img * W_img, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x (B, H, S, D)`` at ``positions (S, 2)`` or ``(B, S, 2)``."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"RoPE2D expects x (B, H, S, D={self.head_dim}), got shape {tuple(x.shape)}"
            )
        _check_positions(positions, x, (2,))
        half = self.head_dim // 2
        return torch.cat(
            (
                self.rows(x[..., :half], positions[..., 0]),
                self.cols(x[..., half:], positions[..., 1]),
            ),
            -1,
        )
