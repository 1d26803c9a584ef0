"""Paged KV caches: :class:`PagedKV` (a whole model's layers) and :class:`PagedCache` (one layer).

One page id names a page of every layer; a sequence has one ordered page list, one length, one
reference per page and one block table for the whole model. Token ``t`` of a sequence sits in
slot ``t % P`` of its page number ``t // P``::

    pages of seq 0 = [3, 0]      P = 4, length 6
    token position   0 1 2 3 | 4 5 · ·
    page             3       | 0          (· = free slot, written by the next append)

The package is four rooms and a facade, each with one job:

- :mod:`~selfattn.cache.paged.blocks`: :class:`BlockTable`, the bookkeeping (sequence table,
  reserve / fork / free / copy-on-write decisions over the reference-counted pool, the prefix
  index); no tensors.
- :mod:`~selfattn.cache.paged.plan`: :class:`StepPlan`, the frozen plan of one step (the only
  thing the layers and tensor-parallel peers see), and the functions that build it.
- :mod:`~selfattn.cache.paged.store`: :class:`PageStore`, the pages of every layer (memory
  layout, quantised pages), their writes, copies and gathers.
- :mod:`~selfattn.cache.paged.layer`: :class:`PagedLayer` (a layer's cache for one step) and
  :class:`PagedCacheView` (a model batch over the cache's sequences).
- :mod:`~selfattn.cache.paged.kv`: :class:`PagedKV`, the facade users build, and
  :class:`PagedCache`, its one-layer form.
"""

from selfattn.cache.paged.blocks import BlockTable
from selfattn.cache.paged.kv import PagedCache, PagedKV
from selfattn.cache.paged.layer import PagedCacheView, PagedLayer
from selfattn.cache.paged.plan import PACKED_ROWS_MAX, StepPlan
from selfattn.cache.paged.store import FP8_HEADROOM, PageStore

# The step plan's earlier name.
PagedPlan = StepPlan

__all__ = ["FP8_HEADROOM", "PACKED_ROWS_MAX", "BlockTable", "PageStore", "PagedCache",
           "PagedCacheView", "PagedKV", "PagedLayer", "PagedPlan", "StepPlan"]  # fmt: skip
