"""The fused CPU attention kernel (csrc/fused_attention.c) against its plain-PyTorch twin.

Here the kernel is fed tile descriptions directly (random EMPTY/FULL/PARTIAL grids, random
PARTIAL blocks varying over batch and heads), so every branch of its tile walk is reached at
small sizes; tests/backends/test_cpu.py checks it through ``attention()`` against the fp64
oracle for the library's masks.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from selfattn.kernels import fused_attention as fa
from selfattn.kernels import ops
from selfattn.testing import GRAD_FACTOR, assert_close_to_reference
from tests._kernel_helpers import c_kernel
from tests.kernels.test_kernels import _c_enum

KERNELS = Path(fa.__file__).resolve().parent

pytestmark = pytest.mark.c_kernel(fa)


def test_kernel_arguments_follow_the_c_enums():
    source = (KERNELS / "csrc" / "fused_attention.c").read_text()
    assert _c_enum(source, "A_B") == list(fa.INT_ARGS)
    assert _c_enum(source, "P_Q") == list(fa.PTR_ARGS)


def _tiles(Sq, Sk, bq, mb=1, mh=1, seed=0, p_empty=0.25, p_full=0.4):
    """A random tile description: each tile EMPTY, FULL or PARTIAL with random blocks."""
    g = torch.Generator().manual_seed(seed)
    n_q, n_k = math.ceil(Sq / bq), math.ceil(Sk / fa.BLOCK_K)
    u = torch.rand(n_q, n_k, generator=g)
    nonempty, full = u >= p_empty, u >= 1 - p_full
    n_partial = int((nonempty & ~full).sum())
    bits = torch.rand(n_partial, mb, mh, bq, fa.BLOCK_K, generator=g) < 0.6
    return fa.Tiles.from_grid(nonempty, full, bq, bits.to(torch.uint8), mb, mh)


def _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, Hq, Sq, D, generator=g).to(dtype),
        torch.randn(B, Hkv, Sk, D, generator=g).to(dtype),
        torch.randn(B, Hkv, Sk, Dv, generator=g).to(dtype),
    )


# (B, Hq, Hkv, Sq, Sk, D, Dv, block_q): ragged tiles on both axes, D and Dv not multiples of the
# vector width, GQA, Sq = 1, Dv != D.
SHAPES = {
    "97x150-G2-D40-Dv24": (2, 4, 2, 97, 150, 40, 24, 49),
    "1x130-MQA-D59": (1, 3, 1, 1, 130, 59, 59, 1),
    "130x65-D8-Dv70": (1, 2, 2, 130, 65, 8, 70, 64),
}


def _force_build(monkeypatch, build: str) -> bool:
    """Run the kernel ``build`` (native, avx2, generic) through SELFATTN_FUSED_ISA; the
    ``generic`` argument of the kernel's functions. Skips where the CPU or compiler lacks it."""
    if build == "avx2":
        if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
            pytest.skip("this CPU has no AVX2")
        monkeypatch.setenv("SELFATTN_FUSED_ISA", "avx2")
        c_kernel(fa)
        assert fa.isa() == "avx2+fma"
    return build == "generic"


@pytest.mark.parametrize("build", ["native", "avx2", "generic"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mask_bh", [(1, 1), (2, 4)], ids=["mask-shared", "mask-per-b-h"])
def test_forward_matches_its_twin(shape, build, mask_bh, monkeypatch):
    generic = _force_build(monkeypatch, build)
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES[shape]
    mb, mh = (min(mask_bh[0], B), mask_bh[1] if mask_bh[1] <= Hq else 1)
    mh = Hq if mh > 1 else 1
    t = _tiles(Sq, Sk, bq, mb, mh, seed=Sq + Sk)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, seed=D)
    scale = D**-0.5
    out, lse, m, l = fa.forward(q, k, v, t, scale, generic=generic)
    o64, lse64 = fa.twin(q, k, v, t, scale)
    o32, lse32 = fa.twin(q, k, v, t, scale, dtype=torch.float32)  # the noise baseline
    assert_close_to_reference(out, o64, o32)
    assert_close_to_reference(lse, lse64, lse32, what="lse")
    empty = lse64 == -math.inf  # rows the tiles leave without a key: out 0, lse -inf, (m, l) (0, 1)
    assert bool((out[empty] == 0).all()) and bool((lse[empty] == -math.inf).all())
    assert bool((m[empty] == 0).all()) and bool((l[empty] == 1).all())


@pytest.mark.parametrize(
    ("dtype", "generic"),
    [(torch.bfloat16, True), (torch.float16, True), (torch.float16, False)],
    ids=["bf16-generic", "fp16-generic", "fp16-native"],
)
def test_low_precision_inputs_are_read_in_place(dtype, generic):
    """bf16/fp16 q, k, v are converted as tiles are packed: the same numbers as float32 inputs
    holding the same values (bf16 on a native build with avx512_bf16 takes vdpbf16ps: below)."""
    if dtype not in fa.supported_dtypes(generic):
        pytest.skip(f"this compiler has no {dtype}")
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES["97x150-G2-D40-Dv24"]
    t = _tiles(Sq, Sk, bq, seed=3)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype=dtype, seed=4)
    out, lse, _, _ = fa.forward(q, k, v, t, 0.2, generic=generic)
    ref, ref_lse, _, _ = fa.forward(q.float(), k.float(), v.float(), t, 0.2, generic=generic)
    # out comes in their dtype, rounded once by the kernel as torch rounds (to nearest even)
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype)) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("mods", [{}, {"softcap": 2.0}], ids=["plain", "softcap"])
@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_scores_match_the_oracle(shape, generic, mods):
    """bf16 q, k, v: on a build with avx512_bf16 the scores are vdpbf16ps sums of exact products
    (odd D pads the last pair with 0), within the ratio rule of float32 arithmetic (the lse);
    the weights are rounded to bf16 for P V, so the output is within the rule of bf16
    arithmetic (the dtype it is returned in). GQA, Sq = 1, ragged tiles, odd Dv. The generic
    build converts to float32."""
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES[shape]
    t = _tiles(Sq, Sk, bq, mb=B, mh=Hq, seed=31)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype=torch.bfloat16, seed=32)
    out, lse, _, _ = fa.forward(q, k, v, t, 0.3, generic=generic, **mods)
    o64, lse64 = fa.twin(q, k, v, t, 0.3, **mods)
    _, lse32 = fa.twin(q, k, v, t, 0.3, dtype=torch.float32, **mods)
    o16, _ = fa.twin(q, k, v, t, 0.3, dtype=torch.bfloat16, **mods)
    assert_close_to_reference(out.bfloat16(), o64, o16)
    assert_close_to_reference(lse, lse64, lse32, what="lse")


@pytest.mark.skipif("avx512_bf16" not in fa.isa(), reason="this CPU has no avx512_bf16")
def test_bf16_native_build_takes_the_dpbf16_path():
    """Sums of exact bf16 products in vdpbf16ps's order, and weights rounded to bf16, differ
    from the float32 path's results: the native build is running the bf16 path."""
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES["97x150-G2-D40-Dv24"]
    t = _tiles(Sq, Sk, bq, seed=33)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype=torch.bfloat16, seed=34)
    out = fa.forward(q, k, v, t, 0.2)[0]
    assert not torch.equal(out, fa.forward(q.float(), k.float(), v.float(), t, 0.2)[0])


@pytest.mark.usefixtures("every_thread")
@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((2, 4, 2, 97, 150, 40, 24, 49), torch.float32),
        # 118 items of 9-row tiles: threads claim runs of several items (Job.grain), the last
        # run cut short; bf16: the transposed tiles' vdpbf16ps path where the build has it
        ((1, 2, 1, 529, 300, 32, 32, 9), torch.bfloat16),
    ],
    ids=["97x150-G2-D40-Dv24", "529x300-bf16-runs"],
)
def test_forward_is_bitwise_deterministic_across_thread_counts(shape, dtype):
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = shape
    t = _tiles(Sq, Sk, bq, seed=5)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype=dtype, seed=6)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 3, 1):
            torch.set_num_threads(n)
            results.append(fa.forward(q, k, v, t, 0.3))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def _backward_case(seed: int):
    """Tiles, (q, k, v), dout and dlse of a GQA case with odd sizes, for the backward tests."""
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES["97x150-G2-D40-Dv24"]
    t = _tiles(Sq, Sk, bq, mb=B, mh=Hq, seed=seed)
    qkv = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    dout, dlse = torch.randn(B, Hq, Sq, Dv, generator=g), torch.randn(B, Hq, Sq, generator=g)
    return t, qkv, dout, dlse


@pytest.mark.usefixtures("every_thread")
@pytest.mark.parametrize("scale", [0.3, 3.0], ids=["spread", "peaked"])
@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
def test_backward_one_pass_is_bitwise_the_two_passes(generic, scale):
    """One thread runs the one-pass backward (dQ, dK, dV per (b, kv head)); three threads with
    B·Hkv = 4 items run the two passes (dQ by query tile, then dK, dV by key tile): the same
    bits, as the kernel promises for any thread count. Scale 3 makes most rows peaked (largest
    weight over 1/2): their Δ comes from the kernel's own P ∘ dP, the query tile's scores and dP
    kept for it (in the one pass, and in the two passes' dQ pass, which then runs first)."""
    t, (q, k, v), dout, dlse = _backward_case(seed=12)
    out, _, m, l = fa.forward(q, k, v, t, scale, generic=generic)
    assert (float((l < 2).float().mean()) > 0.5) == (scale > 1)  # the share of peaked rows
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(fa.backward(dout, dlse, q, k, v, out, m, l, t, scale, generic=generic))
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(("dq", "dk", "dv"), *results):
        assert torch.equal(a, b), (name, float((a - b).abs().max()))


def test_generic_and_native_builds_agree():
    """The forced baseline-ISA build is another compilation of the same source: it agrees with
    the vector build to rounding, and names no vector ISA."""
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES["130x65-D8-Dv70"]
    t = _tiles(Sq, Sk, bq, seed=7)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, seed=8)
    native, generic = fa.forward(q, k, v, t, 0.4), fa.forward(q, k, v, t, 0.4, generic=True)
    for a, b in zip(native, generic):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fa.isa(generic=True) == "generic"
    assert fa.isa() != "none"


@pytest.mark.parametrize("build", ["native", "avx2", "generic"])
def test_backward_matches_the_twins_gradients(build, monkeypatch):
    """dq, dk, dv (GQA: summed over the G heads of a kv head) and the lse's own gradient, against
    autograd through the float64 twin."""
    generic = _force_build(monkeypatch, build)
    t, (q, k, v), dout, dlse = _backward_case(seed=9)
    out, _, m, l = fa.forward(q, k, v, t, 0.25, generic=generic)
    grads = fa.backward(dout, dlse, q, k, v, out, m, l, t, 0.25, generic=generic)

    def twin_grads(dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        o, s = fa.twin(*leaves, t, 0.25)
        s = torch.where(torch.isfinite(s), s, 0)  # rows with no key: lse -inf, no gradient
        return torch.autograd.grad((o * dout).sum() + (s * dlse).sum(), leaves)

    oracle, naive = twin_grads(torch.float64), twin_grads(torch.float32)
    for name, a, o, n in zip(("dq", "dk", "dv"), grads, oracle, naive):
        assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, what=name)


def test_tanh_is_within_a_few_ulp_of_float64():
    """The soft cap's vectorised tanh (polynomial below 1/2, exp2 above) against float64 tanh on a
    sweep of float32 bit patterns in [-20, 20], denormals and the switch included."""
    bits = torch.arange(0, 0x41A00000, 997, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x, -x, torch.tensor([0.5, math.inf, -math.inf])])
    for generic in (False, True):
        y = fa.tanh(x, generic=generic).double()
        exact = torch.tanh(x.double())
        ulp = torch.nextafter(exact.float().abs(), torch.tensor(math.inf)) - exact.float().abs()
        assert ((y - exact).abs() / ulp.double()).max().item() <= 4
    assert torch.isnan(fa.tanh(torch.tensor([math.nan]))).all()


def test_exp2_weights_is_within_a_few_ulp_of_float64():
    """The forward's 2^x for the weights (degree 5 + vscalefps on the bf16 path, the float32
    path's exp2v in the generic build) on a sweep of float32 bit patterns in [-160, 0] (the
    weights' exponents s·c - max are <= 0) and up to 1: within 4 ulp where 2^x is a normal
    float, 1 at 0, 0 far below FLT_MIN (the lse keeps float32 accuracy: the row sums are of these
    weights)."""
    neg = torch.arange(0, 0x43200000, 1009, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([-neg, torch.linspace(0, 1, 1001), torch.tensor([0.0, -0.5, 0.5, -126.0])])
    for generic in (False, True):
        y = fa.exp2_weights(x, generic=generic).double()
        exact = torch.exp2(x.double())
        normal = x >= -126
        ulp = torch.nextafter(exact.float(), torch.tensor(math.inf)) - exact.float()
        err_ulp = ((y - exact).abs() / ulp.double())[normal]
        assert err_ulp.max().item() <= 4, (generic, x[normal][err_ulp.argmax()].item())
        assert bool((y[~normal] <= 2.0**-126).all()) and bool((y[x < -151] == 0).all())
        assert y[x == 0].eq(1).all()


def test_log2_of_row_sums_is_within_two_ulp_of_float64():
    """The forward's vector log2 of the row sums (lse = (m + log2 l) ln 2; l >= 1 where a row
    has a key): on a sweep of float32 bit patterns in [1, 2^31) and the mantissas next to
    sqrt(2), where its range reduction switches, within 2 ulp; NaN stays NaN."""
    lo, hi = 0x3F800000, 0x4F000000  # 1.0, 2^31
    bits = torch.cat(
        [torch.arange(lo, hi, 997), torch.arange(0x3FB504F0 - 4096, 0x3FB504F0 + 4096)]
    )
    x = bits.to(torch.int32).view(torch.float32)
    for generic in (False, True):
        y = fa.log2_sums(x, generic=generic).double()
        exact = torch.log2(x.double())
        ulp = torch.nextafter(exact.float(), torch.tensor(math.inf)) - exact.float()
        err_ulp = ((y - exact).abs() / ulp.double().clamp(min=2.0**-149))[exact > 0]
        assert err_ulp.max().item() <= 2, (generic, x[exact > 0][err_ulp.argmax()].item())
        assert y[x == 1].eq(0).all()
        assert torch.isnan(fa.log2_sums(torch.tensor([math.nan]), generic=generic)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scale", [-0.3, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("shape", ["97x150-G2-D40-Dv24", "1x130-MQA-D59"])
def test_negative_or_zero_scale(shape, scale, dtype):
    """The transposed forward takes bf16's row max on unscaled scores: a negative scale negates q
    as it is packed (even and odd D); float32 q is packed times the scale; a zero scale gives
    every attended key weight 1."""
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES[shape]
    t = _tiles(Sq, Sk, bq, seed=41)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype=dtype, seed=42)
    out, lse, _, _ = fa.forward(q, k, v, t, scale)
    o64, lse64 = fa.twin(q, k, v, t, scale)
    _, lse32 = fa.twin(q, k, v, t, scale, dtype=torch.float32)
    naive, _ = fa.twin(q, k, v, t, scale, dtype=dtype)
    assert_close_to_reference(out.to(dtype), o64, naive)
    assert_close_to_reference(lse, lse64, lse32, what="lse")


# bias (B|1, Hq|1, Sq|1, Sk|1) and softcap cases of the score mods
MODS = {
    "softcap": lambda B, Hq, Sq, Sk, g: (None, 2.5),
    "bias-per-b-h": lambda B, Hq, Sq, Sk, g: (torch.randn(B, Hq, Sq, Sk, generator=g), 0.0),
    "bias-row-broadcast": lambda B, Hq, Sq, Sk, g: (torch.randn(1, Hq, 1, Sk, generator=g), 0.0),
    "bias-then-softcap": lambda B, Hq, Sq, Sk, g: (torch.randn(B, 1, Sq, 1, generator=g) * 3, 1.5),
}


@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
@pytest.mark.parametrize("mod", list(MODS))
def test_score_mods_forward_and_backward_match_the_twin(mod, generic):
    """Bias and soft cap in the kernel, forward and the backward's chain through the cap
    (1 - tanh²), against autograd through the float64 twin; GQA, ragged tiles, Dv != D."""
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES["97x150-G2-D40-Dv24"]
    t = _tiles(Sq, Sk, bq, mb=B, mh=Hq, seed=21)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, seed=22)
    g = torch.Generator().manual_seed(23)
    bias, cap = MODS[mod](B, Hq, Sq, Sk, g)
    scale, kw = 0.5, {"bias": bias, "softcap": cap}  # large scores: the cap bends them
    out, lse, m, l = fa.forward(q, k, v, t, scale, generic=generic, **kw)
    dout, dlse = torch.randn(B, Hq, Sq, Dv, generator=g), torch.randn(B, Hq, Sq, generator=g)
    grads = fa.backward(dout, dlse, q, k, v, out, m, l, t, scale, generic=generic, **kw)

    def twin(dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        o, s = fa.twin(*leaves, t, scale, dtype=dtype, **kw)
        finite = torch.where(torch.isfinite(s), s, 0)
        return (o, s), torch.autograd.grad((o * dout).sum() + (finite * dlse).sum(), leaves)

    (o64, lse64), g64 = twin(torch.float64)
    (o32, lse32), g32 = twin(torch.float32)
    assert_close_to_reference(out, o64, o32)
    assert_close_to_reference(lse, lse64, lse32, what="lse")
    for name, a, o, n in zip(("dq", "dk", "dv"), grads, g64, g32):
        assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, what=name)


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "learned-bias"])
def test_ops_pass_opcheck(bias):
    """Schema, fake, autograd registration and AOT dispatch of selfattn::attention_fwd_cpu; with
    a bias that requires grad, its gradient comes back through the backward op's fourth output."""
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = 1, 2, 1, 9, 70, 8, 16, 9
    t = _tiles(Sq, Sk, bq, p_empty=0.0, seed=12)
    q, k, v = (x.requires_grad_() for x in _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, seed=13))
    args = (q, k, v, *t.tensors(), t.block_q, t.mask_b, t.mask_h, 0.3, False)
    if bias:
        b = torch.randn(1, Hq, Sq, Sk, generator=torch.Generator().manual_seed(14))
        args += (0, None, 0.0, 0, b.requires_grad_(), 0.0)
    torch.library.opcheck(ops.attention_fwd_cpu, args)


def test_bad_tensors_are_refused_with_their_shapes():
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = 1, 2, 1, 9, 70, 8, 16, 9
    t = _tiles(Sq, Sk, bq, seed=14)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, seed=15)
    with pytest.raises(ValueError, match=r"torch.float64 \(1, 1, 70, 8\)"):
        fa.forward(q, k.double(), v, t, 0.3)
    with pytest.raises(ValueError, match="contiguous=False"):
        fa.forward(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, t, 0.3)
    with pytest.raises(ValueError, match=r"bias must broadcast .* got \(1, 2, 9, 3\)"):
        fa.forward(q, k, v, t, 0.3, bias=torch.zeros(1, 2, 9, 3))
    with pytest.raises(ValueError, match="softcap must be a finite number"):
        fa.forward(q, k, v, t, 0.3, softcap=math.inf)
    with pytest.raises(ValueError, match=r"\(Hq,\) = \(2,\) or \(B, Hq\) = \(1, 2\), got \(2, 2\)"):
        fa.forward(q, k, v, t, 0.3, alibi=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"finite must be a CPU bool tensor .* torch.int32 \(2,\)"):
        fa.forward(q, k, v, t, 0.3, finite=torch.ones(2, dtype=torch.int32))


# Every path of the forward that reports finiteness: fwd_t (AVX-512 builds: float32 and even-D
# bf16 tested in registers, odd-D bf16 and fp16 by rows), fwd_item with a score mod or dropout,
# and the generic and AVX2 builds (fwd_item only).
FINITE_PATHS = {
    "fwd_t": ("native", {}),
    "fwd_item-alibi": ("native", {"alibi": torch.tensor([0.5, 0.25])}),
    "fwd_item-dropout": ("native", {"dropout_p": 0.8, "seed0": 7}),
    "generic": ("generic", {}),
    "avx2": ("avx2", {}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", list(FINITE_PATHS))
def test_forward_reports_whether_q_and_out_are_finite(path, dtype, monkeypatch):
    """``finite`` is exactly "every element of q and of out (in q's dtype) is finite", what
    ``fused_or_exact`` needs to trust a result: NaN or Inf in q (also in a row with no key,
    whose out stays 0), a NaN V at an attended key, an out that overflows from finite inputs
    (float32 sums; fp16 rounding of dropout's 1/(1-p)); True otherwise. D and Dv 40 (full
    vectors and a tail) and 59 (odd: bf16 pairs by rows), ragged tiles, a tile row with no key."""
    generic = _force_build(monkeypatch, FINITE_PATHS[path][0])
    kw = FINITE_PATHS[path][1]
    if dtype not in fa.supported_dtypes(generic):
        pytest.skip(f"this compiler has no {dtype}")
    B, Hq, Hkv, Sq, Sk, bq = 1, 2, 1, 97, 150, 32
    g = torch.Generator().manual_seed(17)
    n_q, n_k = math.ceil(Sq / bq), math.ceil(Sk / fa.BLOCK_K)
    nonempty = torch.ones(n_q, n_k, dtype=torch.bool)
    nonempty[0] = False  # rows 0-31 attend no key: out 0 whatever q holds
    full = torch.rand(n_q, n_k, generator=g) < 0.5
    full[2, 1] = True  # rows 64-95 attend keys 64-127
    n_partial = int((nonempty & ~full).sum())
    bits = (torch.rand(n_partial, 1, 1, bq, fa.BLOCK_K, generator=g) < 0.6).to(torch.uint8)
    t = fa.Tiles.from_grid(nonempty, full, bq, bits, 1, 1)
    big = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}[dtype]
    finite = torch.empty((), dtype=torch.bool)
    for D in (40, 59):
        cases = {  # name -> (q, v, what the flag must say)
            "finite": (None, None, True),
            "q NaN": ((0, 1, 50, 3), None, False),
            "q Inf, last element": ((0, 0, 70, D - 1), None, False),
            "q NaN in a row with no key": ((0, 1, 5, 0), None, False),
            "V NaN at an attended key": (None, (0, 0, 69, 2), False),
        }
        for i, (name, (q_at, v_at, want)) in enumerate(cases.items()):
            q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, D, dtype=dtype, seed=D + i)
            if q_at is not None:
                q[q_at] = math.inf if "Inf" in name else math.nan
            if v_at is not None:
                v[v_at] = math.nan
            out = fa.forward(q, k, v, t, D**-0.5, generic=generic, finite=finite, **kw)[0]
            truth = bool(q.isfinite().all() and out.isfinite().all())
            assert bool(finite) == truth == want, (D, name)
        # equal scores (q = 0) and huge V: every attended row's sum of weights x V overflows
        # float32 (Inf); fp16's 6e4 does not, but dropout's 1/(1-p) = 5 takes a row whose kept
        # share is over 0.22 past fp16's largest when stored
        q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, D, dtype=dtype, seed=D)
        q.zero_(), v.fill_(big)
        out = fa.forward(q, k, v, t, D**-0.5, generic=generic, finite=finite, **kw)[0]
        want = dtype != torch.float16 or "dropout_p" in kw
        assert bool(finite) == bool(out.isfinite().all()) == (not want), (D, "out overflows")


@pytest.mark.parametrize(
    "mod", ["alibi", "bias-with-inf", "softcap", "alibi-bias-softcap"]
)  # fmt: skip
@pytest.mark.parametrize("shape", ["97x150-G2-D40-Dv24", "1x130-MQA-D59"])
def test_bf16_score_mods_on_the_transposed_forward(mod, shape):
    """bf16 calls with score mods take the transposed forward (apply_mods_t on Sᵀ; the bf16
    scores are scaled before the mods): against the float64 twin by the ratio rule of bf16
    arithmetic, the lse by float32's. A -inf bias entry is a key not attended and a row of them
    an empty row (out 0, lse -inf), straight from the kernel: -inf scores must not reach the
    exp2 polynomial (NaN) and leave the row to the host's exact redo."""
    B, Hq, Hkv, Sq, Sk, D, Dv, bq = SHAPES[shape]
    t = _tiles(Sq, Sk, bq, mb=B, mh=Hq, seed=51)
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype=torch.bfloat16, seed=52)
    g = torch.Generator().manual_seed(53)
    kw: dict = {"softcap": 3.0 if "softcap" in mod else 0.0}
    bias = torch.zeros(B, Hq, Sq, Sk)  # the twin's: ALiBi as the bias it adds, plus the bias
    if "alibi" in mod:
        kw["alibi"], kw["q_offset"] = torch.rand(Hq, generator=g) * 0.5, Sk - Sq
        dist = (Sk - Sq + torch.arange(Sq).view(Sq, 1) - torch.arange(Sk)).abs()
        bias += -kw["alibi"].view(Hq, 1, 1) * dist
    if "bias" in mod:
        kw["bias"] = torch.randn(B, Hq, Sq, Sk, generator=g)
        if mod == "bias-with-inf":
            kw["bias"][torch.rand(B, Hq, Sq, Sk, generator=g) < 0.3] = -math.inf
            kw["bias"][0, :, Sq // 2] = -math.inf  # a row without a key
        bias = bias + kw["bias"]
    out, lse, _, _ = fa.forward(q, k, v, t, 0.3, **kw)
    tw = {"bias": bias, "softcap": kw["softcap"]}
    o64, lse64 = fa.twin(q, k, v, t, 0.3, **tw)
    _, lse32 = fa.twin(q, k, v, t, 0.3, dtype=torch.float32, **tw)
    o16, _ = fa.twin(q, k, v, t, 0.3, dtype=torch.bfloat16, **tw)
    assert bool(torch.isfinite(out).all()), "the kernel's own output holds NaN/Inf"
    empty = lse64 == -math.inf
    assert bool((out[empty] == 0).all()) and bool((lse[empty] == -math.inf).all())
    assert_close_to_reference(out.bfloat16()[~empty], o64[~empty], o16[~empty])
    assert_close_to_reference(lse[~empty], lse64[~empty], lse32[~empty], what="lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_bias_is_scaled_to_base_2_in_float32(dtype):
    """The kernel takes the bias times log2(e) in float32: the product of a half-precision bias
    must be taken wide. In half precision it rounded each base-2 bias to the half's precision (a
    one-key row's lse off by ~2^-13 of the bias, fuzz seed 11) and overflowed past 65504 /
    log2(e), after which a finite bias was held at float32's max."""
    g = torch.Generator().manual_seed(61)
    x = (torch.randn(4, 64, generator=g) * 3).to(dtype)
    x[0, 0] = -60000.0 if dtype == torch.float16 else -1e30
    got = fa.base2(x, torch.float32)
    want = (x.double() * fa.LOG2E).float()  # the float64 product, rounded once
    torch.testing.assert_close(got, want, rtol=2**-23, atol=0)
    assert bool(got.isfinite().all())
