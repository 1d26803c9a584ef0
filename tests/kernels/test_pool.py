"""The C kernels' persistent worker pool (csrc/thread_pool.h): workers started once and reused,
correct under concurrent calls, thread-count changes and fork, scratch failures reported."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import selfattn as sa
from selfattn.kernels import build, fused_attention, paged_decode
from tests._kernel_helpers import c_kernel
from tests.cache.test_paged import make_paged

# A forked child or a Python thread that has not finished by then is hung.
HANG_S = 60


def _lib(module):
    return c_kernel(module)


@pytest.fixture
def torch_threads():
    """Set torch's thread count within a test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _pool_threads(prefix: str) -> dict[int, str]:
    """This process's threads named ``prefix-N`` (the pool's workers): thread id -> name."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name.startswith(prefix + "-"):
            found[int(task.name)] = name
    return found


def _attention(seed=0, n=97):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 4, n, 40, generator=g) for _ in "qkv")

    def run():
        return sa.attention(q, k, v, mask=sa.masks.causal(), backend="cpu_fused")

    return run


def _decode(seed=0):
    q, kp, vp, table, lens = make_paged([70, 33, 5], 8, 2, D=40, P=8, Sq=2, seed=seed)
    hi = lens.long().view(-1, 1).expand(-1, 2).contiguous()
    lo = torch.zeros_like(hi)
    splits = paged_decode.key_splits(lo, hi, 8)  # fixed: they follow the thread count otherwise

    def run():
        return paged_decode.decode(q, kp, vp, table, lo, hi, 0.2, None, None, None, splits)[0]

    return run


pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="thread names are read from Linux's /proc"
)


def _reload():
    fused_attention._load.cache_clear()
    paged_decode._library_once.cache_clear()


@pytest.fixture
def own_workers(monkeypatch):
    """The kernels as built without OpenMP, whose calls run on the pool's own workers (with it,
    the participants are PyTorch's OpenMP threads: tests/kernels/test_parallel.py)."""
    monkeypatch.setenv("SELFATTN_KERNEL_OPENMP", "0")
    _reload()
    yield
    _reload()  # the next call loads the build of the restored environment


@pytest.fixture(params=["openmp", "own workers"])
def either_build(request, monkeypatch):
    """Each build: on PyTorch's OpenMP threads (where this machine has it), on the pool's own."""
    if request.param == "own workers":
        monkeypatch.setenv("SELFATTN_KERNEL_OPENMP", "0")
    elif not build.openmp_flags(build.compiler() or "cc"):
        pytest.skip("no OpenMP build here (PyTorch's runtime is not libgomp, or no GCC)")
    _reload()
    yield request.param
    _reload()


@pytest.mark.usefixtures("every_thread", "own_workers")
@pytest.mark.parametrize(
    "module, prefix, make",
    [(fused_attention, "sa-fused", _attention), (paged_decode, "sa-paged", _decode)],
)
def test_workers_are_started_once_and_reused(module, prefix, make, torch_threads):
    lib = _lib(module)
    run = make()
    torch_threads(1)
    want = run()
    torch_threads(2)
    got = run()
    workers = _pool_threads(prefix)  # (other builds of the kernel loaded here have pools too)
    assert lib.pool_workers() >= 1 and len(workers) >= lib.pool_workers()
    for _ in range(3):  # the same threads serve every later call, parked in between
        assert torch.equal(run(), got)
        assert _pool_threads(prefix) == workers
    assert torch.equal(got, want)  # and the result does not depend on the thread count


@pytest.mark.usefixtures("every_thread", "own_workers")
def test_pool_grows_with_the_thread_count(torch_threads):
    lib = _lib(fused_attention)
    run = _attention(seed=1)
    torch_threads(1)
    want = run()
    for n in (2, 3, 1, 3):
        torch_threads(n)
        assert torch.equal(run(), want), n
        assert lib.pool_workers() >= n - 1
    assert len(_pool_threads("sa-fused")) >= lib.pool_workers() >= 2


@pytest.mark.usefixtures("every_thread", "either_build")
def test_concurrent_calls_from_python_threads(torch_threads):
    """Python threads calling both kernels at once (ctypes drops the GIL): one call at a time
    has the workers, the others run on their own threads; every result is the serial one."""
    _lib(fused_attention), _lib(paged_decode)
    torch_threads(2)
    runs = [_attention(seed=s) for s in range(2)] + [_decode(seed=s) for s in range(2)]
    wants = [run() for run in runs]
    errors: list[str] = []

    def hammer(i):
        try:
            for r in range(6):
                j = (i + r) % len(runs)
                if not torch.equal(runs[j](), wants[j]):
                    errors.append(f"thread {i} round {r}: call {j} differs")
        except Exception as e:  # reported below, not lost in the thread
            errors.append(f"thread {i}: {e!r}")

    threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + HANG_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a concurrent call hung"
    assert errors == []


@pytest.mark.usefixtures("every_thread")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_runs_multithreaded_calls(torch_threads, either_build):
    """The parent's workers (its own, or libgomp's) do not exist in a child: its calls must
    start workers of its own, not wait on threads that are not there."""
    lib_fused, lib_paged = _lib(fused_attention), _lib(paged_decode)
    torch_threads(2)
    attention, decode = _attention(seed=2), _decode(seed=2)
    want = (attention(), decode())  # the parent's threads are running now
    if either_build == "own workers":
        assert lib_fused.pool_workers() >= 1 and lib_paged.pool_workers() >= 1
    else:
        assert lib_fused.pool_openmp() == lib_paged.pool_openmp() == 1
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when both kernels give the parent's results on 2 threads
        ok = False
        try:
            torch.set_num_threads(2)
            ok = torch.equal(attention(), want[0]) and torch.equal(decode(), want[1])
            ok = ok and lib_fused.pool_workers() >= 1 and lib_paged.pool_workers() >= 1
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + HANG_S
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child hung for {HANG_S} s in a kernel call")
    assert os.waitstatus_to_exitcode(done[1]) == 0, "the child's results differ"


@pytest.mark.usefixtures("every_thread", "either_build")
@pytest.mark.parametrize("module, make", [(fused_attention, _attention), (paged_decode, _decode)])
def test_a_failed_scratch_allocation_is_reported(module, make, torch_threads):
    lib = _lib(module)
    torch_threads(2)
    run = make(seed=3)
    want = run()
    for n_failing in (1, 2):  # the first participant's scratch, or both
        lib.pool_fail_allocs(n_failing)
        try:
            with pytest.raises(MemoryError, match="could not allocate its scratch"):
                run()
        finally:
            lib.pool_fail_allocs(0)
        assert torch.equal(run(), want)  # the next call is whole again


def test_an_edited_header_rebuilds(tmp_path):
    """The library's name hashes the headers its sources include, not only the sources."""
    (tmp_path / "k.c").write_text('#include "a.h"\nint k(void) { return A; }\n')
    (tmp_path / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "b.h").write_text("#define A 1\n")
    spec = build.CLibrary("k", (str(tmp_path / "k.c"),), ())
    before = build.library_name(spec, "cc", [])
    (tmp_path / "b.h").write_text("#define A 2\n")
    assert build.library_name(spec, "cc", []) != before
    assert spec.input_paths() == [tmp_path / n for n in ("k.c", "a.h", "b.h")]
