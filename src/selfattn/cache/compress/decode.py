"""Eviction during decoding: H2O's accumulated attention, TOVA's current query, StreamingLLM.

:class:`DecodeScores` holds one layer's per-token statistic ``(B, Hkv, L)`` aligned with the
cache's slots of each head (oldest first; compaction keeps that order, so the last slots are
the most recent tokens). Each step::

    ds.update(weights)        # (B, Hq, L): this step's softmax weights over the L cached keys,
                              # the new token's key last
    drop, keep = ds.evict()   # (B, Hkv, L - budget) slots to free, (B, Hkv, budget) to keep

- ``observed_attention`` (H2O, Zhang et al., 2023): a key's score is the attention it has
  received, summed over steps (averaged over the group's query heads); the last ``window``
  tokens are kept besides.
- ``tova`` (Oren et al., 2024): the score is the current query's weight (averaged over the
  layer's heads, or the group's with ``per_head``); the last ``window`` tokens are kept.
- ``streaming_llm``: the sinks and the most recent tokens; weights are not needed.

Ties evict the most recent of the tied tokens first (the lowest index is kept, as in
:meth:`Press.keep`).

The Engine runs one a layer for each generating sequence whose request has a ``decode_budget``
(:mod:`selfattn.serving.kv_eviction`), fed each step's weights from the C paged kernel's key
scores (``exp(score - lse)``), and compacts the pages to :meth:`DecodeScores.evict`'s ``keep``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from selfattn.cache.compress.base import Press, check_count, group_mean, top_indices
from selfattn.cache.compress.policies import TOVA, ObservedAttention, StreamingLLM

__all__ = ["DecodeScores", "Eviction"]

DECODE_POLICIES = ("observed_attention", "streaming_llm", "tova")


class Eviction(NamedTuple):
    """Slots per head, ascending: ``drop (B, Hkv, n)`` to free and ``keep (B, Hkv, L - n)``."""

    drop: torch.Tensor
    keep: torch.Tensor


class DecodeScores:
    """One layer's eviction statistic for a decode-time press (module docstring).

    ``budget``: tokens kept per head after each :meth:`evict`; ``n_kv_heads``: Hkv; ``scores``
    ``(B, Hkv, L)``: a starting statistic for the tokens already cached (for H2O, e.g. the
    prefill scores gathered at the kept indices), else zeros on the first update.
    """

    def __init__(
        self,
        press: Press,
        budget: int,
        n_kv_heads: int,
        scores: torch.Tensor | None = None,
    ):
        if not (isinstance(press, Press) and press.decodes):
            raise ValueError(
                f"decode-time eviction reads each step's attention and supports "
                f"{list(DECODE_POLICIES)}, got {getattr(press, 'name', press)!r}"
            )
        check_count(n_kv_heads, "n_kv_heads", 1)
        check_count(budget, "budget", max(1, press.sinks + press.window))
        self.press, self.budget, self.n_kv_heads = press, budget, n_kv_heads
        if scores is not None and (scores.dim() != 3 or scores.shape[1] != n_kv_heads):
            raise ValueError(f"scores must be (B, Hkv={n_kv_heads}, L), got {tuple(scores.shape)}")
        self.scores = scores

    @property
    def length(self) -> int:
        """Tokens tracked per head."""
        return 0 if self.scores is None else self.scores.shape[-1]

    def update(self, weights: torch.Tensor) -> None:
        """Take one step's attention ``weights (B, Hq, L)`` over the ``L >= length`` cached
        keys (new tokens after the tracked ones)."""
        if (
            weights.dim() != 3
            or weights.shape[1] % self.n_kv_heads
            or weights.shape[-1] < (self.length)
        ):
            raise ValueError(
                f"weights must be (B, Hq, L) with Hq a multiple of {self.n_kv_heads} and "
                f"L >= the {self.length} tracked tokens, got {tuple(weights.shape)}"
            )
        b, _, n = weights.shape
        w = weights.to(torch.float64 if weights.dtype == torch.float64 else torch.float32)
        if isinstance(self.press, ObservedAttention):
            new = group_mean(w, self.n_kv_heads)  # a new tensor: the new keys start from it
            if self.scores is not None:
                new[..., : self.length] += self.scores
            self.scores = new
        elif isinstance(self.press, TOVA):
            self.scores = self.press.heads_mean(w, self.n_kv_heads)
        else:
            self.scores = torch.zeros(b, self.n_kv_heads, n, dtype=w.dtype, device=w.device)

    def evict(self) -> Eviction:
        """The slots to free so that ``budget`` tokens remain per head (none while under it);
        the statistic is compacted to the kept slots."""
        if self.scores is None:
            raise ValueError("evict() before any update(): nothing is tracked yet")
        b, hkv, n = self.scores.shape
        ranked = self.scores
        if isinstance(self.press, StreamingLLM):  # recency: the slot order is the age order
            ranked = torch.arange(n, dtype=ranked.dtype, device=ranked.device).expand(b, hkv, n)
        ranked = ranked.clone()
        ranked[..., : self.press.sinks] = torch.inf
        ranked[..., max(n - self.press.window, 0) :] = torch.inf
        keep = top_indices(ranked, min(self.budget, n)).sort(-1).values
        kept = torch.zeros(b, hkv, n, dtype=torch.bool, device=ranked.device)
        kept.scatter_(-1, keep, True)
        dropped_first = torch.sort(kept.to(torch.int8), dim=-1, stable=True).indices
        drop = dropped_first[..., : n - keep.shape[-1]]
        self.scores = self.scores.gather(-1, keep)
        return Eviction(drop, keep)
