"""Scoring through the OpenAI server: ``echo`` (with ``logprobs`` and ``max_tokens: 0``), vLLM's
``prompt_logprobs``, ``logit_bias``, ``best_of``, ``user`` / ``seed`` /
``max_completion_tokens``, and the accepted fields in ``/openapi.json``.

The tiny Llama of tests._serving_helpers is served on a thread on a free 127.0.0.1 port; values
must equal what ``Engine.generate`` reports for the same request on the same weights (one
request at a time computes the same batches), and every ``text_offset`` must point at its
token's text in the returned text.
"""

from __future__ import annotations

import json

import pytest

for _name in ("transformers", "tokenizers", "fastapi", "uvicorn"):
    pytest.importorskip(_name)
openai, httpx = pytest.importorskip("openai"), pytest.importorskip("httpx")

from selfattn.models import from_pretrained, load_tokenizer  # noqa: E402
from selfattn.serving import Engine, SamplingParams  # noqa: E402
from selfattn.serving.server import build_app  # noqa: E402
from tests._serving_helpers import running_server, save_tiny_llama  # noqa: E402

TIMEOUT_S = 20
NAME = "tiny"
PROMPT = "w5 w9 w17 w3 w22 w40"
KNOBS = {"kv_cache_bytes": 1 << 20, "page_size": 4}

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model, tokenizer, base URL) of a server running for the module."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    model, tokenizer = from_pretrained(folder).eval(), load_tokenizer(folder)
    with running_server(build_app(Engine(model, tokenizer, **KNOBS), model_name=NAME)) as url:
        yield model, tokenizer, url


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def engine_says(model, tokenizer, prompt, **params):
    """The request's output from ``Engine.generate`` on a fresh engine."""
    return Engine(model, tokenizer, **KNOBS).generate(prompt, SamplingParams(**params))[0]


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def assert_offsets_point_at_tokens(text: str, lp) -> None:
    """Each token's text starts at its offset, and the tokens tile the text they cover."""
    at = 0
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert offset == at, (token, offset, at)
        if at < len(text):
            assert text[offset : offset + len(token)] == token
        at += len(token)


# -- echo ------------------------------------------------------------------------------------------


def test_echo_with_max_tokens_0_scores_the_prompt(served):
    model, tokenizer, url = served
    c = client(url)
    ids = tokenizer.encode(PROMPT)
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    ch = r.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    lp = ch.logprobs
    assert "".join(lp.tokens) == PROMPT
    assert_offsets_point_at_tokens(ch.text, lp)
    want = engine_says(model, tokenizer, ids, max_tokens=0, prompt_logprobs=2).prompt_logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [x.logprob for x in want[1:]]
    for top, x in zip(lp.top_logprobs[1:], want[1:]):
        assert list(top.values()) == [v for _, v in x.top]
        # each alternative's text where the prompt's token stands (after its space)
        assert list(top) == [" " + tokenizer.decode([t]) for t, _ in x.top]


def test_echo_puts_the_prompt_before_the_completion(served):
    _, tokenizer, url = served
    c = client(url)
    ids = tokenizer.encode(PROMPT)
    kw = dict(model=NAME, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(prompt=PROMPT, logprobs=1, **kw).choices[0]
    echoed = c.completions.create(prompt=PROMPT, echo=True, logprobs=1, **kw).choices[0]
    assert echoed.text == PROMPT + plain.text
    lp = echoed.logprobs
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[len(ids) :] == plain.logprobs.token_logprobs
    assert_offsets_point_at_tokens(echoed.text, lp)
    # without logprobs, and with token ids as the prompt: the decoded prompt
    bare = c.completions.create(prompt=ids, echo=True, **kw).choices[0]
    assert bare.text == tokenizer.decode(ids) + plain.text and bare.logprobs is None
    # streamed: the prompt's chunk first, then the completion's
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=TIMEOUT_S, json={
        "model": NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True,
        "logprobs": 1, "ignore_eos": True, "stream": True, "n": 2,
    }) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [ch["text"] for ch in chunks[:2]] == [PROMPT, PROMPT]
    for i in (0, 1):
        mine = [ch for ch in chunks if ch["index"] == i]
        assert "".join(ch["text"] for ch in mine) == echoed.text
        offsets = [o for ch in mine for o in ch["logprobs"]["text_offset"]]
        assert offsets == lp.text_offset


# -- prompt_logprobs ---------------------------------------------------------------------------


def test_prompt_logprobs_in_vllms_shape(served):
    model, tokenizer, url = served
    ids = tokenizer.encode(PROMPT)
    want = engine_says(model, tokenizer, ids, max_tokens=1, prompt_logprobs=2).prompt_logprobs
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    completion = post(url, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    messages = [{"role": "user", "content": "w7 w8"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    chat_want = engine_says(model, tokenizer, chat_ids, max_tokens=1, prompt_logprobs=2)
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 2}
    chat = post(url, "/v1/chat/completions", body)
    chat_got = chat["prompt_logprobs"]  # vLLM's chat: beside the choices
    cases = [(completion, ids, want), (chat_got, chat_ids, chat_want.prompt_logprobs)]
    for got, prompt, scores in cases:
        assert len(got) == len(prompt) and got[0] is None
        for p, (entry, x) in enumerate(zip(got[1:], scores[1:])):
            t = prompt[p + 1]
            mine = entry[str(t)]
            assert (mine["logprob"], mine["rank"]) == (x.logprob, x.rank)
            assert mine["decoded_token"].strip() == tokenizer.decode([t])
            for rank, (alt, v) in enumerate(x.top, 1):
                assert (entry[str(alt)]["logprob"], entry[str(alt)]["rank"]) == (v, rank)
            assert set(entry) == {str(t), *(str(a) for a, _ in x.top)}


# -- the rest of the schema ------------------------------------------------------------------------


def test_logit_bias_best_of_user_seed_and_max_completion_tokens(served):
    model, tokenizer, url = served
    c = client(url)
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
    forced = c.completions.create(temperature=0, logit_bias={"17": 100}, **kw).choices[0]
    assert forced.text == " w17" * 5  # spaced after the prompt, as the prompt decodes
    free = c.completions.create(temperature=0, **kw).choices[0].text
    ban = {str(tokenizer.encode(w)[0]): -100 for w in set(free.split())}
    banned = c.completions.create(temperature=0, logit_bias=ban, **kw).choices[0].text
    assert not set(banned.split()) & set(free.split())
    # best_of: the engine's choice of the n best; user accepted; seeded: reproducible
    best = c.completions.create(n=2, best_of=5, seed=3, user="someone", **kw)
    again = c.completions.create(n=2, best_of=5, seed=3, **kw)
    want = engine_says(model, tokenizer, PROMPT, n=2, best_of=5, seed=3, max_tokens=5,
                       ignore_eos=True)  # fmt: skip
    assert [ch.text for ch in best.choices] == [o.text for o in want.outputs]
    assert [ch.text for ch in again.choices] == [o.text for o in want.outputs]
    assert best.usage.completion_tokens == 2 * 5
    chat = c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "w4"}], max_completion_tokens=3,
        temperature=0, user="someone", seed=1, logit_bias={"17": 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == " w17" * 3  # this tokenizer spaces every word
    assert chat.usage.completion_tokens == 3


def test_openapi_lists_the_accepted_fields(served):
    *_, url = served
    r = httpx.get(f"{url}/openapi.json", timeout=TIMEOUT_S)
    schemas = r.json()["components"]["schemas"]
    completion = set(schemas["CompletionRequest"]["properties"])
    chat = set(schemas["ChatCompletionRequest"]["properties"])
    shared = {"model", "max_tokens", "n", "temperature", "top_p", "stop", "stream", "seed",
              "logit_bias", "user", "presence_penalty", "frequency_penalty", "top_k", "min_p",
              "repetition_penalty", "stop_token_ids", "ignore_eos", "prompt_logprobs"}  # fmt: skip
    assert shared | {"prompt", "logprobs", "echo", "best_of", "suffix"} <= completion
    assert shared | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"} <= chat


def test_stop_reason_names_what_ended_a_sample(served):
    """vLLM's ``stop_reason``: the stop string, or the stop token's id, or None at the length."""
    _, _, url = served
    kw = dict(prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"17": 100})
    by_string = post(url, "/v1/completions", {**kw, "stop": ["w17"]})["choices"][0]
    assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", "w17")
    by_token = post(url, "/v1/completions", {**kw, "stop_token_ids": [17]})["choices"][0]
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", 17)
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}],
                "max_tokens": 3, "temperature": 0, "logit_bias": {"17": 100},
                "stop": ["w17"]})["choices"][0]  # fmt: skip
    assert (chat["finish_reason"], chat["stop_reason"]) == ("stop", "w17")
    longest = post(url, "/v1/completions", kw)["choices"][0]
    assert (longest["finish_reason"], longest["stop_reason"]) == ("length", None)
