"""generate(kv_compression=): the prompt's KV compressed after the prefill, on the static cache.

Oracles: ratio 0 is the plain run bit for bit; the first decode step's logits against a direct
attention over exactly the kept keys/values (chosen by the press from an uncompressed run's
cache and attention maps captured by selfattn.inspect) at the true position; later steps
against a run over caches holding the same kept K/V with explicit positions ``S + t``.
"""

from __future__ import annotations

import pytest
import torch

from selfattn.cache import StaticCache
from selfattn.cache.compress import press
from selfattn.inspect import capture_attention
from selfattn.models import generate
from selfattn.models.decoder import GPT2, DecoderConfig, Llama
from selfattn.models.kv_compression import compress_prefill

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, S, NEW = 64, 40, 6
PRESSES = {
    "snapkv": press("snapkv", 0.5, window=8),
    "pyramidkv": press("pyramidkv", 0.6, window=4),
    "knorm": press("knorm", 0.5),
    "observed_attention": press("observed_attention", 0.4),
    "tova": press("tova", 0.5),
    "streaming_llm": press("streaming_llm", 0.5),
}


def tiny(family="llama", seed=0, dtype=torch.float64, **over):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64)
    if family == "gpt2":
        kw.update(n_kv_heads=None, positions="learned", activation="gelu_new", max_positions=128)
        return GPT2(DecoderConfig(**kw, **over)).to(dtype).eval()
    return Llama(DecoderConfig(**kw, **over)).to(dtype).eval()


def prompt(B=2, seed=1):
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def kept_kv(model, ids, p, context_len=None):
    """Each layer's kept ``(keys, values, counts)``, chosen by ``p`` from an uncompressed
    prefill of the first ``context_len`` tokens and its attention maps (``counts (B, Hkv)``:
    a ragged press's per-head counts, rows past them padding; None otherwise)."""
    C = ids.shape[1] if context_len is None else context_len
    cache = model.make_cache("static", ids.shape[0], C)
    with capture_attention(model) as maps:
        model(ids[:, :C], cache=cache)
    L, rows = len(model.layers), p.query_rows(C)
    out = []
    for i, layer in enumerate(cache.layers):
        k, v = layer.k[:, :, :C], layer.v[:, :, :C]
        attention = maps[i][:, :, C - rows :] if rows else None
        kept = p.apply(k, v, attention=attention, layer=i, n_layers=L)
        if kept.counts is None:
            assert kept.indices.shape[-1] == p.budget(C, i, L)
        else:  # the layer's total is the uniform budget's, shared unevenly by the heads
            assert bool((kept.counts.sum(-1) == k.shape[1] * p.budget(C, i, L)).all())
        out.append((kept.keys, kept.values, kept.counts))
    return out


def direct_step(model, toks, kept, pos):
    """Logits ``(B, T, vocab)`` of ``toks (B, T)`` at positions ``pos .. pos + T - 1``, each
    layer attending over its ``kept`` keys/values (each head its first ``counts`` rows where a
    ragged press gave counts) plus the new tokens' own (causal), by a plain softmax."""
    T = toks.shape[1]
    h = model.embed(toks)
    positions = torch.arange(pos, pos + T)
    if model.pos_embed is not None:
        h = h + model.pos_embed(positions)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for block, (k, v, counts) in zip(model.layers, kept):
        att = block.self_attention

        def attend(a, att=att, k=k, v=v, counts=counts):
            q, k1, v1 = att.heads_qkv(a, positions=positions)
            keys, values = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            scale = att.scale or q.shape[-1] ** -0.5
            n = k.shape[2]
            hidden = torch.zeros(q.shape[0], q.shape[1], T, n + T, dtype=torch.bool)
            hidden[..., n:] = future
            if counts is not None:  # a head's rows past its count are not its tokens
                pad = torch.arange(n) >= counts.unsqueeze(-1)  # (B, Hkv, n)
                hidden[..., :n] = pad.repeat_interleave(group, 1).unsqueeze(2)
            scores = (q @ keys.transpose(-1, -2) * scale).masked_fill(hidden, -torch.inf)
            return att.project_out(att.merge_heads(scores.softmax(-1) @ values), a)

        h = block.mlp_res(block.self_res(h, attend), block.mlp)
    return model.lm_head(model.norm(h))


@pytest.mark.parametrize("name", ["snapkv", "knorm", "observed_attention", "expected_attention"])
@pytest.mark.parametrize("cache", ["auto", "static"])
def test_ratio_zero_is_the_plain_run(name, cache):
    model, ids = tiny(dtype=torch.float32), prompt()
    plain = generate(model, ids, NEW, cache=cache, ignore_eos=True)
    got = generate(model, ids, NEW, cache=cache, ignore_eos=True, kv_compression=press(name, 0))
    assert torch.equal(got, plain)
    assert torch.equal(generate(model, ids, NEW, cache=cache, ignore_eos=True,
                                kv_compression=f"{name}:0"), plain)  # fmt: skip


@pytest.mark.parametrize("name", sorted(PRESSES))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_first_decode_step_is_attention_over_the_kept_tokens(name, family):
    p, model, ids = PRESSES[name], tiny(family, seed=2), prompt(seed=3)
    kept = kept_kv(model, ids, p)
    cache = model.make_cache("static", 2, S + 1)
    first = compress_prefill(model, ids, cache, p)
    L = len(model.layers)
    assert [c.length for c in cache.layers] == [p.budget(S, i, L) for i in range(L)]
    assert all(c.position == S for c in cache.layers)
    tok = first[:, -1].argmax(-1, keepdim=True)
    got = model(tok, cache=cache)
    want = direct_step(model, tok, kept, S)
    # the ratio rule: ours (float64) within a small multiple of the float32 reference's error
    model32 = tiny(family, seed=2, dtype=torch.float32)
    naive = direct_step(model32, tok, [(k.float(), v.float(), c) for k, v, c in kept], S)
    assert (got - want).abs().max() <= 4 * (naive.double() - want).abs().max()
    assert [c.length for c in cache.layers] == [p.budget(S, i, L) + 1 for i in range(L)]


@pytest.mark.parametrize("context_len", [None, 30])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_adakv_attends_exactly_each_heads_kept_tokens(family, context_len):
    """Per-head budgets: each KV head holds its own count of kept tokens, the slots past it
    hidden from its attention. The first decode step (or, with a question after the context,
    the question's prefill) equals a direct softmax over each head's kept K/V alone."""
    p, model, ids = press("adakv_snapkv", 0.5, window=8), tiny(family, seed=8), prompt(seed=9)
    C = S if context_len is None else context_len
    kept = kept_kv(model, ids, p, C)
    assert any(c.unique().numel() > 1 for *_, c in kept)  # the heads' counts differ
    cache = model.make_cache("static", 2, S + 1)
    got = compress_prefill(model, ids, cache, p, context_len)
    assert [c.length for c in cache.layers] == [int(c.max()) + S - C for *_, c in kept]
    assert all(c.position == S for c in cache.layers)
    toks, pos = ids[:, C:], C
    if C == S:
        toks, pos = got[:, -1].argmax(-1, keepdim=True), S
        got = model(toks, cache=cache)
    want = direct_step(model, toks, kept, pos)[:, -1:]
    # the ratio rule: ours (float64) within a small multiple of the float32 reference's error
    model32 = tiny(family, seed=8, dtype=torch.float32)
    kept32 = [(k.float(), v.float(), c) for k, v, c in kept]
    naive = direct_step(model32, toks, kept32, pos)[:, -1:]
    assert (got - want).abs().max() <= 4 * (naive.double() - want).abs().max()


@pytest.mark.parametrize("context_len", [None, 30])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_positions_continue_after_compression(family, context_len):
    """Greedy decoding of the compressed run equals a run over caches loaded with the same
    kept K/V and fed explicit positions S + t (the question, if any, at C .. S - 1)."""
    p, model, ids = PRESSES["snapkv"], tiny(family, seed=4), prompt(seed=5)
    got = generate(model, ids, NEW, ignore_eos=True, kv_compression=p,
                   kv_compression_context=context_len)  # fmt: skip
    C = S if context_len is None else context_len
    ref = model.make_cache("static", 2, S + NEW)
    for layer, (k, v, _) in zip(ref.layers, kept_kv(model, ids, p, C)):
        layer.update(k, v)
    logits = model(ids[:, :C], cache=None) if C == S else None  # the prefill's last logits
    if C < S:
        logits = model(ids[:, C:], cache=ref, position_ids=torch.arange(C, S))
    seq = ids
    for t in range(NEW):
        tok = logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, tok], 1)
        logits = model(tok, cache=ref, position_ids=torch.tensor([S + t]))
    assert torch.equal(got, seq)


def test_compression_changes_the_run_and_shrinks_the_caches():
    """The check above can fail: a compressed run differs from the plain one somewhere."""
    model, ids = tiny(seed=6), prompt(seed=7)
    plain = generate(model, ids, NEW, cache="static", ignore_eos=True)
    cache = model.make_cache("static", 2, S + 1)
    compress_prefill(model, ids, cache, "knorm:0.75")
    assert [c.length for c in cache.layers] == [10] * 3
    outs = [generate(model, ids, NEW, ignore_eos=True, kv_compression=f"{n}:0.75") for n in
            ("knorm", "streaming_llm", "tova", "expected_attention")]  # fmt: skip
    assert any(not torch.equal(o, plain) for o in outs)


@pytest.mark.parametrize(
    "model_kw, call_kw, match",
    [
        ({}, {"cache": "paged"}, "cache='static'"),
        ({}, {"cache": None}, "cache='static'"),
        ({"sliding_window": 8, "layer_types": ("sliding_attention",) * 3}, {},
         "sliding_attention"),
        ({}, {"kv_compression": "kivi2:0"}, "kivi2"),
        ({}, {"kv_compression": "snapkv:half"}, "ratio must be a number"),
        ({}, {"kv_compression": "snapkv:1.5"}, "compression_ratio"),
        ({}, {"kv_compression": "nope:0.5"}, "unknown KV-compression policy 'nope'"),
        ({}, {"kv_compression": 0.5}, "must be a press"),
        ({}, {"kv_compression": None, "kv_compression_context": 4}, "needs kv_compression"),
        ({}, {"kv_compression_context": S + 1}, "exceeds the prompt's"),
        ({}, {"prompt_lookup_num_tokens": 2}, "speculation"),
        ({}, {"attention_mask": torch.ones(2, S).index_fill(1, torch.tensor([0]), 0)},
         "no padding"),
    ],
)  # fmt: skip
def test_refusals_name_the_value_and_the_fix(model_kw, call_kw, match):
    model = tiny(dtype=torch.float32, **model_kw)
    call = {"kv_compression": "snapkv:0.5", **call_kw}
    with pytest.raises((ValueError, TypeError), match=match):
        generate(model, prompt(), 2, **call)


def test_compact_keeps_the_position_and_refuses_more_tokens_than_cached():
    c = StaticCache(1, 8, 2, 4, dtype=torch.float64)
    k, v = (
        torch.randn(1, 2, 5, 4, dtype=torch.float64),
        torch.randn(1, 2, 5, 4, dtype=torch.float64),
    )
    c.update(k, v)
    c.compact(k[:, :, [1, 4]], v[:, :, [1, 4]])
    assert (c.length, c.position) == (2, 5)
    got = c.update(k[:, :, :1], v[:, :, :1])  # the next token: slot 2, position 5
    assert torch.equal(got[0], torch.cat([k[:, :, [1, 4]], k[:, :, :1]], 2))
    assert (c.length, c.position) == (3, 6)
    with pytest.raises(ValueError, match="subset of the 3 cached tokens, got 4"):
        c.compact(k[:, :, :4], v[:, :, :4])
    c.reset()
    assert (c.length, c.position) == (0, 0)


def test_ragged_compact_hides_each_heads_hole_until_reset():
    """compact(counts=) zeroes each head's rows past its count and hands the range to
    attention as KV.holes; bad counts are refused by name."""
    c = StaticCache(2, 8, 2, 4, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(2))
    c.update(k, v)
    counts = torch.tensor([[3, 1], [2, 3]])
    c.compact(k[:, :, :3], v[:, :, :3], counts)
    assert (c.length, c.position) == (3, 5)
    kv = c.update(k[:, :, :1], v[:, :, :1])
    assert kv.holes.tolist() == [[[3, 3], [1, 3]], [[2, 3], [3, 3]]]
    assert float(kv[0][1, 0, 2].abs().sum()) == 0 and torch.equal(kv[0][1, 0, 3], k[1, 0, 0])
    with pytest.raises(ValueError, match="compacted to ragged counts already"):
        c.compact(k[:, :, :2], v[:, :, :2], counts.clamp(max=2))
    c.reset()
    assert c.update(k, v).holes is None
    with pytest.raises(ValueError, match=r"counts must be in 0\.\.2"):
        c.compact(k[:, :, :2], v[:, :, :2], counts)
    with pytest.raises(ValueError, match=r"counts must be \(B=2, Hkv=2\) integers"):
        c.compact(k[:, :, :2], v[:, :, :2], torch.ones(2))
