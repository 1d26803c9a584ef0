"""Masks: which (query, key) pairs may attend, in one vocabulary every backend understands.

A mask is a predicate over absolute positions. Query row ``i`` of a call sits at position
``q_offset + i`` and key ``j`` at position ``j`` (see :func:`selfattn.attention`), so the same
``causal()`` means "no peeking ahead" for a full forward and for a cached decode step alike.

Every :class:`Mask` can

- evaluate elementwise: ``mask.mask_mod(b, h, q_idx, kv_idx)`` on broadcastable index tensors
  (FlexAttention's signature; ``h`` is the *query* head);
- classify tiles analytically: ``mask.tile_kinds(grid)`` gives EMPTY / PARTIAL / FULL per
  ``(block_q × block_k)`` tile without evaluating the n² elements, so a backend can skip empty
  tiles and drop the mask on full ones;
- materialise: ``mask.to_dense(Sq, Sk, B=, H=)`` -> bool ``(B, H, Sq, Sk)``;
- print: ``mask.render(Sq, Sk)`` (█ attend, · masked);
- become a FlexAttention ``BlockMask``: ``mask.to_block_mask(B, H, Sq, Sk)``;
- answer what a consumer asks of it: ``key_interval`` (one key interval per query row, for the
  paged kernels), ``analytic``, ``relative``, ``is_causal``, ``row_ordered`` (see :class:`Mask`);
- move to a call's positions: ``mask.bind(q_offset)`` anchors tensors given in query-row order
  (``from_tensor``) at absolute positions (every call does it), ``mask.shifted(kv)`` serves a
  call whose key column ``j`` sits at position ``j + kv`` (a window cache, a ring block).

Masks combine with ``&``, ``|`` and ``~``. Plain callables
``mask_mod(b, h, q_idx, kv_idx) -> bool``, bool tensors and FlexAttention ``BlockMask`` objects are
accepted wherever a mask is (see :func:`as_mask`).

Tile classification is *sound* for every mask: EMPTY means no pair of the tile attends and FULL
means every pair does, for each ``(b, h)``. For each built-in leaf it is also *tight* (a tile is
PARTIAL only when it really is mixed); a combination (``&``, ``|``) may call a tile PARTIAL that is
in fact empty or full, which costs a backend some mask work but never a wrong answer.

Layout: :mod:`~selfattn.masks.tiles` (tile kinds, grids and the tile helpers backends plan
with), :mod:`~selfattn.masks.base` (the protocol, ``&``/``|``/``~``),
:mod:`~selfattn.masks.library` (the built-ins), :mod:`~selfattn.masks.tensor` and
:mod:`~selfattn.masks.callable` (masks from a bool tensor or a user callable),
:mod:`~selfattn.masks.flex` (FlexAttention ``BlockMask`` to and from masks),
:mod:`~selfattn.masks.elementwise` (calling user callables on index tensors).
"""

# The package re-exports its modules' public names.
# ruff: noqa: F401

from __future__ import annotations

from selfattn.masks import tiles
from selfattn.masks.base import And, Mask, Not, Or, as_mask
from selfattn.masks.callable import CallableMask
from selfattn.masks.flex import FlexBlockMask
from selfattn.masks.library import (
    BlockSparse,
    Causal,
    Chunked,
    Documents,
    Padding,
    PrefixLM,
    SlidingWindow,
    block_sparse,
    causal,
    chunked,
    documents,
    padding,
    prefix_lm,
    sliding_window,
)
from selfattn.masks.tensor import TensorMask, from_tensor
from selfattn.masks.tiles import EMPTY, FULL, PARTIAL, TileGrid, TileKind

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "CallableMask",
    "FlexBlockMask",
    "Mask",
    "TileGrid",
    "TileKind",
    "as_mask",
    "block_sparse",
    "causal",
    "chunked",
    "documents",
    "from_tensor",
    "padding",
    "prefix_lm",
    "sliding_window",
]
