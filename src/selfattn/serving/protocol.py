"""The OpenAI API's request bodies as pydantic models, checked strictly, and their conversion to
the engine's terms: prompt token ids (:func:`completion_prompt_ids`, :func:`chat_prompt_ids`),
the context check (:func:`max_tokens_within`) and :class:`~selfattn.serving.SamplingParams`
(:func:`sampling_params`).

Every model forbids unknown fields (a typo such as ``max_token`` is a 400, never silently
ignored) and is strict (``"n": "2"`` or ``"stream": 1`` are 400s, not coerced). Fields the API
defines that this server does not implement (``suffix``, ...) are accepted at their neutral
values only and refused otherwise, naming the field. Tool calling's fields (``tools``,
``tool_choice``, ``parallel_tool_calls``, assistant ``tool_calls`` and ``role: "tool"``
messages) are read by :mod:`selfattn.serving.tools`.

Sampling maps as vLLM's OpenAI server maps it: ``temperature`` (default 1), ``top_p``, ``n``,
``best_of`` (completions), ``seed``, ``stop``, ``presence_penalty`` / ``frequency_penalty``,
``logit_bias`` (token id strings -> [-100, 100]), ``logprobs``, ``echo`` (completions: the
prompt before the completion, with its logprobs when ``logprobs`` is set; ``max_tokens: 0``
then scores the prompt only); vLLM's extra fields (``extra_body`` in the ``openai`` client)
``top_k`` (0 or -1: off), ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos`` and ``prompt_logprobs``.

Structured output (one guide per request, :func:`request_guide`; two are a 400): OpenAI's
``response_format`` (``json_object``, or ``json_schema`` with its ``schema``), vLLM's
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark, or GBNF /
EBNF with ``::=`` rules) and vLLM's newer ``structured_outputs`` object (one of ``json``,
``regex``, ``choice``, ``grammar``, ``json_object``), on chat and completions alike.
:func:`compile_guide` compiles it when the request arrives, so a guide the grammar engine
refuses is a 400 naming its field.

Bounds on what one request may ask (each a 400 naming its field): at most :data:`MAX_STOP`
stop strings of :data:`MAX_STOP_CHARS` characters, :data:`MAX_LOGIT_BIAS` ``logit_bias``
entries, ``n`` / ``best_of`` within the engine's running set (:func:`check_samples`), a text
prompt of at most :data:`PROMPT_CHARS_PER_TOKEN` characters per token of the context (checked
before tokenising: :func:`text_within`); logprobs' bounds are SamplingParams'.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from selfattn._optional import require
from selfattn.serving.sampling import SamplingParams
from selfattn.serving.structured import Guide

pydantic = require("pydantic", extra="serve", purpose="the OpenAI server")
BaseModel, ConfigDict, Field = pydantic.BaseModel, pydantic.ConfigDict, pydantic.Field

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "EmbeddingRequest",
    "KVCompressionSpec",
    "RequestError",
    "ToolDefinition",
    "chat_prompt_ids",
    "check_samples",
    "compile_guide",
    "completion_prompt_ids",
    "max_tokens_within",
    "request_guide",
    "sampling_params",
    "text_within",
]

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
# Characters of one stop string: a stream holds back the longest one's length minus one, and
# every step matches each against the sample's tail.
MAX_STOP_CHARS = 256
# logit_bias entries per request: every step adds them to each of its samples' logits.
MAX_LOGIT_BIAS = 1024
# A text prompt's characters per token of the context at most: a prompt longer than
# max_model_len * PROMPT_CHARS_PER_TOKEN characters cannot fit (a token spells ~4 characters of
# English, a few more of code) and is refused before it is tokenised.
PROMPT_CHARS_PER_TOKEN = 32


class RequestError(ValueError):
    """A request the server refuses with a 4xx: ``status``, the OpenAI error ``type``, the
    offending ``param`` (a field name, or None) and a ``code``."""

    def __init__(self, message, *, status=400, type="invalid_request_error", param=None,
                 code=None):  # fmt: skip
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class KVCompressionSpec(BaseModel):
    """``kv_compression`` as an object: the policy, its ratio and budgets, decode-time eviction
    (``decode_budget``, ``decode_interval``); other keys are the policy's knobs (``window``,
    ``n_sink``, ...), checked by :func:`selfattn.cache.compress.compression`."""

    model_config = ConfigDict(extra="allow")
    policy: str | None = None
    ratio: float | None = None
    window: int | None = None
    budget: int | None = None
    decode_budget: int | None = None
    decode_interval: int | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the ``schema`` the output must validate against."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: one of its fields."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class _Sampled(_Strict):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # KV compression: "POLICY[:RATIO][,decode_budget=N]" or {"policy", "ratio", "window",
    # "budget", "decode_budget", "decode_interval", ...}
    kv_compression: str | KVCompressionSpec | None = None

    def refuse_unsupported(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs needs stream: false", param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options needs stream: true", param="stream_options")


class CompletionRequest(_Sampled):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise RequestError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n and self.stream:
            raise RequestError(
                f"best_of={self.best_of} with n={self.n} needs stream: false (the best samples "
                "are known only when all have finished)",
                param="best_of",
            )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallMessage(_Strict):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallMessage(_Strict):
    """A call in an assistant message sent back: ``{"id", "type": "function", "function"}``."""

    id: str
    type: Literal["function"]
    function: FunctionCallMessage


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call answered

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None  # a JSON schema (checked by selfattn.serving.tools)
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampled):
    """``POST /v1/chat/completions``: ``messages`` rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``: text or a list of texts."""

    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


_FIELD = re.compile(r"SamplingParams (\w+)")


def sampling_params(req: _Sampled, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The :class:`SamplingParams` of ``req``; a bad value is a :class:`RequestError` naming its
    field (SamplingParams' own checks: ranges, types)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if len(stop) > MAX_STOP:
        raise RequestError(f"stop holds {len(stop)} strings; at most {MAX_STOP}", param="stop")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise RequestError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} "
                           "each: shorten it", param="stop")  # fmt: skip
    echo = getattr(req, "echo", False)
    if max_tokens == 0 and not echo:
        raise RequestError(
            "max_tokens must be >= 1 (0 only with echo: true, which scores the prompt)",
            param="max_tokens",
        )
    prompt_logprobs = req.prompt_logprobs
    if echo and logprobs is not None:  # the echoed prompt's tokens carry logprobs too
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    bias = _token_biases(req.logit_bias)
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_k=None if req.top_k in (None, 0, -1) else req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=bias,
            best_of=getattr(req, "best_of", None),
            guide=(request_guide(req) or (None, None))[1],
            kv_compression=(
                req.kv_compression.model_dump(exclude_none=True)
                if isinstance(req.kv_compression, KVCompressionSpec)
                else req.kv_compression
            ),
        )
    except RequestError:
        raise
    except (TypeError, ValueError) as e:
        m = _FIELD.match(str(e))
        param = m and m[1]
        message = str(e).replace("SamplingParams ", "", 1)
        if param == "logprobs" and isinstance(req, ChatCompletionRequest):
            param, message = "top_logprobs", f"top_{message}"  # chat's name of the field
        raise RequestError(message, param=param) from None


def _token_biases(bias: dict[str, float] | None) -> dict[int, float]:
    """``logit_bias``'s token id strings -> ints (their biases are SamplingParams' to check)."""
    if bias is not None and len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}: "
                           "bias fewer tokens", param="logit_bias")  # fmt: skip
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(
                f"logit_bias keys must be token ids (decimal strings), got {key!r}",
                param="logit_bias",
            )
        out[int(key)] = value
    return out


def _guides(req: _Sampled) -> list[tuple[str, str, object]]:
    """Every guide ``req`` gives: ``(field, kind, value)``."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", None))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestError(
                "response_format json_schema needs json_schema.schema (the JSON schema)",
                param="response_format",
            )
        found.append(("response_format", "json_schema", rf.json_schema.schema_))
    for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        if getattr(req, field) is not None:
            found.append((field, kind, getattr(req, field)))
    so = req.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json_schema", so.json_), ("regex", so.regex),
                 ("choice", so.choice), ("grammar", so.grammar)) if v is not None]  # fmt: skip
        if so.json_object:
            given.append(("json_object", None))
        found += [("structured_outputs", kind, value) for kind, value in given]
    return found


def request_guide(req: _Sampled) -> tuple[str, Guide] | None:
    """The structured-output guide ``req`` asks for and the field that asked, or None; a
    :class:`RequestError` for two guides at once or a malformed one (an empty choice list)."""
    found = _guides(req)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"{f} ({k})" for f, k, _ in found)
        raise RequestError(f"give at most one structured-output guide; got {names}",
                           param=found[1][0])  # fmt: skip
    field, kind, value = found[0]
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    elif kind == "choice":
        value = tuple(value)
    try:
        return field, Guide(kind, value)
    except ValueError as e:
        raise RequestError(f"{field}: {e}", param=field) from None


def compile_guide(req: _Sampled, params: SamplingParams, grammars) -> None:
    """Compile ``params.guide`` with the engine's ``grammars`` now (cached for the engine), so
    that a guide the grammar engine refuses (an invalid regex or grammar, an unsupported schema)
    is a 400 naming its field; a blocking call (the server runs it on a worker thread)."""
    if params.guide is None:
        return
    field = (request_guide(req) or ("tool_choice",))[0]  # else the guide is tool_choice's
    try:
        grammars.compile(params.guide)
    except (ValueError, ImportError) as e:  # a GuideError, or the serve extra's llguidance absent
        raise RequestError(f"{field}: {e}", param=field) from None


# -- request -> engine ----------------------------------------------------------------------------


def completion_prompt_ids(prompt, tokenizer, max_model_len: int) -> list[list[int]]:
    """A completion's ``prompt`` (text, ids, or a list of either) -> token-id lists; a text
    longer than a context of ``max_model_len`` tokens could hold is refused untokenised (a
    blocking call on a long text: the server runs it on a worker thread)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise RequestError("the prompt is empty; give text or token ids", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise RequestError("the prompt is empty; give text or token ids", param="prompt")
            if tokenizer is None:
                raise RequestError(
                    "this model was served without a tokenizer (no tokenizer.json): send token "
                    "ids as the prompt",
                    param="prompt",
                )
            text_within(len(p), max_model_len, "prompt")
            p = tokenizer.encode(p)
        out.append(list(p))
    return out


def text_within(chars: int, max_model_len: int, param: str) -> None:
    """400 naming ``param`` when ``chars`` characters of text cannot fit a context of
    ``max_model_len`` tokens (more than :data:`PROMPT_CHARS_PER_TOKEN` per token)."""
    limit = max_model_len * PROMPT_CHARS_PER_TOKEN
    if chars > limit:
        raise RequestError(
            f"the {param} has {chars} characters, more than this model's context of "
            f"{max_model_len} tokens can hold (at most {limit} characters, "
            f"{PROMPT_CHARS_PER_TOKEN} per token); shorten it",
            param=param,
            code="context_length_exceeded",
        )


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer, max_model_len: int) -> list[int]:
    """A chat's ``messages`` rendered by the checkpoint's chat template, as token ids; messages
    longer than a context of ``max_model_len`` tokens could hold are refused unrendered (a
    blocking call on long messages: the server runs it on a worker thread)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise RequestError(
            "this model has no chat template (none in its tokenizer_config.json or "
            "chat_template.jinja); use /v1/completions with the prompt formatted yourself",
            param="messages",
        )
    text_within(sum(len(m.text()) for m in body.messages), max_model_len, "messages")
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    kw = {}
    if body.tools:  # the template's own ``tools`` variable, as transformers passes it
        kw["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             **kw)  # fmt: skip
    except Exception as e:  # the template's own raise_exception (an unsupported role, ...)
        raise RequestError(f"the chat template refused the messages: {e}",
                           param="messages") from None  # fmt: skip


def template_message(m: ChatMessage, i: int) -> dict:
    """Message ``i`` in the shape chat templates read (transformers' convention): a call's
    ``arguments`` as a dict where they are a JSON object (templates write ``arguments |
    tojson``), else the text as given; ``tool_call_id`` on a tool's answer."""
    d = {"role": m.role, "content": m.text()}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise RequestError(f"messages[{i}] has tool_calls but role {m.role!r}; only "
                               "assistant messages carry tool_calls", param="messages")  # fmt: skip
        d["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": json_object(c.function.arguments)}}
            for c in m.tool_calls
        ]  # fmt: skip
    if m.role == "tool":
        if m.tool_call_id is None:
            raise RequestError(f"messages[{i}] has role 'tool' but no tool_call_id; give the id "
                               "of the call it answers", param="messages")  # fmt: skip
        d["tool_call_id"] = m.tool_call_id
    elif m.tool_call_id is not None:
        raise RequestError(f"messages[{i}] has a tool_call_id but role {m.role!r}; only tool "
                           "messages answer a call", param="messages")  # fmt: skip
    return d


def json_object(text: str):
    """``text`` parsed where it is a JSON object, else ``text``."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def check_samples(params: SamplingParams, max_num_seqs: int) -> None:
    """400 naming ``n`` or ``best_of`` when a request draws more samples than the engine runs
    at once (each sample is a sequence of its own)."""
    if params.samples > max_num_seqs:
        name = "n" if params.best_of is None else "best_of"
        raise RequestError(
            f"{name}={params.samples} asks for more samples than this server runs at once "
            f"(max_num_seqs={max_num_seqs}); lower {name} or send several requests",
            param=name,
        )


def max_tokens_within(prompt_ids: list[int], max_tokens: int | None, limit: int) -> int:
    """The request's max_tokens after the checks against the context of ``limit`` tokens (None:
    the rest of the context)."""
    P = len(prompt_ids)
    if P == 0:
        raise RequestError("the prompt is empty; give at least one token", param="prompt")
    if P >= limit:
        raise RequestError(
            f"the prompt has {P} tokens but this model's context is {limit} tokens "
            "(prompt and completion together); shorten the prompt",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - P
    if max_tokens > limit - P:
        raise RequestError(
            f"max_tokens={max_tokens} with the prompt's {P} tokens exceeds this model's "
            f"context of {limit} tokens; at most {limit - P} new tokens fit",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
