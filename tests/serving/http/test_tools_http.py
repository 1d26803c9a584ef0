"""Tool calling over HTTP with the official ``openai`` client: a tiny random Llama over a
byte-level tokenizer (tests._serving_helpers) and a Hermes-style chat template written here.

``auto`` mode runs on an engine whose samples follow a script (``ScriptedEngine``: each sample's
next token is its script's, whatever the weights), so the model "writes" calls: the client gets
parsed ``tool_calls``, streamed or not, one reading per choice, and the tool loop (a call, the
tool's result sent back with ``role: "tool"``, a final answer) runs end to end. ``required`` and
a named function run on the plain engine, where the guide alone makes the random model's output
a call: they run where the engine enforces ``SamplingParams.guide`` and are skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from selfattn.serving import Engine  # noqa: E402
from selfattn.serving.sampling import Choice  # noqa: E402
from selfattn.serving.server import build_app  # noqa: E402
from tests._serving_helpers import running_server, save_tiny_byte_llama  # noqa: E402

TIMEOUT_S = 30  # any one HTTP call
NAME = "tiny-tools"
MAX_GUIDED_TOKENS = 200  # room for a guided call: its JSON is short, whatever the weights

pytestmark = pytest.mark.usefixtures("single_thread")

# Qwen2.5's way, shortened: the tools in the system turn, calls in <tool_call> tags with the
# arguments as JSON, tool results in a user turn inside <tool_response>
TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}
{%- for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

UNIT = {"type": "string", "enum": ["c", "f"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Oslo", "Lima"]}, "unit": UNIT},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_byte_llama(tmp_path_factory.mktemp("tiny-byte-llama"), TEMPLATE)


class ScriptedEngine(Engine):
    """An engine whose sample ``i`` writes ``scripts[i]`` and then its end of turn, whatever
    the model's logits; ``prompts`` records each request's prompt ids, ``guides`` its guide."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.scripts: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self.guides: list = []

    def _append(self, seq, choice, now):
        n = len(seq.tokens) - seq.num_prompt
        if n == 0 and seq.index == 0:
            self.prompts.append(list(seq.tokens))
            self.guides.append(seq.params.guide)
        script = self.scripts[seq.index]
        tok = script[n] if n < len(script) else self.tokenizer.eos_token_id
        return super()._append(seq, Choice(tok), now)


@contextlib.contextmanager
def served(engine, **app_kw):
    with running_server(build_app(engine, model_name=NAME, **app_kw)) as url:
        yield openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
        )


def scripted(model, tokenizer, *texts) -> ScriptedEngine:
    engine = ScriptedEngine(model, tokenizer, kv_cache_bytes=1 << 21, page_size=8)
    engine.scripts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return engine


def hermes(name, args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def gathered(stream) -> dict:
    """Per choice index: the content, the calls (id, name, arguments) and the finish reason of
    a streamed chat, assembled as a client assembles OpenAI's deltas."""
    out = {}
    for chunk in stream:
        for ch in chunk.choices:
            o = out.setdefault(ch.index, {"content": "", "calls": {}, "finish": None})
            o["content"] += ch.delta.content or ""
            for tc in ch.delta.tool_calls or ():
                c = o["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id is not None:
                    assert c["id"] is None and tc.type == "function"
                    c["id"], c["name"] = tc.id, tc.function.name
                c["arguments"] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                assert o["finish"] is None
                o["finish"] = ch.finish_reason
    return out


# -- auto: the model's own format ----------------------------------------------------------------


def test_auto_reads_the_models_calls_streamed_or_not(model, tokenizer):
    a, b = {"city": "Oslo", "unit": "c"}, {}
    script = f"Let me check.\n{hermes('weather', a)}\n{hermes('clock', b)}"
    engine = scripted(model, tokenizer, script)
    with served(engine) as client:
        r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=200)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        assert calls(choice.message) == [("weather", a), ("clock", b)]
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
        assert all(c.type == "function" for c in choice.message.tool_calls)
        # the template saw the tools: they are in the prompt the engine got
        prompt = tokenizer.decode(engine.prompts[-1])
        assert all(json.dumps(t) in prompt for t in TOOLS)

        stream = client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, max_tokens=200, stream=True
        )
        (got,) = gathered(stream).values()
        assert got["content"] == "Let me check." and got["finish"] == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
            ("weather", a),
            ("clock", b),
        ]


def test_each_choice_reads_its_own_calls(model, tokenizer):
    texts = [hermes("clock", {}), "No call here.", 'x <tool_call>{"broken</tool_call>']
    engine = scripted(model, tokenizer, *texts)
    with served(engine) as client:
        r = client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, n=3, max_tokens=60
        )
        by_index = {c.index: c for c in r.choices}
        assert calls(by_index[0].message) == [("clock", {})]
        assert by_index[0].message.content is None and by_index[0].finish_reason == "tool_calls"
        for i in (1, 2):  # no call, and a malformed one: content as written, a plain stop
            assert by_index[i].message.tool_calls is None
            assert by_index[i].message.content == texts[i]
            assert by_index[i].finish_reason == "stop"
        got = gathered(
            client.chat.completions.create(
                model=NAME, messages=ASK, tools=TOOLS, n=3, max_tokens=60, stream=True
            )
        )
        assert [(c["name"], c["arguments"]) for c in got[0]["calls"].values()] == [("clock", "{}")]
        assert [got[i]["content"] for i in (1, 2)] == texts[1:]
        assert [got[i]["finish"] for i in range(3)] == ["tool_calls", "stop", "stop"]


def test_tool_choice_none_and_the_none_parser_read_no_calls(model, tokenizer):
    text = hermes("clock", {})
    with served(scripted(model, tokenizer, text), tool_call_parser="none") as client:
        r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=60)
        assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    with served(scripted(model, tokenizer, text)) as client:
        r = client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=60
        )
        assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None


def test_the_openai_tool_loop_runs_end_to_end(model, tokenizer):
    """A call, the tool's answer sent back with role "tool", then the final answer; the second
    prompt is the template's rendering of the whole exchange."""
    args = {"city": "Oslo", "unit": "c"}
    engine = scripted(model, tokenizer, hermes("weather", args))
    with served(engine) as client:
        first = client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, max_tokens=100
        )
        msg = first.choices[0].message
        (call,) = msg.tool_calls
        result = json.dumps({"celsius": -3})
        history = [
            *ASK,
            msg.model_dump(exclude_none=True),  # the assistant's calls, content null
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ]
        engine.scripts = [tokenizer.encode("It is -3 C in Oslo.", add_special_tokens=False)]
        final = client.chat.completions.create(
            model=NAME, messages=history, tools=TOOLS, max_tokens=100
        )
        assert final.choices[0].message.content == "It is -3 C in Oslo."
        assert final.choices[0].finish_reason == "stop"
    want = tokenizer.apply_chat_template(
        [
            *ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "weather", "arguments": args},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ],
        add_generation_prompt=True,
        tools=TOOLS,
    )
    assert engine.prompts[-1] == want
    rendered = tokenizer.decode(want)
    assert f'"arguments": {json.dumps(args)}' in rendered  # a dict to the template, not a string
    assert f"<tool_response>\n{result}\n</tool_response>" in rendered


def test_bad_tool_requests_are_400s_naming_the_field(model, tokenizer):
    def f(name, parameters=None):
        return {"type": "function", "function": {"name": name, "parameters": parameters or {}}}

    cases = {
        "duplicate names": ({"tools": [f("a"), f("a")]}, "tools"),
        "a bad schema": ({"tools": [f("a", {"type": "objekt"})]}, "tools[0].function.parameters"),
        "a bad name": ({"tools": [f("has space")]}, "tools"),
        "a named choice not among the tools": (
            {"tools": [f("a")], "tool_choice": {"type": "function", "function": {"name": "b"}}},
            "tool_choice",
        ),
        "required without tools": ({"tool_choice": "required"}, "tool_choice"),
        "a tool message without its call id": (
            {"tools": [f("a")], "messages": [*ASK, {"role": "tool", "content": "1"}]},
            "messages",
        ),
    }
    engine = scripted(model, tokenizer, "unused")
    with served(engine) as client:
        for what, (extra, param) in cases.items():
            body = {"model": NAME, "messages": ASK, **extra}
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(**body)
            assert e.value.body["param"].startswith(param), what
        assert engine.prompts == []  # none reached the engine


def test_required_and_named_send_their_guide_and_read_the_guided_text(model, tokenizer):
    """What the guide admits reads back as calls (the text is scripted here; the tests below
    let the guide write it)."""
    array = json.dumps(
        [
            {"name": "clock", "parameters": {}},
            {"name": "weather", "parameters": {"city": "Lima", "unit": "f"}},
        ]
    )
    engine = scripted(model, tokenizer, array)
    with served(engine) as client:
        for stream in (False, True):
            kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200)
            if stream:
                (got,) = gathered(client.chat.completions.create(**kw, stream=True)).values()
                made = [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()]
                finish = got["finish"]
            else:
                r = client.chat.completions.create(**kw).choices[0]
                made, finish = calls(r.message), r.finish_reason
            assert made == [("clock", {}), ("weather", {"city": "Lima", "unit": "f"})]
            assert finish == "tool_calls"
            schema = json.loads(engine.guides[-1].value)
            jsonschema.validate(json.loads(array), schema)
        args = json.dumps({"city": "Oslo", "unit": "c"})
        engine.scripts = [tokenizer.encode(args, add_special_tokens=False)]
        named = {"type": "function", "function": {"name": "weather"}}
        r = client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200
        )
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("weather", args)
        assert r.choices[0].finish_reason == "stop"
        assert json.loads(engine.guides[-1].value) == TOOLS[0]["function"]["parameters"]
        got = gathered(
            client.chat.completions.create(
                model=NAME,
                messages=ASK,
                tools=TOOLS,
                tool_choice=named,
                max_tokens=200,
                stream=True,
            )
        )
        assert [(c["name"], c["arguments"]) for c in got[0]["calls"].values()] == [
            ("weather", args)
        ]


# -- required and named: the guide makes any model's output a call --------------------------------


def guided_server(model, tokenizer):
    return served(Engine(model, tokenizer, kv_cache_bytes=1 << 21, page_size=8))


def parameters_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("stream", [False, True])
def test_required_always_answers_with_valid_calls(model, tokenizer, stream):
    with guided_server(model, tokenizer) as client:
        for seed, parallel in ((0, True), (1, False)):
            kw = dict(
                model=NAME,
                messages=ASK,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=parallel,
                max_tokens=MAX_GUIDED_TOKENS,
                seed=seed,
            )
            if stream:
                (got,) = gathered(client.chat.completions.create(**kw, stream=True)).values()
                made = [(c["name"], c["arguments"]) for c in got["calls"].values()]
                finish = got["finish"]
            else:
                choice = client.chat.completions.create(**kw).choices[0]
                made = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
                finish = choice.finish_reason
            assert finish == "tool_calls" and made and (parallel or len(made) == 1)
            for name, arguments in made:
                jsonschema.validate(json.loads(arguments), parameters_of(name))


def test_a_named_function_is_always_called_and_the_loop_completes(model, tokenizer):
    named = {"type": "function", "function": {"name": "weather"}}
    with guided_server(model, tokenizer) as client:
        r = client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=MAX_GUIDED_TOKENS
        )
        msg = r.choices[0].message
        (call,) = msg.tool_calls
        assert call.function.name == "weather" and msg.content is None
        jsonschema.validate(json.loads(call.function.arguments), parameters_of("weather"))
        history = [
            *ASK,
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "-3 C"},
        ]
        final = client.chat.completions.create(
            model=NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
        )
        assert final.choices[0].message.tool_calls is None
        assert final.choices[0].finish_reason in ("stop", "length")
