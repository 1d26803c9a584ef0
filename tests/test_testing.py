"""The tolerance rule itself (selfattn.testing): it fails wrong answers, and it refuses to judge
where it has no tolerance (a naive baseline that overflowed)."""

from __future__ import annotations

import pytest
import torch

from selfattn import masks
from selfattn.testing import (
    assert_close_to_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)
from tests.kernels.test_fused_fuzz import assert_peaked_gradients


def _forward(dtype=torch.bfloat16, seed=0):
    """(actual, oracle, naive) of one forward: the oracle rounded to ``dtype`` as the answer."""
    q, k, v = make_qkv(2, 2, 9, 16, Sk=13, dtype=dtype, seed=seed)
    oracle = reference_attention(q, k, v, mask=masks.causal())[0]
    naive = naive_attention(q, k, v, mask=masks.causal())[0]
    return oracle.to(dtype), oracle, naive


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_naive_baseline_raises_naming_it_and_where(bad):
    actual, oracle, naive = _forward(seed=1)
    assert_close_to_reference(actual, oracle, naive)  # the finite baseline judges
    naive = naive.clone()
    naive[1, 0, 4, 7] = bad
    kind = "NaN" if bad != bad else "inf"
    with pytest.raises(
        ValueError, match=rf"out: the naive .* baseline is {kind} at \[\[1, 0, 4, 7\]\]"
    ):
        assert_close_to_reference(actual, oracle, naive)
    wrong = torch.zeros_like(actual)  # which that baseline would have let through
    with pytest.raises(ValueError, match="float64 oracle is finite"):
        assert_close_to_reference(wrong, oracle, naive)


def test_a_baseline_non_finite_only_where_the_oracle_is_passes():
    """Where the oracle itself is inf (a row with no key: lse -inf), the baseline may be too."""
    actual, oracle, naive = _forward(seed=2)
    oracle, actual, naive = oracle.clone(), actual.clone(), naive.clone()
    for t in (oracle, actual, naive):
        t[0, 1, 3] = float("-inf")
    assert_close_to_reference(actual, oracle, naive)


def _peaked_gradients(dtype: torch.dtype, seed: int):
    """A decode row over 47 keys with scores ~10 wide (nearly one-hot weights), bf16/fp16: the
    float64 oracle's (dq, dk, dv) and the naive formula's in fp32 on the same inputs."""
    q, k, v = make_qkv(1, 1, 1, 111, Sk=239, seed=seed, dtype=dtype, contiguous=False)
    kwargs = dict(mask=masks.chunked(64, causal=False), scale=1.0)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(1, 1, 1, 111, generator=g, dtype=torch.float64)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    o64, _, leaves64 = reference_attention(*leaves, **kwargs)
    on, _, leavesn = naive_attention(*(t.float() for t in leaves), **kwargs)
    oracle = torch.autograd.grad(o64, leaves64, dout)
    naive32 = torch.autograd.grad(on, leavesn, dout.float())
    return oracle, naive32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_peaked_check_fails_zeros_and_a_value_off_by_a_tenth(dtype):
    oracle, naive32 = _peaked_gradients(dtype, seed=213)
    rounded = [o.to(dtype) for o in oracle]  # the best a kernel can return in this dtype
    assert_peaked_gradients((rounded, oracle, naive32), dtype)
    for wrong in ([torch.zeros_like(r) for r in rounded], [(0.9 * o).to(dtype) for o in oracle]):
        with pytest.raises(AssertionError, match="exceeds"):
            assert_peaked_gradients((wrong, oracle, naive32), dtype)
