"""Cross-backend tests of ``selfattn.attention`` and ``selfattn.attention_weights``.

Every backend is checked against the float64 reference with the ratio rule of docs/testing.md
(``selfattn.testing.check_against_reference``). The full Cartesian product of backend × mask ×
score mod × dtype × GQA ratio × sizes × head dim × layout × gradients is far too slow, so
:func:`covering_design` draws a deterministic pairwise covering array: every pair of values of any
two axes (backend × mask, mask × score mod, dtype × GQA ratio, ...) appears in at least one case.

A backend may reject a case (``backends.get(name).reject``) only when the case is outside its
documented capability, :func:`required`; a rejection inside it fails the test. The capability is
also asserted on its own by ``test_capability``, so a wrongly-rejecting backend fails even where
the matrix happens not to reach it.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import os
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import selfattn
from selfattn import backends, masks, scores
from selfattn.call import prepare
from selfattn.testing import (
    assert_close_to_reference,
    check_against_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)

# triton runs on CPU tensors in Triton's interpreter (conftest sets TRITON_INTERPRET=1)
BACKENDS = ("reference", "chunked", "sdpa", "flex", "cpu_fused", "triton", "auto")
REGISTERED = ("reference", "chunked", "sdpa", "flex", "cpu_fused", "triton")

MASK_KINDS = (
    "none",
    "causal",
    "sliding_window",
    "chunked",
    "padding",
    "documents",
    "prefix_lm",
    "block_sparse",
    "bool_tensor",
    "mask_mod",
    "causal&padding",
)
SCORE_KINDS = ("none", "alibi", "softcap", "tensor", "t5", "callable")
DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# GQA ratio G = Hq / Hkv -> (Hq, Hkv); odd head counts where the ratio allows it.
HEADS = {"G1": (3, 3), "G2": (6, 3), "G4": (8, 2), "G8": (16, 2), "MQA": (5, 1)}
# (Sq, Sk) from the odd sizes 1, 7, 97: Sq != Sk both ways, plus Sq == Sk.
SIZES = {"1x1": (1, 1), "1x7": (1, 7), "7x1": (7, 1), "7x97": (7, 97), "97x7": (97, 7)}
SIZES["97x97"] = (97, 97)
HEAD_DIMS = ("8", "40", "59", "64", "128")

# -- documented capabilities ---------------------------------------------------------------------
SDPA_MASKS = ("none", "causal", "bool_tensor")
SDPA_SCORES = ("none", "alibi", "tensor", "t5")
SDPA_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the masks and score mods the Triton kernel takes as data (one key interval per row, document
# ids; alibi, bias and softcap terms)
TRITON_MASKS = tuple(m for m in MASK_KINDS if m not in ("block_sparse", "bool_tensor", "mask_mod"))
TRITON_SCORES = ("none", "alibi", "softcap", "tensor")
# Public SDPA returns no lse (sdpa gets it from the CPU flash kernel, without gradients and only for
# D == Dv); CPU FlexAttention is inference-only. Their lse is checked wherever they return it.
LSE_OPTIONAL = ("sdpa", "flex")


def required(
    backend: str,
    *,
    mask: str = "none",
    score: str = "none",
    dtype: torch.dtype = torch.float32,
    grad: bool = False,
    dropout: bool = False,
    bias_grad: bool = False,
) -> bool:
    """Whether ``backend`` must accept a CPU case of this description (its documented capability).

    reference, chunked (and auto): everything. sdpa: no mask, causal or bool masks; no score mod or
    an additive one (ALiBi, bias tensor, T5); fp32/fp64/bf16; any GQA ratio; gradients; no dropout.
    flex: forward only (no gradients) on CPU, any mask and score mod, fp32, no dropout.
    cpu_fused: any mask, no score mod or ALiBi, fp32/bf16/fp16, gradients, dropout.
    triton (interpreted on CPU): interval masks and document ids (:data:`TRITON_MASKS`), alibi,
    bias and softcap score mods, fp32/bf16/fp16, gradients, dropout; no gradient of the bias
    (``bias_grad``: the ``tensor`` score mod requires grad).
    """
    if backend in ("reference", "chunked", "auto"):
        return True
    if backend == "sdpa":
        return mask in SDPA_MASKS and score in SDPA_SCORES and dtype in SDPA_DTYPES and not dropout
    if backend == "flex":
        return dtype == torch.float32 and not grad and not dropout
    if backend == "cpu_fused":
        return score in ("none", "alibi") and dtype in CPU_DTYPES
    if backend == "triton":
        learnable_bias = bias_grad and score == "tensor"
        return (
            mask in TRITON_MASKS
            and score in TRITON_SCORES
            and dtype in CPU_DTYPES
            and not (learnable_bias)
        )
    return False


def rejection(backend: str, q, k, v, **kwargs) -> str | None:
    """The backend's reason for rejecting this call (``None``: it runs it; ``auto`` runs all)."""
    if backend == "auto":
        return None
    kwargs = dict(kwargs)
    if kwargs.get("generator") is not None:  # do not consume the caller's generator
        kwargs["generator"] = torch.Generator().manual_seed(0)
    qq, kk, vv, call = prepare(q, k, v, **kwargs)
    return backends.get(backend).reject(qq, kk, vv, call)


def run_or_skip(backend: str, must: bool, q, k, v, **kwargs):
    """``selfattn.attention`` on ``backend``; skip if it rejects a case outside its capability.

    ``must`` (usually from :func:`required`) is relaxed for the lse where it is optional.
    """
    reason = rejection(backend, q, k, v, **kwargs)
    if reason is not None:
        if must and (backend not in LSE_OPTIONAL or not kwargs.get("return_lse")):
            pytest.fail(f"{backend} rejected a case inside its documented capability: {reason}")
        pytest.skip(f"{backend}: {reason}")
    return selfattn.attention(q, k, v, backend=backend, **kwargs)


def forward_lse(backend: str, q, k, v, *, must: bool, **kwargs):
    """The lse of a forward-only call, or None where the backend may not return it."""
    q, k, v = (t.detach() for t in (q, k, v))
    reason = rejection(backend, q, k, v, return_lse=True, **kwargs)
    if reason is None:
        return selfattn.attention(q, k, v, backend=backend, return_lse=True, **kwargs)[1]
    if must and backend not in LSE_OPTIONAL:
        pytest.fail(f"{backend} rejected return_lse inside its capability: {reason}")
    return None


def _lse_from_reference(backend: str):
    """``attention`` on ``backend`` without ``return_lse``, handing back the reference's lse.

    For checking the output and gradients of a backend that cannot return the lse for this call;
    its own lse is then checked in a separate forward-only call where it can return it.
    """

    def fn(q, k, v, *, return_lse=True, **kwargs):
        out = selfattn.attention(q, k, v, backend=backend, **kwargs)
        with torch.no_grad():
            _, lse = selfattn.attention(q, k, v, backend="reference", return_lse=True, **kwargs)
        return out, lse

    return fn


def check_backend(
    backend: str, q, k, v, *, cap: dict, grad: bool = True, grad_factor: float = 3.0, **kwargs
) -> None:
    """``check_against_reference`` on ``backend`` for every part of the case it accepts.

    ``cap`` describes the case for :func:`required` (mask, score, dtype). The parts, in order:
    output+lse+gradients, output+gradients, output+lse, output. A backend that returns the lse only
    without gradients (sdpa on CPU) gets its gradients checked in a call without ``return_lse``
    and its lse in a forward-only call. Failing: a rejected part inside the capability. Skipped:
    the whole case, when no part of it is accepted.
    """
    lse_needed = backend not in LSE_OPTIONAL
    reasons: dict = {}

    def reason(g: bool, lse: bool):
        if (g, lse) not in reasons:
            qq, kk, vv = (t.detach().requires_grad_(g) for t in (q, k, v))
            reasons[g, lse] = rejection(backend, qq, kk, vv, return_lse=lse, **kwargs)
        return reasons[g, lse]

    for g in sorted({grad, False}):
        if required(backend, grad=g, **cap) and reason(g, lse_needed) is not None:
            what = "gradients" if g else "the forward"
            pytest.fail(f"{backend} rejected {what} inside its capability: {reason(g, lse_needed)}")
    ran: list = []
    for g, lse in ((grad, True), (grad, False), (False, True), (False, False)):
        if reason(g, lse) is not None or any(g <= rg and lse <= rl for rg, rl in ran):
            continue
        fn = functools.partial(selfattn.attention, backend=backend)
        check_against_reference(
            fn if lse else _lse_from_reference(backend), q, k, v, grad=g,
            grad_factor=grad_factor, **kwargs,
        )  # fmt: skip
        ran.append((g, lse))
    if not ran:
        pytest.skip(f"{backend}: {reason(grad, True)}")


def grad_dtype(backend: str) -> tuple[torch.dtype, bool]:
    """The most precise dtype this backend must run, and whether it must run gradients there."""
    if required(backend, dtype=torch.float64, grad=True):
        return torch.float64, True
    return torch.float32, required(backend, grad=True)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- mask and score-mod factories ------------------------------------------------------------------
def build_mask(kind: str, B: int, Hq: int, Sq: int, Sk: int, g: torch.Generator):
    """A mask of ``kind`` for a call with default (bottom-right) ``q_offset = Sk - Sq``."""
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "sliding_window":
        return masks.sliding_window(int(torch.randint(1, Sk + 2, (1,), generator=g)))
    if kind == "chunked":
        return masks.chunked(int(torch.randint(2, 6, (1,), generator=g)))
    if kind in ("padding", "causal&padding"):
        lengths = torch.randint(0, Sk + 1, (B,), generator=g)
        lengths[-1] = Sk  # at least one sequence with keys everywhere
        pad = masks.padding(lengths)
        return pad if kind == "padding" else masks.causal() & pad
    if kind == "documents":
        # packed sequences: ids are non-decreasing along the sequence
        starts = torch.rand(B, Sk, generator=g) < 0.15
        return masks.documents(starts.long().cumsum(-1))
    if kind == "prefix_lm":
        return masks.prefix_lm(torch.randint(0, Sk + 1, (B,), generator=g))
    if kind == "block_sparse":
        bq, bk = 4, 8
        q_end = Sk  # q_offset + Sq under bottom-right alignment (Sq <= Sk for this kind)
        layout = torch.rand(Hq, -(-q_end // bq), -(-Sk // bk), generator=g) < 0.6
        return masks.block_sparse(layout, (bq, bk))
    if kind == "bool_tensor":
        return torch.rand(B, 1, Sq, Sk, generator=g) < 0.75
    if kind == "mask_mod":

        def stripes(b, h, q_idx, kv_idx):
            return ((q_idx - kv_idx + h) % 3 != 1) | (kv_idx == b)

        return stripes
    raise AssertionError(kind)


def build_score_mod(kind: str, B: int, Hq: int, Sq: int, Sk: int, g):
    """A score mod of ``kind``; its tensors never require gradients (see test_score_mod_grads)."""
    if kind == "none":
        return None
    if kind == "alibi":
        return scores.alibi(Hq)
    if kind == "softcap":
        return scores.softcap(1.5)  # scores are ~N(0, 1): a cap of 1.5 bends many of them
    if kind == "tensor":
        return torch.randn(1, Hq, Sq, Sk, generator=g)
    if kind == "t5":
        t5 = scores.RelativePositionBias(Hq, num_buckets=8, max_distance=20)
        with torch.no_grad():
            t5.weight.copy_(torch.randn(t5.weight.shape, generator=g))
        return t5.requires_grad_(False)
    if kind == "callable":

        def every_third(score, b, h, q_idx, kv_idx):
            return torch.where((q_idx + h - kv_idx) % 3 == 0, score * 1.5, score - 0.5)

        return every_third
    raise AssertionError(kind)


# -- the covering design ---------------------------------------------------------------------------
def covering_design(axes: dict, *, invalid=lambda case: False, seed: int = 0, tries: int = 24):
    """A deterministic pairwise covering array over ``axes`` (name -> tuple of str values).

    AETG-style greedy: each new case starts from an uncovered pair and fills the other axes with
    the value completing the most uncovered pairs; the best of ``tries`` candidates is kept.
    ``invalid(partial_case)`` excludes combinations (and pairs that no valid case can hold).
    """
    rng = random.Random(seed)
    names = list(axes)
    uncovered = set()
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(axes[a], axes[b]):
            if not invalid({a: va, b: vb}):
                uncovered.add(((a, va), (b, vb)))

    def gain(case):
        return sum(
            ((a, case[a]), (b, case[b])) in uncovered for a, b in itertools.combinations(names, 2)
        )

    cases = []
    while uncovered:
        best, best_gain = None, -1
        for _ in range(tries):
            (a, va), (b, vb) = rng.choice(sorted(uncovered))
            case = {a: va, b: vb}
            rest = [n for n in names if n not in case]
            rng.shuffle(rest)
            for n in rest:
                scored = []
                for value in axes[n]:
                    trial = {**case, n: value}
                    if invalid(trial):
                        continue
                    new = sum(((m, trial[m]), (n, value)) in uncovered for m in case)
                    new += sum(((n, value), (m, trial[m])) in uncovered for m in case)
                    scored.append((new, rng.random(), value))
                case[n] = max(scored)[2]
            if gain(case) > best_gain:
                best, best_gain = case, gain(case)
        cases.append({n: best[n] for n in names})
        uncovered -= {((a, best[a]), (b, best[b])) for a, b in itertools.combinations(names, 2)}
    return cases


MATRIX_AXES = {
    "backend": BACKENDS,
    "mask": MASK_KINDS,
    "score": SCORE_KINDS,
    "dtype": tuple(DTYPES),
    "heads": tuple(HEADS),
    "sizes": tuple(SIZES),
    "D": HEAD_DIMS,
    "Dv": ("Dv=D", "Dv!=D"),
    "layout": ("contiguous", "strided"),
    "grad": ("fwd+bwd", "fwd"),
}


def _invalid(case: dict) -> bool:
    # documents ids and block-sparse layouts index absolute positions, which are negative for the
    # first rows when Sq > Sk under bottom-right alignment.
    if case.get("mask") in ("documents", "block_sparse") and "sizes" in case:
        Sq, Sk = SIZES[case["sizes"]]
        return Sq > Sk
    return False


MATRIX = covering_design(MATRIX_AXES, invalid=_invalid)


def _case_id(case: dict) -> str:
    return "-".join(case[n] for n in MATRIX_AXES)


def test_covering_design_covers_every_pair():
    pairs = {
        ((a, c[a]), (b, c[b])) for c in MATRIX for a, b in itertools.combinations(MATRIX_AXES, 2)
    }
    for a, b in itertools.combinations(MATRIX_AXES, 2):
        for va, vb in itertools.product(MATRIX_AXES[a], MATRIX_AXES[b]):
            if not _invalid({a: va, b: vb}):
                assert ((a, va), (b, vb)) in pairs, f"pair {a}={va}, {b}={vb} not covered"
    assert not any(_invalid(c) for c in MATRIX)


@dataclass(frozen=True)
class Case:
    backend: str
    mask: str
    score: str
    dtype: torch.dtype
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    Dv: int
    contiguous: bool
    grad: bool

    @classmethod
    def from_design(cls, c: dict) -> Case:
        D = int(c["D"])
        return cls(
            backend=c["backend"],
            mask=c["mask"],
            score=c["score"],
            dtype=DTYPES[c["dtype"]],
            Hq=HEADS[c["heads"]][0],
            Hkv=HEADS[c["heads"]][1],
            Sq=SIZES[c["sizes"]][0],
            Sk=SIZES[c["sizes"]][1],
            D=D,
            Dv=D if c["Dv"] == "Dv=D" else D + 5,
            contiguous=c["layout"] == "contiguous",
            grad=c["grad"] == "fwd+bwd",
        )


def run_case(case: Case, B: int = 2, seed: int = 0) -> None:
    """Check one case against the float64 reference (forward, and gradients if asked)."""
    g = gen(seed)
    q, k, v = make_qkv(
        B,
        case.Hq,
        case.Sq,
        case.D,
        Hkv=case.Hkv,
        Sk=case.Sk,
        Dv=case.Dv,
        dtype=case.dtype,
        seed=seed,
        contiguous=case.contiguous,
    )
    kw = {
        "mask": build_mask(case.mask, B, case.Hq, case.Sq, case.Sk, g),
        "score_mod": build_score_mod(case.score, B, case.Hq, case.Sq, case.Sk, g),
    }
    cap = dict(mask=case.mask, score=case.score, dtype=case.dtype)
    check_backend(case.backend, q, k, v, cap=cap, grad=case.grad, **kw)


@pytest.mark.parametrize("design", MATRIX, ids=_case_id)
def test_matrix(design):
    case = Case.from_design(design)
    # Triton's interpreter runs every program in Python, one per (batch, head, tile): one batch
    # row halves its time; tests/kernels/test_triton_attention.py covers its batch strides
    run_case(case, B=1 if case.backend == "triton" else 2)


LONG_CASES = {
    # the size where flex's backward once gave NaN (pytorch#153799): causal, bf16, GQA, grads
    "1025x1025-causal-bf16-G2": dict(Sq=1025, Sk=1025, mask="causal", score="none", Hq=2, Hkv=1,
                                     dtype=torch.bfloat16, D=64),
    # a decode step over a long padded cache with ALiBi
    "1x1025-bool-alibi-fp32-MQA": dict(Sq=1, Sk=1025, mask="bool_tensor", score="alibi", Hq=4,
                                       Hkv=1, dtype=torch.float32, D=40),
}  # fmt: skip


# triton's interpreter runs every program in Python: ~4 min for one 1025 case; its compiled kernels
# meet these sizes on CUDA (python -m selfattn.benchmarks.gpu --part triton)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
@pytest.mark.parametrize("name", list(LONG_CASES))
def test_size_1025(backend, name):
    c = LONG_CASES[name]
    case = Case(backend=backend, Dv=c["D"], contiguous=False, grad=True, **c)
    run_case(case, B=1, seed=7)


# -- capabilities ----------------------------------------------------------------------------------
def _capability_cases(backend: str):
    """(mask, score, dtype, grad, dropout) descriptions the backend must accept."""
    dts = list(DTYPES.values())
    if backend in ("reference", "chunked"):
        for i, (m, s) in enumerate(itertools.product(MASK_KINDS, SCORE_KINDS)):
            yield m, s, dts[i % 4], i % 2 == 0, False
        for dt, grad, drop in itertools.product(dts, (False, True), (False, True)):
            yield "causal", "none", dt, grad, drop
    elif backend == "sdpa":
        yield from itertools.product(SDPA_MASKS, SDPA_SCORES, SDPA_DTYPES, (False, True), (False,))
    elif backend == "flex":
        for m, s in itertools.product(MASK_KINDS, SCORE_KINDS):
            yield m, s, torch.float32, False, False
    elif backend == "cpu_fused":
        for m, dt, grad in itertools.product(MASK_KINDS, CPU_DTYPES, (False, True)):
            yield m, "alibi" if grad else "none", dt, grad, dt == torch.float16


@pytest.mark.parametrize("backend", REGISTERED)
def test_capability(backend):
    """Each backend accepts every CPU case of its documented capability (see ``required``)."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 5, 9, 16
    problems = []
    for mask, score, dtype, grad, dropout in _capability_cases(backend):
        assert required(backend, mask=mask, score=score, dtype=dtype, grad=grad, dropout=dropout)
        g = gen(3)
        q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=dtype, requires_grad=grad)
        kw = dict(
            mask=build_mask(mask, B, Hq, Sq, Sk, g),
            score_mod=build_score_mod(score, B, Hq, Sq, Sk, g),
            dropout_p=0.25 if dropout else 0.0,
            return_lse=backend not in LSE_OPTIONAL,
        )
        reason = rejection(backend, q, k, v, **kw)
        if reason is not None:
            what = f"mask={mask} score={score} {dtype} grad={grad} dropout={dropout}"
            problems.append(f"{what}: {reason}")
    assert not problems, f"{backend} wrongly rejects {len(problems)} cases:\n" + "\n".join(
        problems[:10]
    )


# -- scale, head dims, positions -------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [None, 0.0, -0.6, 2.5], ids=["default", "0", "neg", "2.5"])
def test_scale_and_dv(backend, scale):
    dtype, grad = grad_dtype(backend)
    q, k, v = make_qkv(2, 4, 7, 24, Hkv=2, Sk=11, Dv=13, dtype=dtype, seed=11)
    # The Triton interpreter runs tl.dot as numpy's fp32 matmul: its summation order, and so its
    # error on these 11-term sums, is the host BLAS's; the naive baseline's is torch's. On some
    # hosts the interpreter's dv measures ~4.6x the naive error at the sharpest scale.
    factor = 5.0 if backend == "triton" else 3.0
    check_backend(
        backend, q, k, v, cap=dict(dtype=dtype), grad=grad, grad_factor=factor, scale=scale
    )


def test_scale_semantics_on_reference():
    q, k, v = make_qkv(2, 3, 6, 20, Sk=9, Dv=7, dtype=torch.float64, seed=12)
    s = q @ k.transpose(-1, -2)
    expected = torch.softmax(s / math.sqrt(20), dim=-1) @ v
    torch.testing.assert_close(selfattn.attention(q, k, v, backend="reference"), expected)
    explicit = selfattn.attention(q, k, v, backend="reference", scale=1 / math.sqrt(20))
    assert torch.equal(explicit, selfattn.attention(q, k, v, backend="reference"))
    # scale 0: uniform weights, the output is the mean of the values
    zero = selfattn.attention(q, k, v, backend="reference", scale=0.0)
    torch.testing.assert_close(zero, v.mean(dim=2, keepdim=True).expand_as(zero))
    # a negative scale prefers the keys least aligned with the query
    neg = selfattn.attention(q, k, v, backend="reference", scale=-0.7)
    torch.testing.assert_close(neg, torch.softmax(-0.7 * s, dim=-1) @ v)


def _bool(rows):
    return torch.tensor(rows, dtype=torch.bool).view(1, 1, len(rows), len(rows[0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_offset_alignment(backend):
    """Sq=2, Sk=5: causal is bottom-right by default, top-left with q_offset=0; negative works."""
    dtype, _ = grad_dtype(backend)
    q, k, v = make_qkv(2, 3, 2, 16, Sk=5, dtype=dtype, seed=13)
    causal = masks.causal()
    pictures = {
        None: [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],  # default q_offset = Sk - Sq = 3
        0: [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]],  # top-left
        -1: [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0]],  # query 0 at position -1 sees no key
        3: [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
    }
    must = required(backend, mask="causal", dtype=dtype)
    for q_offset, rows in pictures.items():
        out = run_or_skip(backend, must, q, k, v, mask=causal, q_offset=q_offset)
        want = selfattn.attention(q, k, v, mask=_bool(rows), backend="reference")
        torch.testing.assert_close(out, want, msg=f"q_offset={q_offset}")
    assert torch.equal(causal.to_dense(2, 5)[0, 0], _bool(pictures[None])[0, 0]), (
        "to_dense must use the same default alignment as attention"
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_return_lse_shape_and_dtype(backend, dtype):
    q, k, v = make_qkv(2, 4, 5, 16, Hkv=1, Sk=8, dtype=dtype, seed=14)
    must = required(backend, mask="causal", dtype=dtype)
    out, lse = run_or_skip(backend, must, q, k, v, mask=masks.causal(), return_lse=True)
    assert out.shape == (2, 4, 5, 16) and out.dtype == dtype
    assert lse.shape == (2, 4, 5)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    plain = selfattn.attention(q, k, v, mask=masks.causal(), backend=backend)
    assert not isinstance(plain, tuple) and plain.dtype == dtype


def _final_cast(o64: torch.Tensor, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """The oracle cast to ``dtype`` as ``backend`` casts its fp32 output: rounded to nearest, but
    truncated (toward zero) in bf16 by Triton's interpreter, whose fp32 -> bf16 ``cast_impl``
    passes no rounding mode to ``_convert_float`` (compiled Triton rounds to nearest even)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton" and dtype == torch.bfloat16 and interpreted:
        high_bits = torch.tensor(-(1 << 16), dtype=torch.int32)  # sign, exponent, 7 mantissa bits
        return (o64.float().view(torch.int32) & high_bits).view(torch.float32).double()
    return o64.to(dtype).double()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_accumulates_in_fp32(backend, dtype):
    """fp16/bf16 inputs accumulate in fp32: the error is about that of the final rounding.

    Accumulating in the input dtype instead is 3-7x worse at Sk=257, which the ratio rule cannot
    see (its naive baseline is exactly that computation).
    """
    q, k, v = make_qkv(2, 4, 33, 64, Hkv=2, Sk=257, dtype=dtype, seed=39)
    must = required(backend, mask="causal", dtype=dtype)
    out = run_or_skip(backend, must, q, k, v, mask=masks.causal())
    o64, _, _ = reference_attention(q, k, v, mask=masks.causal())
    rounding = (_final_cast(o64, dtype, backend) - o64).abs().max().item()
    err = (out.double() - o64).abs().max().item()
    assert err <= 2 * rounding, (
        f"max error {err:.2e} vs rounding the oracle to {dtype} {rounding:.2e}"
    )


# -- fully masked rows and poisoned padding --------------------------------------------------------
def _empty_row_masks(B, Hq, Sq, Sk, g):
    """A bool mask with some all-False query rows, and the rows that are empty."""
    allowed = torch.rand(B, Hq, Sq, Sk, generator=g) < 0.6
    empty = torch.rand(B, Hq, Sq, generator=g) < 0.3
    empty[0, 0, 0] = True
    allowed[empty] = False
    allowed[..., 0] |= ~empty  # every other row attends at least one key
    return allowed, empty


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool_tensor", "causal_Sq>Sk"])
def test_fully_masked_rows(backend, kind):
    """Rows with no allowed key: output exactly 0, lse -inf, dq exactly 0, no NaN anywhere."""
    B, Hq, Hkv, D = 2, 4, 2, 16
    g = gen(15)
    if kind == "bool_tensor":
        Sq, Sk = 9, 7
        mask, empty = _empty_row_masks(B, Hq, Sq, Sk, g)
        mask_kind = "bool_tensor"
    else:
        Sq, Sk = 9, 5  # bottom-right: query i at position i - 4, rows 0..3 see nothing
        mask = masks.causal()
        empty = (torch.arange(Sq) < Sq - Sk).view(1, 1, Sq).expand(B, Hq, Sq)
        mask_kind = "causal"
    dtype, grad = grad_dtype(backend)
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=dtype, seed=16, requires_grad=grad)
    must = required(backend, mask=mask_kind, dtype=dtype, grad=grad)
    out = run_or_skip(backend, must, q, k, v, mask=mask)
    assert not out.isnan().any()
    assert bool((out[empty] == 0).all()), "fully masked rows must give exactly 0"
    assert bool((out[~empty].abs().sum(-1) > 0).all())
    lse = forward_lse(backend, q, k, v, must=must, mask=mask)
    if lse is not None:
        assert not lse.isnan().any()
        assert bool((lse[empty] == float("-inf")).all()), "fully masked rows must give lse -inf"
        assert bool(torch.isfinite(lse[~empty]).all())
    if grad:
        dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
            assert bool(torch.isfinite(t).all()), f"{name} has non-finite values"
        assert bool((dq[empty] == 0).all()), "dq of fully masked rows must be exactly 0"
    check_backend(backend, q, k, v, cap=dict(mask=mask_kind, dtype=dtype), grad=grad, mask=mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_form", ["padding", "bool_tensor"])
def test_nan_inf_in_padded_kv(backend, mask_form):
    """NaN/Inf stored in K/V positions past each sequence's length never reach the output."""
    B, Hq, Hkv, Sq, Sk, D = 3, 4, 2, 7, 13, 16
    lengths = torch.tensor([5, Sk, 0])
    pad = masks.padding(lengths)
    mask = pad if mask_form == "padding" else pad.to_dense(Sq, Sk, B=B)
    dtype, grad = grad_dtype(backend)
    must = required(backend, mask=mask_form, dtype=dtype, grad=grad)
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=dtype, seed=17)
    clean = run_or_skip(backend, must, q, k, v, mask=mask)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        k2[b, :, n:] = float("nan")
        v2[b, :, n:] = float("inf")
        v2[b, :, n::2] = float("-inf")
    q, k2, v2 = (t.detach().requires_grad_(grad) for t in (q, k2, v2))
    poisoned = selfattn.attention(q, k2, v2, mask=mask, backend=backend)
    assert bool(torch.isfinite(poisoned).all()), "NaN/Inf in padded K/V leaked into the output"
    # inputs with NaN/Inf are redone on chunked's exact path by the fused backends (triton's fp32
    # kernel then differs from its clean call by reordering): both within the rule of the oracle
    o64, _, _ = reference_attention(q, k, v, mask=mask)
    naive, _, _ = naive_attention(q, k, v, mask=mask)
    assert_close_to_reference(poisoned, o64, naive, what="poisoned")
    assert_close_to_reference(clean, o64, naive, what="clean")
    assert bool((poisoned[2] == 0).all()), "a sequence with no keys must give exactly 0"
    if not grad:
        return
    dq, dk, dv = torch.autograd.grad(poisoned, (q, k2, v2), torch.ones_like(poisoned))
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert bool(torch.isfinite(t).all()), f"{name} is not finite"
    for b, n in enumerate(lengths.tolist()):
        assert bool((dk[b, :, n:] == 0).all()) and bool((dv[b, :, n:] == 0).all())


# -- dropout ---------------------------------------------------------------------------------------
DROPOUT_BACKENDS = ("reference", "chunked", "cpu_fused", "triton", "auto")


def _dropout_inputs(seed=18, dtype=torch.float64):
    return make_qkv(2, 4, 9, 16, Hkv=2, Sk=21, dtype=dtype, seed=seed, requires_grad=True)


def _attend_grads(backend, q, k, v, seed, p=0.3, **kw):
    out = run_or_skip(backend, True, q, k, v, dropout_p=p, generator=gen(seed), **kw)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return out, grads


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_same_seed_same_result_different_seed_differs(backend):
    q, k, v = _dropout_inputs(dtype=grad_dtype(backend)[0])
    out1, g1 = _attend_grads(backend, q, k, v, seed=5, mask=masks.causal())
    out2, g2 = _attend_grads(backend, q, k, v, seed=5, mask=masks.causal())
    out3, g3 = _attend_grads(backend, q, k, v, seed=6, mask=masks.causal())
    assert torch.equal(out1, out2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    assert not torch.equal(out1, out3)
    assert not torch.equal(g1[0], g3[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_zero_is_bitwise_no_dropout(backend):
    dtype, grad = grad_dtype(backend)
    q, k, v = make_qkv(2, 4, 9, 16, Hkv=2, Sk=21, dtype=dtype, seed=19, requires_grad=grad)
    must = required(backend, mask="causal", dtype=dtype, grad=grad)
    plain = run_or_skip(backend, must, q, k, v, mask=masks.causal())
    p0 = selfattn.attention(
        q, k, v, mask=masks.causal(), dropout_p=0.0, generator=gen(1), backend=backend
    )
    assert torch.equal(plain, p0)
    if grad:
        g_plain = torch.autograd.grad(plain, (q, k, v), torch.ones_like(plain))
        g_p0 = torch.autograd.grad(p0, (q, k, v), torch.ones_like(p0))
        for a, b in zip(g_plain, g_p0):
            assert torch.equal(a, b)


def _dropped_weights(backend, p, seed, B=2, Hq=4, Sq=33, Sk=64):
    """Dropped, rescaled weights ``(B, Hq, Sq, Sk)`` read through the output: with V = I, O = P."""
    q, k, _ = make_qkv(B, Hq, Sq, 16, Hkv=2, Sk=Sk, dtype=torch.float64, seed=20)
    v = torch.eye(Sk, dtype=torch.float64).expand(B, 2, Sk, Sk)
    out = run_or_skip(backend, True, q, k, v, dropout_p=p, generator=gen(seed))
    return out, selfattn.attention_weights(q, k, v)


@pytest.mark.parametrize("backend", ("reference", "chunked"))
@pytest.mark.parametrize("p", [0.17, 0.7])
def test_dropout_fraction_and_rescaling(backend, p):
    out, w = _dropped_weights(backend, p, seed=21)
    dropped = out == 0
    n = dropped.numel()
    frac = dropped.double().mean().item()
    # binomial bound: 6 standard deviations, a false alarm about once in 10^9 runs
    assert abs(frac - p) < 6 * math.sqrt(p * (1 - p) / n), f"dropped {frac:.4f}, p={p}"
    kept = ~dropped
    torch.testing.assert_close(out[kept], w[kept] / (1 - p))


def test_dropout_reference_and_chunked_drop_the_same_pairs():
    """Both use the counter-based ``_common.dropout_keep``: the same seed drops the same pairs."""
    out_ref, _ = _dropped_weights("reference", 0.4, seed=22)
    out_chk, _ = _dropped_weights("chunked", 0.4, seed=22)
    assert torch.equal(out_ref == 0, out_chk == 0)
    torch.testing.assert_close(out_chk, out_ref)


@pytest.mark.parametrize("backend", ("chunked", "cpu_fused", "triton", "auto"))
def test_dropout_against_reference(backend):
    """Forward and gradients with dropout follow the float64 reference drawn from the same seed."""
    q, k, v = make_qkv(2, 4, 13, 24, Hkv=1, Sk=19, dtype=torch.float32, seed=23)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    kw = dict(mask=masks.sliding_window(6), score_mod=scores.alibi(4), dropout_p=0.25)
    out = run_or_skip(backend, True, q, k, v, generator=gen(9), **kw)
    o64, _, leaves64 = reference_attention(q, k, v, generator=gen(9), **kw)
    onv, _, leavesn = naive_attention(q, k, v, generator=gen(9), **kw)
    assert_close_to_reference(out, o64, onv, what="out")
    dout = torch.randn(out.shape, generator=gen(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout.float())
    g64 = torch.autograd.grad(o64, leaves64, dout)
    gnv = torch.autograd.grad(onv, leavesn, dout.float())
    for name, a, o, n in zip(("dq", "dk", "dv"), grads, g64, gnv):
        assert_close_to_reference(a, o, n, factor=3.0, dtype=torch.float32, what=name)


# -- GQA / MQA -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Hq,Hkv", [(6, 3), (8, 2), (8, 1)], ids=["G2", "G4", "MQA"])
def test_gqa_equals_mha_on_repeated_kv(backend, Hq, Hkv):
    """Query head h reads kv head h // G; dk/dv of the GQA call are sums over each group."""
    dtype, grad = grad_dtype(backend)
    G = Hq // Hkv
    q, k, v = make_qkv(2, Hq, 7, 16, Hkv=Hkv, Sk=12, Dv=9, dtype=dtype, seed=24)
    mask = masks.causal()
    must = required(backend, mask="causal", score="alibi", dtype=dtype, grad=grad)
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    gqa = run_or_skip(backend, must, q, k, v, mask=mask, score_mod=scores.alibi(Hq))
    mha = selfattn.attention(q, kr, vr, mask=mask, score_mod=scores.alibi(Hq), backend=backend)
    torch.testing.assert_close(gqa, mha)
    if not grad:
        return
    dout = torch.randn(gqa.shape, generator=gen(2), dtype=dtype)
    dq, dk, dv = torch.autograd.grad(gqa, (q, k, v), dout)
    dq_m, dkr, dvr = torch.autograd.grad(mha, (q, kr, vr), dout)
    torch.testing.assert_close(dq, dq_m)
    torch.testing.assert_close(dk, dkr.view(2, Hkv, G, 12, 16).sum(2))
    torch.testing.assert_close(dv, dvr.view(2, Hkv, G, 12, 9).sum(2))


# -- attention_weights -----------------------------------------------------------------------------
def test_attention_weights_are_the_softmax_of_explicit_scores():
    B, Hq, Hkv, Sq, Sk, D = 2, 6, 2, 7, 11, 12
    g = gen(25)
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=torch.float64, seed=25)
    allowed, empty = _empty_row_masks(B, Hq, Sq, Sk, g)
    bias = torch.randn(B, Hq, Sq, Sk, generator=g, dtype=torch.float64)
    w = selfattn.attention_weights(q, k, v, mask=allowed, score_mod=bias, scale=0.4)
    assert w.shape == (B, Hq, Sq, Sk) and w.dtype == torch.float64
    s = q @ k.repeat_interleave(Hq // Hkv, dim=1).transpose(-1, -2) * 0.4 + bias
    expected = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    torch.testing.assert_close(w, expected)
    sums = w.sum(-1)
    torch.testing.assert_close(sums, (~empty).double())
    assert bool((w[~allowed] == 0).all())
    out = selfattn.attention(q, k, v, mask=allowed, score_mod=bias, scale=0.4, backend="reference")
    torch.testing.assert_close(out, w @ v.repeat_interleave(Hq // Hkv, dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_weights_dtype_and_causal_default(dtype):
    q, k, v = make_qkv(1, 2, 3, 8, Sk=5, dtype=dtype, seed=26)
    w = selfattn.attention_weights(q, k, v, mask=masks.causal())
    assert w.dtype == dtype
    # bottom-right: query 0 sits at position 2 and sees keys 0..2
    assert torch.equal(w[0, 0] > 0, masks.causal().to_dense(3, 5)[0, 0])
    torch.testing.assert_close(w.float().sum(-1), torch.ones(1, 2, 3), atol=1e-2, rtol=0)


# -- empty sizes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,Sq,Sk", [(2, 5, 0), (2, 0, 6), (0, 5, 6)], ids=["Sk=0", "Sq=0", "B=0"])
def test_empty_sizes(backend, B, Sq, Sk):
    q, k, v = make_qkv(B, 4, Sq, 8, Hkv=2, Sk=Sk, Dv=3, seed=27, requires_grad=True)
    out, lse = selfattn.attention(q, k, v, mask=masks.causal(), return_lse=True, backend=backend)
    assert out.shape == (B, 4, Sq, 3) and out.dtype == q.dtype
    assert lse.shape == (B, 4, Sq) and lse.dtype == torch.float32
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert g is not None and g.shape == t.shape, f"d{name} must be a zero tensor"
        assert bool((g == 0).all())
    w = selfattn.attention_weights(q, k, v)
    assert w.shape == (B, 4, Sq, Sk)


# -- mask and score-mod forms ----------------------------------------------------------------------
def _mask_forms(B, Sq, Sk, lengths):
    """One mask (bottom-right causal & key padding) as a Mask, a mask_mod, and a bool tensor."""
    off = Sk - Sq

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx < lengths[b])

    tensor = (torch.arange(Sk) <= torch.arange(Sq)[:, None] + off) & (
        torch.arange(Sk) < lengths.view(B, 1, 1, 1)
    )  # (B, 1, Sq, Sk)
    return {
        "Mask": masks.causal() & masks.padding(lengths),
        "mask_mod": mask_mod,
        "bool_tensor": tensor,
        "Mask&mask_mod": masks.causal() & (lambda b, h, q_idx, kv_idx: kv_idx < lengths[b]),
        "Mask&bool_tensor": masks.causal() & (torch.arange(Sk) < lengths.view(B, 1, 1, 1)),
    }


def test_mask_forms_are_interchangeable_on_reference():
    B, Sq, Sk = 3, 6, 10
    lengths = torch.tensor([10, 4, 7])
    q, k, v = make_qkv(B, 2, Sq, 8, Sk=Sk, dtype=torch.float64, seed=28)
    outs = {
        name: selfattn.attention(q, k, v, mask=m, backend="reference")
        for name, m in _mask_forms(B, Sq, Sk, lengths).items()
    }
    base = outs.pop("Mask")
    for name, out in outs.items():
        assert torch.equal(out, base), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "form", ["Mask", "mask_mod", "bool_tensor", "Mask&mask_mod", "Mask&bool_tensor"]
)
def test_mask_forms(backend, form):
    B, Sq, Sk = 3, 6, 10
    lengths = torch.tensor([10, 4, 7])
    mask = _mask_forms(B, Sq, Sk, lengths)[form]
    dtype, grad = grad_dtype(backend)
    kind = {"mask_mod": "mask_mod", "Mask&mask_mod": "mask_mod", "bool_tensor": "bool_tensor"}
    kind["Mask&bool_tensor"] = "bool_tensor"  # a bool tensor in the '&' (triton takes none)
    kind = kind.get(form, "causal&padding")
    q, k, v = make_qkv(B, 4, Sq, 8, Hkv=2, Sk=Sk, dtype=dtype, seed=29)
    check_backend(backend, q, k, v, cap=dict(mask=kind, dtype=dtype), grad=grad, mask=mask)


def _score_forms(table: torch.Tensor, q_offset: int):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[b, h, q_idx - q_offset, kv_idx]

    return {"tensor": table, "ScoreMod": scores.bias(table), "callable": score_mod}


def test_score_mod_forms_are_interchangeable_on_reference():
    q, k, v = make_qkv(2, 3, 5, 8, Sk=9, dtype=torch.float64, seed=30)
    table = torch.randn(2, 3, 5, 9, generator=gen(30), dtype=torch.float64)
    forms = _score_forms(table, q_offset=4)
    outs = [selfattn.attention(q, k, v, score_mod=m, backend="reference") for m in forms.values()]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    s = q @ k.transpose(-1, -2) / math.sqrt(8) + table
    torch.testing.assert_close(outs[0], torch.softmax(s, -1) @ v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["tensor", "ScoreMod", "callable"])
def test_score_mod_forms(backend, form):
    q, k, v = make_qkv(2, 4, 5, 16, Hkv=2, Sk=9, dtype=torch.float32, seed=31)
    table = torch.randn(2, 4, 5, 9, generator=gen(31))
    mod = _score_forms(table, q_offset=4)[form]
    _, grad = grad_dtype(backend)
    kind = "tensor" if form != "callable" else "callable"
    cap = dict(mask="causal", score=kind)
    check_backend(backend, q, k, v, cap=cap, grad=grad, score_mod=mod, mask=masks.causal())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["tensor", "t5"])
def test_score_mod_tensor_gradients(backend, kind):
    """Gradients reach the tensors a score mod reads: a bias tensor, T5's bucket table."""
    B, Hq, Sq, Sk = 2, 4, 6, 9
    q, k, v = make_qkv(B, Hq, Sq, 16, Hkv=2, Sk=Sk, seed=40, requires_grad=True)
    if kind == "tensor":
        mod = torch.randn(1, Hq, Sq, Sk, generator=gen(40), requires_grad=True)
        mod64 = mod.detach().double().requires_grad_(True)
        leaf, leaf64 = mod, mod64
    else:
        mod = build_score_mod("t5", B, Hq, Sq, Sk, gen(40)).requires_grad_(True)
        mod64 = copy.deepcopy(mod).double()
        leaf, leaf64 = mod.weight, mod64.weight
    must = backend in ("reference", "chunked", "auto")
    out = run_or_skip(backend, must, q, k, v, mask=masks.causal(), score_mod=mod)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    o64 = selfattn.attention(q64, k64, v64, mask=masks.causal(), score_mod=mod64)
    naive = selfattn.attention(q, k, v, mask=masks.causal(), score_mod=mod, backend="reference")
    dout = torch.randn(out.shape, generator=gen(41))
    (g,) = torch.autograd.grad(out, (leaf,), dout)
    (g64,) = torch.autograd.grad(o64, (leaf64,), dout.double())
    (gn,) = torch.autograd.grad(naive, (leaf,), dout)
    assert bool(g.abs().sum() > 0)
    assert_close_to_reference(g, g64, gn, factor=3.0, what=f"d{kind}")


# -- external parity: torch's scaled_dot_product_attention -----------------------------------------
SDPA_PARITY = {
    "no_mask": dict(),
    "is_causal": dict(causal=True),
    "is_causal_Sq<Sk_top_left": dict(causal=True, Sq=5),
    "bool_mask": dict(bool_mask=True),
    "float_mask": dict(float_mask=True),
    "enable_gqa": dict(Hkv=2),
    "scale": dict(scale=0.3, float_mask=True, Hkv=1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", list(SDPA_PARITY))
def test_reference_matches_torch_sdpa(name, dtype):
    c = {"Sq": 11, "Hkv": 4, "scale": None, **SDPA_PARITY[name]}
    B, Hq, Sk, D = 2, 4, 11, 16
    Sq, Hkv = c["Sq"], c["Hkv"]
    g = gen(32)
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, Dv=10, dtype=dtype, seed=32)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    torch_kw, ours = {"scale": c["scale"], "enable_gqa": Hkv != Hq}, {"scale": c["scale"]}
    if c.get("causal"):
        torch_kw["is_causal"] = True
        # torch's is_causal is top-left aligned: our causal() with q_offset=0
        ours.update(mask=masks.causal(), q_offset=0)
    if c.get("bool_mask"):
        allowed = torch.rand(B, 1, Sq, Sk, generator=g) < 0.6
        allowed[..., 0] = True  # torch and we agree on empty rows only since torch 2.5
        torch_kw["attn_mask"], ours["mask"] = allowed, allowed
    if c.get("float_mask"):
        bias = torch.randn(B, Hq, Sq, Sk, generator=g, dtype=dtype)
        torch_kw["attn_mask"], ours["score_mod"] = bias, bias
    want = F.scaled_dot_product_attention(q, k, v, **torch_kw)
    got = selfattn.attention(q, k, v, backend="reference", **ours)
    torch.testing.assert_close(got, want)
    dout = torch.randn(want.shape, generator=g, dtype=dtype)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)
    ):
        torch.testing.assert_close(a, b)


# -- the seed's worked example ---------------------------------------------------------------------
def _worked_example(dtype):
    q = torch.tensor([1.0, 0.0], dtype=dtype).view(1, 1, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=dtype).view(1, 1, 3, 2)
    v = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=dtype).view(1, 1, 3, 2)
    return q, k, v


def _expected(score_factor: float):
    """Weights and output of the worked example, from math.exp (scores 1, 0, 1 over sqrt(2))."""
    s = [score_factor * x / math.sqrt(2) for x in (1.0, 0.0, 1.0)]
    e = [math.exp(x) for x in s]
    w = [x / sum(e) for x in e]
    vals = [(1.0, 0.0), (0.0, 2.0), (1.0, 1.0)]
    out = [sum(w[j] * vals[j][c] for j in range(3)) for c in range(2)]
    return w, out


@pytest.mark.parametrize("backend", BACKENDS)
def test_worked_example(backend):
    dtype, grad = grad_dtype(backend)
    q, k, v = _worked_example(dtype)
    w, out = _expected(1.0)
    assert [round(x, 3) for x in w] == [0.401, 0.198, 0.401]  # the seed's rounded numbers
    assert [round(x, 2) for x in out] == [0.80, 0.80]
    got = run_or_skip(backend, required(backend, dtype=dtype), q, k, v)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else {}
    torch.testing.assert_close(got.view(2), torch.tensor(out, dtype=dtype), **tol)
    torch.testing.assert_close(
        selfattn.attention_weights(q, k, v).view(3), torch.tensor(w, dtype=dtype), **tol
    )
    # causal with the query at position 0 (q_offset=0): it sees only itself, output = v1
    causal = selfattn.attention(q, k, v, mask=masks.causal(), q_offset=0, backend=backend)
    torch.testing.assert_close(causal.view(2), v[0, 0, 0], **tol)
    # scores x10 saturate the softmax to about [0.5, 0, 0.5]
    w10, out10 = _expected(10.0)
    assert abs(w10[0] - 0.5) < 1e-3 and w10[1] < 1e-3
    got10 = selfattn.attention(q * 10, k, v, backend=backend)
    torch.testing.assert_close(got10.view(2), torch.tensor(out10, dtype=dtype), **tol)
    if not grad:
        return
    # ... and the gradient through the near-zero weight almost vanishes: for L = out . g,
    # dL/dk_j = scale * w_j * (g . v_j - g . out) * q, exact from the same numbers.
    g = (0.3, -1.1)
    for factor in (1.0, 10.0):
        wf, outf = _expected(factor)
        qf = (q * factor).detach().requires_grad_(True)
        kk = k.detach().requires_grad_(True)
        res = selfattn.attention(qf, kk, v, backend=backend)
        (dk,) = torch.autograd.grad(res, (kk,), torch.tensor(g, dtype=dtype).view(res.shape))
        vals = [(1.0, 0.0), (0.0, 2.0), (1.0, 1.0)]
        gout = g[0] * outf[0] + g[1] * outf[1]
        for j in range(3):
            coef = wf[j] * (g[0] * vals[j][0] + g[1] * vals[j][1] - gout) / math.sqrt(2)
            want = torch.tensor([coef * factor, 0.0], dtype=dtype)
            torch.testing.assert_close(dk[0, 0, j], want, **tol)


# -- explain and backend selection -----------------------------------------------------------------
def test_explain_names_the_choice_and_a_reason_for_every_other_backend():
    q, k, v = make_qkv(2, 4, 7, 16, Hkv=2, Sk=9, seed=33)
    ex = backends.explain(q, k, v, mask=masks.causal(), print_table=False)
    names = backends.names()
    assert ex.chosen in names and ex.why
    assert set(ex.reasons) == set(names)
    assert ex.reasons[ex.chosen] is None, "auto must pick a backend that accepts the case"
    text = str(ex)
    assert ex.chosen in text.splitlines()[0]
    for name in names:
        if name == ex.chosen:
            continue
        line = next((ln for ln in text.splitlines() if ln.split()[:1] == [name]), None)
        assert line is not None and len(line.split()) > 1, f"no reason given for {name}"
    # auto runs exactly what explain says it picks
    auto = selfattn.attention(q, k, v, mask=masks.causal())
    assert torch.equal(auto, selfattn.attention(q, k, v, mask=masks.causal(), backend=ex.chosen))


def test_explain_prints_by_default(capsys):
    q, k, v = make_qkv(1, 2, 3, 8, seed=34)
    ex = backends.explain(q, k, v)
    assert str(ex) in capsys.readouterr().out


def test_explain_never_picks_a_backend_that_rejects_dropout_or_grads():
    q, k, v = make_qkv(2, 4, 7, 16, Hkv=2, Sk=9, seed=35, requires_grad=True)
    ex = backends.explain(q, k, v, dropout_p=0.2, generator=gen(0), print_table=False)
    qq, kk, vv, call = prepare(q, k, v, dropout_p=0.2, generator=gen(0))
    assert backends.get(ex.chosen).reject(qq, kk, vv, call) is None


def test_unknown_backend_lists_the_names():
    q, k, v = make_qkv(1, 2, 3, 8, seed=36)
    with pytest.raises(ValueError, match="nonexistent") as err:
        selfattn.attention(q, k, v, backend="nonexistent")
    for name in REGISTERED:
        assert name in str(err.value)


def test_unknown_backend_is_rejected_even_for_empty_inputs():
    q, k, v = make_qkv(1, 2, 3, 8, Sk=0, seed=37)
    with pytest.raises(ValueError, match="nonexistent"):
        selfattn.attention(q, k, v, backend="nonexistent")


def test_forcing_a_backend_that_rejects_the_case_raises_its_reason():
    q, k, v = make_qkv(2, 4, 7, 16, Hkv=2, Sk=9, seed=38, requires_grad=True)
    candidates = [
        ("flex", dict(mask=masks.causal())),  # flex has no backward on CPU
        ("sdpa", dict(dropout_p=0.3)),  # sdpa's dropout is not the counter-based one
        ("sdpa", dict(score_mod=scores.softcap(5.0))),  # not expressible as an additive mask
    ]
    forced = 0
    for name, kw in candidates:
        reason = rejection(name, q, k, v, **kw)
        if reason is None:
            continue
        forced += 1
        with pytest.raises(ValueError) as err:
            selfattn.attention(q, k, v, backend=name, generator=gen(0), **kw)
        assert name in str(err.value) and reason in str(err.value)
    assert forced, "expected at least one of these cases to be outside a backend's capability"
