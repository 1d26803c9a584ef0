"""The attention variants: QK-norm (Qwen-3, OLMo-2), Gemma-3's two RoPE
bases, Llama-4 (chunked RoPE / NoPE layers, query temperature, L2 qk-norm, MoE), differential
attention (DiffLlama); layers against float64 oracles, families against
transformers (tiny perturbed random configs saved with save_pretrained)."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn import masks  # noqa: E402
from selfattn.cache import StaticCache  # noqa: E402
from selfattn.models.decoder import DecoderConfig  # noqa: E402
from selfattn.models.generate import generate  # noqa: E402
from selfattn.nn import DiffAttention, MultiHeadAttention  # noqa: E402
from selfattn.nn.attention import QueryTemperature  # noqa: E402
from selfattn.testing import GRAD_FACTOR, assert_close_to_reference  # noqa: E402
from tests.models.test_models_decoder import (  # noqa: E402
    _COMMON,
    RTOL,
    hf_positions,
    left_padded,
    rel_err,
    tiny_pair,
)

# family -> (transformers config class name, options). Windows of 5 are shorter than the test
# sequences; Gemma-3's two bases are far apart, so a layer rotating with the wrong one fails.
VARIANTS = {
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=24)),
    "olmo2": ("Olmo2Config", dict(_COMMON, eos_token_id=None)),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            _COMMON,
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=5,
            sliding_window_pattern=3,  # 2 sliding : 1 global (Gemma-3's own is 5 : 1)
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e2},
            },
        ),
    ),
    "diffllama": ("DiffLlamaConfig", dict(_COMMON, num_attention_heads=8, num_key_value_heads=4)),
    # Layers: chunked RoPE (dense MLP), global NoPE (MoE), twice. Chunks of 4 and a temperature
    # floor of 3 make both change within the test sequences.
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            _COMMON,
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=48,
            intermediate_size_mlp=80,
            num_local_experts=3,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            attention_chunk_size=4,
            no_rope_layer_interval=2,
            floor_scale=3,
            attn_scale=0.3,
            eos_token_id=None,
            bos_token_id=None,
        ),
    ),
}
NEW = 9  # generated tokens: past the windows of 5, so rings wrap

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return {
        f: tiny_pair(f, tmp_path_factory.mktemp(f), seed=20 + i, families=VARIANTS)
        for i, f in enumerate(VARIANTS)
    }


# -- families against transformers ----------------------------------------------------------------


@pytest.mark.parametrize("family", list(VARIANTS))
def test_logits_match_transformers_left_padded(pairs, family):
    hf, ours = pairs[family]
    ids, mask = left_padded(3, 11, [4, 0, 1], seed=31)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(ids, attention_mask=mask)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


@pytest.mark.parametrize("cache", ["static", "window", "paged"])
@pytest.mark.parametrize("family", list(VARIANTS))
def test_greedy_equals_transformers(pairs, family, cache):
    hf, ours = pairs[family]
    ids, mask = left_padded(2, 6, [3, 0], seed=32)
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    got = generate(ours, ids, NEW, attention_mask=mask, cache=cache, page_size=4)
    assert torch.equal(got, ref)


def test_llama4_logits_match_transformers(pairs):
    """Chunked RoPE layers, NoPE layers with the query temperature, the MoE (unpadded)."""
    hf, ours = pairs["llama4_text"]
    ids, mask = left_padded(3, 13, [0, 0, 0], seed=33)
    with torch.no_grad():
        theirs = hf(ids).logits
        got = ours(ids)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


def test_llama4_ragged_paged_decode_matches_each_sequence_alone(pairs):
    """Sequences of a paged cache at different lengths decode together (no mask): each row's
    chunks and query temperatures follow its own length."""
    _, ours = pairs["llama4_text"]
    ids, _ = left_padded(2, 10, [0, 0], seed=35)
    lens = (9, 5)
    with torch.no_grad():
        cache = ours.make_cache("paged", 2, 12, page_size=4)
        for b, n in enumerate(lens):
            ours(ids[b : b + 1, :n], cache=cache.cache.view([cache.seq_ids[b]]))
        step = torch.stack([ids[0, lens[0]], ids[1, lens[1]]])[:, None]  # (B, 1)
        got = ours(step, cache=cache)[:, -1]
        for b, n in enumerate(lens):
            full = ours(ids[b : b + 1, : n + 1])[0, -1]
            assert rel_err(got[b], full, torch.ones_like(full, dtype=torch.bool)) <= RTOL


def test_query_temperature_values():
    """1 until position floor_scale - 1, then 1 + attn_scale · log1p(floor((p + 1) / floor))."""
    t = QueryTemperature(4, 0.5)(torch.arange(12))
    want = [1.0] * 3 + [1 + 0.5 * math.log(2)] * 4 + [1 + 0.5 * math.log(3)] * 4
    want += [1 + 0.5 * math.log(4)]
    torch.testing.assert_close(t, torch.tensor(want))
    with pytest.raises(ValueError, match="floor_scale"):
        QueryTemperature(0, 0.1)


@pytest.mark.parametrize(
    "family, overrides",
    [
        (  # Gemma-3 4B and up: linear RoPE scaling on the global layers only
            "gemma3_text",
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e2},
                }
            ),
        ),
        ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    ],
    ids=["gemma3-linear-global", "qwen3-windowed-upper-layers"],
)
def test_family_options_match_transformers(tmp_path, family, overrides):
    hf, ours = tiny_pair(family, tmp_path, seed=36, families=VARIANTS, **overrides)
    c = ours.config
    assert c.rope_scaling is not None if family == "gemma3_text" else c.window(1) == 4
    ids, mask = left_padded(2, 11, [3, 0], seed=36)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(ids, attention_mask=mask)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


def test_family_options_are_mapped(pairs):
    """Each family gets its variant (and nothing else's)."""
    c = {f: ours.config for f, (_, ours) in pairs.items()}
    assert (c["qwen3"].qk_norm, c["qwen3"].qk_norm_scope, c["qwen3"].post_norm) == (
        "rms",
        "head",
        False,
    )
    assert (c["olmo2"].qk_norm_scope, c["olmo2"].post_norm) == ("all", True)
    assert c["gemma3_text"].rope_local_base == 1e2 and c["gemma3_text"].rope_base == 1e6
    assert c["gemma3_text"].layer_types == ("sliding_attention",) * 2 + ("full_attention",)
    assert c["diffllama"].diff_attention and c["diffllama"].value_dim == 2 * c["diffllama"].head_dim
    l4 = c["llama4_text"]
    assert l4.nope_layers == (False, True) * 2 and l4.moe_layers == (1, 3)
    assert l4.layer_types == ("chunked_attention", "full_attention") * 2
    assert l4.rope_interleaved and l4.temperature == (3, 0.3)
    gemma = pairs["gemma3_text"][1]
    assert gemma.layers[0].self_attention.inner.rope is gemma.rope_local
    assert gemma.layers[2].self_attention.inner.rope is gemma.rope


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(diff_attention=True, n_kv_heads=1), "n_kv_heads must be even"),
        (dict(sandwich_norm=True, post_norm=True), "exclude each other"),
        (dict(qk_norm="l3"), "qk_norm"),
        (dict(qk_norm="rms", qk_norm_scope="token"), "qk_norm_scope"),
        (dict(layer_types=("chunked_attention",)), "attention_chunk_size is None"),
    ],
)
def test_variant_config_validation(kw, match):
    base = dict(vocab_size=8, d_model=16, n_layers=1, n_heads=2, d_ff=8)
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**{**base, **kw})


# -- QK-norm ---------------------------------------------------------------------------------------


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _causal_softmax_out(q, k, v, scale):
    """``softmax(q kᵀ · scale, causal) v`` with the kv heads repeated for GQA, written out."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    S = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    return s.softmax(-1) @ v


def _qk_norm_oracle(m: MultiHeadAttention, x, scope: str, dtype):
    """The layer's output computed in ``dtype`` from its parameters, written out (no selfattn
    attention): float64 is the oracle, float32 the naive rounding baseline."""
    p = {n: t.detach().to(dtype) for n, t in m.named_parameters()}
    x = x.to(dtype)
    B, S, _ = x.shape
    H, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim
    q, k, v = (x @ p["qkv_proj.weight"].T + p["qkv_proj.bias"]).split([H * D, Hkv * D, Hkv * D], -1)
    eps = m.q_norm.eps
    if scope == "all":
        q, k = _rms(q, p["q_norm.weight"], eps), _rms(k, p["k_norm.weight"], eps)
    q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
    if scope == "head":
        q, k = _rms(q, p["q_norm.weight"], eps), _rms(k, p["k_norm.weight"], eps)
    out = _causal_softmax_out(q, k, v, D**-0.5).transpose(1, 2).reshape(B, S, -1)
    return out @ p["out_proj.weight"].T + p["out_proj.bias"]


def _check_layer_against_oracle(m, oracle, x):
    """Output and input gradient of ``m(x, causal)`` against ``oracle(x, dtype)`` by the ratio
    rule (fwd 2x, grads 3x the float32 formula's error)."""
    x = x.detach().requires_grad_()
    got = m(x, mask=masks.causal())
    x64, x32 = (x.detach().to(d).requires_grad_() for d in (torch.float64, torch.float32))
    ref, naive = oracle(x64, torch.float64), oracle(x32, torch.float32)
    assert_close_to_reference(got, ref, naive)
    g = torch.randn_like(got)
    grads = [torch.autograd.grad(y, t, g.to(y.dtype))[0] for y, t in ((got, x), (ref, x64))]
    (dnaive,) = torch.autograd.grad(naive, x32, g)
    assert_close_to_reference(grads[0], grads[1], dnaive, factor=GRAD_FACTOR, what="dx")


# The CPU backends a layer's call can take (flex compiles per shape on CPU: seconds per test).
BACKENDS = ["reference", "chunked", "sdpa"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scope", ["head", "all"])
def test_qk_norm_matches_float64_oracle_with_gradients(scope, backend):
    torch.manual_seed(41)
    m = MultiHeadAttention(
        40, 4, 2, qk_norm="rms", qk_norm_scope=scope, qk_norm_eps=1e-5, backend=backend
    )
    with torch.no_grad():  # norms off their init, so a norm over the wrong width shows
        m.q_norm.weight.uniform_(0.5, 1.5)
        m.k_norm.weight.uniform_(0.5, 1.5)
    assert m.q_norm.weight.shape == ((40,) if scope == "all" else (10,))
    x = torch.randn(2, 7, 40)
    _check_layer_against_oracle(m, lambda t, d: _qk_norm_oracle(m, t, scope, d), x)


# -- differential attention ------------------------------------------------------------------------


def _diff_oracle(m: DiffAttention, x, dtype):
    """Differential attention from its definition in ``dtype``: per pair ``(h, h + Hq/2)`` the
    difference of the two softmax maps times the pair's ``2·D`` value, RMS-normed, scaled."""
    p = {n: t.to(dtype) for n, t in m.named_parameters()}
    x = x.to(dtype)
    B, S, _ = x.shape
    H, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim
    q, k, v = (x @ p["qkv_proj.weight"].T + p["qkv_proj.bias"]).split([H * D, Hkv * D, Hkv * D], -1)
    q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
    lam = (
        torch.exp((p["lambda_q1"] * p["lambda_k1"]).sum())
        - torch.exp((p["lambda_q2"] * p["lambda_k2"]).sum())
        + m.lambda_init
    )
    group = H // Hkv
    heads = []
    for h in range(H // 2):
        j = (h // group) % (Hkv // 2)  # the value pair of kv heads j and j + Hkv/2
        value = torch.cat([v[:, j], v[:, j + Hkv // 2]], -1)[:, None]  # (B, 1, S, 2D)
        a = _causal_softmax_out(q[:, h : h + 1], k[:, h // group][:, None], value, D**-0.5)
        hb = h + H // 2
        b = _causal_softmax_out(q[:, hb : hb + 1], k[:, hb // group][:, None], value, D**-0.5)
        d = a - lam * b
        heads.append(d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + m.head_norm.eps))
    out = torch.cat(heads, 1) * (1 - m.lambda_init)  # (B, H/2, S, 2D)
    out = out.transpose(1, 2).reshape(B, S, -1)
    return out @ p["out_proj.weight"].T + p["out_proj.bias"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_diff_attention_matches_float64_oracle_with_gradients(n_heads, n_kv_heads, backend):
    torch.manual_seed(43)
    m = DiffAttention(
        48, n_heads, n_kv_heads, head_dim=6, lambda_init=0.35, lambda_std=0.3, backend=backend
    )
    x = torch.randn(2, 9, 48)
    _check_layer_against_oracle(m, lambda t, d: _diff_oracle(m, t, d), x)


def test_diff_attention_lambda_gradcheck():
    """The four λ vectors' gradients (float64 gradcheck on a small layer)."""
    torch.manual_seed(44)
    m = DiffAttention(8, 2, 2, lambda_init=0.2, lambda_std=0.5, dtype=torch.float64)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    names = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
    params = [getattr(m, n).detach().clone().requires_grad_() for n in names]

    def f(*ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x,), {"mask": masks.causal()})

    assert torch.autograd.gradcheck(f, params)


def test_diff_attention_rejects_odd_kv_heads():
    with pytest.raises(ValueError, match="n_kv_heads must be even"):
        DiffAttention(24, 3, 3)


def test_diff_attention_cached_decode_equals_full_forward():
    """The 2·D values go through a cache like any other layer's."""
    torch.manual_seed(45)
    m = DiffAttention(32, 4, 2)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        full = m(x, mask=masks.causal())
        cache = StaticCache(2, 8, 2, m.head_dim, m.value_dim)
        parts = [m(x[:, :4], mask=masks.causal(), cache=cache)]
        parts += [m(x[:, i : i + 1], mask=masks.causal(), cache=cache) for i in range(4, 7)]
    assert rel_err(torch.cat(parts, 1), full, torch.ones_like(full, dtype=torch.bool)) <= RTOL
