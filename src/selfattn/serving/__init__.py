"""Serving: a continuous-batching engine over the paged KV cache (:class:`Engine`).

``Engine(model, tokenizer)`` runs many requests at once (chunked prefill mixed with decode,
prefix caching, preemption by recompute); :class:`SamplingParams` says how each picks its
tokens; :class:`RequestOutput` is what comes back. See :mod:`selfattn.serving.engine`.
"""

from selfattn.serving.engine import DEFAULT_KV_CACHE_BYTES, Engine, QueueFull
from selfattn.serving.metrics import EngineMetrics, Histogram
from selfattn.serving.request import CompletionOutput, RequestOutput, TokenLogprob
from selfattn.serving.sampling import SamplingParams

__all__ = [
    "DEFAULT_KV_CACHE_BYTES",
    "CompletionOutput",
    "Engine",
    "EngineMetrics",
    "Histogram",
    "QueueFull",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
