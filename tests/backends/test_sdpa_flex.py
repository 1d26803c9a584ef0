"""The sdpa and flex backends: parity with the reference (ratio rule) and with PyTorch's own
``scaled_dot_product_attention`` / FlexAttention, empty rows, NaN guards, paths and reasons.

FlexAttention compiles on CPU (seconds per new mask, dtype or head dim), so the flex tests share
one geometry and few masks, and each test does everything it needs from one compiled kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import selfattn
from selfattn import backends, masks, scores
from selfattn.backends import flex as flex_backend
from selfattn.backends import sdpa as sdpa_backend
from selfattn.call import prepare
from selfattn.testing import (
    assert_close_to_reference,
    check_against_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)

DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reason(name: str, q, k, v, **kw) -> str | None:
    qq, kk, vv, call = prepare(q, k, v, **kw)
    return backends.get(name).reject(qq, kk, vv, call)


# ================================================================================================
# sdpa
# ================================================================================================


def _sdpa(q, k, v, return_lse=False, **kw):
    """``attention(backend="sdpa")`` for ``check_against_reference``.

    The output (and its gradients) comes from a plain call; the lse from a separate no-grad call
    with ``return_lse`` (the CPU flash kernel's lse has no gradients). Where sdpa cannot return
    an lse (``D != Dv``) the reference's is handed back, so only out and grads are checked.
    """
    out = selfattn.attention(q, k, v, backend="sdpa", **kw)
    if q.shape[-1] == v.shape[-1]:
        with torch.no_grad():
            _, lse = selfattn.attention(q, k, v, backend="sdpa", return_lse=True, **kw)
    else:
        lse = reference_attention(q, k, v, **kw)[1].to(torch.float32)
    return (out, lse) if return_lse else out


def _sdpa_mask(name: str, B, Hq, Sq, Sk, g):
    if name == "none":
        return None
    if name == "causal":
        return masks.causal()
    if name == "window":
        return masks.sliding_window(3)
    if name == "padding":
        return masks.padding(torch.randint(1, Sk + 1, (B,), generator=g))
    if name == "per_head_tensor":  # varies over b and h: no broadcast dims to keep
        return torch.rand(B, Hq, Sq, Sk, generator=g) > 0.4
    if name == "causal&documents":
        n = max(Sk, Sq)
        ids = torch.randint(0, 3, (n,), generator=g).sort().values
        return masks.causal() & masks.documents(ids)
    raise AssertionError(name)


def _sdpa_score(name: str, B, Hq, Sq, Sk, g):
    if name == "none":
        return None
    if name == "alibi":
        return scores.alibi(Hq)
    if name == "bias":
        return scores.bias(torch.randn(1, Hq, Sq, Sk, generator=g))
    if name == "t5":
        return scores.RelativePositionBias(Hq, num_buckets=8, max_distance=16)
    if name == "alibi+bias":
        return scores.alibi(Hq) >> scores.bias(torch.randn(B, 1, Sq, Sk, generator=g))
    raise AssertionError(name)


# (B, Hq, Hkv, Sq, Sk, D, Dv, q_offset): MHA, GQA, MQA; Sq < Sk, Sq > Sk, Sq == Sk; D != Dv (SDPA
# takes its math kernel then, and GQA is folded into rows instead of repeating K/V); decode.
SDPA_SHAPES = {
    "mha-7x7": (2, 3, 3, 7, 7, 8, 8, None),
    "gqa-5x13": (2, 6, 3, 5, 13, 16, 16, None),
    "mqa-11x6": (1, 4, 1, 11, 6, 8, 8, None),
    "gqa-dv-9x9": (2, 4, 2, 9, 9, 8, 12, None),
    "decode-1x17": (2, 4, 2, 1, 17, 8, 8, None),
    "topleft-6x10": (1, 2, 2, 6, 10, 8, 8, 0),
    "h16-6x9": (1, 16, 4, 6, 9, 8, 8, None),  # ALiBi slopes that are not powers of two
}
SDPA_CASES = [
    # (shape, mask, score, dtype): every mask, score and dtype at least twice, across shapes
    ("mha-7x7", "none", "none", "fp64"),
    ("mha-7x7", "causal", "alibi", "fp32"),
    ("mha-7x7", "per_head_tensor", "bias", "bf16"),
    ("gqa-5x13", "causal", "none", "fp16"),
    ("gqa-5x13", "window", "t5", "fp64"),
    ("gqa-5x13", "padding", "alibi+bias", "fp32"),
    ("mqa-11x6", "causal", "none", "fp32"),  # rows 0..4 see no key: output 0, lse -inf
    ("mqa-11x6", "window", "alibi", "bf16"),
    ("gqa-dv-9x9", "causal", "none", "fp32"),
    ("gqa-dv-9x9", "padding", "bias", "fp64"),
    ("gqa-dv-9x9", "per_head_tensor", "none", "fp16"),
    ("decode-1x17", "causal", "alibi", "bf16"),
    ("decode-1x17", "window", "none", "fp64"),
    ("topleft-6x10", "causal", "none", "fp16"),
    ("topleft-6x10", "causal&documents", "t5", "fp32"),
    ("topleft-6x10", "none", "bias", "bf16"),
    ("h16-6x9", "causal", "alibi", "fp64"),
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=["-".join(c) for c in SDPA_CASES])
def test_sdpa_matches_reference(case):
    shape, mask_name, score_name, dtype_name = case
    B, Hq, Hkv, Sq, Sk, D, Dv, q_offset = SDPA_SHAPES[shape]
    seed = SDPA_CASES.index(case)
    g = _gen(seed)
    q, k, v = make_qkv(
        B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, Dv=Dv, dtype=DTYPES[dtype_name], seed=seed,
        contiguous=seed % 2 == 0,  # odd cases: strided views of a fused QKV, V stored transposed
    )  # fmt: skip
    kw = dict(
        mask=_sdpa_mask(mask_name, B, Hq, Sq, Sk, g),
        score_mod=_sdpa_score(score_name, B, Hq, Sq, Sk, g),
        q_offset=q_offset,
    )
    assert _reason("sdpa", q, k, v, **kw) is None
    check_against_reference(_sdpa, q, k, v, **kw)
    if D == Dv:  # the output of the lse kernel path too (strided inputs included)
        with torch.no_grad():
            fn = functools.partial(selfattn.attention, backend="sdpa")
            check_against_reference(fn, q, k, v, grad=False, **kw)


def _dense_for_torch(Sq, Sk, q_offset, kind):
    """The same masks written directly for torch SDPA, independently of selfattn.masks."""
    i = torch.arange(Sq).view(-1, 1) + q_offset
    j = torch.arange(Sk).view(1, -1)
    if kind == "causal":
        return j <= i
    if kind == "window4":
        return (j <= i) & (j > i - 4)
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "Sq,Sk,q_offset,kind",
    [(9, 9, 0, "causal"), (5, 12, 7, "causal"), (6, 11, 2, "causal"), (10, 10, 0, "window4")],
)
def test_sdpa_and_reference_match_torch_sdpa(Sq, Sk, q_offset, kind, dtype_name):
    """External parity: our sdpa backend and our reference against F.scaled_dot_product_attention
    called directly with an explicit mask (GQA written out with repeat_interleave, test only)."""
    dtype = DTYPES[dtype_name]
    B, Hq, Hkv, D = 2, 4, 2, 16
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=dtype, seed=Sq * 31 + Sk)
    mask = masks.causal() if kind == "causal" else masks.sliding_window(4)
    G = Hq // Hkv
    ours = selfattn.attention(q, k, v, mask=mask, q_offset=q_offset, backend="sdpa")
    ref = selfattn.attention(q, k, v, mask=mask, q_offset=q_offset, backend="reference")
    theirs = F.scaled_dot_product_attention(
        q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
        attn_mask=_dense_for_torch(Sq, Sk, q_offset, kind),
    )  # fmt: skip
    # one rounding of the output apart at most (bf16: 2^-8 relative)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(ours, theirs, **tol)
    torch.testing.assert_close(ref, theirs, **tol)
    # and the scores' log-sum-exp, written out
    _, lse = selfattn.attention(
        q, k, v, mask=mask, q_offset=q_offset, backend="sdpa", return_lse=True
    )
    s = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~_dense_for_torch(Sq, Sk, q_offset, kind), float("-inf"))
    if dtype == torch.float32:
        torch.testing.assert_close(lse.double(), s.logsumexp(-1), rtol=1e-5, atol=1e-5)
    else:
        # SDPA's CPU kernel may round bf16 scores (AVX2 machines do, AVX-512 ones did not): judge
        # it by the ratio rule against the lse computed naively in bf16.
        _, lse_naive, _ = naive_attention(q, k, v, mask=mask, q_offset=q_offset)
        assert_close_to_reference(lse, s.logsumexp(-1), lse_naive, dtype=torch.float32, what="lse")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("how", ["bool_rows", "bias_rows", "causal_sq_gt_sk"])
def test_sdpa_fully_masked_rows(how, dtype_name):
    """A row with no allowed key: output exactly 0, lse -inf, zero gradients, no NaN anywhere."""
    dtype = DTYPES[dtype_name]
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 9, 7, 8
    if how == "causal_sq_gt_sk":
        Sk = 5  # default bottom-right alignment: rows 0..3 sit before key 0
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=dtype, seed=5, requires_grad=True)
    empty_rows = torch.zeros(Sq, dtype=torch.bool)
    kw = {}
    if how == "bool_rows":
        m = torch.rand(B, 1, Sq, Sk, generator=_gen(1)) > 0.3
        m[:, :, ::3] = False
        empty_rows[::3] = True
        kw["mask"] = m
    elif how == "bias_rows":
        bias = torch.randn(1, Hq, Sq, Sk, generator=_gen(2))
        bias[:, :, 1::4] = float("-inf")
        empty_rows[1::4] = True
        kw["score_mod"] = bias
    else:
        kw["mask"] = masks.causal()
        empty_rows[: Sq - Sk] = True
    out = selfattn.attention(q, k, v, backend="sdpa", **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), f"NaN in {name}"
    assert (out[:, :, empty_rows] == 0).all()
    assert (dq[:, :, empty_rows] == 0).all()
    with torch.no_grad():
        _, lse = selfattn.attention(q, k, v, backend="sdpa", return_lse=True, **kw)
    assert (lse[:, :, empty_rows] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, ~empty_rows]).all()
    check_against_reference(_sdpa, q, k, v, **kw)


@pytest.mark.parametrize(
    "mask,q_offset",
    [
        (masks.padding([4, 9]), None),  # dense mask: unattended columns zeroed
        (masks.causal(), 0),  # is_causal: keys past the last query are sliced off
        (masks.causal() & masks.padding([6, 11]), None),
    ],
)
def test_sdpa_nan_in_unattended_kv_does_not_leak(mask, q_offset):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 6, 11, 8
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, seed=11)
    clean = selfattn.attention(q, k, v, mask=mask, q_offset=q_offset, backend="sdpa")
    allowed = mask.to_dense(Sq, Sk, B=B, H=Hq, q_offset=Sk - Sq if q_offset is None else q_offset)
    unattended = ~allowed.any(dim=2).view(B, Hkv, Hq // Hkv, Sk).any(dim=2)  # (B, Hkv, Sk)
    assert unattended.any()
    k2, v2 = k.clone(), v.clone()
    k2[unattended] = float("nan")
    v2[unattended] = float("inf")
    poisoned = selfattn.attention(q, k2, v2, mask=mask, q_offset=q_offset, backend="sdpa")
    assert not poisoned.isnan().any()
    torch.testing.assert_close(poisoned, clean, rtol=0, atol=1e-6)


def test_sdpa_routes_gradients_into_bias_tensors_and_t5_tables():
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 7, 9, 8
    q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, dtype=torch.float64, seed=13)
    bias = torch.randn(1, Hq, Sq, Sk, dtype=torch.float64, generator=_gen(3))
    t5 = scores.RelativePositionBias(Hq, num_buckets=8, max_distance=16).double()
    dout = torch.randn(B, Hq, Sq, D, dtype=torch.float64, generator=_gen(4))
    grads = {}
    for name in ("sdpa", "reference"):
        b = bias.clone().requires_grad_(True)
        t5.zero_grad()
        out = selfattn.attention(
            q, k, v, mask=masks.causal(), score_mod=scores.bias(b) >> t5, backend=name
        )
        out.backward(dout)
        grads[name] = (b.grad, t5.weight.grad.clone())
    torch.testing.assert_close(grads["sdpa"][0], grads["reference"][0])
    torch.testing.assert_close(grads["sdpa"][1], grads["reference"][1])
    assert grads["sdpa"][0].abs().sum() > 0 and grads["sdpa"][1].abs().sum() > 0


@pytest.fixture
def sdpa_spy(monkeypatch):
    """Record the keyword arguments sdpa passes to F.scaled_dot_product_attention."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((tuple(q.shape), tuple(k.shape), kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(sdpa_backend.F, "scaled_dot_product_attention", spy)
    return seen


def test_sdpa_paths(sdpa_spy):
    """Which SDPA arguments each case becomes (the fused-kernel-friendly ones where possible)."""
    B, Hq, Hkv, D = 2, 4, 2, 8

    def call(Sq, Sk, Dv=D, **kw):
        sdpa_spy.clear()
        q, k, v = make_qkv(B, Hq, Sq, D, Hkv=Hkv, Sk=Sk, Dv=Dv, seed=Sq + Sk)
        selfattn.attention(q, k, v, backend="sdpa", **kw)
        (qs, ks, args), = sdpa_spy  # fmt: skip
        return qs, ks, args

    # top-left causal is SDPA's own is_causal; keys past the last query are dropped
    qs, ks, a = call(6, 10, mask=masks.causal(), q_offset=0)
    assert a["is_causal"] and a["attn_mask"] is None and ks[2] == 6 and a["enable_gqa"]
    # one decode step sees every key: no mask at all
    _, _, a = call(1, 10, mask=masks.causal())
    assert a["attn_mask"] is None and not a["is_causal"]
    # key padding: a dense bool mask whose query and head dims stay broadcast
    _, _, a = call(5, 7, mask=masks.padding([3, 7]))
    m = a["attn_mask"]
    assert m.dtype == torch.bool and m.shape[:2] == (2, 1) and m.stride(2) == 0
    # an additive score mod: a float mask, -inf where the mask forbids
    _, _, a = call(5, 7, mask=masks.causal(), score_mod=scores.alibi(Hq))
    assert a["attn_mask"].dtype == torch.float32 and a["attn_mask"].isneginf().any()
    # D != Dv sends SDPA to its math kernel, which would repeat K/V for GQA: rows are folded
    qs, ks, a = call(5, 7, Dv=12, mask=masks.causal())
    assert qs == (B, Hkv, (Hq // Hkv) * 5, D) and "enable_gqa" not in a
    assert a["attn_mask"].shape[-2:] == ((Hq // Hkv) * 5, 7)


def test_sdpa_lower_right_causal_matches_reference():
    """q_offset == Sk - Sq > 0 (a chunk of new queries over a cache) uses causal_lower_right."""
    if sdpa_backend._lower_right_bias() is None:
        pytest.skip("this torch has no torch.nn.attention.bias.causal_lower_right")
    q, k, v = make_qkv(2, 3, 5, 16, Sk=12, seed=17)
    check_against_reference(_sdpa, q, k, v, mask=masks.causal())


def test_sdpa_reject_reasons():
    q, k, v = make_qkv(2, 4, 5, 8, Hkv=2, Sk=7, seed=19, requires_grad=True)
    assert "counter-based" in _reason("sdpa", q, k, v, dropout_p=0.2, generator=_gen(0))
    assert "softcap" in _reason("sdpa", q, k, v, score_mod=scores.softcap(3.0))

    def mod(s, b, h, qi, kv):
        return s * 2

    assert "not additive" in _reason("sdpa", q, k, v, score_mod=mod)
    assert "without gradients" in _reason("sdpa", q, k, v, return_lse=True)
    with torch.no_grad():
        assert _reason("sdpa", q, k, v, return_lse=True) is None
        qd, kd, vd = make_qkv(2, 4, 5, 8, Hkv=2, Sk=7, Dv=6, seed=19)
        assert "D == Dv (got D=8, Dv=6)" in _reason("sdpa", qd, kd, vd, return_lse=True)
    expl = backends.explain(q, k, v, score_mod=scores.softcap(3.0), print_table=False)
    assert "softcap" in expl.reasons["sdpa"]
    with pytest.raises(ValueError, match="not additive"):
        selfattn.attention(q, k, v, score_mod=scores.softcap(3.0), backend="sdpa")


# ================================================================================================
# flex
# ================================================================================================

needs_flex = pytest.mark.skipif(
    flex_backend._api() is None or flex_backend._cpu_reason() is not None,
    reason="this torch / CPU cannot run FlexAttention",
)

# One geometry for all compiled flex runs: 2 query blocks (one ragged) x 3 key blocks (ragged),
# GQA 2, Sq < Sk so that the default q_offset is positive.
FB, FHQ, FHKV, FSQ, FSK, FD = 2, 4, 2, 150, 290, 16


def _flex_masks():
    g = _gen(23)
    ids = torch.randint(0, 5, (FSK,), generator=g).sort().values
    table = torch.rand(FB, 1, FSQ, FSK, generator=g) > 0.5
    table[1, :, 7::11] = False  # some rows with no key at all
    return {
        "causal": masks.causal(),
        "window37+alibi": masks.sliding_window(37),
        "documents&causal+softcap": masks.documents(ids) & masks.causal(),
        "padding": masks.padding([100, 0]),  # sequence 1 has no key: every row empty
        "mask_mod": lambda b, h, q, kv: ((q - kv) % 3 == 0) | (kv == h),
        "tensor": masks.from_tensor(table),
    }


def _flex_score(name):
    if name == "window37+alibi":
        return scores.alibi(FHQ)
    if name == "documents&causal+softcap":
        return scores.softcap(4.0)
    return None


def _direct_flex(q, k, v, mask, score_mod, q_offset):
    """FlexAttention called directly with create_block_mask on the same mask_mod (row indices)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = masks.as_mask(mask).bind(q_offset)  # as attention() binds it: absolute positions
    off = torch.tensor(q_offset)
    mm = flex_backend._wrapped_mask_mod(mask, off)
    # batch / head dims as in our BlockMask (1 where the mask does not vary), so that both
    # calls share one compiled kernel; the blocks themselves come from create_block_mask.
    ours = flex_backend._block_masks.get(mask, FB, FHQ, q.shape[2], k.shape[2], q_offset, "cpu")
    B, H = ours.kv_num_blocks.shape[:2]
    bm = create_block_mask(mm, B, H, q.shape[2], k.shape[2], device="cpu")
    sm = None if score_mod is None else flex_backend._wrapped_score_mod(score_mod, off)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return flex_backend._compiled()(
        q, k, v, block_mask=bm, score_mod=sm, scale=scale, enable_gqa=True
    )


@needs_flex
@pytest.mark.parametrize("name", list(_flex_masks()))
def test_flex_matches_reference_and_flexattention(name):
    """Forward (CPU has no flex backward) against the reference by the ratio rule, against
    FlexAttention with create_block_mask on the same mask_mod, and NaN in unattended keys."""
    mask, score_mod = _flex_masks()[name], _flex_score(name)
    q, k, v = make_qkv(FB, FHQ, FSQ, FD, Hkv=FHKV, Sk=FSK, seed=29)

    def fn(q, k, v, return_lse=False, **kw):  # CPU flex has no lse: hand back the reference's
        out = selfattn.attention(q, k, v, backend="flex", **kw)
        return (out, reference_attention(q, k, v, **kw)[1].float()) if return_lse else out

    kw = dict(mask=mask, score_mod=score_mod)
    with torch.no_grad():
        assert _reason("flex", q, k, v, **kw) is None
        check_against_reference(fn, q, k, v, grad=False, **kw)
        ours = selfattn.attention(q, k, v, backend="flex", **kw)
        direct = _direct_flex(q, k, v, mask, score_mod, FSK - FSQ)
        torch.testing.assert_close(ours, direct, rtol=1e-5, atol=1e-6)
        assert not ours.isnan().any()

        # rows with no allowed key are exactly 0
        allowed = masks.as_mask(mask).to_dense(FSQ, FSK, B=FB, H=FHQ)
        assert (ours.masked_select(~allowed.any(-1, keepdim=True)) == 0).all()

        # NaN/Inf in keys no query attends (inside partial blocks too) must not leak
        unattended = ~allowed.any(dim=2).view(FB, FHKV, FHQ // FHKV, FSK).any(dim=2)
        if unattended.any():
            k2, v2 = k.clone(), v.clone()
            k2[unattended] = float("inf")
            v2[unattended] = float("nan")
            poisoned = selfattn.attention(q, k2, v2, backend="flex", **kw)
            torch.testing.assert_close(poisoned, ours, rtol=0, atol=1e-6)


@needs_flex
def test_flex_new_q_offset_and_low_precision():
    """Other q_offsets (no recompile: the offset lives in a tensor), then bf16 with D != Dv."""
    with torch.no_grad():
        q, k, v = make_qkv(FB, FHQ, FSQ, FD, Hkv=FHKV, Sk=FSK, seed=31)
        for q_offset in (0, 57):
            check_against_reference(
                _flex_with_reference_lse,
                q,
                k,
                v,
                grad=False,
                mask=masks.causal(),
                q_offset=q_offset,
            )
        q, k, v = make_qkv(FB, FHQ, FSQ, FD, Hkv=FHKV, Sk=FSK, Dv=2 * FD, dtype=torch.bfloat16)
        check_against_reference(
            _flex_with_reference_lse, q, k, v, grad=False, mask=masks.sliding_window(64)
        )


def _flex_with_reference_lse(q, k, v, return_lse=False, **kw):
    out = selfattn.attention(q, k, v, backend="flex", **kw)
    return (out, reference_attention(q, k, v, **kw)[1].float()) if return_lse else out


def _block_layout(bm):
    """(partial, full) bool block layouts ``(B', H', n_q, n_k)`` of a BlockMask."""

    def dense(num, idx):
        n_k = idx.shape[-1]
        sel = torch.arange(n_k).view(1, 1, 1, -1) < num.unsqueeze(-1)
        out = torch.zeros(*idx.shape[:-1], n_k, dtype=torch.bool)
        out.scatter_(-1, idx.long(), sel)
        return out

    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    return dense(bm.kv_num_blocks, bm.kv_indices), full


@pytest.mark.skipif(flex_backend._api() is None, reason="this torch has no FlexAttention")
@pytest.mark.parametrize(
    "name,Sq,Sk,q_offset,block",
    [
        ("causal", 97, 97, None, 16),
        ("causal", 37, 200, None, 32),
        ("causal", 200, 37, None, 32),  # Sq > Sk: leading rows empty
        ("window", 130, 130, 0, 16),
        ("chunked", 100, 131, 3, 16),
        ("documents", 90, 90, None, 16),  # per-batch ids
        ("prefix&padding", 64, 99, None, 16),
        ("block_sparse_heads", 96, 96, None, 16),  # per-head layout
        ("tensor_heads", 33, 47, None, 8),  # per-(b, h) bool table
        ("mask_mod", 1, 77, None, 16),
    ],
)
def test_flex_block_mask_equals_create_block_mask(name, Sq, Sk, q_offset, block):
    """Our BlockMask (from tile classification) has the blocks create_block_mask finds.

    create_block_mask pads the ragged last tiles with False, so it never calls them FULL; ours
    may. Everywhere else partial and full blocks agree exactly, and the union everywhere.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    B, H = 2, 3
    g = _gen(sum(map(ord, name)) + Sq)
    mask = {
        "causal": masks.causal(),
        "window": masks.sliding_window(21),
        "chunked": masks.chunked(24),
        "documents": masks.documents(torch.randint(0, 4, (B, Sq), generator=g).sort().values),
        "prefix&padding": masks.prefix_lm(20) & masks.padding([50, 99]),
        "block_sparse_heads": masks.block_sparse(torch.rand(H, 6, 6, generator=g) > 0.5, 16),
        "tensor_heads": masks.from_tensor(torch.rand(B, H, Sq, Sk, generator=g) > 0.3),
        "mask_mod": masks.as_mask(lambda b, h, q, kv: (kv % (h + 2)) == 0),
    }[name]
    off = Sk - Sq if q_offset is None else q_offset
    mask = mask.bind(off)  # as attention() binds it: absolute positions
    ours = flex_backend.build_block_mask(mask, B, H, Sq, Sk, off, "cpu", block=block)
    mm = flex_backend._wrapped_mask_mod(mask, torch.tensor(off))
    theirs = create_block_mask(mm, B, H, Sq, Sk, device="cpu", BLOCK_SIZE=block)
    assert ours.seq_lengths == (Sq, Sk)
    (op, of), (tp, tf) = _block_layout(ours), _block_layout(theirs)
    op, of = (t.expand_as(tp) for t in (op, of))
    torch.testing.assert_close(op | of, tp | tf)
    assert not (op & of).any()
    inner = (slice(None), slice(None), slice(0, Sq // block), slice(0, Sk // block))
    torch.testing.assert_close(of[inner], tf[inner])
    # the dense block view of each agrees as well (BlockMask.to_dense: partial | full)
    torch.testing.assert_close(ours.to_dense().bool().expand_as(tp), theirs.to_dense().bool())


@pytest.mark.skipif(flex_backend._api() is None, reason="this torch has no FlexAttention")
def test_flex_block_mask_cache():
    cache = flex_backend._BlockMaskCache(2)
    m1, m2 = masks.causal(), masks.sliding_window(5)
    a = cache.get(m1, 1, 2, 40, 50, 10, "cpu")
    assert cache.get(m1, 1, 2, 40, 50, 10, "cpu") is a  # same mask object and geometry
    assert cache.get(m1, 1, 2, 40, 50, 9, "cpu") is not a  # another q_offset
    assert cache.get(masks.causal(), 1, 2, 40, 50, 10, "cpu") is not a  # another mask object
    cache.get(m2, 1, 2, 40, 50, 10, "cpu")
    assert len(cache._entries) == 2  # bounded: the oldest entries went
    assert cache.get(m1, 1, 2, 40, 50, 10, "cpu") is not a
    # masks holding a bool tensor (new objects every call) are built, not kept
    t = masks.causal() & masks.from_tensor(torch.ones(40, 50, dtype=torch.bool))
    assert cache.get(t, 1, 2, 40, 50, 10, "cpu") is not cache.get(t, 1, 2, 40, 50, 10, "cpu")
    assert all(entry[0] is not t for entry in cache._entries.values())


def test_flex_reject_reasons():
    if flex_backend._api() is None:
        q, k, v = make_qkv(1, 2, 5, 16, seed=41)
        assert "FlexAttention" in _reason("flex", q, k, v)
        return
    q, k, v = make_qkv(2, 4, 5, 16, Hkv=2, Sk=7, seed=41, requires_grad=True)
    assert "counter-based" in _reason("flex", q, k, v, dropout_p=0.1, generator=_gen(0))
    q64, k64, v64 = make_qkv(1, 2, 5, 16, dtype=torch.float64, seed=43)
    assert "not torch.float64" in _reason("flex", q64, k64, v64)
    if flex_backend._cpu_reason() is not None:
        assert _reason("flex", q, k, v) == flex_backend._cpu_reason()
        return
    assert "no backward on CPU" in _reason("flex", q, k, v, mask=masks.causal())
    with torch.no_grad():
        assert _reason("flex", q, k, v, mask=masks.causal()) is None
        assert "log-sum-exp" in _reason("flex", q, k, v, return_lse=True)
    expl = backends.explain(q, k, v, mask=masks.causal(), print_table=False)
    assert "no backward on CPU" in expl.reasons["flex"]


@needs_flex
def test_flex_compile_failure_names_the_case():
    """A mask_mod that breaks only under torch.compile surfaces as a clear RuntimeError."""

    def fragile(b, h, q, kv):
        if torch.compiler.is_compiling():
            raise ValueError("this mask_mod cannot be compiled")
        return kv <= q

    q, k, v = make_qkv(1, 2, 8, 16, seed=47)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"flex backend failed.*mask_mod"):
        selfattn.attention(q, k, v, mask=fragile, backend="flex")


@needs_flex
def test_flex_falls_back_to_static_shapes(monkeypatch):
    """A case whose automatic-dynamic kernel fails to build is retried, and then started, with
    static shapes (torch 2.13's CPU template fails for some masks once sizes turn symbolic)."""
    calls = []

    def fake_compiled(mode=None, case=None):
        def fn(q, k, v, **kw):
            calls.append(mode)
            if mode is None:
                raise RuntimeError("dynamic-shape kernel failed to build")
            return q.new_zeros(*q.shape[:-1], v.shape[-1])

        return fn

    monkeypatch.setattr(flex_backend, "_compiled", fake_compiled)
    monkeypatch.setattr(flex_backend, "_STATIC_ONLY", set())
    q, k, v = make_qkv(1, 2, 5, 16, seed=53)
    with torch.no_grad():
        for _ in range(2):
            selfattn.attention(q, k, v, mask=masks.causal(), backend="flex")
        assert calls == [None, False, False]
        selfattn.attention(q, k, v, mask=masks.sliding_window(2), backend="flex")
        assert calls[3:] == [None, False]  # another mask: its own try


def test_auto_falls_back_when_flex_fails_to_compile(monkeypatch):
    """A flex compile failure (seen on an H200: NoValidChoicesError for some GQA shapes) makes
    backend="flex" raise BackendCompileError, flex then declines that case, and auto runs the
    next backend instead of failing."""
    if flex_backend._reject(*make_qkv(1, 2, 8, 16), backends.AttentionCall()) is not None:
        pytest.skip("FlexAttention cannot run on this machine")
    monkeypatch.setattr(flex_backend, "_FAILED", {})

    def broken(dynamic=None, case=None):
        def run(*args, **kwargs):
            raise RuntimeError("NoValidChoicesError: no choices")

        return run

    monkeypatch.setattr(flex_backend, "_compiled", broken)
    flex_first = dataclasses.replace(
        backends.get("flex"), cost=lambda *args: backends.Cost(0.0, "test: flex first")
    )
    monkeypatch.setitem(backends.registry()._backends, "flex", flex_first)
    q, k, v = make_qkv(1, 2, 9, 16, seed=3)
    with torch.no_grad():
        with pytest.raises(backends.BackendCompileError, match="NoValidChoicesError"):
            selfattn.attention(q, k, v, mask=masks.causal(), backend="flex")
        why = backends.explain(q, k, v, mask=masks.causal(), print_table=False).reasons["flex"]
        assert "failed to compile" in why
        out = selfattn.attention(q, k, v, mask=masks.causal())  # auto: flex declines now
    ref = selfattn.attention(q, k, v, mask=masks.causal(), backend="reference")
    torch.testing.assert_close(out, ref)
    monkeypatch.setattr(flex_backend, "_FAILED", {})
    with torch.no_grad():  # a fresh process state: auto tries flex and falls back on the spot
        out = selfattn.attention(q, k, v, mask=masks.causal())
    torch.testing.assert_close(out, ref)


def test_score_mod_to_device_keeps_identity():
    """Flex moves a mod's constant tensors to the inputs' device once (a compiled kernel cannot
    capture a tensor of another device); the same device gives the same object back."""
    a = scores.alibi(4)
    assert a.to("cpu") is a
    c = a >> scores.softcap(3.0)
    assert c.to("cpu") is c
    assert c.to(torch.device("cpu")) is c
