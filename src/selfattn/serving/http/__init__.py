"""An OpenAI-compatible HTTP server over an :class:`~selfattn.serving.Engine` (FastAPI + uvicorn).

::

    selfattn serve MODEL_DIR                       # the command (cli/serve.py), or in Python:
    serve(Engine.from_pretrained(folder, load_tokenizer(folder)), port=8000)
    app = build_app(engine, model_name="tiny")     # the ASGI app alone (tests, other servers)

Rooms: ``app.py`` (the app factory: lifespan, API key, error handlers, routers; :func:`serve`),
one module per endpoint family — ``completions.py`` (``POST /v1/completions``), ``chat.py``
(``POST /v1/chat/completions``, the checkpoint's chat template), ``embeddings.py`` (``POST
/v1/embeddings``, a :class:`~selfattn.models.SentenceEncoder`), ``models.py`` (``GET
/v1/models``, ``GET /health``, ``GET /metrics``: Prometheus) — ``common.py`` (the state the
routes read, submission, SSE, usage, logprobs, errors) and ``limits.py`` (the body's bound).
Request bodies and their conversion to prompt ids and
:class:`~selfattn.serving.SamplingParams`: :mod:`selfattn.serving.protocol`; tool calling
(``tools``, ``tool_choice``, the calls read back): :mod:`selfattn.serving.tools`.
``stream: true`` answers with server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``.

Threads: the engine steps on its :class:`~selfattn.serving.loop.EngineLoop`'s thread, which the
app holds from start-up to shutdown; the event loop only validates, submits and writes
responses (each step's outputs reach it in one ``call_soon_threadsafe``); tokenising, chat
templates and guides' compilation run on worker threads, off its path. Requests
reaching an idle engine together share its first step (``EngineConfig.admit_quiet_s``). A failed
batch ends only its own requests (:meth:`Engine.step`); a failure of the step itself ends the
open requests (:meth:`Engine.fail_open`); the loop goes on either way.

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, unknown fields, bad values (sampling ranges, ``max_tokens``, an empty prompt, a prompt or
prompt + ``max_tokens`` beyond the context, the per-request caps of
:mod:`selfattn.serving.protocol`), 401 for a missing or wrong API key, 404 for an unknown model
or route, 413 for a body over :class:`~selfattn.serving.config.ServerLimits`'
``max_request_bytes`` (``limits.py``: before the rest of it is read), 429 with ``Retry-After``
when the waiting queue is full, 500 when the model failed on the request, 503 while shutting
down (and, from uvicorn, beyond ``max_connections``). A stream whose client stopped reading is
dropped past ``max_stream_backlog`` outputs. A client that disconnects has its requests
aborted at once (the next step frees their pages). At shutdown (uvicorn's, on SIGTERM) running
requests finish first.
"""

from selfattn.serving.http.app import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    build_app,
    serve,
    wait_until_healthy,
)
from selfattn.serving.http.embeddings import EMBEDDING_MODEL

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "EMBEDDING_MODEL", "build_app", "serve",
           "wait_until_healthy"]  # fmt: skip
