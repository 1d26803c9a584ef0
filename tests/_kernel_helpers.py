"""The C kernels a test needs: skipped only where they cannot or must not exist, failed where
they should and do not.

A kernel module (``paged_decode``, ``quant_matmul``, ``fused_attention``) returns None from
``library()`` in three cases, which a test must tell apart: its ``ENV_VAR`` is 0 (switched off on
purpose: skip), there is no C compiler (the PyTorch path is all there is: skip), or a compiler is
here and the build or the load failed (a broken kernel: fail, with the compiler's stderr). The
library itself logs the last case once and falls back, for users; a test must not.

Use :func:`c_kernel` in a test or fixture, or mark a test or module
``pytest.mark.c_kernel(module)`` (tests/conftest.py applies it before each test).
"""

from __future__ import annotations

import ctypes
import functools
import os
from types import ModuleType

import pytest

from selfattn.kernels import build, fused_attention


def c_kernel(module: ModuleType, generic: bool = False) -> ctypes.CDLL:
    """``module.library()`` (``library(generic)`` of ``fused_attention``): skips the test where
    ``module.ENV_VAR=0`` or there is no C compiler; fails it, with every target's compiler
    stderr, where a compiler is here and the kernel did not build or load."""
    name = module.__name__.rsplit(".", 1)[-1]
    if os.environ.get(module.ENV_VAR, "1") == "0":
        pytest.skip(f"{module.ENV_VAR}=0 switches the {name} kernel off")
    lib = module.library(generic) if module is fused_attention else module.library()
    if lib is not None:
        return lib
    cc = build.compiler()
    if cc is None:
        pytest.skip(f"no C compiler here ($CC, cc, gcc, clang): the {name} kernel cannot be built")
    spec = fused_attention.spec(generic) if module is fused_attention else module.SPEC
    pytest.fail(
        f"the {name} C kernel ({spec.name}) did not build or load although {cc} is here; "
        f"{name}.library() returned None:\n{_why_not(spec)}",
        pytrace=False,
    )


@functools.cache  # one account per broken build, not one per test of its modules
def _why_not(spec: build.CLibrary) -> str:
    errors = build.build_errors(spec)
    return "\n\n".join(errors) if errors else "it builds and loads afresh: see the selfattn log"
