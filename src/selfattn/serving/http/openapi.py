"""The server's OpenAPI document (``/openapi.json``) as clients, generators and fuzzers read it.

FastAPI documents each route's body and a 200 of any JSON; this adds what the server really
answers: OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``) under every
status a route can send (400 for a body that does not validate, where FastAPI would say 422;
401 when a key is required; 404 for another model's name; 413, 429, 500, 503), the media types of
the answers that are not JSON (``/metrics``' Prometheus text; a stream's server-sent events),
and the bearer key as a security scheme when the server requires one.
"""

from __future__ import annotations

__all__ = ["document"]

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
WHY = {
    400: "The body does not validate, or a value is out of range (the error names it).",
    401: "A missing or wrong API key.",
    404: "The model named is not served here.",
    413: "The body is larger than the server takes.",
    429: "The waiting queue is full; retry after Retry-After seconds.",
    500: "The model failed on this request (the server's log has the details).",
    503: "The engine is not running.",
}
# the statuses each route can answer besides 200 (401 only where a key is required)
ROUTES = {
    "/v1/completions": (400, 404, 413, 429, 500, 503),
    "/v1/chat/completions": (400, 404, 413, 429, 500, 503),
    "/v1/embeddings": (400, 404, 413, 429, 500, 503),
    "/v1/models": (413,),
    "/metrics": (413,),
    "/health": (413, 503),
}
STREAMING = ("/v1/completions", "/v1/chat/completions")


def document(schema: dict, *, api_key: bool) -> dict:
    """``schema`` (FastAPI's document of the app) with the server's real answers (module
    docstring); changed in place and returned."""
    schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    if api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    for path, methods in schema.get("paths", {}).items():
        for op in methods.values():
            answers = op.setdefault("responses", {})
            answers.pop("422", None)
            for status in (*ROUTES.get(path, (400, 413)), *((401,) if api_key else ())):
                answers[str(status)] = {
                    "description": WHY[status],
                    "content": {"application/json": {"schema": ref}},
                }
            ok = answers.setdefault("200", {"description": "Successful Response"})
            if path == "/metrics":
                ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
            elif path in STREAMING:
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    return schema
