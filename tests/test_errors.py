"""Bad input to ``selfattn.attention``: one test per error path, each message naming the culprit."""

from __future__ import annotations

import re

import pytest
import torch

import selfattn
from selfattn import masks
from selfattn.testing import make_qkv

# q (2, 4, 5, 8), k (2, 2, 7, 8), v (2, 2, 7, 6)
B, Hq, Hkv, Sq, Sk, D, Dv = 2, 4, 2, 5, 7, 8, 6


@pytest.fixture
def qkv():
    return make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, Dv=Dv, seed=1)


def raises(exc, *fragments):
    """``pytest.raises`` requiring every fragment (matched literally) in the message."""
    return pytest.raises(exc, match="".join(f"(?=.*{re.escape(f)})" for f in fragments))


# -- tensors ---------------------------------------------------------------------------------------
def test_q_3d(qkv):
    q, k, v = qkv
    with raises(ValueError, "q (B, Hq, Sq, D)", "4-D", "(4, 5, 8)"):
        selfattn.attention(q[0], k, v)


def test_k_5d(qkv):
    q, k, v = qkv
    with raises(ValueError, "k (B, Hkv, Sk, D)", "4-D", "(1, 2, 2, 7, 8)"):
        selfattn.attention(q, k.unsqueeze(0), v)


def test_v_3d(qkv):
    q, k, v = qkv
    with raises(ValueError, "v (B, Hkv, Sk, Dv)", "(2, 14, 6)"):
        selfattn.attention(q, k, v.reshape(2, 14, 6))


def test_batch_mismatch(qkv):
    q, k, v = qkv
    with raises(ValueError, "B=2", "k has 3", "v has 3", "or 1 each"):
        selfattn.attention(q, torch.cat([k, k[:1]]), torch.cat([v, v[:1]]))
    with raises(ValueError, "B=2", "k has 1", "v has 2"):  # batch 1 broadcasts only for both
        selfattn.attention(q, k[:1], v)


def test_head_dim_mismatch_between_q_and_k(qkv):
    q, k, v = qkv
    with raises(ValueError, "head dims differ", "D=8", "has 5"):
        selfattn.attention(q, k[..., :5], v)


def test_k_v_disagree_on_sk(qkv):
    q, k, v = qkv
    with raises(ValueError, "Sk=7", "Sk=4", "(2, 2, 4, 6)"):
        selfattn.attention(q, k, v[:, :, :4])


def test_k_v_disagree_on_hkv(qkv):
    q, k, v = qkv
    with raises(ValueError, "Hkv=2", "Hkv=1"):
        selfattn.attention(q, k, v[:, :1])


def test_hq_not_divisible_by_hkv():
    q, k, v = make_qkv(1, 12, 3, 8, Hkv=5, seed=2)
    with raises(ValueError, "Hq (12)", "Hkv (5)"):
        selfattn.attention(q, k, v)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
def test_different_devices(qkv, which):
    tensors = list(qkv)
    tensors[which] = tensors[which].to("meta")
    with raises(ValueError, "one device", "meta", "cpu"):
        selfattn.attention(*tensors)


def test_different_dtypes(qkv):
    q, k, v = qkv
    with raises(TypeError, "share a dtype", "torch.float32", "torch.float64"):
        selfattn.attention(q, k.double(), v)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int8, torch.complex64, torch.bool], ids=str
)  # fmt: skip
@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
def test_non_float_dtypes(qkv, dtype, which):
    tensors = list(qkv)
    tensors[which] = tensors[which].to(dtype) if dtype != torch.bool else tensors[which] > 0
    with raises(TypeError, f"{'qkv'[which]} has dtype {dtype}", "float32"):
        selfattn.attention(*tensors)


@pytest.mark.parametrize("bad", [[[1.0]], 3.0, None, "q"], ids=["list", "float", "None", "str"])
def test_non_tensor_input(qkv, bad):
    q, _, v = qkv
    with raises(TypeError, "k must be a torch.Tensor", type(bad).__name__):
        selfattn.attention(q, bad, v)


# -- masks and score mods --------------------------------------------------------------------------
def test_bool_mask_that_does_not_broadcast(qkv):
    q, k, v = qkv
    bad = torch.ones(3, 5, dtype=torch.bool)
    with raises(ValueError, "(1, 1, 3, 5)", "(2, 4, 5, 7)"):
        selfattn.attention(q, k, v, mask=bad)


def test_bool_mask_with_wrong_head_count(qkv):
    q, k, v = qkv
    bad = torch.ones(B, 3, Sq, Sk, dtype=torch.bool)
    with raises(ValueError, "(2, 3, 5, 7)", "(2, 4, 5, 7)"):
        selfattn.attention(q, k, v, mask=bad)


def test_float_tensor_as_mask_points_to_score_mod(qkv):
    q, k, v = qkv
    with raises(TypeError, "torch.float32", "score_mod"):
        selfattn.attention(q, k, v, mask=torch.zeros(Sq, Sk))


def test_mask_of_the_wrong_type(qkv):
    q, k, v = qkv
    with raises(TypeError, "mask must be", "int"):
        selfattn.attention(q, k, v, mask=3)


def test_mask_mod_returning_non_bool(qkv):
    q, k, v = qkv
    with raises(TypeError, "bool", "torch.int64"):
        selfattn.attention(q, k, v, mask=lambda b, h, q_idx, kv_idx: q_idx - kv_idx)


def test_score_mod_tensor_that_does_not_broadcast(qkv):
    q, k, v = qkv
    with raises(ValueError, "(1, 3, 5, 7)", "(2, 4, 5, 7)"):
        selfattn.attention(q, k, v, score_mod=torch.zeros(3, Sq, Sk))


def test_int_tensor_as_score_mod(qkv):
    q, k, v = qkv
    with raises(TypeError, "floating-point", "torch.int64"):
        selfattn.attention(q, k, v, score_mod=torch.zeros(Sq, Sk, dtype=torch.long))


def test_score_mod_of_the_wrong_type(qkv):
    q, k, v = qkv
    with raises(TypeError, "score_mod must be", "str"):
        selfattn.attention(q, k, v, score_mod="alibi")


@pytest.mark.parametrize("size", [0, -3])
def test_sliding_window_size_below_one(size):
    with raises(ValueError, "sliding_window", f"got {size}"):
        masks.sliding_window(size)


def test_padding_lengths_of_wrong_batch(qkv):
    q, k, v = qkv
    with raises(ValueError, "3 lengths", "B=2"):
        selfattn.attention(q, k, v, mask=masks.padding([3, 4, 5]))


# -- scalars ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")], ids=["neg", "1", "1.5", "nan"])
def test_dropout_p_out_of_range(qkv, p):
    q, k, v = qkv
    with raises(ValueError, "dropout_p", "[0, 1)", f"got {p}"):
        selfattn.attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("p", ["0.1", None, True], ids=["str", "None", "bool"])
def test_dropout_p_not_a_number(qkv, p):
    q, k, v = qkv
    with raises(TypeError, "dropout_p", repr(p)):
        selfattn.attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_scale_not_finite(qkv, scale):
    q, k, v = qkv
    with raises(ValueError, "scale", repr(scale)):
        selfattn.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", ["0.5", [0.5], True], ids=["str", "list", "bool"])
def test_scale_not_a_number(qkv, scale):
    q, k, v = qkv
    with raises(TypeError, "scale", repr(scale)):
        selfattn.attention(q, k, v, scale=scale)


def test_scale_tensor_with_many_elements(qkv):
    q, k, v = qkv
    with raises(TypeError, "scale", "(2,)"):
        selfattn.attention(q, k, v, scale=torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("q_offset", [1.5, "2", torch.tensor(1.0)], ids=["float", "str", "t"])
def test_q_offset_not_an_int(qkv, q_offset):
    q, k, v = qkv
    with raises(TypeError, "q_offset", repr(q_offset)):
        selfattn.attention(q, k, v, q_offset=q_offset)


def test_generator_of_the_wrong_type(qkv):
    q, k, v = qkv
    with raises(TypeError, "generator", "int"):
        selfattn.attention(q, k, v, dropout_p=0.1, generator=3)


def test_unknown_backend(qkv):
    q, k, v = qkv
    with raises(ValueError, "'flash'", "reference", "chunked"):
        selfattn.attention(q, k, v, backend="flash")


def test_attention_weights_validates_like_attention(qkv):
    q, k, v = qkv
    with raises(ValueError, "Hq (4)", "Hkv (3)"):
        selfattn.attention_weights(q, torch.randn(B, 3, Sk, D), torch.randn(B, 3, Sk, Dv))
    with raises(TypeError, "q_offset", "1.5"):
        selfattn.attention_weights(q, k, v, q_offset=1.5)
