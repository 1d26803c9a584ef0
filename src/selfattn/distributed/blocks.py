"""One block of ring attention: local queries against one rank's K/V, on global positions.

A rank's queries and a visiting K/V shard are each one or two runs of consecutive global positions
(:func:`selfattn.distributed.shard.segments`). Every (query run, key run) pair is one
:func:`selfattn.attention` call. :func:`selfattn.attention` puts key ``j`` at position ``j``, so a
key run starting at global position ``g`` needs its positions shifted by ``g``:

- masks and score mods that only see ``q_idx - kv_idx`` (their ``relative``: causal, sliding
  window, ALiBi, softcap, T5 relative bias) are called unchanged with ``q_offset = gq - g``:
  the backends then recognise them (SDPA's causal kernel, chunked's analytic tiles);
- any other mask or mod is wrapped by :class:`ShiftedMask` / :class:`ShiftedScoreMod`, which add
  ``g`` to ``kv_idx`` and see rows at their global positions (``q_offset = 0`` for masks given
  in row order, such as ``from_tensor`` of a global ``(S, S)`` tensor).

Pairs the mask leaves EMPTY are never computed; FULL ones drop the mask.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from selfattn.functional import attention
from selfattn.masks import EMPTY, FULL, Mask, TileGrid
from selfattn.scores import ScoreMod

__all__ = ["Pair", "ShiftedMask", "ShiftedScoreMod", "attend", "merge", "pairs"]


class ShiftedMask(Mask):
    """``inner`` seen from a call whose key ``j`` sits at global position ``j + shift``."""

    def __init__(self, inner: Mask, shift: int):
        self.inner, self.shift = inner, shift

    def children(self) -> tuple[Mask, ...]:
        return (self.inner,)

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        # rows are at global positions; row-order masks count rows from global position 0
        return self.inner.mask_mod(b, h, q_idx, kv_idx + self.shift, 0)

    def tile_kinds(self, grid, B=1, H=1):
        shifted = dataclasses.replace(grid, kv_offset=grid.kv_offset + self.shift, row_offset=0)
        return self.inner.tile_kinds(shifted, B, H)

    def _batch_heads(self):
        return self.inner._batch_heads()

    def __repr__(self) -> str:
        return f"{self.inner!r} (keys from {self.shift})"


class ShiftedScoreMod(ScoreMod):
    """``inner`` seen from a call whose key ``j`` sits at global position ``j + shift``."""

    def __init__(self, inner: ScoreMod, shift: int):
        self.inner, self.shift = inner, shift
        self.additive = inner.additive

    def score_mod(self, score, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.inner.score_mod(score, b, h, q_idx, kv_idx + self.shift, 0)

    def bias(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.inner.bias(b, h, q_idx, kv_idx + self.shift, 0)

    def tensors(self):
        return self.inner.tensors()

    def __repr__(self) -> str:
        return f"{self.inner!r} (keys from {self.shift})"


@dataclass(frozen=True)
class Pair:
    """A (query run, key run) pair to compute: local rows ``[row, row + n_q)`` at global
    position ``gq``, columns ``[col, col + n_k)`` of the visiting shard at global ``gk``."""

    row: int
    n_q: int
    gq: int
    col: int
    n_k: int
    gk: int
    full: bool  # every (query, key) of the pair attends: no mask work


def _runs(segs):
    row = 0
    for g, n in segs:
        yield row, g, n
        row += n


def pairs(q_segs, kv_segs, mask: Mask | None, B: int, Hq: int, device) -> list[Pair]:
    """The non-EMPTY pairs of local query runs ``q_segs`` and key runs ``kv_segs``.

    Classified as one tile each by ``mask.tile_kinds`` (analytic for the built-ins), over every
    (b, h): a pair is skipped only if EMPTY for all of them.
    """
    out = []
    for row, gq, nq in _runs(q_segs):
        for col, gk, nk in _runs(kv_segs):
            full = True
            if mask is not None:
                grid = TileGrid(nq, nk, nq, nk, gq, gk, device=device, row_offset=0)
                kinds = torch.as_tensor(mask.tile_kinds(grid, B, Hq))
                if int(kinds.max()) == int(EMPTY):
                    continue
                full = int(kinds.min()) == int(FULL)
            out.append(Pair(row, nq, gq, col, nk, gk, full))
    return out


def attend(q, k, v, p: Pair, mask, score_mod, scale, backend):
    """``(out, lse)`` of the pair's queries ``q (B, Hq, n_q, D)`` against ``k``, ``v`` (its key
    run), with positions shifted to global ones (see the module docstring)."""
    mask = None if p.full else mask
    if (mask is None or mask.relative) and (score_mod is None or score_mod.relative):
        q_offset = p.gq - p.gk
    else:
        q_offset = p.gq
        mask = None if mask is None else ShiftedMask(mask, p.gk)
        score_mod = None if score_mod is None else ShiftedScoreMod(score_mod, p.gk)
    return attention(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        q_offset=q_offset,
        return_lse=True,
        backend=backend,
    )


def merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """Fold a partial result into the running one, in place: ``lse = log(e^lse_acc + e^lse)``
    and ``out_acc = out_acc·e^(lse_acc - lse) + out·e^(lse_b - lse)``.

    ``out_acc (B, Hq, n, Dv)`` and ``lse_acc (B, Hq, n)`` are float32 (float64 for fp64 inputs),
    so rounding does not pile up with the number of blocks. Rows empty in both stay 0 / -inf.
    """
    new = torch.logaddexp(lse_acc, lse)
    ref = torch.where(new == -math.inf, 0.0, new)
    out_acc.mul_((lse_acc - ref).exp_().unsqueeze(-1))
    out_acc.add_(out.to(out_acc.dtype) * (lse.to(ref.dtype) - ref).exp_().unsqueeze(-1))
    lse_acc.copy_(new)
