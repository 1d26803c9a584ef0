"""The KV cache contract: what a layer asks of its cache, and what a model asks of its caches.

A layer's cache (:class:`KVCache`) stores each step's keys/values and hands back every key the
step's queries may see, WITH their absolute positions::

    kv = cache.update(k, v)     # k (B, Hkv, S, D), v (B, Hkv, S, Dv): this step's new tokens
    k_all, v_all = kv           # (B, Hkv, Sk, D), (B, Hkv, Sk, Dv): still unpacks as a pair
    kv.start                    # absolute position of key 0; key j sits at kv.start + j
    kv.positions                # (Sk,) int64: kv.start + arange(Sk)

``update`` returns a :class:`KV`, a ``(k, v)`` tuple that also carries its keys' positions.
Design choice: the positions ride on the returned pair rather than being a third element, so
every existing ``k, v = cache.update(...)`` keeps working, and a cache that keeps only part of
the history says where that part starts. ``start`` is 0 for a :class:`StaticCache` (it keeps
every key); a :class:`SlidingWindowCache` returns the last ``window - 1`` keys before the new
ones, so with ``n`` tokens cached before the step its ``start`` is ``max(0, n - window + 1)``.
The layer then evaluates masks and score mods at those true positions
(:meth:`KV.at_key_positions`), so a model builds one mask in absolute positions for every layer
and never asks which cache a layer has. Keys are consecutive positions (one ``start``): every
cache here stores a contiguous run.

Caches that attend in place (:class:`InPlaceKVCache`: the paged caches) never hand out
contiguous keys: the layer gives them ``q, k, v`` and they write the new K/V into their pages
and run :func:`~selfattn.cache.paged_attention` over them, per sequence at its own length.

A model's cache (:class:`ModelKVCache`) is planned once per forward step: ``step =
cache.plan(S)`` does the bookkeeping for ``S`` new tokens of every row (for the paged KV: page
allocation, copy-on-write, block table, lengths and write slots, once for all layers) and
returns a :class:`Step` whose ``layers[i]`` is layer ``i``'s cache for this step. A planned
step is itself a model cache (``step.plan(S)`` returns it), so a caller may plan outside a
compiled region and pass the step as ``cache=``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from selfattn.masks import as_mask
from selfattn.scores import as_score_mod

__all__ = [
    "KV",
    "InPlaceKVCache",
    "KVCache",
    "ModelKVCache",
    "Step",
    "hole_mask",
    "next_position",
    "next_positions",
    "real_entries",
]


class KV(tuple):
    """``(k, v)`` returned by :meth:`KVCache.update`, with ``start``, the absolute position of
    key 0 (keys are consecutive: key ``j`` at ``start + j``), and ``holes``: None, or
    ``(B, Hkv, 2)`` int64 ``[lo, hi)`` key ranges that sequence ``b``'s KV head ``h`` skips
    (a :class:`StaticCache` compacted to ragged per-head counts, AdaKV's)."""

    holes: torch.Tensor | None = None

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, start: int = 0, holes=None):
        self = super().__new__(cls, (k, v))
        self.start = start
        if holes is not None:
            self.holes = holes
        return self

    @property
    def positions(self) -> torch.Tensor:
        """``(Sk,)`` int64 absolute positions of the keys, on their device."""
        k = self[0]
        return torch.arange(self.start, self.start + k.shape[2], device=k.device)

    def at_key_positions(self, mask, score_mod, q_offset: int | None, q: torch.Tensor):
        """``(mask, score_mod, q_offset)`` for ``attention(q, k, v, ...)`` over these keys such
        that masks and score mods see absolute positions: key ``j`` at ``start + j``, query row
        ``i`` at ``q_offset + i`` (default bottom-right: the queries, ``q (B, Hq, Sq, D)``, are
        the last ``Sq`` keys), and every head skips its ``holes``. Unchanged when ``start`` is 0
        and there are no holes.

        The mask and score mod are checked here for the whole key range ``0 .. start + Sk - 1``
        (a shifted mask cannot know where its keys end), then shifted
        (:meth:`selfattn.masks.Mask.shifted`)."""
        if self.start:
            B, Hq, Sq, _ = q.shape
            n = self.start + self[0].shape[2]  # keys 0 .. n - 1; these are the last ones
            q_offset = n - Sq if q_offset is None else q_offset
            if mask is not None:
                mask = as_mask(mask)
                mask.validate(B, Hq, Sq, n, q_offset)
                mask = mask.shifted(self.start)
            if score_mod is not None:
                score_mod = as_score_mod(score_mod)
                score_mod.validate(B, Hq, Sq, n, q_offset)
                score_mod = score_mod.shifted(self.start)
        if self.holes is not None:
            mask = hole_mask(mask, self.holes, q.shape[1])
        return mask, score_mod, q_offset


def real_entries(counts, dims: dict[str, int], n: int, device=None) -> torch.Tensor:
    """``(*dims, n)`` bool on ``device``: which of ``n`` ragged rows per head are real (the
    first ``counts[..., h]``); ``counts``: integers of shape ``dims`` (named sizes, for the
    error), each in ``0..n``. ValueError naming bad counts."""
    shape = tuple(dims.values())
    counts = torch.as_tensor(counts)
    if counts.shape != shape or counts.is_floating_point() or counts.dtype == torch.bool:
        named = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise ValueError(f"counts must be ({named}) integers, got {tuple(counts.shape)}")
    counts = counts.to(device=device, dtype=torch.long)
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > n):
        raise ValueError(f"counts must be in 0..{n} ({n} rows per head), got {counts.tolist()}")
    return torch.arange(n, device=counts.device) < counts.unsqueeze(-1)


def hole_mask(mask, holes: torch.Tensor, n_q_heads: int):
    """``mask`` (any accepted form, or None) and not in query head ``h``'s KV head's hole:
    ``holes (Hkv, 2)`` (one sequence's layer, every batch row alike) or ``(B, Hkv, 2)`` (per
    sequence), ``[lo, hi)`` key indices of the call. Query head ``h`` reads KV head
    ``h // (n_q_heads // Hkv)``."""
    holes = holes if holes.dim() == 3 else holes.unsqueeze(0)  # (B or 1, Hkv, 2)
    G = n_q_heads // holes.shape[1]
    lo, hi = holes[..., 0].repeat_interleave(G, 1), holes[..., 1].repeat_interleave(G, 1)
    per_row = lo.shape[0] > 1  # (B or 1, Hq) each

    def outside_hole(b, h, q_idx, kv_idx):
        h = torch.as_tensor(h, device=lo.device)
        b = torch.as_tensor(b, device=lo.device) if per_row else torch.zeros_like(h)
        return (kv_idx < lo[b, h]) | (kv_idx >= hi[b, h])

    kept = as_mask(outside_hole)  # a mask_mod callable
    return kept if mask is None else as_mask(mask) & kept


@runtime_checkable
class KVCache(Protocol):
    """A layer's KV cache that returns contiguous keys (``StaticCache``, ``SlidingWindowCache``).

    ``update(k (B, Hkv, S, D), v (B, Hkv, S, Dv), positions=None) -> KV``: store the ``S`` new
    tokens (at ``positions`` ``(S,)``, default the next ``S``) and return every key the new
    queries may see with their positions (module docstring). ``length``: tokens cached (one past
    the highest position written). ``reset()``: forget them all, keeping the storage.
    """

    length: int

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None) -> KV: ...

    def reset(self) -> None: ...


@runtime_checkable
class InPlaceKVCache(Protocol):
    """A layer's cache that attends over its own storage (the paged caches).

    ``attend(q (B, Hq, Sq, D), k (B, Hkv, Sq, D), v (B, Hkv, Sq, Dv), *, mask, score_mod, scale,
    return_weights[, sinks]) -> out (B, Hq, Sq, Dv)`` (or ``(out, weights)``; ``sinks (Hq,)``:
    learned attention-sink logits, passed only when set): append ``k``, ``v`` after
    each sequence's cached tokens, then attend ``q``, query row ``i`` of sequence ``b`` at
    position ``lengths[b] + i``. ``lengths (B,)`` int64: tokens cached per sequence before the
    step (sequences may differ: a ragged batch).
    """

    lengths: torch.Tensor

    def attend(self, q, k, v, *, mask=None, score_mod=None, scale=None, return_weights=False): ...


def attends_in_place(cache) -> bool:
    """``isinstance(cache, InPlaceKVCache)`` at the cost of one attribute lookup.

    typing's runtime protocol check walks the protocol's members on every call (about 40 µs on
    Python 3.11), and a decode step asks it twice per layer: a third of a small model's
    per-step Python time. The same contract is read off the class: an ``attend`` method and
    ``lengths`` (a class attribute or property, or an instance attribute).
    """
    cls = type(cache)
    if not callable(getattr(cls, "attend", None)):
        return False
    return hasattr(cls, "lengths") or "lengths" in getattr(cache, "__dict__", ())


def next_position(cache) -> int:
    """The position of a layer cache's next token: its ``position`` where it keeps fewer slots
    than tokens seen (a :class:`~selfattn.cache.StaticCache` after ``compact``), else its
    ``length``."""
    return getattr(cache, "position", cache.length)


def next_positions(past, n_tokens: int, device=None) -> torch.Tensor:
    """Absolute positions of ``n_tokens`` new tokens appended after ``past`` cached ones.

    ``past``: an int (on ``device``) or a 0-d tensor (every row alike) gives ``(S,)``
    ``past + arange(S)``; a ``(B,)`` tensor of per-sequence lengths (a ragged paged batch) gives
    ``(B, S)`` ``past[b] + arange(S)``. A tensor ``past`` keeps its device.
    """
    if not isinstance(past, torch.Tensor):
        return torch.arange(past, past + n_tokens, device=device)
    new = torch.arange(n_tokens, device=past.device)
    return past[:, None] + new if past.dim() == 1 else new + past  # (B,) -> (B, S) | (S,)


@dataclasses.dataclass(eq=False)
class Step:
    """One planned forward step of a model cache: ``layers[i]`` is layer ``i``'s cache,
    ``positions`` the absolute positions of the step's new tokens (``(S,)`` when every row has
    the same length, else ``(B, S)``) and ``past`` the tokens cached before the step (None when
    the rows differ)."""

    layers: Sequence
    positions: torch.Tensor
    past: int | None

    @property
    def n_tokens(self) -> int:
        return self.positions.shape[-1]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """Tokens cached before this step (ValueError when the rows differ)."""
        if self.past is None:
            raise ValueError(
                "the sequences of this step have different lengths; a ragged step has no "
                "single length (pass no attention_mask)"
            )
        return self.past

    def plan(self, n_tokens: int) -> Step:
        """This step itself (it is planned already) for ``n_tokens`` new tokens per row."""
        if n_tokens != self.n_tokens:
            raise ValueError(
                f"this step was planned for {self.n_tokens} new token(s) per row but the input "
                f"has {n_tokens}; plan the cache for the input's length"
            )
        return self


class ModelKVCache(Protocol):
    """A model's caches, one per layer (``CausalLM.make_cache``): ``plan(S) -> Step`` once per
    forward step (module docstring), ``n_layers``, ``length`` (tokens cached, the same for
    every row; a ragged paged batch raises) and ``reset()``."""

    @property
    def n_layers(self) -> int: ...

    @property
    def length(self) -> int: ...

    def plan(self, n_tokens: int) -> Step: ...

    def reset(self) -> None: ...
