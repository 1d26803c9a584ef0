"""The C quantised-matmul kernel (``selfattn.kernels.quant_matmul``): each instruction-set path
(forced by ``SELFATTN_QUANT_ISA``), weight kind and group against the float64 value of its own
arithmetic (the activations rounded to int8 per 32-block, :func:`twin`) and against the
unrounded product, by the ratio rule; odd sizes; results independent of the thread count."""

from __future__ import annotations

import pytest
import torch

from selfattn.kernels import quant_matmul as qmm
from selfattn.testing import assert_close_to_reference

pytestmark = pytest.mark.c_kernel(qmm)


@pytest.fixture(params=qmm.supported_isas() or ["generic"])
def isa(request, monkeypatch):
    monkeypatch.setenv("SELFATTN_QUANT_ISA", request.param)
    assert qmm.isa() == request.param
    return request.param


def random_weights(kind: str, N: int, K: int, group: int, g: torch.Generator):
    """``(qs, d, m)``: every code value (s8: -128..127, as 8-bit checkpoints hold; u4: all
    nibbles), fp16 scales of either sign with some subnormal, minimums for ``u4_min``."""
    if kind == "s8":
        qs = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "group", "M", "N", "K"), CASES)
def test_dequantised_rows_are_the_references_bit_for_bit(isa, kind, group, M, N, K, dtype):
    """The kernel's dequantiser (the many-row path's weights) gives :func:`dequantize`'s values
    in fp32 and their bf16 rounding, bit for bit (signed zeros and subnormal scales included),
    for the whole weight and for row ranges that start and end anywhere."""
    g = torch.Generator().manual_seed(hash((isa, kind, group, N, K, str(dtype))) % 2**31)
    qs, d, m = random_weights(kind, N, K, group, g)
    ref = qmm.dequantize(qs, d, m, kind, group).to(dtype)
    w, lib = qmm.Weights(qs, d, m, kind, group), qmm.library()
    for lo, hi in {(0, N), (N // 3, N - N // 4), (N - 1, N)}:
        got = w.dequantize(lo, hi, dtype, lib)
        assert got.dtype == dtype and got.shape == (hi - lo, K)
        assert torch.equal(_bits(got), _bits(ref[lo:hi])), (lo, hi)


def test_dequantised_rows_do_not_depend_on_threads(every_thread, two_threads):
    g = torch.Generator().manual_seed(5)
    qs, d, m = random_weights("u4_min", 1031, 192, 64, g)
    w, lib = qmm.Weights(qs, d, m, "u4_min", 64), qmm.library()
    two = w.dequantize(0, 1031, torch.bfloat16, lib)
    torch.set_num_threads(1)
    assert torch.equal(_bits(two), _bits(w.dequantize(0, 1031, torch.bfloat16, lib)))


@pytest.mark.parametrize(("lo", "hi"), [(-1, 3), (2, 2), (5, 4), (0, 41)])
def test_dequantised_rows_outside_the_weight_are_refused(lo, hi):
    g = torch.Generator().manual_seed(6)
    w = qmm.Weights(*random_weights("s8", 40, 64, 32, g), "s8", 32)
    with pytest.raises(ValueError, match=rf"rows {lo}:{hi} of a weight of 40 rows"):
        w.dequantize(lo, hi, torch.float32, qmm.library())


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


def _step_weights(kind, N, K, g, bias_dtype=None):
    qs, d, m = random_weights(kind, N, K, 32, g)
    bias = None if bias_dtype is None else torch.randn(N, generator=g).to(bias_dtype)
    return (qs, d, m, kind, 32, bias), qmm.Weights(qs, d, m, kind, 32, bias)


STEP_PARTS = ["norm", "pair", "rope", "residual", "norm+pair", "norm+rope", "all"]


def _normed_away_from_ties(M, K, dtype, g, margin=1e-3):
    """``x (M, K)`` and an RMSNorm ``(weight, eps)`` whose normed values (in fp64) are no
    closer than ``margin`` of a code step to a rounding tie of the int8 activation codes: a
    norm whose sum of squares runs in another order moves a value by an ulp, which at a tie
    flips its code (a jump of one step, the format's, not an error of the kernel)."""
    for _ in range(100):
        x = (torch.randn(M, K, generator=g) * 3).to(dtype)
        weight = (torch.rand(K, generator=g) + 0.5).to(dtype)
        xn = torch.rms_norm(x.double(), (K,), None, 1e-5) * weight.double()
        if dtype != torch.float32:  # the kernel (and the op) round the normed values first
            xn = torch.rms_norm(x, (K,), None, 1e-5).double() * weight.double()
            xn = xn.to(dtype).double()
        blocks = xn.view(M, K // qmm.BLOCK, qmm.BLOCK)
        codes = blocks * 127 / blocks.abs().amax(-1, keepdim=True)
        if ((codes - codes.floor() - 0.5).abs() > margin).all():
            return x, (weight, 1e-5)
    raise AssertionError("no draw away from the ties in 100 tries")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(qmm.KINDS))
@pytest.mark.parametrize("parts", STEP_PARTS)
def test_fused_step_matches_its_ops_in_fp64(isa, kind, parts, dtype):
    """A fused step (norm before, SwiGLU pair, RoPE, residual) against the same ops in PyTorch
    with the kernel's products computed in fp64 (ratio rule: the naive error is the ops' own
    in ``dtype``); in bf16 each part rounds as its op does, so most values are equal."""
    g = torch.Generator().manual_seed(hash((isa, kind, parts, str(dtype))) % 2**31)
    M, N, K, D, r = 3, 5 * 24, 160, 24, 16  # 5 heads of 24, 16 rotated: a partial rotation
    spec, w = _step_weights(kind, N, K, g, dtype if parts == "all" else None)
    spec2, w2 = _step_weights(kind, N, K, g)
    x, norm = _normed_away_from_ties(M, K, dtype, g)
    cos2, sin2 = torch.randn(2, r, generator=g), torch.randn(2, r, generator=g)
    res = torch.randn(M, N, generator=g).to(dtype)
    use = set(("norm", "pair", "rope", "residual") if parts == "all" else parts.split("+"))
    kw = {
        "norm": norm if "norm" in use else None,
        "pair": spec2 if "pair" in use else None,
        "rope": (cos2, sin2, 4, D) if "rope" in use else None,
        "residual": res if "residual" in use else None,
    }
    step = qmm.Step(w, norm=kw["norm"], pair=w2 if "pair" in use else None,
                    rope=(4, D, r) if "rope" in use else None)  # fmt: skip
    got = step(x, qmm.library(), qmm.isa_code(qmm.library()), residual=kw["residual"],
               factors=(cos2, sin2) if "rope" in use else None)  # fmt: skip
    assert got.dtype == dtype and got.shape == (M, N)
    exact = qmm.step_twin(x.double(), spec, **kw, dtype=torch.float64)
    naive = qmm.step_twin(x, spec, **kw)
    assert_close_to_reference(got, exact, naive, dtype=dtype)


def test_fused_step_refuses_mismatched_parts():
    g = torch.Generator().manual_seed(5)
    _, w = _step_weights("u4_min", 64, 128, g)
    _, other = _step_weights("u4_min", 32, 128, g)
    with pytest.raises(ValueError, match="paired weights"):
        qmm.Step(w, pair=other)
    with pytest.raises(ValueError, match="norm's weight"):
        qmm.Step(w, norm=(torch.ones(128, dtype=torch.float16), 1e-6))
    step = qmm.Step(w, rope=(3, 32, 16))  # 3 heads of 32 rotated: factors needed per call
    with pytest.raises(ValueError, match="status 2"):
        step(torch.randn(1, 128), qmm.library(), qmm.isa_code(qmm.library()))
