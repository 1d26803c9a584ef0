"""Masks given as a bool tensor in query-row order (:func:`from_tensor`, ``mask=`` tensors)."""

from __future__ import annotations

import torch

from selfattn.masks.base import Mask, _reduce_tiles


class TensorMask(Mask):
    # tile_kinds reduces the tensor itself: O(elements), and read by query row
    analytic = False
    row_ordered = True

    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"from_tensor expects a bool torch.Tensor, got {type(tensor).__name__}; "
                "wrap it with torch.as_tensor(..., dtype=torch.bool)"
            )
        if tensor.dtype != torch.bool:
            raise TypeError(
                f"a tensor mask must be bool (True = attend), got {tensor.dtype}; pass additive "
                "float biases as score_mod= instead, or convert a 0/1 mask with .bool()"
            )
        if tensor.dim() > 4:
            raise ValueError(
                f"a tensor mask must broadcast to (B, Hq, Sq, Sk), got {tensor.dim()}-D shape "
                f"{tuple(tensor.shape)}"
            )
        self.tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        t = self.tensor.to(q_idx.device)
        idx = [
            x if n > 1 else torch.zeros_like(x)
            for x, n in zip((b, h, q_idx - q_offset, kv_idx), t.shape)
        ]
        return t[idx[0], idx[1], idx[2], idx[3]]

    def tile_kinds(self, grid, B=1, H=1):
        # Slice the covered rows and columns instead of gathering element by element.
        t = self.tensor.to(grid.device) if grid.device is not None else self.tensor
        r0, c0 = grid.first_row, grid.kv_offset
        rows, cols = t.shape[2], t.shape[3]
        ok_r = rows == 1 or (r0 >= 0 and r0 + grid.Sq <= rows)
        ok_c = cols == 1 or (c0 >= 0 and c0 + grid.Sk <= cols)
        if not (ok_r and ok_c):
            raise ValueError(
                f"tensor mask of shape {tuple(self.tensor.shape)} has no rows {r0}.."
                f"{r0 + grid.Sq - 1} / key columns {c0}..{c0 + grid.Sk - 1} asked for by the "
                "tile grid; a tensor mask is indexed by query row and key position"
            )
        if rows > 1:
            t = t[:, :, r0 : r0 + grid.Sq]
        if cols > 1:
            t = t[:, :, :, c0 : c0 + grid.Sk]
        return _reduce_tiles(t, grid)

    def to_dense(self, Sq, Sk, *, B=1, H=1, q_offset=None, device=None):
        self.validate(B, H, Sq, Sk, 0)
        return self.tensor.to(device if device is not None else self.tensor.device).expand(
            B, H, Sq, Sk
        )

    def validate(self, B, H, Sq, Sk, q_offset):
        if not all(n in (1, want) for n, want in zip(self.tensor.shape, (B, H, Sq, Sk))):
            raise ValueError(
                f"mask of shape {tuple(self.tensor.shape)} does not broadcast to "
                f"(B, Hq, Sq, Sk) = ({B}, {H}, {Sq}, {Sk}); each dim must be 1 or the call's size"
            )

    def _batch_heads(self):
        return self.tensor.shape[0], self.tensor.shape[1]

    def __repr__(self) -> str:
        return f"from_tensor(<bool {tuple(self.tensor.shape)}>)"


def from_tensor(tensor: torch.Tensor) -> Mask:
    """A bool tensor broadcastable to ``(B, Hq, Sq, Sk)`` (True = attend), in row order.

    Row ``i`` of the tensor is query row ``i`` of the call, whatever its ``q_offset``; column
    ``j`` is key position ``j``.
    """
    return TensorMask(tensor)
