"""The guards in front of the routes, as ASGI middleware: the API key (:class:`KeyGuard`: a
request without it is answered 401 before its body is read or parsed) and the request body's
bound (:class:`BodyLimit`: a body over the limit is answered 413 before the rest of it is read,
so no request can take the server's memory or hold up the event loop that parses every other
request's JSON).

The server's other bounds live where they apply: the prompt's and sampling fields' in
:mod:`selfattn.serving.protocol` (400s), the waiting queue's in
:meth:`~selfattn.serving.http.common.ServerState.submit` (429), a stream's backlog for a client
that stops reading in :class:`~selfattn.serving.http.common.Submission`, the open connections in
uvicorn (``limit_concurrency``: 503); their values in
:class:`~selfattn.serving.config.ServerLimits`.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
import hmac

from selfattn.serving.http.common import error_response

__all__ = ["PUBLIC_PATHS", "BodyLimit", "KeyGuard"]

# what a server with a key answers without it: the API's description
PUBLIC_PATHS = frozenset(("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"))


class KeyGuard:
    """ASGI middleware: an HTTP request to any path but :data:`PUBLIC_PATHS` without the header
    ``Authorization: Bearer <key>`` is answered 401 (OpenAI's error JSON, ``code:
    "invalid_api_key"``) before its body is read; the key is compared in constant time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self._matches(scope):
            return await self.app(scope, receive, send)
        response = error_response(
            401,
            "a missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
            "key given to selfattn serve --api-key",
            code="invalid_api_key",
            headers={"Connection": "close"},  # the body is never read
        )
        await response(scope, _no_receive, send)

    def _matches(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.key)
        return False


class BodyLimit:
    """ASGI middleware: an HTTP request whose body is over ``max_bytes`` is answered 413
    (OpenAI's error JSON, ``code: "request_too_large"``) and its connection closed, on its
    ``Content-Length`` before any of the body is read, or, for a chunked body, as soon as the
    bytes received pass the limit. A body within it is read whole, then handed to ``app``."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(scope, send, f"{declared} bytes (its Content-Length)")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nobody to answer
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(scope, send, f"{size}+ bytes (received so far)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():  # the body as one message, then the connection's own events
            return body.pop() if body else await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, scope, send, size: str) -> None:
        response = error_response(
            413,
            f"the request body is {size}; this server takes at most {self.max_bytes} bytes "
            "(selfattn serve --max-request-bytes): send a shorter prompt, or split a batch "
            "into several requests",
            code="request_too_large",
            headers={"Connection": "close"},  # the rest of the body is never read
        )
        await response(scope, _no_receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _no_receive():
    return {"type": "http.disconnect"}
