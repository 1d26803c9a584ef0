"""``triton``: our dense Triton kernels (forward, backward; DESIGN). None exists yet, so this
backend declines every call with that reason; Triton runs paged decode only, as the ``triton``
paged backend (:mod:`selfattn.backends.paged.triton`)."""

from __future__ import annotations

from selfattn.backends import AttentionCall, Backend, register

__all__ = ["run"]

_WHY = "no dense Triton kernel yet (Triton runs paged decode only: selfattn.cache.paged_attention)"


def run(q, k, v, call: AttentionCall):
    raise NotImplementedError(_WHY)  # never selected: _reject declines every call


def _reject(q, k, v, call):
    return _WHY


register(Backend("triton", run, _reject, doc="our dense Triton kernels: none yet (declines)"))
