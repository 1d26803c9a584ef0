"""``auto`` and the fused C kernel on no-mask and causal CPU calls: the cost model of
``backends/cpu_fused.py`` (measured regimes: dtype, forward or forward + backward, decode step
or not) decides, ``explain`` says which regime and why, and the calls it now sends to cpu_fused
give the oracle's values and gradients.

The decisions are the model's, checked on shapes on both sides of each measured crossover; no
timing is asserted (``benchmarks/crossover.py`` measures them).
"""

from __future__ import annotations

import functools

import pytest
import torch

import selfattn as sa
from selfattn import masks
from selfattn.backends import cpu_fused
from selfattn.kernels import fused_attention
from selfattn.testing import check_against_reference, make_qkv
from tests.backends.test_cpu_fused import needs_kernel

pytestmark = needs_kernel


def _measured(dtype: torch.dtype) -> bool:
    """Whether this build is the measured one (AVX-512F, and avx512_bf16 without AMX for bf16):
    elsewhere cpu_fused is costed as sdpa's equal and no-mask/causal calls stay on sdpa."""
    from selfattn.kernels import build

    isa = fused_attention.isa().split("+")
    bf16 = "avx512_bf16" in isa and "amx_bf16" not in build.cpu_flags()
    return "avx512f" in isa and (dtype != torch.bfloat16 or bf16)


def _choice(B, Hq, Hkv, Sq, Sk, D, dtype, *, grad=False, mask=None):
    """What auto picks (and why) for a call of these shapes: only shapes, dtypes and
    requires_grad are read, so the tensors are left unfilled."""
    q = torch.empty(B, Hq, Sq, D, dtype=dtype).requires_grad_(grad)
    k, v = (torch.empty(B, Hkv, Sk, D, dtype=dtype).requires_grad_(grad) for _ in "kv")
    return sa.backends.explain(q, k, v, mask=mask, print_table=False)


@pytest.fixture
def torch_threads():
    """Set torch's thread count within a test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


F32, BF16 = torch.float32, torch.bfloat16
CASES = {
    # (B, Hq, Hkv, Sq, Sk, D, dtype, grad): auto's pick, on one thread and on two (measured both)
    "fp32 prefill 4096": ((1, 8, 8, 4096, 4096, 64, F32, False), "cpu_fused"),
    "fp32 prefill GQA 1024": ((1, 32, 8, 1024, 1024, 128, F32, False), "cpu_fused"),
    "fp32 chunk 256 of 4096": ((1, 8, 8, 256, 4096, 64, F32, False), "cpu_fused"),
    "fp32 small 64": ((1, 8, 8, 64, 64, 64, F32, False), "sdpa"),  # the set-up dominates
    "fp32 small 128": ((1, 8, 8, 128, 128, 64, F32, False), "cpu_fused"),  # measured 0.6-0.7x
    "fp32 decode": ((1, 32, 8, 1, 4096, 64, F32, False), "sdpa"),  # sdpa's decode path wins
    "fp32 decode B=8": ((8, 32, 8, 1, 4096, 64, F32, False), "sdpa"),
    "fp32 GQA 4 rows of 4096": ((1, 32, 8, 4, 4096, 64, F32, False), "cpu_fused"),  # no decode
    "fp32 train 1024": ((1, 8, 8, 1024, 1024, 64, F32, True), "cpu_fused"),
    "fp32 train 128": ((1, 8, 8, 128, 128, 64, F32, True), "sdpa"),
    "bf16 prefill 512": ((1, 8, 8, 512, 512, 64, BF16, False), "cpu_fused"),
    "bf16 small 64": ((1, 8, 8, 64, 64, 64, BF16, False), "sdpa"),
    "bf16 decode GQA": ((1, 32, 8, 1, 4096, 128, BF16, False), "cpu_fused"),  # sdpa: 5x slower
    "bf16 decode short": ((1, 8, 8, 1, 256, 64, BF16, False), "sdpa"),
    "bf16 4 rows of 1024": ((1, 8, 8, 4, 1024, 64, BF16, False), "sdpa"),  # sdpa's fast path
    "bf16 train 512": ((1, 8, 8, 512, 512, 64, BF16, True), "cpu_fused"),
    # one row with a backward: chunked (0.30-0.90x sdpa, the fastest; chunked._DECODE_BACKWARD)
    "fp32 decode train GQA": ((1, 32, 8, 1, 4096, 64, F32, True), "chunked"),
    "bf16 decode train": ((1, 8, 8, 1, 4096, 64, BF16, True), "chunked"),
}


@pytest.mark.parametrize("threads", [1, 2], ids=["1 thread", "2 threads"])
@pytest.mark.parametrize("mask", [None, masks.causal()], ids=["no mask", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_auto_follows_the_measured_crossover(case, mask, threads, torch_threads):
    torch_threads(threads)
    (B, Hq, Hkv, Sq, Sk, D, dtype, grad), chosen = CASES[case]
    if not _measured(dtype) and chosen == "cpu_fused":
        # unmeasured build: sdpa's equal, and ties go to sdpa; but where sdpa runs the mask
        # dense (causal with Sq < Sk: its is_causal aligns top-left), cpu_fused skips the empty
        # tiles and wins once its set-up is paid
        pairs = B * Hq * Sq * Sk
        seen = Sq * Sk - Sq * (Sq - 1) // 2  # bottom-right causal: row i sees Sk - Sq + i + 1
        skips = (
            mask is not None
            and Sq < Sk
            and seen / (Sq * Sk) + cpu_fused.UNMEASURED.fixed / pairs < 1
        )
        chosen = "cpu_fused" if skips else "sdpa"
    ex = _choice(B, Hq, Hkv, Sq, Sk, D, dtype, grad=grad, mask=mask)
    assert ex.chosen == chosen, str(ex)


def test_the_regime_follows_autograd():
    """A backward follows only when q, k or v needs grad under grad mode: the same tensors
    under no_grad are costed as a forward (explain names the regime)."""
    args = (1, 8, 8, 1024, 1024, 64, F32)
    if not _measured(F32):
        pytest.skip("this build is not the measured one")
    assert "fp32 forward + backward" in _choice(*args, grad=True).costs["cpu_fused"].why
    with torch.no_grad():
        why = _choice(*args, grad=True).costs["cpu_fused"].why
    assert "fp32 forward (" in why or "fp32 forward:" in why


@needs_kernel
def test_a_learned_bias_is_costed_with_its_gradient():
    """dBias forces the two-pass backward: a bias that needs grad costs LEARNED_BIAS x the
    regime's per pair, so a dense call with one goes to sdpa; a fixed bias, or no grad mode,
    costs the regime alone."""
    if not _measured(F32):
        pytest.skip("this build is not the measured one")
    fit = cpu_fused.FITS[torch.float32, True, False]
    q, k, v = (torch.randn(1, 8, 512, 64, requires_grad=True) for _ in "qkv")
    bias = torch.randn(8, 512, 512, requires_grad=True)
    ex = sa.backends.explain(q, k, v, score_mod=sa.scores.bias(bias))
    got = ex.costs["cpu_fused"]
    assert got.per_pair == pytest.approx(fit.per_pair * cpu_fused.LEARNED_BIAS)
    assert "with the bias gradient" in got.why and ex.chosen == "sdpa", ex.why
    fixed = sa.backends.explain(q, k, v, score_mod=sa.scores.bias(bias.detach()))
    assert fixed.costs["cpu_fused"].per_pair == pytest.approx(fit.per_pair)


def test_explain_says_why():
    """The pick's reason names the regime and its measured constants; the table shows sdpa's
    estimate against it."""
    if not _measured(F32):
        pytest.skip("this build is not the measured one")
    fit = cpu_fused.FITS[torch.float32, False, False]
    ex = _choice(1, 8, 8, 4096, 4096, 64, F32)
    assert ex.chosen == "cpu_fused"
    assert f"fp32 forward: {fit.per_pair:g} x sdpa per pair" in ex.why, ex.why
    pairs = 8 * 4096 * 4096
    assert ex.notes["sdpa"].endswith(f"costs 1 per pair vs {fit.per_pair + fit.fixed / pairs:.3g}")
    ex = _choice(1, 8, 8, 1, 4096, 64, F32)  # decode: sdpa, and cpu_fused's note says why not
    assert ex.chosen == "sdpa" and "fp32 decode-step forward" in ex.notes["cpu_fused"]


@pytest.mark.parametrize(
    "dtype, grad", [(F32, False), (F32, True), (BF16, False)], ids=["fp32", "fp32-grad", "bf16"]
)
def test_unmeasured_builds_and_dtypes_keep_no_mask_calls_on_sdpa(monkeypatch, dtype, grad):
    """The forced generic build (and fp16) were not measured: cpu_fused is sdpa's equal there,
    so a large no-mask call stays on sdpa while a masked one still comes to the kernel."""
    monkeypatch.setenv(fused_attention.ISA_VAR, "generic")
    assert _choice(1, 8, 8, 1024, 1024, 64, dtype, grad=grad).chosen == "sdpa"
    assert _choice(1, 8, 8, 1024, 1024, 64, torch.float16).chosen == "sdpa"
    window = masks.sliding_window(64)
    assert _choice(1, 8, 8, 1024, 1024, 64, dtype, grad=grad, mask=window).chosen == "cpu_fused"


def test_bf16_on_an_amx_cpu_stays_on_sdpa(monkeypatch):
    """On a CPU with AMX tiles sdpa's bf16 GEMMs run on them and ours do not (not measured):
    bf16 no-mask calls stay on sdpa there, fp32 ones still follow the measured fit."""
    if not _measured(BF16):
        pytest.skip("this build is not the measured one")
    from selfattn.kernels import build

    assert _choice(1, 8, 8, 1024, 1024, 64, BF16).chosen == "cpu_fused"
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert _choice(1, 8, 8, 1024, 1024, 64, BF16).chosen == "sdpa"
    assert _choice(1, 8, 8, 1024, 1024, 64, F32).chosen == "cpu_fused"


auto = functools.partial(sa.attention, backend="auto")


@pytest.mark.parametrize(
    "shape, mask",
    [
        ((1, 4, 4, 389, 389, 16), None),  # odd sizes
        ((1, 4, 4, 200, 600, 16), masks.causal()),  # a prefill chunk against a longer cache
        ((1, 6, 2, 200, 333, 40), None),  # GQA 3
        ((1, 6, 2, 200, 333, 40), masks.causal()),
    ],
    ids=["MHA", "MHA-causal-chunk", "GQA", "GQA-causal"],
)
def test_calls_now_routed_to_cpu_fused_match_the_oracle_with_gradients(shape, mask):
    """Calls that auto now sends to the kernel (checked, on the measured build) give the fp64
    oracle's output, lse and gradients within the ratio rule."""
    if not _measured(F32):
        pytest.skip("this build is not the measured one")
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, seed=Sq + Hq)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert sa.backends.explain(q, k, v, mask=mask, print_table=False).chosen == "cpu_fused"
    check_against_reference(auto, q, k, v, mask=mask)


def test_bf16_calls_now_routed_to_cpu_fused_match_the_oracle():
    """A bf16 prefill and a bf16 GQA decode step (both now on the kernel) against the oracle."""
    if not _measured(BF16):
        pytest.skip("this build is not the measured one")
    for (B, Hq, Hkv, Sq, Sk, D), mask in (
        ((1, 4, 4, 301, 301, 64), masks.causal()),
        ((2, 8, 2, 1, 700, 64), None),
    ):
        q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=BF16, seed=Sk)
        with torch.no_grad():
            assert sa.backends.explain(q, k, v, mask=mask, print_table=False).chosen == "cpu_fused"
        check_against_reference(auto, q, k, v, mask=mask, grad=False)
