"""Tool calling in the chat API: a request's ``tools`` / ``tool_choice`` checked and turned into
a :class:`ToolUse`, and the model's text turned back into OpenAI ``tool_calls``.

``tool_choice`` (default ``"auto"`` when ``tools`` are given):

- ``"auto"``: the model writes calls in its family's own format, which a parser reads back
  (:data:`PARSERS`): Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (several per message, text around them), Llama 3 JSON (``{"name": ..., "parameters": {...}}``
  as the whole message, ``;`` between several, with or without ``<|python_tag|>``) and Mistral
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. The parser is named by ``selfattn
  serve --tool-call-parser``, or chosen from the markers the chat template writes
  (:func:`parser_for`). Text that looks like a call but does not parse stays content.
- ``"required"``: the output is guided (:class:`~selfattn.serving.structured.Guide`) to a JSON
  array of ``{"name": <a tool's name>, "parameters": <its arguments>}`` (:func:`required_schema`)
  and read as such; ``parallel_tool_calls: false`` allows one item.
- a named function: the output is guided to that function's ``parameters`` schema and the whole
  text is its arguments.
- ``"none"``: no call is read (the tools still reach the chat template).

Calls come back as OpenAI's ``tool_calls`` (``id`` ``"call_"`` + random hex, or nine letters and
digits under the Mistral parser, whose templates demand that; ``function.arguments`` a JSON
string), ``content`` the text outside them (the whitespace around calls kept only between two
pieces of text; None when nothing is left), ``finish_reason`` ``"tool_calls"`` where ``auto``
or ``required`` made calls (a named function keeps ``"stop"``, as OpenAI answers a forced
call).

Streaming (:meth:`ToolUse.stream`): content streams as it comes, held back only while a call
marker may be opening; a call is sent when it closes, in two deltas (``index``, ``id``,
``type``, ``function.name`` with ``arguments: ""``, then the whole ``arguments``). A named
function's arguments stream token by token (the whole text is them); Llama 3 JSON and
``required`` outputs are read once the sample ends (a call there is the whole message).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from dataclasses import dataclass, field
from functools import lru_cache

from selfattn.serving.protocol import RequestError
from selfattn.serving.structured import Guide

__all__ = [
    "PARSERS",
    "PARSER_CHOICES",
    "CallStream",
    "ToolCall",
    "ToolUse",
    "check_parameters",
    "parse_calls",
    "parser_for",
    "required_schema",
    "tool_use",
]


# -- calls ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's ``name``, its ``arguments`` as JSON text, and
    the call's ``id``."""

    name: str
    arguments: str
    id: str

    def openai(self) -> dict:
        """The call as an entry of OpenAI's ``message.tool_calls``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def openai_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other tool call id."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def call_of(obj, make_id) -> ToolCall | None:
    """``{"name": str, "arguments" | "parameters": object or JSON text}`` as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # arguments already written as JSON text
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args, make_id())
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), make_id())


def partial_marker(text: str, start: int, marker: str) -> int:
    """How many characters at the end of ``text[start:]`` begin ``marker`` (held back: the
    next tokens may complete it)."""
    for m in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:m]):
            return m
    return 0


# -- parsers: a model family's text -> content and calls ------------------------------------------
#
# ``scan(text, start, final)`` reads ``text`` from ``start`` and returns ``(pieces, end)``: what
# is settled up to ``end``, in order, as ``("text", str)`` or ``("call", ToolCall)``. Text from
# ``end`` on may still become a call; ``final`` (the sample ended) settles everything.


def next_marker(pieces: list, text: str, i: int, marker: str, final: bool):
    """Scan ``text`` from ``i`` to the next ``marker``: the text before it appended to
    ``pieces`` as content; returns ``(the marker's index, None)``, or ``(None, where the scan
    ends)`` without one (short of a marker's possible start while more text may come)."""
    j = text.find(marker, i)
    if j < 0:
        end = len(text) - (0 if final else partial_marker(text, i, marker))
        pieces.append(("text", text[i:end]))
        return None, end
    pieces.append(("text", text[i:j]))
    return j, None


class TaggedParser:
    """Calls between an opening and a closing tag: Hermes / Qwen's ``<tool_call>...
    </tool_call>``, one JSON object each (an unclosed last call is read at the end)."""

    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    make_id = staticmethod(openai_id)

    def scan(self, text: str, start: int, final: bool):
        pieces, i = [], start
        while True:
            j, end = next_marker(pieces, text, i, self.open, final)
            if j is None:
                return pieces, end
            k = text.find(self.close, j)
            if k < 0 and not final:
                return pieces, j
            body_end, end = (len(text), len(text)) if k < 0 else (k, k + len(self.close))
            call = call_of(loads(text[j + len(self.open) : body_end]), self.make_id)
            pieces.append(("call", call) if call else ("text", text[j:end]))
            i = end


class MistralParser:
    """``[TOOL_CALLS]`` and a JSON array of calls (or one call); text before it is content."""

    name = "mistral"
    open = "[TOOL_CALLS]"
    make_id = staticmethod(mistral_id)

    def scan(self, text: str, start: int, final: bool):
        pieces, i = [], start
        while True:
            j, end = next_marker(pieces, text, i, self.open, final)
            if j is None:
                return pieces, end
            body = j + len(self.open)
            obj, end = raw_decode(text, body)
            objs = obj if isinstance(obj, list) else [obj]
            calls = [call_of(o, self.make_id) for o in objs] if end else []
            if calls and all(calls):
                pieces += [("call", c) for c in calls]
                i = end
            elif not final:  # the array may still be arriving
                return pieces, j
            else:
                pieces.append(("text", text[j:]))
                return pieces, len(text)


class Llama3JsonParser:
    """Llama 3's JSON calls: the whole message is ``{"name": ..., "parameters": {...}}``
    (``;`` between several), after an optional ``<|python_tag|>``; read once the sample ends."""

    name = "llama3_json"
    tag = "<|python_tag|>"
    make_id = staticmethod(openai_id)

    def scan(self, text: str, start: int, final: bool):
        if start > 0:  # the message did not open with a call: the rest is content
            return [("text", text[start:])], len(text)
        head = text.lstrip()
        could_be_call = head.startswith(("{", self.tag)) or self.tag.startswith(head)
        if not could_be_call:
            return [("text", text)], len(text)
        if not final:
            return [], 0
        calls = self.calls(head.removeprefix(self.tag))
        return ([("call", c) for c in calls] if calls else [("text", text)]), len(text)

    def calls(self, body: str) -> list[ToolCall]:
        calls, i = [], 0
        while True:
            obj, end = raw_decode(body, i)
            call = call_of(obj, self.make_id) if end else None
            if call is None:
                return []
            calls.append(call)
            i = skip(body, end, " \t\r\n;")
            if i == len(body):
                return calls


PARSERS = {p.name: p for p in (TaggedParser(), Llama3JsonParser(), MistralParser())}
PARSER_CHOICES = ("auto", *PARSERS, "none")  # selfattn serve --tool-call-parser


def loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def raw_decode(text: str, start: int):
    """``(value, end)`` of the JSON value starting at ``text[start:]`` (after whitespace), or
    ``(None, 0)`` where none does."""
    try:
        return json.JSONDecoder().raw_decode(text, skip(text, start, " \t\r\n"))
    except ValueError:
        return None, 0


@lru_cache(maxsize=16)
def parser_for(name: str, chat_template: str | None):
    """The parser ``name`` names (one of :data:`PARSER_CHOICES`; None for ``"none"``); for
    ``"auto"``, the one whose markers ``chat_template`` writes (None where it writes none)."""
    if name not in PARSER_CHOICES:
        raise ValueError(f"tool call parser must be one of {PARSER_CHOICES}, got {name!r}")
    if name != "auto":
        return PARSERS.get(name)
    t = chat_template or ""
    if TaggedParser.open in t:
        return PARSERS["hermes"]
    if MistralParser.open in t:
        return PARSERS["mistral"]
    if Llama3JsonParser.tag in t or ("<|start_header_id|>" in t and "tools" in t):
        return PARSERS["llama3_json"]
    return None


# -- one sample's text -> OpenAI deltas -----------------------------------------------------------


@dataclass
class CallStream:
    """One sample's text read as it arrives (:meth:`feed`) into content and calls, as OpenAI
    streams them: a list of ``delta`` dicts per feed. ``content`` and ``calls`` hold what was
    read so far; a whole text fed once with ``final=True`` is the non-streamed answer."""

    parser: object
    parallel: bool = True
    text: str = ""
    pos: int = 0  # text[:pos] is settled
    content: str = ""
    calls: list = field(default_factory=list)
    held: str = ""  # whitespace not yet sent: content only where more content follows
    after_call: bool = False

    def feed(self, delta: str, final: bool) -> list[dict]:
        self.text += delta
        pieces, self.pos = self.parser.scan(self.text, self.pos, final)
        out = []
        for kind, value in pieces:
            if kind == "call":
                self.after_call = True
                if self.parallel or not self.calls:
                    out += self.add(value)
                continue
            if self.after_call:  # one run of whitespace around calls separates content
                rest = value.lstrip()
                self.held = self.held or value[: len(value) - len(rest)]
                if not rest:
                    continue
                value, self.after_call = rest, False
                if not self.content:
                    self.held = ""
            s = self.held + value
            body = s.rstrip()
            self.held = s[len(body) :]
            if body:
                self.content += body
                out.append({"content": body})
        if final and self.held and not self.calls:
            self.content += self.held
            out.append({"content": self.held})
            self.held = ""
        return out

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` read so far (content None where calls were made and no text
        is left)."""
        return (self.content if self.content or not self.calls else None), self.calls

    def add(self, call: ToolCall) -> list[dict]:
        """The two deltas of a new call: its head, then its arguments."""
        i = len(self.calls)
        self.calls.append(call)
        head = {"index": i, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}  # fmt: skip
        args = {"index": i, "function": {"arguments": call.arguments}}
        return [{"tool_calls": [head]}, {"tool_calls": [args]}]


@dataclass
class NamedStream(CallStream):
    """A forced function (``name``): the whole text is its arguments, streamed as they come."""

    name: str = ""

    def feed(self, delta: str, final: bool) -> list[dict]:
        out = []
        if not self.calls:
            out += self.add(ToolCall(self.name, "", openai_id()))[:1]
        self.text += delta
        self.calls[0] = ToolCall(self.name, self.text, self.calls[0].id)
        if delta:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
        return out


class RequiredStream(CallStream):
    """``tool_choice: "required"``: a JSON array of ``{"name", "parameters"}`` read at the end
    (content where it does not parse: a sample cut by ``max_tokens``)."""

    def feed(self, delta: str, final: bool) -> list[dict]:
        self.text += delta
        if not final:
            return []
        items = loads(self.text)
        calls = [call_of(o, openai_id) for o in items] if isinstance(items, list) else []
        if calls and all(calls):
            return [d for c in calls for d in self.add(c)]
        self.content = self.text
        return [{"content": self.text}] if self.text else []


def parse_calls(text: str, parser) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a whole sample under ``parser`` (one of :data:`PARSERS`)."""
    s = CallStream(parser)
    s.feed(text, final=True)
    return s.result()


# -- a request's tools ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolUse:
    """How one chat request calls tools: ``mode`` ``"auto"`` (``parser``: how the model's
    format reads, None: nothing reads as a call), ``"required"`` or ``"named"`` (``name``),
    ``parallel`` (more than one call allowed) and ``guide`` (what the output must match)."""

    mode: str
    parser: object = None
    name: str | None = None
    parallel: bool = True
    guide: Guide | None = None

    def stream(self) -> CallStream:
        """A fresh reader of one sample's text."""
        if self.mode == "named":
            return NamedStream(None, name=self.name)
        if self.mode == "required":
            return RequiredStream(None)
        return CallStream(self.parser or PlainText(), parallel=self.parallel)

    def message(self, text: str) -> dict:
        """OpenAI's ``message`` of a whole sample."""
        s = self.stream()
        s.feed(text, final=True)
        content, calls = s.result()
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.openai() for c in calls]
        return msg

    def sampling(self, params):
        """``params`` (:class:`~selfattn.serving.SamplingParams`) with this use's guide."""
        if self.guide is None:
            return params
        if params.guide is not None:
            raise RequestError(
                f"tool_choice {self.name or self.mode!r} constrains the output to a tool call, "
                "and response_format constrains it too; drop one of them",
                param="tool_choice",
            )
        return dataclasses.replace(params, guide=self.guide)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """``"tool_calls"`` for a sample that stopped on calls (auto, required)."""
        return "tool_calls" if reason == "stop" and called and self.mode != "named" else reason


class PlainText:
    """No parser: every character is content."""

    def scan(self, text: str, start: int, final: bool):
        return [("text", text[start:])], len(text)


def required_schema(tools, parallel: bool = True) -> dict:
    """The JSON schema of ``tool_choice: "required"``'s output: an array of one or more
    ``{"name": <a tool's name>, "parameters": <that tool's schema>}`` (one at most unless
    ``parallel``). ``tools``: the request's function definitions (``name``, ``parameters``)."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f.name]},
                "parameters": f.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


SCHEMA_KEYS = {"properties": dict, "required": list, "items": (dict, bool), "enum": list}


def check_parameters(schema, where: str) -> None:
    """A function's ``parameters`` must be a JSON schema: jsonschema's metaschema check where
    jsonschema is installed, else the structure of its common keywords."""
    if not isinstance(schema, dict):
        raise RequestError(f"{where} must be a JSON schema object, got {schema!r}", param=where)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            path = "".join(f"[{p!r}]" for p in e.path)
            raise RequestError(f"{where}{path} is not a valid JSON schema: {e.message}",
                               param=where) from None  # fmt: skip
        return
    kind = schema.get("type")
    if kind is not None and not (
        isinstance(kind, str) or (isinstance(kind, list) and all(isinstance(k, str) for k in kind))
    ):
        raise RequestError(f"{where}['type'] must be a string or a list of strings, got {kind!r}",
                           param=where)  # fmt: skip
    for key, types in SCHEMA_KEYS.items():
        if key in schema and not isinstance(schema[key], types):
            raise RequestError(f"{where}[{key!r}] has the wrong type: {schema[key]!r}", param=where)
    for name, sub in schema.get("properties", {}).items():
        check_parameters(sub, f"{where}['properties'][{name!r}]")


def tool_use(body, parser_name: str, chat_template: str | None) -> ToolUse | None:
    """The :class:`ToolUse` of a chat request (None: no tool is called), its ``tools`` and
    ``tool_choice`` checked (400 naming the field). ``parser_name``: ``selfattn serve
    --tool-call-parser``."""
    tools = [t.function for t in body.tools or ()]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    named = None if isinstance(choice, str) else choice.function.name
    if not tools and choice not in ("none", "auto"):
        raise RequestError(f"tool_choice {named or choice!r} needs tools; give tools or drop "
                           "tool_choice", param="tool_choice")  # fmt: skip
    names = [f.name for f in tools]
    for i, f in enumerate(tools):
        if names.index(f.name) != i:
            raise RequestError(f"tools[{i}]: the function name {f.name!r} is given twice; "
                               "names must be unique", param="tools")  # fmt: skip
        if f.parameters is not None:
            check_parameters(f.parameters, f"tools[{i}].function.parameters")
    if choice == "none" or not tools:
        return None
    parallel = body.parallel_tool_calls is not False
    if named is not None:
        if named not in names:
            raise RequestError(f"tool_choice names the function {named!r}, which is not among "
                               f"the tools {names}", param="tool_choice")  # fmt: skip
        schema = tools[names.index(named)].parameters or {"type": "object"}
        return ToolUse("named", name=named, guide=Guide("json_schema", json.dumps(schema)))
    if choice == "required":
        schema = required_schema(tools, parallel)
        return ToolUse(
            "required", parallel=parallel, guide=Guide("json_schema", json.dumps(schema))
        )
    return ToolUse("auto", parser=parser_for(parser_name, chat_template), parallel=parallel)
