"""``POST /v1/completions``: text or token-id prompts (one or many), ``n`` samples each."""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
import time

from selfattn._optional import require
from selfattn.serving.http.common import news, respond, state, usage, usage_chunks
from selfattn.serving.protocol import (
    CompletionRequest,
    compile_guide,
    completion_prompt_ids,
    max_tokens_within,
    sampling_params,
)

fastapi = require("fastapi", extra="serve", purpose="the OpenAI server")
concurrency = require("starlette.concurrency", extra="serve", purpose="the OpenAI server")

DEFAULT_MAX_TOKENS = 16  # completions without max_tokens (OpenAI's default)

router = fastapi.APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: fastapi.Request):
    s = state(request)
    engine = s.engine_for(body)
    prompts = completion_prompt_ids(body.prompt, engine.tokenizer)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    for ids in prompts:
        max_tokens_within(ids, max_tokens, engine.max_model_len)
    params = sampling_params(body, max_tokens, body.logprobs)
    await concurrency.run_in_threadpool(compile_guide, body, params, engine.grammars)
    sub = s.submit(prompts, params, "cmpl")
    head = {"id": sub.base_id, "object": "text_completion", "created": int(time.time()),
            "model": s.model_name}  # fmt: skip
    want_lp = params.logprobs is not None

    def choice(k, c, text, lps, offset):
        return {
            "index": k * params.n + c.index,
            "text": text,
            "logprobs": s.tokens.completion_logprobs(lps, offset) if want_lp else None,
            "finish_reason": c.finish_reason,
        }

    seen: dict = {}  # the last output of each prompt, for the closing usage

    def chunks(k, out):
        if out is None:
            yield from usage_chunks(head, body, seen)
            return
        seen[k] = out
        for c, lps in news(out):
            offset = len(c.text or "") - len(c.delta_text or "")
            yield {**head, "choices": [choice(k, c, c.delta_text or "", lps, offset)]}

    def final(outs):
        choices = [
            choice(k, c, c.text or "", c.logprobs, 0) for k in sorted(outs) for c in outs[k].outputs
        ]
        return {**head, "choices": choices, "usage": usage(outs.values())}

    return await respond(request, sub, body.stream, chunks, final)
