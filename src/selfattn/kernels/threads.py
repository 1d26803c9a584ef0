"""How many threads a C kernel call starts: as many as the work pays for, at most torch's.

The C kernels start POSIX threads per call and join them. For a small call that costs more than
it saves: tens of µs to create and join, and on a busy machine the joined thread may wait a whole
scheduler slice (ms) for a core, where the work itself took 0.1 ms. So each thread beyond the
first must have at least :data:`MIN_SECONDS` of work (estimated from FLOPs or bytes at one core's
rate), and a decode step of a short context or an attention call on a 64 x 64 tile runs on the
calling thread alone.
"""

from __future__ import annotations

import ctypes

import torch

from selfattn.kernels.build import Function

__all__ = ["MIN_SECONDS", "POOL_FUNCTIONS", "for_bytes", "for_flops"]

# What every C kernel library exports about its worker pool (csrc/thread_pool.h), for tests:
# pool_workers() -> the workers started so far; pool_fail_allocs(n): the next n scratch
# allocations of its calls fail.
POOL_FUNCTIONS = (
    Function("pool_workers", (), ctypes.c_int),
    Function("pool_fail_allocs", (ctypes.c_int,), None),
)

# Work a thread beyond the first must get: ~10x its start and join on an idle machine.
MIN_SECONDS = 0.3e-3
# One core's rates for the estimate (Zen 4/5, AVX-512: the fused kernels' fp32 products and a
# decode's page reads); off by 2x only moves where a second thread starts.
_FLOPS_PER_SECOND = 100e9
_BYTES_PER_SECOND = 15e9


def _count(seconds: float) -> int:
    most = torch.get_num_threads()
    return most if MIN_SECONDS <= 0 else max(1, min(most, int(seconds / MIN_SECONDS)))


def for_flops(flops: float) -> int:
    """Threads for a call doing ``flops`` floating-point operations."""
    return _count(flops / _FLOPS_PER_SECOND)


def for_bytes(n_bytes: float) -> int:
    """Threads for a call reading ``n_bytes`` (a memory-bound kernel: paged decode)."""
    return _count(n_bytes / _BYTES_PER_SECOND)
