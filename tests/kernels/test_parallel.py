"""The C kernels' threads (csrc/parallel.h): PyTorch's own OpenMP threads where the build can share
its runtime, POSIX threads elsewhere and in a forked child."""

from __future__ import annotations

import os
import pickle
import select
import signal
import time

import pytest
import torch

from selfattn.kernels import build, fused_attention, paged_decode, threads
from tests.cache.test_paged import make_paged

# How long a forked child may take before the test calls it hung (it runs two small calls).
CHILD_TIMEOUT_S = 60


def _libgomp_copies() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "libgomp" in line}


def _decode_once(splits=None, seed: int = 3):
    """A decode call's (out, lse); ``splits`` fixed, as the default depends on torch's threads."""
    q, kp, vp, table, lens = make_paged([700, 333], 8, 2, D=64, P=16, Sq=1, seed=seed)
    hi = lens.long().view(-1, 1)
    lo = torch.zeros_like(hi)
    return paged_decode.decode(q, kp, vp, table, lo, hi, 0.125, None, None, splits=splits)


def _attention_once(seed: int = 4):
    import selfattn as sa

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 4, 300, 40, generator=g) for _ in range(3))
    return sa.attention(q, k, v, mask=sa.masks.sliding_window(64), backend="cpu_fused")


def _libraries():
    libs = {"paged_decode": paged_decode.library(), "fused_attention": fused_attention.library()}
    if None in libs.values():
        pytest.skip("no C kernel here (no compiler)")
    return libs


def test_the_kernels_share_pytorchs_openmp_runtime_where_it_is_libgomp():
    libs = _libraries()
    shared = bool(build.openmp_flags(build.compiler()))
    assert libs["paged_decode"].paged_decode_openmp() == shared
    assert libs["fused_attention"].fa_openmp() == shared
    if shared:  # one runtime in the process: the kernels' libgomp is PyTorch's copy
        assert len(_libgomp_copies()) == 1


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


def test_an_edited_header_rebuilds(monkeypatch, tmp_path):
    """The library's cache name hashes the headers the sources include, not the sources alone."""
    for p in [*paged_decode.SPEC.source_paths(), *paged_decode.SPEC.header_paths()]:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(build, "CSRC", tmp_path)
    before = build.library_name(paged_decode.SPEC, "cc", ["-O3"])
    header = tmp_path / "parallel.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert build.library_name(paged_decode.SPEC, "cc", ["-O3"]) != before


@pytest.mark.usefixtures("two_threads", "every_thread")
def test_a_forked_child_still_runs_the_kernels():
    """libgomp's threads do not survive fork (a child's next parallel region hangs, PyTorch's
    own ops too): a child runs the kernels on two threads of its own (its PyTorch ops on one,
    which is how PyTorch survives there), with the parent's results, bit for bit."""
    _libraries()
    splits = (2, 32)  # two key splits of up to 32 pages: 2 sequences x 2 = 4 work items
    want = (_decode_once(splits), _attention_once())  # the parent runs parallel regions first
    torch.ones(1 << 22).mul_(2.0)  # and a PyTorch one, whose workers then wait in libgomp
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, report through the pipe, never return
        try:
            torch.set_num_threads(1)  # PyTorch's own parallel ops would hang here
            threads._count = lambda seconds: 2  # but the kernels take two threads
            got = (_decode_once(splits), _attention_once())
            os.write(write_end, pickle.dumps(got))
        finally:
            os._exit(0)
    os.close(write_end)
    data, deadline = b"", time.monotonic() + CHILD_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_end], [], [], deadline - time.monotonic())
            chunk = os.read(read_end, 1 << 20) if ready else b""
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
        if os.waitpid(pid, os.WNOHANG) == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert data, f"the forked child did not finish within {CHILD_TIMEOUT_S} s"
    (out, lse), attn = pickle.loads(data)
    assert torch.equal(out, want[0][0]) and torch.equal(lse, want[0][1])
    assert torch.equal(attn, want[1])


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
    assert own_threads is not None and own_threads.paged_decode_openmp() == 0
    assert (own_threads._name != libs["paged_decode"]._name) == shared  # another build
    monkeypatch.setattr(paged_decode, "_library_once", lambda: own_threads)
    got = _decode_once(splits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
