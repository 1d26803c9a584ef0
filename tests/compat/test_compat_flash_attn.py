"""``selfattn.compat.flash_attn`` against flash-attn's own reference semantics.

The oracle is written here from flash-attn's documentation, as its tests/test_flash_attn.py
``attention_ref`` does, independently of selfattn: layouts ``(B, S, H, D)``, K/V repeated for
GQA, scale then softcap, the local/causal mask aligned bottom-right (``i + Sk - Sq``), ALiBi
``-slope · |i + Sk - Sq - j|`` added after the mask, rows with no key giving 0. It runs in float64
(the oracle) and in the test dtype (the noise baseline of the ratio rule).
"""

from __future__ import annotations

import math

import pytest
import torch

import selfattn as sa
from selfattn.compat.flash_attn import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from selfattn.testing import GRAD_FACTOR, assert_close_to_reference
from tests._kernel_helpers import c_kernel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# -- the oracle ------------------------------------------------------------------------------------


def attention_ref(
    q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    softmax_scale=None, dtype=torch.float64,
):  # fmt: skip
    """flash-attn's documented attention for ``q (B, Sq, H, D)``, ``k/v (B, Sk, Hkv, ·)``:
    ``(out (B, Sq, H, Dv), lse (B, H, Sq))`` computed in ``dtype``."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    _, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    s = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq).view(-1, 1) + Sk - Sq  # query row i at position i + Sk - Sq
    j = torch.arange(Sk).view(1, -1)
    left, right = window_size[0], 0 if causal else window_size[1]
    keep = torch.ones(Sq, Sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).view(-1, H, 1, 1)  # (1 or B, H, 1, 1)
        s = s - slopes * (i - j).abs().to(dtype)
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row with no key
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # such a row: weights 0, output 0
    return torch.einsum("bhts,bshd->bthd", p, v), lse


def _ratio_check(got, leaves, ref_kw, *, grads=False, dtype, seed=7, what="out"):
    """``got`` (a function of ``leaves``) against the oracle and the naive baseline, built by
    ``ref_kw(dtype) -> tensor`` on fresh leaves; with ``grads`` also the leaves' gradients."""
    leaves64 = [t.detach().double().requires_grad_(grads) for t in leaves]
    leavesn = [t.detach().clone().requires_grad_(grads) for t in leaves]
    o64, on = ref_kw(leaves64, torch.float64), ref_kw(leavesn, dtype)
    lse = what == "lse"
    assert_close_to_reference(got, o64, on, dtype=torch.float32 if lse else dtype, what=what)
    if not grads:
        return
    dout = torch.randn(got.shape, generator=_gen(seed), dtype=torch.float64)
    g = torch.autograd.grad(got, leaves, dout.to(got.dtype))
    g64 = torch.autograd.grad(o64, leaves64, dout)
    gn = torch.autograd.grad(on, leavesn, dout.to(on.dtype))
    for name, a, o, n in zip(("dq", "dk", "dv"), g, g64, gn):
        assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, dtype=dtype, what=name)


# -- flash_attn_func ------------------------------------------------------------------------------

# (name, keywords for both sides, (Sq, Sk), (H, Hkv), D); alibi: the slopes' leading shape
CASES = [
    ("plain", {}, (37, 37), (3, 3), 40),
    ("causal_sq<sk", {"causal": True}, (23, 97), (6, 2), 59),
    ("causal_sq>sk", {"causal": True}, (61, 29), (4, 1), 40),  # leading rows see no key
    ("decode", {"causal": True}, (1, 97), (8, 2), 64),
    ("window", {"window_size": (13, 5)}, (59, 113), (6, 3), 40),
    ("window_left", {"window_size": (9, -1)}, (41, 41), (4, 2), 16),
    ("window_right", {"window_size": (-1, 4)}, (70, 33), (4, 4), 16),
    ("causal_window", {"causal": True, "window_size": (11, 7)}, (50, 77), (6, 2), 40),
    ("window_zero", {"window_size": (0, 0)}, (19, 31), (2, 1), 8),  # the diagonal only
    ("softcap", {"causal": True, "softcap": 2.0}, (33, 45), (4, 2), 40),
    ("alibi_h", {"causal": True, "alibi": "h"}, (47, 47), (6, 3), 40),
    ("alibi_bh", {"alibi": "bh"}, (29, 58), (4, 2), 40),
    ("everything", {"softmax_scale": 0.3, "window_size": (3, 6), "softcap": 1.5, "alibi": "h"},
     (31, 40), (4, 1), 24),
]  # fmt: skip


def _make(name, kw, Sq, Sk, H, Hkv, D, dtype, B=2, grad=False):
    g = _gen(sum(map(ord, name)) + Sq)
    q = _rand(g, B, Sq, H, D, dtype=dtype)
    k = _rand(g, B, Sk, Hkv, D, dtype=dtype)
    v = _rand(g, B, Sk, Hkv, D + 3, dtype=dtype)  # Dv != D
    kw = dict(kw)
    alibi = kw.pop("alibi", None)
    if alibi is not None:
        shape = (H,) if alibi == "h" else (B, H)
        kw["alibi_slopes"] = torch.rand(shape, generator=g) * 0.5  # fp32, as flash-attn wants
    return [t.requires_grad_(grad) for t in (q, k, v)], kw


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_attn_func_matches_flash_attn_semantics(case, dtype):
    name, kw, (Sq, Sk), (H, Hkv), D = case
    (q, k, v), kw = _make(name, kw, Sq, Sk, H, Hkv, D, dtype)
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert probs is None and out.is_contiguous()
    assert out.shape == (2, Sq, H, D + 3) and lse.shape == (2, H, Sq)
    ref = lambda t, dt: attention_ref(*t, dtype=dt, **kw)[0]  # noqa: E731
    _ratio_check(out, (q, k, v), ref, dtype=dtype)
    ref_lse = lambda t, dt: attention_ref(*t, dtype=dt, **kw)[1]  # noqa: E731
    _ratio_check(lse, (q, k, v), ref_lse, dtype=dtype, what="lse")
    # without the lse, auto may pick another kernel: checked on its own
    _ratio_check(flash_attn_func(q, k, v, **kw), (q, k, v), ref, dtype=dtype)


GRAD_CASES = ["causal_sq>sk", "causal_window", "window_right", "everything"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", GRAD_CASES)
def test_flash_attn_func_gradients(name, dtype):
    _, kw, (Sq, Sk), (H, Hkv), D = next(c for c in CASES if c[0] == name)
    (q, k, v), kw = _make(name, kw, Sq, Sk, H, Hkv, D, dtype, grad=True)
    out = flash_attn_func(q, k, v, **kw)
    ref = lambda t, dt: attention_ref(*t, dtype=dt, **kw)[0]  # noqa: E731
    _ratio_check(out, (q, k, v), ref, grads=True, dtype=dtype)


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["alibi", "softcap-then-alibi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_sequence_alibi_slopes_run_on_the_fused_kernel(dtype, softcap):
    """``alibi_slopes (B, H)``: the fused CPU kernel reads a row of slopes per sequence (it took
    ``(H,)`` only, and such calls ran on chunked), also after a soft cap (flash-attn caps
    first; the kernel capped last only); the Triton kernel names what it does not take."""
    from selfattn.kernels import fused_attention

    c_kernel(fused_attention)
    kw = {"causal": True, "window_size": (20, 0), "alibi": "bh", "softcap": softcap}
    (q, k, v), kw = _make("alibi_per_seq", kw, 37, 70, 6, 2, 40, dtype, B=3, grad=True)
    with sa.backends.use("cpu_fused"):
        out = flash_attn_func(q, k, v, **kw)
    ref = lambda t, dt: attention_ref(*t, dtype=dt, **kw)[0]  # noqa: E731
    _ratio_check(out, (q, k, v), ref, grads=True, dtype=dtype)
    slopes = kw["alibi_slopes"]
    same = dict(kw, alibi_slopes=slopes[0].expand_as(slopes).contiguous())
    with sa.backends.use("cpu_fused"):
        assert not torch.allclose(flash_attn_func(q, k, v, **same), out)  # each row is read
    report = sa.backends.explain(
        *(t.detach().transpose(1, 2) for t in (q, k, v)),
        score_mod=sa.compat.flash_attn._score_mod(0.0, slopes, 6, 3),
    )
    assert "one slope per head" in str(report)
    capped = sa.backends.explain(
        *(t.detach().transpose(1, 2) for t in (q, k, v)),
        score_mod=sa.compat.flash_attn._score_mod(5.0, slopes[0], 6, 3),
    )
    assert "soft cap comes before ALiBi" in str(capped)


def test_flash_attn_func_takes_strided_views_and_dropout():
    """q/k/v sliced from one fused projection (no copies needed); dropout follows selfattn's
    counter-based pattern: reproducible from torch's seed, the same as sa.attention's."""
    g = _gen(3)
    B, S, H, D = 2, 21, 4, 16
    qkv = _rand(g, B, S, 3 * H * D + 5)[..., 5:].view(B, S, 3, H, D)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = flash_attn_func(q, k, v, causal=True)
    ref = lambda t, dt: attention_ref(*t, causal=True, dtype=dt)[0]  # noqa: E731
    _ratio_check(out, (q, k, v), ref, dtype=torch.float32)
    torch.manual_seed(11)
    dropped = flash_attn_func(q, k, v, dropout_p=0.4, causal=True)
    torch.manual_seed(11)
    same = sa.attention(*(t.transpose(1, 2) for t in (q, k, v)), mask=sa.masks.causal(),
                        dropout_p=0.4).transpose(1, 2)  # fmt: skip
    assert torch.equal(dropped, same) and not torch.allclose(dropped, out)


# -- flash_attn_varlen_func ----------------------------------------------------------------------

# per sequence (Sq, Sk): empty, single-token, longer-than and shorter-than the keys
LENGTHS = [(5, 9), (0, 3), (17, 17), (1, 40), (30, 2), (12, 0)]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _varlen_ref(q, k, v, lens, alibi_slopes=None, dtype=torch.float64, **kw):
    """The oracle sequence by sequence: ``(out (total_q, H, Dv), lse (H, total_q))``."""
    outs, lses, rq, rk = [], [], 0, 0
    for s, (nq, nk) in enumerate(lens):
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[s]
        o, lse = attention_ref(
            q[None, rq : rq + nq], k[None, rk : rk + nk], v[None, rk : rk + nk],
            alibi_slopes=slopes, dtype=dtype, **kw,
        )  # fmt: skip
        outs.append(o[0])
        lses.append(lse[0])
        rq, rk = rq + nq, rk + nk
    return torch.cat(outs), torch.cat(lses, dim=-1)


VARLEN = [
    ("causal", {"causal": True}),
    ("plain", {}),
    ("window", {"window_size": (6, 2)}),
    ("alibi_softcap", {"causal": True, "softcap": 3.0, "alibi": "bh"}),
]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name,kw", VARLEN, ids=[c[0] for c in VARLEN])
def test_flash_attn_varlen_func_matches_per_sequence_semantics(name, kw, dtype):
    H, Hkv, D = 4, 2, 40
    g = _gen(len(name) + 100)
    Tq, Tk = sum(n for n, _ in LENGTHS), sum(n for _, n in LENGTHS)
    q, k = _rand(g, Tq, H, D, dtype=dtype), _rand(g, Tk, Hkv, D, dtype=dtype)
    v = _rand(g, Tk, Hkv, 24, dtype=dtype)
    kw = dict(kw)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand(len(LENGTHS), H, generator=g)
    grad = dtype != torch.float16  # gradients in fp32 and bf16
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    cu_q, cu_k = _cu([n for n, _ in LENGTHS]), _cu([n for _, n in LENGTHS])
    out, lse, probs = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 30, 40, return_attn_probs=True, **kw
    )
    assert probs is None and out.shape == (Tq, H, 24) and lse.shape == (H, Tq)
    ref = lambda t, dt: _varlen_ref(*t, LENGTHS, dtype=dt, **kw)[0]  # noqa: E731
    _ratio_check(out, (q, k, v), ref, grads=grad, dtype=dtype)
    with torch.no_grad():
        ref_lse = lambda t, dt: _varlen_ref(*t, LENGTHS, dtype=dt, **kw)[1]  # noqa: E731
        _ratio_check(lse.detach(), (q, k, v), ref_lse, dtype=dtype, what="lse")


def test_flash_attn_varlen_self_attention_equals_flash_attn_func():
    """Packed equal-length sequences (cu_seqlens_q == cu_seqlens_k) give each sequence's own
    flash_attn_func result, GQA included."""
    g = _gen(5)
    lens = [7, 31, 1, 16]
    q, k, v = _rand(g, 55, 8, 32), _rand(g, 55, 2, 32), _rand(g, 55, 2, 32)
    cu = _cu(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 31, 31, causal=True, window_size=(4, 0))
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        alone = flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=True,
                                window_size=(4, 0))  # fmt: skip
        torch.testing.assert_close(out[a:b], alone[0], rtol=2e-6, atol=2e-6)


def test_flash_attn_varlen_checks_cu_seqlens():
    q = k = v = torch.randn(10, 2, 8)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="never decrease"):
        flash_attn_varlen_func(
            q, k, v, torch.tensor([0, 6, 4, 10]), torch.tensor([0, 4, 4, 10]), 6, 6
        )
    with pytest.raises(ValueError, match=r"ends at 9 .* 10 tokens"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 4, 9]), good, 6, 6)
    with pytest.raises(ValueError, match=r"max_seqlen_k=5 is below the longest sequence \(6\)"):
        flash_attn_varlen_func(q, k, v, good, good, 6, 5)
    with pytest.raises(ValueError, match="3 entries but cu_seqlens_k has 2"):
        flash_attn_varlen_func(q, k, v, good, torch.tensor([0, 10]), 6, 10)
    with pytest.raises(TypeError, match="integer tensor"):
        flash_attn_varlen_func(q, k, v, good.float(), good, 6, 6)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache"):
        flash_attn_varlen_func(q, k, v, good, good, 6, 6, block_table=good.view(1, -1))


# -- flash_attn_with_kvcache -----------------------------------------------------------------------


def _cache_case(seed, *, B=3, Sq=1, S_new=1, H=4, Hkv=2, D=32, S_cache=40, dtype=torch.float32):
    g = _gen(seed)
    q = _rand(g, B, Sq, H, D, dtype=dtype)
    k_new, v_new = _rand(g, B, S_new, Hkv, D, dtype=dtype), _rand(g, B, S_new, Hkv, D, dtype=dtype)
    cached = torch.tensor([7, 0, 31][:B], dtype=torch.int32) + Sq  # each holds >= Sq keys
    return g, q, k_new, v_new, cached


def _kvcache_ref(q, seqs_k, seqs_v, dtype=torch.float64, alibi_slopes=None, **kw):
    """The oracle per sequence over its keys ``seqs_k[b] (S_b, Hkv, D)``: out ``(B, Sq, H, Dv)``
    and lse ``(B, H, Sq)``."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        slopes = None if alibi_slopes is None else alibi_slopes[b]
        o, lse = attention_ref(q[b : b + 1], seqs_k[b][None], seqs_v[b][None],
                               alibi_slopes=slopes, dtype=dtype, **kw)  # fmt: skip
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


KV_CASES = [
    ("decode_causal", {"causal": True}, 1),
    ("chunk_causal", {"causal": True}, 3),
    ("window", {"causal": True, "window_size": (5, 0)}, 3),
    ("two_sided", {"window_size": (6, 2)}, 2),
    ("alibi_softcap", {"causal": True, "softcap": 4.0, "alibi": True}, 2),
]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,kw,Sq", KV_CASES, ids=[c[0] for c in KV_CASES])
def test_flash_attn_with_kvcache_appends_in_place_and_attends(name, kw, Sq, dtype, paged):
    B, H, Hkv, D, P, S_cache = 3, 4, 2, 32, 8, 48
    g, q, k_new, v_new, cached = _cache_case(len(name), B=B, Sq=Sq, S_new=Sq, dtype=dtype)
    kw = dict(kw)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand(B, H, generator=g)
    cached = cached - Sq  # tokens before this step's Sq new ones
    if paged:
        n_blocks = S_cache // P
        k_cache = _rand(g, B * n_blocks + 2, P, Hkv, D, dtype=dtype)
        v_cache = _rand(g, B * n_blocks + 2, P, Hkv, D, dtype=dtype)
        table = torch.randperm(B * n_blocks + 2, generator=g)[: B * n_blocks].view(B, n_blocks)
        table = table.to(torch.int32)
        extra = {"block_table": table if dtype == torch.float32 else table.long()}  # any int

        def seq(cache, b, n):  # the first n tokens of sequence b, page by page
            return cache[table[b].long()].reshape(-1, Hkv, D)[:n]
    else:
        k_cache = _rand(g, B + 1, S_cache, Hkv, D, dtype=dtype)
        v_cache = _rand(g, B + 1, S_cache, Hkv, D, dtype=dtype)
        rows = torch.tensor([2, 0, 3], dtype=torch.int32)  # sequence b lives in row rows[b]
        extra = {"cache_batch_idx": rows}

        def seq(cache, b, n):
            return cache[int(rows[b]), :n]

    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached, return_softmax_lse=True,
        **extra, **kw,
    )  # fmt: skip
    # in place: exactly the new tokens were written, where flash-attn writes them
    want_k, want_v = k_before.clone(), v_before.clone()
    for b in range(B):
        for t in range(Sq):
            pos = int(cached[b]) + t
            if paged:
                page, slot = int(table[b, pos // P]), pos % P
                want_k[page, slot], want_v[page, slot] = k_new[b, t], v_new[b, t]
            else:
                want_k[int(rows[b]), pos], want_v[int(rows[b]), pos] = k_new[b, t], v_new[b, t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # attention: each sequence's old tokens followed by the new ones (from the copies)
    n = [int(c) + Sq for c in cached]
    seqs_k = [torch.cat([seq(k_before, b, int(cached[b])), k_new[b]]) for b in range(B)]
    seqs_v = [torch.cat([seq(v_before, b, int(cached[b])), v_new[b]]) for b in range(B)]
    assert [len(s) for s in seqs_k] == n
    ref = lambda t, dt: _kvcache_ref(t[0], seqs_k, seqs_v, dtype=dt, **kw)[0]  # noqa: E731
    _ratio_check(out, (q,), ref, dtype=dtype)
    ref_lse = lambda t, dt: _kvcache_ref(t[0], seqs_k, seqs_v, dtype=dt, **kw)[1]  # noqa: E731
    _ratio_check(lse, (q,), ref_lse, dtype=dtype, what="lse")
    assert out.shape == (B, Sq, H, D) and lse.shape == (B, H, Sq)


def test_flash_attn_with_kvcache_without_new_tokens():
    """k=None: attend over the cache as it is, cache_seqlens an int or the whole cache."""
    g = _gen(8)
    q, kc, vc = _rand(g, 2, 1, 4, 16), _rand(g, 2, 20, 4, 16), _rand(g, 2, 20, 4, 16)
    before = kc.clone()
    for lens, n in ((13, 13), (None, 20)):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)

        def ref(t, dt, n=n):
            return _kvcache_ref(t[0], list(kc[:, :n]), list(vc[:, :n]), dtype=dt)[0]

        _ratio_check(out, (q,), ref, dtype=torch.float32)
    assert torch.equal(kc, before)


def test_flash_attn_with_kvcache_declines_what_it_cannot_do():
    g, q, k_new, v_new, cached = _cache_case(1, B=2)
    kc, vc = _rand(g, 2, 40, 2, 32), _rand(g, 2, 40, 2, 32)
    cos = torch.ones(40, 16)
    with pytest.raises(NotImplementedError, match="rotate q and the new k first"):
        flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=cos,
                                cache_seqlens=cached)  # fmt: skip
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cached, cache_leftpad=cached)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=39 \+ 2 new tokens exceeds .* 40"):
        flash_attn_with_kvcache(q, kc, vc, torch.cat([k_new] * 2, 1), torch.cat([v_new] * 2, 1),
                                cache_seqlens=torch.tensor([39, 3], dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match=r"holds 2 keys .* Sq=3"):
        flash_attn_with_kvcache(torch.cat([q] * 3, 1), kc, vc, cache_seqlens=2)
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, k_new, v_new)
    with pytest.raises(TypeError, match="cast them to the cache's dtype"):
        flash_attn_with_kvcache(q, kc, vc, k_new.double(), v_new.double(), cache_seqlens=cached)
    assert not kc.isnan().any()  # nothing was written by a refused call


def test_bad_arguments_are_named_in_flash_attn_terms():
    q, k, v = torch.randn(2, 9, 4, 16), torch.randn(2, 9, 3, 16), torch.randn(2, 9, 3, 16)
    with pytest.raises(ValueError, match=r"H=4 .* Hkv=3"):
        flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=r"4-D \(B, S, H, D\)"):
        flash_attn_func(q[0], k[0], v[0])
    k, v = k[:, :, :2], v[:, :, :2]
    with pytest.raises(TypeError, match="window_size must be a pair"):
        flash_attn_func(q, k, v, window_size=5)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        flash_attn_func(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes of shape \(3,\) .* \(4,\)"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="return_attn_probs must be True or False"):
        flash_attn_func(q, k, v, return_attn_probs=1)
