"""``selfattn serve [MODEL_DIR]``: an OpenAI-compatible HTTP server (:mod:`selfattn.serving.server`)
over a continuous-batching :class:`~selfattn.serving.Engine`, or, without MODEL_DIR (or with a
sentence-transformers folder), embeddings of a :class:`~selfattn.models.SentenceEncoder`.

SIGTERM or Ctrl-C drains: no new connections, running requests finish, then the command exits 0.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from selfattn.cli import _common

KV_DTYPES = ("auto", "int8", "fp8")
API_KEY_ENV = "SELFATTN_API_KEY"  # the key without putting it on the command line (ps shows it)


def add_parser(subparsers):
    p = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server: completions, chat, embeddings, /metrics",
        description=(
            "Serve MODEL_DIR (a decoder checkpoint folder with tokenizer.json, or a Hub id in "
            "the local cache) on /v1/completions and /v1/chat/completions with continuous "
            "batching, or a sentence-transformers folder on /v1/embeddings. Without MODEL_DIR: "
            "embeddings of the bundled all-MiniLM-L6-v2."
        ),
    )
    p.add_argument(
        "model",
        metavar="MODEL_DIR",
        nargs="?",
        default=None,
        help="checkpoint folder or Hub id (default: all-MiniLM-L6-v2 embeddings)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument(
        "--port",
        type=_common.int_at_least(0),
        default=8000,
        help="port (default 8000; 0: any free port)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route (default ${API_KEY_ENV})",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in requests (default: MODEL_DIR as given)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=_common.positive_int,
        default=None,
        metavar="N",
        help="bytes of the paged KV pool (default 256 MiB)",
    )
    p.add_argument(
        "--page-size",
        type=_common.positive_int,
        default=16,
        metavar="N",
        help="tokens per KV page (default 16)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="KV pool storage: the model's dtype (auto), int8 or fp8",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_common.positive_int,
        default=64,
        metavar="N",
        help="sequences running at once (default 64)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=_common.positive_int,
        default=512,
        metavar="N",
        help="tokens one step computes at most (default 512)",
    )
    p.add_argument(
        "--max-waiting",
        type=_common.positive_int,
        default=4096,
        metavar="N",
        help="requests waiting at once before 429 (default 4096)",
    )
    p.add_argument("--dtype", default="auto", help="weights dtype: auto, bfloat16, float32, ...")
    p.add_argument(
        "--tensor-parallel",
        type=_common.positive_int,
        default=1,
        metavar="N",
        help="split the model over N processes (selfattn.serving.parallel)",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    p.set_defaults(run=run, subparser=p)
    return p


def _is_encoder_folder(path: str) -> bool:
    """A sentence-transformers folder (modules.json) or a BERT checkpoint: embeddings."""
    folder = Path(path)
    if (folder / "modules.json").is_file():
        return True
    config = folder / "config.json"
    if not config.is_file():
        return False
    from selfattn.models.hub import read_json

    return read_json(config).get("model_type") in ("bert",)


def _engine_kwargs(args) -> dict:
    import torch

    from selfattn.serving import DEFAULT_KV_CACHE_BYTES

    kv_dtype = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[args.kv_dtype]
    return dict(
        kv_cache_bytes=args.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES,
        page_size=args.page_size,
        kv_dtype=kv_dtype,
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        max_waiting=args.max_waiting,
    )


def _tokenizer(model: str):
    """The checkpoint's tokenizer, or None (token-id prompts only) when it has none."""
    from selfattn.models import load_tokenizer
    from selfattn.models.hub import CheckpointError

    try:
        return load_tokenizer(model)
    except CheckpointError as e:
        logging.getLogger("selfattn").warning(
            "selfattn serve: %s; serving token-id prompts only (no text, no chat)", e
        )
        return None


def _build_engine(args):
    kw = _engine_kwargs(args)
    kw["tokenizer"] = _tokenizer(args.model)
    if args.tensor_parallel > 1:
        try:
            from selfattn.serving.parallel import tensor_parallel_engine
        except ImportError as e:
            raise RuntimeError(
                f"--tensor-parallel {args.tensor_parallel} needs selfattn.serving.parallel, "
                f"which this installation lacks ({e}); run with --tensor-parallel 1"
            ) from None
        return tensor_parallel_engine(args.model, args.tensor_parallel, **kw)
    from selfattn.models import from_pretrained
    from selfattn.serving import Engine

    model = from_pretrained(args.model, dtype=args.dtype, progress=False).eval()
    return Engine(model, **kw)


def run(args) -> int:
    from selfattn.serving.server import EMBEDDING_MODEL, serve

    logging.getLogger("selfattn").setLevel(logging.INFO)
    engine = encoder = None
    name = args.served_model_name
    if args.model is None or _is_encoder_folder(args.model):
        if args.tensor_parallel > 1:
            args.subparser.error("--tensor-parallel applies to decoder models, not embeddings")
        encoder = _common.load_encoder(args.model)
        app_kw = dict(embedding_model_name=name or args.model or EMBEDDING_MODEL)
    else:
        with _common.spinner(f"loading {args.model}"):
            engine = _build_engine(args)
        app_kw = dict(model_name=name or args.model.rstrip("/"), max_waiting=args.max_waiting)
    serve(
        engine,
        encoder=encoder,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        log_level=args.log_level,
        **app_kw,
    )
    return _common.EXIT_OK
