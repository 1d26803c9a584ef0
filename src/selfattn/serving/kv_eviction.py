"""Decode-time KV eviction in the engine: H2O (``observed_attention``), TOVA and StreamingLLM
cut a generating sequence's cache back to a budget, each KV head its own tokens.

A request's ``kv_compression`` with a ``decode_budget`` N (and ``decode_interval`` K, default
64) asks for it (:class:`~selfattn.cache.compress.KVCompression`); a step then runs::

    found = ev.rows(chunks)     # the step's decode tokens of such sequences: their rows
    ev.ask(plan, found)         # each layer keeps the rows' key scores (cache.paged.scores)
    forward()
    ev.update(found, plan)      # per layer: DecodeScores.update(weights); at N + K cached
                                # tokens, evict to N per KV head: PagedKV.compact

The weights are the step's own: the C paged kernel writes each attended key's score as it
computes the row (``exp(score - lse)`` is the weight; no second attention pass), the PyTorch
path computes the rows' scores from their gathered keys. Only steps with such a row ask.

The statistic (one :class:`~selfattn.cache.compress.DecodeScores` a layer) starts when the
prompt is compressed (:func:`after_prompt`): H2O's from the attention each kept token received
from the prompt's rows (its accumulated attention, as in the paper, which the prompt's streamed
statistic holds), the other policies' from zeros; where the prompt stays whole (ratio 0, or too
short to compress), at the sequence's first decode step from zeros. The cuts keep
slot order (the cache's last slots stay the newest tokens) and positions stay the original
ones (:meth:`~selfattn.cache.PagedKV.evicted`); a sequence holds at most ``ceil((N + K) / P)
+ 1`` pages. The policies with ragged kept counts (PyramidKV, AdaKV) do not decode, so a
sequence here is never ragged and compacts any number of times.

Preemption: a preempted sequence's statistic is dropped and its pages freed; when readmitted
its prompt is recomputed (and compressed again if asked), then its output tokens one a step
(``Sequence.remaining``), each a decode row as when it first ran: the statistic is rebuilt row
by row and the cuts fall at the same lengths, so the cache it resumes with is the one it had
(bit for bit in deterministic mode, where a row's values do not depend on its batch). The
replay costs a step per output token so far, a row in each. Speculative engines refuse
decode-time eviction (a verify chunk is several rows of a sequence).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from selfattn.cache import PagedKV
from selfattn.cache.compress import DecodeScores
from selfattn.cache.compress.base import group_mean
from selfattn.cache.paged.scores import want_scores
from selfattn.kernels.paged_decode import key_weights
from selfattn.serving.request import Sequence

__all__ = ["DecodeEviction", "Evicting", "after_prompt"]

log = logging.getLogger("selfattn")


@dataclass
class Evicting:
    """One sequence's decode-time statistic: ``scores``, a DecodeScores per layer; ``positions
    (L, Hkv, n)`` the original position of each cached slot per layer and KV head, tracked
    where the prompt stayed whole (else None)."""

    scores: list
    positions: torch.Tensor | None


def after_prompt(spec, kept: torch.Tensor, sums: list | None) -> Evicting:
    """The statistic of a sequence whose prompt was just compressed to ``kept (L, Hkv, n)``
    (the prompt positions each layer and KV head keeps, ascending): H2O (``observed_attention``)
    starts from ``sums``, each layer's :class:`~selfattn.cache.compress.AttentionSums` of the
    prompt (every prompt row's weight on each key, averaged over the group: the attention the
    kept tokens accumulated in the prefill), the others from zeros."""
    L, Hkv, _ = kept.shape
    seeds = [None] * L
    if sums is not None and spec.press.name == "observed_attention":
        seeds = [group_mean(s.sums, Hkv).gather(-1, k[None].to(s.sums.device))
                 for s, k in zip(sums, kept)]  # fmt: skip
    scores = [DecodeScores(spec.press, spec.decode_budget, Hkv, scores=x) for x in seeds]
    return Evicting(scores, kept.cpu().clone())


class DecodeEviction:
    """The engine's decode-time eviction over its pool ``kv`` (module docstring); ``refused``:
    why this engine runs none (a request asking is refused with it), or None."""

    def __init__(self, kv: PagedKV, refused: str | None = None):
        self.kv, self.refused = kv, refused

    def check(self, spec) -> None:
        """ValueError where a request's resolved compression asks for decode-time eviction
        this engine cannot run."""
        if spec is not None and spec.decode_budget is not None and self.refused is not None:
            raise ValueError(f"kv_compression decode_budget ({spec.name}): {self.refused}")

    @staticmethod
    def rows(chunks) -> list[tuple[Sequence, int]]:
        """``(sequence, row)`` of each decode token in ``chunks`` (``(sequence, n tokens, first
        row)``) whose request evicts during decoding."""
        found = []
        for seq, n, at in chunks:
            spec = seq.request.compression
            if spec is None or spec.decode_budget is None or n != 1:
                continue
            if seq.num_computed >= seq.num_prompt and not seq.compressing:
                found.append((seq, at))
        return found

    @staticmethod
    def ask(plan, found: list[tuple[Sequence, int]]) -> None:
        """Ask the step's layers for the key scores of ``found``'s rows."""
        if found:
            want_scores(plan, torch.tensor([r for _, r in found], dtype=torch.long))

    def update(self, found: list[tuple[Sequence, int]], plan) -> list[tuple[str, tuple]]:
        """Fold the step's weights into each found sequence's statistic and cut those at their
        budget plus interval back to the budget; ``(policy, (tokens evicted per head, pages
        freed))`` of each cut."""
        cuts = []
        if not found:
            return cuts
        lengths = [self.kv.length(seq.kv_id) for seq, _ in found]
        longest = max(lengths)
        # each layer's weights for every found row at once, over the longest one's keys
        weights = []
        for layer in range(self.kv.n_layers):
            scores, lse = plan.scores[layer]
            weights.append(key_weights(scores[..., :longest], lse))  # (R, Hq, longest)
        for i, ((seq, _), n) in enumerate(zip(found, lengths)):
            spec = seq.request.compression
            state = seq.evicting
            if state is None:
                state = seq.evicting = self._start(seq, spec, n)
            for ds, w in zip(state.scores, weights):
                ds.update(w[i : i + 1, :, :n])  # (1, Hq, n)
            if state.positions is not None:
                new = torch.full((*state.positions.shape[:2], 1), self.kv.evicted(seq.kv_id) + n
                                 - 1, dtype=torch.long)  # fmt: skip
                state.positions = torch.cat((state.positions, new), dim=-1)
            if n >= spec.decode_budget + spec.decode_interval:
                cuts.append((spec.name, self._cut(seq, state)))
        return [c for c in cuts if c[1] is not None]

    def _start(self, seq: Sequence, spec, n: int) -> Evicting:
        L, Hkv = self.kv.n_layers, self.kv.k_store.shape[3]
        scores = [DecodeScores(spec.press, spec.decode_budget, Hkv) for _ in range(L)]
        whole = self.kv.evicted(seq.kv_id) == 0
        # the cached tokens before this step's (its position is appended by update)
        positions = torch.arange(n - 1).expand(L, Hkv, n - 1).clone() if whole else None
        return Evicting(scores, positions)

    def _cut(self, seq: Sequence, state: Evicting) -> tuple[int, int] | None:
        keep = torch.stack([ds.evict().keep[0] for ds in state.scores])  # (L, Hkv, N)
        if state.positions is not None:
            state.positions = state.positions.gather(-1, keep)
        try:
            return self.kv.compact(seq.kv_id, keep.to(self.kv.k_store.device))
        except RuntimeError as e:  # too few free pages for the copies of shared ones
            log.warning("selfattn.serving: a decode-time eviction was skipped: %s", e)
            seq.evicting = None  # the statistic was cut with it: start again next step
            return None
