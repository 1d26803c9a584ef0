"""Absolute position embeddings: fixed sinusoids and a learned table.

Both map int ``positions (S,)`` or ``(B, S)`` to embeddings ``(S, d_model)`` or
``(B, S, d_model)`` that the caller adds to the token embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validate import positive_int

__all__ = [
    "LearnedPositions",
    "Sinusoidal",
    "check_position_values",
]


# Angles are ``position * inv_freq`` in float64, which holds every integer exactly only up to 2**53:
# past it neighbouring positions round to one angle (a silent wrong embedding).
_MAX_EXACT_POSITION = 1 << 53


def check_position_values(owner: str, positions: torch.Tensor) -> None:
    """ValueError unless every position lies in ``0 .. 2**53`` (an int tensor).

    Inside a compiled graph, where reading a value would break it, the same condition is an
    assert the graph checks when it runs (RuntimeError, a generic message).
    """
    if torch.compiler.is_compiling():
        ok = (positions >= 0) & (positions <= _MAX_EXACT_POSITION)
        torch._assert_async(ok.all(), f"{owner} positions must be in 0..2**53")
        return
    if not positions.numel():
        return
    low, high = (int(x) for x in positions.aminmax())
    if low < 0:
        raise ValueError(f"{owner} positions must be >= 0, got min {low}")
    if high > _MAX_EXACT_POSITION:
        raise ValueError(
            f"{owner} positions must be <= 2**53 ({_MAX_EXACT_POSITION}), got max {high}: "
            "angles are computed in float64, which rounds larger positions; count positions "
            "from the start of the sequence"
        )


def _check_int_positions(owner: str, positions) -> None:
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{owner} positions must be an int tensor, got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(
            f"{owner} positions must be an integer tensor, got {positions.dtype}; pass .long()"
        )
    if positions.dim() not in (1, 2):
        raise ValueError(
            f"{owner} positions must be (S,) or (B, S), got shape {tuple(positions.shape)}"
        )
    check_position_values(owner, positions)


class Sinusoidal(nn.Module):
    """The original Transformer's fixed encodings (Vaswani et al. 2017, section 3.5).

    ``PE[p, 2i] = sin(p / base^(2i/d_model))`` and ``PE[p, 2i+1] = cos(...)`` (interleaved).
    Angles are computed in float64 so that large positions stay exact; the result is float32
    unless ``dtype`` is given. No parameters, no length limit.
    """

    def __init__(self, d_model: int, base: float = 10000.0):
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 2 or d_model % 2:
            raise ValueError(
                f"Sinusoidal d_model must be an even int >= 2, got {d_model!r}; sin and cos "
                "fill alternate dims"
            )
        if not base > 1:
            raise ValueError(f"Sinusoidal base must be > 1, got {base}; the paper uses 10000.0")
        self.d_model = d_model
        self.base = float(base)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, base={self.base}"

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``positions (S,)`` or ``(B, S)`` -> ``(S, d_model)`` or ``(B, S, d_model)``."""
        _check_int_positions("Sinusoidal", positions)
        inv_freq = self.base ** (
            -torch.arange(0, self.d_model, 2, dtype=torch.float64, device=positions.device)
            / self.d_model
        )
        angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., ) -> (..., d/2)
        pe = torch.stack((angles.sin(), angles.cos()), -1)  # (..., d/2) -> (..., d/2, 2)
        return pe.flatten(-2).to(dtype)  # (..., d/2, 2) -> (..., d_model)


class LearnedPositions(nn.Module):
    """A learned absolute table ``(max_positions, d_model)`` (BERT, GPT-2), init N(0, 0.02²).

    Positions ``>= max_positions`` raise a ValueError naming the length: a table cannot extrapolate.
    """

    def __init__(self, max_positions: int, d_model: int):
        super().__init__()
        for name, value in (("max_positions", max_positions), ("d_model", d_model)):
            positive_int(value, f"LearnedPositions {name}")
        self.max_positions = max_positions
        self.d_model = d_model
        self.weight = nn.Parameter(torch.randn(max_positions, d_model) * 0.02)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, d_model={self.d_model}"

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions (S,)`` or ``(B, S)`` -> ``(S, d_model)`` or ``(B, S, d_model)``."""
        _check_int_positions("LearnedPositions", positions)
        if torch.compiler.is_compiling():  # a graph assert: reading the max would break it
            ok = (positions < self.max_positions).all()
            torch._assert_async(ok, f"LearnedPositions: positions must be < {self.max_positions}")
        elif positions.numel() and int(positions.max()) >= self.max_positions:
            top = int(positions.max())
            raise ValueError(
                f"position {top} is past LearnedPositions' length {self.max_positions} (valid "
                f"positions 0..{self.max_positions - 1}); build it with max_positions >= {top + 1} "
                "or use a relative scheme (RoPE, ALiBi) to extrapolate"
            )
        return self.weight[positions]  # (S,) or (B, S) -> (..., d_model)
