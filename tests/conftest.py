"""Shared fixtures, and Triton's interpreter for machines without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in Triton's interpreter on CPU tensors (docs/testing.md). The flag must be set
# before triton is first imported, so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor compiles (FlexAttention on CPU, torch.compile tests) in this process: its default pool
# of compile workers, each importing torch, costs more than it saves on the suite's small graphs
# (a CPU flex test: 28 s with the pool, 16 s without), and the benchmarks' subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Under pytest-xdist every worker is a process of its own on the same cores: intra-op threads
# beyond one per worker oversubscribe them (OpenMP's spinning waiters then burn the other
# worker's time). Tests about threads set their own count (the two_threads fixture).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def c_kernel_mark(request):
    """A test marked ``pytest.mark.c_kernel(module)`` gets that C kernel or skips or fails as
    tests/_kernel_helpers.c_kernel says (no compiler: skip; a failed build: fail)."""
    mark = request.node.get_closest_marker("c_kernel")
    if mark is not None:
        from tests._kernel_helpers import c_kernel

        c_kernel(*mark.args, **mark.kwargs)


@pytest.fixture
def gathered_counts(monkeypatch) -> list[int]:
    """Spy on page gathers: the list fills with the number of indices of each ``index_select``.

    Both spellings are wrapped: the method, and the function that gathers into reused buffers
    (``torch.index_select(..., out=)``).
    """
    counts: list[int] = []
    method, function = torch.Tensor.index_select, torch.index_select

    def spy_method(t, d, i):
        counts.append(i.numel())
        return method(t, d, i)

    def spy_function(t, d, i, **kw):
        counts.append(i.numel())
        return function(t, d, i, **kw)

    monkeypatch.setattr(torch.Tensor, "index_select", spy_method)
    monkeypatch.setattr(torch, "index_select", spy_function)
    return counts


@pytest.fixture
def every_thread(monkeypatch):
    """The C kernels start every torch thread even for a tiny call (they otherwise start only
    as many as the work pays for): for the tests of thread-count independence."""
    from selfattn.kernels import threads

    monkeypatch.setattr(threads, "MIN_SECONDS", 0.0)


@pytest.fixture
def two_threads():
    """Two intra-op threads (the kernels' thread-count tests), restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-model tests: on a loaded 2-core machine the
    threads cost more than they save (up to 10x on the model tests)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
