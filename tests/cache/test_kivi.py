"""KIVI caches: the quantisers against an fp64 reference of the same rule, the residual across
group boundaries, attention over the cache, and generation with a tiny random model."""

from __future__ import annotations

import pytest
import torch

import selfattn as sa
from selfattn import masks
from selfattn.cache import (
    KIVICache,
    StaticCache,
    dequantize_keys,
    dequantize_values,
    kivi_bytes,
    kv_cache_bytes,
    quantize_keys,
    quantize_values,
)
from selfattn.cache.kivi import pack_codes, quantized_tokens, unpack_codes
from selfattn.models import generate
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention
from tests._speculative import tiny_llama

# the fp32 arithmetic of a code: (x - zero) / scale in float32, a few roundings of at most
# 2**bits in size; a reference code farther than this from a rounding tie is exact
TIE_ULPS = 64


def kv_like(g, B, H, T, D, dtype=torch.float32):
    """Random keys with outlier channels (as real keys have) and random values."""
    k = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k[..., : max(1, D // 8)] *= 6.0
    v = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    return k.to(dtype), v.to(dtype)


def reference_codes(x, dim, bits, dtype):
    """fp64 rule over groups along ``dim``: (codes, scale, zero, t) with scale and zero rounded
    to ``dtype`` as stored, and t the unrounded code."""
    x = x.double()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).to(dtype).double()
    zero = lo.to(dtype).double()
    t = torch.where(scale > 0, (x - zero) / scale, torch.zeros_like(x))
    return t.round().clamp(0, 2**bits - 1), scale, zero, t


# -- packing and the quantisers --------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_layout_and_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 5, 24), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    per = 8 // bits
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 24 // per)
    # the documented layout: channel c at byte c * bits // 8, bits (c % per) * bits upwards
    for c in (0, 1, per - 1, per, 23):
        byte = packed[..., c * bits // 8].long()
        assert torch.equal((byte >> (c % per) * bits) & (2**bits - 1), codes[..., c].long())
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bits", [2, 4])
def test_quantisers_against_fp64_reference(bits, dtype):
    g = torch.Generator().manual_seed(bits + 7 * dtype.itemsize)
    k, v = kv_like(g, 2, 3, 64, 24, dtype)
    G = 16
    qk, qv = quantize_keys(k, bits, G), quantize_values(v, bits, 8)
    assert qk.codes.shape == (2, 3, 64, 24 * bits // 8) and qk.scale.shape == (2, 3, 4, 24)
    assert qv.codes.shape == (2, 3, 64, 24 * bits // 8) and qv.scale.shape == (2, 3, 64, 3)
    cases = (
        ("keys", qk, k.unflatten(2, (4, G)), 3, dequantize_keys(qk, torch.float64)),
        ("values", qv, v.unflatten(3, (3, 8)), 4, dequantize_values(qv, torch.float64)),
    )
    tie = TIE_ULPS * 2**bits * torch.finfo(torch.float32).eps
    for what, q, grouped, dim, back in cases:
        codes, scale, zero, t = reference_codes(grouped, dim, bits, dtype)
        ours = unpack_codes(q.codes, bits).view(grouped.shape).double()
        far = ((t - t.floor()) - 0.5).abs() > tie
        assert far.float().mean() > 0.95, f"{what}: too few codes away from ties to compare"
        assert torch.equal(ours[far], codes[far]), f"{what}: codes differ from the fp64 rule"
        assert torch.equal(q.zero.double(), zero.squeeze(dim)), f"{what}: zero is not the min"
        # the scale rounds once to the storage dtype: from fp32 arithmetic, within one ulp
        ulp = torch.finfo(dtype).eps * scale.squeeze(dim)
        assert bool(((q.scale.double() - scale.squeeze(dim)).abs() <= ulp).all()), what
        # reconstruction: within half a step of its group (plus fp32 rounding of code * scale)
        err = (back.view(grouped.shape) - grouped.double()).abs()
        step = q.scale.double().unsqueeze(dim)
        slack = 8 * torch.finfo(torch.float32).eps * grouped.double().abs().amax()
        assert bool((err <= step / 2 + slack).all()), f"{what}: max error {err.max():.3e}"


def test_constant_groups_reconstruct_exactly():
    k = torch.randn(1, 2, 8, 8)
    k[:, :, :4, 3] = 1.25  # one channel constant over the first key group
    v = torch.randn(1, 2, 8, 8)
    v[0, 1, 5] = -0.5  # one token constant over its channels
    qk, qv = quantize_keys(k, 2, 4), quantize_values(v, 2, 8)
    assert qk.scale[0, :, 0, 3].eq(0).all() and qv.scale[0, 1, 5].eq(0).all()
    assert dequantize_keys(qk)[:, :, :4, 3].eq(1.25).all()
    assert dequantize_values(qv)[0, 1, 5].eq(-0.5).all()


# -- the cache -------------------------------------------------------------------------------------


def expected_history(k, v, n, bits, group, residual):
    """What the cache should return after ``n`` tokens: the full groups quantised by the
    reference functions, then the residual unchanged."""
    n_q = quantized_tokens(n, group, residual)
    g_v = min(group, v.shape[-1])
    kq = dequantize_keys(quantize_keys(k[:, :, :n_q], bits, group)) if n_q else k[:, :, :0]
    vq = dequantize_values(quantize_values(v[:, :, :n_q], bits, g_v)) if n_q else v[:, :, :0]
    return torch.cat([kq, k[:, :, n_q:n]], 2), torch.cat([vq, v[:, :, n_q:n]], 2)


@pytest.mark.parametrize(
    ("appends", "group", "residual"),
    [
        ([1] * 41, 8, 16),  # decode steps across several group boundaries
        ([3, 5, 7, 1, 9, 11], 8, 16),  # odd counts
        ([70, 1, 1, 13], 8, 16),  # a prefill longer than the residual
        ([8, 8, 8, 8], 8, 0),  # exactly a group at a time, no residual
        ([16, 8, 1, 7, 1], 8, 8),  # exactly at the boundaries
    ],
)
@pytest.mark.parametrize("bits", [2, 4])
def test_residual_across_group_boundaries(appends, group, residual, bits):
    g = torch.Generator().manual_seed(sum(appends) + bits)
    total = sum(appends)
    k, v = kv_like(g, 2, 2, total, 16)
    cache = KIVICache(2, total, 2, 16, bits=bits, group=group, residual=residual)
    n = 0
    for s in appends:
        kk, vv = cache.update(k[:, :, n : n + s], v[:, :, n : n + s])
        n += s
        assert cache.length == n and kk.shape == (2, 2, n, 16)
        n_q = cache.n_quantized
        assert n_q % group == 0 and n - n_q >= min(n, residual) and n - n_q < residual + group
        ek, ev = expected_history(k, v, n, bits, group, residual)
        assert torch.equal(kk, ek) and torch.equal(vv, ev), f"after {n} tokens"
        assert cache.stored_bytes() == kivi_bytes(1, 2, 16, n, bits, group, residual, "fp32", 2)
    cache.reset()
    kk, _ = cache.update(k[:, :, :total], v[:, :, :total])  # one prefill after reset
    assert torch.equal(kk, expected_history(k, v, total, bits, group, residual)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_the_cache_matches_fp64(dtype):
    g = torch.Generator().manual_seed(3)
    k, v = kv_like(g, 2, 2, 90, 32, dtype)
    q = torch.randn(2, 4, 90, 32, generator=g).to(dtype)  # GQA 4 / 2
    cache = KIVICache(2, 90, 2, 32, bits=2, group=16, residual=16, dtype=dtype)
    cache.update(k[:, :, :77], v[:, :, :77])
    for n in range(77, 90):  # decode steps: each one query
        kk, vv = cache.update(k[:, :, n : n + 1], v[:, :, n : n + 1])
        qn = q[:, :, n : n + 1]
        out = sa.attention(qn, kk, vv, mask=masks.causal())
        oracle = reference_attention(qn, kk, vv, mask=masks.causal())[0]
        naive = naive_attention(qn, kk, vv, mask=masks.causal())[0]
        assert_close_to_reference(out, oracle, naive, what=f"step {n}")


def test_error_shrinks_from_2_to_4_bits():
    g = torch.Generator().manual_seed(4)
    k, v = kv_like(g, 1, 2, 200, 32)
    q = torch.randn(1, 2, 8, 32, generator=g)
    full = StaticCache(1, 200, 2, 32)
    exact = sa.attention(q, *full.update(k, v), mask=masks.causal())
    err = {}
    for bits in (2, 4):
        cache = KIVICache(1, 200, 2, 32, bits=bits, group=32, residual=32)
        out = sa.attention(q, *cache.update(k, v), mask=masks.causal())
        err[bits] = (out - exact).abs().max().item()
    # a 4-bit step is 3/15 of a 2-bit one: the error falls well below half
    assert 0 < err[4] < err[2] / 2, err


def test_kivi_bytes_against_a_16_bit_cache():
    # long sequences: bits/8 per element plus the scales, against 2 bytes per element
    args = (4, 8, 128, 8192)
    for bits, low, high in ((2, 4, 6), (4, 3, 4)):
        ratio = kv_cache_bytes(*args, "bf16") / kivi_bytes(*args, bits, 32, 128, "bf16")
        assert low < ratio < high, (bits, ratio)
    # every token in the residual: the 16-bit cache's bytes
    assert kivi_bytes(4, 8, 128, 100, residual=128) == kv_cache_bytes(4, 8, 128, 100, "bf16")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"bits": 3}, "bits must be one of"),
        ({"bits": 8}, "got 8"),
        ({"bits": 2.0}, "got 2.0"),
        ({"group": 0}, "group must be a positive int, got 0"),
        ({"residual": -32}, "got -32"),
        ({"residual": 48}, r"residual \(48\) must be a multiple of group \(32\)"),
        ({"head_dim": 6}, r"head_dim \(6\) must be a multiple of 4"),
        ({"value_dim": 48}, r"group \(32\) must divide the value dim \(48\)"),
    ],
)
def test_bad_settings_name_the_value(kwargs, named):
    args = {"head_dim": 64, **kwargs}
    with pytest.raises(ValueError, match=named):
        KIVICache(1, 64, 2, **args)


def test_bad_updates_name_the_value():
    cache = KIVICache(1, 10, 2, 8, group=4, residual=4)
    x = torch.randn(1, 2, 6, 8)
    cache.update(x, x)
    with pytest.raises(ValueError, match="max_len"):
        cache.update(x, x)
    with pytest.raises(ValueError, match="appends only"):
        cache.update(x[:, :, :1], x[:, :, :1], positions=torch.tensor([2]))
    with pytest.raises(ValueError, match="expects k of shape"):
        cache.update(x[:, :1], x[:, :1])


# -- models and generation -------------------------------------------------------------------------


def test_make_cache_and_generate_checks():
    model = tiny_llama(0)
    cache = model.make_cache("kivi", 2, 40, bits=4, group=8, residual=8)
    assert all(isinstance(c, KIVICache) and c.bits == 4 for c in cache.layers)
    with pytest.raises(ValueError, match=r"make_cache\('static'\) takes no \['bits'\]"):
        model.make_cache("static", 1, 8, bits=2)
    with pytest.raises(ValueError, match="'kivi8'"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, cache="kivi8")
    ids = torch.randint(0, 97, (2, 5))
    generate(model, ids, 2, cache=cache)
    with pytest.raises(ValueError, match="empty cache, got one holding 6 tokens"):
        generate(model, ids, 2, cache=cache)


def test_generate_with_everything_in_the_residual_is_the_static_cache():
    model = tiny_llama(1)
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    static = generate(model, ids, 12, cache="static", ignore_eos=True)
    assert torch.equal(generate(model, ids, 12, cache="kivi", ignore_eos=True), static)


def teacher_forced_logits(model, tokens, prompt, cache):
    """Logits ``(B, n, vocab)`` predicting tokens ``prompt ..`` given the ones before each."""
    logits = [model(tokens[:, :prompt], cache=cache)[:, -1]]
    for t in range(prompt, tokens.shape[1] - 1):
        logits.append(model(tokens[:, t : t + 1], cache=cache)[:, -1])
    return torch.stack(logits, 1)


@torch.no_grad()
def test_generate_tokens_match_where_the_margin_exceeds_the_error():
    model = tiny_llama(2)
    B, S, n = 3, 40, 16
    ids = torch.randint(0, 97, (B, S), generator=torch.Generator().manual_seed(2))
    fp = generate(model, ids, n, cache="static", ignore_eos=True)
    ref = teacher_forced_logits(model, fp, S, model.make_cache("static", B, S + n))
    errors, checked = {}, 0
    for bits in (2, 4):
        kivi = {"bits": bits, "group": 8, "residual": 8}
        ours = teacher_forced_logits(model, fp, S, model.make_cache("kivi", B, S + n, **kivi))
        err = (ours - ref).abs().amax(-1)  # (B, n): each step's largest logit error
        errors[bits] = err.max().item()
        top2 = ref.topk(2, -1).values
        margin = top2[..., 0] - top2[..., 1]
        cache = model.make_cache("kivi", B, S + n, **kivi)
        out = generate(model, ids, n, cache=cache, ignore_eos=True)[:, S:]
        for b in range(B):
            for t in range(n):  # while the rows agree, a wide margin fixes the next token
                if margin[b, t] > 2 * err[b, t]:
                    assert out[b, t] == fp[b, S + t], f"{bits}-bit row {b} step {t}"
                    checked += 1
                if out[b, t] != fp[b, S + t]:
                    break
    assert checked >= B * n // 2, f"only {checked} steps had a margin above the error"
    assert 0 < errors[4] < errors[2], errors
