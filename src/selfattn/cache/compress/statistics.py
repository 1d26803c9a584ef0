"""Prefill statistics streamed per chunk: what a press that reads (nearly) every prompt query
keeps instead of those queries.

``observed_attention`` reads all ``S`` query rows and ``expected_attention`` all past its sinks:
kept as rows, that is ``S x d_model`` floats per layer until the prompt ends, and a second full
``(Hq, S, S)`` softmax at compression. :meth:`~selfattn.cache.compress.Press.statistic` gives
such a press an accumulator that a chunked prefill feeds as each chunk's keys are written::

    stat = press.statistic()                                # per sequence and layer
    for each chunk of rows first .. first + n - 1:          # in order
        stat.update(queries, keys[:, :, : first + n], first, scale)   # chunk-sized transients
    scores = press.score(keys, values, statistic=stat, ...)  # (B, Hkv, S), as from all rows

- :class:`AttentionSums` (observed attention): each key's causal softmax weight summed over the
  rows that see it, ``(B, Hq, S)`` grown per chunk; per chunk one ``QK^T`` over the keys up to
  each row (in blocks of ``row_block`` rows), no ``PV``. The row maxima are recomputed there
  rather than taken from the attention kernel's log-sum-exp (a chunk-sized pass; the kernels
  stay untouched).
- :class:`QueryMoments` (expected attention): the count, mean ``(B, Hq, D)`` and centred second
  moment ``(B, Hq, D, D)`` of the pre-RoPE queries, float64, merged per chunk by Chan, Golub
  and LeVeque's pairwise update (no ``E[qq^T] - mu mu^T`` cancellation); keys are not read.

A press given every row at once builds the same statistic in one update and scores from it, so
one piece of code scores both ways.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from selfattn.cache.compress.base import check_count, group_mean, window_attention, work_dtype

__all__ = ["AttentionSums", "QueryMoments"]


def _check_queries(queries: torch.Tensor, first_row: int) -> None:
    if not isinstance(queries, torch.Tensor) or queries.dim() != 4:
        got = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries)
        raise ValueError(f"queries must be (B, Hq, n, D), got {got}")
    if isinstance(first_row, bool) or not isinstance(first_row, int) or first_row < 0:
        raise ValueError(f"first_row must be an int >= 0, got {first_row!r}")


class AttentionSums:
    """Observed attention's statistic: ``sums (B, Hq, end)`` of the causal softmax weights of
    the rows ``first .. end - 1`` folded in so far (row ``i`` sees keys ``0 .. i``), in
    :func:`~selfattn.cache.compress.base.work_dtype`; ``rows`` how many. ``row_block``: rows
    softmaxed at once, so an update's transient is ``(B, Hq, row_block, keys)`` floats (a few
    copies: logits, mask, softmax), not ``(B, Hq, chunk, keys)``."""

    needs_keys: ClassVar[bool] = True

    def __init__(self, row_block: int = 128):
        check_count(row_block, "row_block", 1)
        self.row_block = row_block
        self.sums: torch.Tensor | None = None
        self.rows = 0

    @property
    def end(self) -> int:
        """One past the last row folded in (0 before any)."""
        return 0 if self.sums is None else self.sums.shape[-1]

    def update(self, queries, keys, first_row: int, scale: float | None = None) -> None:
        """Fold in rows ``first_row .. first_row + n - 1``: their rotated ``queries (B, Hq,
        n, D)`` over ``keys (B, Hkv, first_row + n, D)`` (RoPE applied), the softmax scale
        ``scale`` (default 1/sqrt(D)). Rows come in order, each chunk right after the last."""
        _check_queries(queries, first_row)
        n = queries.shape[2]
        if self.sums is not None and first_row != self.end:
            raise ValueError(
                f"observed attention's rows come in order: rows up to {self.end} are in, got "
                f"a chunk from row {first_row}; feed each chunk once, right after the last"
            )
        if keys is None or keys.dim() != 4 or keys.shape[2] != first_row + n:
            got = None if keys is None else tuple(keys.shape)
            raise ValueError(
                f"keys must be (B, Hkv, {first_row + n}, D): every key up to the chunk's last "
                f"row {first_row + n - 1}, got {got}"
            )
        for a in range(0, n, self.row_block):
            b = min(a + self.row_block, n)
            rows = window_attention(queries[:, :, a:b], keys[:, :, : first_row + b], scale)
            self.add(rows)  # (B, Hq, b - a, first_row + b)

    def add(self, weights: torch.Tensor) -> None:
        """Fold in ``weights (B, Hq, n, end)``: the softmax rows of rows ``end - n .. end - 1``
        over keys ``0 .. end - 1`` (zero above the diagonal)."""
        col = weights.sum(2)  # (B, Hq, n, end) -> (B, Hq, end)
        if self.sums is not None:
            col[..., : self.end] += self.sums
        self.sums = col
        self.rows += weights.shape[2]

    def score(self, n_kv_heads: int) -> torch.Tensor:
        """``(B, Hkv, end)``: each key's summed weight over the rows that saw it, divided by
        their number (``min(end - j, rows)`` for key ``j``), averaged over the group."""
        if self.sums is None:
            raise ValueError("observed attention's statistic is empty: feed it the prompt's rows")
        s = self.end
        seen = torch.arange(s, 0, -1, device=self.sums.device).clamp(max=self.rows)
        return group_mean(self.sums / seen, n_kv_heads)


class QueryMoments:
    """Expected attention's statistic: ``count``, ``mean (B, Hq, D)`` and centred second moment
    ``m2 (B, Hq, D, D)`` (float64) of the pre-RoPE query rows at index ``>= skip`` (past the
    sinks) folded in so far."""

    needs_keys: ClassVar[bool] = False

    def __init__(self, skip: int = 0):
        self.skip = skip
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def update(self, queries, keys, first_row: int, scale: float | None = None) -> None:
        """Fold in rows ``first_row .. first_row + n - 1``: their pre-RoPE ``queries (B, Hq, n,
        D)``, the rows before ``skip`` dropped; ``keys`` and ``scale`` are not read. Order does
        not matter."""
        _check_queries(queries, first_row)
        q = queries[:, :, max(0, self.skip - first_row) :].to(torch.float64)
        nb = q.shape[2]
        if nb == 0:
            return
        mb = q.mean(2)  # (B, Hq, n, D) -> (B, Hq, D)
        c = q - mb.unsqueeze(2)
        m2b = c.transpose(-1, -2) @ c  # (B, Hq, D, D)
        if self.count == 0:
            self.count, self.mean, self.m2 = nb, mb, m2b
            return
        na, n = self.count, self.count + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta.unsqueeze(-1) * delta.unsqueeze(-2) * (na * nb / n)
        self.count = n

    def covariance(self) -> torch.Tensor:
        """``(B, Hq, D, D)``: the rows' covariance (divided by their count, as kvpress does)."""
        return self.m2 / self.count


def moments_of(queries: torch.Tensor, skip: int = 0) -> QueryMoments:
    """:class:`QueryMoments` of every row of ``queries (B, Hq, R, D)``, rows ``skip ..``."""
    found = QueryMoments(skip)
    found.update(queries, None, 0)
    return found


def sums_of(weights: torch.Tensor) -> AttentionSums:
    """:class:`AttentionSums` of ``weights (B, Hq, R, S)``, the last ``R`` rows' softmax."""
    found = AttentionSums()
    found.add(weights.to(work_dtype(weights)))
    return found


__all__ += ["moments_of", "sums_of"]
