"""selfattn: self-attention, complete and fast, on PyTorch.

>>> import selfattn as sa
>>> out = sa.attention(q, k, v, mask=sa.masks.causal())      # doctest: +SKIP
"""

import importlib

__version__ = "0.1.0"

# Everything loads on first use (PEP 562): `import selfattn` costs no torch import, so the
# `selfattn` command answers --help at once; `sa.attention`, `sa.masks`, `from selfattn import nn`
# import what they name when first touched. `models`, `distributed` and `inspect` pull in
# safetensors, torch.distributed and matplotlib, which plain attention calls never need.
_SUBMODULES = (
    "backends",
    "cache",
    "distributed",
    "inspect",
    "masks",
    "models",
    "nn",
    "positions",
    "scores",
)
_FUNCTIONS = {"attention": "selfattn.functional", "attention_weights": "selfattn.functional"}

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
    if name in _SUBMODULES:
        return importlib.import_module(f"selfattn.{name}")  # the import binds it on this module
    if name in _FUNCTIONS:
        value = getattr(importlib.import_module(_FUNCTIONS[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'selfattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
