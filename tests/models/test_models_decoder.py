"""Decoder-only LMs (selfattn.models.decoder) against transformers.

Random-initialised tiny transformers models of each family are perturbed (so norms, biases and
Gemma's ``1 + weight`` norms are all off their init), saved as safetensors and loaded with
``from_pretrained``; fp32 logits are compared on left-padded batches, with every cache kind for a
prefill-then-decode run, and for each RoPE scaling of ``rope_parameters``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.cache import PagedCacheView  # noqa: E402
from selfattn.models.decoder import (  # noqa: E402
    GPT2,
    CausalLM,
    DecoderConfig,
    LayerCaches,
    Llama,
)
from selfattn.models.hub import UnsupportedConfigError, from_pretrained  # noqa: E402
from selfattn.testing import perturb_parameters  # noqa: E402

RTOL = 1e-4  # max |ours - theirs| / max |theirs| over real tokens, fp32 (the bar)
VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
)
# family -> (transformers config class name, options). Windows of 5 are shorter than the test
# sequences, so windowed layers really drop keys.
FAMILIES = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=80)),
    "llama": ("LlamaConfig", dict(_COMMON, head_dim=24, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(_COMMON, sliding_window=5)),
    "qwen2": ("Qwen2Config", dict(_COMMON, num_key_value_heads=1)),
    "gemma2": (
        "Gemma2Config",
        dict(_COMMON, head_dim=16, sliding_window=5, query_pre_attn_scalar=24),
    ),
}


pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_pair(family: str, folder, seed: int = 0, *, families=FAMILIES, **overrides):
    """``(transformers model, our model)`` of a tiny random ``family`` config (from
    ``families``: name -> (config class name, options)), in eval mode."""
    cls_name, options = families[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = getattr(transformers, cls_name)(**{**options, **overrides})
        cfg.pad_token_id = None
        torch.manual_seed(seed)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        hf.generation_config.eos_token_id = None  # generate() stops only where a test says
        perturb_parameters(hf, seed)
        transformers.logging.set_verbosity_error()
        hf.save_pretrained(folder, safe_serialization=True)
    return hf, from_pretrained(folder)


def left_padded(B: int, S: int, pads, seed: int):
    """Random ``input_ids (B, S)`` and a 0/1 mask with ``pads[b]`` leading zeros."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    return ids, mask


def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    """transformers' generate() positions: cumsum - 1, padding at 1 (never read)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def rel_err(ours: torch.Tensor, theirs: torch.Tensor, keep: torch.Tensor) -> float:
    return float((ours - theirs).abs()[keep].max() / theirs.abs()[keep].max())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """One perturbed (transformers, ours) pair per family, built once for the module."""
    return {f: tiny_pair(f, tmp_path_factory.mktemp(f), seed=i) for i, f in enumerate(FAMILIES)}


# -- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_left_padded(pairs, family):
    hf, ours = pairs[family]
    ids, mask = left_padded(3, 11, [4, 0, 1], seed=1)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(ids, attention_mask=mask)
    assert got.shape == (3, 11, VOCAB)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


@pytest.mark.parametrize(
    "options",
    [{"scale_attn_by_inverse_layer_idx": True}, {"scale_attn_weights": False}],
    ids=["inverse-layer-scale", "unscaled"],
)
def test_gpt2_attention_scale_options_match_transformers(tmp_path, options):
    hf, ours = tiny_pair("gpt2", tmp_path, seed=11, **options)
    ids, mask = left_padded(2, 9, [2, 0], seed=11)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(ids, attention_mask=mask)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


def test_qwen2_windowed_upper_layers_match_transformers(tmp_path):
    """Qwen2's use_sliding_window: layers from max_window_layers on are windowed."""
    hf, ours = tiny_pair(
        "qwen2", tmp_path, seed=9, use_sliding_window=True, sliding_window=4, max_window_layers=1
    )
    assert ours.config.layer_types == ("full_attention", "sliding_attention")
    ids, mask = left_padded(2, 11, [3, 0], seed=9)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(ids, attention_mask=mask)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_logits_match_transformers_with_holes(pairs, family):
    """A mask that is not left padding (a hole mid-row) takes the bool key-mask path."""
    hf, ours = pairs[family]
    ids, mask = left_padded(2, 9, [0, 2], seed=2)
    mask[0, 3] = 0
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask, position_ids=pos)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


@pytest.mark.parametrize("kind", ["static", "window", "paged"])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt2"])
def test_prefill_then_decode_equals_full_forward(pairs, family, kind):
    """Chunks of 5, 1, 3, 1 tokens through a cache give the full forward's logits."""
    _, ours = pairs[family]
    ids, mask = left_padded(2, 10, [3, 0], seed=3)
    with torch.no_grad():
        full = ours(ids, attention_mask=mask)
        cache = ours.make_cache(kind, 2, 12, page_size=4)
        parts, n = [], 0
        for size in (5, 1, 3, 1):
            parts.append(
                ours(ids[:, n : n + size], attention_mask=mask[:, : n + size], cache=cache)
            )
            n += size
    assert isinstance(cache, PagedCacheView if kind == "paged" else LayerCaches)
    assert cache.length == 10
    assert rel_err(torch.cat(parts, 1), full, mask.bool()) <= RTOL


@pytest.mark.parametrize("family", ["gpt2", "mistral"])
def test_ragged_paged_decode_matches_each_sequence_alone(pairs, family):
    """The serving case: sequences of a paged cache at different lengths decode together
    (no mask; positions follow each sequence's own length)."""
    _, ours = pairs[family]
    ids, _ = left_padded(2, 9, [0, 0], seed=12)
    lens = (8, 5)
    with torch.no_grad():
        cache = ours.make_cache("paged", 2, 12, page_size=4)
        for b, n in enumerate(lens):  # prefill each sequence alone, through a one-row view
            alone = cache.cache.view([cache.seq_ids[b]])  # the same PagedKV, one sequence
            ours(ids[b : b + 1, :n], cache=alone)
        step = torch.stack([ids[0, lens[0]], ids[1, lens[1]]])[:, None]  # (B, 1)
        got = ours(step, cache=cache)[:, -1]
        for b, n in enumerate(lens):
            full = ours(ids[b : b + 1, : n + 1])[0, -1]
            assert rel_err(got[b], full, torch.ones_like(full, dtype=torch.bool)) <= RTOL


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "yarn-untruncated": {  # gpt-oss's: the correction range is not rounded
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [1.0 + 3.0 * i for i in range(6)],
        "original_max_position_embeddings": 8,
    },
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_scalings_match_transformers(tmp_path, case):
    """Each rope_type of transformers 5's rope_parameters; 13 tokens > max_position 10 so the
    length-dependent scalings (dynamic, longrope) switch to their long frequencies."""
    params = {"rope_theta": 5000.0, **ROPE_CASES[case]}
    hf, ours = tiny_pair(
        "llama",
        tmp_path,
        seed=5,
        head_dim=12,
        max_position_embeddings=10,
        rope_parameters=params,
        tie_word_embeddings=False,
    )
    ids, mask = left_padded(1, 13, [0], seed=4)
    with torch.no_grad():
        theirs = hf(ids).logits
        got = ours(ids)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


def test_loss_gradients_match_transformers(pairs):
    """Training is a use: next-token loss gradients equal transformers' (fp32)."""
    hf, ours = pairs["qwen2"]
    ids, mask = left_padded(2, 8, [2, 0], seed=6)
    labels = ids.masked_fill(mask == 0, -100)
    hf.zero_grad()
    hf(ids, attention_mask=mask, position_ids=hf_positions(mask), labels=labels).loss.backward()
    ours.zero_grad()
    logits = ours(ids, attention_mask=mask)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    loss.backward()
    attn = hf.model.layers[0].self_attn
    grads = [
        (
            torch.cat([attn.q_proj.weight.grad, attn.k_proj.weight.grad, attn.v_proj.weight.grad]),
            ours.layers[0].self_attention.qkv_proj.weight.grad,
        ),
        (
            torch.cat([attn.q_proj.bias.grad, attn.k_proj.bias.grad, attn.v_proj.bias.grad]),
            ours.layers[0].self_attention.qkv_proj.bias.grad,
        ),
        (hf.model.layers[1].mlp.down_proj.weight.grad, ours.layers[1].mlp.down.weight.grad),
    ]
    for a, b in grads:
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())
    ours.zero_grad()


# -- loading ------------------------------------------------------------------------------------


def test_families_and_tied_embeddings(pairs):
    assert isinstance(pairs["gpt2"][1], GPT2)
    for f in ("llama", "mistral", "qwen2", "gemma2"):
        assert isinstance(pairs[f][1], Llama)
    for f in ("gpt2", "llama", "gemma2"):  # tied: one tensor, not a copy
        ours = pairs[f][1]
        assert ours.lm_head.weight is ours.embed.weight
    ours = pairs["mistral"][1]
    assert ours.lm_head.weight is not ours.embed.weight
    assert ours.config.layer_types == ("sliding_attention",) * 2
    assert pairs["gemma2"][1].config.layer_types == ("sliding_attention", "full_attention")
    assert pairs["qwen2"][1].config.sliding_window is None


def test_window_cache_uses_rings_only_on_windowed_layers(pairs):
    from selfattn.cache import SlidingWindowCache, StaticCache

    cache = pairs["gemma2"][1].make_cache("window", 2, 40)
    assert [type(c) for c in cache.layers] == [SlidingWindowCache, StaticCache]
    assert cache.layers[0].window == 5
    cache = pairs["llama"][1].make_cache("window", 2, 40)
    assert all(type(c) is StaticCache for c in cache.layers)


def _config_dict(family: str, **overrides) -> dict:
    cls_name, options = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = getattr(transformers, cls_name)(**options).to_dict()
    return json.loads(json.dumps({**cfg, **overrides}))


@pytest.mark.parametrize(
    ("family", "overrides", "key"),
    [
        ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}},
            "rope_parameters",
        ),
    ],
)
def test_unsupported_options_raise(family, overrides, key):
    cls = GPT2 if family == "gpt2" else Llama
    with pytest.raises(UnsupportedConfigError, match=key):
        cls.from_config(_config_dict(family, **overrides))


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(n_heads=6, n_kv_heads=4), r"n_heads \(6\) must be divisible by n_kv_heads \(4\)"),
        (dict(d_model=30, n_heads=4), r"d_model \(30\) must be divisible by n_heads \(4\)"),
        (dict(layer_types=("full_attention",)), "layer_types must list 2 entries"),
        (dict(layer_types=("sliding_attention",) * 2), "sliding_window is None"),
        (dict(activation="tanhh"), "activation 'tanhh'"),
        (dict(positions="alibi"), "positions must be 'rope' or 'learned'"),
        (dict(final_softcap=0.0), "final_softcap must be > 0"),
        (dict(vocab_size=0), "vocab_size must be a positive int"),
    ],
)
def test_config_validation(kw, match):
    base = dict(vocab_size=16, d_model=32, n_layers=2, n_heads=4, d_ff=40)
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**{**base, **kw})


def test_bad_calls_raise(pairs):
    ours = pairs["llama"][1]
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, S\) int tensor, got \(5,\)"):
        ours(ids[0])
    with pytest.raises(TypeError, match="integer token ids"):
        ours(ids.float())
    with pytest.raises(
        ValueError, match=r"attention_mask must be \(B=2, S_past \+ S=5\).*\(2, 4\)"
    ):
        ours(ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(TypeError, match="make_cache"):
        ours(ids, cache=[None, None])
    with pytest.raises(ValueError, match=r"cache kind must be one of .* got 'ring'"):
        ours.make_cache("ring", 2, 8)
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        ours.make_cache("static", 2, 0)
    assert isinstance(ours, CausalLM)


def test_family_refuses_another_model_type():
    with pytest.raises(UnsupportedConfigError, match=r"model_type='llama'.*GPT2 builds"):
        GPT2.from_config(_config_dict("llama"))


def test_logits_to_keep_gives_the_last_positions(pairs):
    _, ours = pairs["gemma2"]
    ids, mask = left_padded(2, 7, [2, 0], seed=8)
    with torch.no_grad():
        full = ours(ids, attention_mask=mask)
        last = ours(ids, attention_mask=mask, logits_to_keep=2)
    assert last.shape == (2, 2, VOCAB)
    torch.testing.assert_close(last, full[:, -2:])  # same rows; matmul blocking may differ
    with pytest.raises(ValueError, match=r"logits_to_keep must be an int in 1..S=7 or None, got 8"):
        ours(ids, logits_to_keep=8)
