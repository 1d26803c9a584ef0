"""FlexAttention's ``BlockMask`` built from a mask's tile classification.

:func:`build_block_mask` (``Mask.to_block_mask``) serves the flex backend and users who call
``flex_attention`` themselves. EMPTY tiles are left out, FULL tiles go in the full-block lists
(FlexAttention skips ``mask_mod`` there), PARTIAL tiles in the partial lists; for the built-in
masks that costs O(tiles), not ``create_block_mask``'s O(Sq·Sk) evaluation.

FlexAttention's ``mask_mod`` sees query rows; ours see absolute positions ``q_offset + row``, so a
built ``BlockMask`` carries our mask wrapped to add ``q_offset`` (a 0-d tensor, so that another
offset does not recompile a kernel). The other way, a ``BlockMask`` as a mask, is
:class:`~selfattn.masks.flex.FlexBlockMask`.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from selfattn.masks.tiles import FULL, PARTIAL, TileGrid, classify

FLEX_BLOCK = 128  # FlexAttention's default sparse block size; its kernels tile inside it
_FLEX_MODULE = "torch.nn.attention.flex_attention"


@functools.cache
def flex_api():
    """``torch.nn.attention.flex_attention`` if this torch has it (2.5+), else None."""
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError:
        return None
    return fa


def is_block_mask(obj) -> bool:
    """Whether ``obj`` is a FlexAttention ``BlockMask`` (without importing FlexAttention: an
    object cannot be one unless its module is loaded)."""
    fa = sys.modules.get(_FLEX_MODULE)
    return fa is not None and isinstance(obj, getattr(fa, "BlockMask", ()))


@functools.cache
def _from_kv_blocks_takes_seq_lengths() -> bool:
    # Without seq_lengths a BlockMask assumes whole blocks; create_block_mask is used then.
    return "seq_lengths" in inspect.signature(flex_api().BlockMask.from_kv_blocks).parameters


def block_sizes(block_size) -> tuple[int, int]:
    """``(block_q, block_k)`` from an int or a pair, FlexAttention's ``BLOCK_SIZE``."""
    sizes = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    ok = len(sizes) == 2 and all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes
    )
    if not ok:
        raise ValueError(
            f"block_size must be a positive int or a pair (block_q, block_k), got {block_size!r}"
        )
    return sizes


def wrapped_mask_mod(mask, off: torch.Tensor):
    """Our mask (absolute query positions) as FlexAttention's ``mask_mod`` (query rows)."""
    inner = mask.as_mask_mod()

    def mask_mod(b, h, q_idx, kv_idx):
        return inner(b, h, q_idx + off, kv_idx)

    return mask_mod


def kv_blocks(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block, how many key blocks are selected and their indices (selected first).

    ``sel``: bool ``(B', H', n_q, n_k)`` -> ``num (B', H', n_q)`` and ``idx (B', H', n_q, n_k)``,
    both int32, the layout ``BlockMask.from_kv_blocks`` takes.
    """
    num = sel.sum(dim=-1, dtype=torch.int32)  # (B', H', n_q)
    # A stable descending sort of 0/1 puts the selected blocks first, in increasing key order.
    idx = torch.sort(sel.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return num, idx.to(torch.int32)


def build_block_mask(
    mask, B: int, H: int, Sq: int, Sk: int, q_offset: int, device, block_size=FLEX_BLOCK
):
    """A FlexAttention ``BlockMask`` for ``mask`` from its tile classification (see
    :meth:`Mask.to_block_mask`). Batch and head dims stay 1 where the classification does not
    vary over them. Torch versions whose ``from_kv_blocks`` has no ``seq_lengths`` get
    ``create_block_mask`` instead (it evaluates every element)."""
    fa = flex_api()
    if fa is None:
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no FlexAttention (BlockMask needs torch >= 2.5)"
        )
    bq, bk = block_sizes(block_size)
    off = torch.tensor(q_offset, device=device)
    mask_mod = wrapped_mask_mod(mask, off)
    if not _from_kv_blocks_takes_seq_lengths():
        return fa.create_block_mask(mask_mod, B, H, Sq, Sk, device=device, BLOCK_SIZE=(bq, bk))
    grid = TileGrid(Sq, Sk, bq, bk, q_offset, device=device)
    # broadcast dims of size 1 stay 1 (FlexAttention broadcasts them); n_q, n_k are made whole
    kinds = classify(mask, grid, B, H)
    num, idx = kv_blocks(kinds == int(PARTIAL))
    full_num, full_idx = kv_blocks(kinds == int(FULL))
    return fa.BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx, BLOCK_SIZE=(bq, bk), mask_mod=mask_mod, seq_lengths=(Sq, Sk)
    )
