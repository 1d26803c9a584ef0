"""Tool calling's parts without a server (selfattn.serving.tools): each family's parser on texts
(several calls, text around them, malformed calls), streaming == one read for every way the
text can arrive, the guides of ``tool_choice`` "required" / named against jsonschema, the
request checks, the chat template's view of tools and tool messages, and the serve flag."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

from selfattn.serving.protocol import (  # noqa: E402
    ChatCompletionRequest,
    RequestError,
    chat_prompt_ids,
)
from selfattn.serving.sampling import SamplingParams  # noqa: E402
from selfattn.serving.structured import Guide  # noqa: E402
from selfattn.serving.tools import (  # noqa: E402
    PARSER_CHOICES,
    PARSERS,
    CallStream,
    parse_calls,
    parser_for,
    tool_use,
)

HERMES, LLAMA, MISTRAL = PARSERS["hermes"], PARSERS["llama3_json"], PARSERS["mistral"]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "time",
            "description": "now",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


def calls_of(text, parser):
    content, calls = parse_calls(text, parser)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def hermes(name, args, pad="\n"):
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': args})}{pad}</tool_call>"


# -- parsers ---------------------------------------------------------------------------------------


def test_hermes_reads_several_calls_and_the_text_around_them():
    a, b = {"city": "Paris", "unit": "c"}, {}
    text = f"Let me look.\n{hermes('weather', a)}\n{hermes('time', b, pad='')}\n"
    assert calls_of(text, HERMES) == ("Let me look.", [("weather", a), ("time", b)])
    # text on both sides of a call: one run of the whitespace around it separates them
    assert calls_of(f"before {hermes('time', b)} after", HERMES) == ("before after", [("time", b)])
    # only calls: no content
    assert calls_of(hermes("time", b), HERMES) == (None, [("time", b)])
    # an unclosed last call (the sample ended first) is read
    assert calls_of("<tool_call>" + json.dumps({"name": "t", "arguments": {"x": 1}}), HERMES) == (
        None,
        [("t", {"x": 1})],
    )


def test_arguments_written_as_json_text_are_kept_as_written():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
    (call,) = parse_calls(text, HERMES)[1]
    assert call.arguments == '{"x": 2}'


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>',
        "<tool_call>",
        "plain text with a </tool_call> stray",
    ],
)
def test_malformed_hermes_calls_stay_content(text):
    assert parse_calls(text, HERMES) == (text, [])


def test_a_malformed_call_beside_good_ones_is_content_and_the_good_ones_are_calls():
    bad = "<tool_call>{oops}</tool_call>"
    content, calls = calls_of(f"{hermes('a', {})}{bad}{hermes('b', {'y': 1})}", HERMES)
    assert content == bad and calls == [("a", {}), ("b", {"y": 1})]


def test_llama3_json_is_the_whole_message():
    a = {"name": "weather", "parameters": {"city": "Oslo"}}
    b = {"name": "time", "parameters": {}}
    want = [("weather", {"city": "Oslo"}), ("time", {})]
    assert calls_of(json.dumps(a), LLAMA) == (None, want[:1])
    assert calls_of(f"<|python_tag|>{json.dumps(a)}; {json.dumps(b)}", LLAMA) == (None, want)
    assert calls_of(f"  {json.dumps(a)};{json.dumps(b)}\n", LLAMA) == (None, want)
    for text in (
        f"Sure: {json.dumps(a)}",  # a call is the whole message
        f"{json.dumps(a)} and then text",
        '{"answer": 42}',  # JSON, but no call
        "{truncated",
        "<|python_tag|>",
        "",
    ):
        assert parse_calls(text, LLAMA) == (text, []), text


def test_mistral_reads_the_array_after_its_marker():
    a, b = {"name": "weather", "arguments": {"city": "Rome"}}, {"name": "time", "arguments": {}}
    content, calls = parse_calls(f"Checking. [TOOL_CALLS] {json.dumps([a, b])}", MISTRAL)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Rome"}),
        ("time", {}),
    ]
    # Mistral's templates accept nine letters and digits as a call id, nothing else
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert calls_of(f"[TOOL_CALLS]{json.dumps(a)}", MISTRAL) == (
        None,
        [("weather", a["arguments"])],
    )
    for text in ("[TOOL_CALLS] [{broken", "[TOOL_CALLS] []", 'x [TOOL_CALLS] [{"name": 1}]'):
        assert parse_calls(text, MISTRAL) == (text, []), text


def test_call_ids_are_openai_shaped_and_unique():
    _, calls = parse_calls(hermes("a", {}) * 3, HERMES)
    ids = [c.id for c in calls]
    assert len(set(ids)) == 3 and all(i.startswith("call_") and len(i) > 10 for i in ids)


# -- streaming == one read -------------------------------------------------------------------------


def streamed(text: str, parser, cuts: list[int]):
    """Content, calls and deltas of ``text`` fed in pieces cut at ``cuts``."""
    s, deltas, at = CallStream(parser), [], 0
    for cut in [*cuts, len(text)]:
        deltas += s.feed(text[at:cut], final=cut == len(text))
        at = cut
    content = "".join(d.get("content", "") for d in deltas)
    calls = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            c = calls.setdefault(tc["index"], {"name": None, "arguments": "", "id": None})
            if "id" in tc:
                assert c["id"] is None and tc["type"] == "function"  # the head comes once, first
                c["id"], c["name"] = tc["id"], tc["function"]["name"]
                assert tc["function"]["arguments"] == ""
            else:
                c["arguments"] += tc["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for c in calls.values()], deltas


CASES = [
    (HERMES, f"Let me see. {hermes('weather', {'city': 'Lima'})}\n{hermes('time', {})} done"),
    (HERMES, f"{hermes('time', {})}<tool_call>{{bad}}</tool_call> tail <tool_ca"),
    (HERMES, "  no calls at all, spaces kept  "),
    (
        LLAMA,
        '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}; {"name": "g", "parameters": {}}',
    ),
    (LLAMA, "plain {answer}"),
    (MISTRAL, 'Hm. [TOOL_CALLS][{"name": "f", "arguments": {"s": "x]y"}}] and [TOOL_CALLS] [{"x'),
]


@pytest.mark.parametrize("parser, text", CASES)
def test_streaming_in_any_pieces_equals_one_read(parser, text):
    content, calls = parse_calls(text, parser)
    whole = (content or "", [(c.name, c.arguments) for c in calls])
    rng = random.Random(len(text))
    for trial in range(40):
        k = rng.randrange(0, min(len(text), 12)) if trial else len(text) - 1
        cuts = sorted(rng.sample(range(1, len(text)), k)) if trial else list(range(1, len(text)))
        got_content, got_calls, _ = streamed(text, parser, cuts)
        assert (got_content, got_calls) == whole, cuts


def test_content_streams_before_the_sample_ends():
    s = CallStream(HERMES)
    assert s.feed("Hello there", final=False) == [{"content": "Hello there"}]
    assert s.feed(" <tool_", final=False) == []  # maybe a marker: held
    assert s.feed("call>", final=False) == []  # a call opened: held until it closes
    out = s.feed('{"name": "f", "arguments": {}}</tool_call>', final=False)
    assert [list(d["tool_calls"][0]) for d in out] == [
        ["index", "id", "type", "function"],
        ["index", "function"],
    ]


def test_parallel_tool_calls_false_keeps_the_first_call():
    s = CallStream(HERMES, parallel=False)
    s.feed(hermes("a", {}) + hermes("b", {}), final=True)
    assert [c.name for c in s.calls] == ["a"]


# -- tool_choice -> guide --------------------------------------------------------------------------


def request(**kw) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw}
    return ChatCompletionRequest.model_validate(body)


def schema_of(use) -> dict:
    assert isinstance(use.guide, Guide) and use.guide.kind == "json_schema"
    return json.loads(use.guide.value)


def test_required_guides_to_an_array_of_the_tools_calls():
    use = tool_use(request(tool_choice="required"), "auto", None)
    schema = schema_of(use)
    jsonschema.validators.validator_for(schema).check_schema(schema)
    good = [
        [{"name": "weather", "parameters": {"city": "Oslo"}}],
        [
            {"name": "time", "parameters": {}},
            {"name": "weather", "parameters": {"city": "x", "unit": "f"}},
        ],
    ]
    bad = [
        [],  # at least one call
        {"name": "time", "parameters": {}},  # an array, not one object
        [{"name": "nope", "parameters": {}}],  # a name not among the tools
        [{"name": "weather", "parameters": {}}],  # weather's schema wants a city
        [{"name": "weather", "parameters": {"city": "x", "unit": "k"}}],
        [{"name": "time"}],
        [{"name": "time", "parameters": {}, "extra": 1}],
    ]
    for items in good:
        jsonschema.validate(items, schema)
    for items in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(items, schema)
    # and what the schema admits reads back as the calls
    msg = use.message(json.dumps(good[1]))
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
    ] == [(o["name"], o["parameters"]) for o in good[1]]
    assert msg["content"] is None and use.finish_reason("stop", True) == "tool_calls"


def test_required_without_parallel_calls_allows_one_item():
    schema = schema_of(
        tool_use(request(tool_choice="required", parallel_tool_calls=False), "auto", None)
    )
    one = [{"name": "time", "parameters": {}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)


def test_a_named_function_guides_to_its_parameters_and_the_text_is_its_arguments():
    use = tool_use(
        request(tool_choice={"type": "function", "function": {"name": "weather"}}), "auto", None
    )
    assert schema_of(use) == WEATHER
    text = json.dumps({"city": "Quito"})
    msg = use.message(text)
    assert msg["content"] is None
    ((call),) = msg["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": text}
    assert use.finish_reason("stop", True) == "stop"  # as OpenAI answers a forced call
    s, pieces = use.stream(), ['{"ci', 'ty": "Qu', 'ito"}']
    deltas = [d for p in pieces for d in s.feed(p, final=p is pieces[-1])]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]) == text


def test_the_guide_rides_on_the_sampling_params_and_never_overrides_another():
    use = tool_use(request(tool_choice="required"), "auto", None)
    assert use.sampling(SamplingParams()).guide == use.guide
    with pytest.raises(RequestError, match="response_format") as e:
        use.sampling(SamplingParams(guide=Guide("json_object")))
    assert e.value.param == "tool_choice"


def test_auto_and_none():
    assert tool_use(request(tool_choice="none"), "auto", "<tool_call>") is None
    assert (
        tool_use(
            ChatCompletionRequest.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            ),
            "auto",
            None,
        )
        is None
    )
    use = tool_use(request(), "auto", "... <tool_call> ...")
    assert use.mode == "auto" and use.parser is HERMES and use.guide is None
    assert tool_use(request(), "none", "<tool_call>").parser is None
    # no parser: the text is content, whatever it holds
    assert tool_use(request(), "none", None).message(hermes("a", {})) == {
        "role": "assistant",
        "content": hermes("a", {}),
    }


@pytest.mark.parametrize(
    "template, want",
    [
        ("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>", "hermes"),
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|><|python_tag|>", "llama3_json"),
        ("{% if tools %}<|start_header_id|>user<|end_header_id|>{% endif %}", "llama3_json"),
        ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", None),
        (None, None),
    ],
)
def test_auto_picks_the_parser_by_the_templates_markers(template, want):
    got = parser_for("auto", template)
    assert (got and got.name) == want
    assert parser_for("mistral", template) is MISTRAL
    with pytest.raises(ValueError, match="'qwen'"):
        parser_for("qwen", template)


# -- request checks --------------------------------------------------------------------------------


def bad_request(**kw):
    with pytest.raises(RequestError) as e:
        tool_use(request(**kw), "auto", None)
    return e.value


def test_bad_tools_and_tool_choice_are_400s_naming_the_field():
    twice = bad_request(tools=[TOOLS[0], TOOLS[0]])
    assert twice.param == "tools" and "'weather'" in str(twice)
    schema = {"type": "object", "properties": {"x": {"type": 5}}}
    bad = bad_request(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert bad.param == "tools[0].function.parameters" and "not a valid JSON schema" in str(bad)
    missing = bad_request(tool_choice={"type": "function", "function": {"name": "nope"}})
    assert missing.param == "tool_choice" and "'nope'" in str(missing)
    for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
        e = bad_request(tools=None, tool_choice=choice)
        assert e.param == "tool_choice" and "needs tools" in str(e)


def test_the_structural_schema_check_without_jsonschema(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import fails
    for schema, where in [
        ({"type": 5}, "['type']"),
        ({"properties": []}, "['properties']"),
        ({"properties": {"x": {"required": "x"}}}, "['properties']['x']['required']"),
    ]:
        e = bad_request(
            tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}]
        )
        assert where in str(e), str(e)
    tool_use(request(), "auto", None)  # good schemas pass


# -- messages through the chat template ------------------------------------------------------------

TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | tojson }}|{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}"
)


class TextTokenizer:
    """What chat_prompt_ids reads of a tokenizer; the rendered text comes back as one "id"."""

    chat_template = TEMPLATE

    def apply_chat_template(self, messages, **kw):
        from selfattn.models.tokenizer import Tokenizer

        return [
            Tokenizer(None, chat_template=TEMPLATE).apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                **{k: v for k, v in kw.items() if k == "tools"},
            )
        ]


def test_tools_and_tool_messages_reach_the_template_in_transformers_shape():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "time", "arguments": "?"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    (text,) = chat_prompt_ids(request(messages=messages), TextTokenizer(), 4096)
    tools_line, *rest = text.split("|")
    assert json.loads(tools_line.removeprefix("TOOLS=")) == TOOLS  # the tools as given
    # arguments that are a JSON object reach the template as a dict, others as the text
    assert rest[1] == 'assistant:[call_1 weather {"city": "Oslo"}][call_2 time "?"]'
    assert rest[2] == "tool:sunny(call_1)"


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "tool", "content": "x"}, "no tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "only tool messages"),
        ({"role": "user", "content": "x", "tool_calls": []}, "only assistant"),
    ],
)
def test_misplaced_tool_fields_in_messages_are_400s(message, words):
    with pytest.raises(RequestError, match=words) as e:
        chat_prompt_ids(request(messages=[message]), TextTokenizer(), 4096)
    assert e.value.param == "messages" and "messages[0]" in str(e.value)


def test_serve_offers_every_parser_and_hands_the_choice_to_the_app(tmp_path, monkeypatch):
    from selfattn.cli import main
    from selfattn.cli.main import build_parser
    from selfattn.cli.serve import TOOL_CALL_PARSERS

    assert TOOL_CALL_PARSERS == PARSER_CHOICES
    assert build_parser().parse_args(["serve", "m"]).tool_call_parser == "auto"
    pytest.importorskip("fastapi")
    pytest.importorskip("transformers")
    import selfattn.serving.server as server

    with pytest.raises(ValueError, match="'qwen'"):
        server.build_app(encoder=object(), tool_call_parser="qwen")
    from tests._serving_helpers import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny")
    served = []
    monkeypatch.setattr(server, "serve", lambda engine, **kw: served.append(kw))
    argv = ["serve", str(folder), "--kv-cache-bytes", str(1 << 20), "--threads", "1"]
    assert main([*argv, "--tool-call-parser", "mistral"]) == 0
    assert [kw["tool_call_parser"] for kw in served] == ["mistral"]
