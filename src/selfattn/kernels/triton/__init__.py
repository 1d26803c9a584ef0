"""Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``). Triton is an optional extra:
a kernel module imports it only when first run."""

from __future__ import annotations

import functools
import importlib.util

from selfattn.kernels.markers import assume_constant_result

__all__ = ["available"]


@assume_constant_result  # torch.compile: asked once while tracing, not traced
def available() -> bool:
    """Whether Triton is installed (checked without importing it: the import takes seconds)."""
    return _installed()


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None
