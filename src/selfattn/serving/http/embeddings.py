"""``POST /v1/embeddings``: a :class:`~selfattn.models.SentenceEncoder`'s sentence embeddings,
computed on the server's embedding thread (the event loop stays free)."""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
import asyncio
import base64
import concurrent.futures
import struct

from selfattn._optional import require
from selfattn.serving.http.common import ServerState, model_not_found, state
from selfattn.serving.protocol import EmbeddingRequest, RequestError

fastapi = require("fastapi", extra="serve", purpose="the OpenAI server")

EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # the name of the bundled encoder's embeddings

router = fastapi.APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: fastapi.Request):
    s = state(request)
    texts = _texts(body, s)
    encoder = await _encoder(s)
    if body.dimensions is not None and body.dimensions != encoder.dim:
        raise RequestError(
            f"dimensions={body.dimensions}: this model's embeddings have {encoder.dim} "
            "dimensions (leave dimensions unset)",
            param="dimensions",
        )
    loop = asyncio.get_running_loop()
    emb, n_tokens = await loop.run_in_executor(s.embed_pool, _embed, encoder, texts)
    data = []
    for i, row in enumerate(emb):
        if body.encoding_format == "base64":
            vec = base64.b64encode(struct.pack(f"<{len(row)}f", *row)).decode()
        else:
            vec = row
        data.append({"object": "embedding", "index": i, "embedding": vec})
    return {"object": "list", "data": data, "model": s.embedding_model_name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}  # fmt: skip


def _texts(body: EmbeddingRequest, s: ServerState) -> list[str]:
    """The texts to embed; 404 unless this server embeds with ``body.model``."""
    if s.encoder is None or body.model != s.embedding_model_name:
        served = [s.embedding_model_name] if s.encoder is not None else []
        raise model_not_found(
            f"the model {body.model!r} does not serve embeddings here; this server embeds "
            f"with {served or 'no model (start it without MODEL_DIR for all-MiniLM-L6-v2)'}"
        )
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or any(not t for t in texts):
        raise RequestError("input must hold non-empty strings", param="input")
    return texts


async def _encoder(s: ServerState):
    """The encoder; one still loading (a ``Future``) is awaited once and kept."""
    if isinstance(s.encoder, concurrent.futures.Future):
        s.encoder = await asyncio.wrap_future(s.encoder)
    return s.encoder


def _embed(encoder, texts: list[str]) -> tuple[list[list[float]], int]:
    import torch

    with torch.inference_mode():
        emb = encoder.encode(texts)  # (n, dim)
        _, mask = encoder.tokenize(texts)
    return emb.float().tolist(), int(mask.sum())
