"""Encoder–decoder models (selfattn.models.seq2seq): T5 and BART against transformers.

Random-initialised tiny transformers models are saved and loaded with ``from_pretrained``; fp32
logits, cached decoding, greedy generation and gradients are compared on padded batches.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.cache import PagedKV  # noqa: E402
from selfattn.models.generate import generate  # noqa: E402
from selfattn.models.hub import (  # noqa: E402
    CheckpointError,
    UnsupportedConfigError,
    from_pretrained,
)
from selfattn.models.seq2seq import T5, Bart, CrossAttention  # noqa: E402
from selfattn.testing import perturb_parameters  # noqa: E402

RTOL = 1e-4  # max |ours - theirs| / max |theirs| for fp32 logits (the bar)
VOCAB = 97


pytestmark = pytest.mark.usefixtures("single_thread")


def _t5_config(**kw):
    base = dict(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        # few buckets and a short max_distance so the log-spaced and clamped buckets are hit
        relative_attention_num_buckets=8,
        relative_attention_max_distance=12,
        decoder_start_token_id=0,
        dropout_rate=0.0,
        initializer_factor=4.0,  # larger weights: greedy outputs vary instead of repeating
    )
    return transformers.T5Config(**{**base, **kw})


def _bart_config(**kw):
    base = dict(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=40,
        decoder_ffn_dim=36,
        max_position_embeddings=64,
        forced_eos_token_id=None,
        dropout=0.0,
        init_std=0.05,
    )
    return transformers.BartConfig(**{**base, **kw})


FAMILIES = {
    "t5-relu-tied": (transformers.T5ForConditionalGeneration, lambda: _t5_config()),
    "t5-gated-gelu-unscaled": (
        transformers.T5ForConditionalGeneration,
        lambda: _t5_config(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    ),
    "bart": (transformers.BartForConditionalGeneration, lambda: _bart_config()),
    "bart-scaled-embedding-untied": (
        transformers.BartForConditionalGeneration,
        lambda: _bart_config(
            scale_embedding=True, activation_function="relu", tie_word_embeddings=False
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its saved folder, folder)."""
    cls, make_config = FAMILIES[request.param]
    torch.manual_seed(sum(map(ord, request.param)))
    ref = cls(make_config()).eval()
    perturb_parameters(ref, seed=len(request.param), buffers=True)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, from_pretrained(path), path


def _batch(seed: int, B: int = 3, Se: int = 19):
    """Encoder ids with a right-padded and a left-padded row, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, Se), generator=g)
    mask = torch.ones(B, Se, dtype=torch.long)
    mask[1, Se - 6 :] = 0
    mask[2, :4] = 0
    return ids, mask


def _rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_logits_match_transformers(pair):
    ref, model, _ = pair
    ids, mask = _batch(1)
    dec = torch.randint(3, VOCAB, (3, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        ours = model(ids, mask, decoder_input_ids=dec)
    assert ours.shape == theirs.shape == (3, 23, VOCAB)
    err = _rel_err(ours, theirs)
    assert err <= RTOL, f"max relative logits error {err:.2e} > {RTOL}"


def _logits_error(ref, model) -> float:
    ids, mask = _batch(10)
    dec = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        return _rel_err(model(ids, mask, decoder_input_ids=dec), theirs)


def test_mt5_logits_match_transformers(tmp_path):
    torch.manual_seed(12)
    cfg = transformers.MT5Config(**_t5_config(num_decoder_layers=1).to_dict())
    ref = transformers.MT5ForConditionalGeneration(cfg).eval()
    perturb_parameters(ref, seed=12, buffers=True)
    ref.save_pretrained(tmp_path)
    err = _logits_error(ref, from_pretrained(tmp_path))
    assert err <= RTOL, f"mT5: max relative logits error {err:.2e}"


def test_t5_untied_checkpoint_format(tmp_path):
    """Configs written before transformers 5 (T5 v1.1, flan-t5): tie_word_embeddings=false and a
    separate lm_head.weight in the checkpoint, no output rescale."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(13)
    ref = transformers.T5ForConditionalGeneration(
        _t5_config(num_decoder_layers=1, tie_word_embeddings=False)
    ).eval()
    perturb_parameters(ref, seed=13, buffers=True)
    with torch.no_grad():  # a head of its own, as untied checkpoints have
        ref.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32))
    ref.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = ref.lm_head.weight.detach().clone()
    save_file(state, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["scale_decoder_outputs"]
    cfg["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(tmp_path)
    assert model.lm_head is not None and not model.scale_output
    err = _logits_error(ref, model)
    assert err <= RTOL, f"untied T5: max relative logits error {err:.2e}"


def test_encoder_padding_is_ignored(pair):
    """Changing padded encoder tokens changes nothing (the mask reaches every layer)."""
    _, model, _ = pair
    ids, mask = _batch(3)
    other = torch.where(mask.bool(), ids, (ids + 5) % VOCAB)
    dec = torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a = model(ids, mask, decoder_input_ids=dec)
        b = model(other, mask, decoder_input_ids=dec)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_cached_decode_equals_full_forward(pair, kind):
    _, model, _ = pair
    ids, mask = _batch(5)
    dec = torch.randint(3, VOCAB, (3, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        memory = model.encode(ids, mask)
        full = model.decode(dec, memory, encoder_attention_mask=mask)
        cache = model.make_cache(kind, 3, 16, page_size=4)
        steps = [model.decode(dec[:, :3], memory, encoder_attention_mask=mask, cache=cache)]
        for t in range(3, 11):
            steps.append(
                model.decode(dec[:, t : t + 1], memory, encoder_attention_mask=mask, cache=cache)
            )
    err = _rel_err(torch.cat(steps, dim=1), full)
    assert err <= RTOL, f"cached ({kind}) vs full decode: max relative error {err:.2e}"
    if kind == "paged":  # one PagedKV (one block table, one allocator) for all decoder layers
        kv = cache.self_attention.cache
        assert isinstance(kv, PagedKV) and kv.n_layers == len(model.decoder)
        kv.check()


def test_cross_attention_memo_is_computed_once_and_never_stale(pair, monkeypatch):
    _, model, _ = pair
    ids, mask = _batch(14)
    dec = torch.randint(3, VOCAB, (3, 1), generator=torch.Generator().manual_seed(15))
    calls = []
    project = CrossAttention.project_memory
    monkeypatch.setattr(
        CrossAttention, "project_memory", lambda self, m: calls.append(1) or project(self, m)
    )
    n = len(model.decoder)
    with torch.no_grad():
        memory = model.encode(ids, mask)
        cache = model.make_cache("static", 3, 8)
        for _ in range(3):
            model.decode(dec, memory, encoder_attention_mask=mask, cache=cache)
        assert len(calls) == n, f"cross K/V projected {len(calls)} times for {n} layers"
        memory.mul_(0.5)  # in place: the memo must notice (version counter)
        model.decode(dec, memory, encoder_attention_mask=mask, cache=cache)
        memory = memory + 0.25  # another tensor
        model.decode(dec, memory, encoder_attention_mask=mask, cache=cache)
        assert len(calls) == 3 * n, f"{len(calls)} projections, want {3 * n}"
        cache.reset()
        got = model.decode(dec, memory, encoder_attention_mask=mask, cache=cache)
        want = model.decode(dec, memory, encoder_attention_mask=mask)
    torch.testing.assert_close(got, want)


def test_greedy_generation_matches_transformers(pair):
    """selfattn's generate() (cached and uncached) == transformers' greedy search, padded batch."""
    ref, model, _ = pair
    ids, mask = _batch(7, B=4, Se=13)
    mask[3, 2:] = 0  # a row with only two real tokens
    # use_cache=False: transformers 5.24 sizes T5's generation cache by num_layers, which breaks
    # (IndexError) when num_decoder_layers is larger; its uncached path is the same greedy search
    with torch.no_grad():
        theirs = ref.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            num_beams=1,
            max_new_tokens=12,
            use_cache=False,
        )
    stop = dict(eos_token_id=model.eos_token_id, pad_token_id=model.pad_token_id)
    for cache in ("static", "paged", None):
        ours = generate(model, ids, 12, attention_mask=mask, cache=cache, page_size=4, **stop)
        assert torch.equal(ours, theirs), f"cache={cache}: {ours.tolist()} != {theirs.tolist()}"


def test_gradients_match_transformers(pair):
    """One cross-entropy backward: every parameter gets the gradient transformers computes."""
    ref, model, _ = pair
    ids, mask = _batch(8)
    g = torch.Generator().manual_seed(9)
    dec = torch.randint(3, VOCAB, (3, 7), generator=g)
    labels = torch.randint(3, VOCAB, (3, 7), generator=g)
    ref.zero_grad()
    model.zero_grad()
    loss_theirs = ref(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=labels).loss
    loss_theirs.backward()
    logits = model(ids, mask, decoder_input_ids=dec)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    torch.testing.assert_close(loss, loss_theirs, rtol=RTOL, atol=0)
    # compare through the checkpoint name mapping: their grads renamed like their weights
    theirs = model.convert_hf_state_dict(
        {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    )
    # tied models: transformers' shared grad already sums the embedding and output-head uses
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    for name, g_ours in grads.items():
        g_theirs = theirs[name]
        err = float((g_ours - g_theirs).abs().max() / g_theirs.abs().max().clamp_min(1e-30))
        assert err <= 1e-3, f"gradient of {name}: max relative error {err:.2e}"


def test_protocol_attributes(pair):
    ref, model, _ = pair
    cfg = ref.config
    assert model.is_encoder_decoder is True
    assert model.decoder_start_token_id == cfg.decoder_start_token_id
    assert model.eos_token_id == cfg.eos_token_id
    assert model.pad_token_id == cfg.pad_token_id
    assert not model.training


# -- errors ----------------------------------------------------------------------------------------
def _save(tmp_path, model, **config_changes):
    model.save_pretrained(tmp_path)
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(config_changes)
    cfg_file.write_text(json.dumps(cfg))
    return tmp_path


@pytest.fixture(scope="module")
def tiny_t5():
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(_t5_config(num_decoder_layers=1)).eval()


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"feed_forward_proj": "gated-mish"}, r"feed_forward_proj='gated-mish'.*activation 'mish'"),
        ({"is_decoder": True}, r"is_decoder=True"),
        ({"d_kv": 0}, r"config d_kv \(t5\) must be an int >= 1, got 0"),
        ({"num_heads": None}, r"config has no 'num_heads'"),
    ],
)
def test_t5_bad_config(tmp_path, tiny_t5, changes, match):
    path = _save(tmp_path, tiny_t5, **changes)
    with pytest.raises(ValueError, match=match):
        from_pretrained(path)


def test_bart_bad_config():
    cfg = _bart_config().to_dict()
    with pytest.raises(UnsupportedConfigError, match=r"normalize_before=True"):
        Bart.from_config({**cfg, "normalize_before": True})
    with pytest.raises(UnsupportedConfigError, match=r"activation_function='quick_gelu'"):
        Bart.from_config({**cfg, "activation_function": "quick_gelu"})


def test_tied_config_with_distinct_lm_head_is_refused(tiny_t5):
    model = T5.from_config(_t5_config(num_decoder_layers=1).to_dict())
    state = {n: p.detach().clone() for n, p in tiny_t5.state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["shared.weight"])
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs from shared\.weight"):
        model.convert_hf_state_dict(state)


def test_bart_position_limit(tmp_path):
    torch.manual_seed(0)
    ref = transformers.BartForConditionalGeneration(_bart_config(max_position_embeddings=8))
    model = from_pretrained(_save(tmp_path, ref))
    with pytest.raises(ValueError, match=r"max_position_embeddings=8 but positions 0\.\.8"):
        model.encode(torch.randint(3, VOCAB, (1, 9)))


def test_bad_inputs(tmp_path, tiny_t5):
    model = from_pretrained(_save(tmp_path, tiny_t5))
    ids = torch.randint(3, VOCAB, (2, 5))
    memory = model.encode(ids)
    with pytest.raises(ValueError, match=r"attention_mask must be \(B=2, Se=5\).*got \(2, 4\)"):
        model.encode(ids, torch.ones(2, 4))
    with pytest.raises(ValueError, match=rf"token ids 3\.\.{VOCAB} outside the vocabulary"):
        model.encode(torch.tensor([[3, VOCAB]]))
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor \(B, S\)"):
        model.encode(ids.float())
    with pytest.raises(ValueError, match=r"memory must be \(B=3, Se, d_model=32\).*\(2, 5, 32\)"):
        model.decode(torch.zeros(3, 1, dtype=torch.long), memory)
    with pytest.raises(ValueError, match=r"cache kind must be 'static' or 'paged', got 'window'"):
        model.make_cache("window", 2, 8)
    cache = model.make_cache("static", 2, 8)
    with pytest.raises(ValueError, match=r"cache has 2 layer caches but the decoder has 1"):
        model.decode(ids[:, :1], memory, cache=cache.layers * 2)
    a = model.decoder[0].self_attention
    kv = PagedKV(2, 4, 4, a.n_kv_heads, a.head_dim, max_seqs=2, max_pages_per_seq=2)
    two_layers = kv.view(kv.add_sequences(2))
    with pytest.raises(ValueError, match=r"cache has 2 layer caches but the decoder has 1"):
        model.decode(ids[:, :1], memory, cache=two_layers)
    assert two_layers.length == 0  # refused before planning
