"""Mamba-2, Bamba (Mamba-2 + attention) and Qwen3-Next (gated DeltaNet + gated attention, with
experts and without) against transformers on tiny perturbed random configs (saved with
save_pretrained, loaded by selfattn's from_pretrained): logits, left padding, greedy generation;
the state cache (static and paged): decode == full forward, fork == recompute; kv-size's state
formula against the bytes make_cache allocates."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.cache.state import HybridCache, LayerState, fork  # noqa: E402
from selfattn.models.generate import generate  # noqa: E402
from tests.models.test_models_decoder import (  # noqa: E402
    RTOL,
    VOCAB,
    hf_positions,
    left_padded,
    rel_err,
    tiny_pair,
)

_MAMBA = dict(n_groups=2, expand=2, chunk_size=4)  # chunks of 4: prompts span several
_QWEN3_NEXT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"], mlp_only_layers=[1],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
    moe_intermediate_size=16, shared_expert_intermediate_size=24,
)  # fmt: skip
FAMILIES = {
    "mamba2": (
        "Mamba2Config",
        dict(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=6,
             conv_kernel=4, num_hidden_layers=2, **_MAMBA),
    ),
    # layers: mamba, attention, mamba (Bamba's RoPE turns half of each head)
    "bamba": (
        "BambaConfig",
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
             mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=6,
             mamba_d_conv=4, mamba_chunk_size=4, mamba_expand=2),
    ),
    # layers: DeltaNet (experts), attention (dense: mlp_only_layers), DeltaNet (experts); 2 key
    # heads of 8 serve 4 value heads of 6; RoPE on a quarter of each attention head
    "qwen3_next": ("Qwen3NextConfig", dict(_QWEN3_NEXT, num_experts=4, num_experts_per_tok=2)),
    # no experts: a SwiGLU after every layer; biases on the attention's projections
    "qwen3_next_dense": ("Qwen3NextConfig", dict(_QWEN3_NEXT, num_experts=0,
                                                 attention_bias=True)),
}  # fmt: skip
# the families with attention layers (transformers reads positions from position_ids)
_ATTENTION = ("bamba", "qwen3_next", "qwen3_next_dense")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (transformers model, ours, the checkpoint folder), built once."""
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(family)
        out[family] = (*tiny_pair(family, folder, seed=i, families=FAMILIES), folder)
    return out


def _theirs(hf, family, ids, mask):
    kw = {"position_ids": hf_positions(mask)} if family in _ATTENTION else {}
    return hf(ids, attention_mask=mask, **kw).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(pairs, family):
    hf, ours, _ = pairs[family]
    # 70 tokens: more than one of the DeltaNet's chunks of 64 (Mamba's are 4 here)
    ids = torch.randint(2, VOCAB, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, got = hf(ids).logits, ours(ids)
    assert got.shape == (2, 70, VOCAB)
    assert rel_err(got, theirs, torch.ones_like(ids, dtype=torch.bool)) <= RTOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_left_padded(pairs, family):
    hf, ours, _ = pairs[family]
    ids, mask = left_padded(3, 11, [4, 0, 1], seed=1)
    with torch.no_grad():
        theirs, got = _theirs(hf, family, ids, mask), ours(ids, attention_mask=mask)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_greedy_generation_matches_transformers(pairs, family, padded):
    hf, ours, _ = pairs[family]
    ids, mask = left_padded(3, 9, [3, 0, 1] if padded else [0, 0, 0], seed=2)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    got = generate(ours, ids, 10, attention_mask=mask if padded else None, cache="static")
    assert torch.equal(got, theirs)


@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_decode_equals_full_forward(pairs, family, kind):
    _, ours, _ = pairs[family]
    ids = torch.randint(2, VOCAB, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(ids)
        cache = ours.make_cache(kind, 2, 14, page_size=4)
        parts = [ours(ids[:, :9], cache=cache)]
        parts += [ours(ids[:, t : t + 1], cache=cache) for t in range(9, 14)]
    assert cache.length == 14
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fork_equals_recompute(pairs, family):
    """One prompt prefilled once, forked into 3 rows (n = 3 continuations): each row's next
    logits equal recomputing the prompt and its continuation from scratch."""
    _, ours, _ = pairs[family]
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(2, VOCAB, (1, 10), generator=g)
    nxt = torch.randint(2, VOCAB, (3, 3), generator=g)
    with torch.no_grad():
        cache = ours.make_cache("static", 1, 16)
        ours(prompt, cache=cache)
        forked = fork(cache, [0, 0, 0])
        steps = torch.cat([ours(nxt[:, t : t + 1], cache=forked) for t in range(3)], 1)
        again = ours(torch.cat([prompt.expand(3, -1), nxt], 1))[:, 10:]
    torch.testing.assert_close(steps, again, rtol=1e-5, atol=1e-5)
    assert cache.length == 10 and forked.length == 13


@pytest.mark.parametrize("family", ["bamba", "qwen3_next"])
def test_paged_fork_equals_recompute_and_frees_every_page(pairs, family):
    """Bamba and Qwen3-Next on the paged cache (pages of 4; the prompt of 10 ends inside a
    page, so the first write copies it): a prompt prefilled once, forked into 3 rows that share
    its pages. Each row and the parent take a different token, then decode greedily: the same
    tokens as generating from scratch, the parent untouched by its forks. Freed, every page is
    back in the pool."""
    _, ours, _ = pairs[family]
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(2, VOCAB, (1, 10), generator=g)
    first = torch.randint(2, VOCAB, (4, 1), generator=g)  # row 0: the parent's, 1-3: the forks'
    new = 5
    with torch.no_grad():
        cache = ours.make_cache("paged", 1, 16, page_size=4, max_seqs=4)
        ours(prompt, cache=cache)
        kv = cache.kv.cache
        forked = fork(cache, [0, 0, 0])
        assert kv.pool.num_free == kv.num_pages - 3  # shared, not copied
        got = []
        for c, tok in ((cache, first[:1]), (forked, first[1:])):
            out = [tok]
            for _ in range(new):
                out.append(ours(out[-1], cache=c)[:, -1:].argmax(-1))
            got.append(torch.cat(out, 1))
        got = torch.cat(got)
        scratch = generate(ours, torch.cat([prompt.expand(4, -1), first], 1), new, cache="static")
    assert torch.equal(got, scratch[:, 10:])
    assert cache.length == forked.length == 10 + new
    kv.check()
    forked.free()
    cache.free()
    kv.check()
    assert kv.pool.num_free == kv.num_pages and kv.seq_ids == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kv_size_reports_the_state_make_cache_allocates(pairs, family, capsys):
    from selfattn.cli.main import main

    _, ours, folder = pairs[family]
    tokens = 40
    rc = main(["kv-size", "--config", str(folder), "--tokens", str(tokens), "--dtype", "fp32",
               "--json"])  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    cache = ours.make_cache("static", 1, tokens)
    states = [c for c in cache.layers if isinstance(c, LayerState)]
    kv = [c for c in cache.layers if not isinstance(c, LayerState)]
    assert result["state"]["bytes"] == sum(c.nbytes for c in states)
    assert result["bytes"] == sum(c.k.nbytes + c.v.nbytes for c in kv)
    assert result["total_bytes"] == result["bytes"] + result["state"]["bytes"]
    # the state does not grow with the context; the KV cache does
    rc = main(["kv-size", "--config", str(folder), "--tokens", str(10 * tokens), "--dtype",
               "fp32", "--json"])  # fmt: skip
    longer = json.loads(capsys.readouterr().out)
    assert longer["state"]["bytes"] == result["state"]["bytes"]
    assert longer["bytes"] == 10 * result["bytes"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_with_the_paged_cache(pairs, family):
    """The attention layers on one PagedKV (pages of 4: prompts span several) beside the
    recurrent states: the same tokens as transformers."""
    hf, ours, _ = pairs[family]
    ids, mask = left_padded(2, 9, [2, 0], seed=5)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    got = generate(ours, ids, 8, attention_mask=mask, cache="paged", page_size=4)
    assert torch.equal(got, theirs)


def test_paged_hybrid_cache_layout_and_errors(pairs):
    _, ours, _ = pairs["bamba"]
    cache = ours.make_cache("paged", 2, 12, page_size=4)
    assert isinstance(cache, HybridCache) and cache.kv.cache.n_layers == 1
    step = cache.plan(3)
    assert [type(c).__name__ for c in step.layers] == ["LayerState", "PagedLayer", "LayerState"]
    with pytest.raises(RuntimeError, match=r"holds 2 of max_seqs=2 .* max_seqs=3\)"):
        fork(cache, [0])
    assert len(cache.kv.cache.seq_ids) == 2  # nothing forked
    with pytest.raises(ValueError, match="needs max_len"):
        ours.make_cache("static", 1)
    with pytest.raises(ValueError, match="2 attention and 1 recurrent layers but got a KV cache"):
        HybridCache([True, True, False], cache.kv, cache.states)


@pytest.mark.parametrize("kinds", [("deltanet", "attention"), ("linear", "mamba")])
def test_other_layer_kinds_and_window_cache_decode_equals_full_forward(kinds):
    """HybridLM's gated DeltaNet and linear-attention layers, and attention over a window of 5
    served by the window cache (a ring shorter than the sequence)."""
    from selfattn.cache import SlidingWindowCache
    from selfattn.models.hybrid import HybridConfig, HybridLM

    config = HybridConfig(vocab_size=VOCAB, d_model=32, layer_types=kinds, ssm_heads=4,
                          ssm_head_dim=8, state_size=4, chunk_size=4, d_ff=48, n_heads=4,
                          window=5)  # fmt: skip
    torch.manual_seed(0)
    lm = HybridLM(config).double().eval()
    ids = torch.randint(2, VOCAB, (2, 13), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = lm(ids)
        cache = lm.make_cache("window", 2, 13)
        parts = [lm(ids[:, :6], cache=cache)] + [lm(ids[:, t : t + 1], cache=cache)
                                                 for t in range(6, 13)]  # fmt: skip
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)
    windowed = [c for c in cache.layers if isinstance(c, SlidingWindowCache)]
    assert len(windowed) == kinds.count("attention")
