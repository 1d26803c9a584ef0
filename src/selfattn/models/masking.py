"""transformers' ``attention_mask`` as a selfattn mask: the one helper every model family uses.

An ``attention_mask (B, S)`` holds 1 (or True) at tokens and 0 at padding. As a key mask it hides
the padded keys from every query; the pattern of its zeros picks the cheapest exact form::

    every entry 1          None (nothing to hide)
    1 1 1 0 0  (right)     padding(lengths)        keys past each row's length hidden
    0 0 1 1 1  (left)      ~padding(starts)        keys before each row's first token hidden
    1 0 1 1 0  (other)     a bool (B, 1, 1, S) tensor

The two analytic forms let tile-skipping backends drop whole tiles of padding, where a bool
tensor is read elementwise.
"""

from __future__ import annotations

import torch

from selfattn import masks

__all__ = ["padding_mask"]


def padding_mask(
    attention_mask,
    B: int,
    S: int,
    *,
    name: str = "attention_mask",
    length: str = "S",
    padded_queries_see_padding: bool = False,
):
    """The key mask (a :class:`~selfattn.masks.Mask`, or None) of a 1/0 ``attention_mask (B, S)``
    (module docstring). ValueError naming the shape when it is not a ``(B, S)`` tensor;
    ``name`` and ``length`` name the argument and its ``S`` in that message.

    ``padded_queries_see_padding`` (self-attention over the same ``S`` tokens only): for right
    padding, ``documents`` with the tokens as one document and the padding as another, so the
    padded queries attend to the padding instead of the tokens. The tokens' rows are the same;
    every key column is attended by some row and no row is empty, so the sdpa backend need not
    zero unattended K/V columns (measured: 5 % of MiniLM's forward). For encoders, whose padded
    rows nobody reads.
    """
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, S):
        got = (
            tuple(attention_mask.shape)
            if isinstance(attention_mask, torch.Tensor)
            else type(attention_mask).__name__
        )
        raise ValueError(
            f"{name} must be (B={B}, {length}={S}) with 1 at tokens and 0 at padding, got {got}"
        )
    keep = attention_mask.bool()
    n = keep.sum(-1)  # (B,) tokens per row
    cols = torch.arange(S, device=keep.device)
    right = keep == (cols < n[:, None])
    left = keep == (cols >= (S - n)[:, None])
    # One device sync for the three questions.
    full, right, left = torch.stack([(n == S).all(), right.all(), left.all()]).tolist()
    if full:
        return None
    if right:
        if padded_queries_see_padding:
            return masks.documents((~keep).long())
        return masks.padding(n)
    if left:
        return ~masks.padding(S - n)
    return masks.from_tensor(keep[:, None, None, :])  # (B, S) -> (B, 1, 1, S)
