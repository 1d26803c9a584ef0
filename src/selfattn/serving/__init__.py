"""Serving: a continuous-batching engine over the paged KV cache (:class:`Engine`).

``Engine(model, tokenizer)`` runs many requests at once (chunked prefill mixed with decode,
prefix caching, preemption by recompute); :class:`EngineConfig` holds its knobs
(:class:`ServerLimits` the HTTP server's bounds on one client);
:class:`SamplingParams` says how each request picks its tokens; :class:`RequestOutput` is what
comes back; :class:`EngineLoop` steps it (offline, asyncio streams, the HTTP server in
:mod:`selfattn.serving.http`). See :mod:`selfattn.serving.engine`.

The names load on first use: ``selfattn serve --help`` reads :class:`EngineConfig`'s defaults
without importing torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfattn.serving.config import DEFAULT_KV_CACHE_BYTES, EngineConfig, ServerLimits
    from selfattn.serving.engine import Engine, QueueFull
    from selfattn.serving.loop import EngineLoop
    from selfattn.serving.metrics import EngineMetrics, Histogram
    from selfattn.serving.request import CompletionOutput, RequestOutput, TokenLogprob
    from selfattn.serving.sampling import SamplingParams

_HOME = {
    "DEFAULT_KV_CACHE_BYTES": "config",
    "CompletionOutput": "request",
    "Engine": "engine",
    "EngineConfig": "config",
    "EngineLoop": "loop",
    "EngineMetrics": "metrics",
    "Histogram": "metrics",
    "QueueFull": "engine",
    "RequestOutput": "request",
    "SamplingParams": "sampling",
    "ServerLimits": "config",
    "TokenLogprob": "request",
}

__all__ = [
    "DEFAULT_KV_CACHE_BYTES",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineLoop",
    "EngineMetrics",
    "Histogram",
    "QueueFull",
    "RequestOutput",
    "SamplingParams",
    "ServerLimits",
    "TokenLogprob",
]


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'selfattn.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"selfattn.serving.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
