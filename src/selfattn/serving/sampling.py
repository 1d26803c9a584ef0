"""How a request picks its tokens: :class:`SamplingParams` (validated) and :func:`choose`.

One step's logits are processed for every sequence of the batch at once, each row with its own
parameters, in this order (transformers' and vLLM's)::

    logits ─ logit_bias ─ penalties ─┬─ temperature == 0: argmax                     (greedy)
                                     └─ / temperature ─ top-k ─ top-p ─ min-p ─ draw  (sampling)

- ``logit_bias`` (OpenAI's): a fixed number in [-100, 100] added to the logits of the tokens it
  names; -100 bans a token in practice, +100 forces it.

- ``repetition_penalty`` r (CTRL, Keskar et al. 2019): the logit of every token already in the
  prompt or the output is divided by r when positive, multiplied by r when negative.
- ``presence_penalty`` a and ``frequency_penalty`` f (OpenAI's): ``logit -= a·[count > 0] +
  f·count`` over the tokens of the output so far.
- top-k keeps the k most likely tokens, top-p the smallest most-likely set whose probability
  reaches p (the first token always stays), min-p the tokens at least ``min_p`` times as likely
  as the most likely one (Nguyen et al. 2024).
- The draw is one uniform number per sequence from the sequence's own ``torch.Generator``
  mapped through the kept tokens' cumulative distribution (inverse CDF). A seeded sequence
  therefore draws the same tokens whatever else shares its batch: nothing it reads depends on
  the other rows.

Log-probabilities (``logprobs=k``) are those of the model's distribution, before the bias,
penalties, temperature and filters: the chosen token's, its rank and the ``k`` most likely
tokens' (:func:`token_logprobs`, which scores prompt tokens too).

A guided sequence (structured output, :mod:`selfattn.serving.structured`) samples from its
biased and penalised logits with every token its guide forbids set to -inf, before temperature
and the filters (as vLLM applies its grammar bitmask); its log-probabilities stay the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from selfattn.cache.compress import KVCompression, compression
from selfattn.serving.structured import Guide, apply_bitmask

__all__ = [
    "MAX_BIAS",
    "MAX_LOGPROBS",
    "MAX_N",
    "NO_COMPRESSION",
    "Choice",
    "SamplingParams",
    "choose",
    "probabilities",
    "token_logprobs",
]

MAX_N = 128  # samples per request: each is a sequence with its own pages once it diverges
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's limit)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_BIAS = 100.0  # |logit_bias| values (OpenAI's range)
# SamplingParams.kv_compression's explicit "off" (None there means the engine's default)
NO_COMPRESSION = "none"


def _number(name: str, value, lo: float, hi: float, *, lo_open=False, hi_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"SamplingParams {name} must be a finite number, got {value!r}")
    low_ok = value > lo if lo_open else value >= lo
    high_ok = value < hi if hi_open else value <= hi
    if not (low_ok and high_ok):
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"SamplingParams {name} must lie in {rng}, got {value!r}")
    return float(value)


def _int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams {name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"SamplingParams {name} must be {rng}, got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for; every field is checked when built (ValueError / TypeError
    naming the field, its value and the valid range: a server answers them with a 400).

    ``n`` samples of up to ``max_tokens`` new tokens each. ``temperature=0`` is greedy decoding;
    ``top_k`` (None: off), ``top_p``, ``min_p`` filter a sampled distribution; the penalties
    are in the module docstring. ``seed``: sample ``i`` of the request draws from a
    ``torch.Generator`` seeded with ``seed + i`` (unseeded requests get seeds from the engine's
    own generator). ``stop``: strings that end a sample (not included in its text; needs a
    tokenizer); ``stop_token_ids``: tokens that end it (included in its token ids, not in its
    text), as does the model's end-of-sequence token unless ``ignore_eos``. ``logprobs=k``:
    the log-probability of each chosen token and of the ``k`` most likely ones (0: the chosen
    token's only; None: none). ``guide``: a :class:`~selfattn.serving.structured.Guide` the
    output must match (structured output).

    ``max_tokens=0`` computes the prompt and stops (with ``prompt_logprobs``: scores it).
    ``prompt_logprobs=k``: the log-probability of every prompt token after the first, its rank
    and the ``k`` most likely tokens at its position (``RequestOutput.prompt_logprobs``),
    computed in the prefill the request runs anyway. ``logit_bias``: ``{token id: bias}``
    added to the logits before sampling (stored as sorted ``(id, bias)`` pairs). ``best_of``:
    draw that many samples and return the ``n`` with the highest cumulative log-probability
    (vLLM's rule; None: ``n``). ``kv_compression``: what the prompt's KV keeps after its
    prefill (:func:`selfattn.cache.compress.compression` reads ``"snapkv:0.5"``, ``{"policy":
    "snapkv", "ratio": 0.5, "window": 32, "budget": 1024}`` or a press; stored as a
    :class:`~selfattn.cache.compress.KVCompression`); None: the engine's default;
    ``"none"`` or ratio 0: no compression (stored as :data:`NO_COMPRESSION`).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    best_of: int | None = None
    guide: Guide | None = None
    kv_compression: KVCompression | str | None = None

    def __post_init__(self):
        _int("n", self.n, 1, MAX_N)
        _int("max_tokens", self.max_tokens, 0)
        _number("temperature", self.temperature, 0.0, math.inf, hi_open=True)
        if self.top_k is not None:
            _int("top_k", self.top_k, 1)
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True)
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if self.seed is not None:
            _int("seed", self.seed, 0, 2**63 - 1 - MAX_N)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            raise TypeError(
                f"SamplingParams stop must be a string or a list of strings, got {self.stop!r}"
            ) from None
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"SamplingParams stop must hold non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        ids = (ids,) if isinstance(ids, int) and not isinstance(ids, bool) else tuple(ids)
        for t in ids:
            _int("stop_token_ids entries", t, 0)
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.best_of is not None:
            _int("best_of", self.best_of, self.n, MAX_N)
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise TypeError(f"SamplingParams guide must be a Guide, got {self.guide!r}")
        spec = self.kv_compression
        if spec is not None and spec != NO_COMPRESSION:
            try:
                spec = compression(spec) or NO_COMPRESSION
            except (TypeError, ValueError) as e:
                raise type(e)(f"SamplingParams kv_compression: {e}") from None
            object.__setattr__(self, "kv_compression", spec)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def samples(self) -> int:
        """Samples drawn: ``best_of``, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def ranked(self) -> bool:
        """Whether more samples are drawn than returned (``best_of > n``)."""
        return self.samples > self.n

    @property
    def scores_tokens(self) -> bool:
        """Whether each chosen token's log-probability is needed (logprobs, or ranking)."""
        return self.logprobs is not None or self.ranked

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError unless every ``logit_bias`` token id is below ``vocab_size``."""
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise ValueError(
                    f"logit_bias names token id {t}, outside the vocabulary 0..{vocab_size - 1}; "
                    "give ids of this model's tokenizer"
                )

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping or ``(id, bias)`` pairs) -> sorted pairs, each checked."""
    items = bias.items() if hasattr(bias, "items") else bias
    try:
        pairs = [tuple(p) for p in items]
    except TypeError:
        raise TypeError(
            f"SamplingParams logit_bias must map token ids to biases, got {bias!r}"
        ) from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise TypeError(f"SamplingParams logit_bias must map token ids to biases, got {bias!r}")
        t, b = pair
        _int("logit_bias token ids", t, 0)
        out[t] = _number(f"logit_bias[{t}]", b, -MAX_BIAS, MAX_BIAS)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Choice:
    """One sequence's pick: ``token``; with logprobs, ``logprob`` (the chosen token's), ``top``
    (``(token, logprob)`` of the most likely tokens, most likely first) and ``rank`` (the
    chosen token's place in the model's distribution, 1 for the most likely)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    rank: int | None = None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[Choice]:
    """Each row's ``tokens[i]`` scored under ``logits (R, V)``: its log-probability, its rank
    (1 + the tokens strictly more likely) and the ``k`` most likely ``(token, logprob)``."""
    lp = logits.float().log_softmax(-1)  # (R, V)
    chosen = lp.gather(1, tokens.view(-1, 1))  # (R, 1)
    ranks = (lp > chosen).sum(-1) + 1
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    rows = zip(tokens.tolist(), chosen.view(-1).tolist(), ranks.tolist(), top_i.tolist(),
               top_v.tolist())  # fmt: skip
    return [Choice(t, v, tuple(zip(ti, tv)), r) for t, v, r, ti, tv in rows]


def _apply_bias(x: torch.Tensor, seqs) -> None:
    """Each row's ``logit_bias``, in place on ``x (R, V)``."""
    for i, s in enumerate(seqs):
        if s.params.logit_bias:
            ids, bias = zip(*s.params.logit_bias)
            x[i, list(ids)] += torch.tensor(bias, dtype=x.dtype, device=x.device)


def _apply_penalties(x: torch.Tensor, seqs) -> None:
    """Penalties of each row's sequence, in place on ``x (R, V)`` float32."""
    V = x.shape[1]
    for i, s in enumerate(seqs):
        p = s.params
        if not p.penalised:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.tokens)), dtype=torch.long, device=x.device)
            vals = x[i, seen]
            r = p.repetition_penalty
            x[i, seen] = torch.where(vals > 0, vals / r, vals * r)
        out = s.output_ids
        if out and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(out, dtype=torch.long, device=x.device)
            counts = torch.bincount(ids, minlength=V).to(x.dtype)  # (V,)
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def _sorted_probs(x: torch.Tensor, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x (R, V)`` (penalised logits) -> ``(probs, order)``: each row's distribution
    after its sequence's temperature, top-k, top-p and min-p, most likely first (``probs (R,
    V)``, zero past the kept tokens; unnormalised), and the token ids in that order."""
    R, V = x.shape
    dev = x.device
    temp = torch.tensor([s.params.temperature for s in seqs], device=dev).view(R, 1)
    # a temperature below the dtype's smallest normal (1e-99 is 0 in float32) divides as that
    # smallest one: the most likely token alone, never 0 / 0
    temp = temp.to(x.dtype).clamp(min=torch.finfo(x.dtype).tiny)
    top_k = torch.tensor([s.params.top_k or V for s in seqs], device=dev).view(R, 1)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=dev).view(R, 1)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=dev).view(R, 1)
    # Shifted by the row maximum first: a tiny temperature then gives -inf, never inf - inf;
    # the maxima give 0, +inf logits too (a tiny repetition_penalty divides a logit to +inf)
    top = x.amax(-1, keepdim=True)
    scaled = torch.where(x == top, 0.0, (x - top) / temp)
    vals, order = scaled.sort(dim=-1, descending=True)  # (R, V) most likely first
    vals = vals.masked_fill(torch.arange(V, device=dev).view(1, V) >= top_k, -math.inf)
    probs = vals.softmax(-1)
    # Drop a token when the more likely ones already reach top_p; the first always stays.
    drop = (probs.cumsum(-1) - probs) >= top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0), order


def probabilities(x: torch.Tensor, seqs) -> torch.Tensor:
    """The distributions sampled rows draw from: ``x (R, V)`` (penalised logits, row ``i`` for
    ``seqs[i]``) -> ``(R, V)`` probabilities in vocabulary order, each row with its sequence's
    temperature, top-k, top-p and min-p (a speculative step's target and draft ``p``, ``q``)."""
    probs, order = _sorted_probs(x.float(), seqs)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.empty_like(probs).scatter_(1, order, probs)


def _draw(x: torch.Tensor, seqs) -> torch.Tensor:
    """Sampled tokens ``(R,)`` of rows ``x (R, V)`` (penalised logits), each row with its
    sequence's temperature, filters and generator (module docstring)."""
    R, dev = x.shape[0], x.device
    probs, order = _sorted_probs(x, seqs)
    cdf = probs.cumsum(-1)  # kept tokens are a prefix of the sorted order
    u = torch.stack([torch.rand((), generator=s.generator) for s in seqs]).to(dev)
    j = torch.searchsorted(cdf, (u * cdf[:, -1]).view(R, 1), right=True)  # (R, 1)
    kept = (probs > 0).sum(-1, keepdim=True)
    # u · total rounding onto the last kept token's edge; a row of NaN logits (none kept)
    # takes its first token rather than failing its batch
    j = torch.minimum(j, kept - 1).clamp(min=0)
    return order.gather(1, j).view(R)


def choose(logits: torch.Tensor, seqs, masks=None) -> list[Choice]:
    """The next token of each sequence from ``logits (R, V)`` (row ``i`` for ``seqs[i]``).

    A sequence provides ``params`` (:class:`SamplingParams`), ``tokens`` (prompt and output
    ids), ``output_ids`` and ``generator`` (a CPU ``torch.Generator``). ``masks``: ``(rows
    (G,), bits (G, words))``, the allowed tokens of the guided rows as bitmasks
    (:func:`~selfattn.serving.structured.apply_bitmask`; each row allows at least one token).
    """
    x = logits.float()
    raw = x
    if masks is not None or any(s.params.penalised or s.params.logit_bias for s in seqs):
        x = x.clone()
    if any(s.params.penalised or s.params.logit_bias for s in seqs):
        _apply_bias(x, seqs)
        _apply_penalties(x, seqs)
    if masks is not None:
        apply_bitmask(x, *masks)
    tokens = x.argmax(-1)  # (R,): greedy rows keep it
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=x.device)
        tokens[idx] = _draw(x[idx], [seqs[i] for i in sampled])
    choices = [Choice(t) for t in tokens.tolist()]
    want = [i for i, s in enumerate(seqs) if s.params.scores_tokens]
    if not want:
        return choices
    idx = torch.tensor(want, device=x.device)
    k = max(seqs[i].params.logprobs or 0 for i in want)
    for i, c in zip(want, token_logprobs(raw[idx], tokens[idx], k)):  # the model's distribution
        choices[i] = Choice(c.token, c.logprob, c.top[: seqs[i].params.logprobs or 0], c.rank)
    return choices
