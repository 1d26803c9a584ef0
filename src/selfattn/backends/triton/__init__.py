"""Triton kernels (CUDA). Triton is an optional extra: imported only when a kernel runs."""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["available"]


@functools.cache
def available() -> bool:
    """Whether Triton is installed (checked without importing it: the import takes seconds)."""
    return importlib.util.find_spec("triton") is not None
