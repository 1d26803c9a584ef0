"""``StaticCache``: the preallocated per-layer KV cache of DESIGN.md's cache contract."""

from __future__ import annotations

from selfattn.nn.attention import ContiguousCache

__all__ = ["StaticCache"]


class StaticCache(ContiguousCache):
    """A per-layer KV cache preallocated to ``max_len`` tokens; :class:`ContiguousCache` itself.

    ``StaticCache(batch, max_len, n_kv_heads, head_dim, value_dim=None, *, dtype, device)``.
    Memory layout: ``k (B, Hkv, max_len, D)``, ``v (B, Hkv, max_len, Dv)``, slot ``t`` holding
    cache position ``t``. ``update(k, v, positions=None)`` writes ``S`` tokens at slots
    ``positions`` (default the next ``S``) and returns views ``(B, Hkv, length, D/Dv)`` of the
    filled prefix; ``length`` is one past the highest slot written, ``reset()`` empties it. Exactly
    ``max_len`` tokens fit; a write past them raises ``ValueError`` naming the slots and
    ``max_len``. The storage never reallocates, so its addresses stay fixed across steps.

    The layer (:class:`selfattn.nn.MultiHeadAttention`) already ships this cache as
    ``ContiguousCache``; this name is the one DESIGN.md's ``selfattn.cache`` gives it, kept as a
    subclass so one piece of code serves both.
    """
