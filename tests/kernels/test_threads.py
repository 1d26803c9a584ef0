"""How many threads the C kernels start (selfattn.kernels.threads): as many as the work pays for."""

from __future__ import annotations

import pytest
import torch

from selfattn.kernels import fused_attention, paged_decode, threads
from tests._kernel_helpers import c_kernel


@pytest.mark.usefixtures("two_threads")
def test_thread_count_follows_the_work():
    assert threads.for_flops(1e3) == 1  # a 16 x 16 tile: the calling thread alone
    assert threads.for_bytes(64 << 10) == 1  # a short context's pages
    assert threads.for_flops(1e12) == 2  # never more than torch's threads
    assert threads.for_bytes(1 << 30) == 2


def _spy(monkeypatch, module, name):
    """Record the n_threads argument of the C entry ``name`` of ``module``'s library."""
    seen = []
    lib = c_kernel(module)
    fn = getattr(lib, name)

    class Spy:
        def __call__(self, iargs, ptrs, n, *rest):
            seen.append(n)
            return fn(iargs, ptrs, n, *rest)

    monkeypatch.setattr(lib, name, Spy())
    return seen


@pytest.mark.usefixtures("two_threads")
def test_small_attention_calls_run_on_one_thread(monkeypatch):
    import selfattn as sa

    seen = _spy(monkeypatch, fused_attention, "fa_forward")
    g = torch.Generator().manual_seed(0)
    small = torch.randn(1, 2, 16, 16, generator=g)
    sa.attention(small, small, small, mask=sa.masks.causal(), backend="cpu_fused")
    big = torch.randn(1, 8, 1024, 64, generator=g)
    sa.attention(big, big, big, mask=sa.masks.causal(), backend="cpu_fused")
    assert seen == [1, 2]


@pytest.mark.usefixtures("two_threads")
def test_short_decode_runs_on_one_thread(monkeypatch):
    from tests.cache.test_paged import make_paged

    seen = _spy(monkeypatch, paged_decode, "paged_decode")
    for n in (40, 30_000):
        q, kp, vp, table, lens = make_paged([n], 8, 2, D=64, P=16, Sq=1, seed=1)
        hi = lens.long().view(-1, 1)
        paged_decode.decode(q, kp, vp, table, torch.zeros_like(hi), hi, 0.1, None, None)
    assert seen == [1, 2]
