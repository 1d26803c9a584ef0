"""Feed-forward layers of a transformer block: ``MLP`` (GELU) and ``SwiGLU`` (gated)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "MLP", "SwiGLU"]

#: transformers' ``hidden_act`` names -> the activation callables they mean.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}


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
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()  # not called at p=0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = apply_dropout(
            self.dropout, self.activation(self.fc1(x))
        )  # (..., d_model) -> (..., d_hidden)
        return self.fc2(h)  # (..., d_hidden) -> (..., d_model)


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer, 2020): ``down(act(gate(x)) * up(x))``, ``act`` = SiLU.

    ``(..., d_model) -> (..., d_hidden) -> (..., d_model)``; no bias by default (Llama).
    ``activation`` swaps the gate's non-linearity (GeGLU: GELU-tanh for Gemma and T5 v1.1).
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        *,
        bias: bool = False,
        dropout: float = 0.0,
        activation=F.silu,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.activation = activation
        self.gate = nn.Linear(d_model, d_hidden, bias=bias, device=device, dtype=dtype)
        self.up = nn.Linear(d_model, d_hidden, bias=bias, device=device, dtype=dtype)
        self.down = nn.Linear(d_hidden, d_model, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()  # not called at p=0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.gate(x)) * self.up(x)  # (..., d_model) -> (..., d_hidden)
        return self.down(apply_dropout(self.dropout, h))  # (..., d_hidden) -> (..., d_model)


def apply_dropout(dropout: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``dropout(x)``, or ``x`` itself for an ``nn.Identity`` (p=0): a module call costs ~6 µs,
    several per layer of a decode step."""
    return x if isinstance(dropout, nn.Identity) else dropout(x)
