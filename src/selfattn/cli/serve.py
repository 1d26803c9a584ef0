"""``selfattn serve [MODEL_DIR]``: an OpenAI-compatible HTTP server (:mod:`selfattn.serving.server`)
over a continuous-batching :class:`~selfattn.serving.Engine`, or, with a sentence-transformers
folder, embeddings of a :class:`~selfattn.models.SentenceEncoder`. Without MODEL_DIR: the bundled
SmolLM2-135M-Instruct on completions and chat, and the bundled all-MiniLM-L6-v2 on embeddings.

Its flags build one :class:`~selfattn.serving.config.EngineConfig` and take their defaults from
its fields (one statement of each), but the KV pool, sized from this machine's available memory
(:func:`~selfattn.serving.config.kv_cache_bytes_from_memory`). Start-up imports only what
serving needs (no transformers), so ``/health`` answers within seconds of the launch.

SIGTERM or Ctrl-C drains: no new connections, running requests finish, then the command exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from selfattn.cli import _common
from selfattn.serving.config import DEFAULT_HOST, DEFAULT_PORT, EngineConfig, ServerLimits

KV_DTYPES = ("auto", "int8", "fp8", "kivi2", "kivi4")
# selfattn.serving.tools.PARSER_CHOICES, spelled here: --help imports no serving module
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")
API_KEY_ENV = "SELFATTN_API_KEY"  # the key without putting it on the command line (ps shows it)
# Flags that set an EngineConfig field of the same name; each flag's default is the field's.
ENGINE_FLAGS = (
    ("--page-size", "page_size", "tokens per KV page"),
    ("--max-num-seqs", "max_num_seqs", "sequences running at once"),
    ("--max-batch-tokens", "max_batch_tokens",
     "tokens one step computes at most (decode tokens and prefill chunks)"),
    ("--max-waiting", "max_waiting", "requests waiting at once before 429"),
)  # fmt: skip


# Flags that set a ServerLimits field of the same name; each flag's default is the field's.
LIMIT_FLAGS = (
    ("--max-connections", "max_connections",
     "open connections at once; beyond them uvicorn answers 503"),
    ("--max-stream-backlog", "max_stream_backlog",
     "outputs a stream may hold for a client that stopped reading before it is dropped"),
    ("--drain-timeout", "drain_timeout",
     "seconds SIGTERM waits for running requests (new ones get 503; a second SIGTERM exits "
     "at once)"),
)  # fmt: skip


def add_parser(subparsers):
    p = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server: completions, chat, embeddings, /metrics",
        description=(
            "Serve MODEL_DIR (a decoder checkpoint folder with tokenizer.json, a .gguf file, or "
            "a Hub id in the local cache) on /v1/completions and /v1/chat/completions with "
            "continuous batching, or a sentence-transformers folder on /v1/embeddings. Without "
            "MODEL_DIR: the bundled SmolLM2-135M-Instruct on completions and chat, and the "
            "bundled all-MiniLM-L6-v2 on /v1/embeddings. Unset flags take the engine's defaults "
            "(selfattn.serving.EngineConfig)."
        ),
    )
    p.add_argument(
        "model",
        metavar="MODEL_DIR",
        nargs="?",
        default=None,
        help="checkpoint folder, .gguf file or Hub id (default: SmolLM2-135M-Instruct for "
        "chat and completions, all-MiniLM-L6-v2 for embeddings)",
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default {DEFAULT_HOST}: this machine only)",
    )
    p.add_argument(
        "--port",
        type=_common.int_at_least(0),
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}; 0: any free port)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route (default ${API_KEY_ENV})",
    )
    p.add_argument(
        "--allowed-origins",
        metavar="ORIGIN[,ORIGIN]",
        default="",
        help="browser origins allowed to call the API (CORS), e.g. http://localhost:3000; "
        "'*' for any; none by default",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in requests and /v1/models (default: the model's own name: a "
        "GGUF's general.name, a folder's name, a Hub id as given)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=_common.positive_int,
        default=None,
        metavar="N",
        help="bytes of the paged KV pool (default: a quarter of the available memory, at most "
        "4 GiB; memory is taken only as pages are written; logged at start)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="KV pool storage: the model's dtype (auto), int8, fp8, or KIVI pages of 2 or 4 "
        "bits (kivi2, kivi4: full pages quantised, the filling page in the model's dtype)",
    )
    p.add_argument(
        "--kv-compression",
        metavar="POLICY[:RATIO][,KEY=INT]",
        default=EngineConfig.kv_compression,
        help="compress every prompt's KV after its prefill unless the request names its own "
        "kv_compression: snapkv, knorm, tova, observed_attention, expected_attention or "
        "streaming_llm, RATIO the fraction removed (default 0.5), e.g. snapkv:0.5; off by "
        "default. KEY=INT: budget, or decode_budget and decode_interval (evict while "
        "generating: tova, observed_attention, streaming_llm), e.g. tova:0,decode_budget=512",
    )
    for flag, field, text in ENGINE_FLAGS:
        default = getattr(EngineConfig, field)
        p.add_argument(flag, type=_common.positive_int, default=default, metavar="N",
                       help=f"{text} (default {default})")  # fmt: skip
    _add_limits(p)
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="how chat requests with tools read the model's calls: hermes (<tool_call>, Qwen), "
        "llama3_json, mistral ([TOOL_CALLS]), none, or auto (by the markers the chat template "
        "writes; default)",
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.deterministic,
        help="a request's tokens and logprobs bitwise the same alone or in any batch "
        "(fixed key splits, batch-invariant matmuls; slower decode); off by default",
    )
    _add_speculative(p)
    _common.add_dtype(p)
    _common.add_threads(p)
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


def _add_limits(p) -> None:
    """The flags of what one client may take (ServerLimits' fields)."""
    p.add_argument(
        "--max-request-bytes",
        type=_common.positive_int,
        default=ServerLimits.max_request_bytes,
        metavar="N",
        help="bytes of one request body; beyond them 413 before the rest is read (default: "
        "64 per token of the model's context plus 1 MiB)",
    )
    for flag, field, text in LIMIT_FLAGS:
        default = getattr(ServerLimits, field)
        p.add_argument(flag, type=_common.positive_int, default=default, metavar="N",
                       help=f"{text} (default {default})")  # fmt: skip


def _add_speculative(p) -> None:
    """The speculative decoding flags (EngineConfig's speculative fields)."""
    p.add_argument(
        "--speculative",
        choices=("ngram", "draft"),
        default=EngineConfig.speculative,
        help="speculative decoding: ngram (drafts by prompt lookup) or draft (a draft model, "
        "--speculative-model); off by default",
    )
    p.add_argument(
        "--speculative-model",
        metavar="PATH",
        default=EngineConfig.speculative_model,
        help="the draft model (a folder or .gguf with the model's vocabulary); implies "
        "--speculative draft",
    )
    k = EngineConfig.num_speculative_tokens
    p.add_argument("--num-speculative-tokens", type=_common.positive_int, default=k,
                   metavar="K",
                   help=f"draft tokens per sequence and step (default {k})")  # fmt: skip
    hi, lo = EngineConfig.prompt_lookup_max, EngineConfig.prompt_lookup_min
    p.add_argument("--prompt-lookup-max", type=_common.positive_int, default=hi, metavar="N",
                   help=f"longest n-gram prompt lookup matches (default {hi})")  # fmt: skip
    p.add_argument("--prompt-lookup-min", type=_common.positive_int, default=lo, metavar="N",
                   help=f"shortest n-gram prompt lookup matches (default {lo})")  # fmt: skip


SPECULATIVE_FIELDS = ("speculative", "speculative_model", "num_speculative_tokens",
                      "prompt_lookup_max", "prompt_lookup_min")  # fmt: skip


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


def _engine_config(args) -> EngineConfig:
    """The engine's config from the flags, and the KV pool from memory unless
    ``--kv-cache-bytes``."""
    import torch

    from selfattn.serving.config import kv_cache_bytes_from_memory

    kv_dtype = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(
        args.kv_dtype, args.kv_dtype
    )
    kv_bytes = args.kv_cache_bytes or kv_cache_bytes_from_memory()
    how = "--kv-cache-bytes" if args.kv_cache_bytes else "a quarter of MemAvailable, capped"
    logging.getLogger("selfattn").info(
        "selfattn serve: KV pool of %.0f MiB (%s)", kv_bytes / 2**20, how
    )
    fields = {field: getattr(args, field) for _, field, _ in ENGINE_FLAGS}
    fields |= {field: getattr(args, field) for field in SPECULATIVE_FIELDS}
    return EngineConfig(kv_cache_bytes=kv_bytes, kv_dtype=kv_dtype,
                        kv_compression=args.kv_compression, deterministic=args.deterministic,
                        **fields)  # fmt: skip


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


def _build_engine(args, path: str):
    """``(engine, served name)`` of the decoder at ``path``."""
    kw = {"config": _engine_config(args)}
    if args.tensor_parallel > 1:
        kw["tokenizer"] = _tokenizer(path)
        try:
            from selfattn.serving.parallel import tensor_parallel_engine
        except ImportError as e:
            raise RuntimeError(
                f"--tensor-parallel {args.tensor_parallel} needs selfattn.serving.parallel, "
                f"which this installation lacks ({e}); run with --tensor-parallel 1"
            ) from None
        engine = tensor_parallel_engine(path, args.tensor_parallel, quantize=args.quantize,
                                        dtype=_common.model_dtype(args.dtype), **kw)  # fmt: skip
        return engine, _common.served_name(None, path)
    from selfattn.models import from_pretrained
    from selfattn.serving import Engine

    kw["tokenizer"] = _in_background(lambda: _tokenizer(path), "tokenizer")
    model = from_pretrained(
        path, dtype=_common.model_dtype(args.dtype), progress=False, quantize=args.quantize
    ).eval()
    kw["tokenizer"] = kw["tokenizer"].result()
    return Engine(model, **kw), _common.served_name(model, path)


def _in_background(fn, name: str):
    """``fn()`` on a thread of its own, as a ``concurrent.futures.Future``: start-up loads the
    tokenizer, the HTTP stack and MiniLM while the main thread loads the model (torch's work
    releases the GIL)."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"selfattn-{name}")
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def _minilm_loader():
    """``(future, start)``: the bundled all-MiniLM-L6-v2 as a ``Future`` the server answers
    beside (embedding requests wait for it), and ``start()`` that loads it on a thread of its
    own. The server calls ``start`` once it is up: loading beside the chat model or the HTTP
    stack would slow both (torch's OpenMP regions on few cores, and the GIL)."""
    import concurrent.futures
    import threading

    from selfattn.models.encoder import SentenceEncoder

    future: concurrent.futures.Future = concurrent.futures.Future()

    def load() -> None:
        try:
            future.set_result(SentenceEncoder.from_pretrained(None).eval())
        except BaseException as e:  # the embedding requests report it
            future.set_exception(e)

    def start() -> None:
        threading.Thread(target=load, name="selfattn-minilm", daemon=True).start()

    return future, start


def _import_server():
    import uvicorn  # noqa: F401  pure Python, imported off the path

    import selfattn.serving.server  # noqa: F401  fastapi too


def run(args) -> int:
    log = logging.getLogger("selfattn")
    log.setLevel(logging.INFO)
    if not log.handlers:  # start-up lines on stderr beside uvicorn's, in its format
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    import torch

    # Loading runs on one thread: its many small ops gain nothing from more, and on a busy
    # machine torch's OpenMP workers spin at every op's barrier (measured: seconds of start-up).
    # The requested threads compute once the server runs.
    torch.set_num_threads(1)
    engine = encoder = None
    name = args.served_model_name
    app_kw = {}
    if args.model is not None and _is_encoder_folder(args.model):
        if args.tensor_parallel > 1:
            args.subparser.error("--tensor-parallel applies to decoder models, not embeddings")
        encoder = _common.load_encoder(args.model)
        app_kw = dict(embedding_model_name=name or args.model)
        _common.apply_threads(args)
    else:
        path = _common.model_path(args.model)
        label = _common.CHAT_MODEL_NAME if args.model is None else path
        # The model and engine modules first, on this thread: a package imported by two
        # threads at once can hand one of them a half-initialised module (an ImportError).
        import selfattn.models
        import selfattn.serving  # noqa: F401

        _in_background(_import_server, "import")
        with _common.spinner(f"loading {label}"):
            engine, own_name = _build_engine(args, path)
        app_kw = dict(model_name=name or own_name, max_waiting=args.max_waiting,
                      tool_call_parser=args.tool_call_parser)  # fmt: skip
        threads = _common.apply_threads(args)
        log.info("selfattn serve: %r as %r on %d threads: %r", path, app_kw["model_name"],
                 threads, engine)  # fmt: skip
        if args.model is None:  # the bundled pair: chat and completions, and embeddings
            encoder, app_kw["on_startup"] = _minilm_loader()
    from selfattn.serving.server import EMBEDDING_MODEL, serve

    if args.model is None:
        app_kw["embedding_model_name"] = EMBEDDING_MODEL
    limit_fields = {field: getattr(args, field) for _, field, _ in LIMIT_FLAGS}
    limits = ServerLimits(max_request_bytes=args.max_request_bytes, **limit_fields)
    serve(
        engine,
        encoder=encoder,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        allowed_origins=tuple(o for o in args.allowed_origins.split(",") if o),
        log_level=args.log_level,
        limits=limits,
        **app_kw,
    )
    return _common.EXIT_OK
