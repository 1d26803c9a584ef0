"""The OpenAI-compatible HTTP server's public names where they have always been imported from;
the server itself is :mod:`selfattn.serving.http` (one module per endpoint family).

:class:`EngineWorker` is the engine's stepping loop, :class:`~selfattn.serving.loop.EngineLoop`.
"""

from selfattn.serving.http import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    EMBEDDING_MODEL,
    build_app,
    serve,
    wait_until_healthy,
)
from selfattn.serving.loop import EngineLoop as EngineWorker

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "EMBEDDING_MODEL",
    "EngineWorker",
    "build_app",
    "serve",
    "wait_until_healthy",
]
