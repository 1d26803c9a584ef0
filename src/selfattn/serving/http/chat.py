"""``POST /v1/chat/completions``: messages rendered by the checkpoint's chat template."""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
import time

from selfattn._optional import require
from selfattn.serving.http.common import news, respond, state, usage, usage_chunks
from selfattn.serving.protocol import (
    ChatCompletionRequest,
    chat_prompt_ids,
    compile_guide,
    max_tokens_within,
    sampling_params,
)

fastapi = require("fastapi", extra="serve", purpose="the OpenAI server")
concurrency = require("starlette.concurrency", extra="serve", purpose="the OpenAI server")

router = fastapi.APIRouter()


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: fastapi.Request):
    s = state(request)
    engine = s.engine_for(body)
    ids = chat_prompt_ids(body, engine.tokenizer)
    asked = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    max_tokens = max_tokens_within(ids, asked, engine.max_model_len)  # None: the context's rest
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs)
    await concurrency.run_in_threadpool(compile_guide, body, params, engine.grammars)
    sub = s.submit([ids], params, "chatcmpl")
    head = {"id": sub.base_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": s.model_name}  # fmt: skip
    seen: dict = {}

    def choice(c, lps, **content):
        lp = s.tokens.chat_logprobs(lps) if body.logprobs else None
        return {"index": c.index, **content, "logprobs": lp, "finish_reason": c.finish_reason}

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
        for c, lps in news(out):
            delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
            yield {**head, "choices": [choice(c, lps, delta=delta)]}

    def final(outs):
        o = outs[0]
        choices = [
            choice(c, c.logprobs, message={"role": "assistant", "content": c.text or ""})
            for c in o.outputs
        ]
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": usage([o])}  # fmt: skip

    return await respond(request, sub, body.stream, chunks, final)
