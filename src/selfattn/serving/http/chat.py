"""``POST /v1/chat/completions``: messages rendered by the checkpoint's chat template; tool
calls read back from the model's text (:mod:`selfattn.serving.tools`)."""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
import time

from selfattn._optional import require
from selfattn.serving.http.common import news, respond, state, stop_reason, usage, usage_chunks
from selfattn.serving.protocol import (
    ChatCompletionRequest,
    chat_prompt_ids,
    compile_guide,
    max_tokens_within,
    sampling_params,
)
from selfattn.serving.tools import tool_use

fastapi = require("fastapi", extra="serve", purpose="the OpenAI server")
concurrency = require("starlette.concurrency", extra="serve", purpose="the OpenAI server")

router = fastapi.APIRouter()


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: fastapi.Request):
    s = state(request)
    engine = s.engine_for(body)
    tools = tool_use(body, s.tool_call_parser, getattr(engine.tokenizer, "chat_template", None))
    # off the event loop: rendering and tokenising long messages would hold up other requests
    ids = await concurrency.run_in_threadpool(chat_prompt_ids, body, engine.tokenizer,
                                              engine.max_model_len)  # fmt: skip
    asked = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    max_tokens = max_tokens_within(ids, asked, engine.max_model_len)  # None: the context's rest
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs)
    if tools is not None:
        params = tools.sampling(params)
    await concurrency.run_in_threadpool(compile_guide, body, params, engine.grammars)
    sub = s.submit([ids], params, "chatcmpl")
    head = {"id": sub.base_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": s.model_name}  # fmt: skip
    seen: dict = {}
    ended: set = set()  # the samples whose finish_reason was sent (news)
    readers: dict = {}  # sample index -> (its tools.CallStream, logprobs not yet sent)

    def choice(c, lps, finish_reason, **content):
        lp = s.tokens.chat_logprobs(lps) if body.logprobs else None
        return {"index": c.index, **content, "logprobs": lp, "finish_reason": finish_reason,
                "stop_reason": stop_reason(c) if finish_reason else None}  # fmt: skip

    def tool_chunks(c, lps):
        """One sample's news read for calls: its deltas, then a closing chunk when it ends."""
        reader, held = readers.setdefault(c.index, (tools.stream(), []))
        held += lps or ()
        deltas = reader.feed(c.delta_text or "", c.finished)
        finish = tools.finish_reason(c.finish_reason, bool(reader.calls))
        if c.finished:
            deltas.append({})
        for i, delta in enumerate(deltas):
            last = c.finished and i == len(deltas) - 1
            yield {**head, "choices": [choice(c, list(held), finish if last else None,
                                              delta=delta)]}  # fmt: skip
            held.clear()

    def chunks(k, out):
        if out is None:
            yield from usage_chunks(head, body, seen)
            return
        if not seen:  # OpenAI opens each choice with the role
            for i in range(params.n):
                opening = {"index": i, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None}  # fmt: skip
                yield {**head, "choices": [opening]}
        seen[k] = out
        for c, lps in news(out, ended):
            if tools is not None:
                yield from tool_chunks(c, lps)
                continue
            delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
            yield {**head, "choices": [choice(c, lps, c.finish_reason, delta=delta)]}

    def message(c) -> tuple[dict, str | None]:
        if tools is None:
            return {"role": "assistant", "content": c.text or ""}, c.finish_reason
        msg = tools.message(c.text or "")
        return msg, tools.finish_reason(c.finish_reason, "tool_calls" in msg)

    def final(outs):
        o = outs[0]
        choices = []
        for c in o.outputs:
            msg, finish = message(c)
            choices.append(choice(c, c.logprobs, finish, message=msg))
        answer = {**head, "object": "chat.completion", "choices": choices, "usage": usage([o])}
        if body.prompt_logprobs is not None:  # vLLM's: beside the choices
            answer["prompt_logprobs"] = s.tokens.prompt_logprobs(
                o.prompt_token_ids, o.prompt_logprobs, body.prompt_logprobs
            )
        return answer

    return await respond(request, sub, body.stream, chunks, final)
