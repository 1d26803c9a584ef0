"""Structured output in the Engine (SamplingParams(guide=Guide(...)), selfattn.serving.structured).

A tiny random Llama whose byte-level tokenizer spells JSON (tests._structured_helpers) runs
guided and free requests in one batch. Whatever the weights, every guided output must be in its
guide's language: JSON outputs parse and validate against their schema (``jsonschema``, the
oracle), regex outputs match in full (``re.fullmatch``), choices are one of the choices. A
truncated output comes back only with ``finish_reason "length"``. The logits are wider than the
vocabulary; a guide no token can continue ends its own request with ``DEAD_END``, disturbing
nobody.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from selfattn.serving import Engine, SamplingParams  # noqa: E402
from selfattn.serving.structured import DEAD_END, Guide, GuideError  # noqa: E402
from tests._structured_helpers import (  # noqa: E402
    MODEL_VOCAB,
    load_tiny_json_llama,
    save_tiny_json_llama,
)

pytestmark = pytest.mark.usefixtures("single_thread")

ADDRESS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["city", "zip"],
    "additionalProperties": False,
}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 10},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "home": ADDRESS,
            "nick": {"type": "string"},
        },
        "required": ["name", "age", "score", "home"],
        "additionalProperties": False,
    },
    "enum_array": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c"]},
                "minItems": 2,
                "maxItems": 4,
            },
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        "required": ["colour", "tags"],
    },
    "refs_anyof": {
        "$defs": {"address": ADDRESS, "id": {"type": "string", "format": "uuid"}},
        "type": "object",
        "properties": {
            "where": {"$ref": "#/$defs/address"},
            "who": {"anyOf": [{"$ref": "#/$defs/id"}, {"type": "integer", "minimum": 0}]},
            "when": {"type": "string", "format": "date"},
            "mail": {"type": "string", "format": "email", "maxLength": 16},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]},
        },
        "required": ["where", "who", "when", "mail"],
        "additionalProperties": False,
    },
    "top_array": {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]},
        "minItems": 1,
        "maxItems": 3,
    },
}
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny_json_llama(save_tiny_json_llama(tmp_path_factory.mktemp("tiny-json")))


def engine_of(tiny, **kw) -> Engine:
    model, tok = tiny
    return Engine(model, tok, **{"kv_cache_bytes": 1 << 22, "page_size": 8, **kw})


def valid(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_always_validate(tiny, temperature):
    engine = engine_of(tiny)
    seed = random.randrange(2**32)
    prompts, params, schemas = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for j in range(2):
            prompts.append(f"{name} {j}")
            guide = Guide("json_schema", json.dumps(schema))
            params.append(SamplingParams(max_tokens=300, temperature=temperature, guide=guide,
                                         seed=seed + 2 * i + j))  # fmt: skip
            schemas.append(schema)
    prompts.append("a free request")  # free and guided rows share the batch
    params.append(SamplingParams(max_tokens=12, temperature=0.0))
    outs = engine.generate(prompts, params)
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (seed, c.text, c.finish_reason)
        valid(schema, c.text)
        assert max(c.token_ids) < len(tiny[1].tokenizer.get_vocab())  # padded ids masked
    alone = engine_of(tiny).generate("a free request", params[-1])[0].outputs[0]
    assert outs[-1].outputs[0].token_ids == alone.token_ids
    engine.check()


def test_json_object_regex_choice_grammar(tiny):
    engine = engine_of(tiny)
    lark = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[a-z]/ | "x" "y"'
    gbnf = 'root ::= "call " name "()"\nname ::= [a-c]+'
    cases = [
        (Guide("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (Guide("regex", r"[0-9]{3}-[a-f]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-f]{2,4}", t)),
        (
            Guide("choice", ("yes", "no", 'say "maybe"')),
            lambda t: t in ("yes", "no", 'say "maybe"'),
        ),
        (
            Guide("grammar", lark),
            lambda t: re.fullmatch(r"\((?:[a-z]|xy)(?:,(?:[a-z]|xy)){0,2}\)", t),
        ),
        (Guide("grammar", gbnf), lambda t: re.fullmatch(r"call [a-c]+\(\)", t)),
    ]
    for temperature in (0.0, 1.0):
        ps = [SamplingParams(max_tokens=200, temperature=temperature, guide=g) for g, _ in cases]
        for (g, ok), out in zip(cases, engine.generate(["go"] * len(cases), ps)):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (g, c.text, c.finish_reason)


def test_samples_fork_their_guide_and_length_truncates(tiny):
    engine = engine_of(tiny)
    schema = SCHEMAS["enum_array"]
    guide = Guide("json_schema", json.dumps(schema))
    out = engine.generate("n", SamplingParams(n=4, max_tokens=300, temperature=1.0, guide=guide))
    for c in out[0].outputs:
        assert c.finish_reason == "stop"
        valid(schema, c.text)
    short = engine.generate("n", SamplingParams(max_tokens=3, temperature=0.0, guide=guide))
    c = short[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_logprobs_stay_the_models(tiny):
    """The favoured quote is the model's most likely first token; the guide forces "{" (or
    its merge): the reported top alternative is the quote, the chosen token less likely."""
    tok = tiny[1]
    engine = engine_of(tiny)
    guide = Guide("json_schema", json.dumps(SCHEMAS["nested"]))
    out = engine.generate("p", SamplingParams(max_tokens=5, temperature=0.0, guide=guide,
                                              logprobs=3))  # fmt: skip
    first = out[0].outputs[0].logprobs[0]
    quote = tok.tokenizer.token_to_id('"')
    assert first.top[0][0] == quote and first.token != quote
    assert first.logprob < first.top[0][1]


def test_padded_ids_are_masked(tiny):
    """Ids past the tokenizer's vocabulary (the model's padding) are never chosen by a guided
    request, even where the model favours them above everything."""
    model, tok = tiny
    pad = MODEL_VOCAB - 1
    assert pad >= len(tok.tokenizer.get_vocab())
    with torch.no_grad():
        model.lm_head.bias[pad] += 50.0
    try:
        engine = engine_of(tiny)
        guided = SamplingParams(max_tokens=50, temperature=0.0, guide=Guide("regex", "[a-z]{4}"))
        free = SamplingParams(max_tokens=3, temperature=0.0)
        g, f = engine.generate(["a", "b"], [guided, free])
    finally:
        with torch.no_grad():
            model.lm_head.bias[pad] -= 50.0
    assert f.outputs[0].token_ids[0] == pad
    assert pad not in g.outputs[0].token_ids and re.fullmatch("[a-z]{4}", g.outputs[0].text)


def test_dead_end_ends_its_request_only(tiny):
    """The vocabulary has no tab nor newline: the guide's language cannot be spelled."""
    engine = engine_of(tiny)
    dead = SamplingParams(max_tokens=20, temperature=0.0, guide=Guide("regex", "ab(\t|\n)c"))
    other = SamplingParams(max_tokens=40, temperature=1.0, guide=Guide("regex", "[0-9]{6}"))
    free = SamplingParams(max_tokens=6, temperature=0.0)
    d, o, f = engine.generate(["x", "y", "z"], [dead, other, free])
    assert d.outputs[0].finish_reason == "stop" and d.outputs[0].stop_reason == DEAD_END
    assert d.outputs[0].text == "ab"
    assert re.fullmatch("[0-9]{6}", o.outputs[0].text)
    alone = engine_of(tiny).generate("z", free)[0].outputs[0]
    assert f.outputs[0].token_ids == alone.token_ids
    engine.check()


def test_speculative_engine_declines_drafts_for_guided(tiny):
    engine = engine_of(tiny, speculative="ngram")
    schema = SCHEMAS["top_array"]
    p = SamplingParams(
        max_tokens=200, temperature=0.0, guide=Guide("json_schema", json.dumps(schema))
    )
    out = engine.generate("[1, 2, 3, 1, 2, 3", p)[0].outputs[0]
    assert out.finish_reason == "stop"
    valid(schema, out.text)


@pytest.mark.parametrize(
    ("guide", "words"),
    [
        (Guide("regex", "a(b"), "unclosed group"),
        (Guide("grammar", "start: missing_rule"), "missing_rule"),
        (Guide("json_schema", '{"type": "strng"}'), "strng"),
        (Guide("json_schema", "{not json"), "not valid JSON"),
        (Guide("json_schema", '{"type": "string", "format": "no-such-format"}'), "no-such-format"),
    ],
)
def test_guides_the_engine_refuses(tiny, guide, words):
    engine = engine_of(tiny)
    with pytest.raises(GuideError, match=re.escape(words)):
        engine.add_request("x", SamplingParams(guide=guide))
    assert not engine.has_unfinished()


def test_guide_checks():
    with pytest.raises(ValueError, match="non-empty strings"):
        Guide("choice", ())
    with pytest.raises(ValueError, match="kind must be one of"):
        Guide("xml", "x")


def test_compiled_guides_are_cached(tiny):
    engine = engine_of(tiny)
    g = engine.grammars
    g.cache_size = 2
    guides = [Guide("regex", f"[a-z]{{{k}}}") for k in (1, 2, 3)]
    for guide in guides:
        g.compile(guide)
    assert g.compile(guides[2]) is g.compile(guides[2])
    assert list(g._cache) == guides[1:]  # the least recently used went first
