"""Prompt logprobs, ``max_tokens=0``, ``logit_bias`` and ``best_of`` in the Engine.

Prompt logprobs come out of the prefill the request runs anyway; they must equal a plain full
forward's ``log_softmax`` of the same model, by the ratio rule against the model in float64,
whether the prompt is computed in one chunk or over many steps, among other requests, through a
pool small enough to preempt, and when its pages are already in the prefix cache (a scoring
request computes them again: cached pages hold no logits).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("transformers")

from selfattn.cache import kv_cache_bytes
from selfattn.serving import Engine, SamplingParams
from selfattn.testing import assert_close_to_reference
from tests.models.test_models_decoder import VOCAB, tiny_pair

P = 4  # tokens per page
K = 3  # alternatives per position
GREEDY = dict(temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_pair("llama", tmp_path_factory.mktemp("llama"), seed=5)[1]


@pytest.fixture(scope="module")
def model64(model):
    return copy.deepcopy(model).double()


def engine_for(model, pages: int = 64, **kw) -> Engine:
    c = model.config
    one = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, P, "fp32")
    return Engine(model, kv_cache_bytes=pages * one, page_size=P, **kw)


def log_softmax(model, prompt: list[int]) -> torch.Tensor:
    """``(len(prompt), V)``: a plain full forward's log-probabilities at every position."""
    with torch.no_grad():
        return model(torch.tensor([prompt]))[0].double().log_softmax(-1)


def check_prompt_logprobs(out, model, model64, k: int = K) -> None:
    """``out.prompt_logprobs`` against the full forward (ratio rule vs float64; ranks and the
    top-k ids as the float32 forward orders them)."""
    prompt = list(out.prompt_token_ids)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    if len(prompt) == 1:
        return
    naive, oracle = log_softmax(model, prompt), log_softmax(model64, prompt)
    ours, ref, plain = [], [], []
    for p, lp in enumerate(lps[1:]):
        t = prompt[p + 1]
        assert lp.token == t
        ids = [t, *(i for i, _ in lp.top)]
        ours += [lp.logprob, *(v for _, v in lp.top)]
        ref += oracle[p, ids].tolist()
        plain += naive[p, ids].tolist()
        assert [i for i, _ in lp.top] == naive[p].topk(k).indices.tolist()
        assert lp.rank == int((naive[p] > naive[p, t]).sum()) + 1
    assert_close_to_reference(torch.tensor(ours), torch.tensor(ref), torch.tensor(plain),
                              dtype=torch.float32, what="prompt logprobs")  # fmt: skip


def prompts(seed: int, count: int, shared: int = 9, longest: int = 26) -> list[list[int]]:
    """Random prompts (a 1-token one among them); every other one starts with one prefix."""
    g = random.Random(seed)
    prefix = [g.randrange(2, VOCAB) for _ in range(shared)]
    out = [[g.randrange(2, VOCAB)]]
    for i in range(count - 1):
        tail = [g.randrange(2, VOCAB) for _ in range(g.randint(1, longest - shared))]
        out.append(prefix + tail if i % 2 else [g.randrange(2, VOCAB), *tail])
    return out


# -- prompt logprobs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knobs",
    [
        dict(max_batch_tokens=512),  # each prompt in one chunk
        dict(max_batch_tokens=5),  # chunks of a prompt over several steps
        dict(max_batch_tokens=7, pages=8, max_num_seqs=3),  # and preemption by recompute
    ],
    ids=["one-chunk", "chunked", "preempted"],
)
def test_prompt_logprobs_equal_a_full_forward(model, model64, knobs):
    knobs = dict(knobs)
    engine = engine_for(model, knobs.pop("pages", 64), **knobs)
    ps = prompts(seed=len(str(knobs)), count=7)
    params = [
        SamplingParams(max_tokens=3, prompt_logprobs=K, n=1 + i % 2, **GREEDY)
        if i % 3 != 2
        else SamplingParams(max_tokens=3, **GREEDY)  # no scoring: none reported
        for i in range(len(ps))
    ]
    outs = engine.generate(ps, params)
    for out, p in zip(outs, params):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(out, model, model64)
    # the output continues as without scoring
    plain = engine_for(model).generate(ps, SamplingParams(max_tokens=3, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert (engine.metrics.preemptions > 0) == (engine.kv.num_pages == 8)
    engine.check()


def test_a_scoring_request_recomputes_cached_pages(model, model64):
    engine = engine_for(model, prefix_caching=True, max_batch_tokens=6)
    prompt = prompts(seed=3, count=2, shared=0, longest=18)[1]
    warm = engine.generate(prompt, SamplingParams(max_tokens=2, **GREEDY))[0]
    assert warm.cached_tokens == 0
    again = engine.generate(prompt, SamplingParams(max_tokens=2, **GREEDY))[0]
    assert again.cached_tokens == (len(prompt) - 1) // P * P > 0  # the cache holds its pages
    scored = engine.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=K, **GREEDY))[0]
    assert scored.cached_tokens == 0, "a scoring request must compute every prompt token"
    check_prompt_logprobs(scored, model, model64)
    assert scored.outputs[0].token_ids == warm.outputs[0].token_ids
    engine.check()


def test_max_tokens_0_scores_the_prompt_only(model, model64):
    engine = engine_for(model, max_batch_tokens=8)
    prompt = prompts(seed=4, count=2)[1]
    outs = engine.generate(
        [prompt, prompt[:5]],
        [SamplingParams(max_tokens=0, prompt_logprobs=K, n=2), SamplingParams(max_tokens=4)],
    )
    scored = outs[0]
    assert [(c.token_ids, c.finish_reason) for c in scored.outputs] == [((), "length")] * 2
    check_prompt_logprobs(scored, model, model64)
    assert len(outs[1].outputs[0].token_ids) == 4
    assert engine.metrics.requests_finished == 2
    engine.check()
    cached = 0 if engine.kv.index is None else engine.kv.index.num_cached_pages
    assert engine.kv.pool.num_used == cached  # every page freed, or held by the prefix cache


def test_prompt_logprobs_zero_alternatives_and_a_one_token_prompt(model):
    engine = engine_for(model)
    one, many = engine.generate([[5], [5, 9, 11]], SamplingParams(max_tokens=1,
                                                                   prompt_logprobs=0))  # fmt: skip
    assert one.prompt_logprobs == (None,)
    assert [lp.top for lp in many.prompt_logprobs[1:]] == [(), ()]


# -- logit_bias ------------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens_and_logprobs_stay_the_models(model):
    engine = engine_for(model)
    prompt = prompts(seed=6, count=2)[1]
    free = engine.generate(prompt, SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0]
    forced = engine.generate(
        prompt, SamplingParams(max_tokens=6, logit_bias={17: 100}, logprobs=2, **GREEDY)
    )[0].outputs[0]
    assert forced.token_ids == (17,) * 6
    full = log_softmax(model, prompt + [17] * 5)[len(prompt) - 1 :]  # (6, V)
    for t, lp in enumerate(forced.logprobs):  # the model's distribution, not the biased one
        assert lp.logprob == pytest.approx(full[t, 17].item(), abs=1e-4)
        assert [i for i, _ in lp.top] == full[t].topk(2).indices.tolist()
    banned = dict.fromkeys(set(free.token_ids), -100)
    greedy = engine.generate(prompt, SamplingParams(max_tokens=6, logit_bias=banned, **GREEDY))
    assert not set(greedy[0].outputs[0].token_ids) & set(banned)
    sampled = engine.generate(
        prompt,
        SamplingParams(max_tokens=8, n=4, seed=7, logit_bias=banned, ignore_eos=True),
    )[0]
    for c in sampled.outputs:
        assert not set(c.token_ids) & set(banned)


# -- best_of ---------------------------------------------------------------------------------------


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(model):
    engine = engine_for(model)
    prompt = prompts(seed=8, count=2)[1]
    kw = dict(max_tokens=5, seed=11, ignore_eos=True, temperature=1.3)
    every = engine.generate(prompt, SamplingParams(n=6, logprobs=0, **kw))[0].outputs
    for c in every:
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
    best = engine.generate(prompt, SamplingParams(n=2, best_of=6, **kw))[0].outputs
    want = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in want]
    assert [c.cumulative_logprob for c in best] == pytest.approx(
        [c.cumulative_logprob for c in want]
    )
    assert best[0].logprobs is None  # ranked without logprobs: none reported


def test_best_of_reports_once_when_finished(model):
    engine = engine_for(model)
    rid = engine.add_request([3, 4, 5], SamplingParams(n=1, best_of=3, max_tokens=4, seed=1))
    seen = []
    while engine.has_unfinished():
        seen += [o for o in engine.step() if o.request_id == rid]
    assert len(seen) == 1 and seen[0].finished and len(seen[0].outputs) == 1
