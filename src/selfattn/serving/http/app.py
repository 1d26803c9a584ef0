"""The app factory (:func:`build_app`), the uvicorn runner (:func:`serve`) and the health poll
(:func:`wait_until_healthy`); the routes live in one module per endpoint family."""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import threading
import time

from selfattn._optional import require
from selfattn.serving.config import DEFAULT_HOST, DEFAULT_PORT, ServerLimits
from selfattn.serving.engine import Engine
from selfattn.serving.http import chat, completions, embeddings, models, openapi
from selfattn.serving.http.common import (
    RETRY_AFTER_S,
    ServerState,
    error_response,
    validation_message,
)
from selfattn.serving.http.limits import BodyLimit, KeyGuard
from selfattn.serving.protocol import RequestError
from selfattn.serving.tools import PARSER_CHOICES

fastapi = require("fastapi", extra="serve", purpose="the OpenAI server")
exceptions = require("fastapi.exceptions", extra="serve")
starlette_exc = require("starlette.exceptions", extra="serve")
get_openapi = require("fastapi.openapi.utils", extra="serve").get_openapi
cors = require("starlette.middleware.cors", extra="serve")

log = logging.getLogger("selfattn")

ROUTERS = (completions.router, chat.router, embeddings.router, models.router)


def build_app(
    engine: Engine | None = None,
    *,
    encoder=None,
    model_name: str = "selfattn",
    embedding_model_name: str = embeddings.EMBEDDING_MODEL,
    api_key: str | None = None,
    allowed_origins: tuple[str, ...] = (),
    max_waiting: int | None = None,
    on_startup=None,
    tool_call_parser: str = "auto",
    limits: ServerLimits | None = None,
):
    """The FastAPI app serving ``engine`` (completions, chat) and/or ``encoder`` (a
    :class:`~selfattn.models.SentenceEncoder`: embeddings) under ``model_name`` /
    ``embedding_model_name``; see :mod:`selfattn.serving.http`. ``encoder`` may be a
    ``concurrent.futures.Future`` of one, still loading: the server answers at once (``/health``,
    the engine's routes) and embedding requests wait for it (``selfattn serve`` without a model
    loads MiniLM so, beside the chat model).

    ``api_key``: every route wants ``Authorization: Bearer <api_key>`` (401 otherwise, before
    the body is read; the API's description, ``/openapi.json`` and ``/docs``, stays public).
    ``allowed_origins``: browser origins the API answers across origins (CORS; ``"*"``: any);
    none by default, so a web page elsewhere cannot call it from a user's browser.
    ``max_waiting``: requests waiting for admission at once before new ones get 429 (default,
    and at most, the engine's ``max_waiting``). ``on_startup()``: called once the app starts,
    just before the server takes connections (``selfattn serve`` starts loading MiniLM there,
    off the start-up's path). ``tool_call_parser``: how chat requests with ``tools`` read the
    model's calls, one of :data:`~selfattn.serving.tools.PARSER_CHOICES` (``"auto"``: by the
    markers the chat template writes). ``limits``: what one client may take
    (:class:`~selfattn.serving.config.ServerLimits`: the request body's size, a stream's backlog;
    :func:`serve` passes its ``max_connections`` to uvicorn).
    """
    _check_app_args(engine, encoder, max_waiting)
    limits = ServerLimits() if limits is None else limits
    if not isinstance(limits, ServerLimits):
        raise TypeError(f"limits must be a ServerLimits, got {type(limits).__name__}")
    if tool_call_parser not in PARSER_CHOICES:
        raise ValueError(
            f"tool_call_parser must be one of {PARSER_CHOICES}, got {tool_call_parser!r}"
        )
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="selfattn-embed")
    state = ServerState(engine, encoder, model_name=model_name, max_waiting=max_waiting,
                        embedding_model_name=embedding_model_name, embed_pool=pool,
                        tool_call_parser=tool_call_parser, limits=limits)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state.loop is not None:
            state.loop.start(hold=True)
        if on_startup is not None:
            on_startup()
        yield
        if state.loop is not None:  # uvicorn waited for open responses; drain what is left
            await asyncio.to_thread(state.loop.stop)
        pool.shutdown(wait=True)

    app = fastapi.FastAPI(title="selfattn", lifespan=lifespan)
    app.state.selfattn = state  # what the routes read (common.state)

    def openapi_schema() -> dict:
        if app.openapi_schema is None:
            plain = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = openapi.document(plain, api_key=api_key is not None)
        return app.openapi_schema

    app.openapi = openapi_schema
    for error, handler in _ERROR_HANDLERS:
        app.add_exception_handler(error, handler)
    for router in ROUTERS:
        app.include_router(router)
    max_model_len = None if engine is None else engine.max_model_len
    app.add_middleware(BodyLimit, max_bytes=limits.request_bytes(max_model_len))
    if api_key is not None:  # outside the body's bound: checked before the body is read
        app.add_middleware(KeyGuard, key=api_key)
    if allowed_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(cors.CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])  # fmt: skip
    return app


def _check_app_args(engine, encoder, max_waiting) -> None:
    if engine is None and encoder is None:
        raise ValueError("build_app needs an engine (completions, chat), an encoder "
                         "(embeddings), or both")  # fmt: skip
    if engine is not None and not isinstance(engine, Engine):
        raise TypeError(f"engine must be a selfattn.serving.Engine, got {type(engine).__name__}")
    if max_waiting is not None and (
        isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
    ):
        raise ValueError(f"max_waiting must be a positive int, got {max_waiting!r}")


# -- errors: OpenAI's JSON ------------------------------------------------------------------------


async def _on_request_error(request, e: RequestError):
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
    return error_response(e.status, str(e), e.type, e.param, e.code, headers)


async def _on_invalid(request, e):
    message, param = validation_message(e.errors())
    return error_response(400, message, param=param)


async def _on_http(request, e):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(e.status_code, str(e.detail), kind, headers=e.headers)


async def _on_unexpected(request, e: Exception):
    """Anything else a route raised (a tokenizer that failed on one prompt): logged with its
    trace here, a 500 without it for the client (a message or trace may name the server's
    files)."""
    log.error("selfattn.serving: %s %s failed", request.method, request.url.path,
              exc_info=(type(e), e, e.__traceback__))  # fmt: skip
    return error_response(
        500,
        f"the server failed on this request ({type(e).__name__}); its log has the details",
        "server_error",
    )


_ERROR_HANDLERS = (
    (RequestError, _on_request_error),
    (exceptions.RequestValidationError, _on_invalid),
    (starlette_exc.HTTPException, _on_http),
    (Exception, _on_unexpected),
)


# -- running it -----------------------------------------------------------------------------------


def serve(
    engine: Engine | None = None,
    *,
    encoder=None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    **app_kw,
) -> None:
    """Run :func:`build_app` on uvicorn until SIGINT/SIGTERM, then drain: the listening socket
    closes, requests arriving on open connections get 503, running ones finish and get their
    answers within ``limits.drain_timeout`` seconds (then they are cut), and this returns; a
    second signal returns at once. Connections beyond ``limits.max_connections`` are answered
    503 by uvicorn."""
    uvicorn = require("uvicorn", extra="serve", purpose="selfattn serve")
    limits = ServerLimits() if limits is None else limits
    app = build_app(engine, encoder=encoder, limits=limits, **app_kw)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=limits.drain_timeout,
                            limit_concurrency=limits.max_connections)  # fmt: skip

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # the second signal: stop waiting for anything
                self.force_exit = True
            app.state.selfattn.draining = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            # Still listening: new requests get 503 while the running ones finish (uvicorn's
            # own shutdown then closes the socket and waits for the responses to be sent).
            deadline = time.monotonic() + limits.drain_timeout
            while (engine is not None and engine.has_unfinished() and not self.force_exit
                   and time.monotonic() < deadline):  # fmt: skip
                await asyncio.sleep(0.05)
            await super().shutdown(sockets)

    server = Server(config)
    main = threading.current_thread() is threading.main_thread()
    # uvicorn re-raises the signal it shut down on, to let the previous handler act; this one
    # lets the drained process return normally (exit 0) instead of dying by SIGTERM.
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        server.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    if main and server.force_exit:
        # The second signal: out now. The engine's thread may be inside a kernel, and an
        # interpreter finalising around it can abort (SIGABRT) instead of exiting 0.
        logging.shutdown()
        os._exit(0)


def wait_until_healthy(
    base_url: str, timeout_s: float = 60.0, process=None, api_key: str | None = None
) -> None:
    """Poll ``GET {base_url}/health`` until it answers 200 (a server just started, e.g.
    ``selfattn serve`` in a ``subprocess.Popen`` given as ``process``; ``api_key``: the key a
    server run with ``--api-key`` wants); RuntimeError when the process exits first or
    ``timeout_s`` passes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server process exited with code {process.returncode}")
        try:
            auth = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
            probe = urllib.request.Request(f"{base_url}/health", headers=auth)
            with urllib.request.urlopen(probe, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}/health did not answer within {timeout_s} s")
        time.sleep(0.1)
