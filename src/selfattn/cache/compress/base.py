"""The press contract: score each cached token, size a layer's budget, keep the best, gather.

A press is a frozen dataclass over one layer's dense K/V, ``keys``/``values (B, Hkv, S, D)``
with RoPE already applied to the keys (as a cache holds them). Its steps::

    scores = press.score(keys, values, queries, attention, layer=, n_layers=)   # (B, Hkv, S)
    n = press.budget(S, layer, n_layers)          # tokens kept per head in this layer
    idx = press.keep(scores, n)                   # (B, Hkv, n), ascending per head
    keys2, values2 = press.compress(keys, values, idx)

or all at once, :meth:`Press.apply`. ``compression_ratio`` has kvpress's meaning: the fraction of
the prompt's tokens removed, so a layer keeps ``int(S * (1 - compression_ratio))`` (kvpress's
``ScorerPress`` rounding, kept for parity); ``0`` is an exact no-op (the same tensors back).

Tokens a policy always keeps (an observation window, attention sinks) score ``+inf``; a budget
below their count is a ValueError, never a silent partial window. Selection is deterministic:
the highest scores win, ties go to the lowest token index (the oldest), NaN scores rank lowest.
Scores are float32 (float64 for float64 keys) whatever the K/V dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

__all__ = [
    "Compressed",
    "Kept",
    "Press",
    "check_kv",
    "compress_kv",
    "group_mean",
    "top_indices",
    "window_attention",
    "work_dtype",
]


class Kept(NamedTuple):
    """Ragged per-head selection: ``indices (B, Hkv, max(counts))`` ascending per head, the
    first ``counts[b, h]`` real and the rest padding (index 0); ``counts (B, Hkv)``."""

    indices: torch.Tensor
    counts: torch.Tensor


class Compressed(NamedTuple):
    """:meth:`Press.apply`'s result: the kept ``keys``/``values (B, Hkv, n, D)``, their
    original token ``indices (B, Hkv, n)`` (ascending) and, for a ragged press, ``counts
    (B, Hkv)`` (rows past a head's count are zeros); ``counts`` is None otherwise."""

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    counts: torch.Tensor | None


def work_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for float64 input, float32 otherwise: the dtype scores are computed in."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_kv(keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int, int]:
    """``(B, Hkv, S, D)`` of ``keys``, after checking ``values`` matches its first three dims."""
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys and values must be (B, Hkv, S, D) with equal B, Hkv, S, got keys "
            f"{tuple(keys.shape)} and values {tuple(values.shape)}"
        )
    return tuple(keys.shape)


def _check_rows(t: torch.Tensor, name: str, keys: torch.Tensor, last: int, what: str) -> int:
    b, hkv, _, _ = keys.shape
    if t.dim() != 4 or t.shape[0] != b or t.shape[-1] != last or t.shape[1] % hkv:
        raise ValueError(
            f"{name} must be (B={b}, Hq, rows, {what}={last}) with Hq a multiple of "
            f"Hkv={hkv}, got {tuple(t.shape)}"
        )
    return t.shape[2]


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Softmax weights of the last ``W`` tokens' queries over every key, causally.

    ``queries (B, Hq, W, D)`` are the rotated queries of positions ``S-W .. S-1``, ``keys (B,
    Hkv, S, D)`` (query head ``h`` reads KV head ``h // (Hq / Hkv)``); returns ``(B, Hq, W, S)``
    in :func:`work_dtype`, zero above the diagonal: row ``i`` sees keys ``0 .. S-W+i``.
    """
    b, hkv, s, d = keys.shape
    w = _check_rows(queries, "queries", keys, d, "D")
    if w > s:
        raise ValueError(f"queries has {w} rows, more than the {s} keys they attend to")
    hq = queries.shape[1]
    work = work_dtype(keys)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = queries.to(work).view(b, hkv, hq // hkv, w, d)
    k = keys.to(work).unsqueeze(2)  # (B, Hkv, S, D) -> (B, Hkv, 1, S, D)
    logits = (q @ k.transpose(-1, -2)).view(b, hq, w, s)  # (B, Hkv, g, W, S) -> (B, Hq, W, S)
    rows = torch.arange(w, device=keys.device).unsqueeze(1) + (s - w)
    future = torch.arange(s, device=keys.device) > rows  # (W, S)
    # in place: one (B, Hq, W, S) tensor besides the result, however long the rows
    return logits.mul_(scale).masked_fill_(future, -math.inf).softmax(-1)


def attention_rows(
    queries: torch.Tensor | None,
    attention: torch.Tensor | None,
    keys: torch.Tensor,
    rows: int,
    scale: float | None,
    policy: str,
) -> torch.Tensor:
    """The last ``rows`` rows ``(B, Hq, rows, S)`` of the attention weights: from ``attention``
    where given (weights of the last queries over all S keys), else computed from ``queries``."""
    s = keys.shape[2]
    if attention is not None:
        have = _check_rows(attention, "attention", keys, s, "S")
        source = attention
    elif queries is not None:
        have = _check_rows(queries, "queries", keys, keys.shape[-1], "D")
        source = queries
    else:
        raise ValueError(f"{policy} scores from attention: pass queries= or attention=")
    if have < rows:
        raise ValueError(
            f"{policy} needs the last {rows} query rows, got {have}; pass at least "
            f"press.query_rows(S) = {rows} rows"
        )
    if attention is not None:
        return attention[:, :, have - rows :].to(work_dtype(keys))
    return window_attention(source[:, :, have - rows :], keys, scale)


def group_mean(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """``(B, Hq, ...) -> (B, Hkv, ...)``: the mean over each KV head's group of query heads."""
    b, hq = x.shape[:2]
    return x.view(b, n_kv_heads, hq // n_kv_heads, *x.shape[2:]).mean(2)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest ``scores`` along the last dim, best first; ties go to the
    lower index and NaN ranks below everything (a stable descending sort)."""
    clean = torch.where(torch.isnan(scores), -math.inf, scores)
    return torch.sort(clean, dim=-1, descending=True, stable=True).indices[..., :k]


def compress_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each head's kept tokens: ``indices (B, Hkv, n)`` -> ``(B, Hkv, n, D)`` keys and
    values; with ``counts (B, Hkv)`` the rows past a head's count are zeroed (padding)."""
    b, hkv, s, _ = check_kv(keys, values)
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (b, hkv):
        raise ValueError(f"indices must be (B={b}, Hkv={hkv}, n), got {tuple(indices.shape)}")
    if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < s):
        lo, hi = int(indices.min()), int(indices.max())
        raise ValueError(f"indices must lie in [0, {s}), got {lo}..{hi}")
    k = keys.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    v = values.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
    if counts is not None:
        pad = torch.arange(indices.shape[-1], device=indices.device) >= counts.unsqueeze(-1)
        k, v = k.masked_fill(pad.unsqueeze(-1), 0), v.masked_fill(pad.unsqueeze(-1), 0)
    return k, v


def _check_ratio(ratio) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise ValueError(
            f"compression_ratio must be a number in [0, 1) (the fraction of the prompt's KV "
            f"removed; 0 keeps every token), got {ratio!r}"
        )


def check_count(value, name: str, minimum: int) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Press:
    """A KV-compression policy (module docstring). Fields: ``compression_ratio`` in [0, 1) and
    ``window``, the last tokens always kept (the observation window where the policy has one).

    Class attributes: ``name`` (the registry's), ``ragged`` (per-head budgets: :meth:`keep`
    returns :class:`Kept`), ``decodes`` (usable by :class:`~selfattn.cache.compress.DecodeScores`)
    and ``rotated_queries`` (False: ``queries`` are taken before RoPE).
    """

    compression_ratio: float = 0.0
    window: int = 0

    name: ClassVar[str] = "press"
    ragged: ClassVar[bool] = False
    decodes: ClassVar[bool] = False
    rotated_queries: ClassVar[bool] = True

    def __post_init__(self):
        _check_ratio(self.compression_ratio)
        check_count(self.window, f"{self.name} window", 0)

    # -- what the caller must provide
    def query_rows(self, seq_len: int) -> int:
        """How many of the last queries :meth:`score` reads (0: none)."""
        return 0

    @property
    def sinks(self) -> int:
        """The first tokens always kept (attention sinks; 0 where the policy has none)."""
        return 0

    def protected(self, seq_len: int) -> int:
        """How many tokens are always kept (they score +inf): the sinks and the window."""
        return min(self.sinks + self.window, seq_len)

    def statistic(self):
        """A fresh accumulator of what :meth:`score` reads, fed chunk by chunk during a
        prefill (:mod:`selfattn.cache.compress.statistics`), for a policy that reads (nearly)
        every prompt query; None for one that reads a few rows (pass those as ``queries``)."""
        return None

    def _check_statistic(self, statistic, queries, attention) -> None:
        fresh = self.statistic()
        if fresh is None or type(statistic) is not type(fresh):
            want = "queries=" if fresh is None else type(fresh).__name__
            raise ValueError(
                f"{self.name} scores from {want}, got statistic={type(statistic).__name__}"
            )
        if queries is not None or attention is not None:
            raise ValueError(
                f"{self.name}: pass statistic= or queries=/attention=, not both (the statistic "
                "already holds the prefill's rows)"
            )

    # -- the budget
    def layer_budget(self, seq_len: int, layer: int, n_layers: int) -> int:
        """The policy's budget before the checks of :meth:`budget`."""
        return int(seq_len * (1 - self.compression_ratio))

    def budget(self, seq_len: int, layer: int = 0, n_layers: int = 1) -> int:
        """Tokens kept per head in ``layer`` of ``n_layers`` for a ``seq_len``-token prompt:
        ``seq_len`` at ratio 0; ValueError where it cannot hold the protected tokens."""
        check_count(seq_len, "seq_len", 1)
        check_count(n_layers, "n_layers", 1)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(f"layer must be an int in [0, n_layers={n_layers}), got {layer!r}")
        if self.compression_ratio == 0:
            return seq_len
        n = self.layer_budget(seq_len, layer, n_layers)
        need = max(1, self.protected(seq_len))
        if n < need:
            raise ValueError(
                f"{self.name}: budget {n} tokens (seq_len {seq_len}, compression_ratio "
                f"{self.compression_ratio}, layer {layer}) is below the {need} tokens it always "
                f"keeps (window {self.window}); lower compression_ratio or the window, or leave "
                "prompts this short uncompressed"
            )
        return n

    # -- scoring and selection
    def score(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None = None,
        attention: torch.Tensor | None = None,
        *,
        layer: int = 0,
        n_layers: int = 1,
        positions: torch.Tensor | None = None,
        rope=None,
        scale: float | None = None,
        statistic=None,
    ) -> torch.Tensor:
        """Importance ``(B, Hkv, S)`` of each token, higher kept first, protected ones +inf.

        ``queries (B, Hq, R, D)``: the last ``R >= query_rows(S)`` tokens' queries, rotated
        (pre-RoPE where ``rotated_queries`` is False); ``attention (B, Hq, R, S)``: their
        softmax weights over all keys, used instead of recomputing them where the policy
        scores from attention; ``statistic``: instead of either, what :meth:`statistic`
        gathered over the prefill's chunks. ``positions (S,)``: the keys' absolute positions
        (default ``0 .. S-1``); ``rope``: a callable ``rope(x (B, H, S, D), positions (S,))``
        such as :class:`selfattn.positions.RoPE`; ``scale``: the softmax scale (default
        1/sqrt(D)).
        """
        s = check_kv(keys, values)[2]
        if statistic is not None:
            self._check_statistic(statistic, queries, attention)
        if s <= self.protected(s):
            raise ValueError(
                f"{self.name} scores past its {self.sinks} sinks and window {self.window}: "
                f"seq_len {s} leaves no token to score; pass more tokens or a smaller window"
            )
        scores = self.raw_score(
            keys,
            values,
            queries,
            attention,
            layer=layer,
            n_layers=n_layers,
            positions=positions,
            rope=rope,
            scale=scale,
            statistic=statistic,
        )
        scores = scores.clone()
        scores[..., : self.sinks] = math.inf
        scores[..., s - self.window :] = math.inf
        return scores

    def raw_score(self, keys, values, queries, attention, **kwargs) -> torch.Tensor:
        """The policy's scores ``(B, Hkv, S)``; :meth:`score` then sets the protected ones to
        +inf (so their values here do not matter)."""
        raise NotImplementedError(f"{type(self).__name__} has no score")

    def keep(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """The ``budget`` best tokens per head, ``(B, Hkv, budget)`` ascending (ties: lowest
        index first)."""
        if budget > scores.shape[-1]:
            raise ValueError(f"budget {budget} exceeds the {scores.shape[-1]} scored tokens")
        return top_indices(scores, budget).sort(-1).values

    def compress(self, keys, values, indices, counts=None):
        """:func:`compress_kv`."""
        return compress_kv(keys, values, indices, counts)

    def apply(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None = None,
        attention: torch.Tensor | None = None,
        *,
        layer: int = 0,
        n_layers: int = 1,
        **kwargs,
    ) -> Compressed:
        """Score, budget, keep and gather one layer (arguments as :meth:`score`). At ratio 0
        the very ``keys``/``values`` come back with indices ``0 .. S-1``."""
        b, hkv, s, _ = check_kv(keys, values)
        n = self.budget(s, layer, n_layers)
        if n == s:
            every = torch.arange(s, device=keys.device).expand(b, hkv, s)
            return Compressed(keys, values, every, None)
        scores = self.score(
            keys, values, queries, attention, layer=layer, n_layers=n_layers, **kwargs
        )
        chosen = self.keep(scores, n)
        if isinstance(chosen, Kept):
            return Compressed(*compress_kv(keys, values, *chosen), *chosen)
        return Compressed(*compress_kv(keys, values, chosen), chosen, None)


__all__ += ["attention_rows", "check_count"]
