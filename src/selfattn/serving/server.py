"""An OpenAI-compatible HTTP server over an :class:`~selfattn.serving.Engine` (FastAPI + uvicorn).

::

    selfattn serve MODEL_DIR                       # the command (cli/serve.py), or in Python:
    serve(Engine.from_pretrained(folder, load_tokenizer(folder)), port=8000)
    app = build_app(engine, model_name="tiny")     # the ASGI app alone (tests, other servers)

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the checkpoint's chat
template), ``POST /v1/embeddings`` (a :class:`~selfattn.models.SentenceEncoder`), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). ``stream: true`` answers with
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``.

Threads: the engine steps on ONE worker thread (:class:`EngineWorker`) while it has work; the
event loop only validates, tokenises, submits (:meth:`Engine.add_request`; after each step the
worker hands the outputs to the requests' ``asyncio.Queue`` s through
``loop.call_soon_threadsafe``) and writes responses. Requests reaching an idle engine
together (clients starting at once) share its first step (:data:`ADMIT_QUIET_S`). A failed
batch ends only its own requests (:meth:`Engine.step`); a failure of the step itself ends the
open requests (:meth:`Engine.fail_open`); the worker goes on either way.

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, unknown fields, bad values (sampling ranges, ``max_tokens``, an empty prompt, a prompt or
prompt + ``max_tokens`` beyond the context), 401 for a missing or wrong API key, 404 for an
unknown model or route, 429 with ``Retry-After`` when the waiting queue is full, 500 when the
model failed on the request. A client that disconnects has its requests aborted at once (the
next step frees their pages). At shutdown (uvicorn's, on SIGTERM) running requests finish first.

``/metrics`` is written by ``prometheus_client`` from the engine's
:class:`~selfattn.serving.EngineMetrics` at each scrape (a collector on the app's own registry:
no process-global state, two apps in one process do not mix, and the text format, escaping and
histogram conventions are the reference implementation's rather than ours).
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (the request
# body models, ``fastapi.Request``) as objects, and ``fastapi`` is imported lazily (a local).
import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import hmac
import json
import logging
import signal
import struct
import threading
import time
import uuid

from selfattn._optional import require
from selfattn.serving.engine import Engine, QueueFull
from selfattn.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RequestError,
    sampling_params,
)

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "EngineWorker",
    "build_app",
    "serve",
    "wait_until_healthy",
]

log = logging.getLogger("selfattn")

DEFAULT_HOST = "127.0.0.1"  # loopback unless --host says otherwise
DEFAULT_PORT = 8000
DEFAULT_MAX_TOKENS = 16  # completions without max_tokens (OpenAI's default); chat: the context
RETRY_AFTER_S = 1  # Retry-After of a 429: a step or a few free room in the waiting queue
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
# Requests reaching an idle engine together (clients starting at once) are admitted into its
# first step together: the worker waits while they keep arriving, each within ADMIT_QUIET_S of
# the one before, ADMIT_WINDOW_S at most. A request that missed that step would wait a whole
# step (tens of ms on a CPU) for its own prefill, and cost the burst one more step; a lone
# request pays ADMIT_QUIET_S. A busy engine waits for nothing: what arrives during a step joins
# the next one.
ADMIT_QUIET_S = 0.003  # an HTTP request takes ~0.3 ms of the event loop's time
ADMIT_WINDOW_S = 0.03  # about one decode step of the benchmark's model on a CPU


class EngineWorker:
    """The one thread that steps ``engine`` while it has unfinished requests, and sleeps
    otherwise. :meth:`submit` and :meth:`abort` may be called from any thread.

    A step's outputs go to their event loops in one ``call_soon_threadsafe`` per loop and step
    (not one per request: 16 streams would wake the loop 16 times a step). Woken from idle, it
    lets a burst of arrivals land before its first step (``admit_quiet_s``,
    ``admit_window_s``: :data:`ADMIT_QUIET_S`); ``admit_window_s=0`` steps at once.
    """

    def __init__(self, engine: Engine, *, admit_quiet_s: float = ADMIT_QUIET_S,
                 admit_window_s: float = ADMIT_WINDOW_S):  # fmt: skip
        for name, v in (("admit_quiet_s", admit_quiet_s), ("admit_window_s", admit_window_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 60:
                raise ValueError(f"EngineWorker {name} must be seconds in [0, 60), got {v!r}")
        self.engine = engine
        self.admit_quiet_s, self.admit_window_s = admit_quiet_s, admit_window_s
        self._arrivals = 0  # requests submitted so far (only compared for a change)
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._outbox: dict = {}  # event loop -> [(queue, item)], filled during a step
        engine.worker = self  # generate() on the engine refuses while this thread steps it

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="selfattn-engine", daemon=True
                )
                self._thread.start()

    def submit(self, prompt, params, request_id: str, loop, queue, tag) -> str:
        """Add a request whose outputs arrive in ``queue`` (of ``loop``) as ``(tag, output)``."""
        if self._stopping:
            raise RequestError("the server is shutting down", status=503, type="server_error")
        self.start()
        sink = functools.partial(self._post, loop, queue, tag)
        rid = self.engine.add_request(prompt, params, request_id, sink=sink)
        self._arrivals += 1
        self._wake.set()
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def _post(self, loop, queue, tag, out) -> None:  # a sink: on this thread, during a step
        self._outbox.setdefault(loop, []).append((queue, (tag, out)))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody reads these any more
                for _, (_, out) in items:
                    if not out.finished:
                        self.engine.abort(out.request_id)

    def _run(self) -> None:
        engine = self.engine
        while True:
            self._wake.wait()
            # Cleared before looking for work: a submit after this line sets it again.
            self._wake.clear()
            if engine.has_unfinished():  # idle until now
                self._gather_burst()
            while engine.has_unfinished():
                try:
                    engine.step()
                except Exception as e:  # one bad step: its requests end, the worker goes on
                    engine.fail_open(e)
                self._flush()
            if self._stopping:
                return

    def _gather_burst(self) -> None:
        """Before an idle engine's first step: wait while requests keep arriving, each within
        ``admit_quiet_s`` of the last, ``admit_window_s`` at most, and no longer once the waiting
        ones fill the running set or the server stops."""
        deadline = time.monotonic() + self.admit_window_s
        seen = None
        while seen != self._arrivals and not self._stopping:
            seen = self._arrivals
            left = deadline - time.monotonic()
            if left <= 0 or self.engine.num_waiting() >= self.engine.scheduler.max_num_seqs:
                return
            time.sleep(min(self.admit_quiet_s, left))

    def stop(self, timeout: float | None = None) -> None:
        """Drain: finish every unfinished request, then end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


# -- errors ---------------------------------------------------------------------------------------


def _error(status: int, message: str, type: str = "invalid_request_error", param=None,
           code=None, headers=None):  # fmt: skip
    responses = require("fastapi.responses", extra="serve")
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return responses.JSONResponse(body, status_code=status, headers=headers)


def _validation_message(errors) -> tuple[str, str | None]:
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


# -- one HTTP request's engine requests -----------------------------------------------------------


class _Submission:
    """The engine requests of one HTTP request (one per prompt), their outputs arriving in one
    queue as ``(prompt index, RequestOutput)``; :meth:`close` aborts whatever is unfinished."""

    def __init__(self, worker: EngineWorker, base_id: str):
        self.worker, self.base_id = worker, base_id
        self.ids: list[str] = []
        self.open: set[str] = set()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()

    def add(self, prompt_ids: list[int], params) -> None:
        k = len(self.ids)
        rid = self.worker.submit(prompt_ids, params, f"{self.base_id}-{k}", self.loop,
                                 self.queue, k)  # fmt: skip
        self.ids.append(rid)
        self.open.add(rid)

    async def outputs(self):
        """``(k, output)`` as they come, until every request finished; a failed one raises."""
        while self.open:
            k, out = await self.queue.get()
            if out.finished:
                self.open.discard(out.request_id)
            if out.error is not None:
                raise _ModelFailure(out.error)
            yield k, out

    def close(self) -> None:
        for rid in list(self.open):
            self.worker.abort(rid)
        self.open.clear()


class _ModelFailure(RuntimeError):
    """The engine ended a request with an error (the model raised on its batch)."""


async def _until_disconnect(request) -> None:
    """Returns when the client hangs up (uvicorn's receive gives ``http.disconnect`` once the
    body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- response bodies ------------------------------------------------------------------------------


def _usage(outs) -> dict:
    """OpenAI's ``usage`` of engine outputs (every sample's tokens; cached prompt tokens)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)},
    }


def _news(out):
    """The samples of ``out`` with something to report, and the logprobs new in each."""
    for c in out.outputs:
        if c.delta_token_ids or c.delta_text or c.finished:
            new_lps = None
            if c.logprobs is not None:
                new_lps = c.logprobs[len(c.token_ids) - len(c.delta_token_ids) :]
            yield c, new_lps


class _Tokens:
    """Token text for logprobs (None without a tokenizer: the id as text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, t: int) -> str:
        return str(t) if self.tokenizer is None else self.tokenizer.decode([t])

    def completion_logprobs(self, lps, offset: int) -> dict:
        """OpenAI's completions ``logprobs`` of ``lps`` (TokenLogprob), text offsets from
        ``offset``."""
        tokens, offsets = [], []
        for lp in lps:
            tokens.append(self.text(lp.token))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps) -> dict:
        def entry(t: int, v: float) -> dict:
            s = self.text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {
            "content": [
                {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in lps
            ]
        }


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# -- the app --------------------------------------------------------------------------------------


def build_app(
    engine: Engine | None = None,
    *,
    encoder=None,
    model_name: str = "selfattn",
    embedding_model_name: str = EMBEDDING_MODEL,
    api_key: str | None = None,
    max_waiting: int | None = None,
    on_startup=None,
):
    """The FastAPI app serving ``engine`` (completions, chat) and/or ``encoder`` (a
    :class:`~selfattn.models.SentenceEncoder`: embeddings) under ``model_name`` /
    ``embedding_model_name``; see the module docstring. ``encoder`` may be a
    ``concurrent.futures.Future`` of one, still loading: the server answers at once (``/health``,
    the engine's routes) and embedding requests wait for it (``selfattn serve`` without a model
    loads MiniLM so, beside the chat model).

    ``api_key``: every route wants ``Authorization: Bearer <api_key>`` (401 otherwise).
    ``max_waiting``: requests waiting for admission at once before new ones get 429 (default,
    and at most, the engine's ``max_waiting``). ``on_startup()``: called once the app starts,
    just before the server takes connections (``selfattn serve`` starts loading MiniLM there,
    off the start-up's path).
    """
    fastapi = require("fastapi", extra="serve", purpose="the OpenAI server")
    responses = require("fastapi.responses", extra="serve")
    exceptions = require("fastapi.exceptions", extra="serve")
    starlette_exc = require("starlette.exceptions", extra="serve")
    prom = require("prometheus_client", extra="serve", purpose="the server's /metrics")
    prom_core = require("prometheus_client.core", extra="serve")
    if engine is None and encoder is None:
        raise ValueError("build_app needs an engine (completions, chat), an encoder "
                         "(embeddings), or both")  # fmt: skip
    if engine is not None and not isinstance(engine, Engine):
        raise TypeError(f"engine must be a selfattn.serving.Engine, got {type(engine).__name__}")
    if max_waiting is not None and (
        isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
    ):
        raise ValueError(f"max_waiting must be a positive int, got {max_waiting!r}")
    worker = None if engine is None else EngineWorker(engine)
    tokens = _Tokens(None if engine is None else engine.tokenizer)
    embed_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="selfattn-embed")
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if worker is not None:
            worker.start()
        if on_startup is not None:
            on_startup()
        yield
        if worker is not None:  # uvicorn waited for open responses; drain what is left
            await asyncio.to_thread(worker.stop)
        embed_pool.shutdown(wait=True)

    # async: FastAPI runs a plain ``def`` dependency on its thread pool, a round trip through
    # another thread (and the GIL, which the engine thread holds between its kernels) for
    # every request
    async def check_key(request: fastapi.Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
            raise RequestError(
                "a missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                "with the key given to selfattn serve --api-key",
                status=401,
                code="invalid_api_key",
            )

    app = fastapi.FastAPI(
        title="selfattn", lifespan=lifespan, dependencies=[fastapi.Depends(check_key)]
    )
    app.state.engine, app.state.worker, app.state.encoder = engine, worker, encoder

    @app.exception_handler(RequestError)
    async def on_request_error(request, e: RequestError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        return _error(e.status, str(e), e.type, e.param, e.code, headers)

    @app.exception_handler(exceptions.RequestValidationError)
    async def on_invalid(request, e):
        message, param = _validation_message(e.errors())
        return _error(400, message, param=param)

    @app.exception_handler(starlette_exc.HTTPException)
    async def on_http(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind, headers=e.headers)

    # -- shared steps of completions and chat ---------------------------------------------------

    def generation_engine(name: str) -> Engine:
        if engine is None or name != model_name:
            served = [model_name] if engine is not None else []
            raise RequestError(
                f"the model {name!r} does not exist here; this server generates with "
                f"{served or 'no model (it serves embeddings only)'} (GET /v1/models)",
                status=404,
                param="model",
                code="model_not_found",
            )
        return engine

    def check_lengths(prompt_ids: list[int], max_tokens: int | None) -> int:
        """The request's max_tokens after the context checks (None: the rest of the context)."""
        limit, P = engine.max_model_len, len(prompt_ids)
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

    def submit(prompts: list[list[int]], params, prefix: str) -> _Submission:
        waiting = engine.num_waiting()
        limit = engine.max_waiting if max_waiting is None else min(max_waiting, engine.max_waiting)
        if waiting + len(prompts) > limit:
            raise RequestError(
                f"{waiting} requests are waiting (at most {limit}); retry after {RETRY_AFTER_S} s",
                status=429,
                type="rate_limit_exceeded",
                code="queue_full",
            )
        sub = _Submission(worker, f"{prefix}-{uuid.uuid4().hex}")
        try:
            for ids in prompts:
                sub.add(ids, params)
        except QueueFull as e:
            sub.close()
            raise RequestError(str(e), status=429, type="rate_limit_exceeded",
                               code="queue_full") from None  # fmt: skip
        except (ValueError, TypeError) as e:
            sub.close()
            if isinstance(e, RequestError):
                raise
            raise RequestError(str(e), param="prompt") from None
        return sub

    async def respond(request, sub: _Submission, stream: bool, chunks, final):
        """Stream ``chunks(k, out)`` events, or await every output and answer ``final(outs)``
        (``outs[k]``: prompt k's last output); either way a client gone aborts the rest."""
        if stream:
            return _EventStream(sub, chunks)
        done = asyncio.ensure_future(_collect(sub))
        gone = asyncio.ensure_future(_until_disconnect(request))
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
        except _ModelFailure as e:
            log.error("selfattn.serving: request %s failed: %r", sub.base_id, e.args[0])
            return _error(500, f"the model failed on this request: {e.args[0]!r}", "server_error")
        return responses.JSONResponse(final(outs))

    class _EventStream(responses.StreamingResponse):
        """Server-sent events of one submission; whatever ends the response (the last
        event, or starlette cancelling it when the client disconnects) aborts what is left."""

        def __init__(self, sub: _Submission, chunks):
            async def events():
                try:
                    async for k, out in sub.outputs():
                        for chunk in chunks(k, out):
                            yield _sse(chunk)
                    for chunk in chunks(None, None):  # the closing events (usage)
                        yield _sse(chunk)
                except _ModelFailure as e:
                    log.error("selfattn.serving: request %s failed: %r", sub.base_id, e.args[0])
                    message = f"the model failed on this request: {e.args[0]!r}"
                    yield _sse({"error": {"message": message, "type": "server_error",
                                          "param": None, "code": None}})  # fmt: skip
                yield "data: [DONE]\n\n"

            super().__init__(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip
            self.sub = sub

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.sub.close()

    async def _collect(sub: _Submission) -> dict:
        last = {}
        try:
            async for k, out in sub.outputs():
                last[k] = out
        finally:
            sub.close()
        return last

    # -- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if worker is not None and worker._thread is not None and not worker.alive:
            return _error(503, "the engine worker thread has stopped", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        data = []
        if engine is not None:
            data.append(
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "selfattn",
                    "max_model_len": engine.max_model_len,
                }
            )
        if encoder is not None:
            data.append({"id": embedding_model_name, "object": "model", "created": created,
                         "owned_by": "selfattn"})  # fmt: skip
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: fastapi.Request):
        eng = generation_engine(body.model)
        body.refuse_unsupported()
        prompts = _completion_prompts(body.prompt, eng.tokenizer)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
        for ids in prompts:
            check_lengths(ids, max_tokens)
        params = sampling_params(body, max_tokens, body.logprobs)
        sub = submit(prompts, params, "cmpl")
        n = params.n
        head = {"id": sub.base_id, "object": "text_completion", "created": int(time.time()),
                "model": model_name}  # fmt: skip
        want_lp = params.logprobs is not None

        def choice(k, c, text, lps, offset):
            return {
                "index": k * n + c.index,
                "text": text,
                "logprobs": tokens.completion_logprobs(lps, offset) if want_lp else None,
                "finish_reason": c.finish_reason,
            }

        seen: dict = {}  # the last output of each prompt, for the closing usage

        def chunks(k, out):
            if out is None:
                if body.stream_options and body.stream_options.include_usage:
                    yield {**head, "choices": [], "usage": _usage(seen.values())}
                return
            seen[k] = out
            for c, lps in _news(out):
                offset = len(c.text or "") - len(c.delta_text or "")
                yield {**head, "choices": [choice(k, c, c.delta_text or "", lps, offset)]}

        def final(outs):
            choices = [
                choice(k, c, c.text or "", c.logprobs, 0)
                for k in sorted(outs)
                for c in outs[k].outputs
            ]
            return {**head, "choices": choices, "usage": _usage(outs.values())}

        return await respond(request, sub, body.stream, chunks, final)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: fastapi.Request):
        eng = generation_engine(body.model)
        body.refuse_unsupported()
        ids = _chat_prompt(body, eng.tokenizer)
        max_tokens = body.max_completion_tokens
        max_tokens = check_lengths(ids, body.max_tokens if max_tokens is None else max_tokens)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, logprobs)
        sub = submit([ids], params, "chatcmpl")
        head = {"id": sub.base_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}  # fmt: skip
        seen: dict = {}

        def choice(c, lps, **content):
            lp = tokens.chat_logprobs(lps) if body.logprobs else None
            return {"index": c.index, **content, "logprobs": lp, "finish_reason": c.finish_reason}

        def chunks(k, out):
            if out is None:
                if body.stream_options and body.stream_options.include_usage:
                    yield {**head, "choices": [], "usage": _usage(seen.values())}
                return
            if not seen:  # OpenAI opens each choice with the role
                for i in range(params.n):
                    opening = {"index": i, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}  # fmt: skip
                    yield {**head, "choices": [opening]}
            seen[k] = out
            for c, lps in _news(out):
                delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
                yield {**head, "choices": [choice(c, lps, delta=delta)]}

        def final(outs):
            o = outs[0]
            choices = [
                choice(c, c.logprobs, message={"role": "assistant", "content": c.text or ""})
                for c in o.outputs
            ]
            return {**head, "object": "chat.completion", "choices": choices,
                    "usage": _usage([o])}  # fmt: skip

        return await respond(request, sub, body.stream, chunks, final)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        nonlocal encoder
        if encoder is None or body.model != embedding_model_name:
            served = [embedding_model_name] if encoder is not None else []
            raise RequestError(
                f"the model {body.model!r} does not serve embeddings here; this server embeds "
                f"with {served or 'no model (start it without MODEL_DIR for all-MiniLM-L6-v2)'}",
                status=404,
                param="model",
                code="model_not_found",
            )
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        if not texts or any(not t for t in texts):
            raise RequestError("input must hold non-empty strings", param="input")
        if isinstance(encoder, concurrent.futures.Future):  # still loading: wait for it once
            encoder = await asyncio.wrap_future(encoder)
        if body.dimensions is not None and body.dimensions != encoder.dim:
            raise RequestError(
                f"dimensions={body.dimensions}: this model's embeddings have {encoder.dim} "
                "dimensions (leave dimensions unset)",
                param="dimensions",
            )
        loop = asyncio.get_running_loop()
        emb, n_tokens = await loop.run_in_executor(embed_pool, _embed, encoder, texts)
        data = []
        for i, row in enumerate(emb):
            if body.encoding_format == "base64":
                vec = base64.b64encode(struct.pack(f"<{len(row)}f", *row)).decode()
            else:
                vec = row
            data.append({"object": "embedding", "index": i, "embedding": vec})
        return {"object": "list", "data": data, "model": embedding_model_name,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        registry = prom.CollectorRegistry()
        if engine is not None:
            registry.register(_EngineCollector(engine, model_name, prom_core))
        return responses.Response(prom.generate_latest(registry),
                                  media_type=prom.CONTENT_TYPE_LATEST)  # fmt: skip

    return app


def _completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """``prompt`` (text, ids, or a list of either) -> token-id lists."""
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
            p = tokenizer.encode(p)
        out.append(list(p))
    return out


def _chat_prompt(body: ChatCompletionRequest, tokenizer) -> list[int]:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise RequestError(
            "this model has no chat template (none in its tokenizer_config.json or "
            "chat_template.jinja); use /v1/completions with the prompt formatted yourself",
            param="messages",
        )
    messages = []
    for m in body.messages:
        d = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        messages.append(d)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template's own raise_exception (an unsupported role, ...)
        raise RequestError(f"the chat template refused the messages: {e}",
                           param="messages") from None  # fmt: skip


def _embed(encoder, texts: list[str]) -> tuple[list[list[float]], int]:
    import torch

    with torch.inference_mode():
        emb = encoder.encode(texts)  # (n, dim)
        _, mask = encoder.tokenize(texts)
    return emb.float().tolist(), int(mask.sum())


class _EngineCollector:
    """The engine's gauges, counters and histograms at scrape time (module docstring)."""

    def __init__(self, engine: Engine, model_name: str, core):
        self.engine, self.model, self.core = engine, model_name, core

    def collect(self):
        m, core = self.engine.metrics, self.core
        labels = (["model"], [self.model])

        def gauge(name, doc, value):
            g = core.GaugeMetricFamily(f"selfattn_{name}", doc, labels=labels[0])
            g.add_metric(labels[1], value)
            return g

        def counter(name, doc, value):
            c = core.CounterMetricFamily(f"selfattn_{name}", doc, labels=labels[0])
            c.add_metric(labels[1], value)
            return c

        def histogram(name, doc, h):
            out = core.HistogramMetricFamily(f"selfattn_{name}", doc, labels=labels[0])
            buckets = [("+Inf" if le == float("inf") else repr(le), n) for le, n in h.cumulative()]
            out.add_metric(labels[1], buckets, h.sum)
            return out

        yield gauge("num_requests_running", "Requests running in the engine.", m.running)
        yield gauge("num_requests_waiting", "Requests waiting for admission.", m.waiting)
        yield gauge("kv_pages_used", "Pages of the KV pool in use.", m.pages_used)
        yield gauge("kv_pages_free", "Free pages of the KV pool.", m.pages_free)
        yield gauge("kv_pool_bytes", "Bytes of the KV pool.", m.pool_bytes)
        yield gauge("prefix_cache_hit_rate",
                    "Prompt tokens served from the prefix cache / prompt tokens admitted.",
                    m.prefix_hit_rate)  # fmt: skip
        yield gauge("generation_tokens_per_second",
                    "Tokens generated per second over the last 10 s.", m.tokens_per_s)  # fmt: skip
        yield counter("prompt_tokens", "Prompt tokens admitted.", m.prompt_tokens)
        yield counter("cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                      m.cached_prompt_tokens)  # fmt: skip
        yield counter("generation_tokens", "Tokens generated.", m.generated_tokens)
        yield counter("preemptions", "Sequences preempted (recomputed later).", m.preemptions)
        yield counter("requests_finished", "Requests finished.", m.requests_finished)
        yield counter("requests_aborted", "Requests aborted.", m.requests_aborted)
        yield histogram("time_to_first_token_seconds", "Arrival to first token.", m.ttft)
        yield histogram("inter_token_latency_seconds", "Between consecutive tokens.", m.itl)


def serve(
    engine: Engine | None = None,
    *,
    encoder=None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    log_level: str = "info",
    **app_kw,
) -> None:
    """Run :func:`build_app` on uvicorn until SIGINT/SIGTERM, then drain: the listening socket
    closes, running requests finish and get their answers, and this returns."""
    uvicorn = require("uvicorn", extra="serve", purpose="selfattn serve")
    app = build_app(engine, encoder=encoder, **app_kw)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=None)  # fmt: skip
    server = uvicorn.Server(config)
    main = threading.current_thread() is threading.main_thread()
    # uvicorn re-raises the signal it shut down on, to let the previous handler act; this one
    # lets the drained process return normally (exit 0) instead of dying by SIGTERM.
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        server.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def wait_until_healthy(base_url: str, timeout_s: float = 60.0, process=None) -> None:
    """Poll ``GET {base_url}/health`` until it answers 200 (a server just started, e.g.
    ``selfattn serve`` in a ``subprocess.Popen`` given as ``process``); RuntimeError when the
    process exits first or ``timeout_s`` passes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server process exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}/health did not answer within {timeout_s} s")
        time.sleep(0.1)
