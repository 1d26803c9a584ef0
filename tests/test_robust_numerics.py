"""Non-finite values, rows a score mod empties and gradient precision, on every backend.

The rule (``selfattn/backends/_common.py``): a key a row does not attend (the mask removes it, or
the score mod gives it ``-inf``) never reaches that row; V at a key the row attends passes on in
IEEE arithmetic whatever its weight (as the C decode kernel does); NaN in a query row makes that
row NaN. A row the score mod leaves without a finite score is an empty row: output 0, lse ``-inf``,
zero gradients. CPU FlexAttention compiles per mask and score-mod code, so only a few cases run it.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import selfattn
from selfattn import masks
from selfattn.testing import make_qkv
from tests.test_attention import (
    BACKENDS,
    check_backend,
    forward_lse,
    gen,
    grad_dtype,
    required,
    run_or_skip,
)

NAN, INF = math.nan, math.inf
NO_FLEX = tuple(b for b in BACKENDS if b != "flex")


def _grads(out, inputs, seed):
    dout = torch.randn(out.shape, generator=gen(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, inputs, dout)


def _detached(*tensors, grad):
    return tuple(t.detach().requires_grad_(grad) for t in tensors)


# -- rows a score mod empties ----------------------------------------------------------------------
def _emptying_mod(kind: str, Hq: int, Sq: int, Sk: int):
    """A score mod leaving some rows without a finite score, and those rows as bool ``(Hq, Sq)``."""
    empty = torch.zeros(Hq, Sq, dtype=torch.bool)
    if kind == "callable":
        off = Sk - Sq  # absolute position of query row 0 (default bottom-right alignment)
        empty[:, 0] = True
        empty[1, 3] = True

        def gone(score, b, h, q_idx, kv_idx):
            return torch.where((q_idx == off) | ((h == 1) & (q_idx == off + 3)), -INF, score)

        return gone, empty
    bias = torch.randn(1, Hq, Sq, Sk, generator=gen(60))
    empty[0, 2] = empty[2, 0] = empty[3, Sq - 1] = True
    bias[0][empty] = -INF
    bias[0, 1, 4, ::2] = -INF  # a row partly at -inf stays an ordinary row
    return bias, empty


EMPTYING = [(b, "callable") for b in BACKENDS]
EMPTYING += [(b, kind) for b in NO_FLEX for kind in ("bias", "bias+dropout")]


@pytest.mark.parametrize("backend,kind", EMPTYING)
def test_rows_a_score_mod_empties_are_empty_rows(backend, kind):
    """A row whose every score the mod sends to -inf: output 0, lse -inf, zero gradients (of the
    bias too), never NaN; with dropout as well. Other rows follow the float64 reference."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 7, 9, 16
    dtype, grad = grad_dtype(backend)
    dropout = 0.3 if kind.endswith("dropout") else 0.0
    mod, empty = _emptying_mod(kind.split("+")[0], Hq, Sq, Sk)
    if isinstance(mod, torch.Tensor):
        mod = mod.to(dtype).requires_grad_(grad)
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=dtype, seed=61, requires_grad=grad)
    score = "callable" if kind == "callable" else "tensor"
    must = required(
        backend, score=score, dtype=dtype, grad=grad, dropout=dropout > 0, bias_grad=grad
    )

    def kw():  # a fresh generator per call: the same dropout pattern every time
        return dict(score_mod=mod, dropout_p=dropout, generator=gen(62))

    out = run_or_skip(backend, must, q, k, v, **kw())
    rows = empty.expand(B, Hq, Sq)
    assert not out.isnan().any()
    assert bool((out[rows] == 0).all()), "rows the score mod empties must give exactly 0"
    assert bool((out[~rows].abs().sum(-1) > 0).all())
    lse = forward_lse(backend, q, k, v, must=must, **kw())
    if lse is not None:
        assert bool((lse[rows] == -INF).all()), "rows the score mod empties must give lse -inf"
        assert bool(torch.isfinite(lse[~rows]).all())
    if grad:
        leaves = (q, k, v, mod) if isinstance(mod, torch.Tensor) else (q, k, v)
        grads = _grads(out, leaves, seed=63)
        for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
            assert bool(torch.isfinite(g).all()), f"{name} has non-finite values"
        assert bool((grads[0][rows] == 0).all()), "dq of emptied rows must be exactly 0"
        if len(grads) == 4:
            assert bool((grads[3][0][empty] == 0).all()), "dbias of emptied rows must be 0"
    if dropout:  # the same pairs dropped as the reference's for the same seed
        ref = selfattn.attention(q, k, v, backend="reference", **kw())
        torch.testing.assert_close(out, ref)
        return
    cap = dict(score=score, dtype=dtype)
    check_backend(backend, *_detached(q, k, v, grad=False), cap=cap, grad=grad, score_mod=mod)


# -- non-finite values and overflow at masked entries ----------------------------------------------
MASKED = [(b, kind) for b in NO_FLEX for kind in ("bias", "overflow")] + [("flex", "overflow")]


@pytest.mark.parametrize("backend,kind", MASKED)
def test_nonfinite_at_masked_entries_do_not_leak(backend, kind):
    """NaN/±Inf in bias entries the mask removes, and a float32 q·k overflowing at a masked
    entry, leave every row finite and as the float64 reference computes it."""
    B, Hq, Hkv, S, D = 2, 4, 2, 11, 16
    dtype, grad = grad_dtype(backend)
    # not a plain causal(): sdpa then builds a dense mask, which it adds to the scores
    mask = masks.causal() & masks.sliding_window(S - 2)
    q, k, v = make_qkv(B, Hq, S, D, Hkv=Hkv, dtype=dtype, seed=64)
    kw: dict = dict(mask=mask)
    cap: dict = dict(mask="causal", dtype=dtype)
    if kind == "bias":
        bias = torch.randn(1, Hq, S, S, generator=gen(65), dtype=dtype)
        masked = ~mask.to_dense(S, S, q_offset=0).view(1, 1, S, S).expand_as(bias)
        garbage = torch.tensor([NAN, INF, -INF], dtype=dtype)
        bias[masked] = garbage[torch.arange(int(masked.sum())) % 3]
        kw["score_mod"] = bias.requires_grad_(grad)
        cap["score"] = "tensor"
    else:  # |q_0 · k_5| overflows float32 (and row 0 does not attend key 5)
        dtype, grad = torch.float32, False
        q, k, v = (t.float() for t in (q, k, v))
        q[:, :, 0] = 1e20
        k[:, :, 5] = 1e20
        cap["dtype"] = dtype
    q, k, v = _detached(q, k, v, grad=grad)
    must = required(backend, grad=grad, bias_grad=grad, **cap)
    out = run_or_skip(backend, must, q, k, v, **kw)
    assert bool(torch.isfinite(out).all()), "a value at a masked entry leaked into the output"
    if grad:
        grads = _grads(out, (q, k, v, kw["score_mod"]), seed=66)
        for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
            assert bool(torch.isfinite(g).all()), f"{name} has non-finite values"
        assert bool((grads[3][masked] == 0).all()), "dbias at masked entries must be 0"
    check_backend(backend, *_detached(q, k, v, grad=False), cap=cap, grad=grad, **kw)


# -- NaN/Inf in K or V at a key only some rows attend ----------------------------------------------
KEYS = [(b, what) for b in NO_FLEX for what in ("v_nan", "v_inf", "k_nan")] + [("flex", "v_nan")]


@pytest.mark.parametrize("backend,what", KEYS)
def test_nonfinite_key_stays_out_of_rows_that_do_not_attend_it(backend, what):
    """Under causal(), NaN/Inf stored at key 5 leaves rows 0-4 as without it (output, lse, and dq
    for V), while rows 5.. see it: NaN in V gives NaN in that column, +Inf gives +Inf, NaN in K
    gives NaN rows. dV = Pᵀ dO does not depend on V, so it stays exact. (dQ = dS K multiplies
    every key's K by the row's dS, 0 where masked: NaN in K reaches every row's dq.)"""
    B, Hq, Hkv, S, D, j, d = 2, 4, 2, 11, 16, 5, 1
    dtype, grad = grad_dtype(backend)
    q, k, v = make_qkv(B, Hq, S, D, Hkv=Hkv, dtype=dtype, seed=67)
    k2, v2 = k.clone(), v.clone()
    if what == "k_nan":
        k2[:, :, j, d] = NAN
    else:
        v2[:, :, j, d] = NAN if what == "v_nan" else INF
    must = required(backend, mask="causal", dtype=dtype, grad=grad)
    q, k, v, k2, v2 = _detached(q, k, v, k2, v2, grad=grad)
    clean = run_or_skip(backend, must, q, k, v, mask=masks.causal())
    out = selfattn.attention(q, k2, v2, mask=masks.causal(), backend=backend)
    torch.testing.assert_close(out[:, :, :j], clean[:, :, :j])
    seen = out[:, :, j:]
    if what == "k_nan":
        assert bool(seen.isnan().all()), "rows attending a NaN key must be NaN"
    else:
        want = seen[..., d].isnan() if what == "v_nan" else seen[..., d] == INF
        assert bool(want.all()), f"rows attending key {j} must carry its {what[2:]}"
        others = [c for c in range(D) if c != d]
        torch.testing.assert_close(seen[..., others], clean[:, :, j:][..., others])
    lse = forward_lse(backend, q, k2, v2, must=must, mask=masks.causal())
    if lse is not None:
        lse_clean = forward_lse(backend, q, k, v, must=must, mask=masks.causal())
        if what == "k_nan":
            assert bool(lse[:, :, j:].isnan().all())
            lse, lse_clean = lse[:, :, :j], lse_clean[:, :, :j]
        torch.testing.assert_close(lse, lse_clean)  # the lse does not depend on V
    if not grad:
        return
    dq, _, dv = _grads(out, (q, k2, v2), seed=68)
    dq_c, _, dv_c = _grads(clean, (q, k, v), seed=68)
    assert not bool(torch.isfinite(dq[:, :, j:]).any()), "rows made non-finite need non-finite dq"
    if what != "k_nan":
        torch.testing.assert_close(dq[:, :, :j], dq_c[:, :, :j])
        torch.testing.assert_close(dv, dv_c)


@pytest.mark.parametrize("backend", NO_FLEX)
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_v_at_keys_the_score_mod_removes(backend, value):
    """A bias of -inf removes a key from a row like the mask: V stored there never reaches it.
    A finite bias so low that the weight underflows to 0 does not: the row still reads the key
    (0 · NaN = NaN, 0 · Inf = NaN), as the C decode kernel reads every key of a row's interval."""
    B, Hq, S, D, j, d = 2, 3, 9, 8, 5, 2
    dtype, grad = grad_dtype(backend)
    q, k, v = make_qkv(B, Hq, S, D, dtype=dtype, seed=69)
    bias = torch.randn(1, Hq, S, S, generator=gen(70), dtype=dtype)
    bias[..., :j, j] = -INF  # rows 0-4 do not attend key 5
    bias[..., 7, j] = -1e30  # row 7 attends it with weight 0
    v2 = v.clone()
    v2[:, :, j, d] = value
    must = required(backend, score="tensor", dtype=dtype, grad=grad)
    q, k, v, v2 = _detached(q, k, v, v2, grad=grad)
    clean = run_or_skip(backend, must, q, k, v, score_mod=bias)
    out = selfattn.attention(q, k, v2, score_mod=bias, backend=backend)
    torch.testing.assert_close(out[:, :, :j], clean[:, :, :j])
    col = out[:, :, j:, d]
    assert bool(col[:, :, 7 - j].isnan().all()), "a weight of 0 must still read the key"
    if value == INF:
        assert bool((col[:, :, [0, 1, 3]] == INF).all())
    else:
        assert bool(col.isnan().all())
    if grad:
        dq, _, dv = _grads(out, (q, k, v2), seed=71)
        dq_c, _, dv_c = _grads(clean, (q, k, v), seed=71)
        torch.testing.assert_close(dq[:, :, :j], dq_c[:, :, :j])
        torch.testing.assert_close(dv, dv_c)


# -- NaN in a query row ----------------------------------------------------------------------------
QUERIES = [(b, m) for b in NO_FLEX for m in ("none", "causal_Sq>Sk")] + [("flex", "none")]


@pytest.mark.parametrize("backend,mask_kind", QUERIES)
def test_nan_query_row_gives_a_nan_row(backend, mask_kind):
    """NaN in a query row gives that row NaN output and lse on every backend (SDPA's CPU kernel
    alone made it 0); other rows are untouched. A row with no key stays 0 / -inf."""
    B, Hq, Sq, D = 2, 4, 9, 16
    Sk = Sq if mask_kind == "none" else 6  # causal, bottom-right: rows 0-2 see no key
    mask = None if mask_kind == "none" else masks.causal()
    # float32: SDPA's CPU flash kernel (which made NaN rows 0) runs it; float64 takes its math one
    dtype, grad = torch.float32, required(backend, grad=True)
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=2, Sk=Sk, dtype=dtype, seed=72)
    q2 = q.clone()
    q2[:, :, 5, 3] = NAN
    if mask is not None:
        q2[:, :, 1, 0] = NAN  # a row with no key
    must = required(backend, mask="none" if mask is None else "causal", dtype=dtype, grad=grad)
    q, q2, k, v = _detached(q, q2, k, v, grad=grad)
    clean = run_or_skip(backend, must, q, k, v, mask=mask)
    out = selfattn.attention(q2, k, v, mask=mask, backend=backend)
    assert bool(out[:, :, 5].isnan().all()), "a NaN query row must give a NaN output row"
    rest = [r for r in range(Sq) if r != 5 and (mask is None or r != 1)]
    torch.testing.assert_close(out[:, :, rest], clean[:, :, rest])
    if mask is not None:
        assert bool((out[:, :, 1] == 0).all()), "a row with no key gives 0, NaN query or not"
    lse = forward_lse(backend, q2, k, v, must=must, mask=mask)
    if lse is not None:
        assert bool(lse[:, :, 5].isnan().all()), "a NaN query row must give a NaN lse"
        if mask is not None:
            assert bool((lse[:, :, 1] == -INF).all())
    if grad:
        dq = _grads(out, (q2,), seed=73)[0]
        dq_c = _grads(clean, (q,), seed=73)[0]
        torch.testing.assert_close(dq[:, :, rest], dq_c[:, :, rest])


# -- gradient precision on large scores ------------------------------------------------------------
@pytest.mark.parametrize("backend", NO_FLEX)
def test_gradients_on_large_scores(backend):
    """flash-attention's backward-overflow inputs (scores up to ~70): dq/dk/dv within the 3x of the
    naive float32 error that docs/testing.md promises (chunked's recomputation from one float32
    log-sum-exp gave 3.5-6.3x)."""
    q, k, v = make_qkv(2, 5, 128, 16, seed=80)
    q, k, v = q * 5, k * 3, v * 3
    cap = dict(mask="causal", dtype=torch.float32)
    check_backend(backend, q, k, v, cap=cap, grad=True, mask=masks.causal())


# -- sdpa: no lower-right causal bias with Sq > Sk -------------------------------------------------
@pytest.mark.parametrize("backend", NO_FLEX)
def test_causal_with_more_queries_than_keys_warns_nothing(backend):
    """Causal with Sq > Sk (the first rows see no key): no backend hands PyTorch the lower-right
    causal bias, which warns that it produces NaN there; the rows are 0 and the rest exact."""
    q, k, v = make_qkv(1, 2, 9, 16, Sk=5, seed=75)
    must = required(backend, mask="causal")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run_or_skip(backend, must, q, k, v, mask=masks.causal())
    assert bool((out[:, :, :4] == 0).all())
    check_backend(backend, q, k, v, cap=dict(mask="causal"), grad=True, mask=masks.causal())
