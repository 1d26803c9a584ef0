"""Speculative decoding in the Engine (EngineConfig speculative="ngram" | "draft"): greedy outputs
equal plain ``generate`` of each request alone across batch mixes, chunked prefills and
preemption; no page leaks once every request ends; the acceptance counters (every draft of the
target's twin accepted, few of a random draft's); stops and ``max_tokens`` inside an accepted
run; sampling keeps the model's distribution (chi-square against the exact probabilities); the
config's checks.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from selfattn.cache import kv_cache_bytes
from selfattn.models.generate import generate, token_probs
from selfattn.serving import Engine, EngineConfig, SamplingParams
from tests._speculative import chi2_pvalue, exact_joint, tiny_llama

VOCAB = 97
P = 4  # tokens per page
ALPHA = 1e-4
GREEDY = dict(temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def engine_for(model, pages: int, **kw) -> Engine:
    c = model.config
    one = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, P, "fp32")
    return Engine(model, kv_cache_bytes=pages * one, page_size=P, **kw)


def prompts_for(seed: int, count: int) -> list[list[int]]:
    """Prompts of 1..16 tokens, most repeating their start (prompt lookup finds it), every
    third one sharing a page-aligned prefix with the first."""
    g = random.Random(seed)
    out = []
    for i in range(count):
        head = [g.randrange(VOCAB) for _ in range(g.randint(1, 8))]
        prompt = head + head[: g.randint(0, len(head))]
        out.append(out[0][:P] + prompt if i % 3 == 2 else prompt)
    return out


def alone(model, prompt, n: int) -> list[int]:
    return generate(model, torch.tensor([prompt]), n, ignore_eos=True)[0, len(prompt) :].tolist()


def drafter_kw(drafter: str, model) -> dict:
    if drafter == "ngram":
        return {"speculative": "ngram"}
    return {"speculative_model": copy.deepcopy(model) if drafter == "twin" else tiny_llama(5)}


@pytest.mark.parametrize("drafter", ["ngram", "twin", "random"])
@pytest.mark.parametrize("pages, budget, k", [(400, 1024, 4), (16, 16, 3), (13, 7, 1)])
def test_greedy_equals_generate_alone(target, drafter, pages, budget, k):
    """Big pool; a small pool (preemption) with chunked prefills; a pool just large enough."""
    prompts = prompts_for(pages + k, 9)
    N = 20
    refs = [alone(target, p, N) for p in prompts]
    e = engine_for(target, pages, max_batch_tokens=budget, num_speculative_tokens=k,
                   **drafter_kw(drafter, target))  # fmt: skip
    outs = e.generate(prompts, SamplingParams(max_tokens=N, **GREEDY))
    for o, ref in zip(outs, refs):
        assert list(o.outputs[0].token_ids) == ref
    e.check()  # every page free or held by the prefix cache alone: none leaked
    if e.speculator.runner is not None:  # the draft model's pool: every page back
        assert e.speculator.runner.kv.pool.num_used == 0
    m = e.metrics
    assert m.spec_draft_tokens > 0
    if pages < 20:
        assert m.preemptions > 0
    if drafter == "twin":
        assert m.spec_accepted_tokens == m.spec_draft_tokens
    if drafter == "random":
        assert m.spec_accepted_tokens < m.spec_draft_tokens / 4


def test_requests_arriving_while_others_decode(target):
    """Requests added between steps join running speculative sequences; n > 1 samples fork."""
    prompts = prompts_for(3, 8)
    N = 11
    refs = [alone(target, p, N) for p in prompts]
    e = engine_for(target, 60, max_batch_tokens=24, speculative="ngram",
                   num_speculative_tokens=3)  # fmt: skip
    params = SamplingParams(max_tokens=N, n=2, **GREEDY)
    ids = {}
    pending = list(enumerate(prompts))
    done = {}
    while pending or e.has_unfinished():
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                ids[e.add_request(p, params)] = i
        for out in e.step():
            if out.finished:
                done[ids[out.request_id]] = out
    for i, ref in enumerate(refs):
        assert [list(c.token_ids) for c in done[i].outputs] == [ref, ref]
    e.check()
    assert e.kv.pool.num_used == (e.kv.index.num_evictable_pages if e.kv.index else 0)


def test_stops_and_max_tokens_inside_an_accepted_run(target):
    prompts = prompts_for(11, 5)
    N = 20
    refs = [alone(target, p, N) for p in prompts]
    e = engine_for(target, 200, speculative_model=copy.deepcopy(target), num_speculative_tokens=5)
    stops = [ref[7] for ref in refs]  # tokens 7: inside the second run of 6 accepted tokens
    outs = e.generate(prompts, [SamplingParams(max_tokens=N, temperature=0.0, stop_token_ids=[s])
                                for s in stops])  # fmt: skip
    for o, ref, s in zip(outs, refs, stops):
        assert list(o.outputs[0].token_ids) == ref[: ref.index(s) + 1]
        assert o.outputs[0].finish_reason == "stop"
    for n in (1, 2, 8, 9):
        outs = e.generate(prompts, SamplingParams(max_tokens=n, **GREEDY))
        for o, ref in zip(outs, refs):
            assert list(o.outputs[0].token_ids) == ref[:n]
            assert o.outputs[0].finish_reason == "length"
    e.check()


def test_penalties_and_logprobs_decode_without_drafts(target):
    prompts = prompts_for(2, 3)
    plain = engine_for(target, 200)
    e = engine_for(target, 200, speculative="ngram")
    greedy = {"max_tokens": 9, "temperature": 0.0}
    for params in (SamplingParams(**greedy, logprobs=2),
                   SamplingParams(**greedy, repetition_penalty=1.3)):  # fmt: skip
        a, b = plain.generate(prompts, params), e.generate(prompts, params)
        assert [o.outputs for o in a] == [o.outputs for o in b]
    assert e.metrics.spec_draft_tokens == 0


# -- sampling keeps the distribution -------------------------------------------------------------
SMALL_V = 11
SAMPLES = 1500


@pytest.mark.parametrize(
    "kw, params",
    [
        ({"speculative": "ngram", "num_speculative_tokens": 3}, {"temperature": 0.6}),
        ({"speculative_model": "other", "num_speculative_tokens": 2},
         {"temperature": 0.8, "top_k": 6, "min_p": 0.05}),
    ],
)  # fmt: skip
def test_sampling_keeps_the_models_distribution(kw, params):
    model = tiny_llama(1, vocab=SMALL_V)
    if kw.get("speculative_model") == "other":
        kw = {**kw, "speculative_model": tiny_llama(2, vocab=SMALL_V, layers=1)}
    prompt = [3, 7, 1, 3, 7, 1, 3]
    e = engine_for(model, 4000, max_num_seqs=256, max_batch_tokens=4096, **kw)
    each = [SamplingParams(max_tokens=3, seed=i, ignore_eos=True, **params)
            for i in range(SAMPLES)]  # fmt: skip
    outs = e.generate([prompt] * SAMPLES, each)
    tokens = torch.tensor([list(o.outputs[0].token_ids) for o in outs])
    probs = {"temperature": params["temperature"], "top_k": params.get("top_k")}
    exact = _exact_with_min_p(model, prompt, params.get("min_p", 0.0), probs)
    pairs = torch.zeros(SMALL_V, SMALL_V)
    pairs.index_put_((tokens[:, 0], tokens[:, 1]), torch.ones(SAMPLES), accumulate=True)
    third = torch.bincount(tokens[:, 2], minlength=SMALL_V)
    assert e.metrics.spec_accepted_tokens > 0
    p_pairs, p_third = chi2_pvalue(pairs, exact.sum(2)), chi2_pvalue(third, exact.sum((0, 1)))
    assert p_pairs > ALPHA and p_third > ALPHA, (p_pairs, p_third)


def _exact_with_min_p(model, prompt, min_p, processing):
    """:func:`exact_joint` with the engine's min-p after temperature and top-k (off at 0)."""

    def probs(logits, **kw):
        p = token_probs(logits, **kw)
        p = p.masked_fill(p < min_p * p.amax(-1, keepdim=True), 0.0)
        return p / p.sum(-1, keepdim=True)

    return exact_joint(model, prompt, 3, probs_fn=probs, **processing)


# -- configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"speculative": "medusa"}, ValueError, "speculative must be one of"),
        ({"speculative": "draft"}, ValueError, "needs speculative_model"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, ValueError,
         "num_speculative_tokens must be a positive int"),
        ({"speculative": "ngram", "prompt_lookup_min": 4}, ValueError,
         r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(3\)"),
        ({"speculative": "ngram", "speculative_model": "x"}, ValueError, "drop one"),
    ],
)  # fmt: skip
def test_config_checks(kw, exc, match):
    with pytest.raises(exc, match=match):
        EngineConfig(**kw)


def test_speculative_model_alone_means_draft():
    assert EngineConfig(speculative_model="some/folder").speculative == "draft"


def test_draft_vocabulary_must_match(target):
    with pytest.raises(ValueError, match=r"vocabulary \(11 tokens\) differs .* \(97\)"):
        engine_for(target, 50, speculative_model=tiny_llama(0, vocab=11))


def test_a_wrong_rule_fails_the_distribution_test(monkeypatch):
    """The engine's distribution test has the power to see a rule that accepts every draft."""
    from selfattn.models import speculative

    def accept_every_draft(p, draft, q=None, generator=None):
        return [*draft, int(torch.multinomial(p[len(draft)].float(), 1, generator=generator))]

    monkeypatch.setattr(speculative, "accept", accept_every_draft)
    with pytest.raises(AssertionError, match=r"\(.*\)"):
        test_sampling_keeps_the_models_distribution(
            {"speculative": "ngram", "num_speculative_tokens": 3}, {"temperature": 0.6}
        )


def test_metrics_route_reports_acceptance(target):
    """/metrics: vLLM's counter names (draft tokens, accepted) and the rate."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    prom = pytest.importorskip("prometheus_client.parser")
    from selfattn.serving.server import build_app
    from tests._serving_helpers import running_server

    e = engine_for(target, 200, speculative_model=copy.deepcopy(target))
    with running_server(build_app(e, model_name="tiny")) as url:
        body = {"model": "tiny", "prompt": [5, 6, 7, 5, 6], "max_tokens": 12, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=20).status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=20).text
    samples = {s.name: s.value for f in prom.text_string_to_metric_families(text)
               for s in f.samples}  # fmt: skip
    m = e.metrics
    assert samples["selfattn_spec_decode_num_draft_tokens_total"] == m.spec_draft_tokens > 0
    assert samples["selfattn_spec_decode_num_accepted_tokens_total"] == m.spec_accepted_tokens
    assert samples["selfattn_spec_decode_draft_acceptance_rate"] == 1.0  # the target's twin


def test_serve_flags_build_a_speculative_engine(tmp_path, monkeypatch):
    """`selfattn serve --speculative-model PATH --num-speculative-tokens K` reaches the engine;
    the flags default to the config's fields."""
    from selfattn.cli.main import build_parser, main
    from selfattn.serving import server
    from tests._serving_helpers import save_tiny_llama

    args = build_parser().parse_args(["serve", "m"])
    c = EngineConfig()
    assert (args.speculative, args.speculative_model, args.num_speculative_tokens,
            args.prompt_lookup_max, args.prompt_lookup_min) == (
        c.speculative, c.speculative_model, c.num_speculative_tokens, c.prompt_lookup_max,
        c.prompt_lookup_min)  # fmt: skip
    folder = save_tiny_llama(tmp_path / "tiny")
    served = []
    monkeypatch.setattr(server, "serve", lambda engine, **kw: served.append(engine))
    argv = ["serve", str(folder), "--kv-cache-bytes", str(1 << 20), "--threads", "1",
            "--speculative-model", str(folder), "--num-speculative-tokens", "2"]  # fmt: skip
    assert main(argv) == 0
    (engine,) = served
    assert engine.config.speculative == "draft" and engine.scheduler.lookahead == 2
    served.clear()
    argv = ["serve", str(folder), "--kv-cache-bytes", str(1 << 20), "--threads", "1",
            "--speculative", "ngram", "--prompt-lookup-max", "4"]  # fmt: skip
    assert main(argv) == 0
    assert served[0].speculator.ngram == (4, 1)
