"""The C kernels' threads (csrc/thread_pool.h): PyTorch's own OpenMP threads where the build can
share its runtime, the pool's own workers elsewhere and in a forked child."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from selfattn.kernels import build, fused_attention, paged_decode
from tests._kernel_helpers import c_kernel
from tests.cache.test_paged import make_paged


def _mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process (/proc/self/maps), or ""."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[-1] if len(fields) > 5 else ""
    return ""


def _decode_once(splits=None, seed: int = 3):
    """A decode call's (out, lse); ``splits`` fixed, as the default depends on torch's threads."""
    q, kp, vp, table, lens = make_paged([700, 333], 8, 2, D=64, P=16, Sq=1, seed=seed)
    hi = lens.long().view(-1, 1)
    lo = torch.zeros_like(hi)
    return paged_decode.decode(q, kp, vp, table, lo, hi, 0.125, None, None, splits=splits)


def _libraries():
    return {"paged_decode": c_kernel(paged_decode), "fused_attention": c_kernel(fused_attention)}


def test_the_kernels_share_pytorchs_openmp_runtime_where_it_is_libgomp():
    libs = _libraries()
    shared = bool(build.openmp_flags(build.compiler()))
    assert libs["paged_decode"].pool_openmp() == shared
    assert libs["fused_attention"].pool_openmp() == shared
    if shared:  # the kernels' OpenMP runtime is PyTorch's copy of libgomp, not a second one
        torch_dir = Path(torch.__file__).parent
        for lib in libs.values():
            entry = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
            assert Path(_mapped_file(entry)).is_relative_to(torch_dir), _mapped_file(entry)


def test_openmp_is_off_on_request_and_for_other_compilers(monkeypatch, tmp_path):
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("SELFATTN_KERNEL_OPENMP", "0")
    assert build.openmp_flags(cc) == ()
    monkeypatch.delenv("SELFATTN_KERNEL_OPENMP")
    fake = tmp_path / "clang"  # says it is clang: its -fopenmp would link a second runtime
    fake.write_text("#!/bin/sh\necho 'clang version 18.0.0'\n")
    fake.chmod(0o700)
    assert build.openmp_flags(str(fake)) == ()
    spec = paged_decode.SPEC
    tried = spec.target_flags(cc)
    assert tried[-len(spec.targets) :] == list(spec.targets)  # the plain builds stay as fallbacks


@pytest.mark.usefixtures("two_threads", "every_thread")
def test_the_build_without_openmp_gives_the_same_results(monkeypatch):
    """SELFATTN_KERNEL_OPENMP=0 (and every machine where PyTorch's runtime is not libgomp)
    builds the kernel with POSIX threads: the same results, bit for bit."""
    libs = _libraries()
    splits = (2, 32)
    want = _decode_once(splits)
    shared = bool(build.openmp_flags(build.compiler()))
    monkeypatch.setenv("SELFATTN_KERNEL_OPENMP", "0")
    own_threads = build.load(paged_decode.SPEC)
    assert own_threads is not None and own_threads.pool_openmp() == 0
    assert (own_threads._name != libs["paged_decode"]._name) == shared  # another build
    monkeypatch.setattr(paged_decode, "_library_once", lambda: own_threads)
    got = _decode_once(splits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "loaded, shareable",
    [
        (["torch/lib/libgomp.so.1"], True),  # PyTorch's CPU wheels
        (["torch/lib/libgomp.so.1", "sklearn.libs/libgomp-e985bcbb.so.1.0.0"], True),
        (["torch/lib/libgomp-a34b3233.so.1"], False),  # auditwheel's name: another soname
        (["torch/lib/libgomp-a34b3233.so.1", "/usr/lib/libgomp.so.1"], False),
        (["/opt/conda/lib/libgomp.so.1.0.0"], True),  # PyTorch linking the environment's
        ([], False),
    ],
)
def test_openmp_only_where_a_build_binds_to_pytorchs_libgomp(monkeypatch, loaded, shareable):
    """-fopenmp links libgomp.so.1: only where that soname is PyTorch's copy does the build
    share its threads (else it would bring a second runtime)."""
    root = Path("/site-packages")
    paths = [root / p if not p.startswith("/") else Path(p) for p in loaded]
    monkeypatch.setattr(build, "_mapped_libgomps", lambda: paths)
    assert build._shareable_libgomp(root / "torch") == shareable
