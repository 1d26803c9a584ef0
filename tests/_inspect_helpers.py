"""Shared by the attribution and explorer tests: a two-layer residual attention stack, and the
explorer page's embedded data read back."""

from __future__ import annotations

import base64
import gzip
import json
import re
from pathlib import Path

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


def page_data(path: Path) -> dict:
    html = path.read_text()
    (blob,) = re.findall(r'<script id="selfattn-data" type="application/json">(.*?)</script>', html)
    return json.loads(blob)


def decode(b64: str, n: int) -> torch.Tensor:
    """The page's codes back in Python (the inverse of view._encode, written out)."""
    raw = gzip.decompress(base64.b64decode(b64))
    planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int32)
    z = planes[:n] | (planes[n:] << 8)
    return (z >> 1) ^ -(z & 1)
