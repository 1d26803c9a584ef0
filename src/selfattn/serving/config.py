"""The engine's knobs in one frozen dataclass, :class:`EngineConfig`: each default stated once.

The :class:`~selfattn.serving.Engine`, ``selfattn serve`` (its flags' defaults are these fields')
and :func:`~selfattn.serving.parallel.tensor_parallel_engine` all read it::

    engine = Engine(model, tok, config=EngineConfig(max_num_seqs=8))
    engine = Engine(model, tok, max_num_seqs=8)        # the same: keywords build the config

This module imports no torch (``selfattn serve --help`` reads the defaults without it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_MAX_BATCH_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_MAX_WAITING",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_PORT",
    "EngineConfig",
    "ServerLimits",
    "kv_cache_bytes_from_memory",
]

DEFAULT_HOST = "127.0.0.1"  # the server's address: loopback unless --host says otherwise
DEFAULT_PORT = 8000
# `selfattn serve` sizes its pool from memory: this share of MemAvailable, at most the cap (as
# vLLM's CPU build reserves 4 GiB by default). A large pool is an anonymous map that holds memory
# only where pages are written (selfattn.cache.memory): it costs no start-up time, and the process
# grows with the tokens cached, not with the pool. --kv-cache-bytes sets it.
KV_MEMORY_FRACTION = 0.25
KV_MEMORY_CAP = 4 * 2**30
MAX_ADMIT_S = 60  # admission waits are seconds in [0, MAX_ADMIT_S)
SPECULATIVE_KINDS = (None, "ngram", "draft")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every knob of an :class:`~selfattn.serving.Engine` and its stepping loop; checked on
    construction (a bad value raises naming it and the fix)."""

    # Bytes of the paged KV pool: ``kv_cache_bytes // page_bytes`` pages (engine module docstring).
    kv_cache_bytes: int = 256 * 2**20
    # Tokens per KV page.
    page_size: int = 16
    # The pool's storage: None (the model's dtype), torch.int8, torch.float8_e4m3fn, or
    # "kivi2" / "kivi4" (KIVI pages: selfattn.cache.paged.kivi).
    kv_dtype: torch.dtype | str | None = None
    # Tokens one step computes at most (decode tokens and prefill chunks); the serving
    # benchmark's fastest budget.
    max_batch_tokens: int = 1024
    # Sequences running at once (the serving benchmark's running set).
    max_num_seqs: int = 64
    # Requests waiting at once; add_request raises QueueFull beyond it (a server answers 429).
    max_waiting: int = 4096
    # Reuse the K/V of cached page-aligned prompt prefixes.
    prefix_caching: bool = True
    # Longest prompt + output; None: the model's max_positions, at most what the pool holds.
    max_model_len: int | None = None
    # Seeds the generators of requests without a seed.
    seed: int = 0
    # Requests reaching an idle loop together (clients starting at once) share its first step:
    # the loop waits while they keep arriving, each within admit_quiet_s of the one before,
    # admit_window_s at most. A request that missed that step would wait a whole step (tens of
    # ms on a CPU) for its own prefill; a lone request pays admit_quiet_s. A busy loop waits for
    # nothing: what arrives during a step joins the next one. An HTTP request takes ~0.3 ms of
    # the event loop's time; the window is about one decode step of the benchmark's model.
    admit_quiet_s: float = 0.003
    # The longest an idle loop waits for a burst (0: it steps at once).
    admit_window_s: float = 0.03
    # Speculative decoding (selfattn.models.speculative): None (off), "ngram" (drafts by prompt
    # lookup in each sequence's own tokens) or "draft" (a draft model's greedy tokens). Each
    # step verifies a running sequence's drafts in the one packed forward: 1 + k tokens.
    speculative: str | None = None
    # The draft model of speculative="draft": a folder or GGUF file (loaded in the target's
    # dtype) or a loaded selfattn causal LM, with the target's vocabulary. Giving it alone
    # means speculative="draft".
    speculative_model: object = None
    # Draft tokens per sequence and step (k; transformers' num_assistant_tokens default).
    num_speculative_tokens: int = 5
    # Prompt lookup tries n-grams of prompt_lookup_max tokens down to prompt_lookup_min
    # (vLLM's names; the longest match first).
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    # KV compression of every prompt without its own kv_compression: "POLICY[:RATIO][,KEY=INT]"
    # ("snapkv:0.5", "tova:0,decode_budget=512": evict while generating;
    # selfattn.cache.compress.compression reads it) or None (off).
    kv_compression: str | None = None
    # Deterministic mode (selfattn.kernels.determinism): a request's tokens and logprobs are
    # bitwise the same alone or in any batch, whatever the chunking, preemption or prefix-cache
    # hits: fixed key splits, batch-invariant linears, every prompt token attended as a row.
    # Off by default: it costs decode speed (benchmarks/determinism.py measures how much).
    deterministic: bool = False

    def __post_init__(self):
        for name in ("kv_cache_bytes", "page_size", "max_batch_tokens", "max_num_seqs",
                     "max_waiting"):  # fmt: skip
            _positive(name, getattr(self, name))
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        for name in ("prefix_caching", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineConfig {name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"EngineConfig seed must be an int, got {self.seed!r}")
        for name in ("admit_quiet_s", "admit_window_s"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not (math.isfinite(v) and 0 <= v < MAX_ADMIT_S)
            ):
                raise ValueError(
                    f"EngineConfig {name} must be seconds in [0, {MAX_ADMIT_S}), got {v!r}"
                )
        self._check_kv_dtype()
        self._check_deterministic_pages()
        self._check_speculative()
        if self.kv_compression is not None:
            if not isinstance(self.kv_compression, str):
                raise TypeError(
                    "EngineConfig kv_compression must be None or 'POLICY[:RATIO]' (e.g. "
                    f"'snapkv:0.5'), got {self.kv_compression!r}"
                )
            from selfattn.cache.compress import compression  # torch: only when asked

            try:
                compression(self.kv_compression)
            except ValueError as e:
                raise ValueError(f"EngineConfig kv_compression: {e}") from None

    def _check_deterministic_pages(self) -> None:
        """Deterministic mode refuses page formats whose rounding depends on other requests
        or on where a prompt's chunks end."""
        if not self.deterministic or self.kv_dtype is None:
            return
        import torch

        why = None
        if self.kv_dtype == torch.float8_e4m3fn:
            why = ("fp8 pages share one scale per layer and head, set by the first request "
                   "that writes the pool, so a request rounds by what ran before it")  # fmt: skip
        elif self.kv_dtype in ("kivi2", "kivi4"):
            why = (f"{self.kv_dtype} pages are quantised when they fill, so a prompt token "
                   "reads its earlier pages quantised or not by where its chunk ends")  # fmt: skip
        if why is not None:
            raise ValueError(
                f"EngineConfig deterministic=True cannot run kv_dtype={self.kv_dtype}: {why}; "
                "use int8 pages (a scale per token) or the model's dtype"
            )

    def _check_speculative(self) -> None:
        if self.speculative is None and self.speculative_model is not None:
            object.__setattr__(self, "speculative", "draft")
        if self.speculative not in SPECULATIVE_KINDS:
            raise ValueError(
                f"EngineConfig speculative must be one of {SPECULATIVE_KINDS}, got "
                f"{self.speculative!r}"
            )
        if self.speculative == "draft" and self.speculative_model is None:
            raise ValueError(
                "EngineConfig speculative='draft' needs speculative_model (a path or a model); "
                "or use speculative='ngram'"
            )
        if self.speculative == "ngram" and self.speculative_model is not None:
            raise ValueError(
                "EngineConfig speculative_model is for speculative='draft', got "
                "speculative='ngram'; drop one"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            _positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"EngineConfig prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    def _check_kv_dtype(self) -> None:
        if self.kv_dtype is None:
            return
        import torch

        if self.kv_dtype in ("kivi2", "kivi4"):  # KIVI pages
            return
        if not isinstance(self.kv_dtype, torch.dtype):
            raise TypeError(
                f"EngineConfig kv_dtype must be None, a float torch.dtype, torch.int8, "
                f"torch.float8_e4m3fn, 'kivi2' or 'kivi4', got {self.kv_dtype!r}"
            )

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes`` (checked again); unknown names raise naming the fields."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            known = ", ".join(f.name for f in dataclasses.fields(self))
            raise TypeError(f"EngineConfig has no field {', '.join(unknown)}; its fields: {known}")
        return dataclasses.replace(self, **changes)


def _positive(name: str, value, owner: str = "EngineConfig") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner} {name} must be a positive int (1 or more), got {value!r}")
    return value


# A request body's default bound: enough for a prompt of max_model_len tokens as JSON text (a
# token spells a few characters, ~4 in English, a JSON escape writes one in up to 6 bytes; 64
# bytes per token leaves room for both) plus the rest of the request (sampling fields, tool
# definitions, a JSON schema). A batch of long prompts needs a larger --max-request-bytes.
REQUEST_BYTES_PER_TOKEN = 64
REQUEST_SLACK_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one client may take of ``selfattn serve``'s memory and connections (the HTTP
    server's knobs; the engine's are :class:`EngineConfig`'s). Each limit answers the request
    it refuses with OpenAI's error JSON (docs/serving.md, "Limits")."""

    # Bytes of one request body; None: max_model_len * REQUEST_BYTES_PER_TOKEN +
    # REQUEST_SLACK_BYTES (request_bytes). Checked on Content-Length, then counted as a body
    # streams in: 413 before the rest is read.
    max_request_bytes: int | None = None
    # Open connections at once (uvicorn's limit_concurrency: 503 beyond it). Every waiting or
    # running request holds one, so this also bounds what clients can queue over HTTP.
    max_connections: int = 1024
    # Engine steps' outputs a stream may hold for a client that does not read them; beyond it,
    # while the stream's writer waits on the client's socket, the stream is dropped (its
    # requests aborted, their pages freed). A client reading at any pace drains one output per
    # step, so only one that stopped reading falls this far behind.
    max_stream_backlog: int = 256
    # Seconds a SIGTERM (or Ctrl-C) waits for running requests to finish before cutting them;
    # requests arriving meanwhile get 503, and a second signal exits at once.
    drain_timeout: int = 30

    def __post_init__(self):
        if self.max_request_bytes is not None:
            _positive("max_request_bytes", self.max_request_bytes, "ServerLimits")
        _positive("max_connections", self.max_connections, "ServerLimits")
        _positive("max_stream_backlog", self.max_stream_backlog, "ServerLimits")
        _positive("drain_timeout", self.drain_timeout, "ServerLimits")

    def request_bytes(self, max_model_len: int | None) -> int:
        """The body limit in bytes: ``max_request_bytes``, else derived from ``max_model_len``
        (None, a server without an engine: the slack alone)."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return (max_model_len or 0) * REQUEST_BYTES_PER_TOKEN + REQUEST_SLACK_BYTES


# The defaults under the names the engine module has always exported (one statement: the fields).
DEFAULT_KV_CACHE_BYTES = EngineConfig.kv_cache_bytes
DEFAULT_PAGE_SIZE = EngineConfig.page_size
DEFAULT_MAX_BATCH_TOKENS = EngineConfig.max_batch_tokens
DEFAULT_MAX_NUM_SEQS = EngineConfig.max_num_seqs
DEFAULT_MAX_WAITING = EngineConfig.max_waiting


def kv_cache_bytes_from_memory(
    fraction: float = KV_MEMORY_FRACTION, cap: int = KV_MEMORY_CAP
) -> int:
    """A KV pool size for this machine: ``fraction`` of ``MemAvailable`` (/proc/meminfo), at most
    ``cap`` bytes; :data:`DEFAULT_KV_CACHE_BYTES` where the file is missing (not Linux)."""
    from selfattn.cache.memory import memory_available_bytes

    available = memory_available_bytes()
    if available is None:
        return DEFAULT_KV_CACHE_BYTES
    return max(min(int(available * fraction), cap), 1 << 20)
