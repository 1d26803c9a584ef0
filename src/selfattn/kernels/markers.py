"""Markers for ``torch.compile`` that cost nothing at import (kernels and backends use them).

``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (with sympy and, where
installed, Triton) the moment it decorates a function: about 150 MiB of RSS and a second or more
of start-up in every process that only runs eager code. Dynamo reads its decision from a marker
attribute on the function when it traces a call, so setting that attribute is the same decorator
without the import (``tests/test_compile.py`` traces these functions with zero graph breaks).
"""

from __future__ import annotations

__all__ = ["assume_constant_result"]


def assume_constant_result(fn):
    """Mark ``fn`` as returning a constant under ``torch.compile`` (asked once while tracing,
    its result baked into the graph), as ``torch.compiler.assume_constant_result`` does."""
    fn._dynamo_marked_constant = True
    return fn
