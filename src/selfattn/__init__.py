"""selfattn: self-attention, complete and fast, on PyTorch.

>>> import selfattn as sa
>>> out = sa.attention(q, k, v, mask=sa.masks.causal())      # doctest: +SKIP
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ loads these
    from selfattn import (
        backends,
        cache,
        distributed,
        inspect,
        masks,
        models,
        nn,
        positions,
        scores,
    )
    from selfattn.functional import attention, attention_weights

__version__ = "0.1.0"

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

# Every public name loads on first use (PEP 562): `import selfattn` costs no torch import, so the
# `selfattn` command answers --help at once; `sa.attention`, `sa.masks`, `from selfattn import nn`
# import what they name when first touched. `models`, `distributed` and `inspect` pull in
# safetensors, torch.distributed and matplotlib, which plain attention calls never need.
# Functions come from these modules; every other public name is a submodule.
_FUNCTIONS = {"attention": "selfattn.functional", "attention_weights": "selfattn.functional"}


def __getattr__(name: str):
    if name in _FUNCTIONS:
        value = getattr(importlib.import_module(_FUNCTIONS[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    if name in __all__:
        return importlib.import_module(f"selfattn.{name}")  # the import binds it on this module
    raise AttributeError(f"module 'selfattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
