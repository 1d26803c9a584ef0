"""One block of ring attention: local queries against one rank's K/V, on global positions.

A rank's queries and a visiting K/V shard are each one or two runs of consecutive global positions
(:func:`selfattn.distributed.shard.segments`). Every (query run, key run) pair is one
:func:`selfattn.attention` call. :func:`selfattn.attention` puts key ``j`` at position ``j``, so a
key run starting at global position ``g`` needs its positions shifted by ``g``:

- masks and score mods that only see ``q_idx - kv_idx`` (their ``relative``: causal, sliding
  window, ALiBi, softcap, T5 relative bias) are called unchanged with ``q_offset = gq - g``:
  the backends then recognise them (SDPA's causal kernel, chunked's analytic tiles);
- any other mask or mod is called at global positions: ``q_offset = gq`` and
  ``mask.shifted(g)`` (key ``j`` at ``j + g``). Tensors given in query-row order (a global
  ``(S, S)`` ``from_tensor`` or bias) were bound to global rows once, by ring attention's
  ``prepare`` (row ``i`` at position ``i``), so every block reads its own slice.

Pairs the mask leaves EMPTY are never computed; FULL ones drop the mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from selfattn.functional import attention
from selfattn.masks import EMPTY, FULL, Mask, TileGrid

__all__ = ["Pair", "attend", "merge", "pairs"]


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
                grid = TileGrid(nq, nk, nq, nk, gq, gk, device=device)
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
        mask = None if mask is None else mask.shifted(p.gk)
        score_mod = None if score_mod is None else score_mod.shifted(p.gk)
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
