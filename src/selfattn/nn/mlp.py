"""Feed-forward layers of a transformer block: ``MLP`` (GELU) and ``SwiGLU``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "SwiGLU"]


class MLP(nn.Module):
    """``fc2(dropout(act(fc1(x))))``: ``(..., d_model) -> (..., d_hidden) -> (..., d_model)``.

    ``activation`` is any callable (default exact GELU, as BERT and torch's Transformer layers use;
    ``"tanh"`` approximation via ``functools.partial(F.gelu, approximate="tanh")``).
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        activation=F.gelu,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(d_hidden, d_model, bias=bias, device=device, dtype=dtype)
        self.activation = activation
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(self.activation(self.fc1(x)))  # (..., d_model) -> (..., d_hidden)
        return self.fc2(h)  # (..., d_hidden) -> (..., d_model)


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer, 2020): ``down(silu(gate(x)) * up(x))``.

    ``(..., d_model) -> (..., d_hidden) -> (..., d_model)``; no bias by default (Llama).
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        *,
        bias: bool = False,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.gate = nn.Linear(d_model, d_hidden, bias=bias, device=device, dtype=dtype)
        self.up = nn.Linear(d_model, d_hidden, bias=bias, device=device, dtype=dtype)
        self.down = nn.Linear(d_hidden, d_model, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(F.silu(self.gate(x)) * self.up(x))  # (..., d_model) -> (..., d_hidden)
        return self.down(h)  # (..., d_hidden) -> (..., d_model)
