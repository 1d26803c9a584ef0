"""Latent caches for multi-head latent attention (MLA, DeepSeek-V2 arXiv:2405.04434 §2.1).

MLA caches, per token and layer, one compressed latent ``c (kv_lora_rank,)`` and one rope key
``k_rope (qk_rope_head_dim,)`` shared by every head, stored side by side as one row of ``D =
kv_lora_rank + qk_rope_head_dim``. The absorbed attention (:class:`selfattn.nn.LatentAttention`)
reads it as a single KV head: keys the whole row, values its first ``kv_lora_rank`` columns::

    row of token t   [ c_0 ... c_{r-1} | k_rope_0 ... k_rope_{dr-1} ]
    key   (D = r + dr) ^-----------------------------------------^
    value (Dv = r)     ^----------------^   a view: nothing stored twice

Both classes keep the plain cache contract (:mod:`selfattn.cache.base`) with ``Hkv = 1``: their
value storage is a view of the key storage's first ``kv_lora_rank`` columns, so ``v`` costs
no memory (``update(k, v)`` with ``v = k[..., :r]`` writes the same values twice; the paged
``write`` stores ``k`` only). :class:`LatentCache` is the dense one (a :class:`StaticCache`),
:class:`PagedLatentKV` the model-level paged one (a :class:`PagedKV`: ``k_store (L, N, P, 1,
D)``, read in place by :func:`~selfattn.cache.paged_attention` with ``v_pages = k_pages[...,
:r]``).
"""

from __future__ import annotations

import torch

from selfattn._validate import positive_int
from selfattn.cache.paged import PagedKV
from selfattn.cache.static import StaticCache

__all__ = ["LatentCache", "PagedLatentKV", "latent_value"]


def latent_value(rows: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """The value view of latent rows ``(..., kv_lora_rank + rope)``: the first
    ``kv_lora_rank`` columns (no copy)."""
    return rows[..., :kv_lora_rank]


def _sizes(owner: str, kv_lora_rank, rope_dim) -> int:
    positive_int(kv_lora_rank, f"{owner} kv_lora_rank")
    positive_int(rope_dim, f"{owner} rope_dim")
    return kv_lora_rank + rope_dim


class LatentCache(StaticCache):
    """A per-layer MLA cache preallocated to ``max_len`` tokens.

    ``LatentCache(batch, max_len, kv_lora_rank, rope_dim, *, dtype, device)``. Memory layout:
    ``k (B, 1, max_len, kv_lora_rank + rope_dim)`` (module docstring), ``v`` its view
    ``k[..., :kv_lora_rank]``. :meth:`update` is :meth:`StaticCache.update` with ``Hkv = 1``.
    """

    def __init__(
        self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, *, dtype=torch.float32,
        device=None,
    ):  # fmt: skip
        D = _sizes(type(self).__name__, kv_lora_rank, rope_dim)
        # The parent allocates a one-column value store; it is replaced by the view below.
        super().__init__(batch, max_len, 1, D, 1, dtype=dtype, device=device)
        self.kv_lora_rank = kv_lora_rank
        self.v = latent_value(self.k, kv_lora_rank)  # (B, 1, max_len, r): a view of k


class PagedLatentKV(PagedKV):
    """Paged MLA latents of ``n_layers`` layers under one page allocator.

    ``PagedLatentKV(n_layers, num_pages, page_size, kv_lora_rank, rope_dim, *, max_seqs,
    max_pages_per_seq, prefix_caching=False, dtype, device)``: a :class:`PagedKV` with one KV
    head of ``D = kv_lora_rank + rope_dim`` whose ``v_store`` is the view ``k_store[...,
    :kv_lora_rank]`` (module docstring); plan, fork, prefix caching and copy-on-write work as
    for any :class:`PagedKV`.
    """

    query_blocks = False  # its long steps attend through paged_attention

    def __init__(
        self, n_layers: int, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int,
        **kw,
    ):  # fmt: skip
        D = _sizes(type(self).__name__, kv_lora_rank, rope_dim)
        # The parent allocates a one-column value store; it is replaced by the views below.
        super().__init__(n_layers, num_pages, page_size, 1, D, 1, **kw)
        self.kv_lora_rank = kv_lora_rank
        self.store.share_values(latent_value(self.k_store, kv_lora_rank))  # (L, N, P, 1, r)

    def write(self, layer: int, plan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer ``layer``'s rows ``k (B, 1, S, r + dr)`` at the planned slots; ``v`` is
        their first ``r`` columns, already written with them (a second write through the
        value view would be refused under autograd: the view predates the write)."""
        B, _, S, D = k.shape
        rows = self.k_store[layer].view(-1, 1, D)  # (N·P, 1, D), a view made now
        rows.index_copy_(0, plan.slots, k.transpose(1, 2).reshape(B * S, 1, D).to(rows.dtype))
