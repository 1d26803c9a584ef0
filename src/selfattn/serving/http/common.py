"""What the endpoint modules share: the server's state, OpenAI errors, one HTTP request's engine
requests (:class:`Submission`), the answer as JSON or server-sent events (:func:`respond`),
``usage`` and logprobs bodies."""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
import asyncio
import json
import logging
import time
import uuid

from selfattn._optional import require
from selfattn.serving.config import ServerLimits
from selfattn.serving.engine import Engine, QueueFull
from selfattn.serving.loop import EngineLoop, ShuttingDown
from selfattn.serving.protocol import RequestError, check_samples

responses = require("fastapi.responses", extra="serve", purpose="the OpenAI server")

log = logging.getLogger("selfattn")

RETRY_AFTER_S = 1  # Retry-After of a 429: a step or a few free room in the waiting queue


# -- errors ---------------------------------------------------------------------------------------


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None,
                   code=None, headers=None):  # fmt: skip
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return responses.JSONResponse(body, status_code=status, headers=headers)


def validation_message(errors) -> tuple[str, str | None]:
    """pydantic's errors -> one message naming each offending field, and the first field."""
    parts, first = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        field = ".".join(loc) or None
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx", {}).get("error", "")
            parts.append(f"the body is not valid JSON ({ctx})")
            continue
        first = first or (loc[0] if loc else None)
        if e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {field!r}")
        elif field:
            parts.append(f"{field}: {e.get('msg')}")
        else:
            parts.append(str(e.get("msg")))
    return "; ".join(parts), first


def model_not_found(message: str) -> RequestError:
    """The 404 of a request naming a model this server does not serve on its route."""
    return RequestError(message, status=404, param="model", code="model_not_found")


class ModelFailure(RuntimeError):
    """The engine ended a request with an error (the model raised on its batch)."""


def failure_message(e: ModelFailure, request_id: str) -> str:
    """What a client is told of an internal failure: its kind and where the server's log has
    the rest (never the message or the trace, which may name the server's files)."""
    return (
        f"the model failed on this request ({type(e.args[0]).__name__}); the server's log has "
        f"the details under request {request_id}"
    )


# -- the server's state ---------------------------------------------------------------------------


class ServerState:
    """What the routes read (``app.state.selfattn``): the engine and its loop, the encoder (or a
    ``Future`` of it, replaced once loaded), the served names, the waiting limit, the pool that
    embeds, the tool call parser's name (:data:`selfattn.serving.tools.PARSER_CHOICES`), the
    server's :class:`~selfattn.serving.config.ServerLimits` and the streams dropped for falling
    behind them."""

    def __init__(self, engine: Engine | None, encoder, *, model_name: str,
                 embedding_model_name: str, max_waiting: int | None, embed_pool,
                 tool_call_parser: str = "auto", limits: ServerLimits | None = None):  # fmt: skip
        self.engine, self.encoder = engine, encoder
        self.limits = ServerLimits() if limits is None else limits
        self.streams_dropped = 0
        self.draining = False  # a SIGTERM arrived: new requests get 503 (serve)
        self.tool_call_parser = tool_call_parser
        self.loop: EngineLoop | None = None if engine is None else engine.loop
        self.model_name, self.embedding_model_name = model_name, embedding_model_name
        self.max_waiting, self.embed_pool = max_waiting, embed_pool
        self.created = int(time.time())
        self.tokens = TokenText(None if engine is None else engine.tokenizer)

    def count_dropped(self) -> None:
        self.streams_dropped += 1

    def engine_for(self, body) -> Engine:
        """The engine generating for ``body`` (a completion or chat request): 404 unless it
        names the served model, 400 for a field this server does not implement."""
        if self.engine is None or body.model != self.model_name:
            served = [self.model_name] if self.engine is not None else []
            raise model_not_found(
                f"the model {body.model!r} does not exist here; this server generates with "
                f"{served or 'no model (it serves embeddings only)'} (GET /v1/models)"
            )
        body.refuse_unsupported()
        return self.engine

    def draining_error(self) -> RequestError:
        return RequestError("the server is shutting down; send the request to another replica "
                            "or retry when it is back", status=503, type="server_error",
                            code="shutting_down")  # fmt: skip

    def submit(self, prompts: list[list[int]], params, prefix: str) -> "Submission":
        """One engine request per prompt; 429 when the waiting queue has no room for them, 503
        once the server drains (``draining``: a SIGTERM arrived)."""
        if self.draining:
            raise self.draining_error()
        engine = self.engine
        check_samples(params, engine.scheduler.max_num_seqs)
        waiting = engine.num_waiting()
        limit = engine.max_waiting if self.max_waiting is None else min(
            self.max_waiting, engine.max_waiting)  # fmt: skip
        if waiting + len(prompts) > limit:
            raise RequestError(
                f"{waiting} requests are waiting (at most {limit}); retry after {RETRY_AFTER_S} s",
                status=429,
                type="rate_limit_exceeded",
                code="queue_full",
            )
        try:
            params.check_vocab(engine.model.config.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), param="logit_bias") from None
        sub = Submission(self.loop, f"{prefix}-{uuid.uuid4().hex}")
        try:
            for ids in prompts:
                sub.add(ids, params)
        except QueueFull as e:
            sub.close()
            raise RequestError(str(e), status=429, type="rate_limit_exceeded",
                               code="queue_full") from None  # fmt: skip
        except ShuttingDown:
            sub.close()
            raise self.draining_error() from None
        except (ValueError, TypeError) as e:
            sub.close()
            if isinstance(e, RequestError):
                raise
            raise RequestError(str(e), param="prompt") from None
        return sub


# -- one HTTP request's engine requests -----------------------------------------------------------


class Submission:
    """The engine requests of one HTTP request (one per prompt), their outputs arriving in one
    queue as ``(prompt index, RequestOutput)``; :meth:`close` aborts whatever is unfinished.

    A stream's writer may wait on a client that does not read (the socket's buffers full); the
    outputs it has not written wait in the queue, each holding its sample's tokens and text so
    far. :meth:`bound` caps them: past ``max_backlog`` per engine request, while the writer
    waits to send (not merely for its turn on a busy event loop), the submission is dropped
    (:meth:`drop`: its requests aborted, its writer cancelled)."""

    def __init__(self, loop: EngineLoop, base_id: str):
        self.loop, self.base_id = loop, base_id
        self.ids: list[str] = []
        self.open: set[str] = set()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.event_loop = asyncio.get_running_loop()
        self.max_backlog: int | None = None
        self.on_drop = None
        self.dropped = False
        self.writer: asyncio.Task | None = None  # the task writing its stream
        self.sending = False  # whether the writer waits in the server's send

    def add(self, prompt_ids: list[int], params) -> None:
        k = len(self.ids)
        rid = self.loop.submit(prompt_ids, params, f"{self.base_id}-{k}", self.event_loop,
                               self, k)  # fmt: skip
        self.ids.append(rid)
        self.open.add(rid)

    def bound(self, max_backlog: int, on_drop) -> None:
        """Drop the submission once more than ``max_backlog`` outputs per request wait to be
        written; ``on_drop()`` is told."""
        self.max_backlog, self.on_drop = max_backlog, on_drop

    def put_nowait(self, item) -> None:
        """An output from the engine loop (on the event loop's thread)."""
        if self.dropped:
            return
        bound = None if self.max_backlog is None else self.max_backlog * len(self.ids)
        if self.sending and bound is not None and self.queue.qsize() >= bound:
            self.drop()
            return
        self.queue.put_nowait(item)

    def drop(self) -> None:
        """Abort the requests and end the stream's writer: its client fell too far behind."""
        log.warning("selfattn.serving: dropped the stream of %s: its client has not read the "
                    "last %d outputs", self.base_id, self.queue.qsize())  # fmt: skip
        self.dropped = True
        self.close()
        if self.on_drop is not None:
            self.on_drop()
        if self.writer is not None:
            self.writer.cancel()

    async def outputs(self):
        """``(k, output)`` as they come, until every request finished; a failed one raises."""
        while self.open:
            k, out = await self.queue.get()
            if out.finished:
                self.open.discard(out.request_id)
            if out.error is not None:
                raise ModelFailure(out.error)
            yield k, out

    async def collect(self) -> dict:
        """Every prompt's last output, ``{k: output}``; aborts the rest if interrupted."""
        last = {}
        try:
            async for k, out in self.outputs():
                last[k] = out
        finally:
            self.close()
        return last

    def close(self) -> None:
        for rid in list(self.open):
            self.loop.abort(rid)
        self.open.clear()


async def until_disconnect(request) -> None:
    """Returns when the client hangs up (uvicorn's receive gives ``http.disconnect`` once the
    body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- answers --------------------------------------------------------------------------------------


def sse(obj) -> str:
    """One server-sent event of ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStream(responses.StreamingResponse):
    """Server-sent events of one submission: ``chunks(k, out)`` per output, ``chunks(None,
    None)`` at the end (usage), then ``[DONE]``. Whatever ends the response (the last event, or
    starlette cancelling it when the client disconnects) aborts what is left."""

    def __init__(self, sub: Submission, chunks):
        super().__init__(_events(sub, chunks), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self.sub = sub

    async def __call__(self, scope, receive, send):
        self.sub.writer = asyncio.current_task()

        async def sending(message):  # a client that does not read holds the writer here
            self.sub.sending = True
            try:
                await send(message)
            finally:
                self.sub.sending = False

        try:
            await super().__call__(scope, receive, sending)
        except asyncio.CancelledError:
            if not self.sub.dropped:
                raise
            # dropped (Submission.drop): the response ends unfinished and uvicorn closes the
            # connection; from Python 3.11 the task counts cancellations, this one is handled
            if hasattr(self.sub.writer, "uncancel"):
                self.sub.writer.uncancel()
        finally:
            self.sub.writer = None
            self.sub.close()


async def _events(sub: Submission, chunks):
    try:
        async for k, out in sub.outputs():
            for chunk in chunks(k, out):
                yield sse(chunk)
        if sub.dropped:  # its writer is being cancelled: no closing events
            return
        for chunk in chunks(None, None):  # the closing events (usage)
            yield sse(chunk)
    except ModelFailure as e:
        log.error("selfattn.serving: request %s failed: %r", sub.base_id, e.args[0])
        yield sse({"error": {"message": failure_message(e, sub.base_id), "type": "server_error",
                             "param": None, "code": None}})  # fmt: skip
    yield "data: [DONE]\n\n"


async def respond(request, sub: Submission, stream: bool, chunks, final):
    """Stream ``chunks(k, out)`` events, or await every output and answer ``final(outs)``
    (``outs[k]``: prompt k's last output); either way a client gone aborts the rest."""
    if stream:
        s = state(request)
        sub.bound(s.limits.max_stream_backlog, s.count_dropped)
        return EventStream(sub, chunks)
    done = asyncio.ensure_future(sub.collect())
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():  # the client left (or this handler was cancelled)
            done.cancel()
            sub.close()
    if not done.done() or done.cancelled():
        return responses.Response(status_code=499)
    try:
        outs = done.result()
    except ModelFailure as e:
        log.error("selfattn.serving: request %s failed: %r", sub.base_id, e.args[0])
        return error_response(500, failure_message(e, sub.base_id), "server_error")
    return responses.JSONResponse(final(outs))


def usage(outs) -> dict:
    """OpenAI's ``usage`` of engine outputs (every sample's tokens; cached prompt tokens)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)},
    }


def usage_chunks(head: dict, body, seen: dict):
    """The closing usage chunk of a stream, when ``stream_options.include_usage`` asks for it."""
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": usage(seen.values())}


def join_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Completions ``logprobs`` of ``a``'s tokens followed by ``b``'s (either may be None)."""
    if a is None or b is None:
        return b if a is None else a
    return {key: a[key] + b[key] for key in a}


def news(out, ended: set):
    """The samples of ``out`` with something to report, and the logprobs new in each. A
    finished sample is in every later output of its request: it is reported once, the
    ``(request id, index)`` of those reported finished kept in ``ended``."""
    for c in out.outputs:
        key = (out.request_id, c.index)
        if key in ended:
            continue
        if c.finished:
            ended.add(key)
        if c.delta_token_ids or c.delta_text or c.finished:
            new_lps = None
            if c.logprobs is not None:
                new_lps = c.logprobs[len(c.token_ids) - len(c.delta_token_ids) :]
            yield c, new_lps


CONTEXT_TOKENS = 6  # tokens a token's text is decoded after (spaces and merges depend on them)


def stop_reason(c) -> int | str | None:
    """vLLM's ``stop_reason`` of a finished sample ``c`` (a CompletionOutput): the stop token's
    id or the stop string that ended it, why a guide ended it (structured output), else None."""
    return c.stop_reason if c.finished else None


class TokenText:
    """Token text for logprobs (None without a tokenizer: the id as text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, t: int) -> str:
        return str(t) if self.tokenizer is None else self.tokenizer.decode([t])

    def after(self, context: list[int], tokens) -> list[str]:
        """The text each of ``tokens`` adds after ``context`` (the tokens before it): the
        decoded ``context + [t]`` past the decoded ``context`` (its last ``CONTEXT_TOKENS``),
        so a word's leading space belongs to its token and consecutive pieces add up to the
        decoded text."""
        ctx = context[-CONTEXT_TOKENS:]
        if self.tokenizer is None or not ctx:
            return [self.text(t) for t in tokens]
        head = self.tokenizer.decode(ctx)
        out = []
        for t in tokens:
            full = self.tokenizer.decode([*ctx, t])
            out.append(full[len(head) :] if full.startswith(head) else self.text(t))
        return out

    def pieces(self, ids: list[int], context: list[int] = ()) -> list[str]:
        """The text of each of ``ids`` after ``context`` and the ids before it."""
        seen = list(context)
        out = []
        for t in ids:
            out += self.after(seen, [t])
            seen.append(t)
        return out

    def completion_logprobs(self, ids, lps, offset: int, context=(), top=None) -> dict:
        """OpenAI's completions ``logprobs`` of the tokens ``ids`` after ``context`` (their
        :class:`TokenLogprob` s ``lps``, None where a token has none: a prompt's first), at
        most ``top`` alternatives each; ``text_offset``: where each token's text starts in a
        text whose ``ids`` start at ``offset``."""
        seen, tokens, offsets, tops = list(context), [], [], []
        for t, lp in zip(ids, lps):
            alts = [] if lp is None else [a for a, _ in lp.top[:top]]
            texts = self.after(seen, [t, *alts])
            tokens.append(texts[0])
            offsets.append(offset)
            offset += len(texts[0])
            tops.append(None if lp is None else {s: v for s, (_, v) in zip(texts[1:], lp.top)})
            seen.append(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def prompt_logprobs(self, prompt_ids, lps, top: int) -> list:
        """vLLM's ``prompt_logprobs``: None for the first token, then per position ``{token
        id: {"logprob", "rank", "decoded_token"}}`` for the prompt's token and the ``top`` most
        likely ones."""
        out = [None]
        for p, lp in enumerate(lps[1:]):
            ids = [lp.token, *(t for t, _ in lp.top[:top])]
            texts = self.after(list(prompt_ids[: p + 1]), ids)
            ranks = [lp.rank, *range(1, len(ids))]
            values = [lp.logprob, *(v for _, v in lp.top[:top])]
            out.append({str(t): {"logprob": v, "rank": r, "decoded_token": s}
                        for t, v, r, s in zip(ids, values, ranks, texts)})  # fmt: skip
        return out

    def chat_logprobs(self, lps) -> dict:
        """OpenAI's chat ``logprobs`` of ``lps`` (TokenLogprob)."""

        def entry(t: int, v: float) -> dict:
            s = self.text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {
            "content": [
                {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in lps
            ]
        }


def state(request) -> ServerState:
    """The server's state, from a route's ``fastapi.Request``."""
    return request.app.state.selfattn
