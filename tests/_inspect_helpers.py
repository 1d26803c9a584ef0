"""Shared by the attribution and explorer tests: a two-layer residual attention stack."""

from __future__ import annotations

import torch
from torch import nn

from selfattn import masks
from selfattn.nn import MultiHeadAttention

D = 24


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Stack(nn.Module):
    """Residual attention layers ``x + attn(x)``: MHA with a causal mask, then GQA."""

    def __init__(self):
        super().__init__()
        self.attns = nn.ModuleList([MultiHeadAttention(D, 4), MultiHeadAttention(D, 4, 2)])

    def forward(self, x):
        x = x + self.attns[0](x, mask=masks.causal())
        return x + self.attns[1](x)
