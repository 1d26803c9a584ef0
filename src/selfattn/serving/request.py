"""A request's state in the engine, and what the engine reports about it.

A :class:`Request` (one prompt, one :class:`~selfattn.serving.sampling.SamplingParams`) owns
``n`` :class:`Sequence` s. Until its prompt is computed it has one; then ``n - 1`` more are
forked from it, sharing the prompt's pages (copy-on-write), and each continues on its own::

    waiting ──admit──> running ──(last token of the prompt computed)──> sample, fork n - 1
       ^                  │                                              │
       └────preempt───────┘   (pages freed; recomputed when readmitted)  └─> finished

A sequence's ``tokens`` are its prompt followed by its output; ``num_computed`` of them have
K/V in the cache. A step computes the next ``tokens[num_computed:]`` chunk; when that reaches
the end, the step's logits pick the next token. Preemption sets ``num_computed`` back to 0 (its
pages freed, the full ones left in the prefix cache) and readmission recomputes them, so a
resumed sequence continues exactly where it stopped.

:class:`RequestOutput` is what :meth:`Engine.step`, :meth:`Engine.generate` and
:meth:`Engine.stream` hand out: each :class:`CompletionOutput` holds the sample's tokens and
text so far plus what is new since the request's previous output (``delta_*``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from selfattn._log import log_once
from selfattn.serving.sampling import SamplingParams

__all__ = ["CompletionOutput", "Request", "RequestOutput", "Sequence", "TokenLogprob"]

# Prompt tokens decoded before a sample's first ones, for their context (vLLM's 5): a tokenizer
# that spaces or merges by neighbours then spells the sample's start as it does mid-text.
PROMPT_CONTEXT = 5


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of a chosen (or prompt) ``token``, of the most likely tokens at its
    position (``top``: ``(token, logprob)``, most likely first) and the token's ``rank`` there
    (1: the most likely)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """Sample ``index`` of a request: ``token_ids`` and ``text`` (None without a tokenizer) so
    far, ``logprobs`` (None unless asked), ``finish_reason`` (None while running; ``"stop"``,
    ``"length"``, ``"abort"`` or ``"error"``) and ``stop_reason`` (the stop string or token id
    that ended it). ``delta_token_ids`` / ``delta_text``: new since the previous output.
    ``cumulative_logprob``: the sum of its tokens' log-probabilities (None unless logprobs
    or ``best_of`` asked for them)."""

    index: int
    token_ids: tuple[int, ...]
    text: str | None
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    stop_reason: str | int | None
    delta_token_ids: tuple[int, ...]
    delta_text: str | None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """One request's state: its ``outputs`` (one per sample), ``finished`` when all are,
    ``prompt_token_ids``, ``cached_tokens`` (prompt tokens served from the prefix cache at
    admission), ``error`` (the exception that ended it, if one did) and times in seconds
    (``time.perf_counter``): ``arrival_time``, ``first_token_time``. ``prompt_logprobs``
    (asked by ``SamplingParams.prompt_logprobs``): one entry per prompt token, None for the
    first (nothing precedes it), then each token's :class:`TokenLogprob` (vLLM's layout)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    error: BaseException | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(eq=False)
class Request:
    """A prompt and its parameters; ``seqs`` its sequences (one until the prompt is computed)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    order: int  # admission order: FIFO, and preemption takes the highest first
    arrival_time: float
    seed: int  # sample i draws from torch.Generator().manual_seed(seed + i)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    cached_tokens: int | None = None  # set at the first admission
    first_token_time: float | None = None
    error: BaseException | None = None
    sink: object = None  # where outputs go (an async stream's queue), or None
    # the KV compression its prompt gets (the params' or the engine's default), or None
    compression: object = None
    # selfattn.inspect.RequestHooks bound to the model (capture / edit on its rows), or None
    hooks: object = None
    # prompt logprobs scored so far (None first: the first token has none); a tuple once whole
    prompt_logprobs: list[TokenLogprob | None] | tuple[TokenLogprob | None, ...] | None = None

    def __post_init__(self):
        self.seqs = [Sequence(self, 0, list(self.prompt_ids))]
        if self.params.prompt_logprobs is not None:  # a one-token prompt is scored already
            self.prompt_logprobs = [None] if len(self.prompt_ids) > 1 else (None,)

    @property
    def computes_prompt(self) -> bool:
        """Whether its prompt must be computed, not read from the prefix cache: prompt
        logprobs need its logits, hooks its activations."""
        return self.scoring_prompt or self.hooks is not None

    @property
    def scoring_prompt(self) -> bool:
        """Whether prompt logprobs are still to be computed (its prefill cannot start from
        cached pages: those have no logits)."""
        return isinstance(self.prompt_logprobs, list)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def slots(self) -> int:
        """Cache sequences one of its sequences needs: all samples before the fork, then one."""
        return 1 if self.forked else self.params.samples


@dataclass(eq=False)
class Sequence:
    """One sample of a request (module docstring)."""

    request: Request
    index: int
    tokens: list[int]
    num_computed: int = 0
    kv_id: int | None = None
    cached_pages: int = 0  # full pages offered to the prefix cache so far
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""  # decoded output (of the first read_offset tokens), cut at a stop string
    prefix_offset: int = 0  # output tokens [prefix_offset, read_offset) give the next decode's
    read_offset: int = 0  # context (detokenize; negative: the prompt's last tokens)
    last_token_time: float | None = None
    sent_tokens: int = 0  # output tokens already reported
    sent_text: int = 0  # characters of text already reported
    generator: torch.Generator = None
    matcher: object = None  # the guide's grammar state (structured output), or None
    # KV compression: whether the prompt's KV was compressed (or found too short) since the
    # sequence was last admitted, and what its policy observed of the prompt so far, per layer
    # (the window's attention inputs, or a statistic streamed per chunk); the tokens evicted
    # are its cache sequence's (PagedKV.evicted)
    compressed: bool = False
    observed: list | None = None
    # decode-time eviction's statistic, one DecodeScores a layer (selfattn.serving.kv_eviction),
    # from its first decode step since it was last admitted; None before
    evicting: list | None = None

    def __post_init__(self):
        r = self.request
        self.generator = torch.Generator().manual_seed(r.seed + self.index)
        if len(self.tokens) == self.num_prompt:  # the first decode's context: the prompt's end
            self.prefix_offset = -min(PROMPT_CONTEXT, self.num_prompt)
        if r.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next token can be chosen; a prompt to be compressed
        first stops at its end (the tokens after it attend the compressed prompt). A sequence
        that evicts while decoding and is recomputed after a preemption goes on one output
        token a step, as it first ran them: each row's attention feeds its statistic and the
        cuts fall at the same lengths, so it resumes with the cache it had."""
        end = len(self.tokens)
        spec = self.request.compression
        if spec is not None and spec.decode_budget is not None:
            end = min(end, max(self.num_prompt, self.num_computed + 1))
        elif self.compressing:
            end = min(end, self.num_prompt)
        return end - self.num_computed

    @property
    def compressing(self) -> bool:
        """Whether its prompt's KV is still to be compressed (the request asks for it)."""
        spec = self.request.compression
        return spec is not None and spec.prompt and not self.compressed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def draft_room(self, k: int) -> int:
        """Draft tokens a speculative step may verify for this decoding sequence: at most
        ``k``, fewer near ``max_tokens`` (the step emits up to one more than it verifies), none
        with penalties, logit_bias or logprobs (their values depend on every token before, or
        the verdict does not apply them), none for a guided sequence (its mask of each drafted
        position would need the drafts consumed first)."""
        p = self.params
        if self.compressing:
            return 0  # its prompt ends the chunk (remaining), to be compressed first
        if self.matcher is not None:
            log_once("speculative-guided", logging.INFO, "speculative decoding: guided requests "
                     "(structured output) decode one token a step, without drafts")  # fmt: skip
            return 0
        if p.penalised or p.logit_bias or p.scores_tokens:
            log_once("speculative-declined", logging.INFO, "speculative decoding: requests with "
                     "penalties, logit_bias, logprobs or best_of decode one token a step, "
                     "without drafts")  # fmt: skip
            return 0
        return max(min(k, p.max_tokens - (len(self.tokens) - self.num_prompt) - 1), 0)

    @property
    def key(self) -> tuple[int, int]:
        """Age order: older requests first, then sample index."""
        return (self.request.order, self.index)

    def fork(self, index: int) -> Sequence:
        """Sample ``index`` of the same request, at this sequence's state (a new generator; a
        copy of the guide's state)."""
        child = Sequence(self.request, index, list(self.tokens), self.num_computed)
        child.compressed = self.compressed
        if self.matcher is not None:
            child.matcher = self.matcher.deep_copy()
        return child

    def detokenize(self, tokenizer, end: int, final: bool) -> str:
        """Extend ``text`` to the first ``end`` output tokens; returns the text added.

        Incremental, as vLLM's ``detokenize_incrementally``: each call decodes only the window
        from ``prefix_offset`` (the tokens decoded last time, context for a tokenizer that
        spaces or merges by neighbours) to ``end``, and keeps what the window adds beyond its
        context, so a sample of ``n`` tokens costs O(n) decoding, not O(n²). The first window
        starts ``PROMPT_CONTEXT`` tokens into the prompt, as vLLM's does: a SentencePiece
        tokenizer drops the space of a text's first word, which the completion's first word has.
        Text ending in U+FFFD (a UTF-8 character the next token may complete) waits, unless
        ``final``.
        """
        base = self.num_prompt
        window = self.tokens[base + self.prefix_offset : base + end]
        known = self.read_offset - self.prefix_offset
        before = tokenizer.decode(window[:known]) if known else ""
        text = tokenizer.decode(window)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        new = text[len(before) :]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, end
        return new

    def output(self, tokenizer, hold_back: int) -> CompletionOutput:
        """This sample's :class:`CompletionOutput`, marking its new part as reported.

        ``hold_back`` characters at the end of a running sample's text are not reported yet
        (the longest stop string minus one: a stop string is never streamed in part), nor is
        a trailing U+FFFD (an incomplete UTF-8 character the next token completes).
        """
        out = tuple(self.output_ids)
        new_tokens = out[self.sent_tokens :]
        self.sent_tokens = len(out)
        text = delta = None
        if tokenizer is not None:
            text = self.text
            shown = len(text)
            if not self.finished:
                shown = max(shown - hold_back, 0)
                while shown and text[shown - 1] == "\ufffd":
                    shown -= 1
            shown = max(shown, self.sent_text)
            delta = text[self.sent_text : shown]
            self.sent_text = shown
            text = text[:shown]
        return CompletionOutput(
            index=self.index,
            token_ids=out,
            text=text,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            delta_token_ids=new_tokens,
            delta_text=delta,
            cumulative_logprob=self.cumulative_logprob if self.params.scores_tokens else None,
        )
