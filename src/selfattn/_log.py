"""The ``selfattn`` logger, and :func:`log_once` for fast-path fallbacks.

Whenever selfattn runs something slower than it could (a kernel that did not build, a compile
that failed, a fused kernel's result redone exactly), it says so on
``logging.getLogger("selfattn")``, once per process and kind of fallback, so a serving loop is
not flooded. Nothing is printed unless logging is configured or the record is a warning
(Python's last-resort handler prints warnings to stderr). Imports nothing from selfattn.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

import torch

__all__ = ["log_once", "logger"]

logger = logging.getLogger("selfattn")

_said: set[Hashable] = set()
_lock = threading.Lock()


def log_once(key: Hashable, level: int, message: str, *args) -> bool:
    """Log ``message % args`` at ``level`` on the ``selfattn`` logger unless ``key`` was logged
    already in this process; whether it was logged now. Silent while ``torch.compile`` traces
    (a log call would break the graph; the eager run says it)."""
    if torch.compiler.is_compiling():
        return False
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    logger.log(level, message, *args)
    return True
