"""Decode-time eviction in the Engine (selfattn.serving.kv_eviction): H2O, TOVA and StreamingLLM
cutting a generating sequence's cache back to its decode_budget.

Oracle: an independent loop over the model on a static cache: each decode step's attention
inputs recorded, the queries projected and the weights over the cached keys computed in float64,
DecodeScores' rule applied and each layer's cache compacted to the kept slots; the engine must
produce the same tokens and keep the same original positions per layer and KV head, on the C
kernel's scores and on the PyTorch path's.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from selfattn.cache.compress import DecodeScores, compression
from selfattn.models.kv_compression import attention_layers, recorded_inputs
from selfattn.serving import SamplingParams
from tests.serving.test_serving_compress import GREEDY, VOCAB, P, assert_drained, engine_for

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    from tests.models.test_generate_compress import tiny

    return tiny(dtype=torch.float32, seed=3)


def reference(model, prompt: list[int], n: int, spec):
    """``(tokens, positions)``: greedy tokens of the oracle loop (module docstring) and the
    original positions each layer's KV heads hold at the end ``(L, Hkv, kept)``."""
    N, K = spec.decode_budget, spec.decode_interval
    layers = attention_layers(model)
    cache = model.make_cache("static", 1, len(prompt) + n)
    with torch.no_grad():
        with recorded_inputs(layers, len(prompt)) as rows:
            logits = model(torch.tensor([prompt]), cache=cache, logits_to_keep=1)
        tokens = [int(logits[0, -1].argmax())]
        Hkv = cache.layers[0].k.shape[1]
        stats = [DecodeScores(spec.press, N, Hkv) for _ in layers]
        positions = torch.arange(len(prompt)).expand(len(layers), Hkv, -1)
        if spec.press.compression_ratio > 0:
            stats, positions = compressed_prompt(layers, cache, rows, spec)
        for step in range(n - 1):
            pos = len(prompt) + step
            with recorded_inputs(layers, 1) as seen:
                logits = model(torch.tensor([[tokens[-1]]]), cache=cache)
            tokens.append(int(logits[0, -1].argmax()))
            positions = torch.cat((positions, torch.full((len(layers), Hkv, 1), pos)), dim=-1)
            for i, (att, c) in enumerate(zip(layers, cache.layers)):
                q = att.queries(seen[i][0], torch.tensor([pos]), rotate=True)  # (1, Hq, 1, D)
                k = c.k[0, :, : c.length].double()  # (Hkv, n, D)
                q = q[0, :, 0].double().view(Hkv, -1, k.shape[-1])  # (Hkv, G, D)
                scale = att.scale or k.shape[-1] ** -0.5
                s = (q @ k.transpose(1, 2) * scale).reshape(1, -1, c.length)  # (1, Hq, n)
                stats[i].update(torch.softmax(s, dim=-1))
            if cache.layers[0].length >= N + K:
                kept = []
                for ds, c in zip(stats, cache.layers):
                    keep = ds.evict().keep  # (1, Hkv, N)
                    idx = keep[..., None]
                    k, v = (t[:, :, : c.length] for t in (c.k, c.v))
                    c.compact(k.gather(2, idx.expand(-1, -1, -1, k.shape[-1])),
                              v.gather(2, idx.expand(-1, -1, -1, v.shape[-1])))  # fmt: skip
                    kept.append(keep[0])
                positions = positions.gather(-1, torch.stack(kept))
    return tokens, positions


def compressed_prompt(layers, cache, rows, spec):
    """H2O's prompt compression in the oracle: each layer's prompt rows' causal softmax in
    float64, each key's weight summed over the rows (divided by the rows seeing it for the
    prompt's choice, as kvpress), the press's budget kept per KV head and the cache compacted to
    it; the decode statistic starts from the kept tokens' sums (their accumulated attention)."""
    stats, kept = [], []
    for i, (att, c) in enumerate(zip(layers, cache.layers)):
        C, (Hkv, D) = c.length, c.k.shape[1::2]
        q = att.queries(rows[i][0], torch.arange(C), rotate=True)[0].double()  # (Hq, C, D)
        k = c.k[0, :, :C].double().repeat_interleave(q.shape[0] // Hkv, 0)  # (Hq, C, D)
        s = q @ k.transpose(1, 2) * (att.scale or D**-0.5)
        s = s.masked_fill(torch.ones(C, C, dtype=torch.bool).triu(1), -math.inf)
        sums = torch.softmax(s, dim=-1).sum(1)  # (Hq, C)
        group = sums.view(Hkv, -1, C).mean(1)  # (Hkv, C)
        score = group / torch.arange(C, 0, -1)
        keep = spec.press.keep(score[None], spec.press.budget(C, i, len(layers)))[0]
        keep = keep.sort(-1).values  # (Hkv, n)
        idx = keep[None, ..., None]
        k_all, v_all = (t[:, :, :C] for t in (c.k, c.v))
        c.compact(k_all.gather(2, idx.expand(-1, -1, -1, D)),
                  v_all.gather(2, idx.expand(-1, -1, -1, v_all.shape[-1])))  # fmt: skip
        stats.append(DecodeScores(spec.press, spec.decode_budget, Hkv,
                                  scores=group.gather(-1, keep)[None]))  # fmt: skip
        kept.append(keep)
    return stats, torch.stack(kept)


SPECS = {  # (policy, knobs): small budgets and intervals, several cuts in 30 tokens
    "observed_attention": {"policy": "observed_attention", "decode_budget": 12,
                           "decode_interval": 4},
    "observed_attention after its prompt": {"policy": "observed_attention", "ratio": 0.5,
                                            "decode_budget": 12, "decode_interval": 4},
    "tova": {"policy": "tova", "decode_budget": 10, "decode_interval": 5},
    "streaming_llm": {"policy": "streaming_llm", "n_sink": 2, "decode_budget": 9,
                      "decode_interval": 3},
}  # fmt: skip


# the C kernel's scores and the PyTorch path's for each policy; the Triton kernel's (in its
# slow interpreter) for the case that exercises most: H2O seeded by its compressed prompt
KERNEL_CASES = [(name, k) for name in sorted(SPECS) for k in ("c-kernel", "pytorch")]
KERNEL_CASES.append(("observed_attention after its prompt", "triton"))


@pytest.mark.parametrize(
    ("name", "kernel"), KERNEL_CASES, ids=[f"{n}-{k}" for n, k in KERNEL_CASES]
)
def test_engine_evicts_the_tokens_an_independent_loop_evicts(model, name, kernel, monkeypatch):
    """Same tokens and, per layer and KV head, the same kept original positions as the float64
    oracle loop; the C kernel's scores, the Triton kernel's (in its interpreter) and the
    PyTorch path's alike."""
    if kernel == "triton":
        pytest.importorskip("triton")
        import selfattn.cache.paged.layer as paged_layer

        def not_from_pages(kv, plan, *args):
            if plan.scores.get("rows") is not None:  # a decode step asked for scores
                raise AssertionError("the Triton kernel's step recorded no key scores")

        monkeypatch.setenv("SELFATTN_PAGED_TRITON", "1")
        monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")  # scores from Triton's kernel or none
        monkeypatch.setattr(paged_layer, "record_from_pages", not_from_pages)
    else:
        monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "1" if kernel == "c-kernel" else "0")
    spec = compression(SPECS[name])
    g = random.Random(len(name))
    # compressed to 20, past N + K: the first decode step cuts by the prompt's own sums
    prompt = [g.randrange(VOCAB) for _ in range(40 if "prompt" in name else 11)]
    n = 30
    want, kept = reference(model, prompt, n, spec)
    engine = engine_for(model, 64, max_batch_tokens=8)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=n, kv_compression=spec, **GREEDY))
    seq = engine._requests[rid].seqs[0]
    got, positions = [], None
    while engine.has_unfinished():
        engine.step()
        if seq.evicting is not None and seq.evicting.positions is not None:
            positions = seq.evicting.positions
    got = seq.output_ids
    assert got == want
    assert positions is not None and torch.equal(positions, kept)
    m = engine.metrics
    cuts = m.kv_decode_eviction_by_policy[SPECS[name]["policy"]]
    assert cuts[0] == m.kv_decode_evictions >= 2 and m.kv_decode_evicted_tokens == cuts[1] > 0
    assert_drained(engine)


def test_pages_stay_within_the_budget_and_none_leak(model):
    """A long generation holds at most ceil((N + K) / P) + 1 pages (checked every step) and
    gives every page back when it ends."""
    N, K = 9, 6
    spec = {"policy": "tova", "decode_budget": N, "decode_interval": K}
    engine = engine_for(model, 64)
    prompt = list(range(20))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=90, kv_compression=spec, **GREEDY))
    seq, most = engine._requests[rid].seqs[0], 0
    while engine.has_unfinished():
        engine.step()
        if seq.kv_id is not None and seq.num_computed > len(prompt):
            most = max(most, len(engine.kv.pages(seq.kv_id)))
    assert len(seq.output_ids) == 90
    assert 0 < most <= math.ceil((N + K) / P) + 1
    assert engine.metrics.kv_decode_pages_freed > 0
    assert_drained(engine)


def test_non_evicting_neighbours_are_bit_identical(model):
    """A batch mixing evicting and plain requests: the plain ones' tokens and logprobs equal
    theirs without the evicting neighbours, bit for bit (deterministic mode: batch-invariant
    kernels, so a neighbour's shorter cache changes no other row's arithmetic)."""
    g = random.Random(5)
    prompts = [[g.randrange(VOCAB) for _ in range(g.randint(6, 15))] for _ in range(4)]
    plain = SamplingParams(max_tokens=25, logprobs=0, **GREEDY)
    spec = {"policy": "observed_attention", "decode_budget": 8, "decode_interval": 4}
    evict = SamplingParams(max_tokens=25, logprobs=0, kv_compression=spec, **GREEDY)
    alone = engine_for(model, 64, deterministic=True).generate(prompts[::2], plain)
    engine = engine_for(model, 64, deterministic=True)
    mixed = engine.generate(prompts, [plain, evict] * 2)
    assert engine.metrics.kv_decode_evictions >= 4
    for a, b in zip(alone, mixed[::2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in a.outputs[0].logprobs] == [
            x.logprob for x in b.outputs[0].logprobs
        ]


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"policy": "snapkv", "decode_budget": 8}, r"'snapkv' scores the prompt only.*'tova'"),
        ({"policy": "tova", "decode_budget": 0}, r"decode_budget.*0"),
        ({"policy": "streaming_llm", "decode_budget": 3}, r"decode_budget 3 is below the 4"),
        ({"policy": "tova", "decode_budget": 8, "decode_interval": 0}, r"decode_interval.*0"),
        ({"policy": "tova", "decode_budget": "8"}, r"decode_budget must be an int"),
        ("tova,decode_budget=x", r"'decode_budget=x' must be KEY=INT"),
    ],
)
def test_bad_decode_fields_are_refused_naming_them(model, spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(max_tokens=4, kv_compression=spec)


def test_a_speculative_engine_refuses_decode_eviction(model):
    engine = engine_for(model, 32, speculative="ngram", num_speculative_tokens=2)
    spec = {"policy": "tova", "decode_budget": 8}
    with pytest.raises(ValueError, match=r"decode_budget.*speculative"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, kv_compression=spec))


def test_an_engine_default_with_a_decode_budget_evicts_every_request(model):
    """``EngineConfig.kv_compression`` in the string form with decode keys: requests naming no
    policy evict during decoding; a speculative engine refuses such a default when built."""
    engine = engine_for(
        model, 64, kv_compression="streaming_llm:0,decode_budget=8,decode_interval=4"
    )
    outs = engine.generate([[3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(max_tokens=20, **GREEDY))
    assert len(outs[0].outputs[0].token_ids) == 20
    assert engine.metrics.kv_decode_eviction_by_policy["streaming_llm"][0] >= 3
    assert_drained(engine)
    with pytest.raises(ValueError, match=r"decode_budget \(tova\).*speculative"):
        engine_for(model, 32, speculative="ngram", num_speculative_tokens=2,
                   kv_compression="tova,decode_budget=8")  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        {"policy": "observed_attention", "decode_budget": 8, "decode_interval": 8},
        {"policy": "observed_attention", "ratio": 0.5, "decode_budget": 8, "decode_interval": 8},
        {"policy": "tova", "decode_budget": 7, "decode_interval": 6},
    ],
    ids=["h2o", "h2o-after-its-prompt", "tova"],
)
def test_preempted_evicting_sequences_resume_as_if_never_preempted(model, spec):
    """A pool too small for every evicting request at once: some are preempted after cuts,
    recomputed when readmitted (prompt, then their outputs a row a step, the statistic rebuilt
    and the cuts made again) and go on with the cache they had: every request's tokens and
    logprobs equal a pool that never preempts, bit for bit (deterministic mode), the budget
    holds, no page leaks."""
    g = random.Random(11)
    prompts = [[g.randrange(VOCAB) for _ in range(g.randint(9, 14))] for _ in range(8)]
    params = SamplingParams(max_tokens=30, logprobs=0, kv_compression=spec, **GREEDY)
    # no prefix caching: a cut copies pages the prefix index shares, which a full pool can
    # refuse (the cut is then skipped and logged): a difference that is not preemption's
    roomy = engine_for(model, 64, deterministic=True, prefix_caching=False)
    alone = roomy.generate(prompts, params)
    assert roomy.metrics.preemptions == 0
    engine = engine_for(model, 16, deterministic=True, prefix_caching=False)
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine._requests[r].seqs[0] for r in ids]
    cut_then_preempted, finals = 0, {}
    while engine.has_unfinished():
        cut = [seq.kv_id is not None and engine.kv.evicted(seq.kv_id) > 0 for seq in seqs]
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        cut_then_preempted += sum(c and seq.kv_id is None for c, seq in zip(cut, seqs))
    assert engine.metrics.preemptions > 0 and cut_then_preempted > 0
    for a, rid in zip(alone, ids):
        b = finals[rid].outputs[0]
        assert b.token_ids == a.outputs[0].token_ids
        assert [x.logprob for x in b.logprobs] == [x.logprob for x in a.outputs[0].logprobs]
    assert engine.metrics.kv_decode_evictions >= 8 * 2
    assert_drained(engine)


def test_generate_refuses_a_decode_budget(model):
    from selfattn.models import generate

    with pytest.raises(ValueError, match=r"decode_budget.*runs in the Engine"):
        generate(model, torch.tensor([[1, 2, 3]]), 2, kv_compression="tova,decode_budget=8")


def test_forked_samples_over_a_shared_prefix_evict_each_their_own(model):
    """n = 3 samples of two requests sharing a cached prefix: each sample cuts its own cache
    (shared pages are copied, never written), all finish, no page leaks."""
    engine = engine_for(model, 40, prefix_caching=True)
    spec = {"policy": "tova", "decode_budget": 8, "decode_interval": 4}
    params = SamplingParams(max_tokens=30, n=3, temperature=1.0, ignore_eos=True,
                            kv_compression=spec)  # fmt: skip
    outs = engine.generate([list(range(13)), [*range(13), 5, 6]], params)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [30] * 6
    assert engine.metrics.kv_decode_evictions >= 6 * 4
    assert_drained(engine)
