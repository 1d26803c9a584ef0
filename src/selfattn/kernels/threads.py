"""How many threads a C kernel call uses: as many as the work pays for, at most torch's.

The C kernels run a call's participants as an OpenMP region on PyTorch's own threads where the
build shares PyTorch's libgomp (``csrc/thread_pool.h``, ``build.openmp_flags``; :func:`openmp`
says which), else on a persistent worker pool of their own, whose figures follow: the workers
are started once and park between calls, and a call wakes as many as it uses (the calling
thread works too).
A worker still polling from the previous call (up to 50 µs after it) starts within ~0.2 µs; a
parked one runs ~30-50 µs after the call wakes it (median over 400 calls after 0.2-1 ms of other
work, on a shared 2-core host), and waking it costs the caller ~7 µs (a
call with no work left for it takes the request back without waiting; the per-call
``pthread_create`` + join this replaced cost 25-35 µs, and up to a scheduler slice on a busy
host). A worker therefore shortens a call only when the call outlasts its start-up: each thread
beyond the first gets at least :data:`MIN_SECONDS` of work (estimated from FLOPs or bytes at one
core's rate), so a second thread joins calls of >= 0.1 ms (the fused forward measured 0.75x the
one-thread wall time at ~0.11 ms, 1.0x at 0.036 ms), and a decode step of a short context or an
attention call on a 64 x 64 tile runs on the calling thread alone.

On a host whose other cores are busy the scheduler may wake a parked worker on its caller's
core: the call then takes one thread's time (measured 1.01-1.02x it on the S=16384 window and
documents forwards), where per-call threads took 1.05-1.18x it there and up to 5x on small
calls. On a quiet host those forwards take 0.51-0.56x one thread's time on two.

Measured in one process on the host above, wall time: the pool's start-up by a C probe that
includes thread_pool.h (a task stamping the clock when the worker enters it), the kernels'
1- vs 2-thread calls through their ctypes entries with 0.2 ms of other work between calls
(10th percentile of 200-400 calls, best of 5 interleaved rounds).
"""

from __future__ import annotations

import ctypes

import torch

from selfattn.kernels.build import Function

__all__ = [
    "MIN_SECONDS", "MIN_SECONDS_OPENMP", "POOL_FUNCTIONS", "for_bytes", "for_flops", "openmp",
]  # fmt: skip

# What every C kernel library exports about its threads (csrc/thread_pool.h): pool_openmp() ->
# 1 where its calls run on PyTorch's OpenMP threads, 0 on the pool's own workers; for tests,
# pool_workers() -> the workers started so far, pool_fail_allocs(n): the next n scratch
# allocations of its calls fail.
POOL_FUNCTIONS = (
    Function("pool_openmp", (), ctypes.c_int),
    Function("pool_workers", (), ctypes.c_int),
    Function("pool_fail_allocs", (ctypes.c_int,), None),
)

# Work a thread beyond the first must get: a parked worker's start-up (~30-50 µs), so it arrives
# while half the work is left.
MIN_SECONDS = 50e-6
# The same where the call runs on PyTorch's OpenMP threads, which spin for milliseconds after
# each parallel op (a decode step's previous op): a region starts within a few µs there (a
# quantised decode matmul with a PyTorch op between calls, 2 threads on 2 cores: 0.07 MB of
# weights 1.1x slower on two threads, 0.2 MB 1.2x faster, 0.55 MB 1.4-1.5x).
MIN_SECONDS_OPENMP = 5e-6
# One core's rates for the estimate (an AVX-512 core: the fused kernels' fp32 products and a
# decode's page reads); off by 2x only moves where a second thread starts.
_FLOPS_PER_SECOND = 100e9
_BYTES_PER_SECOND = 15e9


def _count(seconds: float, least: float | None = None) -> int:
    most = torch.get_num_threads()
    least = MIN_SECONDS if least is None else least  # read at each call: tests set it to 0
    return most if least <= 0 else max(1, min(most, int(seconds / least)))


def openmp(lib: ctypes.CDLL | None) -> bool:
    """Whether the calls of C kernel library ``lib`` run on PyTorch's OpenMP threads."""
    return lib is not None and bool(lib.pool_openmp())


def for_flops(flops: float) -> int:
    """Threads for a call doing ``flops`` floating-point operations."""
    return _count(flops / _FLOPS_PER_SECOND)


def for_bytes(n_bytes: float, *, openmp_threads: bool = False) -> int:
    """Threads for a call reading ``n_bytes`` (a memory-bound kernel: paged decode);
    ``openmp_threads``: the call runs on PyTorch's OpenMP threads (:func:`openmp`), which start
    sooner (:data:`MIN_SECONDS_OPENMP`)."""
    least = min(MIN_SECONDS_OPENMP, MIN_SECONDS) if openmp_threads else None
    return _count(n_bytes / _BYTES_PER_SECOND, least)
