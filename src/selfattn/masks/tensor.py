"""Tensors given in query-row order: :func:`from_tensor` masks (and ``mask=`` bool tensors), and
the :class:`RowTensor` they share with :func:`selfattn.scores.bias`.

A row-ordered tensor's row ``i`` is query row ``i`` of the call it is given to, whatever the
call's ``q_offset``. :meth:`Mask.bind` (done by :func:`selfattn.call.prepare` for every call)
anchors it to absolute positions, so that its ``mask_mod(b, h, q_idx, kv_idx)`` takes absolute
positions like every other mask and no consumer passes ``q_offset`` to it.
"""

from __future__ import annotations

import torch

from selfattn.masks.base import Mask, register_conversion
from selfattn.masks.tiles import reduce_tiles


class RowTensor:
    """A ``(B or 1, H or 1, R, C)`` tensor whose row ``r`` holds query position ``rows_at + r``
    and whose column ``c`` holds key position ``c``.

    ``rows_at`` is None until bound, an int, or a ``(B,)`` int64 tensor (one first query position
    per sequence, as in a paged batch whose sequences have different lengths).
    """

    def __init__(self, tensor: torch.Tensor, rows_at=None):
        self.tensor, self.rows_at = tensor, rows_at

    @property
    def bound(self) -> bool:
        return self.rows_at is not None

    def bind(self, q_offset) -> RowTensor:
        """Row 0 at ``q_offset`` (an int or a ``(B,)`` tensor); a bound tensor stays as it is."""
        return self if self.bound else RowTensor(self.tensor, q_offset)

    def at(self, b, h, q_idx, kv_idx, owner) -> torch.Tensor:
        """The entries at broadcast index tensors (absolute positions); ``owner`` (the mask or
        score mod) names it in the error."""
        if not self.bound:
            raise RuntimeError(
                f"{owner!r} is read by query row, so it needs the call's positions: bind it with "
                ".bind(q_offset) (row 0 at position q_offset; attention() binds it itself)"
            )
        t = self.tensor.to(q_idx.device)  # differentiable, a no-op on the same device
        rows_at = self.rows_at
        if isinstance(rows_at, torch.Tensor):
            rows_at = rows_at.to(q_idx.device)[b]  # one offset per sequence; b broadcasts
        idx = [
            x if n > 1 else torch.zeros_like(x)
            for x, n in zip((b, h, q_idx - rows_at, kv_idx), t.shape)
        ]
        return t[idx[0], idx[1], idx[2], idx[3]]

    def window(self, q_offset: int, Sq: int, kv_offset: int, Sk: int, what: str) -> torch.Tensor:
        """The rows of query positions ``q_offset .. q_offset + Sq - 1`` and the columns of key
        positions ``kv_offset .. kv_offset + Sk - 1`` (a view; dims of size 1 stay 1). An unbound
        tensor's row 0 is ``q_offset`` (it is given to this call)."""
        if isinstance(self.rows_at, torch.Tensor):
            raise ValueError(f"{what} has one row offset per sequence; evaluate it elementwise")
        t = self.tensor
        r0 = 0 if self.rows_at is None else q_offset - self.rows_at
        rows, cols = t.shape[2], t.shape[3]
        ok_r = rows == 1 or (r0 >= 0 and r0 + Sq <= rows)
        ok_c = cols == 1 or (kv_offset >= 0 and kv_offset + Sk <= cols)
        if not (ok_r and ok_c):
            raise ValueError(
                f"{what} of shape {tuple(t.shape)} has no rows {r0}..{r0 + Sq - 1} / key columns "
                f"{kv_offset}..{kv_offset + Sk - 1} for query positions {q_offset}.."
                f"{q_offset + Sq - 1}; it is indexed by query row and key position"
            )
        if rows > 1:
            t = t[:, :, r0 : r0 + Sq]
        if cols > 1:
            t = t[:, :, :, kv_offset : kv_offset + Sk]
        return t

    def validate(self, B: int, H: int, Sq: int, Sk: int, q_offset: int, what: str) -> None:
        """Unbound: every dim must be 1 or the call's size. Bound (to an int): the call's rows and
        key columns must lie inside the tensor (a ring block reads a slice of a global one)."""
        shape = tuple(self.tensor.shape)
        lead_ok = all(n in (1, want) for n, want in zip(shape[:2], (B, H)))
        if not self.bound:
            ok = lead_ok and all(n in (1, want) for n, want in zip(shape[2:], (Sq, Sk)))
            if not ok:
                raise ValueError(
                    f"{what} of shape {shape} does not broadcast to (B, Hq, Sq, Sk) = "
                    f"({B}, {H}, {Sq}, {Sk}); each dim must be 1 or the call's size"
                )
            return
        if not lead_ok:
            raise ValueError(
                f"{what} of shape {shape} does not broadcast to B={B}, Hq={H}; its leading dims "
                "must be 1 or (B, Hq)"
            )
        if not isinstance(self.rows_at, torch.Tensor) and Sq and Sk:
            self.window(q_offset, Sq, 0, Sk, what)


class TensorMask(Mask):
    # tile_kinds reduces the tensor itself: O(elements), and read by query row
    analytic = False
    row_ordered = True

    def __init__(self, tensor: torch.Tensor, *, _rows: RowTensor | None = None):
        if _rows is not None:  # a bound copy (bind)
            self.rows, self.tensor = _rows, _rows.tensor
            return
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
        self.rows = RowTensor(self.tensor)

    def bind(self, q_offset) -> Mask:
        rows = self.rows.bind(q_offset)
        return self if rows is self.rows else TensorMask(self.tensor, _rows=rows)

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.rows.at(b, h, q_idx, kv_idx, self)

    def tile_kinds(self, grid, B=1, H=1):
        if isinstance(self.rows.rows_at, torch.Tensor):  # per-sequence rows: no single slice
            return super().tile_kinds(grid, B, H)
        # Slice the covered rows and columns instead of gathering element by element.
        t = self.rows.window(grid.q_offset, grid.Sq, grid.kv_offset, grid.Sk, "tensor mask")
        if grid.device is not None:
            t = t.to(grid.device)
        return reduce_tiles(t, grid)

    def to_dense(self, Sq, Sk, *, B=1, H=1, q_offset=None, device=None):
        q_offset = Sk - Sq if q_offset is None else q_offset
        if isinstance(self.rows.rows_at, torch.Tensor):
            return super().to_dense(Sq, Sk, B=B, H=H, q_offset=q_offset, device=device)
        self.validate(B, H, Sq, Sk, q_offset)
        t = self.rows.window(q_offset, Sq, 0, Sk, "tensor mask")
        return t.to(device if device is not None else t.device).expand(B, H, Sq, Sk)

    def validate(self, B, H, Sq, Sk, q_offset):
        self.rows.validate(B, H, Sq, Sk, q_offset, "mask")

    def batch_heads(self):
        return self.tensor.shape[0], self.tensor.shape[1]

    def __repr__(self) -> str:
        return f"from_tensor(<bool {tuple(self.tensor.shape)}>)"


def from_tensor(tensor: torch.Tensor) -> Mask:
    """A bool tensor broadcastable to ``(B, Hq, Sq, Sk)`` (True = attend), in row order.

    Row ``i`` of the tensor is query row ``i`` of the call, whatever its ``q_offset``; column
    ``j`` is key position ``j``. The call binds it to absolute positions (:meth:`Mask.bind`).
    """
    return TensorMask(tensor)


register_conversion(lambda obj: isinstance(obj, torch.Tensor), TensorMask)
