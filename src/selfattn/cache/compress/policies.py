"""The presses: each paper's token-importance rule, with kvpress's defaults.

Every score is ``(B, Hkv, S)``; where a rule reads per-query-head attention, the query heads of
a KV head's group are averaged (kvpress's aggregation; SnapKV's authors' GQA answer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from selfattn.cache.compress.base import (
    Kept,
    Press,
    attention_rows,
    check_count,
    group_mean,
    top_indices,
    work_dtype,
)
from selfattn.cache.compress.statistics import AttentionSums, QueryMoments, moments_of, sums_of

__all__ = [
    "TOVA",
    "AdaKV",
    "ExpectedAttention",
    "KNorm",
    "ObservedAttention",
    "PyramidKV",
    "SnapKV",
    "StreamingLLM",
]


@dataclass(frozen=True)
class StreamingLLM(Press):
    """Keep ``n_sink`` attention sinks and the most recent tokens (Xiao et al., 2023,
    arXiv:2309.17453): the score is the token's index, the sinks +inf."""

    n_sink: int = 4

    name: ClassVar[str] = "streaming_llm"
    decodes: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        check_count(self.n_sink, "streaming_llm n_sink", 0)

    @property
    def sinks(self) -> int:
        return self.n_sink

    def raw_score(self, keys, values, queries, attention, **kwargs):
        b, hkv, s, _ = keys.shape
        return torch.arange(s, dtype=work_dtype(keys), device=keys.device).expand(b, hkv, s)


@dataclass(frozen=True)
class KNorm(Press):
    """Keep the keys of smallest L2 norm, which draw the most attention (Devoto et al., 2024,
    arXiv:2406.11430): the score is ``-||k||``."""

    name: ClassVar[str] = "knorm"

    def raw_score(self, keys, values, queries, attention, **kwargs):
        return -keys.to(work_dtype(keys)).norm(dim=-1)


@dataclass(frozen=True)
class SnapKV(Press):
    """The observation window's votes (Li et al., 2024, arXiv:2404.14469): each key's attention
    from the last ``window`` queries, averaged over them, smoothed by a ``kernel_size`` average
    pool (zero padded) and averaged over the group; the window itself is kept.
    ``window`` is kvpress's ``window_size``."""

    window: int = 64
    kernel_size: int = 5

    name: ClassVar[str] = "snapkv"

    def __post_init__(self):
        super().__post_init__()
        check_count(self.kernel_size, f"{self.name} kernel_size", 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(
                f"{self.name} kernel_size must be odd (a pool centred on each token), "
                f"got {self.kernel_size}"
            )

    def query_rows(self, seq_len: int) -> int:
        return self.window

    def raw_score(self, keys, values, queries, attention, *, scale=None, **kwargs):
        hkv, s = keys.shape[1:3]
        w, pool = self.window, self.kernel_size
        if w == 0:
            raise ValueError(f"{self.name} votes from its window: window must be >= 1, got 0")
        rows = attention_rows(queries, attention, keys, w, scale, self.name)
        votes = rows[..., : s - w].mean(-2)  # (B, Hq, W, S-W) -> (B, Hq, S-W)
        votes = F.avg_pool1d(votes, pool, stride=1, padding=pool // 2)
        return F.pad(group_mean(votes, hkv), (0, w))  # the window's place, set to +inf


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV's scores under a pyramid of layer budgets (Cai et al., 2024, arXiv:2406.02069):
    the lowest layer keeps most, the top ``1/beta`` of that, linearly between, with the same
    total as a uniform budget (kvpress's formula, falling back to uniform where the pyramid
    does not fit)."""

    beta: float = 20

    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)):
            raise ValueError(f"pyramidkv beta must be a number >= 1, got {self.beta!r}")
        if not self.beta >= 1:
            raise ValueError(f"pyramidkv beta must be a number >= 1, got {self.beta!r}")

    def layer_budget(self, seq_len: int, layer: int, n_layers: int) -> int:
        # Per layer the pyramid keeps ``window`` plus a share of the rest; the shares run
        # linearly from ``top`` (layer 0) to ``bottom`` (the last layer) and average
        # ``seq_len * (1 - ratio)``, so ``top + bottom = 2 * seq_len * (1 - ratio)``.
        w, kept = self.window, seq_len * (1 - self.compression_ratio)
        low = kept / self.beta
        high = 2 * kept - low
        if high >= seq_len - w:
            high = seq_len - w
            low = 2 * kept - high
        if n_layers == 1 or not seq_len >= high >= low >= w:
            return round(kept)
        return round(high - layer * (high - low) / (n_layers - 1))


@dataclass(frozen=True)
class TOVA(Press):
    """Token Omission Via Attention (Oren et al., 2024, arXiv:2401.06104): keep the tokens the
    last query attends to most, its weights averaged over every head of the layer (the same
    tokens for each KV head), or over each group with ``per_head``; the last token is kept."""

    window: int = 1
    per_head: bool = False

    name: ClassVar[str] = "tova"
    decodes: ClassVar[bool] = True

    def query_rows(self, seq_len: int) -> int:
        return 1

    def raw_score(self, keys, values, queries, attention, *, scale=None, **kwargs):
        last = attention_rows(queries, attention, keys, 1, scale, self.name)[:, :, 0]
        return self.heads_mean(last, keys.shape[1])

    def heads_mean(self, weights: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
        """``(B, Hq, S) -> (B, Hkv, S)``: the mean over the layer's heads, or the group's."""
        if self.per_head:
            return group_mean(weights, n_kv_heads)
        mean = weights.mean(1, keepdim=True)
        return mean.expand(-1, n_kv_heads, -1)


@dataclass(frozen=True)
class ObservedAttention(Press):
    """H2O's heavy hitters at prefill (Zhang et al., 2023, arXiv:2306.14048), as kvpress
    scores them: each key's attention summed over the queries that see it, divided by their
    number, averaged over the group. kvpress observes every prompt query; given only the last
    ``R`` (``queries`` or ``attention`` rows) each key is averaged over the rows that see it.
    ``window`` recent tokens are kept besides (H2O's recent window; kvpress has none)."""

    name: ClassVar[str] = "observed_attention"
    decodes: ClassVar[bool] = True

    def query_rows(self, seq_len: int) -> int:
        return seq_len

    def statistic(self) -> AttentionSums:
        return AttentionSums()

    def raw_score(self, keys, values, queries, attention, *, scale=None, statistic=None, **kw):
        s = keys.shape[2]
        if statistic is None:
            given = queries if attention is None else attention
            r = max(1, min(given.shape[2], s)) if given is not None and given.dim() == 4 else s
            statistic = sums_of(attention_rows(queries, attention, keys, r, scale, self.name))
        elif statistic.end != s:
            raise ValueError(
                f"{self.name}'s statistic holds rows up to {statistic.end}, the keys are {s}: "
                "feed it every chunk of the prompt before scoring"
            )
        return statistic.score(keys.shape[1])


@dataclass(frozen=True)
class ExpectedAttention(Press):
    """Expected attention of future queries (Devoto et al., 2025, kvpress, arXiv:2510.00636):
    the prompt's pre-RoPE queries (past the sinks) as a Gaussian, rotated by RoPE averaged over
    the next ``n_future_positions``; ``E[exp(s q.k)] = exp(s mu.k + s^2/2 k^T Sigma k)``,
    softmaxed over the keys, averaged over the group, times ``||v||`` (``use_vnorm``).

    ``queries`` are pre-RoPE (``query_rows(S) = S - n_sink`` of them) and ``rope`` rotates
    them; the future starts after the last of ``positions``."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    name: ClassVar[str] = "expected_attention"
    rotated_queries: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_count(self.n_future_positions, "expected_attention n_future_positions", 1)
        check_count(self.n_sink, "expected_attention n_sink", 0)
        if isinstance(self.epsilon, bool) or not (
            isinstance(self.epsilon, (int, float)) and 0 <= self.epsilon < math.inf
        ):
            raise ValueError(f"expected_attention epsilon must be >= 0, got {self.epsilon!r}")

    @property
    def sinks(self) -> int:
        return self.n_sink

    def query_rows(self, seq_len: int) -> int:
        return seq_len - self.n_sink

    def statistic(self) -> QueryMoments:
        return QueryMoments(self.n_sink)

    def raw_score(self, keys, values, queries, attention, *, rope=None, statistic=None, **kw):
        s = keys.shape[2]
        if (queries is None and statistic is None) or rope is None:
            raise ValueError(
                "expected_attention needs queries= (pre-RoPE, the prompt's past the sinks) or "
                "their statistic=, and rope= (e.g. selfattn.positions.RoPE(head_dim)) to "
                "predict future queries"
            )
        if statistic is None:
            statistic = moments_of(queries[:, :, -self.query_rows(s) :])
        if statistic.count == 0:
            raise ValueError(
                f"expected_attention's statistic holds no query past the {self.n_sink} sinks: "
                "feed it the prompt's rows before scoring"
            )
        cov = statistic.covariance() if self.use_covariance else None
        return self.from_moments(keys, values, statistic.mean, cov, rope=rope, **kw)

    def from_moments(
        self, keys, values, mean, covariance=None, *, rope, positions=None, scale=None, **kw
    ) -> torch.Tensor:
        """The raw scores ``(B, Hkv, S)`` (sinks 0) from the pre-RoPE queries' ``mean (B, Hq,
        D)`` and ``covariance (B, Hq, D, D)`` (None: the mean alone); the one scoring code of
        both the query rows and a prefill's streamed :class:`QueryMoments`."""
        b, hkv, s, d = keys.shape
        work = work_dtype(keys)
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        nxt = s if positions is None else int(positions[-1]) + 1
        rot_t = self.mean_rotation(rope, nxt, d, work, keys.device)  # R̄ᵀ
        mu = (mean.to(work) @ rot_t).view(b, hkv, -1, d)  # (B, Hq, D) -> (B, Hkv, g, D)
        k = keys[:, :, self.n_sink :].to(work)  # (B, Hkv, S', D)
        logits = torch.einsum("bhgd,bhsd->bhgs", mu, k) * scale
        if covariance is not None:
            cov = (rot_t.T @ covariance.to(work) @ rot_t).view(b, hkv, -1, d, d)
            logits = logits + torch.einsum("bhsd,bhgde,bhse->bhgs", k, cov, k) * scale**2 / 2
        scores = logits.softmax(-1).mean(2)  # (B, Hkv, g, S') -> (B, Hkv, S')
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values[:, :, self.n_sink :].to(work).norm(dim=-1)
        return F.pad(scores, (self.n_sink, 0))  # the sinks' place, set to +inf

    def mean_rotation(self, rope, start: int, dim: int, dtype, device) -> torch.Tensor:
        """``R̄ᵀ (D, D)``: RoPE's rotation averaged over positions ``start ..
        start + n_future_positions - 1``, transposed (row i: the average image of e_i), got by
        rotating the basis vectors, so any RoPE layout or scaling works."""
        n = self.n_future_positions
        basis = torch.eye(dim, dtype=dtype, device=device).view(dim, 1, 1, dim)
        basis = basis.expand(dim, 1, n, dim).contiguous()
        pos = torch.arange(start, start + n, device=device)
        return rope(basis, pos).mean(2)[:, 0].to(dtype)


@dataclass(frozen=True)
class AdaKV(Press):
    """Budgets per head (Feng et al., 2024, arXiv:2407.11550): the layer keeps its
    ``Hkv * budget`` best tokens across all heads of ``scorer``'s scores, each head first
    guaranteed its ``int(alpha_safeguard * budget)`` best (kvpress's safeguard); ties go to the
    lower head, then the lower index. ``compression_ratio`` and ``window`` are the scorer's."""

    scorer: Press | None = None
    alpha_safeguard: float = 0.20

    ragged: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.scorer, Press) or isinstance(self.scorer, AdaKV):
            raise ValueError(f"adakv needs a scorer press (e.g. SnapKV()), got {self.scorer!r}")
        super().__post_init__()
        a = self.alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"adakv alpha_safeguard must be in [0, 1], got {a!r}")
        mine = (self.compression_ratio, self.window)
        theirs = (self.scorer.compression_ratio, self.scorer.window)
        if mine != theirs:
            raise ValueError(
                f"adakv's compression_ratio and window {mine} must be its scorer's {theirs}; "
                "build it with press('adakv_<scorer>', ratio, ...)"
            )

    @property
    def name(self) -> str:
        return f"adakv_{self.scorer.name}"

    @property
    def sinks(self) -> int:
        return self.scorer.sinks

    @property
    def rotated_queries(self) -> bool:
        return self.scorer.rotated_queries

    def query_rows(self, seq_len: int) -> int:
        return self.scorer.query_rows(seq_len)

    def statistic(self):
        return self.scorer.statistic()

    def layer_budget(self, seq_len: int, layer: int, n_layers: int) -> int:
        return self.scorer.layer_budget(seq_len, layer, n_layers)

    def score(self, keys, values, queries=None, attention=None, **kwargs):
        return self.scorer.score(keys, values, queries, attention, **kwargs)

    def keep(self, scores: torch.Tensor, budget: int) -> Kept:
        """Per-head tokens for an average ``budget``: :class:`Kept` (indices padded to the
        largest head's count, ascending, and the counts)."""
        b, hkv, s = scores.shape
        if budget > s:
            raise ValueError(f"budget {budget} exceeds the {s} scored tokens")
        safe = top_indices(scores, int(budget * self.alpha_safeguard))
        ranked = scores.scatter(-1, safe, math.inf)
        best = top_indices(ranked.reshape(b, hkv * s), hkv * budget)  # (B, Hkv*budget)
        kept = torch.zeros(b, hkv * s, dtype=torch.bool, device=scores.device)
        kept = kept.scatter(-1, best, True).view(b, hkv, s)
        counts = kept.sum(-1)
        # kept tokens first, each run in index order (a stable sort of "not kept")
        order = torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices
        order = order[..., : int(counts.max()) if counts.numel() else 0]
        pad = torch.arange(order.shape[-1], device=scores.device) >= counts.unsqueeze(-1)
        return Kept(order.masked_fill(pad, 0), counts)
