"""Position encodings: absolute (sinusoidal, learned), rotary (RoPE + scalings, 2-D) and ALiBi.

Absolute encodings return embeddings to add to token embeddings; RoPE rotates q and k inside
attention; ALiBi is a score mod (:func:`selfattn.scores.alibi`) whose slopes are re-exported here.
"""

from selfattn.positions.alibi import alibi_slopes
from selfattn.positions.rope import NTK, DynamicNTK, Linear, Llama3, LongRoPE, RoPE, RoPE2D, YaRN
from selfattn.positions.sinusoidal import LearnedPositions, Sinusoidal

__all__ = [
    "NTK",
    "DynamicNTK",
    "LearnedPositions",
    "Linear",
    "Llama3",
    "LongRoPE",
    "RoPE",
    "RoPE2D",
    "Sinusoidal",
    "YaRN",
    "alibi_slopes",
]
