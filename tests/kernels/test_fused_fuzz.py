"""Adversarial grid for the fused CPU kernel (``cpu_fused``), as an outside reviewer would run it:
random combinations of what each other test varies one at a time, through ``attention()``,
against the float64 oracle by the ratio rule (out, lse, dq/dk/dv).

Each case draws, from a seeded generator: the shape (FlashAttention's test grid of seqlen pairs
such as (113, 203), (1, 239), (3, 79), both ways round, and Sq = 1, Sk = 1, ragged 64-key and
query tiles), head dims 8..256 (40, 59, 96, 111: not multiples of the vector width) with Dv != D,
GQA/MQA ratios, B with batch-1 K/V broadcast, fp32/bf16/fp16, non-contiguous or expanded views,
every mask kind of ``sa.masks`` and their ``& | ~`` (documents, prefix-LM, windows, block-sparse,
bool tensors per batch/head, FlexAttention BlockMasks, user callables), the kernel's score mods
(soft cap, ALiBi, bias tensors of every broadcast shape, their chain), sinks, q_offset (top-left,
bottom-right, shifted), scales incl. negative ones, and the kernel build (native, and the forced
``SELFATTN_FUSED_ISA=avx2|generic``). The case is in the test id.

``SELFATTN_FUZZ_SEED`` / ``SELFATTN_FUZZ_CASES`` widen the hunt (default: a fixed seed and
``CASES`` cases, ~10 s). Gradients are checked for every case up to ``MAX_GRAD_PAIRS``; the
scales drawn keep scores about unit-wide. Rows of nearly one-hot weights have their own test
(the backward's ``Δ`` there comes from its own ``P ∘ dP``, not ``rowsum(dO ∘ O)``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random

import pytest
import torch

import selfattn
from selfattn import backends, masks, scores
from selfattn.kernels import fused_attention
from selfattn.testing import (
    GRAD_FACTOR,
    assert_close_to_reference,
    check_against_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)
from tests._kernel_helpers import c_kernel
from tests.backends.test_cpu_fused import check_dropout_call, cpu_attention, needs_kernel
from tests.compat.test_compat_flash_attn import _ratio_check, attention_ref

pytestmark = needs_kernel

SEED = int(os.environ.get("SELFATTN_FUZZ_SEED", "16"))
CASES = int(os.environ.get("SELFATTN_FUZZ_CASES", "32"))
# FlashAttention's test_flash_attn.py seqlen pairs (those small enough for an fp64 oracle with
# gradients in a fraction of a second), and the tile edges: Sq = 1, Sk = 1, 64 +- 1.
SEQLENS = [(113, 203), (128, 217), (108, 256), (1, 239), (3, 79), (127, 130), (1, 1), (7, 1),
           (65, 64), (97, 33), (200, 70), (17, 17), (1, 64), (2, 129)]  # fmt: skip
HEAD_DIMS = [8, 32, 40, 59, 64, 96, 111, 128, 256]
MASK_KINDS = ["none", "causal", "window", "chunked", "chunked_bidir", "padding", "documents",
              "prefix_lm", "block_sparse", "tensor", "block_mask", "callable", "and", "or",
              "not"]  # fmt: skip
# the masks "and", "or" and "not" combine
LEAVES = ["causal", "window", "chunked", "chunked_bidir", "padding", "documents", "prefix_lm",
          "block_sparse", "callable"]  # fmt: skip
MOD_KINDS = ["none", "softcap", "alibi", "bias", "alibi>>bias>>softcap"]
BIAS_SHAPES = ["BHQK", "H1K", "QK", "1K", "B11K", "Q1"]
# Masks that index tensors by absolute position: q_offset must be >= 0 (no negative positions).
ABSOLUTE = {"documents", "block_sparse", "block_mask", "and", "or", "not"}
# Pairs past which the oracles' backward costs more than the case's budget (fp16's naive baseline
# runs fp16 matmuls, slow on CPUs: a quarter of it).
MAX_GRAD_PAIRS = 150_000


def _builds() -> list[str]:
    """The kernel builds this CPU runs: native, and the forced avx2 (on an AVX2 CPU) and generic."""
    found = ["native", "generic"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        found.append("avx2")
    return found


@dataclasses.dataclass(frozen=True)
class Case:
    """One random call, drawn without tensors (so that it can name its test)."""

    seed: int
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    Dv: int
    dtype: str
    layout: str  # contiguous, strided (slices of a fused projection), expanded (stride-0 heads)
    kv_batch1: bool
    q_offset: int | None
    mask: str
    mod: str
    bias_shape: str
    sinks: bool
    scale: float | None
    build: str

    def __str__(self):
        kv = "kv1" if self.kv_batch1 else ""
        return (
            f"B{self.B}-H{self.Hq}/{self.Hkv}-{self.Sq}x{self.Sk}-D{self.D}/{self.Dv}-{self.dtype}"
            f"-{self.layout}{kv}-off{self.q_offset}-{self.mask}-{self.mod}"
            f"{'-' + self.bias_shape if 'bias' in self.mod else ''}"
            f"{'-sinks' if self.sinks else ''}-scale{self.scale}-{self.build}"
        )

    @property
    def offset(self) -> int:
        return self.Sk - self.Sq if self.q_offset is None else self.q_offset


def draw(i: int, seed: int = SEED) -> Case:
    r = random.Random(seed * 1_000_003 + i)
    Sq, Sk = r.choice(SEQLENS)
    if r.random() < 0.5:
        Sq, Sk = Sk, Sq
    Hkv = r.choice([1, 2, 3])
    Hq = Hkv * r.choice([1, 2, 4, 5])
    D = r.choice(HEAD_DIMS)
    Dv = D if r.random() < 0.5 else r.choice(HEAD_DIMS)
    mask = r.choice(MASK_KINDS)
    q_offset = r.choice([None, None, 0, 5])
    if mask in ABSOLUTE and (Sk - Sq if q_offset is None else q_offset) < 0:
        q_offset = 0
    return Case(
        seed=seed * 1_000_003 + i, B=r.choice([1, 2, 3]), Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D,
        Dv=Dv, dtype=r.choice(["fp32", "fp32", "bf16", "fp16"]),
        layout=r.choice(["contiguous", "contiguous", "strided", "expanded"]),
        kv_batch1=r.random() < 0.2, q_offset=q_offset, mask=mask, mod=r.choice(MOD_KINDS),
        bias_shape=r.choice(BIAS_SHAPES), sinks=r.random() < 0.15,
        scale=r.choice([None, None, None, 0.05, -0.1]), build=r.choice(_builds()),
    )  # fmt: skip


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _mask(case: Case, g: torch.Generator, kind: str | None = None):
    B, Hq, Sq, Sk = case.B, case.Hq, case.Sq, case.Sk
    n = max(Sk, case.offset + Sq)  # absolute positions the call covers
    kind = case.mask if kind is None else kind
    pick = functools.partial(_pick, g)
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.sliding_window(pick([1, 2, 7, 64, 65, 300]))
    if kind == "chunked":
        return masks.chunked(pick([1, 5, 64, 100]))
    if kind == "chunked_bidir":
        return masks.chunked(pick([3, 64, 77]), causal=False)
    if kind == "padding":
        return masks.padding(torch.randint(0, Sk + 1, (B,), generator=g))
    if kind == "documents":  # sorted ids: packed documents, some of one token
        ids = torch.randint(0, pick([1, 3, 9]), (B, n), generator=g).sort(-1).values
        return masks.documents(ids)
    if kind == "prefix_lm":
        return masks.prefix_lm(torch.randint(0, 70, (B,), generator=g))
    if kind == "block_sparse":
        bs = pick([5, 16, 64])
        return masks.block_sparse(torch.rand(Hq, n // bs + 1, n // bs + 1, generator=g) > 0.5, bs)
    if kind == "tensor":  # True = attend; a sparse one leaves rows without a key
        shape = [(B, 1, Sq, Sk), (Sq, Sk), (1, Hq, Sq, Sk), (B, Hq, Sq, Sk)][pick([0, 1, 2, 3])]
        return torch.rand(*shape, generator=g) > pick([0.3, 0.9, 0.99])
    if kind == "block_mask":  # FlexAttention's BlockMask (its full blocks skip the mask_mod)
        inner = masks.causal() & masks.sliding_window(pick([9, 70]))
        return inner.to_block_mask(B, Hq, Sq, Sk, q_offset=case.offset)
    if kind == "callable":
        return lambda b, h, q_idx, kv_idx: ((q_idx - kv_idx) % 3 == 0) | (h == 1)
    a = masks.as_mask(_mask(case, g, pick(LEAVES)))
    if kind == "not":
        return ~a
    b = masks.as_mask(_mask(case, g, pick(LEAVES)))
    return a & b if kind == "and" else a | b


def _pick(g: torch.Generator, options: list):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _score_mod(case: Case, g: torch.Generator, dtype: torch.dtype, bias_leaf=None):
    """The case's score mod; ``bias_leaf(tensor)``: the tensor its bias term adds instead of the
    drawn one (a copy that requires grad, in another dtype)."""
    B, Hq, Sq, Sk = case.B, case.Hq, case.Sq, case.Sk
    shape = {"BHQK": (B, Hq, Sq, Sk), "H1K": (Hq, 1, Sk), "QK": (Sq, Sk), "1K": (1, Sk),
             "B11K": (B, 1, 1, Sk), "Q1": (Sq, 1)}[case.bias_shape]  # fmt: skip
    tensor = (torch.randn(*shape, generator=g) * 2).to(dtype)
    bias = scores.bias(tensor if bias_leaf is None else bias_leaf(tensor))
    return {
        "none": None,
        "softcap": scores.softcap(_pick(g, [0.5, 2.0, 30.0])),
        "alibi": scores.alibi(Hq),
        "bias": bias,
        "alibi>>bias>>softcap": scores.alibi(Hq) >> bias >> scores.softcap(3.0),
    }[case.mod]


def _inputs(case: Case, grad: bool, bias_leaf=None):
    dtype = DTYPES[case.dtype]
    q, k, v = make_qkv(
        case.B, case.Hq, case.Sq, case.D, Hkv=case.Hkv, Sk=case.Sk, Dv=case.Dv, dtype=dtype,
        seed=case.seed % 2**31, contiguous=case.layout != "strided",
    )  # fmt: skip
    if case.layout == "expanded":  # one kv head's K/V seen by every kv head: stride 0
        k, v = (t[:, :1].expand(-1, case.Hkv, -1, -1) for t in (k, v))
    if case.kv_batch1:
        k, v = k[:1], v[:1]
    g = torch.Generator().manual_seed(case.seed % 2**31 + 1)
    kwargs = dict(
        mask=_mask(case, g), score_mod=_score_mod(case, g, dtype, bias_leaf),
        q_offset=case.q_offset, scale=case.scale,
    )  # fmt: skip
    if case.sinks:
        kwargs["sinks"] = torch.randn(case.Hq, generator=g)
    return (q, k, v), kwargs


def _use_build(monkeypatch, build: str) -> None:
    if build != "native":
        monkeypatch.setenv(fused_attention.ISA_VAR, build)
    c_kernel(fused_attention)


@pytest.mark.parametrize("case", [draw(i) for i in range(CASES)], ids=str)
def test_random_calls_match_the_fp64_oracle(case: Case, monkeypatch):
    _use_build(monkeypatch, case.build)
    pairs = case.B * case.Hq * case.Sq * case.Sk
    grad = pairs <= MAX_GRAD_PAIRS // (4 if case.dtype == "fp16" else 1)
    (q, k, v), kwargs = _inputs(case, grad)
    why = backends.explain(q, k, v, print_table=False, **kwargs).reasons["cpu_fused"]
    assert why is None, f"{case}: cpu_fused declined: {why}"
    check_against_reference(cpu_attention, q, k, v, grad=grad, **kwargs)


def _bias_cases(n: int) -> list[Case]:
    """``n`` drawn cases (past the first ``CASES``) whose score mod adds a bias, small enough for
    gradients."""
    found, i = [], CASES
    while len(found) < n:
        case = draw(i)
        pairs = case.B * case.Hq * case.Sq * case.Sk
        if "bias" in case.mod and pairs <= MAX_GRAD_PAIRS // (4 if case.dtype == "fp16" else 1):
            found.append(case)
        i += 1
    return found


@pytest.mark.parametrize("case", _bias_cases(max(1, CASES // 3)), ids=str)
def test_random_bias_gradients_match_the_fp64_oracle(case: Case, monkeypatch):
    """A bias that requires grad, in the random calls of every mask kind, broadcast shape, build,
    q_offset, with sinks, ALiBi and the soft cap: cpu_fused runs it (it declined before) and its
    dBias is within the ratio rule of the float64 oracle's (the bias in float64 there)."""
    _use_build(monkeypatch, case.build)
    grads = []
    for attend, dtype in ((cpu_attention, None), (reference_attention, torch.float64),
                          (naive_attention, None)):  # fmt: skip
        leaf = []

        def bias_leaf(t, dtype=dtype, leaf=leaf):
            leaf.append(t.to(dtype or t.dtype).requires_grad_(True))
            return leaf[0]

        (q, k, v), kwargs = _inputs(case, True, bias_leaf)
        if attend is cpu_attention:
            why = backends.explain(q, k, v, print_table=False, **kwargs).reasons["cpu_fused"]
            assert why is None, f"{case}: cpu_fused declined: {why}"
        out = attend(q, k, v, **kwargs)
        out = out if attend is cpu_attention else out[0]
        g = torch.Generator().manual_seed(case.seed % 2**31 + 3)
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
        grads.append(torch.autograd.grad(out, leaf, dout)[0])
    assert grads[0].shape == grads[1].shape
    assert_close_to_reference(*grads, factor=GRAD_FACTOR, dtype=DTYPES[case.dtype], what="dbias")


# A fuzz finding (seed 32): a bias per query row (broadcast over keys) whose gradient sums each
# row's dS, which cancels exactly: Δ = rowsum(dO ∘ O) left its rounding there, 6.7x the naive fp32
# error (1.5x the bound) on every build; a call with dBias now takes Δ from its own P and dP.
_PER_ROW_BIAS = Case(
    seed=32001503, B=2, Hq=6, Hkv=3, Sq=3, Sk=79, D=128, Dv=256, dtype="fp32", layout="contiguous",
    kv_batch1=False, q_offset=5, mask="window", mod="alibi>>bias>>softcap", bias_shape="Q1",
    sinks=False, scale=0.05, build="native",
)  # fmt: skip


@pytest.mark.parametrize("build", _builds())
@pytest.mark.parametrize("mod", ["alibi>>bias>>softcap", "bias"])
def test_bias_per_query_row_gradient_within_the_ratio_rule(build, mod, monkeypatch):
    """dBias of a (Sq, 1) bias: each row's sum of dS (exactly 0 without the soft cap)."""
    case = dataclasses.replace(_PER_ROW_BIAS, build=build, mod=mod)
    test_random_bias_gradients_match_the_fp64_oracle(case, monkeypatch)


def _one_hot_row(dtype):
    """One decode row attending 47 keys (a bidirectional chunk of 64 at position 238) with
    scores ~10 wide (scale 1, D = 111): nearly one-hot weights; dq was 87x the naive error."""
    q, k, v = make_qkv(1, 1, 1, 111, Sk=239, seed=213, contiguous=False, dtype=dtype)
    return (q, k, v), dict(mask=masks.chunked(64, causal=False), scale=1.0)


def _one_key_rows_with_dropout(dtype):
    """Every row attends one key (Sk = 1) under dropout: exact dq is 0 (dP - Δ cancels), the
    kernel's was ~2e-6 (Δ from the dropped, rescaled output rounds differently from dP)."""
    q, k, v = make_qkv(2, 2, 30, 59, Sk=1, seed=214, dtype=dtype)
    return (q, k, v), dict(dropout_p=0.25, generator=torch.Generator().manual_seed(215))


def _peaked_rows_gqa_window_dropout(dtype):
    """GQA 4/2, ragged query and key tiles, a sliding window, dropout, scale 1 on D = 59: most
    rows put over half their weight on one key, some rows spread it (both kinds in one tile)."""
    q, k, v = make_qkv(2, 4, 97, 59, Hkv=2, Sk=150, seed=216, dtype=dtype)
    kw = dict(mask=masks.sliding_window(40), scale=1.0, dropout_p=0.1)
    return (q, k, v), dict(kw, generator=torch.Generator().manual_seed(217))


def _gradients(q, k, v, kwargs: dict, gen_seed: int | None, dout_seed: int, naive_dtype=None):
    """``(dq, dk, dv)`` of the kernel, the float64 oracle and the naive formula, for one random
    ``dout`` (the same dropout generator seed for each). ``naive_dtype``: the naive formula's
    arithmetic (default the inputs' dtype) on the same inputs and ``dout``."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

    def run(attend, dtype=None):
        more = {} if gen_seed is None else {"generator": torch.Generator().manual_seed(gen_seed)}
        return attend(*(t if dtype is None else t.to(dtype) for t in (q, k, v)), **kwargs, **more)

    out = run(cpu_attention)
    o64, _, leaves64 = run(reference_attention)
    on, _, leavesn = run(naive_attention, naive_dtype)
    g = torch.Generator().manual_seed(dout_seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(q.dtype)
    return (
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(o64, leaves64, dout.double()),
        torch.autograd.grad(on, leavesn, dout.to(on.dtype)),
    )


def assert_peaked_gradients(grads, dtype: torch.dtype, of: str = "") -> None:
    """The peaked-row check of bf16/fp16 gradients (``grads`` from :func:`_gradients` with
    ``naive_dtype=torch.float32``): their naive error in the input dtype and the floor at
    magnitude 1 reach these small gradients' own size, so the rule would pass an all-zero
    answer; the kernel accumulates in fp32, so the baseline is the naive formula in fp32 on the
    same inputs and the floor is taken at each gradient's own magnitude (a wrong answer, zeros
    or the value scaled by 0.9, then fails: tests/test_testing.py)."""
    for name, a, o, n in zip(("dq", "dk", "dv"), *grads):
        assert_close_to_reference(
            a, o, n, factor=GRAD_FACTOR, dtype=dtype, what=name + of, relative_floor=True
        )


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(
    "make",
    [_one_hot_row, _one_key_rows_with_dropout, _peaked_rows_gqa_window_dropout],
    ids=lambda f: f.__name__,
)
def test_peaked_rows_backward_within_the_ratio_rule(make, dtype):
    """Rows whose weight sits mostly on one key: Δ = rowsum(dO ∘ O) (FlashAttention-2's, and
    sdpa's CPU flash kernel's) was far less precise there than the naive rowsum(P ∘ dP) (O
    rounded to bf16/fp16, the forward's weights a few ulps off the backward's); the kernel takes
    Δ from its own P and dP on such rows."""
    (q, k, v), kwargs = make(dtype)
    gen = kwargs.pop("generator", None)
    seed = 0 if gen is None else gen.initial_seed()
    if dtype == torch.float32:
        grads = _gradients(q, k, v, kwargs, None if gen is None else seed, seed + 1)
        for name, a, o, n in zip(("dq", "dk", "dv"), *grads):
            assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, dtype=dtype, what=name)
        return
    gen_seed = None if gen is None else seed
    assert_peaked_gradients(_gradients(q, k, v, kwargs, gen_seed, seed + 1, torch.float32), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_peaked_decode_rows_each_within_the_ratio_rule(dtype):
    """32 sequences of one decode row each (GQA 4/2, D = 111, a bidirectional chunk of 64 keys,
    scale 2, dropout), each sequence checked on its own: the rule over a whole batch lets one
    bad row hide under another row's naive error. Δ from O rounded to bf16/fp16 was up to 4.2x
    (bf16) and 1.6x (fp16) a sequence's bound; from the kernel's own P and dP it is ~0.04x.
    Not fp32: against one row's naive error (a single draw, often a lucky one) these rows still
    reach 3-7x (17x with one FMA chain over D per score); over the batch they are within the
    rule (test_sharp_fp32_decode_rows_within_the_ratio_rule_over_the_batch)."""
    B = 32
    q, k, v = make_qkv(B, 4, 1, 111, Hkv=2, Sk=239, seed=218, dtype=dtype, contiguous=False)
    kwargs = dict(mask=masks.chunked(64, causal=False), scale=2.0, dropout_p=0.2)
    grads = _gradients(q, k, v, kwargs, 219, 220, torch.float32)
    for b in range(B):
        assert_peaked_gradients([[g[b] for g in gs] for gs in grads], dtype, f" of sequence {b}")


# The sharp fp32 rows' gradient ratio (the test below says why it is not GRAD_FACTOR).
SHARP_FACTOR = 5.0


def test_sharp_fp32_decode_rows_within_the_ratio_rule_over_the_batch():
    """16 decode rows as above in fp32 with D = 256, checked over the batch: each score one FMA
    chain over D made these sharp rows' weights ~2.5x less precise than the naive formula's (dq
    4.0x, dK 3.6x its error); the scores and dP now sum D in blocks of 64 (MM_KC in
    csrc/fused_attention.c): 1.5x, 1.8x. The naive baseline is torch's fp32 product, whose
    error depends on the host's BLAS: where it sums in finer blocks it comes out several times
    closer, and the native builds' dq measures up to 4.4x it, so this case allows 5x
    (:data:`SHARP_FACTOR`); a wrong gradient misses by orders of magnitude."""
    q, k, v = make_qkv(16, 4, 1, 256, Hkv=2, Sk=239, seed=218, contiguous=False)
    kwargs = dict(mask=masks.chunked(64, causal=False), scale=2.0, dropout_p=0.2)
    for name, a, o, n in zip(("dq", "dk", "dv"), *_gradients(q, k, v, kwargs, 219, 220)):
        assert_close_to_reference(a, o, n, factor=SHARP_FACTOR, dtype=torch.float32, what=name)


@pytest.mark.parametrize("build", _builds())
@pytest.mark.parametrize("seed", [221, 222])
def test_mqa_gradients_summed_over_many_heads_within_the_ratio_rule(build, seed, monkeypatch):
    """MQA, 16 query heads over 256 causal rows, fp32: dK and dV of the one kv head each sum 16 x
    256 rows' terms. Summed as one FMA chain per element (every micro-kernel call adding to the
    running sum) they were 9-13x the naive error, where sgemm and the naive head sum add blocks;
    each call's sum is now added to the running one (found by flash-attn's grid: MQA, 9 heads)."""
    _use_build(monkeypatch, build)
    q, k, v = make_qkv(1, 16, 256, 64, Hkv=1, Sk=256, seed=seed, dtype=torch.float32)
    grads = _gradients(q, k, v, dict(mask=masks.causal()), None, seed + 1)
    for name, a, o, n in zip(("dq", "dk", "dv"), *grads):
        assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, dtype=torch.float32, what=name)


# -- FlashAttention's own test grid, through the flash-attn compat layer on cpu_fused ------------

# (Sq, Sk) of flash-attn's tests x head dims x (causal, window, softcap, alibi); the flash-attn
# conventions (bottom-right causal, window (left, right)) are checked by attention_ref.
FLASH_CASES = [
    ((113, 203), 40, {"causal": True}),
    ((128, 217), 59, {"window_size": (17, 3)}),
    ((108, 256), 96, {"causal": True, "window_size": (64, -1)}),
    ((1, 239), 111, {"causal": True}),
    ((3, 799), 32, {"window_size": (-1, 0), "softcap": 5.0}),
    ((239, 1), 64, {"causal": True}),  # Sq > Sk: every row but the last sees no key
    ((127, 512), 256, {"alibi": True}),
    ((1023, 1024), 32, {"causal": True}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("seqlens", "D", "kw"), FLASH_CASES, ids=[f"{s[0]}x{s[1]}-D{d}" for s, d, _ in FLASH_CASES]
)
def test_flash_attn_grid_on_the_fused_kernel(seqlens, D, kw, dtype):
    from selfattn.compat.flash_attn import flash_attn_func

    (Sq, Sk), H, Hkv = seqlens, 4, 2
    g = torch.Generator().manual_seed(Sq * 7 + D)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(H, generator=g) * 0.5
    grad = Sq * Sk <= 2**17
    q, k, v = (
        torch.randn(2, S, h, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
        for S, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv))
    )
    with backends.use("cpu_fused"):
        out = flash_attn_func(q, k, v, **kw)
    ref = lambda t, dt: attention_ref(*t, dtype=dt, **kw)[0]  # noqa: E731
    _ratio_check(out, (q, k, v), ref, grads=grad, dtype=dtype)


# -- dropout, determinism, empty rows, lse gradient ------------------------------------------------


# (B, Hq, Hkv, Sq, Sk, D, mask): rows of several keys each (one-key rows: the peaked-row test)
DROPOUT_CASES = [
    (2, 4, 2, 97, 150, 40, "causal"),
    (1, 6, 3, 113, 203, 59, "documents"),
    (3, 5, 1, 33, 70, 96, "tensor"),
    (2, 2, 2, 65, 64, 111, "window"),
]


@pytest.mark.parametrize("shape", DROPOUT_CASES, ids=lambda c: f"{c[3]}x{c[4]}-D{c[5]}-{c[6]}")
def test_dropout_drops_the_pairs_every_backend_drops(shape):
    """The counter-based pattern over random masks, GQA, ALiBi, odd shapes: the fused kernel
    drops the pairs the reference and chunked drop (forward and gradients); any other pair would
    show far above the ratio rule's bound."""
    B, Hq, Hkv, Sq, Sk, D, mask = shape
    case = dataclasses.replace(
        draw(0), B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=D, mod="alibi", sinks=False,
        scale=None, build="native", dtype="fp32", mask=mask, layout="contiguous", q_offset=None,
        kv_batch1=False,
    )  # fmt: skip
    (q, k, v), kwargs = _inputs(case, grad=True)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

    kwargs.update(dropout_p=0.25)
    _, gen, o64, on = check_dropout_call(q, k, v, Sq * Sk, **kwargs)
    chunked = selfattn.attention(q, k, v, generator=gen(), backend="chunked", **kwargs)
    assert_close_to_reference(chunked, o64, on)


@pytest.mark.usefixtures("every_thread")
def test_backward_is_bitwise_deterministic_across_runs_and_threads():
    """flash-attn's ``deterministic=True`` promise, kept always: no atomics, each work item
    writes its own rows, so the gradients do not depend on the run or the thread count."""
    q, k, v = make_qkv(2, 6, 113, 40, Hkv=2, Sk=203, Dv=24, seed=41, requires_grad=True)
    mask = masks.sliding_window(70) | masks.prefix_lm(9)
    mod = scores.alibi(6) >> scores.softcap(4.0)
    dout = torch.randn(2, 6, 113, 24, generator=torch.Generator().manual_seed(42))
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 2):
            torch.set_num_threads(threads)
            out = cpu_attention(q, k, v, mask=mask, score_mod=mod)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    finally:
        torch.set_num_threads(before)
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again))


@pytest.mark.parametrize(
    "extra, dtype",
    [("plain", torch.float32), ("dropout", torch.float32), ("sinks", torch.float32),
     ("bias-inf", torch.float32), ("bias-inf", torch.bfloat16)],
)  # fmt: skip
def test_rows_without_keys_give_zero_output_and_zero_gradients(extra, dtype):
    """Rows left without a key (Sq > Sk under causal; a -inf bias row) give out 0, lse -inf
    (the sink's logit with sinks) and gradients 0 to q, whatever else the call does. (bf16 with
    a bias: the transposed forward's score mods, whose -inf scores must not reach exp2w.)"""
    B, H, Sq, Sk = 2, 4, 97, 33  # bottom-right causal: the first 64 rows see no key
    q, k, v = make_qkv(B, H, Sq, 40, Hkv=2, Sk=Sk, dtype=dtype, seed=43, requires_grad=True)
    kw: dict = {"mask": masks.causal()}
    empty = torch.zeros(B, H, Sq, dtype=torch.bool)
    empty[:, :, : Sq - Sk] = True
    if extra == "dropout":
        kw.update(dropout_p=0.5, generator=torch.Generator().manual_seed(44))
    if extra == "sinks":
        kw["sinks"] = torch.randn(H, generator=torch.Generator().manual_seed(45))
    if extra == "bias-inf":
        bias = torch.randn(B, 1, Sq, Sk, generator=torch.Generator().manual_seed(46))
        bias[1, :, 70] = -math.inf  # a row that the mask would let see keys 0..6
        empty[1, :, 70] = True
        kw["score_mod"] = bias
    out, lse = cpu_attention(q, k, v, return_lse=True, **kw)
    want_lse = kw["sinks"].view(1, H, 1).expand(B, H, Sq) if extra == "sinks" else None
    assert bool((out[empty] == 0).all())
    if want_lse is None:
        assert bool((lse[empty] == -math.inf).all())
    else:
        torch.testing.assert_close(lse[empty], want_lse[empty])
    dq = torch.autograd.grad(out.square().sum() + lse[~empty].sum(), q)[0]
    assert bool(torch.isfinite(dq).all()) and bool((dq[empty] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lse_gradient_matches_the_oracle(dtype):
    """A loss on out and on the lse (ring attention and sinks merge through it): the lse's
    gradient reaches q and k by the ratio rule, GQA, a documents mask, ragged tiles."""
    q, k, v = make_qkv(2, 4, 97, 59, Hkv=2, Sk=150, dtype=dtype, seed=47, requires_grad=True)
    ids = torch.arange(150).div(37, rounding_mode="floor")
    kw = dict(mask=masks.causal() & masks.documents(ids), return_lse=True)
    g = torch.Generator().manual_seed(48)
    w_out, w_lse = torch.randn(2, 4, 97, 59, generator=g), torch.randn(2, 4, 97, generator=g)

    def loss(out, lse):
        return (out.double() * w_out.double()).sum() + (lse.double() * w_lse.double()).sum()

    grads = torch.autograd.grad(loss(*cpu_attention(q, k, v, **kw)), (q, k))
    o64, l64, leaves64 = reference_attention(q, k, v, **kw)
    on, ln, leavesn = naive_attention(q, k, v, **kw)
    g64 = torch.autograd.grad(loss(o64, l64), leaves64[:2])
    gn = torch.autograd.grad(loss(on, ln), leavesn[:2])
    for name, a, o, n in zip(("dq", "dk"), grads, g64, gn):
        assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, dtype=dtype, what=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_additive_mask_of_float32_min_is_a_score_not_an_empty_row(dtype):
    """transformers' additive masks hold finfo(float32).min at padded keys: a row whose every
    key carries it (a left-padded query row) is the softmax of equal scores, as the oracle,
    sdpa and transformers' eager give, not an empty row. The kernel kept its base-2 bias
    ``bias · log2(e)``, which overflowed to -inf there, and returned 0. (bf16: the transposed
    forward's score mods.)"""
    _float32_min_bias_rows(cpu_attention, dtype)


def test_float32_min_bias_rows_in_chunked():
    """chunked kept its scores in base 2 the same way (``s · log2(e)`` overflowed to -inf)."""
    _float32_min_bias_rows(functools.partial(selfattn.attention, backend="chunked"))


def _float32_min_bias_rows(attend, dtype=torch.float32):
    q, k, v = make_qkv(2, 4, 70, 32, Hkv=2, Sk=90, dtype=dtype, seed=49, requires_grad=True)
    bias = torch.zeros(2, 1, 70, 90)
    lo = torch.finfo(torch.float32).min
    bias[0, :, :, 60:] = lo  # padded keys
    bias[1, :, :5] = lo  # padded query rows: every key at finfo.min
    out, lse = attend(q, k, v, score_mod=bias, return_lse=True)
    assert bool((lse[1, :, :5] < -1e38).all()) and bool(torch.isfinite(lse).all())
    # the lse of those rows is -FLT_MAX·ln 2 + log(Sk), not -FLT_MAX: outside the ratio rule
    if dtype == torch.float32:
        ref = selfattn.attention(q, k, v, score_mod=bias, backend="reference")
        torch.testing.assert_close(out, ref)  # uniform weights over the padded rows' keys
    else:  # bf16: by the ratio rule, every row (the padded ones uniform, as the oracle)
        check_against_reference(attend, q, k, v, score_mod=bias, lse=False)
    check_against_reference(
        attend, q[:1], k[:1], v[:1], score_mod=bias[:1], lse=False
    )  # fp32 min on some keys of every row: those keys get weight 0, gradients by the rule


def _nan_case(name: str, dtype: torch.dtype):
    q, k, v = make_qkv(1, 2, 3, 8, Sk=130, dtype=dtype, seed=52)
    kw: dict = {}
    if name == "one-key":  # every row attends its one key, NaN for head 1
        k, v = k[:, :, :1].clone(), v[:, :, :1]
        k[0, 1, 0, 2] = math.nan
    elif name == "nan-tile-first":  # head 0's first key tile all NaN, finite keys after it
        k[0, 0, :64] = math.nan
    else:  # window 1 at the top-left: row i attends key i, NaN for head 0
        k[0, 0, :3, 5] = math.nan
        kw = dict(mask=masks.sliding_window(1), q_offset=0)
    return q, k, v, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["one-key", "nan-tile-first", "window-1"])
def test_nan_scores_reach_the_rows_that_attend_them(name, dtype):
    """A NaN score at a key a row attends makes its out and lse NaN (attention()'s contract).
    The kernel's vector max never keeps a NaN, so a tile whose attended scores were all NaN
    looked empty: the row came back (0, -inf), or ignored those keys when others followed."""
    q, k, v, kw = _nan_case(name, dtype)
    out, lse = cpu_attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = selfattn.attention(
        q.double(), k.double(), v.double(), return_lse=True, backend="reference", **kw
    )
    assert bool(torch.isnan(ref_lse).any())
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    torch.testing.assert_close(out.double().nan_to_num(), ref.nan_to_num(), atol=2e-2, rtol=0)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda q, k, v: (q, k.bfloat16(), v), r"share a dtype.*float32, torch\.bfloat16"),
        (lambda q, k, v: (q, k[..., :8], v), r"q \(1, 4, 5, 16\) has D=16, k \(1, 2, 7, 8\)"),
        (lambda q, k, v: (q, k[:, :1].expand(1, 3, 7, 16), v[:, :1].expand(1, 3, 7, 16)),
         r"Hq \(4\) must be a multiple of Hkv \(3\)"),
        (lambda q, k, v: (q, k, v[:, :, :6]), r"k \(1, 2, 7, 16\) and v \(1, 2, 6, 16\)"),
        (lambda q, k, v: (q.double(), k.double(), v.double()), r"float64.*chunked"),
        (lambda q, k, v: tuple(t.to("meta") for t in (q, k, v)), r"tensors on meta.*CPU"),
    ],
    ids=["dtype-mix", "D-mismatch", "GQA-ratio", "Sk-mismatch", "float64", "meta-device"],
)  # fmt: skip
def test_bad_inputs_name_the_shapes_and_the_fix(build, says):
    q, k, v = make_qkv(1, 4, 5, 16, Hkv=2, Sk=7, seed=50)
    with pytest.raises((TypeError, ValueError), match=says):
        cpu_attention(*build(q, k, v))


def test_a_bias_of_the_wrong_shape_is_named():
    q, k, v = make_qkv(1, 4, 5, 16, Hkv=2, Sk=7, seed=51)
    with pytest.raises(ValueError, match=r"\(1, 1, 5, 6\) does not broadcast to .*\(1, 4, 5, 7\)"):
        cpu_attention(q, k, v, score_mod=torch.zeros(5, 6))
