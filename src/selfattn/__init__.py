"""selfattn: self-attention, complete and fast, on PyTorch.

>>> import selfattn as sa
>>> out = sa.attention(q, k, v, mask=sa.masks.causal())      # doctest: +SKIP
"""

from selfattn import backends, cache, masks, nn, positions, scores
from selfattn.functional import attention, attention_weights

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "attention",
    "attention_weights",
    "backends",
    "cache",
    "masks",
    "nn",
    "positions",
    "scores",
]
