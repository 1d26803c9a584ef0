"""``POST /v1/completions``: text or token-id prompts (one or many), ``n`` samples each; ``echo``
puts each prompt (and its logprobs) before its completions, streamed first."""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
import time

from selfattn._optional import require
from selfattn.serving.http.common import (
    join_logprobs,
    news,
    respond,
    state,
    stop_reason,
    usage,
    usage_chunks,
)
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
    # off the event loop: a long text's tokenisation would hold up every other request
    prompts = await concurrency.run_in_threadpool(
        completion_prompt_ids, body.prompt, engine.tokenizer, engine.max_model_len
    )
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    for ids in prompts:
        max_tokens_within(ids, max_tokens, engine.max_model_len)
    params = sampling_params(body, max_tokens, body.logprobs)
    await concurrency.run_in_threadpool(compile_guide, body, params, engine.grammars)
    sub = s.submit(prompts, params, "cmpl")
    head = {"id": sub.base_id, "object": "text_completion", "created": int(time.time()),
            "model": s.model_name}  # fmt: skip
    want_lp = params.logprobs is not None
    prompt_parts: dict = {}  # prompt k -> its echo (text, logprobs) and its prompt_logprobs

    def prompt_part(k, out) -> tuple:
        if k not in prompt_parts:
            ids, lps = list(out.prompt_token_ids), out.prompt_logprobs
            text = "".join(s.tokens.pieces(ids)) if body.echo else ""
            echo_lp = None
            if body.echo and want_lp:
                echo_lp = s.tokens.completion_logprobs(ids, lps, 0, top=body.logprobs)
            scored = None
            if body.prompt_logprobs is not None:
                scored = s.tokens.prompt_logprobs(ids, lps, body.prompt_logprobs)
            prompt_parts[k] = (text, echo_lp, scored)
        return prompt_parts[k]

    def choice(k, out, c, text, lps, offset):
        """Sample ``c`` of prompt ``k``: ``text``, and the logprobs ``lps`` of its last tokens
        whose text starts ``offset`` characters into the completion."""
        echoed, _, scored = prompt_part(k, out)
        lp = None
        if want_lp:
            # the tokens before them, the prompt's included: the engine decodes in that context
            before = [*out.prompt_token_ids, *c.token_ids[: len(c.token_ids) - len(lps)]]
            ids = [x.token for x in lps]
            lp = s.tokens.completion_logprobs(ids, lps, len(echoed) + offset, before)
        d = {"index": k * params.n + c.index, "text": text, "logprobs": lp,
             "finish_reason": c.finish_reason, "stop_reason": stop_reason(c)}  # fmt: skip
        if scored is not None:
            d["prompt_logprobs"] = scored
        return d

    seen: dict = {}  # the last output of each prompt, for the closing usage
    ended: set = set()  # the samples whose finish_reason was sent (news)

    def chunks(k, out):
        if out is None:
            yield from usage_chunks(head, body, seen)
            return
        if body.echo and k not in seen:  # the prompt first, one chunk per sample
            text, lp, _ = prompt_part(k, out)
            for i in range(params.n):
                opening = {"index": k * params.n + i, "text": text, "logprobs": lp,
                           "finish_reason": None}  # fmt: skip
                yield {**head, "choices": [opening]}
        seen[k] = out
        for c, lps in news(out, ended):
            offset = len(c.text or "") - len(c.delta_text or "")
            yield {**head, "choices": [choice(k, out, c, c.delta_text or "", lps, offset)]}

    def final(outs):
        choices = []
        for k in sorted(outs):
            for c in outs[k].outputs:
                ch = choice(k, outs[k], c, c.text or "", c.logprobs, 0)
                text, lp, _ = prompt_part(k, outs[k])
                ch["text"] = text + ch["text"]
                ch["logprobs"] = join_logprobs(lp, ch["logprobs"])
                choices.append(ch)
        return {**head, "choices": choices, "usage": usage(outs.values())}

    return await respond(request, sub, body.stream, chunks, final)
