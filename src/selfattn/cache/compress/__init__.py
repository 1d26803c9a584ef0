"""KV-compression policies ("presses") as tensor functions over one layer's dense K/V.

Prefill: ``press(name, ratio).apply(keys, values, queries, ...)`` scores the prompt's tokens,
sizes the layer's budget and gathers the kept K/V per head (:mod:`.base` for the contract).
Streamed: ``press.statistic()`` gathers what a press reading every prompt query needs, chunk by
chunk (:mod:`.statistics`). Decode: :class:`DecodeScores` evicts from per-step attention (H2O,
TOVA, StreamingLLM).
"""

from selfattn.cache.compress.base import Compressed, Kept, Press, compress_kv, window_attention
from selfattn.cache.compress.decode import DecodeScores, Eviction
from selfattn.cache.compress.policies import (
    TOVA,
    AdaKV,
    ExpectedAttention,
    KNorm,
    ObservedAttention,
    PyramidKV,
    SnapKV,
    StreamingLLM,
)
from selfattn.cache.compress.registry import (
    POLICIES,
    QUANTIZED,
    KVCompression,
    Quantized,
    compression,
    names,
    press,
)
from selfattn.cache.compress.statistics import AttentionSums, QueryMoments

__all__ = [
    "POLICIES",
    "QUANTIZED",
    "TOVA",
    "AdaKV",
    "AttentionSums",
    "Compressed",
    "DecodeScores",
    "Eviction",
    "ExpectedAttention",
    "KNorm",
    "KVCompression",
    "Kept",
    "ObservedAttention",
    "Press",
    "PyramidKV",
    "Quantized",
    "QueryMoments",
    "SnapKV",
    "StreamingLLM",
    "compress_kv",
    "compression",
    "names",
    "press",
    "window_attention",
]
