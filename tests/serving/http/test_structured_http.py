"""Structured output through the OpenAI server: ``response_format`` (the ``openai`` client's
``chat.completions.parse`` with a pydantic model), vLLM's ``guided_*`` and ``structured_outputs``
fields on chat and completions, and the 400s of guides the engine refuses (each naming its
field). A tiny random Llama whose tokenizer spells JSON (tests._structured_helpers) serves on a
free loopback port; every call has a timeout."""

from __future__ import annotations

import json
import re
import typing

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pydantic = pytest.importorskip("pydantic")

from selfattn.serving import Engine  # noqa: E402
from selfattn.serving.server import build_app  # noqa: E402
from tests._serving_helpers import running_server  # noqa: E402
from tests._structured_helpers import load_tiny_json_llama, save_tiny_json_llama  # noqa: E402

TIMEOUT_S = 30
NAME = "tiny-json"

pytestmark = pytest.mark.usefixtures("single_thread")


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    kind: typing.Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=4)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model, tok = load_tiny_json_llama(save_tiny_json_llama(tmp_path_factory.mktemp("tiny-json")))
    engine = Engine(model, tok, kv_cache_bytes=1 << 22, page_size=8)
    with running_server(build_app(engine, model_name=NAME)) as base:
        yield base


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=TIMEOUT_S, max_retries=0)


MESSAGES = [{"role": "user", "content": "a pet"}]


def test_parse_with_a_pydantic_model(url):
    r = client(url).chat.completions.parse(
        model=NAME, messages=MESSAGES, response_format=Pet, max_tokens=200, temperature=1.0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_response_format_json_object_and_guided_fields(url):
    c = client(url)
    r = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=200, temperature=0,
                                  response_format={"type": "json_object"})  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=1,
                                  extra_body={"guided_choice": ["alpha", "beta"]})  # fmt: skip
    assert r.choices[0].message.content in ("alpha", "beta")
    r = c.completions.create(model=NAME, prompt="id:", max_tokens=20, temperature=1,
                             extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})  # fmt: skip
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", r.choices[0].text)
    r = c.completions.create(
        model=NAME, prompt="x", max_tokens=30, temperature=0, n=2,
        extra_body={"structured_outputs": {"grammar": 'root ::= "f(" [0-9] ")"'}},
    )  # fmt: skip
    assert all(re.fullmatch(r"f\([0-9]\)", ch.text) for ch in r.choices)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=50, temperature=0,
                                  stream=True, extra_body={"guided_json": schema})  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
    assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
        ({"guided_json": {"type": "strng"}}, "guided_json", "strng"),
        ({"guided_choice": []}, "guided_choice", "non-empty strings"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema",
        ),
    ],
)
def test_bad_guides_are_400s_naming_the_field(url, extra, param, words):
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 5, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ok = httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT_S,
                    json={"model": NAME, "messages": MESSAGES, "max_tokens": 3})  # fmt: skip
    assert ok.status_code == 200
