"""Quantised KV storage: int8 / fp8 round trips and paged_attention over quantised pages.

The error comparison against a bf16 cache here uses random K/V with outlier channels and
outlier tokens; tests/test_quant_real.py measures it on real all-MiniLM-L6-v2 K/V.
"""

from __future__ import annotations

import math

import pytest
import torch

from selfattn import masks
from selfattn.cache import paged_attention
from selfattn.cache.quant import (
    dequantize,
    quantize_fp8,
    quantize_int8,
    write_quantized,
)
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention


def make_pool(lens, Hq, Hkv, D, P, *, Sq, Dv=None, seed=0, outliers=False):
    """fp64 pages, a permuted block table (-1 past each sequence's pages), fp64 q."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    B = len(lens)
    max_pages = max(math.ceil(n / P) for n in lens) + 1
    N = B * max_pages + 2
    kp = torch.randn(N, P, Hkv, D, generator=g, dtype=torch.float64)
    vp = torch.randn(N, P, Hkv, Dv, generator=g, dtype=torch.float64)
    if outliers:  # a few large channels (as in real K) and ~1 % large tokens
        kp[..., : max(1, D // 16)] *= 4.0
        for t in (kp, vp):
            hit = torch.rand(t.shape[:3], generator=g) < 0.01
            t[hit] *= 8.0
    perm = torch.randperm(N, generator=g)[: B * max_pages].view(B, max_pages)
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        table[b, : math.ceil(n / P)] = perm[b, : math.ceil(n / P)].int()
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64)
    return q, kp, vp, table, torch.tensor(lens, dtype=torch.int32)


def contiguous(pages, table, b, n):
    """Sequence ``b``'s first ``n`` tokens through the table: ``(1, Hkv, n, ·)``."""
    used = math.ceil(n / pages.shape[1])
    rows = pages[table[b, :used].long()].reshape(-1, *pages.shape[2:])[:n]  # (n, Hkv, ·)
    return rows.transpose(0, 1).unsqueeze(0)


def quantize(pages, storage):
    return quantize_int8(pages) if storage == "int8" else quantize_fp8(pages)


# -- quantisers ----------------------------------------------------------------------------------


def test_int8_round_trip_bound_and_zero_rows():
    x = torch.randn(5, 7, 3, 33, dtype=torch.float64) * torch.rand(5, 7, 3, 1, dtype=torch.float64)
    x[1, 2, 0] = 0.0  # an all-zero (token, head) row
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (5, 7, 3)
    assert s[1, 2, 0] == 1.0 and bool((q[1, 2, 0] == 0).all())
    nonzero = x.abs().amax(-1) > 0
    # absmax maps to ±127, or ±126 where the scale rounded up to bfloat16 by up to 2**-7
    assert bool((q.abs().amax(-1)[nonzero] >= 126).all())
    err = (dequantize(q, s, torch.float64) - x).abs()
    assert bool((err <= s.double().unsqueeze(-1) / 2 * (1 + 1e-6)).all())
    # bfloat16 scales rounded up: never below absmax / 127 (no saturation), within one ulp of it
    exact = (x.abs().amax(-1) / 127).float()
    ulp = 2.0**-7  # bfloat16 keeps 8 significant bits
    assert bool((s.float()[nonzero] >= exact[nonzero]).all())
    assert bool((s.float()[nonzero] <= exact[nonzero] * (1 + ulp)).all())


def test_fp8_per_head_scales_bound_and_saturation():
    x = torch.randn(9, 4, 2, 17, dtype=torch.float64)
    x[..., 1, :] *= 50.0  # heads of very different ranges
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2,) and s.dtype == torch.float32
    torch.testing.assert_close(s.double(), x.abs().amax(dim=(0, 1, 3)) / 448, rtol=1e-6, atol=0)
    err = (dequantize(q, s, torch.float64) - x).abs()
    bound = x.abs() / 16 + s.double().view(2, 1) / 1024
    assert bool((err <= bound * (1 + 1e-6)).all())
    # New tokens under the cache's scales: beyond 448 · scale they saturate, never NaN/Inf.
    q2, s2 = quantize_fp8(x * 3, s)
    assert s2 is s and bool(torch.isfinite(q2.float()).all())
    assert float(q2.float().abs().max()) == 448.0
    zq, zs = quantize_fp8(torch.zeros(3, 2, 4))
    assert bool((zs == 1.0).all()) and bool((zq.float() == 0).all())


@pytest.mark.parametrize(
    "fn,arg,exc,match",
    [
        (quantize_int8, torch.tensor([[1.0, math.nan]]), ValueError, "NaN or Inf"),
        (quantize_int8, torch.ones(2, 3, dtype=torch.int32), TypeError, "torch.int32"),
        (quantize_fp8, torch.ones(4), ValueError, r"\(\.\.\., Hkv, D\)"),
    ],
)
def test_quantizer_errors(fn, arg, exc, match):
    with pytest.raises(exc, match=match):
        fn(arg)


def test_write_quantized_into_slots():
    N, P, Hkv, D = 5, 4, 2, 8
    x = torch.randn(3, Hkv, D)
    ids, offs = torch.tensor([4, 0, 4]), torch.tensor([1, 3, 2])
    pages = torch.zeros(N, P, Hkv, D, dtype=torch.int8)
    scales = torch.zeros(N, P, Hkv, dtype=torch.bfloat16)
    write_quantized(pages, scales, ids, offs, x)
    q, s = quantize_int8(x)
    assert torch.equal(pages[ids, offs], q) and torch.equal(scales[ids, offs], s)
    assert int(pages[1].abs().sum()) == 0 and float(scales[1].abs().sum()) == 0  # untouched
    fp = torch.zeros(N, P, Hkv, D, dtype=torch.float8_e4m3fn)
    fs = torch.tensor([0.01, 0.02])
    write_quantized(fp, fs, ids, offs, x)
    assert torch.equal(fp[ids, offs].float(), quantize_fp8(x, fs)[0].float())
    assert torch.equal(fs, torch.tensor([0.01, 0.02]))  # the cache's per-head scales stay
    with pytest.raises(ValueError, match=r"offsets must lie in 0\.\.3"):
        write_quantized(pages, scales, ids, torch.tensor([0, 4, 1]), x)
    with pytest.raises(ValueError, match=r"x must be \(T, 2, 8\)"):
        write_quantized(pages, scales, ids, offs, torch.randn(3, 2, 7))


# -- paged_attention over quantised pages --------------------------------------------------------


@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Sq,mask", [(1, None), (4, masks.causal())])
def test_exact_on_dequantised_values(storage, dtype, Sq, mask):
    """Given the dequantised K/V, the kernel is as exact as on float pages (the ratio rule)."""
    lens = [Sq, 37, 130]
    q, kp, vp, table, sl = make_pool(lens, 6, 3, D=24, P=7, Sq=Sq, Dv=20, seed=Sq)
    (kq, ks), (vq, vs) = quantize(kp, storage), quantize(vp, storage)
    q = q.to(dtype)
    out, lse = paged_attention(
        q, kq, vq, table, sl, mask=mask, k_scales=ks, v_scales=vs, return_lse=True
    )
    assert out.dtype == dtype and lse.dtype == torch.float32
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)  # fp32, as the kernel computes them
    for b, n in enumerate(lens):
        qb = q[b : b + 1]
        kb, vb = contiguous(kd, table, b, n), contiguous(vd, table, b, n)
        o64, l64, _ = reference_attention(qb, kb, vb, mask=mask)
        naive_o, naive_l, _ = naive_attention(qb, kb.to(dtype), vb.to(dtype), mask=mask)
        assert_close_to_reference(out[b : b + 1], o64, naive_o, dtype=dtype, what=f"out[{b}]")
        assert_close_to_reference(lse[b : b + 1], l64, naive_l, dtype=torch.float32)


@pytest.mark.parametrize("storage", ["int8", "fp8"])
def test_error_vs_unquantised_within_documented_bound(storage):
    """|out_q - out| <= (exp(2ε) - 1) · max|v| + max|Δv| per row (quant.py's docstring)."""
    lens = [50, 301]
    Hq, Hkv, D, Sq = 4, 2, 32, 3
    q, kp, vp, table, sl = make_pool(lens, Hq, Hkv, D, P=16, Sq=Sq, seed=7, outliers=True)
    (kq, ks), (vq, vs) = quantize(kp, storage), quantize(vp, storage)
    out = paged_attention(q, kq, vq, table, sl, k_scales=ks, v_scales=vs)  # fp64 throughout
    dk, dv = dequantize(kq, ks, torch.float64) - kp, dequantize(vq, vs, torch.float64) - vp
    scale = 1 / math.sqrt(D)
    for b, n in enumerate(lens):
        kb, vb = contiguous(kp, table, b, n), contiguous(vp, table, b, n)
        ref, _, _ = reference_attention(q[b : b + 1], kb, vb)
        heads = torch.arange(Hq) // (Hq // Hkv)
        dkb = contiguous(dk, table, b, n)[0, heads]  # (Hq, n, D)
        dvb = contiguous(dv, table, b, n)[0, heads]
        eps = scale * (q[b].abs() @ dkb.abs().transpose(1, 2)).amax(-1)  # (Hq, Sq)
        vmax = vb[0, heads].abs().amax(dim=(1, 2)).view(Hq, 1, 1)
        bound = torch.expm1(2 * eps).unsqueeze(-1) * vmax + dvb.abs().amax((1, 2)).view(Hq, 1, 1)
        err = (out[b] - ref[0]).abs()  # (Hq, Sq, D)
        assert bool((err <= bound).all()), float((err / bound).max())
        assert float(err.max()) > 0  # the quantisation is really there


def measured_errors(seed=0, D=64, n=512):
    """RMS(out - truth) / RMS(truth) for int8, fp8 and a bf16 cache, on outlier-laden K/V."""
    q, kp, vp, table, sl = make_pool([n, 129], 8, 2, D, P=16, Sq=2, seed=seed, outliers=True)
    truth = paged_attention(q, kp, vp, table, sl)  # fp64
    q32 = q.float()
    errs = {}
    for storage in ("int8", "fp8"):
        (kq, ks), (vq, vs) = quantize(kp, storage), quantize(vp, storage)
        errs[storage] = paged_attention(q32, kq, vq, table, sl, k_scales=ks, v_scales=vs)
    kb, vb = kp.bfloat16().float(), vp.bfloat16().float()  # bf16 storage, fp32 compute
    errs["bf16"] = paged_attention(q32, kb, vb, table, sl)
    rms = truth.pow(2).mean().sqrt()
    return {k: float((o.double() - truth).pow(2).mean().sqrt() / rms) for k, o in errs.items()}


def test_error_relative_to_bf16_cache():
    """The documented claim: int8 within 16×, fp8 e4m3 within 40× the error of a bf16 cache."""
    for seed in (1, 2):
        e = measured_errors(seed)
        assert e["int8"] <= 16 * e["bf16"] and e["int8"] <= 0.05, e
        assert e["fp8"] <= 40 * e["bf16"] and e["fp8"] <= 0.1, e
        assert e["bf16"] < e["int8"] < e["fp8"], e  # the comparison is not vacuous


def test_k_and_v_scales_are_not_swapped():
    """The same codes under very different K and V scales: a swap changes the output."""
    q, kp, _, table, sl = make_pool([40, 9], 4, 2, D=8, P=4, Sq=2, seed=3)
    kq, ks = quantize_int8(kp)
    vq = kq.clone()  # identical codes: only the scales tell K from V
    k_scales, v_scales = ks * 0.02, ks * 5.0
    q = q.float()
    out = paged_attention(q, kq, vq, table, sl, k_scales=k_scales, v_scales=v_scales)
    swapped = paged_attention(q, kq, vq, table, sl, k_scales=v_scales, v_scales=k_scales)
    kd, vd = dequantize(kq, k_scales), dequantize(vq, v_scales)
    for b, n in enumerate([40, 9]):
        ref, _, _ = reference_attention(
            q[b : b + 1], contiguous(kd, table, b, n), contiguous(vd, table, b, n)
        )
        torch.testing.assert_close(out[b : b + 1], ref.float(), rtol=1e-5, atol=1e-5)
    assert float((out - swapped).abs().max()) > 0.1
    # fp8: per-head K and V scales, also distinct.
    fk, fks = quantize_fp8(kp)
    out8 = paged_attention(q, fk, fk, table, sl, k_scales=fks * 0.1, v_scales=fks * 3)
    ref8 = paged_attention(q, dequantize(fk, fks * 0.1), dequantize(fk, fks * 3), table, sl)
    torch.testing.assert_close(out8, ref8, rtol=1e-5, atol=1e-5)


def test_garbage_in_unused_slots_and_scales_never_reaches_output():
    lens = [13, 6]
    q, kp, vp, table, sl = make_pool(lens, 4, 2, D=8, P=8, Sq=2, seed=5)
    kq, ks = quantize_int8(kp)
    vq, vs = quantize_int8(vp)
    q = q.float()
    clean = paged_attention(q, kq, vq, table, sl, k_scales=ks, v_scales=vs)
    used = set()
    for b, n in enumerate(lens):
        pages = table[b, : math.ceil(n / 8)].tolist()
        used.update(pages)
        ks[pages[-1], n % 8 :] = math.nan  # tails of last pages
        vs[pages[-1], n % 8 :] = math.inf
    for p in set(range(kq.shape[0])) - used:
        ks[p], vs[p] = math.nan, math.nan
    assert torch.equal(clean, paged_attention(q, kq, vq, table, sl, k_scales=ks, v_scales=vs))


def test_dequantises_a_group_at_a_time(monkeypatch, gathered_counts):
    from selfattn.backends.paged import pytorch as paged_torch

    monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")  # counts the PyTorch path's gathers
    monkeypatch.setattr(paged_torch, "GROUP_KEYS", 32)
    q, kp, vp, table, sl = make_pool([200, 70], 4, 2, D=8, P=8, Sq=1, seed=2)
    (kq, ks), (vq, vs) = quantize_int8(kp), quantize_int8(vp)
    calls = gathered_counts
    calls.clear()  # count only the call under test, not the set-up
    out = paged_attention(q.float(), kq, vq, table, sl, k_scales=ks, v_scales=vs)
    assert max(calls) <= 2 * 4 and len(calls) >= 4 * math.ceil(200 / 32)  # pages + scales
    ref = paged_attention(q.float(), dequantize(kq, ks), dequantize(vq, vs), table, sl)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_storage_bytes_int8_about_half_of_bf16():
    N, P, Hkv, D = 6, 16, 4, 128
    x = torch.randn(N, P, Hkv, D)
    q, s = quantize_int8(x)
    int8_bytes = q.numel() * q.element_size() + s.numel() * s.element_size()
    bf16 = x.bfloat16()
    assert int8_bytes <= 0.53 * bf16.numel() * bf16.element_size()
    f, fs = quantize_fp8(x)
    assert f.numel() * f.element_size() + fs.numel() * 4 <= 0.51 * bf16.numel() * 2


# -- errors --------------------------------------------------------------------------------------


def _args(storage="int8"):
    q, kp, vp, table, sl = make_pool([10, 4], 4, 2, D=8, P=4, Sq=2)
    (kq, ks), (vq, vs) = quantize(kp, storage), quantize(vp, storage)
    return q.float(), kq, vq, table, sl, ks, vs


@pytest.mark.parametrize(
    "storage,over,exc,match",
    [
        ("int8", dict(k_scales=None), ValueError, "k_pages are torch.int8 but k_scales is None"),
        ("int8", dict(v_scales=None), ValueError, "v_pages are torch.int8 but v_scales is None"),
        ("fp8", dict(k_scales=None), ValueError, "torch.float8_e4m3fn but k_scales is None"),
        ("int8", dict(k_scales=torch.ones(2, dtype=torch.bfloat16)), ValueError,
         r"shape \(10, 4, 2\) .* got \(2,\)"),
        ("int8", dict(k_scales=torch.ones(10, 4, 2)), TypeError,
         "must be torch.bfloat16, got torch.float32"),
        ("fp8", dict(v_scales=torch.ones(10, 4, 2)), ValueError, r"shape \(2,\) .*\(10, 4, 2\)"),
        ("int8", dict(k_scales=torch.ones(10, 4, 2).half()), TypeError, "torch.float16"),
        ("int8", dict(k_scales=[1.0]), TypeError, "got list"),
        ("float", dict(k_scales=torch.ones(2)), ValueError, "k_scales given but k_pages are"),
    ],
)  # fmt: skip
def test_scale_errors(storage, over, exc, match):
    q, kq, vq, table, sl, ks, vs = _args("int8" if storage == "float" else storage)
    if storage == "float":
        kq, vq, vs = dequantize(kq, ks), dequantize(vq, vs), None
    kw = dict(k_scales=ks, v_scales=vs)
    kw.update(over)
    with pytest.raises(exc, match=match):
        paged_attention(q, kq, vq, table, sl, **kw)


def test_quantised_query_rejected():
    q, kq, vq, table, sl, ks, vs = _args()
    with pytest.raises(TypeError, match="q must be"):
        paged_attention(q.to(torch.int8), kq, vq, table, sl, k_scales=ks, v_scales=vs)
