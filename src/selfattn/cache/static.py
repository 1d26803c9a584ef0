"""``StaticCache``: the preallocated per-layer KV cache (``selfattn.nn.ContiguousCache``)."""

from __future__ import annotations

import torch

from selfattn._validate import positive_int
from selfattn.cache.base import KV, real_entries

__all__ = ["StaticCache"]


def dense_storage(owner: str, batch, slots, n_kv_heads, head_dim, value_dim, dtype, device):
    """Zeroed ``k (B, Hkv, n, D)``, ``v (B, Hkv, n, Dv)`` for ``slots = (name, n)``, after
    checking every size (errors name ``owner``, the cache class)."""
    for name, x in (("batch", batch), slots, ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        positive_int(x, f"{owner} {name}")
    value_dim = head_dim if value_dim is None else positive_int(value_dim, f"{owner} value_dim")
    k = torch.zeros(batch, n_kv_heads, slots[1], head_dim, dtype=dtype, device=device)
    v = torch.zeros(batch, n_kv_heads, slots[1], value_dim, dtype=dtype, device=device)
    return k, v


def check_new_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k, v) -> int:
    """``S`` of new ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` matching a dense cache's
    ``(B, Hkv, ·, D/Dv)`` storage; ValueError naming both shapes otherwise."""
    B, H, _, D = cache_k.shape
    S = k.shape[2] if k.dim() == 4 else -1
    if k.dim() != 4 or tuple(k.shape) != (B, H, S, D):
        raise ValueError(
            f"cache expects k of shape (B={B}, Hkv={H}, S, D={D}), got {tuple(k.shape)}; "
            "build the cache with the model's batch, n_kv_heads and head_dim"
        )
    want_v = (B, H, S, cache_v.shape[3])
    if tuple(v.shape) != want_v:
        raise ValueError(f"cache expects v of shape {want_v} (matching k), got {tuple(v.shape)}")
    return S


class StaticCache:
    """A per-layer KV cache preallocated to ``max_len`` tokens (:mod:`selfattn.cache.base`).

    ``StaticCache(batch, max_len, n_kv_heads, head_dim, value_dim=None, *, dtype, device)``.
    Memory layout: ``k (B, Hkv, max_len, D)``, ``v (B, Hkv, max_len, Dv)``, slot ``t`` holding
    the token at position ``t`` of every sequence. :meth:`update` writes new keys/values at the
    given slots and returns the filled prefix ``[:length]`` (key ``j`` at position ``j``), which
    is what attention reads; the queries of that step are its last ``Sq`` rows (bottom-right
    alignment). Exactly ``max_len`` tokens fit; a write past them raises ``ValueError`` naming
    the slots and ``max_len``. After a ragged :meth:`compact` the returned keys carry each
    head's hole (``KV.holes``), which attention skips. The storage never reallocates, so its
    addresses stay fixed across steps. ``selfattn.nn.ContiguousCache`` is this class under the
    layer's old name.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        dtype=torch.float32,
        device=None,
    ):
        self.k, self.v = dense_storage(
            type(self).__name__, batch, ("max_len", max_len), n_kv_heads, head_dim, value_dim,
            dtype, device,
        )  # fmt: skip
        self.length = 0
        self.evicted = 0  # tokens removed by compact(): positions run ahead of slots by this
        self.holes = None  # (B, Hkv, 2) [lo, hi) slots each head skips after a ragged compact

    @property
    def position(self) -> int:
        """The next token's position: tokens seen, ``length`` plus those :meth:`compact`
        removed."""
        return self.length + self.evicted

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every token (the storage is kept and overwritten by later updates)."""
        self.length = self.evicted = 0
        self.holes = None

    def compact(self, k: torch.Tensor, v: torch.Tensor, counts=None) -> None:
        """Keep only ``k (B, Hkv, n, D)``, ``v (B, Hkv, n, Dv)`` (a subset of the cached tokens,
        oldest first) in slots ``0 .. n - 1``; ``position`` stays, so later tokens continue
        at their true positions in the slots after ``n``.

        ``counts (B, Hkv)``: ragged per-head counts (AdaKV's budgets): sequence ``b``'s head
        ``h`` keeps its first ``counts[b, h]`` rows, and slots ``[counts[b, h], n)`` become
        its hole, zeroed and skipped by attention (``update`` returns them as ``KV.holes``).
        A cache compacts once; :meth:`reset` clears the holes."""
        n = check_new_kv(self.k, self.v, k, v)
        if n > self.length:
            raise ValueError(
                f"compact keeps a subset of the {self.length} cached tokens, got {n}; pass at "
                "most the cached tokens"
            )
        if self.holes is not None:
            raise ValueError("this cache was compacted to ragged counts already; compact it once")
        B, Hkv = self.k.shape[:2]
        real = None
        if counts is not None:
            real = real_entries(counts, {"B": B, "Hkv": Hkv}, n, self.k.device)  # (B, Hkv, n)
        position = self.position
        self.k[:, :, :n] = k if real is None else k.masked_fill(~real[..., None], 0)
        self.v[:, :, :n] = v if real is None else v.masked_fill(~real[..., None], 0)
        self.length, self.evicted = n, position - n
        if real is not None and not bool(real.all()):
            counts = real.sum(-1)
            self.holes = torch.stack((counts, torch.full_like(counts, n)), dim=-1)

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None) -> KV:
        """Store ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` at slots ``positions`` ``(S,)``.

        ``positions`` defaults to the next ``S`` slots ``length .. length + S - 1``. Returns
        ``KV(k_all, v_all, start=0)``: ``(B, Hkv, length, D)`` and ``(B, Hkv, length, Dv)``
        views after the write, where ``length`` is one past the highest slot written so far.
        """
        S = check_new_kv(self.k, self.v, k, v)
        if positions is None:  # the next S slots: known on the host, no sync and no index tensor
            first, end = self.length, self.length + S
            self._check_slots(first, end)
            self.k[:, :, first:end] = k
            self.v[:, :, first:end] = v
            self.length = end
            return KV(self.k[:, :, :end], self.v[:, :, :end], holes=self.holes)
        positions = torch.as_tensor(positions, device=self.k.device)
        if positions.dim() != 1 or positions.shape[0] != S or positions.is_floating_point():
            raise ValueError(
                f"cache positions must be an int tensor of shape (S={S},), got "
                f"{positions.dtype} {tuple(positions.shape)}"
            )
        if S == 0:
            return KV(self.k[:, :, : self.length], self.v[:, :, : self.length], holes=self.holes)
        end = int(positions.max()) + 1
        self._check_slots(int(positions.min()), end)
        positions = positions.long()  # index_copy_ takes int64 slots only
        self.k.index_copy_(2, positions, k.to(self.k.dtype))
        self.v.index_copy_(2, positions, v.to(self.v.dtype))
        self.length = max(self.length, end)
        return KV(self.k[:, :, : self.length], self.v[:, :, : self.length], holes=self.holes)

    def _check_slots(self, first: int, end: int) -> None:
        if first < 0 or end > self.max_len:
            raise ValueError(
                f"cache positions {first}..{end - 1} fall outside the cache's max_len "
                f"({self.max_len}); build it with a larger max_len or reset() it"
            )
