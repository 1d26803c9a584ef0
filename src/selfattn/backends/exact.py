"""The exact fallback of the fused backends: a fused result with NaN/Inf redone exactly.

sdpa, flex, triton and cpu_fused run their kernel through :func:`fused_or_exact`; a result the
check finds non-finite is redone by chunked's exact path or the reference. This module sits
above chunked and reference (it calls them) and below the fused backends (they call it), so the
arrows run one way and ``_common`` stays a leaf.
"""

from __future__ import annotations

import logging

import torch

from selfattn._log import log_once
from selfattn.backends import chunked, reference
from selfattn.backends._common import all_finite

__all__ = ["fused_or_exact"]


def fused_or_exact(q, k, v, call, attend, attend_zeroed, *, backend: str, checked=False):
    """``(out, lse)`` from a fused kernel, checked: what sdpa, flex, triton and cpu_fused run.

    A fused kernel adds masks to the scores and multiplies every weight by every V row, so NaN/Inf
    at a masked entry leaks (``NaN + -inf``, ``0 · NaN``), and CPU kernels turn a NaN query row
    into 0. One reduction over ``q`` and the output finds all of these, so finite inputs pay
    nothing else; with ``checked``, ``attend()`` returns ``(out, lse, finite)``, ``finite`` the
    kernel's own verdict on the same question (every element of ``q`` and ``out`` finite: the
    cpu_fused kernel tests them as it reads and writes them), and not even that reduction runs.
    Such a call is redone by ``attend_zeroed()`` (the kernel with the K/V columns no query
    attends zeroed; None where non-finite values remain), which serves garbage in padded cache
    slots at kernel speed, else by chunked's exact path (the reference where chunked cannot run
    the call).

    Under ``torch.compile`` nothing may branch on values, so the check and the exact fallback are
    left out: the kernel runs with the unattended K/V columns zeroed (``attend_zeroed``, without
    its own check), which keeps NaN/Inf in masked-out keys (padded cache slots) from leaking, or
    as it is where ``attend_zeroed`` cannot zero without looking at values (None); the rarer
    cases the exact path also covers (a NaN query row on CPU kernels, a key non-finite at a
    masked entry of a row while another row attends it) follow the kernel.

    Each way of redoing a call is logged once per ``backend`` on the ``selfattn`` logger (INFO:
    the result is exact, only slower).
    """
    if torch.compiler.is_compiling():
        result = attend_zeroed()
        if result is None:
            result = attend()
        return result[:2] if checked else result
    result = attend()
    if checked:
        result, finite = result[:2], bool(result[2])
    else:
        finite = all_finite(q, result[0])
    if finite:
        return result
    if all_finite(q) and not all_finite(k, v):
        result = attend_zeroed()
        if result is not None and all_finite(result[0]):
            _redone(backend, f"{backend} again with the unattended non-finite K/V columns zeroed")
            return result
    if chunked.reject(q, k, v, call) is None:
        _redone(backend, "chunked's exact path")
        return chunked.run(q, k, v, call, exact=True)
    _redone(backend, "the reference backend")
    return reference.run(q, k, v, call)


def _redone(backend: str, how: str) -> None:
    log_once(
        ("non-finite redo", backend, how),
        logging.INFO,
        "selfattn %s: the fused kernel's output had NaN/Inf (non-finite inputs); call redone by "
        "%s, which keeps them where they belong (logged once)",
        backend,
        how,
    )
