"""User ``mask_mod`` callables as masks (FlexAttention's signature)."""

from __future__ import annotations

from collections.abc import Callable

from selfattn.masks.base import Mask, register_conversion
from selfattn.masks.elementwise import call_elementwise, check_arity, check_bool, fn_name


class CallableMask(Mask):
    """Wraps a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (absolute
    positions).

    ``mask_mod`` calls it on broadcast index tensors when it broadcasts and falls back to
    ``torch.vmap`` when it does not (FlexAttention calls it on 0-d tensors), and checks that it
    returns bool. Tile classification is elementwise (exact, O(elements)).
    """

    def __init__(self, fn: Callable):
        if not callable(fn):
            raise TypeError(f"mask must be callable, got {type(fn).__name__}")
        check_arity(
            fn,
            4,
            "mask_mod",
            "b, h, q_idx, kv_idx",
            "a 5-argument score function goes in score_mod=",
        )
        self.fn = fn

    def mask_mod(self, b, h, q_idx, kv_idx):
        return check_bool(call_elementwise(self.fn, (b, h, q_idx, kv_idx), "mask_mod"), self.fn)

    def as_mask_mod(self) -> Callable:
        return self.fn

    def __repr__(self) -> str:
        return f"mask_mod({fn_name(self.fn)})"


register_conversion(callable, CallableMask, last=True)
