"""The serving engine: many requests at once over one paged KV cache, one model forward per step.

::

    engine = Engine(model, tokenizer, kv_cache_bytes=2**30)
    outs = engine.generate(["Hello", "The capital of"], SamplingParams(max_tokens=32))

    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0))   # the loop, by hand
    while engine.has_unfinished():
        for out in engine.step(): ...

    async for out in engine.stream("Hi", SamplingParams(max_tokens=8)):  # asyncio
        print(out.outputs[0].delta_text, end="")

A step (:meth:`Engine.step`) takes new requests and aborts, asks the
:class:`~selfattn.serving.scheduler.Scheduler` for a batch (decode tokens and prefill chunks under
a token budget), runs the model ONCE over all of its tokens packed into one row
(:meth:`~selfattn.cache.PagedKV.plan_packed`: each token attends over its own sequence's pages),
keeps the logits of each sequence's last token only, and lets each sequence choose its next
token (:func:`~selfattn.serving.sampling.choose`); finished sequences free their pages. Greedy
output equals :func:`selfattn.models.generate` of each request alone. A request with
``prompt_logprobs`` also keeps the logits of every prompt row its prefill chunks compute (the
LM head over those rows only) and scores the next prompt token at each.

Pool: ``kv_cache_bytes`` buys ``kv_cache_bytes // page_bytes`` pages, ``page_bytes`` from the
textbook's formula (:func:`selfattn.cache.kv_cache_bytes` of one page:
``2 × layers × kv_heads × head_dim × page_size × bytes(kv_dtype)``, plus int8's scales).
``kv_dtype`` int8 or float8_e4m3fn stores quantised pages (:mod:`selfattn.cache.quant`).

Knobs: one :class:`~selfattn.serving.config.EngineConfig` (``Engine(model, config=...)``, or its
fields as keywords).

Threads: one :class:`~selfattn.serving.loop.EngineLoop` (``engine.loop``) steps the engine for
:meth:`generate` (on the caller's thread), :meth:`stream` and the HTTP server (on its own thread
while they have work); :meth:`add_request` and :meth:`abort` may be called from any thread (they
queue, and the next step takes them), :meth:`step` from one thread at a time.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as SequenceABC

import torch

from selfattn.cache import PagedKV
from selfattn.cache.paged.kivi import KIVIPagedKV, kivi_bits, kivi_page_bytes
from selfattn.cache.size import kv_cache_bytes as _kv_bytes
from selfattn.kernels.determinism import deterministic
from selfattn.models.decoder import CausalLM
from selfattn.models.generate import stop_token_ids
from selfattn.serving.config import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_WAITING,
    DEFAULT_PAGE_SIZE,
    EngineConfig,
    kv_cache_bytes_from_memory,
)
from selfattn.serving.kv_compression import PromptCompression
from selfattn.serving.kv_eviction import DecodeEviction
from selfattn.serving.loop import EngineLoop
from selfattn.serving.metrics import EngineMetrics
from selfattn.serving.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    Sequence,
    TokenLogprob,
)
from selfattn.serving.sampling import Choice, SamplingParams, choose, token_logprobs
from selfattn.serving.scheduler import Batch, Scheduler
from selfattn.serving.speculative import Speculator
from selfattn.serving.structured import DEAD_END, Grammars

__all__ = [
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_MAX_BATCH_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_MAX_WAITING",
    "DEFAULT_PAGE_SIZE",
    "Engine",
    "EngineConfig",
    "QueueFull",
    "kv_cache_bytes_from_memory",
]

log = logging.getLogger("selfattn")


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_waiting``: retry later (a server answers 429/503)."""


class Engine:
    """Continuous batching over ``model`` (a :class:`~selfattn.models.CausalLM`: GPT-2, Llama,
    Mistral, Qwen2, Gemma-2) on its device and dtype; see the module docstring.

    Args:
        tokenizer: anything with ``encode(text) -> ids`` and ``decode(ids) -> text``; needed for
            text prompts, outputs' ``text`` and stop strings. Token-id prompts never need one.
        config: the engine's knobs (:class:`~selfattn.serving.config.EngineConfig`: pool size,
            page size, KV dtype, token budget, running set, waiting queue, prefix caching,
            ``max_model_len``, seed); ``**knobs``: its fields as keywords, over ``config``.
            :meth:`add_request` raises :class:`QueueFull` beyond ``max_waiting``.
    """

    # why this kind of engine runs no KV compression (None: it does)
    compression_refused: str | None = None

    def __init__(
        self,
        model: CausalLM,
        tokenizer=None,
        *,
        config: EngineConfig | None = None,
        **knobs,
    ):
        if not isinstance(model, CausalLM):
            raise TypeError(
                f"Engine serves selfattn's decoder LMs (selfattn.models.from_pretrained of a "
                f"GPT-2, Llama, Mistral, Qwen2 or Gemma-2 folder), got {type(model).__name__}"
            )
        for name in ("encode", "decode"):
            if tokenizer is not None and not callable(getattr(tokenizer, name, None)):
                raise TypeError(f"tokenizer must have an {name}() method, got {tokenizer!r}")
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = cfg = (config or EngineConfig()).replace(**knobs)
        c = model.config
        w = model.norm.weight  # dense in every model (a quantised LM head has no .weight)
        kivi = cfg.kv_dtype if isinstance(cfg.kv_dtype, str) else None
        kv_dtype = w.dtype if cfg.kv_dtype is None or kivi else cfg.kv_dtype
        page_size = cfg.page_size
        if kivi:
            page_bytes = kivi_page_bytes(c.n_layers, c.n_kv_heads, c.head_dim, page_size, kivi,
                                         kv_dtype)  # fmt: skip
        else:
            page_bytes = _kv_bytes(c.n_layers, c.n_kv_heads, c.head_dim, page_size, kv_dtype)
        num_pages = cfg.kv_cache_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(
                f"kv_cache_bytes={cfg.kv_cache_bytes} holds no page: one page of {page_size} "
                f"tokens takes {page_bytes} bytes for this model in {kv_dtype}; give more bytes"
            )
        limit = min(c.max_positions, num_pages * page_size)
        if cfg.max_model_len is not None:
            limit = min(limit, cfg.max_model_len)
        self.max_model_len = limit
        self.model, self.tokenizer = model, tokenizer
        pool = {
            "max_seqs": cfg.max_num_seqs,
            "max_pages_per_seq": -(-limit // page_size),
            "prefix_caching": cfg.prefix_caching,
            "dtype": kv_dtype,
            "device": w.device,
        }
        if kivi:
            self.kv = KIVIPagedKV(c.n_layers, num_pages, page_size, c.n_kv_heads, c.head_dim,
                                  bits=kivi_bits(kivi), **pool)  # fmt: skip
        else:
            self.kv = PagedKV(c.n_layers, num_pages, page_size, c.n_kv_heads, c.head_dim,
                              **pool)  # fmt: skip
        self.scheduler = Scheduler(
            self.kv, max_batch_tokens=cfg.max_batch_tokens, max_num_seqs=cfg.max_num_seqs,
            lookahead=cfg.num_speculative_tokens if cfg.speculative else 0,
        )  # fmt: skip
        self.speculator = None
        if cfg.speculative is not None:
            self.speculator = Speculator(cfg, model, num_pages=num_pages, max_len=limit)
        self.max_waiting = cfg.max_waiting
        # the model's and the tokenizer's stop tokens (end of turn included); ignore_eos skips
        self._eos = frozenset(stop_token_ids(model, tokenizer))
        # structured output: the grammar engine's tokenizer and compiled guides, built at the
        # first guided request; the guided rows' masks are filled on a worker thread while
        # the forward runs (the grammar engine releases the GIL)
        self.grammars = Grammars(tokenizer, c.vocab_size, self._eos)
        self._mask_worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._rng = random.Random(cfg.seed)
        self._order = itertools.count()
        self._inbox: collections.deque[Request] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()
        refused = self.compression_refused
        if kivi and refused is None:
            refused = (
                f"this engine's pool is kv_dtype={kivi!r}: its pages are KIVI-quantised "
                "already, and presses evict tokens from plain pages; serve with a float "
                "--kv-dtype to run presses"
            )
        self.compression = PromptCompression(model, self.kv, cfg.kv_compression,
                                             refused=refused)  # fmt: skip
        if refused is None and self.speculator is not None:
            refused = "a speculative engine verifies several rows a sequence; serve without it"
        self.eviction = DecodeEviction(self.kv, refused)
        self.eviction.check(self.compression.default)
        self.metrics = EngineMetrics(pool_bytes=self.kv.nbytes, pages_free=num_pages)
        self.loop = EngineLoop(self)  # steps this engine for generate, stream and a server

    @classmethod
    def from_pretrained(cls, folder, tokenizer=None, **engine_kw) -> Engine:
        """An engine over ``selfattn.models.from_pretrained(folder)`` in eval mode."""
        from selfattn.models import from_pretrained

        return cls(from_pretrained(folder).eval(), tokenizer, **engine_kw)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        sink: Callable[[RequestOutput], None] | None = None,
        hooks=None,
    ) -> str:
        """Queue a request; returns its id (``request_id`` or a fresh one).

        ``prompt``: text (needs the tokenizer) or token ids (a list or a 1-D tensor). Raises
        ValueError / TypeError for a bad prompt or parameters (an empty prompt, ids outside the
        vocabulary, prompt + ``max_tokens`` beyond ``max_model_len``, stop strings without a
        tokenizer, a repeated id) and :class:`QueueFull` when ``max_waiting`` requests wait.
        ``sink(output)`` receives each of its outputs as :meth:`step` makes them (on the
        stepping thread). ``hooks``: a :class:`selfattn.inspect.RequestHooks` capturing and
        editing this request's activations (one sample; its ``cache`` fills as it runs).
        """
        arrival = time.perf_counter()  # a guide's compile counts in its time to first token
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        ids = self._prompt_ids(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt's {len(ids)} tokens plus max_tokens={params.max_tokens} exceed "
                f"the engine's max_model_len={self.max_model_len}; shorten the prompt or lower "
                "max_tokens"
            )
        if params.samples > self.scheduler.max_num_seqs:
            name = "n" if params.best_of is None else "best_of"
            raise ValueError(
                f"{name}={params.samples} samples need {params.samples} sequences at once but "
                f"the engine runs at most max_num_seqs={self.scheduler.max_num_seqs}; lower {name}"
            )
        params.check_vocab(self.model.config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop strings {list(params.stop)} need a tokenizer; build the Engine with one "
                "or use stop_token_ids"
            )
        if request_id is None:
            request_id = f"req-{next(self._order)}-{self._rng.getrandbits(32):08x}"
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pick another")
        waiting = self.num_waiting()
        if waiting >= self.max_waiting:
            raise QueueFull(
                f"{waiting} requests are waiting (max_waiting={self.max_waiting}); retry when "
                "running requests finish, or build the Engine with a larger max_waiting"
            )
        if hooks is not None:
            self._check_hooks(hooks, params)
        compression = self.compression.resolve(params)
        self.eviction.check(compression)
        matcher = None if params.guide is None else self._matcher(params.guide)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Request(request_id, text, ids, params, next(self._order), arrival, seed,
                      sink=sink, compression=compression)  # fmt: skip
        req.seqs[0].matcher = matcher
        req.hooks = hooks
        self._requests[request_id] = req
        self._inbox.append(req)
        return request_id

    def _check_hooks(self, hooks, params: SamplingParams) -> None:
        from selfattn.inspect import RequestHooks

        if not isinstance(hooks, RequestHooks):
            raise TypeError(f"hooks must be a selfattn.inspect.RequestHooks, got {hooks!r}")
        if params.samples > 1:
            raise ValueError(
                f"hooks follow one sequence; this request samples {params.samples} (n / best_of)"
                ": ask for one, or add one request per sample"
            )
        if self.speculator is not None:
            raise ValueError(
                "hooks see each step's rows, and a speculative engine's steps verify drafts "
                "that may be rolled back: use an Engine without speculation"
            )
        if params.kv_compression is not None or self.compression.default is not None:
            spec = self.compression.resolve(params)
            if spec is not None:
                raise ValueError(
                    f"hooks and kv_compression {spec.name!r} on one request: compression "
                    "records the prompt's attention inputs with hooks of its own; pass "
                    'kv_compression="none"'
                )
        hooks.bind(self.model)

    def _matcher(self, guide):
        """A matcher at the start of ``guide`` (structured output); a guide the grammar engine
        refuses raises :class:`~selfattn.serving.structured.GuideError` (a ValueError)."""
        if self.tokenizer is None:
            raise ValueError(
                f"a {guide.kind} guide needs the tokenizer (the grammar is spelled in its "
                "tokens); build the Engine with one"
            )
        return self.grammars.matcher(guide)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "a text prompt needs a tokenizer: build the Engine with one, or pass token ids"
                )
            ids = self.tokenizer.encode(prompt)
            ids = getattr(ids, "ids", ids)  # a tokenizers.Encoding
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point():
                raise ValueError(f"a tensor prompt must be 1-D token ids, got {prompt.dtype} "
                                 f"{tuple(prompt.shape)}")  # fmt: skip
            ids = prompt.tolist()
        else:
            ids = prompt
        try:
            ids = list(ids)
        except TypeError:
            raise TypeError(
                f"a prompt is text or a list of token ids, got {type(prompt).__name__}"
            ) from None
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        V = self.model.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                raise ValueError(
                    f"prompt token ids must be ints in 0..{V - 1} (the vocabulary), got {t!r}"
                )
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are freed and its final output (``finish_reason
        "abort"``) comes out of the next :meth:`step`. Unknown or finished ids are ignored."""
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or bool(self._requests)

    def num_waiting(self) -> int:
        """Sequences waiting for admission, and requests added since the last step."""
        return len(self.scheduler.waiting) + len(self._inbox)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step (module docstring); returns the outputs of the requests it changed."""
        with self._lock:
            touched: dict[int, Request] = {}
            self._take_inbox(touched)
            batch = self.scheduler.schedule()
            for req in batch.first_admitted:
                self.metrics.prompt_tokens += len(req.prompt_ids)
                self.metrics.cached_prompt_tokens += req.cached_tokens
            if batch.chunks:
                try:
                    with deterministic(self.config.deterministic):
                        self._run(batch, touched)
                except Exception as e:  # the batch fails, the engine goes on
                    log.exception("selfattn.serving: a step failed; its requests end with it")
                    for seq, _ in batch.chunks:
                        self._fail(seq.request, e, touched)
            if self.speculator is not None:
                self.speculator.forget(self.scheduler.running)
            self.metrics.preemptions = self.scheduler.num_preemptions
            self.metrics.computed_tokens = self.scheduler.computed_tokens
            self.metrics.prefill_tokens = self.scheduler.prefill_tokens
            return self._outputs(touched)

    def _take_inbox(self, touched: dict[int, Request]) -> None:
        while self._inbox:
            req = self._inbox.popleft()
            if req.finished:  # aborted before it was taken
                continue
            self.scheduler.add(req.seqs[0])
        while self._aborts:
            req = self._requests.get(self._aborts.popleft())
            if req is None or req.finished:
                continue
            self._end(req, "abort")
            self.metrics.requests_aborted += 1
            touched[id(req)] = req

    def _end(self, req: Request, reason: str) -> None:
        """Finish every unfinished sequence of ``req`` with ``reason`` (abort, error)."""
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        if not req.forked:  # the n - 1 samples it never forked end too
            n = req.params.samples
            req.seqs += [Sequence(req, i, list(req.prompt_ids)) for i in range(1, n)]
            for seq in req.seqs[1:]:
                seq.finish_reason = reason
            req.forked = True

    def _fail(self, req: Request, error: BaseException, touched) -> None:
        if not req.finished:
            req.error = error
            self._end(req, "error")
            touched[id(req)] = req

    def _run(self, batch: Batch, touched: dict[int, Request]) -> None:
        """One forward over the batch's packed tokens, then every sampling sequence's token."""
        ids, counts, flat, keep, samplers, at = [], [], [], [], [], []
        drafts = self._drafts(batch) if self.speculator is not None else {}
        spec_keep, spec = [], []  # the drafted chunks' rows; (sequence, draft, q)
        prompt_keep, scoring = [], []  # prompt rows kept for prompt logprobs; (request, lo, hi)
        for seq, n in batch.chunks:
            ids.append(seq.kv_id)
            counts.append(n)
            if id(seq) in drafts:  # its last token and the drafts, every row's logits kept
                draft, q = drafts[id(seq)]
                flat += [seq.tokens[-1], *draft]
                spec_keep += range(len(flat) - n, len(flat))
                spec.append((seq, draft, q))
                continue
            flat += seq.tokens[seq.num_computed : seq.num_computed + n]
            at.append((seq, n, len(flat) - n))
            if seq.request.scoring_prompt:
                self._prompt_rows(seq, n, len(flat) - n, prompt_keep, scoring)
            if seq.num_computed + n == len(seq.tokens):  # the chunk ends the known tokens
                keep.append(len(flat) - 1)
                samplers.append(seq)
        device = self.kv.k_store.device
        masks = self._start_masks(samplers)
        step = self.kv.plan_packed(ids, counts)
        evicting = self.eviction.rows(at)
        self.eviction.ask(step.layers[0].plan, evicting)
        m = self.metrics
        m.peak_pages_used = max(m.peak_pages_used, self.kv.pool.num_used)  # pages are taken now
        try:
            x = torch.tensor(flat, dtype=torch.long, device=device).view(1, -1)  # (1, T)
            rows = torch.tensor(keep + spec_keep + prompt_keep, dtype=torch.long, device=device)
            with self.compression.recording(self.compression.window_rows(at)), self._hooked(at):
                logits = self._forward(x, step, rows)
        except BaseException:
            self._undo(step)
            raise
        if scoring:
            self._score_prompts(scoring, logits[len(keep) + len(spec_keep) :])
        bits = None if masks is None else masks.result()  # before forks copy the matchers
        if spec:
            self.scheduler.advance(Batch([c for c in batch.chunks if id(c[0]) not in drafts]))
            self._settle(spec, logits[len(keep) :], touched)
        else:
            self.scheduler.advance(batch)
        for seq, _, _ in at:  # a prompt just computed: compressed before its samples fork
            if self.compression.due(seq):
                self._compress(seq)
        for policy, done in self.eviction.update(evicting, step.layers[0].plan):
            self.metrics.record_decode_eviction(policy, done)
        # The prompt's last logits choose the first token of every sample: fork the rest now.
        seqs, rows = [], []
        for r, seq in enumerate(samplers):
            req = seq.request
            if req.params.max_tokens == 0:  # the prompt only (scored): no sample
                self._end(req, "length")
                self.metrics.requests_finished += 1
                touched[id(req)] = req
                continue
            if not req.forked:
                for i in range(1, req.params.samples):
                    req.seqs.append(self.scheduler.fork(seq, i))
                req.forked = True
                group = req.seqs
            else:
                group = [seq]
            seqs += group
            rows += [r] * len(group)
        if bits is not None:
            seqs, rows, masks = self._guided_rows(samplers, bits, seqs, rows, touched)
        choices = choose(logits[rows], seqs, masks) if seqs else []
        now = time.perf_counter()
        for seq, choice in zip(seqs, choices):
            self._append(seq, choice, now)
            touched[id(seq.request)] = seq.request
        self.metrics.record_tokens(len(choices), now)

    @contextlib.contextmanager
    def _hooked(self, at: list):
        """The hooks of the step's requests that have them, each on its own rows."""
        with contextlib.ExitStack() as stack:
            for seq, n, start in at:
                h = seq.request.hooks
                if h is not None:
                    stack.enter_context(h.on_rows(self.model, slice(start, start + n),
                                                  restart=seq.num_computed == 0))  # fmt: skip
            yield

    def _compress(self, seq: Sequence) -> None:
        """Compress ``seq``'s prompt KV (:mod:`selfattn.serving.kv_compression`) and count it;
        a pool too short for the copies of shared pages leaves the prompt whole (logged)."""
        name = seq.request.compression.name
        try:
            done = self.compression.compress(seq)
        except RuntimeError as e:
            log.warning("selfattn.serving: %s left a prompt uncompressed: %s", name, e)
            done = None
        self.metrics.record_compression(name, done)

    @staticmethod
    def _prompt_rows(seq: Sequence, n: int, at: int, keep: list, scoring: list) -> None:
        """The rows of ``seq``'s chunk of ``n`` tokens (from row ``at`` of the step) whose
        logits score a prompt token not scored yet: position ``p``'s scores token ``p + 1``."""
        req, start = seq.request, seq.num_computed
        lo = max(start, len(req.prompt_logprobs) - 1)
        hi = min(start + n, len(req.prompt_ids) - 1)
        if lo < hi:
            keep += range(at + lo - start, at + hi - start)
            scoring.append((req, lo, hi))

    @staticmethod
    def _score_prompts(scoring: list, logits: torch.Tensor) -> None:
        """Append the prompt logprobs of ``scoring`` (``(request, lo, hi)``: positions ``lo ..
        hi - 1``, their rows of ``logits`` in order); a whole prompt's become a tuple."""
        targets = [t for req, lo, hi in scoring for t in req.prompt_ids[lo + 1 : hi + 1]]
        k = max(req.params.prompt_logprobs for req, _, _ in scoring)
        picks = token_logprobs(logits, torch.tensor(targets, device=logits.device), k)
        at = 0
        for req, lo, hi in scoring:
            k = req.params.prompt_logprobs
            req.prompt_logprobs += [TokenLogprob(c.token, c.logprob, c.top[:k], c.rank)
                                    for c in picks[at : at + hi - lo]]  # fmt: skip
            at += hi - lo
            if len(req.prompt_logprobs) == len(req.prompt_ids):
                req.prompt_logprobs = tuple(req.prompt_logprobs)

    def _start_masks(self, samplers) -> concurrent.futures.Future | None:
        """The guided samplers' next-token bitmasks, filled on the mask worker (structured
        output) while the caller runs the forward; None when no sampler is guided."""
        guided = [s.matcher for s in samplers if s.matcher is not None]
        if not guided:
            return None
        if self._mask_worker is None:
            self._mask_worker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="selfattn-guide-masks"
            )
        return self._mask_worker.submit(self.grammars.fill_bitmasks, guided)

    def _guided_rows(self, samplers, bits, seqs, rows, touched):
        """The sampling sequences and their logits rows without those whose guide allows no
        token (finished: ``DEAD_END``), and choose's ``masks``: each guided sequence's row
        (after its sampler's forks) and its sampler's bitmask ``bits (G, words)``."""
        g_of, alive = {}, []  # sampler row -> its bitmask row; whether the guide goes on
        for r, seq in enumerate(samplers):
            if seq.matcher is not None:
                g_of[r] = len(alive)
                alive.append(not seq.matcher.is_error())  # stuck: it allows only the EOS
        alive = [a and any_ for a, any_ in zip(alive, bits.ne(0).any(-1).tolist())]
        keep, mask_rows, mask_of = [], [], []
        for j, (seq, r) in enumerate(zip(seqs, rows)):
            if r in g_of and not alive[g_of[r]]:
                self._finish(seq, "stop", DEAD_END)
                touched[id(seq.request)] = seq.request
                continue
            if r in g_of:
                mask_rows.append(len(keep))
                mask_of.append(g_of[r])
            keep.append(j)
        seqs, rows = [seqs[j] for j in keep], [rows[j] for j in keep]
        if not mask_rows:
            return seqs, rows, None
        return seqs, rows, (torch.tensor(mask_rows), bits[mask_of])

    def _drafts(self, batch: Batch) -> dict[int, tuple[list[int], object]]:
        """Drafts for the batch's decoding chunks with room for them (the scheduler's lookahead),
        each chunk shrunk to its last token and its draft: ``id(seq) -> (draft, q)`` for the
        sequences with a non-empty draft (the others decode one token as usual)."""
        picked = [(i, seq, n - 1) for i, (seq, n) in enumerate(batch.chunks)
                  if n > 1 and seq.remaining == 1]  # fmt: skip
        if not picked:
            return {}
        seqs = [seq for _, seq, _ in picked]
        drafts, qs = self.speculator.propose(seqs, [r for *_, r in picked], self.scheduler.running)
        out = {}
        for (i, seq, _), draft, q in zip(picked, drafts, qs):
            batch.chunks[i] = (seq, 1 + len(draft))
            if draft:
                out[id(seq)] = (draft, q)
        return out

    def _settle(self, spec, logits: torch.Tensor, touched: dict[int, Request]) -> None:
        """The verdict on each drafted chunk (``spec``: ``(sequence, draft, q)``; ``logits``
        their rows in order): the cache keeps the accepted drafts, then the accepted tokens
        and the next one are appended up to a stop."""
        m, at, emitted_all, now = self.metrics, 0, 0, time.perf_counter()
        for seq, draft, q in spec:
            n = 1 + len(draft)
            emitted = self.speculator.verify(seq, logits[at : at + n], draft, q)
            at += n
            self.scheduler.settle(seq, n, len(emitted), emitted[:-1])
            self.speculator.rollback(seq, seq.num_computed)
            m.spec_draft_tokens += len(draft)
            m.spec_accepted_tokens += len(emitted) - 1
            for tok in emitted:
                self._append(seq, Choice(tok), now)
                emitted_all += 1
                if seq.finished:
                    break
            touched[id(seq.request)] = seq.request
        m.record_tokens(emitted_all, now)

    def _forward(self, x: torch.Tensor, step, rows: torch.Tensor) -> torch.Tensor:
        """The model over a planned packed step: ``x (1, T)`` token ids -> the logits ``(R,
        vocab)`` of the tokens ``rows`` lists (a tensor-parallel engine runs its peers here)."""
        with torch.no_grad():
            return self.model(x, cache=step, logits_to_keep=rows)[0]

    def _undo(self, step) -> None:
        with contextlib.suppress(RuntimeError):  # a layer undid it before raising
            self.kv.undo(step.layers[0].plan)

    def _append(self, seq: Sequence, choice: Choice, now: float) -> None:
        """Add the chosen token to ``seq``; finish it on a stop token, stop string or length."""
        tok, p, req = choice.token, seq.params, seq.request
        seq.tokens.append(tok)
        if choice.logprob is not None:
            seq.cumulative_logprob += choice.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(TokenLogprob(tok, choice.logprob, choice.top, choice.rank))
        if seq.last_token_time is None:
            self.metrics.ttft.observe(now - req.arrival_time)
            if req.first_token_time is None:
                req.first_token_time = now
        else:
            self.metrics.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self._eos)
        # a guided sequence ends where its grammar admits nothing more
        complete = dead = False
        if seq.matcher is not None:
            dead = not seq.matcher.consume_token(tok)  # the grammar engine misjudged its mask
            complete = dead or seq.matcher.is_stopped()
        n_out = len(seq.tokens) - seq.num_prompt
        length = n_out >= p.max_tokens or len(seq.tokens) >= self.max_model_len
        if self.tokenizer is not None:
            new = seq.detokenize(self.tokenizer, n_out - stop_token,
                                 stop_token or length or complete)  # fmt: skip
            if p.stop and not stop_token and new:
                # Only a stop string ending in the new text can be new: search from the
                # longest stop string's length before it (the rest was searched before).
                start = max(len(seq.text) - len(new) - max(map(len, p.stop)) + 1, 0)
                hits = [(i, s) for s in p.stop if (i := seq.text.find(s, start)) >= 0]
                if hits:
                    at, s = min(hits)
                    seq.text = seq.text[:at]
                    return self._finish(seq, "stop", s)
        if stop_token:
            return self._finish(seq, "stop", tok)
        if complete:
            return self._finish(seq, "stop", DEAD_END if dead else None)
        if length:
            return self._finish(seq, "length", None)
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        if seq.request.finished:
            self.metrics.requests_finished += 1

    def _outputs(self, touched: dict[int, Request]) -> list[RequestOutput]:
        outs = []
        for req in touched.values():
            if req.params.ranked and not req.finished:
                continue  # best_of: one output, at the end, of the n best samples
            hold = max((len(s) for s in req.params.stop), default=1) - 1
            samples = tuple(s.output(self.tokenizer, hold) for s in req.seqs)
            scored = req.prompt_logprobs
            out = RequestOutput(
                request_id=req.request_id,
                prompt=req.prompt,
                prompt_token_ids=tuple(req.prompt_ids),
                outputs=_best(samples, req.params.n) if req.params.ranked else samples,
                finished=req.finished,
                cached_tokens=req.cached_tokens or 0,
                arrival_time=req.arrival_time,
                first_token_time=req.first_token_time,
                error=req.error,
                prompt_logprobs=scored if isinstance(scored, tuple) else None,
            )
            if out.finished:
                self._requests.pop(req.request_id, None)
            if req.sink is not None:
                try:
                    req.sink(out)
                except Exception:  # the consumer is gone (its event loop closed): stop it
                    req.sink = None
                    if not out.finished:
                        self.abort(req.request_id)
            outs.append(out)
        m, s, pool = self.metrics, self.scheduler, self.kv.pool
        m.running = len({id(q.request) for q in s.running})
        m.waiting = len({id(q.request) for q in s.waiting}) + len(self._inbox)
        m.pages_used, m.pages_free = pool.num_used, pool.num_free
        m.pages_cached = 0 if self.kv.index is None else self.kv.index.num_cached_pages
        return outs

    # -- offline ----------------------------------------------------------------------------------
    def generate(
        self, prompts, params: SamplingParams | SequenceABC[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run ``prompts`` (one prompt, or a list of texts / token-id lists) to completion;
        returns their final outputs in order. ``params``: one for all, or one per prompt. The
        steps run on this thread (:meth:`EngineLoop.run_until`)."""
        self._refuse_a_second_stepper()
        pending = _prompts_and_params(prompts, params)
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}

        def sink(out: RequestOutput) -> None:
            if out.finished:
                done[out.request_id] = out

        at = 0
        while at < len(pending) or len(done) < len(ids):
            while at < len(pending) and self.num_waiting() < self.max_waiting:
                try:
                    ids.append(self.loop.add(*pending[at], sink=sink))
                except (ValueError, TypeError):  # a bad prompt: the others do not run either
                    for rid in ids:
                        self.abort(rid)
                    self.loop.run_until(lambda: not self.has_unfinished())
                    raise
                at += 1
            self.loop.cycle()
        for out in done.values():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed") from out.error
        return [done[i] for i in ids]

    def _refuse_a_second_stepper(self) -> None:
        if self.loop.held:
            raise RuntimeError(
                "generate() cannot run while a server worker steps this engine (two threads "
                "would step it at once); send the prompts to the server, or give generate() "
                "an Engine of its own"
            )
        if self.loop.alive and self.has_unfinished():
            raise RuntimeError(
                "generate() cannot run while stream() requests are being served; await them, "
                "or use stream()"
            )

    # -- asyncio --------------------------------------------------------------------------------
    async def stream(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs as steps make them (the last has ``finished``).

        Steps run on the loop's thread while any request is open. Leaving the ``async for``
        early (``break``, cancellation, a client gone) aborts the request: its pages are freed
        at the next step. A failed request raises its error here.
        """
        queue: asyncio.Queue = asyncio.Queue()
        rid = self.loop.submit(prompt, params, request_id, asyncio.get_running_loop(), queue)
        finished = False
        try:
            while not finished:
                _, out = await queue.get()
                finished = out.finished
                if out.error is not None:
                    raise RuntimeError(f"request {rid} failed") from out.error
                yield out
        finally:
            if not finished:
                self.loop.abort(rid)

    def fail_open(self, error: BaseException) -> None:
        """After :meth:`step` itself raised (not a batch: those end their own requests): end
        every open request with ``error``, so that no stream waits forever; its sink hears it."""
        log.exception("selfattn.serving: the engine step failed; failing open requests")
        with self._lock:
            touched: dict[int, Request] = {}
            self._inbox.clear()
            for req in list(self._requests.values()):
                self._fail(req, error, touched)
            self._outputs(touched)

    def close(self) -> None:
        """Drain the loop (its thread finishes the open requests, aborting those whose event
        loop closed, and ends), then apply the aborts that no step took yet: their pages are
        freed."""
        self.loop.stop()
        if self._aborts:
            self.step()
        if self._mask_worker is not None:
            self._mask_worker.shutdown()

    def check(self) -> None:
        """Raise AssertionError unless the pool and the scheduler agree (no page leaked: with
        nothing running, every page is free or held by the prefix cache alone; a draft model's
        pool holds the running sequences only)."""
        with self._lock:
            self.scheduler.check()
            if self.speculator is not None:
                self.speculator.check(self.scheduler.running)

    def _kv_dtype_name(self):
        """The pool's storage as configured: a KIVI name, else the pages' dtype."""
        kind = self.config.kv_dtype
        return kind if isinstance(kind, str) else self.kv.k_store.dtype

    def __repr__(self) -> str:
        return (
            f"Engine({type(self.model).__name__}, pages={self.kv.num_pages}x"
            f"{self.kv.page_size}, kv_dtype={self._kv_dtype_name()}, "
            f"max_batch_tokens={self.scheduler.max_batch_tokens}, "
            f"max_num_seqs={self.scheduler.max_num_seqs})"
        )


def _best(samples: tuple[CompletionOutput, ...], n: int) -> tuple[CompletionOutput, ...]:
    """The ``n`` samples of highest cumulative log-probability, best first, indexed 0 .. n-1."""
    ranked = sorted(samples, key=lambda c: -c.cumulative_logprob)[:n]
    return tuple(dataclasses.replace(c, index=i) for i, c in enumerate(ranked))


def _prompts_and_params(prompts, params) -> list[tuple]:
    """:meth:`Engine.generate`'s arguments -> ``[(prompt, SamplingParams | None)]``."""
    one = isinstance(prompts, (str, torch.Tensor)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    )
    prompts = [prompts] if one else list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    return list(zip(prompts, params))
