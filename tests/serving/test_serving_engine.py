"""selfattn.serving.Engine against selfattn.models.generate and transformers' generate.

Tiny perturbed random models of each family (test_models_decoder.tiny_pair, saved with
save_pretrained) serve prompts of mixed lengths, some sharing a prefix, arriving in a random
order, some with n > 1, through a pool small enough to force preemption and a token budget
small enough to chunk every prefill: each sample's greedy tokens must equal both references run
on its request alone. Then seeded sampling, prefix caching, stops, logprobs, aborts, the
waiting-queue bound, argument errors, the asyncio stream, quantised pools and a soak.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.cache import PagedKV, kv_cache_bytes  # noqa: E402
from selfattn.models.generate import generate  # noqa: E402
from selfattn.serving import Engine, QueueFull, SamplingParams  # noqa: E402
from tests.models.test_models_decoder import VOCAB, tiny_pair  # noqa: E402

FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "gemma2"]
P = 4  # tokens per page: prompts span several pages, prefixes share whole ones
GREEDY = dict(temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (transformers model, our model), built once."""
    return {f: tiny_pair(f, tmp_path_factory.mktemp(f), seed=i) for i, f in enumerate(FAMILIES)}


def engine_for(model, pages: int, **kw) -> Engine:
    """An engine whose pool holds exactly ``pages`` pages of ``P`` fp32 tokens."""
    c = model.config
    one = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, P, "fp32")
    return Engine(model, kv_cache_bytes=pages * one, page_size=P, **kw)


def prompts_for(seed: int, count: int, shared: int = 9, longest: int = 30) -> list[list[int]]:
    """Random prompts of 1..longest tokens; every other one starts with one shared prefix."""
    g = random.Random(seed)
    prefix = [g.randrange(2, VOCAB) for _ in range(shared)]
    out = []
    for i in range(count):
        tail = [g.randrange(2, VOCAB) for _ in range(g.randint(1, longest - shared))]
        out.append(prefix + tail if i % 2 else [g.randrange(2, VOCAB), *tail])
    return out


def ours_alone(model, prompt, n: int) -> list[int]:
    return generate(model, torch.tensor([prompt]), n)[0, len(prompt) :].tolist()


def theirs_alone(hf, prompt, n: int) -> list[int]:
    ids = torch.tensor([prompt])
    return hf.generate(ids, max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


def run_arriving(engine: Engine, requests, seed: int) -> dict[int, object]:
    """Add ``requests`` ``(prompt, params)`` in a random order, a random few per step, and step
    until all finish; returns {request index: final output}."""
    g = random.Random(seed)
    order = list(range(len(requests)))
    g.shuffle(order)
    ids, done = {}, {}
    while order or engine.has_unfinished():
        for _ in range(g.randint(0, 2)):
            if order:
                i = order.pop()
                ids[engine.add_request(*requests[i])] = i
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
    assert set(done) == set(ids), "a request was lost"
    return {ids[r]: out for r, out in done.items()}


def assert_drained(engine: Engine) -> None:
    """Nothing runs, and every page is free or held by the prefix cache alone."""
    engine.check()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    cached = 0 if engine.kv.index is None else engine.kv.index.num_cached_pages
    assert engine.kv.pool.num_used == cached


# -- greedy parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate_and_transformers(models, family):
    hf, ours = models[family]
    prompts = prompts_for(seed=FAMILIES.index(family), count=9)
    g = random.Random(1)
    requests = [
        (p, SamplingParams(max_tokens=g.randint(1, 12), n=2 if i in (3, 6) else 1, **GREEDY))
        for i, p in enumerate(prompts)
    ]
    # 14 pages of 4 tokens for up to 6 sequences of up to 42 tokens: preemption is certain;
    # chunks of up to 24 tokens attend as rows (<= 16) or as query blocks.
    engine = engine_for(ours, 14, max_batch_tokens=24, max_num_seqs=6)
    outs = run_arriving(engine, requests, seed=2)
    for i, (prompt, params) in enumerate(requests):
        want = ours_alone(ours, prompt, params.max_tokens)
        assert want == theirs_alone(hf, prompt, params.max_tokens)
        assert len(outs[i].outputs) == params.n
        for sample in outs[i].outputs:
            assert list(sample.token_ids) == want, f"request {i} sample {sample.index}"
            assert sample.finish_reason == "length"
    assert engine.metrics.preemptions > 0, "the pool was meant to force preemption"
    assert any(o.cached_tokens > 0 for o in outs.values()), "no prefix was reused"
    assert_drained(engine)


def test_engine_steps_take_the_decode_fast_path(models, monkeypatch):
    """Every engine step of a plain Llama-layout model (decode tokens, short and long prefill
    chunks) runs the blocks' lean step loop (selfattn.models.decode_fast), not module by module,
    and greedy tokens still equal generate's."""
    from selfattn.models import decode_fast

    _, ours = models["llama"]
    counts = {"fast": 0, "steps": 0}
    run, forward = decode_fast.FastBlocks.run, Engine._forward

    def fast(self, *args):
        counts["fast"] += 1
        return run(self, *args)

    def step(self, *args):
        counts["steps"] += 1
        return forward(self, *args)

    monkeypatch.setattr(decode_fast.FastBlocks, "run", fast)
    monkeypatch.setattr(Engine, "_forward", step)
    prompts = prompts_for(seed=7, count=4)
    engine = engine_for(ours, 40, max_batch_tokens=24)
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    assert counts["steps"] >= 6 and counts["fast"] == counts["steps"]
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == ours_alone(ours, prompt, 6)


# -- sampling --------------------------------------------------------------------------------------


def sampled(seed: int, n: int = 1, **kw) -> SamplingParams:
    options = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
                   presence_penalty=0.3, frequency_penalty=0.2, max_tokens=10)  # fmt: skip
    return SamplingParams(seed=seed, n=n, ignore_eos=True, **{**options, **kw})


def test_seeded_sampling_is_reproducible_and_batch_independent(models):
    _, ours = models["llama"]
    prompt = prompts_for(seed=5, count=2)[1]
    alone = engine_for(ours, 64).generate(prompt, sampled(7))[0].outputs[0].token_ids
    # The same request among others, arriving in another order, through a pool that preempts.
    others = [(p, sampled(100 + i, n=2)) for i, p in enumerate(prompts_for(seed=6, count=6))]
    engine = engine_for(ours, 20, max_batch_tokens=12, max_num_seqs=5)
    outs = run_arriving(engine, [(prompt, sampled(7)), *others], seed=3)
    assert outs[0].outputs[0].token_ids == alone
    assert engine.metrics.preemptions > 0
    again = engine_for(ours, 64).generate(prompt, sampled(7))[0].outputs[0].token_ids
    assert again == alone
    other_seed = engine_for(ours, 64).generate(prompt, sampled(8))[0].outputs[0].token_ids
    assert other_seed != alone
    assert_drained(engine)


def test_sample_i_of_n_draws_from_seed_plus_i(models):
    """n = 3 forks the prompt's pages; sample i continues exactly as a lone request seeded
    seed + i (its own generator, its own penalties)."""
    _, ours = models["qwen2"]
    prompt = prompts_for(seed=8, count=2)[1]
    out = engine_for(ours, 64).generate(prompt, sampled(20, n=3))[0]
    for i, sample in enumerate(out.outputs):
        lone = engine_for(ours, 64).generate(prompt, sampled(20 + i))[0].outputs[0]
        assert sample.token_ids == lone.token_ids
    assert len({s.token_ids for s in out.outputs}) > 1


def test_greedy_rows_ignore_filters_and_temperature_zero_is_argmax(models):
    _, ours = models["llama"]
    prompt = prompts_for(seed=9, count=1)[0]
    want = ours_alone(ours, prompt, 6)
    params = SamplingParams(max_tokens=6, temperature=0.0, top_k=3, top_p=0.5, ignore_eos=True)
    assert list(engine_for(ours, 32).generate(prompt, params)[0].outputs[0].token_ids) == want


def test_extreme_legal_sampling_values_draw_sensibly():
    """A temperature below float32's range (0 there) is the most likely token, and a tiny
    repetition_penalty (dividing a logit to +inf) makes the penalised tokens certain, not a
    0 / 0: legal values the schema fuzzer sent (they once failed their whole step)."""
    from types import SimpleNamespace as NS

    from selfattn.serving.sampling import choose

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=g)
    req = NS(prompt_ids=[7, 9], params=None)

    def seq(**kw):
        p = SamplingParams(**kw)
        s = NS(params=p, request=NS(**{**vars(req), "params": p}), tokens=[7, 9],
               generator=torch.Generator().manual_seed(1), matcher=None, num_prompt=2)  # fmt: skip
        s.output_ids = []
        return s

    rows = [seq(temperature=1.2e-99), seq(temperature=1e-30, top_k=1),
            seq(temperature=1.0, repetition_penalty=1e-300)]  # fmt: skip
    x = logits.clone()
    x[2, 7], x[2, 9] = 5.0, 6.0  # the prompt's tokens, positive: divided to +inf
    got = [c.token for c in choose(x, rows)]
    assert got[0] == int(x[0].argmax()) and got[1] == int(x[1].argmax())
    assert got[2] in (7, 9)


# -- prefix caching --------------------------------------------------------------------------------


def test_prefix_caching_computes_only_the_new_tokens(models):
    """6 requests with one 16-token prefix (4 pages) + 3 own tokens, submitted at once: the
    prefix is computed once (the others wait a step for its pages), each later request
    reports 16 cached tokens, and the outputs do not change."""
    _, ours = models["mistral"]
    g = random.Random(4)
    prefix = [g.randrange(2, VOCAB) for _ in range(16)]
    prompts = [prefix + [g.randrange(2, VOCAB) for _ in range(3)] for _ in range(6)]
    params = SamplingParams(max_tokens=4, **GREEDY)
    runs = {}
    for caching in (True, False):
        engine = engine_for(ours, 64, prefix_caching=caching)
        runs[caching] = (engine.generate(prompts, params), engine.metrics)
    (with_cache, m_on), (without, m_off) = runs[True], runs[False]
    assert [o.outputs[0].token_ids for o in with_cache] == [o.outputs[0].token_ids for o in without]
    assert [o.cached_tokens for o in with_cache] == [0] + [16] * 5
    assert [o.cached_tokens for o in without] == [0] * 6
    assert m_off.computed_tokens - m_on.computed_tokens == 5 * 16
    assert m_on.prefix_hit_rate == pytest.approx(5 * 16 / (6 * 19))


# -- stops, lengths, logprobs ----------------------------------------------------------------------


class CharTokenizer:
    """Token t <-> one character: enough for stop strings and streamed text."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x100 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(0x100 + t) for t in ids)


def test_stop_strings_stop_tokens_eos_and_length(models):
    _, ours = models["llama"]
    tok = CharTokenizer()
    ids_prompt = prompts_for(seed=10, count=1)[0]
    prompt = tok.decode(ids_prompt)
    engine = engine_for(ours, 64, max_num_seqs=8, tokenizer=tok)
    free = engine.generate(prompt, SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    assert free.finish_reason == "length" and free.text == tok.decode(free.token_ids)
    ids = list(free.token_ids)
    stop_text = tok.decode(ids[3:5])
    by_text = engine.generate(prompt, SamplingParams(max_tokens=8, stop=[stop_text], **GREEDY))
    got = by_text[0].outputs[0]
    first = free.text.find(stop_text)
    assert (got.finish_reason, got.stop_reason, got.text) == ("stop", stop_text, free.text[:first])
    by_id = engine.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[ids[2]], **GREEDY))
    got = by_id[0].outputs[0]
    cut = ids.index(ids[2])
    assert list(got.token_ids) == ids[: cut + 1]  # the stop token is kept in the ids ...
    assert got.text == tok.decode(ids[:cut])  # ... not in the text
    assert (got.finish_reason, got.stop_reason) == ("stop", ids[2])
    eos_engine = engine_for(ours, 64)
    eos_engine._eos = frozenset({ids[1]})  # as if the model's end-of-sequence token
    ignored = eos_engine.generate(ids_prompt, SamplingParams(max_tokens=8, **GREEDY))
    assert list(ignored[0].outputs[0].token_ids) == ids
    stopped = eos_engine.generate(ids_prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert list(stopped[0].outputs[0].token_ids) == ids[: ids.index(ids[1]) + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"
    assert_drained(engine)
    assert_drained(eos_engine)


class CountingTokenizer(CharTokenizer):
    """Counts the token ids it decodes."""

    decoded = 0

    def decode(self, ids) -> str:
        self.decoded += len(ids)
        return super().decode(ids)


def test_stop_strings_and_text_decode_linearly(models):
    """Each new token decodes a window of a few tokens, not the whole output again (a sample of
    n tokens used to decode n(n+1)/2 ids); the text and the stop strings come out the same."""
    _, ours = models["llama"]
    tok = CountingTokenizer()
    n = 48
    engine = engine_for(ours, 64, tokenizer=tok)
    params = SamplingParams(max_tokens=n, stop=["never here", "nor this"], **GREEDY)
    out = engine.generate(prompts_for(seed=16, count=1)[0], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == n
    assert out.text == CharTokenizer().decode(out.token_ids)
    assert tok.decoded <= 4 * n, tok.decoded  # two decodes of at most two tokens per token


class ByteTokenizer:
    """Token t <-> one byte; text is the bytes as UTF-8 (invalid ones replaced)."""

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("seed", range(4))
def test_incremental_detokenize_equals_one_decode(seed):
    """Characters of 1-4 UTF-8 bytes, one byte per token, with stray bytes: the text grows by
    prefixes of the whole decode (an unfinished character waits) and ends equal to it."""
    from selfattn.serving.request import Request

    g = random.Random(seed)
    chars = [chr(g.choice([g.randrange(0x20, 0x7F), g.randrange(0xA0, 0x800),
                           g.randrange(0x800, 0xD800), g.randrange(0x10000, 0x10FFFF)]))
             for _ in range(60)]  # fmt: skip
    data = b"".join(c.encode() for c in chars)
    data = bytes(b if g.random() > 0.03 else g.randrange(0x80, 0x100) for b in data)  # strays
    tok = ByteTokenizer()
    seq = Request("r", None, [0x41], SamplingParams(), 0, 0.0, 0).seqs[0]
    full = tok.decode(data)
    for i, b in enumerate(data):
        seq.tokens.append(b)
        seq.detokenize(tok, i + 1, final=i + 1 == len(data))
        assert full.startswith(seq.text)  # never a character the next byte would change
    assert seq.text == full


class WordTokenizer:
    """SentencePiece's way with spaces: words joined by one, the text's first word without."""

    def decode(self, ids) -> str:
        return " ".join(f"w{i}" for i in ids)


@pytest.mark.parametrize("prompt_len", [1, 3, 12])
def test_a_completion_spells_its_start_as_after_the_prompt(prompt_len):
    """The completion's text is what its tokens add to the prompt's decoded text (a first word's
    space included), also when the prompt is longer than the decoding context."""
    from selfattn.serving.request import Request

    tok = WordTokenizer()
    prompt, out = list(range(prompt_len)), [7, 8, 9]
    seq = Request("r", None, prompt, SamplingParams(), 0, 0.0, 0).seqs[0]
    for i, t in enumerate(out):
        seq.tokens.append(t)
        seq.detokenize(tok, i + 1, final=i + 1 == len(out))
    whole, head = tok.decode(prompt + out), tok.decode(prompt)
    assert seq.text == whole[len(head) :] == " w7 w8 w9"


def test_logprobs_are_the_models_log_softmax(models):
    _, ours = models["gemma2"]
    prompt = prompts_for(seed=11, count=1)[0]
    params = SamplingParams(max_tokens=5, logprobs=3, **GREEDY)
    sample = engine_for(ours, 32).generate(prompt, params)[0].outputs[0]
    ids = torch.tensor([prompt + list(sample.token_ids)])
    with torch.no_grad():
        full = ours(ids)[0, len(prompt) - 1 : -1].log_softmax(-1)  # (5, vocab)
    for t, lp in enumerate(sample.logprobs):
        top_v, top_i = full[t].topk(3)
        assert lp.token == sample.token_ids[t] == int(top_i[0])
        torch.testing.assert_close(torch.tensor(lp.logprob), full[t, lp.token])
        assert [i for i, _ in lp.top] == top_i.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top_v)


# -- aborts, queue bound, argument errors ----------------------------------------------------------


def test_abort_frees_pages_and_leaves_others_alone(models):
    _, ours = models["gpt2"]
    prompts = prompts_for(seed=12, count=4)
    params = SamplingParams(max_tokens=10, **GREEDY)
    engine = engine_for(ours, 64, max_num_seqs=2)
    rids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    engine.step()
    engine.abort(rids[0])  # running
    engine.abort(rids[3])  # still waiting (two sequences at most run)
    engine.abort("no-such-request")
    finals = {}
    while engine.has_unfinished():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    for r in (rids[0], rids[3]):
        assert finals[r].outputs[0].finish_reason == "abort"
    for r, p in zip(rids[1:3], prompts[1:3]):
        assert list(finals[r].outputs[0].token_ids) == ours_alone(ours, p, 10)
    assert engine.metrics.requests_aborted == 2
    assert_drained(engine)


def test_a_failing_step_ends_its_requests_and_the_engine_goes_on(models, monkeypatch):
    _, ours = models["gpt2"]
    engine = engine_for(ours, 32)
    params = SamplingParams(max_tokens=4, **GREEDY)
    real, calls = ours.forward, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args, **kw)

    monkeypatch.setattr(ours, "forward", flaky)
    a = engine.add_request([5, 6, 7], params)
    engine.step()  # A's prefill
    b = engine.add_request([8, 9], params)
    failed = {o.request_id: o for o in engine.step()}  # A's decode and B's prefill: raises
    assert set(failed) == {a, b}
    for out in failed.values():
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert str(out.error) == "boom"
    engine.check()  # the step's pages were given back
    (out,) = engine.generate([[3, 4]], params)
    assert list(out.outputs[0].token_ids) == ours_alone(ours, [3, 4], 4)
    assert_drained(engine)


def test_waiting_queue_is_bounded(models):
    _, ours = models["gpt2"]
    engine = engine_for(ours, 16, max_waiting=2)
    engine.add_request([5, 6])
    engine.add_request([7, 8])
    with pytest.raises(QueueFull, match="max_waiting=2"):
        engine.add_request([9])
    # generate() feeds a bounded queue as it drains
    outs = engine.generate([[3]] * 5, SamplingParams(max_tokens=2, **GREEDY))
    assert len(outs) == 5


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n": 0}, "n must be in 1..128"),
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
        ({"temperature": -0.5}, r"temperature must lie in \[0.0, inf\)"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_k": 0}, "top_k must be >= 1"),
        ({"top_p": 0.0}, r"top_p must lie in \(0.0, 1.0\]"),
        ({"min_p": 1.5}, "min_p must lie in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must lie in"),
        ({"presence_penalty": 3.0}, r"presence_penalty must lie in \[-2.0, 2.0\]"),
        ({"seed": -1}, "seed must be in"),
        ({"stop": [""]}, "stop must hold non-empty strings"),
        ({"stop_token_ids": [-3]}, "stop_token_ids entries must be >= 0"),
        ({"logprobs": 21}, "logprobs must be in 0..20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in 0..20"),
        ({"logit_bias": {3: 100.5}}, r"logit_bias\[3\] must lie in \[-100.0, 100.0\]"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias token ids must be >= 0"),
        ({"logit_bias": [1, 2]}, "logit_bias must map token ids to biases"),
        ({"n": 3, "best_of": 2}, "best_of must be in 3..128"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ],
)
def test_sampling_params_errors_name_the_field(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kw)


def test_bad_requests_raise_and_change_nothing(models):
    _, ours = models["llama"]
    engine = engine_for(ours, 16, max_num_seqs=2)  # 64 tokens at most per sequence
    cases = [
        (([],), "the prompt is empty"),
        (([1, VOCAB],), f"ints in 0..{VOCAB - 1}"),
        (("text",), "a text prompt needs a tokenizer"),
        (([1] * 60, SamplingParams(max_tokens=8)), "exceed the engine's max_model_len=64"),
        (([1], SamplingParams(stop="x")), "stop strings .* need a tokenizer"),
        (([1], SamplingParams(n=3)), "n=3 samples need 3 sequences .* max_num_seqs=2"),
        (([1], SamplingParams(best_of=3)), "best_of=3 samples .* lower best_of"),
        (([1], SamplingParams(logit_bias={VOCAB: 1.0})), f"logit_bias names token id {VOCAB}"),
        (([1], {"max_tokens": 3}), "params must be a SamplingParams"),
    ]
    for args, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            engine.add_request(*args)
    engine.add_request([1], request_id="a")
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        engine.add_request([2], request_id="a")
    with pytest.raises(TypeError, match="selfattn's decoder LMs"):
        Engine(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="holds no page"):
        Engine(ours, kv_cache_bytes=10)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
        Engine(ours, max_num_seqs=0)
    assert engine.generate([[2]], SamplingParams(max_tokens=1, **GREEDY))[0].finished
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.generate([[2, 3], []], SamplingParams(max_tokens=2, **GREEDY))
    assert not engine.has_unfinished()  # the good prompt before it was aborted
    engine.abort("a")
    engine.step()
    assert_drained(engine)


# -- asyncio ---------------------------------------------------------------------------------------


def test_stream_yields_deltas_and_a_client_that_leaves_frees_its_pages(models):
    _, ours = models["mistral"]
    tok = CharTokenizer()
    prompts = prompts_for(seed=13, count=4)
    engine = engine_for(ours, 64, tokenizer=tok)
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def client(prompt, leave_after=None):
        tokens, text, last = [], "", None
        async for out in engine.stream(prompt, params):
            tokens += out.outputs[0].delta_token_ids
            text += out.outputs[0].delta_text
            last = out
            if leave_after is not None and len(tokens) >= leave_after:
                break
        return tokens, text, last

    async def main():
        return await asyncio.gather(*(client(p, 2 if i == 1 else None)
                                      for i, p in enumerate(prompts)))  # fmt: skip

    results = asyncio.run(main())
    engine.close()
    for i, (tokens, text, last) in enumerate(results):
        want = ours_alone(ours, prompts[i], 6)
        if i == 1:
            assert tokens == want[: len(tokens)] and not last.finished
            continue
        assert tokens == want == list(last.outputs[0].token_ids)
        assert text == tok.decode(want) and last.finished
    assert not engine.has_unfinished()
    assert_drained(engine)


# -- quantised pools -------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantised_pool_serves_close_to_float(models, kv_dtype):
    """int8 / fp8 pages end to end: the first token's log-probabilities stay near the float
    pool's (bounds: a few times the worst seen over these prompts), pages still balance."""
    _, ours = models["llama"]
    prompts = prompts_for(seed=14, count=5)
    params = SamplingParams(max_tokens=3, logprobs=5, **GREEDY)
    exact = engine_for(ours, 64).generate(prompts, params)
    quant = Engine(ours, kv_cache_bytes=engine_for(ours, 64).kv.nbytes, page_size=P,
                   kv_dtype=kv_dtype)  # fmt: skip
    got = quant.generate(prompts, params)
    bound = {torch.int8: 0.02, torch.float8_e4m3fn: 0.1}[kv_dtype]  # nats
    for a, b in zip(exact, got):
        ta, tb = dict(a.outputs[0].logprobs[0].top), dict(b.outputs[0].logprobs[0].top)
        common = ta.keys() & tb.keys()
        assert len(common) >= 3
        assert max(abs(ta[t] - tb[t]) for t in common) <= bound
    assert quant.kv.k_store.dtype == kv_dtype
    assert quant.kv.num_pages > engine_for(ours, 64).kv.num_pages  # same bytes, more pages
    assert_drained(quant)


@pytest.mark.parametrize("D", [24, 64])
def test_int8_pool_bytes_follow_the_formula(D):
    """An int8 pool takes ``kv_cache_bytes``'s bytes (a bfloat16 scale per token and head):
    ``(D + 2) / 2D`` of a bf16 pool of the same pages, <= 0.53 for heads of 64."""
    L, N, Hkv = 3, 7, 2
    pools = {
        dt: PagedKV(L, N, P, Hkv, D, max_seqs=1, max_pages_per_seq=N, dtype=dt)
        for dt in (torch.int8, torch.bfloat16)
    }
    for dt, kv in pools.items():
        assert kv.nbytes == kv_cache_bytes(L, Hkv, D, N * P, dt)
    ratio = pools[torch.int8].nbytes / pools[torch.bfloat16].nbytes
    assert ratio == (D + 2) / (2 * D)
    if D == 64:
        assert ratio <= 0.53


# -- soak ------------------------------------------------------------------------------------------


def test_soak_many_requests_random_params_aborts_and_a_full_pool(models):
    """300 requests of random lengths and parameters, arriving over time, ~10 % aborted, through
    a pool that fills (preemption): every greedy output equals generate() of its request, every
    aborted one is a prefix of it, seeded ones repeat alone, none is lost, no page leaks."""
    _, ours = models["llama"]
    g = random.Random(15)
    prompts = prompts_for(seed=15, count=300, shared=8, longest=24)
    requests = []
    for i, p in enumerate(prompts):
        if i % 3:
            params = SamplingParams(max_tokens=g.randint(1, 8), n=g.choice([1, 1, 2]), **GREEDY)
        else:
            params = sampled(1000 + i, n=g.choice([1, 2]), max_tokens=g.randint(1, 8))
        requests.append((p, params))
    engine = engine_for(ours, 40, max_batch_tokens=48, max_num_seqs=12, max_waiting=64)
    pending = list(range(len(requests)))
    ids, finals, aborted = {}, {}, set()
    while pending or engine.has_unfinished():
        while pending and len(engine.scheduler.waiting) < 32 and g.random() < 0.8:
            i = pending.pop(0)
            ids[engine.add_request(*requests[i])] = i
        live = [r for r in ids if r not in finals and r not in aborted]
        if live and g.random() < 0.12:
            victim = g.choice(live)
            aborted.add(victim)
            engine.abort(victim)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
    assert set(finals) == set(ids) and len(ids) == 300
    assert engine.metrics.preemptions > 0
    assert engine.metrics.requests_aborted == len(aborted) >= 10
    print(engine.metrics.snapshot())
    # greedy references in one left-padded batch per max_tokens (rows are independent)
    greedy = [i for i in range(300) if requests[i][1].greedy]
    by_len: dict[int, list[int]] = {}
    for i in greedy:
        by_len.setdefault(requests[i][1].max_tokens, []).append(i)
    want = {}
    for n, rows in by_len.items():
        S = max(len(prompts[i]) for i in rows)
        ids_t = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.long)
        for b, i in enumerate(rows):
            ids_t[b, S - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[b, S - len(prompts[i]) :] = 1
        out = generate(ours, ids_t, n, attention_mask=mask)[:, S:]
        want |= {i: out[b].tolist() for b, i in enumerate(rows)}
    for rid, out in finals.items():
        i = ids[rid]
        for sample in out.outputs:
            if sample.finish_reason == "abort":
                assert rid in aborted
                if i in want:
                    assert list(sample.token_ids) == want[i][: len(sample.token_ids)]
            elif i in want:
                assert list(sample.token_ids) == want[i], f"request {i}"
            else:
                assert len(sample.token_ids) == requests[i][1].max_tokens
    # a few seeded ones that ran to their length, alone in a fresh engine
    by_index = {ids[r]: out for r, out in finals.items()}
    seeded = [i for i in range(300) if i not in want and i % 3 == 0]
    seeded = [i for i in seeded if by_index[i].outputs[0].finish_reason == "length"][:5]
    assert seeded
    for i in seeded:
        alone = engine_for(ours, 64).generate(*requests[i])[0]
        assert [s.token_ids for s in alone.outputs] == [s.token_ids for s in by_index[i].outputs]
    assert_drained(engine)
