"""selfattn.nn: MultiHeadAttention (torch parity, GQA, cache, padding), norms, MLPs, blocks."""

from __future__ import annotations

import copy
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn import masks, positions
from selfattn.nn import (
    MLP,
    ContiguousCache,
    DecoderBlock,
    EncoderBlock,
    LayerNorm,
    MultiHeadAttention,
    RMSNorm,
    SwiGLU,
)
from selfattn.nn.norms import make_norm

TOL = {torch.float32: 2e-5, torch.float64: 1e-11}


def rope_like(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A tiny rotary map: rotate (first half, second half) pairs of ``x (B, H, S, D)``."""
    D = x.shape[-1]
    freq = 1.0 / (100.0 ** (torch.arange(D // 2, dtype=torch.float64) / (D // 2)))
    pos = positions.to(torch.float64)
    ang = pos[..., None] * freq  # (S, D/2) or (B, S, D/2)
    if ang.dim() == 3:
        ang = ang[:, None]  # (B, S, D/2) -> (B, 1, S, D/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _seed(*parts) -> int:
    """A seed per test case that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(parts).encode())


def _randomise(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _close(a, b, dtype, what=""):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= TOL[dtype], f"{what}: max err {err:.3g} > {TOL[dtype]:.1g}"


# -- torch.nn.MultiheadAttention parity ----------------------------------------------------------
MASK_CASES = ["none", "kpm_bool", "kpm_float", "attn_bool", "attn_float_bh", "both"]


def _torch_masks(case, B, H, L, S, dtype, gen):
    kpm = attn = None
    if case in ("kpm_bool", "both"):
        kpm = torch.rand(B, S, generator=gen) < 0.3
        kpm[:, 0] = False  # every row keeps a key: torch gives NaN for empty rows, we give 0
    if case == "kpm_float":
        kpm = torch.randn(B, S, generator=gen, dtype=dtype)
    if case in ("attn_bool", "both"):
        attn = torch.rand(L, S, generator=gen) < 0.4
        attn[:, 0] = False
    if case == "attn_float_bh":
        attn = torch.randn(B * H, L, S, generator=gen, dtype=dtype)
        attn[..., 1] = float("-inf")
    return kpm, attn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kv_dims", [None, (5, 7)])
@pytest.mark.parametrize("case", MASK_CASES)
def test_from_torch_matches_torch(dtype, batch_first, kv_dims, case):
    gen = torch.Generator().manual_seed(_seed(dtype, batch_first, kv_dims, case))
    E, H, B, L, S = 12, 3, 2, 5, 7
    kdim, vdim = kv_dims or (E, E)
    m = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=vdim, dtype=dtype)
    _randomise(m, gen)
    m.eval()
    ours = MultiHeadAttention.from_torch(m).eval()

    def seq(n, d):
        shape = (B, n, d) if batch_first else (n, B, d)
        return torch.randn(shape, generator=gen, dtype=dtype)

    q, k, v = seq(L, E), seq(S, kdim), seq(S, vdim)
    kpm, attn = _torch_masks(case, B, H, L, S, dtype, gen)
    for need, avg in [(True, True), (True, False), (False, True)]:
        kw = dict(key_padding_mask=kpm, attn_mask=attn, need_weights=need, average_attn_weights=avg)
        out_t, w_t = m(q, k, v, **kw)
        out_o, w_o = ours(q, k, v, **kw)
        assert out_o.shape == out_t.shape and out_o.dtype == out_t.dtype
        _close(out_o, out_t, dtype, f"out need={need} avg={avg}")
        if need:
            assert w_o.shape == w_t.shape
            _close(w_o, w_t, dtype, f"weights avg={avg}")
        else:
            assert w_o is None and w_t is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_from_torch_self_attention_gradients_equal(dtype):
    gen = torch.Generator().manual_seed(11)
    E, H, B, L = 10, 2, 3, 6
    m = nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    _randomise(m, gen)
    m.eval()
    ours = MultiHeadAttention.from_torch(m).eval()
    x = torch.randn(B, L, E, generator=gen, dtype=dtype)
    kpm = torch.zeros(B, L, dtype=dtype)
    kpm[0, -2:] = float("-inf")
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype)
    r_out = torch.randn(B, L, E, generator=gen, dtype=dtype)
    r_w = torch.randn(B, L, L, generator=gen, dtype=dtype)
    grads = []
    for mod in (m, ours):
        xi = x.clone().requires_grad_()
        out, w = mod(xi, xi, xi, key_padding_mask=kpm, attn_mask=causal, is_causal=True)
        ((out * r_out).sum() + (w * r_w).sum()).backward()
        grads.append(xi.grad)
    _close(grads[1], grads[0], dtype, "d input")
    a = ours.attn
    ours_in = torch.cat([a.q_proj.weight.grad, a.k_proj.weight.grad, a.v_proj.weight.grad])
    _close(ours_in, m.in_proj_weight.grad, dtype, "d in_proj_weight")
    ours_bias = torch.cat([a.q_proj.bias.grad, a.k_proj.bias.grad, a.v_proj.bias.grad])
    _close(ours_bias, m.in_proj_bias.grad, dtype, "d in_proj_bias")
    _close(a.out_proj.weight.grad, m.out_proj.weight.grad, dtype, "d out_proj")


def test_from_torch_unbatched_no_bias_and_separate_weights():
    gen = torch.Generator().manual_seed(5)
    m = nn.MultiheadAttention(8, 4, bias=False, kdim=3, vdim=6, dtype=torch.float64).eval()
    _randomise(m, gen)
    ours = MultiHeadAttention.from_torch(m)
    q = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    v = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    for avg in (True, False):
        out_t, w_t = m(q, k, v, average_attn_weights=avg)
        out_o, w_o = ours(q, k, v, average_attn_weights=avg)
        assert out_o.shape == out_t.shape and w_o.shape == w_t.shape
        _close(out_o, out_t, torch.float64, "unbatched out")
        _close(w_o, w_t, torch.float64, "unbatched weights")


def test_from_torch_errors():
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(3, 3))
    ours = MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, batch_first=True))
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="is_causal"):
        ours(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B=2, S=5\), got \(2, 4\)"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must be \(L=5, S=5\) or \(B·H=4"):
        ours(x, x, x, attn_mask=torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="int64"):
        ours(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.long))


# -- MultiHeadAttention: configuration errors ----------------------------------------------------
def test_config_errors_name_values():
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by n_heads \(3\)"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match=r"n_heads \(12\) must be divisible by n_kv_heads \(5\)"):
        MultiHeadAttention(24, 12, 5)
    with pytest.raises(ValueError, match=r"kdim=5.*fused=False"):
        MultiHeadAttention(8, 2, kdim=5)
    with pytest.raises(ValueError, match="n_heads must be a positive int, got 0"):
        MultiHeadAttention(8, 0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        MultiHeadAttention(8, 2, dropout=1.5)
    with pytest.raises(TypeError, match="rope must be callable"):
        MultiHeadAttention(8, 2, rope=3)
    with pytest.raises(ValueError, match="norm must be 'rms' or 'layer', got 'batch'"):
        MultiHeadAttention(8, 2, qk_norm="batch")
    m = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"x must be \(B, Sq, d_model=8\), got shape \(2, 3, 7\)"):
        m(torch.randn(2, 3, 7))
    with pytest.raises(ValueError, match="cache is for self-attention"):
        m(torch.randn(1, 3, 8), torch.randn(1, 4, 8), cache=ContiguousCache(1, 8, 2, 4))


def test_cache_errors():
    cache = ContiguousCache(2, 6, 3, 4)
    with pytest.raises(ValueError, match=r"\(B=2, Hkv=3, S, D=4\), got \(2, 2, 1, 4\)"):
        cache.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    with pytest.raises(ValueError, match=r"v of shape \(2, 3, 1, 4\)"):
        cache.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 5))
    with pytest.raises(ValueError, match=r"max_len \(6\)"):
        cache.update(torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4))
    with pytest.raises(ValueError, match=r"shape \(S=2,\)"):
        cache.update(torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        ContiguousCache(1, 0, 1, 1)
    m = MultiHeadAttention(8, 2, 1)
    with pytest.raises(ValueError, match="Hkv=3"):
        m(torch.randn(2, 1, 8), cache=cache)
    k_all, _ = cache.update(torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4))
    assert k_all.shape == (2, 3, 4, 4) and len(cache) == 4
    cache.reset()
    assert len(cache) == 0


# -- MultiHeadAttention: semantics against a plain float64 formula -------------------------------
def _naive(m: MultiHeadAttention, x, context=None, allowed=None, positions=None):
    """Softmax attention written out from the module's weights (float64, no library attention)."""
    key = x if context is None else context
    if m.fused:
        q_out, kv_out = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        wq, wk, wv = m.qkv_proj.weight.split([q_out, kv_out, kv_out])
        bq, bk, bv = m.qkv_proj.bias.split([q_out, kv_out, kv_out])
    else:
        wq, wk, wv = m.q_proj.weight, m.k_proj.weight, m.v_proj.weight
        bq, bk, bv = m.q_proj.bias, m.k_proj.bias, m.v_proj.bias
    B, Sq, _ = x.shape
    Sk = key.shape[1]
    q = (x @ wq.T + bq).view(B, Sq, m.n_heads, -1).transpose(1, 2)
    k = (key @ wk.T + bk).view(B, Sk, m.n_kv_heads, -1).transpose(1, 2)
    v = (key @ wv.T + bv).view(B, Sk, m.n_kv_heads, -1).transpose(1, 2)
    if m.q_norm is not None:
        q, k = m.q_norm(q), m.k_norm(k)
    if m.rope is not None and context is None:
        pos = torch.arange(Sq) if positions is None else positions
        q, k = m.rope(q, pos), m.rope(k, pos)
    G = m.n_heads // m.n_kv_heads
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(m.head_dim)
    if m.alibi is not None:
        slopes = m.alibi.slopes.to(s.dtype)[:, None, None]
        s = s - slopes * (torch.arange(Sq)[:, None] + Sk - Sq - torch.arange(Sk)).abs()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    w = s.softmax(-1)
    out = (w @ v).transpose(1, 2).reshape(B, Sq, -1)
    if m.gate_proj is not None:  # gated attention: the query rows gate their merged heads
        out = out * torch.sigmoid(x @ m.gate_proj.weight.T + m.gate_proj.bias)
    return out @ m.out_proj.weight.T + m.out_proj.bias, w


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_kv_heads=3, fused=True),
        dict(n_kv_heads=1, fused=False, qk_norm="rms"),
        dict(n_kv_heads=6, fused=True, qk_norm="layer", alibi=True),
        dict(n_kv_heads=2, fused=False, rope=rope_like),
        dict(n_kv_heads=2, fused=True, qk_norm="rms", rope=rope_like, output_gate=True),
    ],
    ids=["gqa2-fused", "mqa-qknorm-rms", "mha-qknorm-layer-alibi", "gqa3-rope", "output-gate"],
)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_forward_matches_formula(kw, cross):
    gen = torch.Generator().manual_seed(_seed(sorted(kw), cross))
    m = MultiHeadAttention(24, 6, dtype=torch.float64, **kw)
    _randomise(m, gen)
    B, Sq, Sk = 2, 5, 9
    x = torch.randn(B, Sq, 24, generator=gen, dtype=torch.float64)
    ctx = torch.randn(B, Sk, 24, generator=gen, dtype=torch.float64) if cross else None
    allowed = None
    mask = None
    if not cross:
        mask = masks.causal()
        allowed = torch.ones(Sq, Sq, dtype=torch.bool).tril()
    out, w = m(x, ctx, mask=mask, return_weights=True)
    ref_out, ref_w = _naive(m, x, ctx, allowed)
    assert out.shape == (B, Sq, 24) and w.shape == (B, 6, Sq, Sk if cross else Sq)
    _close(out, ref_out, torch.float64, "out")
    _close(w, ref_w, torch.float64, "weights")


def test_gradients_match_formula():
    gen = torch.Generator().manual_seed(17)
    m = MultiHeadAttention(12, 6, 2, qk_norm="layer", rope=rope_like, dtype=torch.float64)
    _randomise(m, gen)
    x = torch.randn(2, 7, 12, generator=gen, dtype=torch.float64)
    r = torch.randn(2, 7, 12, generator=gen, dtype=torch.float64)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()
    grads = []
    for f in (lambda xi: m(xi, mask=masks.causal()), lambda xi: _naive(m, xi, None, allowed)[0]):
        m.zero_grad()
        xi = x.clone().requires_grad_()
        (f(xi) * r).sum().backward()
        grads.append([xi.grad] + [p.grad.clone() for p in m.parameters()])
    for name, a, b in zip(["x"] + [n for n, _ in m.named_parameters()], *grads):
        _close(a, b, torch.float64, f"d {name}")


def test_gqa_equals_mha_with_repeated_kv_weights():
    gen = torch.Generator().manual_seed(3)
    d, H, Hkv, D = 16, 4, 2, 4
    gqa = MultiHeadAttention(d, H, Hkv, fused=False, dtype=torch.float64)
    mha = MultiHeadAttention(d, H, fused=False, dtype=torch.float64)
    _randomise(gqa, gen)
    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            # kv head j serves query heads j*G .. j*G+G-1: repeat its rows G times in a row
            dst.weight.copy_(src.weight.view(Hkv, D, d).repeat_interleave(H // Hkv, 0).view(-1, d))
            dst.bias.copy_(src.bias.view(Hkv, D).repeat_interleave(H // Hkv, 0).view(-1))
    x = torch.randn(3, 7, d, generator=gen, dtype=torch.float64)
    _close(gqa(x, mask=masks.causal()), mha(x, mask=masks.causal()), torch.float64, "gqa vs mha")


def test_fused_equals_separate_for_self_and_cross():
    gen = torch.Generator().manual_seed(8)
    fused = MultiHeadAttention(12, 4, 2, dtype=torch.float64)
    sep = MultiHeadAttention(12, 4, 2, fused=False, dtype=torch.float64)
    _randomise(fused, gen)
    with torch.no_grad():
        for lin, w, b in zip(
            (sep.q_proj, sep.k_proj, sep.v_proj),
            fused.qkv_proj.weight.split([12, 6, 6]),
            fused.qkv_proj.bias.split([12, 6, 6]),
        ):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        sep.out_proj.load_state_dict(fused.out_proj.state_dict())
    x = torch.randn(2, 4, 12, generator=gen, dtype=torch.float64)
    ctx = torch.randn(2, 11, 12, generator=gen, dtype=torch.float64)
    _close(fused(x), sep(x), torch.float64, "self")
    _close(fused(x, ctx), sep(x, ctx), torch.float64, "cross")


@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("alibi", [False, True])
def test_cached_decode_equals_full_forward(chunk, alibi):
    gen = torch.Generator().manual_seed(chunk * 10 + alibi)
    m = MultiHeadAttention(
        16, 4, 2, rope=rope_like, qk_norm="rms", alibi=alibi, dtype=torch.float64
    ).eval()
    _randomise(m, gen)
    B, S = 2, 17
    x = torch.randn(B, S, 16, generator=gen, dtype=torch.float64)
    full = m(x, mask=masks.causal())
    cache = ContiguousCache(B, 32, 2, 4, dtype=torch.float64)
    steps = [m(x[:, i : i + chunk], mask=masks.causal(), cache=cache) for i in range(0, S, chunk)]
    assert len(cache) == S
    _close(torch.cat(steps, dim=1), full, torch.float64, f"chunks of {chunk}")


def test_layer_picks_the_cache_protocol_by_contract_not_by_attribute():
    """``InPlaceKVCache`` (``lengths`` + ``attend``) decides who attends: a contiguous cache that
    happens to have an ``attend`` method still goes through ``update``, and a cache of the
    in-place contract gets q, k, v (RoPE positions after its ``lengths``)."""
    gen = torch.Generator().manual_seed(_seed("protocol"))
    m = MultiHeadAttention(16, 4, 2, rope=rope_like, dtype=torch.float64).eval()
    _randomise(m, gen)
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)

    class CacheWithAttend(ContiguousCache):
        def attend(self, *args, **kwargs):
            raise AssertionError("a KVCache must be updated, not asked to attend")

    cache = CacheWithAttend(2, 8, 2, 4, dtype=torch.float64)
    _close(m(x, mask=masks.causal(), cache=cache), m(x, mask=masks.causal()), torch.float64)
    assert len(cache) == 5

    seen = {}

    class InPlace:
        lengths = torch.tensor([3, 3])

        def attend(self, q, k, v, *, mask=None, score_mod=None, scale=None, return_weights=False):
            seen["q"] = q
            return q

    m(x, cache=InPlace())
    q_at_3 = m.heads_qkv(x, positions=torch.arange(3, 8))[0]  # rows at positions 3..7
    _close(seen["q"], q_at_3, torch.float64, "positions after lengths 3")


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_per_sample(side, alibi):
    gen = torch.Generator().manual_seed(21 + (side == "left") + 2 * alibi)
    m = MultiHeadAttention(12, 3, rope=rope_like, alibi=alibi, dtype=torch.float64).eval()
    _randomise(m, gen)
    lengths, S = [6, 3, 1], 6
    rows = [torch.randn(1, n, 12, generator=gen, dtype=torch.float64) for n in lengths]
    x = torch.randn(len(lengths), S, 12, generator=gen, dtype=torch.float64)  # pads: noise
    keep = torch.zeros(len(lengths), S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        sl = slice(S - n, S) if side == "left" else slice(0, n)
        x[b, sl] = rows[b][0]
        keep[b, sl] = True
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)  # (B, S): positions from the padding
    mask = masks.causal() & keep[:, None, None, :]
    out = m(x, mask=mask, positions=positions)
    for b, n in enumerate(lengths):
        sl = slice(S - n, S) if side == "left" else slice(0, n)
        _close(out[b, sl], m(rows[b], mask=masks.causal())[0], torch.float64, f"row {b}")


def test_low_precision_and_int32_cache_slots():
    gen = torch.Generator().manual_seed(13)
    m = MultiHeadAttention(16, 4, 2, qk_norm="rms", rope=rope_like, dtype=torch.float64)
    _randomise(m, gen)
    x = torch.randn(2, 11, 16, generator=gen, dtype=torch.float64)
    want = m(x, mask=masks.causal())
    for dtype, tol in ((torch.bfloat16, 0.1), (torch.float16, 0.02)):
        got = copy.deepcopy(m).to(dtype)(x.to(dtype), mask=masks.causal())
        assert got.dtype == dtype and torch.isfinite(got).all()
        err = (got.double() - want).abs().max().item()
        assert err <= tol * want.abs().max().item(), f"{dtype}: max err {err:.3g}"
    cache = ContiguousCache(2, 11, 2, 4, dtype=torch.float64)
    first = m(x[:, :6], mask=masks.causal(), cache=cache)
    cache.update(cache.k[:, :, :6], cache.v[:, :, :6], torch.arange(6, dtype=torch.int32))
    _close(first, want[:, :6], torch.float64, "int32 slots rewrite in place")
    _close(m(x[:, 6:], mask=masks.causal(), cache=cache), want[:, 6:], torch.float64, "rest")


def test_attention_dropout_only_in_training():
    gen = torch.Generator().manual_seed(4)
    m = MultiHeadAttention(8, 2, dropout=0.5, dtype=torch.float64)
    _randomise(m, gen)
    x = torch.randn(2, 9, 8, generator=gen, dtype=torch.float64)
    m.eval()
    _close(m(x), _naive(m, x)[0], torch.float64, "eval: no dropout")
    m.train()
    assert (m(x) - m.eval()(x)).abs().max() > 1e-3


# -- norms, MLPs, blocks -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_rmsnorm_formula_in_float32(dtype):
    gen = torch.Generator().manual_seed(2)
    n = RMSNorm(13, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        n.weight.copy_(torch.randn(13, generator=gen))
    x = (torch.randn(3, 5, 13, generator=gen) * 1e-3).to(dtype)  # tiny values: fp16 x² underflows
    x64 = x.double()
    want = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    want = want.to(dtype).double() * n.weight.double()
    got = n(x)
    assert got.dtype == dtype
    tol = {torch.float16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert (got.double() - want).abs().max() <= tol * want.abs().max()
    with pytest.raises(ValueError, match="dim=13 but the input's last dim is 4"):
        n(torch.randn(2, 4, dtype=dtype))
    with pytest.raises(ValueError, match="eps must be > 0"):
        RMSNorm(4, eps=0.0)
    assert isinstance(make_norm("layer", 4), nn.LayerNorm) and LayerNorm is nn.LayerNorm


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rmsnorm_is_the_written_out_formula_bit_for_bit(dtype):
    # RMSNorm runs torch's fused rms_norm (one op instead of seven on the decode path): it must
    # round exactly as the float32 (float64) steps it replaced, and differentiate alike.
    gen = torch.Generator().manual_seed(5)
    n = RMSNorm(37, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        n.weight.copy_(torch.randn(37, generator=gen))
    x = (torch.randn(2, 7, 37, generator=gen) * 3).to(dtype).requires_grad_()
    acc = x.to(torch.float64 if dtype == torch.float64 else torch.float32)
    want = (acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * n.weight
    got = n(x)
    assert got.dtype == dtype and torch.equal(got, want)
    if dtype == torch.float64:
        g = torch.randn(got.shape, generator=gen, dtype=dtype)
        (gx_want,) = torch.autograd.grad(want, x, g)
        (gx_got,) = torch.autograd.grad(got, x, g)
        assert (gx_got - gx_want).abs().max() <= 1e-12 * gx_want.abs().max()


def test_mlp_and_swiglu_formulas():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    mlp, glu = MLP(8, 20, dtype=torch.float64), SwiGLU(8, 20, dtype=torch.float64)
    want = mlp.fc2(F.gelu(x @ mlp.fc1.weight.T + mlp.fc1.bias))
    _close(mlp(x), want, torch.float64, "mlp")
    g = x @ glu.gate.weight.T
    want = (g * torch.sigmoid(g) * (x @ glu.up.weight.T)) @ glu.down.weight.T
    _close(glu(x), want, torch.float64, "swiglu")


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_matches_torch_encoder_layer(norm_first):
    gen = torch.Generator().manual_seed(int(norm_first))
    E, H, F_ = 12, 3, 20
    t = nn.TransformerEncoderLayer(
        E,
        H,
        F_,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=norm_first,
        dtype=torch.float64,
    ).eval()
    _randomise(t, gen)
    attn = MultiHeadAttention.from_torch(t.self_attn).attn
    mlp = MLP(E, F_, dtype=torch.float64)
    mlp.fc1.load_state_dict(t.linear1.state_dict())
    mlp.fc2.load_state_dict(t.linear2.state_dict())
    block = EncoderBlock(attn, mlp, t.norm1, t.norm2, norm_first=norm_first).eval()
    x = torch.randn(2, 7, E, generator=gen, dtype=torch.float64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    want = t(x, src_key_padding_mask=pad)
    got = block(x, mask=~pad[:, None, None, :])
    _close(got[0], want[0], torch.float64, "row 0")
    _close(got[1, :5], want[1, :5], torch.float64, "row 1 (unpadded rows)")


def _decoder(gen, cross: bool):
    d, H = 16, 4
    parts = dict(
        self_attention=MultiHeadAttention(d, H, 2, rope=rope_like, dtype=torch.float64),
        mlp=SwiGLU(d, 24, dtype=torch.float64),
        self_norm=RMSNorm(d, dtype=torch.float64),
        mlp_norm=RMSNorm(d, dtype=torch.float64),
    )
    if cross:
        parts["cross_attention"] = MultiHeadAttention(
            d, H, kdim=10, vdim=10, fused=False, dtype=torch.float64
        )
        parts["cross_norm"] = RMSNorm(d, dtype=torch.float64)
    block = DecoderBlock(**parts).eval()
    _randomise(block, gen)
    return block


@pytest.mark.parametrize("cross", [False, True])
def test_decoder_block_cached_equals_full(cross):
    gen = torch.Generator().manual_seed(30 + cross)
    block = _decoder(gen, cross)
    x = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)
    ctx = torch.randn(2, 13, 10, generator=gen, dtype=torch.float64) if cross else None
    full = block(x, ctx)
    cache = ContiguousCache(2, 9, 2, 4, dtype=torch.float64)
    steps = [block(x[:, i : i + 4], ctx, cache=cache) for i in range(0, 9, 4)]
    _close(torch.cat(steps, 1), full, torch.float64, "decoder cache")
    # causal: changing a later token leaves earlier outputs unchanged
    x2 = x.clone()
    x2[:, 6:] = torch.randn(2, 3, 16, generator=gen, dtype=torch.float64)
    _close(block(x2, ctx)[:, :6], full[:, :6], torch.float64, "causality")


def test_decoder_block_errors():
    gen = torch.Generator().manual_seed(1)
    block = _decoder(gen, cross=False)
    with pytest.raises(ValueError, match="has cross_attention: False, context given: True"):
        block(torch.randn(1, 2, 16, dtype=torch.float64), torch.randn(1, 2, 10))
    with pytest.raises(ValueError, match="pass both or neither"):
        DecoderBlock(
            block.self_attention,
            block.mlp,
            RMSNorm(16),
            RMSNorm(16),
            cross_attention=MultiHeadAttention(16, 4),
        )


_SCALINGS = {
    "none": None,
    "linear": lambda: positions.Linear(2.0),
    "ntk": lambda: positions.NTK(3.0),
    # Dynamic NTK and LongRoPE choose frequencies from the call's length; below the original
    # length they are fixed, which is when a cache is consistent (transformers#25104).
    "dynamic": lambda: positions.DynamicNTK(2.0, original_max_position=64),
    "yarn": lambda: positions.YaRN(4.0, original_max_position=8),
    "llama3": lambda: positions.Llama3(8.0, original_max_position=8),
    "longrope": lambda: positions.LongRoPE([1.0, 1.5], [2.0, 4.0], original_max_position=64),
}


@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("scaling", sorted(_SCALINGS))
def test_cached_decode_equals_full_forward_with_real_rope(scaling, chunk):
    """The layer with selfattn.positions.RoPE: decoding through the cache equals one forward."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{scaling}{chunk}".encode()))
    make = _SCALINGS[scaling]
    rope = positions.RoPE(4, base=100.0, scaling=None if make is None else make())
    m = MultiHeadAttention(16, 4, 2, rope=rope, qk_norm="rms", dtype=torch.float64).eval()
    _randomise(m, gen)
    B, S = 2, 19
    x = torch.randn(B, S, 16, generator=gen, dtype=torch.float64)
    full = m(x, mask=masks.causal())
    cache = ContiguousCache(B, 32, 2, 4, dtype=torch.float64)
    steps = [m(x[:, i : i + chunk], mask=masks.causal(), cache=cache) for i in range(0, S, chunk)]
    _close(torch.cat(steps, dim=1), full, torch.float64, f"{scaling}, chunks of {chunk}")
    # and the rotation really happens: the same layer without RoPE gives another answer
    m.rope = None
    assert not torch.allclose(m(x, mask=masks.causal()), full)


@pytest.mark.parametrize("need_weights", [False, True])
def test_from_torch_is_causal_hint_alone(need_weights):
    """is_causal with only the causal attn_mask: ours uses causal() and still equals torch."""
    gen = torch.Generator().manual_seed(5 + need_weights)
    m = nn.MultiheadAttention(12, 3, batch_first=True, dtype=torch.float64)
    _randomise(m, gen)
    m.eval()
    ours = MultiHeadAttention.from_torch(m).eval()
    x = torch.randn(2, 9, 12, generator=gen, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(9, dtype=torch.float64)
    want = m(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
    got = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
    _close(got[0], want[0], torch.float64, "out")
    if need_weights:
        _close(got[1], want[1], torch.float64, "weights")


# -- the paged cache through the layer ----------------------------------------------------------
def _paged(B: int, P: int = 3, pages: int = 40):
    from selfattn.cache import PagedCache

    return PagedCache(pages, P, 2, 4, max_seqs=B, max_pages_per_seq=10, dtype=torch.float64)


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("mask_kind", ["causal", "window", "tensor"])
def test_paged_view_ragged_equals_contiguous_cache(mask_kind, alibi):
    """Sequences of different lengths decode together through one PagedCache view; each row
    equals the same sequence run alone through a ContiguousCache (RoPE at its own positions)."""
    gen = torch.Generator().manual_seed(_seed("paged", mask_kind, alibi))
    rope = positions.RoPE(4, base=100.0)
    m = MultiHeadAttention(16, 4, 2, rope=rope, qk_norm="rms", alibi=alibi, dtype=torch.float64)
    m = m.eval()
    _randomise(m, gen)
    prompts, steps = [5, 1, 8], [1, 2, 1, 3, 1]  # ragged prompts; Sq of each joint step
    B = len(prompts)
    xs = [torch.randn(1, n + sum(steps), 16, generator=gen, dtype=torch.float64) for n in prompts]
    allowed = torch.rand(B, 1, 32, 32, generator=gen) < 0.7  # (query pos, key pos), tensor case
    allowed |= torch.eye(32, dtype=torch.bool)  # every query may see itself: no empty row
    base = {"causal": masks.causal(), "window": masks.sliding_window(4)}.get(mask_kind)
    paged = _paged(B)
    ids = paged.add_sequences(B)
    refs = [ContiguousCache(1, 32, 2, 4, dtype=torch.float64) for _ in range(B)]
    for b, n in enumerate(prompts):  # prefill each sequence alone (a view of one)
        got = m(xs[b][:, :n], mask=masks.causal(), cache=paged.view([ids[b]]))
        _close(got, m(xs[b][:, :n], mask=masks.causal(), cache=refs[b]), torch.float64, "prefill")
    view, done = paged.view(ids), list(prompts)
    for Sq in steps:
        x = torch.cat([xs[b][:, d : d + Sq] for b, d in enumerate(done)])  # (B, Sq, 16)
        ends = [d + Sq for d in done]
        if mask_kind == "tensor":  # row i of sequence b = its query at position ends[b] - Sq + i
            rows = torch.stack([allowed[b, :, e - Sq : e, : max(ends)] for b, e in enumerate(ends)])
            mask = masks.causal() & masks.from_tensor(rows)
        else:
            mask = base
        out = m(x, mask=mask, cache=view)
        for b, e in enumerate(ends):
            one = base if mask_kind != "tensor" else masks.causal() & allowed[b, :, e - Sq : e, :e]
            want = m(xs[b][:, done[b] : e], mask=one, cache=refs[b])
            _close(out[b : b + 1], want, torch.float64, f"{mask_kind} step Sq={Sq} row {b}")
        done = ends
    assert view.lengths.tolist() == done
    with pytest.raises(ValueError, match="different lengths"):
        _ = view.length


def test_decoder_block_left_padded_paged_equals_contiguous():
    """A decoder layer with left padding, equal lengths, one cache per layer (how a model
    generates): PagedCache(...).view(ids) gives what ContiguousCache gives, prefill and decode."""
    gen = torch.Generator().manual_seed(_seed("decoder paged"))
    block = _decoder(gen, cross=False)
    B, S, new = 3, 6, 4
    x = torch.randn(B, S + new, 16, generator=gen, dtype=torch.float64)
    keep = torch.ones(B, S + new, dtype=torch.bool)
    keep[1, :2] = keep[2, :5] = False  # left padding: rows 1 and 2 have shorter prompts
    pos = (keep.long().cumsum(-1) - 1).clamp(min=0)  # (B, S + new)
    paged, contiguous = _paged(B, P=4), ContiguousCache(B, 16, 2, 4, dtype=torch.float64)
    view = paged.view(paged.add_sequences(B))
    for cache in (view, contiguous):
        cache_out = [
            block(x[:, :S], mask=keep[:, None, None, :S], positions=pos[:, :S], cache=cache)
        ]
        for t in range(S, S + new):
            m = keep[:, None, None, : t + 1]
            cache_out.append(
                block(x[:, t : t + 1], mask=m, positions=pos[:, t : t + 1], cache=cache)
            )
        if cache is view:
            got = torch.cat(cache_out, 1)
    want = torch.cat(cache_out, 1)
    _close(got[keep], want[keep], torch.float64, "left-padded decoder block")
    assert view.length == S + new
    # The sliding-window variant, and positions by default (the sequence's own length).
    view.reset()
    assert paged.pool.num_free == paged.num_pages
    layer = block.self_attention
    contiguous.reset()
    for cache in (view, contiguous):
        outs = [layer(x[:, :S], mask=masks.sliding_window(3), cache=cache)]
        outs += [
            layer(x[:, t : t + 1], mask=masks.sliding_window(3), cache=cache)
            for t in range(S, S + new)
        ]
        if cache is view:
            got = torch.cat(outs, 1)
    _close(got, torch.cat(outs, 1), torch.float64, "sliding window, default positions")


def test_paged_view_weights_and_errors():
    gen = torch.Generator().manual_seed(_seed("paged weights"))
    m = MultiHeadAttention(16, 4, 2, rope=rope_like, dtype=torch.float64).eval()
    _randomise(m, gen)
    paged = _paged(2)
    a, b = paged.add_sequences(2)
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    m(x[:1, :3], mask=masks.causal(), cache=paged.view([a]))  # a holds 3 tokens, b none
    out, w = m(x[:, 3:5], mask=masks.causal(), cache=paged.view([a, b]), return_weights=True)
    assert w.shape == (2, 4, 2, 5)
    ref = ContiguousCache(1, 8, 2, 4, dtype=torch.float64)
    m(x[:1, :3], mask=masks.causal(), cache=ref)
    out_a, w_a = m(x[:1, 3:5], mask=masks.causal(), cache=ref, return_weights=True)
    _close(out[:1], out_a, torch.float64, "out a")
    _close(w[:1], w_a, torch.float64, "weights a")
    _, w_b = m(x[1:, 3:5], mask=masks.causal(), return_weights=True)
    _close(w[1:, :, :, :2], w_b, torch.float64, "weights b")
    assert (w[1:, :, :, 2:] == 0).all()  # past b's end
    # A bias tensor in query-row order, ragged: row i of each sequence is its new token i.
    bias = torch.randn(2, 1, 2, 7, generator=gen, dtype=torch.float64)
    out = m(x[:, 3:5], mask=masks.causal(), score_mod=bias, cache=paged.view([a, b]))
    want_a = m(x[:1, 3:5], mask=masks.causal(), score_mod=bias[:1, :, :, :7], cache=ref)
    ref_b = ContiguousCache(1, 8, 2, 4, dtype=torch.float64)
    m(x[1:, 3:5], mask=masks.causal(), cache=ref_b)
    want_b = m(x[1:, 3:5], mask=masks.causal(), score_mod=bias[1:, :, :, :4], cache=ref_b)
    _close(out, torch.cat([want_a, want_b]), torch.float64, "row-ordered bias, ragged")
    view = paged.view([a, b])
    with pytest.raises(ValueError, match="q_offset=0 cannot be combined"):
        m(x[:, :1], cache=view, q_offset=0)
    with pytest.raises(ValueError, match=r"holds 2 sequence.* but x has batch B=1"):
        m(x[:1, :1], cache=view)
    plain = MultiHeadAttention(16, 4, 2, dtype=torch.float64).eval()  # no rope: attend checks
    with pytest.raises(ValueError, match=r"q must be \(B=2, Hq, Sq, D\)"):
        plain(x[:1, :1], cache=view)
    drop = MultiHeadAttention(16, 4, 2, dropout=0.1, dtype=torch.float64).train()
    with pytest.raises(ValueError, match=r"dropout \(0.1\) is not supported"):
        drop(x[:, :1], cache=view)
    with pytest.raises(TypeError, match=r"q is torch\.float32 but the cache stores torch\.float64"):
        copy.deepcopy(plain).float()(x[:, :1].float(), cache=view)
    wide = masks.from_tensor(torch.ones(2, 1, 1, 4, dtype=torch.bool))  # 4 < 8 keys after a step
    with pytest.raises(
        ValueError, match=r"does not broadcast to \(B, Hq, Sq, Sk\) = \(2, 4, 1, 8\)"
    ):
        plain(x[:, :1], mask=wide, cache=view)
    assert paged.seq_lens([a, b]).tolist() == [7, 4]  # failed calls appended nothing
