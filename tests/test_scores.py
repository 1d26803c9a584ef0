"""Score mods: ALiBi slopes against Press et al. and transformers, softcap, bias tensors with
gradients, T5 relative-position buckets against transformers, composition, callables, errors.

Expected values are computed here independently of ``selfattn.scores``; attention outputs come
from ``selfattn.attention(..., backend="reference")`` and are compared with the formula written
out in the test.
"""

from __future__ import annotations

import math

import pytest
import torch

import selfattn as sa
from selfattn import masks as M
from selfattn import scores as S


def grids(B, H, Sq, Sk, q_offset):
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    i = (torch.arange(Sq) + q_offset).view(1, 1, Sq, 1)
    j = torch.arange(Sk).view(1, 1, 1, Sk)
    return b, h, i, j


def manual_attention(q, k, v, bias=None, allowed=None, scale=None):
    """softmax(q kᵀ · scale + bias, masked) v with MHA heads, written out."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def qkv(B, H, Sq, Sk, D, seed, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, H, s, D, generator=g, dtype=dtype).requires_grad_(requires_grad)
        for s in (Sq, Sk, Sk)
    )


# ----------------------------------------------------------------------------------------------
# ALiBi
# ----------------------------------------------------------------------------------------------


def press_get_slopes(n: int) -> list[float]:
    """Press et al.'s get_slopes (attention_with_linear_biases), restated."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + press_get_slopes(2 * closest)[0::2][: n - closest]


def press_slopes32(n: int) -> torch.Tensor:
    """The slopes as stored (float32), in float64 for the fp64 formulas below."""
    return torch.tensor(press_get_slopes(n), dtype=torch.float32).double()


def test_alibi_slopes_match_press_et_al():
    for n in range(1, 65):
        got = S.alibi_slopes(n)
        assert got.dtype == torch.float32 and got.shape == (n,)
        want = torch.tensor(press_get_slopes(n), dtype=torch.float64)
        torch.testing.assert_close(got.double(), want, rtol=1e-7, atol=0, msg=f"n_heads={n}")
    # spot values from the paper: 8 heads start at 1/2 and halve; all slopes are in (0, 1)
    torch.testing.assert_close(S.alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_alibi_slopes_match_transformers():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    ones = torch.ones(1, 2, dtype=torch.long)  # positions 0 and 1: alibi[h, 0, 1] = slope[h]
    for n in [*range(1, 41), 48, 64, 96, 128]:
        alibi = bloom.build_alibi_tensor(ones, n, torch.float32)  # (n, 1, 2)
        torch.testing.assert_close(
            S.alibi_slopes(n), alibi[:, 0, 1], rtol=2e-6, atol=0, msg=f"n_heads={n}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_alibi_bias_values_and_sign(dtype):
    B, H, Sq, Sk = 2, 5, 4, 9
    mod = S.alibi(H)
    assert mod.additive
    b, h, i, j = grids(B, H, Sq, Sk, Sk - Sq)
    score = torch.randn(B, H, Sq, Sk, dtype=dtype, generator=torch.Generator().manual_seed(1))
    out = mod.score_mod(score, b, h, i, j)
    assert out.dtype == dtype
    slopes = torch.tensor(press_get_slopes(H), dtype=torch.float32).to(dtype)
    want = -slopes.view(1, H, 1, 1) * (i - j).abs().to(dtype)
    torch.testing.assert_close(out - score, want.expand_as(score))
    bias = mod.bias(b, h, i, j)
    assert bool((bias <= 0).all()) and bool((bias[..., 3, 8] == 0).all())  # own position: 0
    # the further the key, the larger the penalty; H=5 slopes are 1/4, 1/16, 1/64, 1/256 and
    # then 1/2 (the interleaved extra head is the steepest)
    assert bool((bias[0, :, 3, :-1].diff(dim=-1) > 0).all())
    assert bias[0, 4, 3, 0] < bias[0, 0, 3, 0] < bias[0, 1, 3, 0] < bias[0, 3, 3, 0] < 0


def test_alibi_through_reference_attention():
    B, H, Sq, Sk, D = 2, 6, 5, 11, 8
    q, k, v = qkv(B, H, Sq, Sk, D, seed=2)
    _, _, i, j = grids(B, H, Sq, Sk, Sk - Sq)
    slopes = press_slopes32(H).view(1, H, 1, 1)
    out = sa.attention(q, k, v, mask=M.causal(), score_mod=S.alibi(H), backend="reference")
    # Press et al.'s causal form slope · (j - i)
    want = manual_attention(q, k, v, bias=slopes * (j - i), allowed=j <= i)
    torch.testing.assert_close(out, want)


def test_alibi_errors():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"n_heads=8 but the call has Hq=4 .* alibi\(4\)"):
        sa.attention(q, q, q, score_mod=S.alibi(8), backend="reference")
    with pytest.raises(ValueError, match=r"got 0"):
        S.alibi(0)
    with pytest.raises(TypeError, match=r"float 2\.0"):
        S.alibi_slopes(2.0)
    with pytest.raises(TypeError, match=r"bool True"):
        S.alibi(True)


# ----------------------------------------------------------------------------------------------
# softcap
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [0.5, 7, 50.0])
def test_softcap_values_and_bounds(cap):
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 3, 4, 5, dtype=torch.float64, generator=g) * 3 * cap
    out = S.softcap(cap).score_mod(s, None, None, None, None)
    want = torch.tensor([cap * math.tanh(x / cap) for x in s.flatten().tolist()], dtype=s.dtype)
    torch.testing.assert_close(out, want.view_as(s))
    huge = torch.tensor([-1e30, -1e6, 0.0, 1e6, 1e30], dtype=torch.float64)
    capped = S.softcap(cap).score_mod(huge, None, None, None, None)
    assert bool((capped.abs() <= cap).all()) and bool((capped.diff() >= 0).all())
    assert capped[2] == 0
    # near zero it is the identity to first order
    small = torch.tensor([1e-6 * cap], dtype=torch.float64)
    torch.testing.assert_close(S.softcap(cap).score_mod(small, None, None, None, None), small)
    assert not S.softcap(cap).additive


@pytest.mark.parametrize(
    "cap,exc,match",
    [
        (0, ValueError, r"got 0"),
        (-1.5, ValueError, r"got -1\.5"),
        (float("inf"), ValueError, r"got inf"),
        (float("nan"), ValueError, r"got nan"),
        ("30", TypeError, r"str '30'"),
        (True, TypeError, r"bool True"),
        (torch.tensor(3.0), TypeError, r"Tensor"),
    ],
)
def test_softcap_invalid(cap, exc, match):
    with pytest.raises(exc, match=match):
        S.softcap(cap)


# ----------------------------------------------------------------------------------------------
# bias(tensor)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(11,), (5, 11), (1, 11), (3, 1, 11), (3, 5, 11), (2, 1, 5, 11), (2, 3, 5, 1)]
)
def test_bias_broadcasts_and_gets_gradients(shape):
    B, H, Sq, Sk, D = 2, 3, 5, 11, 4
    q, k, v = qkv(B, H, Sq, Sk, D, seed=4, requires_grad=True)
    g = torch.Generator().manual_seed(5)
    t = torch.randn(shape, dtype=torch.float64, generator=g).requires_grad_(True)
    t2 = t.detach().clone().requires_grad_(True)
    cot = torch.randn(B, H, Sq, D, dtype=torch.float64, generator=g)
    out = sa.attention(q, k, v, score_mod=S.bias(t), mask=M.causal(), backend="reference")
    _, _, i, j = grids(B, H, Sq, Sk, Sk - Sq)
    want = manual_attention(q.detach(), k.detach(), v.detach(), bias=t2, allowed=j <= i)
    torch.testing.assert_close(out, want)
    (grad,) = torch.autograd.grad((out * cot).sum(), t)
    (grad_want,) = torch.autograd.grad((want * cot).sum(), t2)
    assert grad.shape == t.shape
    torch.testing.assert_close(grad, grad_want)
    # a plain float tensor as score_mod= is the same bias
    out2 = sa.attention(q, k, v, score_mod=t.detach(), mask=M.causal(), backend="reference")
    torch.testing.assert_close(out2, want)


def test_bias_is_row_ordered_and_neg_inf_masks():
    B, H, Sq, Sk, D = 1, 2, 3, 6, 4
    q, k, v = qkv(B, H, Sq, Sk, D, seed=6)
    t = torch.zeros(Sq, Sk, dtype=torch.float64)
    t[:, -1] = float("-inf")  # the last key is never attended
    for q_offset in (None, 0, 10):
        out = sa.attention(q, k, v, score_mod=S.bias(t), q_offset=q_offset, backend="reference")
        want = manual_attention(q, k[:, :, :-1], v[:, :, :-1])
        torch.testing.assert_close(out, want)
    mod = S.bias(t)
    assert mod.additive and mod.tensors()[0].shape == (1, 1, Sq, Sk)


def test_bias_errors():
    with pytest.raises(TypeError, match=r"torch\.int64; cast it with \.float\(\)"):
        S.bias(torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"torch\.complex64"):
        S.bias(torch.zeros(3, 3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"torch\.bool; pass bool masks as mask="):
        S.bias(torch.zeros(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"got list"):
        S.bias([[0.0]])
    with pytest.raises(ValueError, match=r"5-D shape \(1, 1, 1, 3, 3\)"):
        S.bias(torch.zeros(1, 1, 1, 3, 3))
    q = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match=r"shape \(1, 1, 4, 5\) .* \(2, 3, 4, 4\)"):
        sa.attention(q, q, q, score_mod=torch.zeros(4, 5), backend="reference")
    with pytest.raises(ValueError, match=r"shape \(1, 2, 1, 1\) .* \(2, 3, 4, 4\)"):
        sa.attention(q, q, q, score_mod=torch.zeros(2, 1, 1), backend="reference")


# ----------------------------------------------------------------------------------------------
# T5 relative-position bias
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (16, 64), (9, 50)])
def test_relative_position_buckets_match_t5(bidirectional, num_buckets, max_distance):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 301)
    rpb = S.RelativePositionBias(4, num_buckets, max_distance, bidirectional=bidirectional)
    want = t5.T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    got = rpb.bucket(rel)
    assert torch.equal(got, want.long())
    assert int(got.min()) >= 0 and int(got.max()) < num_buckets
    assert torch.equal(rpb.bucket(rel.to(torch.int32)), got)


def test_relative_position_bias_values_and_gradients():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    B, H, Sq, Sk, D = 2, 3, 4, 7, 8
    torch.manual_seed(7)
    rpb = S.RelativePositionBias(H, num_buckets=8, max_distance=16, bidirectional=False).double()
    assert rpb.additive and rpb.tensors() == (rpb.weight,)
    q, k, v = qkv(B, H, Sq, Sk, D, seed=8)
    _, _, i, j = grids(B, H, Sq, Sk, Sk - Sq)
    buckets = t5.T5Attention._relative_position_bucket(
        j - i, bidirectional=False, num_buckets=8, max_distance=16
    )
    table = rpb.weight.detach().clone().requires_grad_(True)
    bias = table[buckets].permute(0, 1, 4, 2, 3)[0]  # (1, 1, Sq, Sk, H) -> (1, H, Sq, Sk)
    torch.testing.assert_close(rpb(Sq, Sk), bias)  # forward(): T5's compute_bias
    out = sa.attention(q, k, v, score_mod=rpb, mask=M.causal(), backend="reference")
    want = manual_attention(q, k, v, bias=bias, allowed=j <= i)
    torch.testing.assert_close(out, want)
    cot = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * cot).sum(), rpb.weight)
    (grad_want,) = torch.autograd.grad((want * cot).sum(), table)
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, grad_want)


def test_relative_position_bias_errors():
    with pytest.raises(ValueError, match=r"num_buckets must be >= 4 .* got 3"):
        S.RelativePositionBias(2, num_buckets=3)
    with pytest.raises(ValueError, match=r"max_distance \(8\) must exceed .* \(8 for num_buckets"):
        S.RelativePositionBias(2, num_buckets=32, max_distance=8)
    with pytest.raises(TypeError, match=r"n_heads must be an int, got float 2\.0"):
        S.RelativePositionBias(2.0)
    with pytest.raises(ValueError, match=r"n_heads must be >= 1, got 0"):
        S.RelativePositionBias(0)
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"n_heads=2 but the call has Hq=4"):
        sa.attention(q, q, q, score_mod=S.RelativePositionBias(2), backend="reference")


# ----------------------------------------------------------------------------------------------
# Composition and callables
# ----------------------------------------------------------------------------------------------


def test_compose_order_and_additivity():
    B, H, Sq, Sk = 1, 4, 3, 8
    b, h, i, j = grids(B, H, Sq, Sk, Sk - Sq)
    s = torch.randn(B, H, Sq, Sk, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    s = s * 4
    slopes = press_slopes32(H).view(1, H, 1, 1)
    ali = -slopes * (i - j).abs()
    cap = 2.0
    after = (S.alibi(H) >> S.softcap(cap)).score_mod(s, b, h, i, j)
    before = (S.softcap(cap) >> S.alibi(H)).score_mod(s, b, h, i, j)
    torch.testing.assert_close(after, cap * torch.tanh((s + ali) / cap))
    torch.testing.assert_close(before, cap * torch.tanh(s / cap) + ali)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(
        S.compose(S.alibi(H), S.softcap(cap)).score_mod(s, b, h, i, j), after
    )

    t = torch.randn(Sq, Sk, dtype=torch.float64)
    add = S.alibi(H) >> S.bias(t)
    assert add.additive and not (S.alibi(H) >> S.softcap(cap)).additive
    # bias(tensor) is row ordered: bound at q_offset, row = position - q_offset
    got = add.bind(Sk - Sq).bias(b, h, i, j)
    torch.testing.assert_close(got, ali + t, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match=r"softcap\(2\) is not an additive"):
        (S.alibi(H) >> S.softcap(cap)).bias(b, h, i, j)
    nested = (S.alibi(H) >> S.bias(t)) >> (S.softcap(cap) >> S.alibi(H))
    assert len(nested.mods) == 4  # flattened
    (read,) = nested.tensors()  # the bias tensor, as score_mod reads it
    assert read.shape == (1, 1, Sq, Sk) and torch.equal(read[0, 0], t)
    with pytest.raises(ValueError, match=r"at least one"):
        S.compose()


def test_callables_match_builtins_and_compose_either_side():
    B, H, Sq, Sk, D = 2, 4, 5, 9, 8
    q, k, v = qkv(B, H, Sq, Sk, D, seed=10)
    slopes = S.alibi_slopes(H).double()

    def alibi_fn(score, b, h, q_idx, kv_idx):  # FlexAttention style
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def tanh_cap(score, b, h, q_idx, kv_idx):
        return 3.0 * torch.tanh(score / 3.0)

    ref = sa.attention(q, k, v, score_mod=S.alibi(H) >> S.softcap(3.0), backend="reference")
    for mod in (alibi_fn >> S.softcap(3.0), S.alibi(H) >> tanh_cap, S.compose(alibi_fn, tanh_cap)):
        out = sa.attention(q, k, v, score_mod=mod, backend="reference")
        torch.testing.assert_close(out, ref, msg=repr(mod))
    assert S.as_score_mod(alibi_fn).as_score_mod() is alibi_fn  # FlexAttention gets it back


def test_callable_score_mod_vmap_fallback_and_bias_only_result():
    B, H, Sq, Sk, D = 1, 2, 4, 6, 8
    q, k, v = qkv(B, H, Sq, Sk, D, seed=11)
    _, _, i, j = grids(B, H, Sq, Sk, Sk - Sq)

    def not_broadcasting(score, b, h, q_idx, kv_idx):  # stack needs equal shapes: vmap only
        return score + torch.stack([q_idx, kv_idx]).amax(0).to(score.dtype) * 0.1

    def ignores_score(score, b, h, q_idx, kv_idx):  # returns a (1, 1, Sq, Sk) tensor
        return (kv_idx - q_idx).to(torch.float64) * 0.2

    want = manual_attention(q, k, v, bias=torch.maximum(i, j).double() * 0.1)
    torch.testing.assert_close(
        sa.attention(q, k, v, score_mod=not_broadcasting, backend="reference"), want
    )
    s = q @ k.transpose(-1, -2) * 0
    want2 = torch.softmax(s + (j - i) * 0.2, dim=-1) @ v
    got2 = sa.attention(q, k, v, score_mod=ignores_score, backend="reference")
    torch.testing.assert_close(got2, want2)


def test_as_score_mod_errors():
    with pytest.raises(TypeError, match=r"torch\.int32"):
        S.as_score_mod(torch.zeros(3, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"torch\.complex128"):
        S.as_score_mod(torch.zeros(3, 3, dtype=torch.complex128))
    with pytest.raises(TypeError, match=r"got str"):
        S.as_score_mod("alibi")
    with pytest.raises(TypeError, match=r"got int"):
        S.as_score_mod(3)

    def four(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(TypeError, match=r"four\(b, h, q_idx, kv_idx\) .* mask="):
        S.as_score_mod(four)
    q = torch.randn(1, 2, 3, 4)

    def returns_bool(score, b, h, q_idx, kv_idx):
        return score > 0

    with pytest.raises(
        TypeError, match=r"returns_bool must return a floating-point .* torch\.bool"
    ):
        sa.attention(q, q, q, score_mod=returns_bool, backend="reference")

    def returns_int(score, b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    with pytest.raises(TypeError, match=r"returns_int .* torch\.int64"):
        sa.attention(q, q, q, score_mod=returns_int, backend="reference")


def test_relative_and_row_ordered_claims_hold_elementwise():
    """A score mod that says it is relative gives the same scores when queries and keys move by
    the same amount (ring attention then calls it unshifted); composition answers from its parts;
    a bias tensor is read by query row."""
    g = torch.Generator().manual_seed(7)
    H, Sq, Sk, shift = 3, 5, 9, 37
    score = torch.randn(2, H, Sq, Sk, generator=g, dtype=torch.float64)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q, kv = (torch.arange(Sq) + 4).view(1, 1, Sq, 1), torch.arange(Sk).view(1, 1, 1, Sk)
    t5 = S.RelativePositionBias(H, num_buckets=8, max_distance=16).double()
    relative = [S.alibi(H), S.softcap(2.0), t5, S.alibi(H) >> S.softcap(3.0)]
    for mod in relative:
        assert mod.relative, repr(mod)
        with torch.no_grad():
            here = mod.score_mod(score, b, h, q, kv)
            moved = mod.score_mod(score, b, h, q + shift, kv + shift)
        torch.testing.assert_close(moved, here, rtol=0, atol=0, msg=repr(mod))
    bias = S.bias(torch.randn(Sq, Sk, generator=g))
    fn = S.as_score_mod(lambda s, b, h, q, kv: s + q)
    for mod in (bias, fn, S.alibi(H) >> bias, S.softcap(2.0) >> fn):
        assert not mod.relative, repr(mod)
    assert bias.row_ordered and (S.alibi(H) >> bias).row_ordered
    assert not any(m.row_ordered for m in [*relative, fn])


def test_kernel_terms_name_alibi_bias_and_softcap_in_order():
    """What a kernel applies as data (the Triton backend), in the mod's order; None for what is
    not made of those terms."""
    slopes_mod = S.alibi(4)
    terms = (slopes_mod >> S.bias(torch.ones(1, 4, 3, 5)) >> S.softcap(2.0)).bind(2)
    names = [name for name, _ in terms.kernel_terms(2, 3, 5)]
    assert names == ["alibi", "bias", "softcap"]
    _, view = terms.kernel_terms(2, 3, 5)[1]
    assert view.shape == (1, 4, 3, 5)
    assert S.softcap(3.0).kernel_terms(0, 1, 1) == (("softcap", 3.0),)
    assert S.as_score_mod(lambda s, b, h, qi, ki: s).kernel_terms(0, 1, 1) is None
    assert (S.alibi(4) >> S.as_score_mod(lambda s, b, h, qi, ki: s)).kernel_terms(0, 1, 1) is None
