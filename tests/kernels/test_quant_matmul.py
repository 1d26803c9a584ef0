"""The C quantised-matmul kernel (``selfattn.kernels.quant_matmul``): each instruction-set path
(forced by ``SELFATTN_QUANT_ISA``), weight kind and group against the float64 value of its own
arithmetic (the activations rounded to int8 per 32-block, :func:`twin`) and against the
unrounded product, by the ratio rule; odd sizes; results independent of the thread count."""

from __future__ import annotations

import pytest
import torch

from selfattn.kernels import quant_matmul as qmm
from selfattn.testing import assert_close_to_reference

pytestmark = pytest.mark.skipif(
    qmm.library() is None, reason="no C compiler here: the kernel cannot be built"
)


@pytest.fixture(params=qmm.supported_isas() or ["generic"])
def isa(request, monkeypatch):
    monkeypatch.setenv("SELFATTN_QUANT_ISA", request.param)
    assert qmm.isa() == request.param
    return request.param


def random_weights(kind: str, N: int, K: int, group: int, g: torch.Generator):
    """``(qs, d, m)``: every code value (s8: -127..127; u4: all nibbles), fp16 scales of either
    sign with some subnormal, minimums for ``u4_min``."""
    if kind == "s8":
        qs = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    else:
        qs = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)

    def halves():
        v = torch.randn(N, K // group, generator=g, dtype=torch.float64) * 0.05
        tiny = torch.rand(N, K // group, generator=g) < 0.1
        return torch.where(tiny, v * 2.0**-16, v).half().view(torch.int16)

    return qs, halves(), halves() if kind == "u4_min" else None


def check(x, qs, d, m, kind, group, bias=None):
    got = qmm.matmul(x, qs, d, m, kind, group, bias)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], d.shape[0])
    exact = qmm.twin(x, qs, d, m, kind, group, bias)
    naive = qmm.twin(x, qs, d, m, kind, group, bias, dtype=x.dtype)
    assert_close_to_reference(got, exact, naive, dtype=x.dtype, what="vs rounded activations")
    w = qmm.dequantize(qs, d, m, kind, group, torch.float64)
    unrounded = torch.nn.functional.linear(x.double(), w, None if bias is None else bias.double())
    assert_close_to_reference(got, unrounded, naive, dtype=x.dtype)


CASES = [  # (kind, group, M, N, K): K down to one block, tails of 1-3 blocks past 4, odd N
    ("s8", 32, 1, 97, 32),
    ("s8", 96, 7, 64, 96),
    ("s8", 576, 16, 7, 576),
    ("u4_offset", 32, 1, 1, 160),
    ("u4_offset", 64, 5, 97, 448),
    ("u4_min", 32, 3, 130, 224),
    ("u4_min", 128, 16, 33, 512),
    ("u4_min", 32, 9, 65, 96),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "group", "M", "N", "K"), CASES)
def test_each_path_matches_its_arithmetic_in_fp64(isa, kind, group, M, N, K, dtype):
    g = torch.Generator().manual_seed(hash((isa, kind, group, M, N, K, str(dtype))) % 2**31)
    qs, d, m = random_weights(kind, N, K, group, g)
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 3).to(dtype)
    x[0, :32] = 0  # a block of zeros: scale 0
    bias = torch.randn(N, generator=g).to(dtype) if M % 2 else None
    check(x, qs, d, m, kind, group, bias)


def test_bias_of_the_other_dtype_and_outliers(isa):
    """An fp32 bias with bf16 input; one huge activation in a block (its 31 others round to 0)."""
    g = torch.Generator().manual_seed(7)
    qs, d, m = random_weights("u4_min", 40, 128, 32, g)
    x = torch.randn(2, 128, generator=g)
    x[1, 5] = 1e4
    check(x.bfloat16(), qs, d, m, "u4_min", 32, torch.randn(40, generator=g))
    check(x, qs, d, m, "u4_min", 32, torch.randn(40, generator=g).bfloat16())


def test_threads_do_not_change_the_result():
    g = torch.Generator().manual_seed(3)
    qs, d, m = random_weights("u4_offset", 4099, 256, 32, g)
    x = torch.randn(3, 256, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qmm.matmul(x, qs, d, m, "u4_offset", 32)
        torch.set_num_threads(2)
        two = qmm.matmul(x, qs, d, m, "u4_offset", 32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_quantised_activations_are_the_twins():
    """The twin's rounding: int8 codes within +-127, scale max|x| / 127, zero blocks zero."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 96, generator=g)
    x[2, 32:64] = 0
    xq = qmm.quantize_activations(x).view(3, 3, 32)
    s = x.view(3, 3, 32).abs().amax(-1, keepdim=True) / 127
    codes = torch.where(s == 0, torch.zeros_like(xq), xq / s)
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() < 127.001
    assert (xq - x.view(3, 3, 32)).abs().le(s / 2 * (1 + 1e-5)).all()


def test_a_path_this_cpu_lacks_or_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.setenv("SELFATTN_QUANT_ISA", "avx9000")
    with pytest.raises(ValueError, match=r"SELFATTN_QUANT_ISA='avx9000': expected one of"):
        qmm.isa()
