"""selfattn: self-attention, complete and fast, on PyTorch.

>>> import selfattn as sa
>>> out = sa.attention(q, k, v, mask=sa.masks.causal())      # doctest: +SKIP
"""

import importlib

from selfattn import backends, cache, masks, nn, positions, scores
from selfattn.functional import attention, attention_weights

__version__ = "0.1.0"

# Loaded on first use (``sa.models``, ``sa.distributed``, ``sa.inspect``): they pull in
# safetensors, torch.distributed and matplotlib, which plain attention calls never need.
_LAZY = ("distributed", "inspect", "models")

__all__ = [
    "__version__",
    "attention",
    "attention_weights",
    "backends",
    "cache",
    "distributed",
    "inspect",
    "masks",
    "models",
    "nn",
    "positions",
    "scores",
]


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"selfattn.{name}")
    raise AttributeError(f"module 'selfattn' has no attribute {name!r}")
