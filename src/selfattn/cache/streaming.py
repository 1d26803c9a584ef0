"""``StreamingCache``: StreamingLLM's attention sinks plus a rolling window (Xiao et al., 2023).

A layer's cache that keeps the first ``n_sink`` tokens of a sequence (the "attention sinks":
the softmax dumps its excess mass on them, and dropping them is what makes plain windowing
fall apart past the window) and the last ``window`` tokens, so memory stays
``n_sink + window`` tokens at any length::

    absolute positions   0 1 2 3 | ... evicted ... | p-W+1 ... p-1 p
    cache slots          0 1 2 3 |                 | 4   ...        n_sink + W - 1
                         sinks                       the window (a ring), the query last

Positions (``positions=``):

- ``"cache"`` (the paper's choice, the default): a token's RoPE position is its slot in the
  cache, not its place in the text: sinks at ``0 .. n_sink - 1``, window tokens next, the query
  at the cache length. Keys are therefore cached UN-rotated (the layer hands over keys rotated
  at their slot of the step, :meth:`StreamingCache.next_positions`; the cache rotates them back
  once) and rotated at their current slots on every read, so relative distances never exceed
  the cache size however long the text: what lets a model run past its trained length.
- ``"absolute"``: RoPE positions are the tokens' places in the text (keys cached as rotated).
  RoPE sees distances only, so the window is unaffected, but the sinks drift ever further from
  the queries, past any distance the model was trained on.

Masks: a query sees the sinks and the keys of its window (``masks.sliding_window(window)``, its
own token included), causally. The returned keys are in slot order, so the mask is built from
the existing vocabulary in slot coordinates (:class:`StreamingKV`): ``causal() &
(padding(n_sinks) | sliding_window(window))``, where ``padding(n)`` is "key slot < n": slot
differences equal position differences inside the window's run, so this is the sink/window
rule at absolute positions. Nothing dense is built per step.

:class:`StreamingCaches` is the model-level cache (``CausalLM.make_cache("streaming",
n_sink=, window=)``): one StreamingCache per layer, planned with the slot positions.
:class:`~selfattn.cache.StreamingPagedKV` is the same policy over paged K/V.
"""

from __future__ import annotations

import torch

from selfattn import masks as _masks
from selfattn._validate import int_at_least, one_of, positive_int
from selfattn.cache.base import KV, Step
from selfattn.cache.layers import LayerCaches
from selfattn.cache.static import StaticCache, check_new_kv
from selfattn.cache.window import SlidingWindowCache
from selfattn.positions import DynamicNTK, LongRoPE

__all__ = ["POSITION_MODES", "StreamingCache", "StreamingCaches", "StreamingKV"]

POSITION_MODES = ("cache", "absolute")


class StreamingKV(KV):
    """``(k, v)`` in cache-slot order (sinks, then the window's run) returned by
    :meth:`StreamingCache.update`. ``n_sinks`` keys are sinks, ``window`` the window size and
    ``key_positions`` the keys' RoPE positions (slots in ``"cache"`` mode, text positions in
    ``"absolute"`` mode)."""

    def __new__(cls, k, v, n_sinks: int, window: int, key_positions: torch.Tensor):
        self = super().__new__(cls, k, v, 0)
        self.n_sinks, self.window, self.key_positions = n_sinks, window, key_positions
        return self

    @property
    def positions(self) -> torch.Tensor:
        return self.key_positions

    def at_key_positions(self, mask, score_mod, q_offset, q):
        """The sink/window mask in slot coordinates (module docstring), queries bottom-right.

        The layer's own mask may only be ``causal()`` (what a decoder block passes without an
        ``attention_mask``): the streaming cache decides which keys survive, so a mask at text
        positions (padding, documents, another window) cannot be honoured. Score mods see cache
        slots (ALiBi over slots is the paper's choice for ALiBi models)."""
        if mask is not None and not _masks.as_mask(mask).is_causal:
            raise ValueError(
                f"StreamingCache applies its own mask (causal, {self.n_sinks} sinks, window "
                f"{self.window}) and takes no other, got {mask!r}; run rows of equal length "
                "without an attention_mask, or use the 'static' or 'window' cache"
            )
        if q_offset is not None:
            raise ValueError(
                f"q_offset={q_offset} cannot be combined with StreamingCache: its queries are "
                "the last keys it returns; drop q_offset"
            )
        if self[0].shape[2] - self.n_sinks <= self.window:
            # The run fits the window (every decode step): each query sees every key up to its
            # own, and a plain causal mask keeps the fused no-mask kernels.
            return _masks.causal(), score_mod, None
        visible = _masks.sliding_window(self.window)
        if self.n_sinks:
            visible = _masks.padding(self.n_sinks) | visible
        return _masks.causal() & visible, score_mod, None


def check_rerotatable(owner: str, rope) -> None:
    """ValueError unless ``rope`` (None: no RoPE) rotates by a fixed angle per position."""
    if rope is not None and not callable(rope):
        raise TypeError(f"{owner} rope must be a RoPE module, got {type(rope)}")
    if rope is not None and isinstance(rope.scaling, (DynamicNTK, LongRoPE)):
        # DynamicNTK/LongRoPE change their frequencies with the length: no fixed rotation to
        # undo, and slot positions never reach the lengths they were made for anyway.
        raise ValueError(
            f"{owner} cannot re-rotate keys under a length-dependent RoPE scaling "
            f"({type(rope.scaling).__name__}); use positions='absolute' or a fixed scaling"
        )


def rotate_back(rope, k: torch.Tensor, positions: torch.Tensor, *, undo_factor: bool = True):
    """``k`` rotated by ``R(-p)`` at ``positions`` ``p``: with ``undo_factor`` (``k = a R(p) x``
    as ``rope`` made it, ``a`` its attention factor: YaRN's) back to ``x``, else ``a R(q - p) x``
    for a ``k = a R(q) x`` (a key moved ``p`` slots down). ``R(-p) = F R(p) F`` with ``F`` the
    reflection negating each pair's second coordinate (RoPE takes positions >= 0 only), so
    ``F rope(F k, p) = a R(-p) k``."""
    r = rope.rotary_dim
    flip = torch.ones(k.shape[-1], dtype=k.dtype, device=k.device)
    if rope.interleaved:
        flip[1:r:2] = -1
    else:
        flip[r // 2 : r] = -1
    out = rope(k * flip, positions) * flip
    factor = float(rope.attention_factor) ** (2 if undo_factor else 1)
    return out if factor == 1.0 else torch.cat((out[..., :r] / factor, out[..., r:]), -1)


class StreamingCache:
    """KV cache keeping ``n_sink`` sink tokens and a rolling ``window`` (module docstring).

    ``StreamingCache(batch, n_sink, window, n_kv_heads, head_dim, value_dim=None, *,
    positions="cache", rope=None, dtype, device)``. Memory layout: the sinks in a
    :class:`StaticCache` of ``n_sink`` slots, the later tokens in a :class:`SlidingWindowCache`
    ring of ``window`` slots: ``n_sink + window`` tokens at any length (``n_sink=0`` is plain
    windowing). ``length`` counts every token appended (absolute).

    ``rope`` (the layer's RoPE, needed in ``"cache"`` mode for a RoPE model; None for models
    without RoPE, whose keys carry no position) re-rotates the keys by slot. In ``"cache"`` mode
    the layer must rotate each step's q and k at :meth:`next_positions` (``StreamingCaches.plan``
    does that for a model); in ``"absolute"`` mode at ``length + arange(S)`` (the default).

    :meth:`update` returns a :class:`StreamingKV`: the sinks, then the last
    ``min(length - n_sink, window - 1)`` window tokens and the ``S`` new ones, in position order.
    """

    def __init__(
        self,
        batch: int,
        n_sink: int,
        window: int,
        n_kv_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        positions: str = "cache",
        rope=None,
        dtype=torch.float32,
        device=None,
    ):
        int_at_least(n_sink, "StreamingCache n_sink", 0)
        positive_int(window, "StreamingCache window")
        self.mode = one_of(positions, "StreamingCache positions", POSITION_MODES)
        check_rerotatable(type(self).__name__, rope)
        self.n_sink, self.rope = n_sink, rope
        shape = (n_kv_heads, head_dim, value_dim)
        fk = {"dtype": dtype, "device": device}
        self.sinks = StaticCache(batch, n_sink, *shape, **fk) if n_sink else None
        self.ring = SlidingWindowCache(batch, window, *shape, **fk)
        self.length = 0

    @property
    def window(self) -> int:
        return self.ring.window

    @property
    def capacity(self) -> int:
        """Tokens held at most: ``n_sink + window``."""
        return self.n_sink + self.window

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every token (the storage is kept)."""
        self.length = 0
        self.ring.reset()
        if self.sinks is not None:
            self.sinks.reset()

    def _held_before(self, n_new: int) -> int:
        """Keys returned ahead of ``n_new`` new tokens: every sink cached so far and the window
        tokens the first new query still sees (at most ``window - 1``)."""
        ring_len = max(self.length - self.n_sink, 0)
        return min(self.length, self.n_sink) + min(ring_len, self.window - 1)

    def next_positions(self, n_tokens: int, device=None) -> torch.Tensor:
        """``(S,)`` RoPE positions for the next ``n_tokens`` tokens: their slots in the returned
        keys (``"cache"`` mode; a decode step's query sits at ``n_sink + window - 1`` once full)
        or their text positions ``length + arange(S)`` (``"absolute"``)."""
        first = self._held_before(n_tokens) if self.mode == "cache" else self.length
        return torch.arange(first, first + n_tokens, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None) -> StreamingKV:
        """Append ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` (rotated at
        :meth:`next_positions`); returns the :class:`StreamingKV` the step's queries attend.

        ``positions`` (optional ``(S,)``) must be those :meth:`next_positions`: the cache only
        appends."""
        store = self.ring.k
        S = check_new_kv(store, self.ring.v, k, v)
        want = self.next_positions(S, store.device)
        if positions is not None:
            positions = torch.as_tensor(positions, device=store.device)
            if positions.shape != (S,) or not torch.equal(positions.long(), want):
                raise ValueError(
                    f"StreamingCache ({self.mode!r} positions) appends only: positions must be "
                    f"{want.tolist()} (length={self.length}, S={S}), got {positions.tolist()}; "
                    "reset() the cache to start a new sequence"
                )
        rerotate = self.mode == "cache" and self.rope is not None
        if rerotate:  # keys are cached un-rotated: the slots move as the window slides
            k = rotate_back(self.rope, k, want)
        n_new_sinks = min(max(self.n_sink - self.length, 0), S)
        parts_k, parts_v, n_sinks = [], [], min(self.length + S, self.n_sink)
        if self.sinks is not None:
            sk, sv = self.sinks.update(k[:, :, :n_new_sinks], v[:, :, :n_new_sinks])
            parts_k.append(sk)
            parts_v.append(sv)
        ring = self.ring.update(k[:, :, n_new_sinks:], v[:, :, n_new_sinks:])
        k_all = torch.cat([*parts_k, ring[0]], dim=2)  # (B, Hkv, n_sinks + n_run, D)
        v_all = torch.cat([*parts_v, ring[1]], dim=2)
        self.length += S
        Sk = k_all.shape[2]
        slots = torch.arange(Sk, device=store.device)
        if rerotate:
            k_all = self.rope(k_all, slots)
        if self.mode == "cache":
            key_positions = slots
        else:  # the run's text positions start after the sinks' own
            run = torch.arange(Sk - n_sinks, device=store.device) + self.n_sink + ring.start
            key_positions = torch.cat([slots[:n_sinks], run])
        return StreamingKV(k_all, v_all, n_sinks, self.window, key_positions)

    def __repr__(self) -> str:
        return (
            f"StreamingCache(n_sink={self.n_sink}, window={self.window}, "
            f"positions={self.mode!r}, length={self.length})"
        )


class StreamingCaches(LayerCaches):
    """A model's streaming caches, one :class:`StreamingCache` per layer
    (``CausalLM.make_cache("streaming", ...)``): :meth:`plan` hands out the new tokens' RoPE
    positions from :meth:`StreamingCache.next_positions` (slots in ``"cache"`` mode)."""

    def __init__(self, layers: list, device=None):
        super().__init__("streaming", layers, device)

    def plan(self, n_tokens: int) -> Step:
        return Step(self.layers, self.layers[0].next_positions(n_tokens, self.device), self.length)

    @property
    def memory_bytes(self) -> int:
        """Bytes of K/V storage over all layers (fixed at construction: bounded by design)."""
        total = 0
        for c in self.layers:
            for t in (c.ring.k, c.ring.v, *(() if c.sinks is None else (c.sinks.k, c.sinks.v))):
                total += t.numel() * t.element_size()
        return total
