"""Sequence layouts for context parallelism: which global positions each rank holds.

A sequence of ``S`` positions is cut across the ``W`` ranks of a process group. Two layouts::

    contiguous (W = 2, S = 8)         zigzag (W = 2, S = 8: 2W = 4 chunks of 2)
    position  0 1 2 3 4 5 6 7         position  0 1 2 3 4 5 6 7
    rank      0 0 0 0 1 1 1 1         rank      0 0 1 1 1 1 0 0

``contiguous`` gives rank ``r`` the slice ``[r·S/W, (r+1)·S/W)``. Under a causal mask the last rank
then does ``2W - 1`` times the work of the first. ``zigzag`` cuts the sequence into ``2W`` chunks
and gives rank ``r`` the chunks ``r`` and ``2W-1-r`` (an early and a late one), so that every rank
does the same causal work: the load balancing of Llama 3's context parallelism (Llama Team, 2024,
"The Llama 3 herd of models", §3.3.2), also known as ring-flash-attn's "zigzag". A rank's local
rows are its chunks in increasing position order.

Without an initialised process group (or with ``group`` of size 1) everything here acts as a single
rank holding the whole sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from selfattn.distributed.checks import dtype_code, dtype_name, rank_checks

__all__ = [
    "LAYOUTS",
    "position_ids",
    "segments",
    "shard_sequence",
    "unshard_sequence",
    "world",
]

LAYOUTS = ("contiguous", "zigzag")


def world(group=None) -> tuple[int, int]:
    """``(W, rank)`` of this process in ``group``; ``(1, 0)`` without an initialised group."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def divisor(layout: str, W: int) -> int:
    """How many equal pieces the global sequence is cut into: ``W`` or ``2W``."""
    return 2 * W if check_layout(layout) == "zigzag" and W > 1 else W


def check_length(S: int, layout: str, W: int, what: str = "sequence length") -> None:
    n = divisor(layout, W)
    if S % n:
        pad = -S % n
        raise ValueError(
            f"{what} S={S} is not divisible by {n} ({'2·' if n == 2 * W else ''}W for "
            f"layout={layout!r} on W={W} ranks); pad the sequence by {pad} to {S + pad} "
            "positions and mask the padding (selfattn.masks.padding), or use another layout"
        )


def segments(S: int, layout: str = "zigzag", rank: int = 0, W: int = 1) -> list[tuple[int, int]]:
    """``[(global_start, length), ...]`` of the positions ``rank`` holds, in local row order.

    Adjacent pieces are merged (zigzag on one rank is the whole sequence, one segment).
    """
    check_length(S, layout, W)
    if layout == "contiguous" or W == 1:
        n = S // W
        return [(rank * n, n)]
    c = S // (2 * W)
    return [(rank * c, c), ((2 * W - 1 - rank) * c, c)]


def position_ids(S: int, layout: str = "zigzag", group=None, device=None) -> torch.Tensor:
    """Global positions ``(S / W,)`` int64 of this rank's local rows, for RoPE and position masks.

    ``S`` is the GLOBAL sequence length. With ``W = 2`` and ``S = 8``, zigzag rank 0 gets
    ``[0, 1, 6, 7]`` and rank 1 ``[2, 3, 4, 5]``.
    """
    W, r = world(group)
    parts = [torch.arange(g, g + n, device=device) for g, n in segments(S, layout, r, W)]
    return torch.cat(parts)


def seq_dim(x: torch.Tensor, dim: int | None, what: str) -> int:
    """The sequence dimension of ``x`` (non-negative): ``dim``, or by default 0 for ``(S,)`` and 1
    for ``(B, S)`` / ``(B, S, d)``. A 4-D tensor must say: heads-first ``(B, H, S, D)`` q/k/v
    (``dim=2``) and ``(B, S, H, D)`` (``dim=1``) look alike, and cutting the heads instead of the
    sequence would run without an error and give wrong attention."""
    if dim is None:
        if x.dim() in _DEFAULT_DIM:
            return _DEFAULT_DIM[x.dim()]
        raise ValueError(
            f"{what}: which dimension of x {tuple(x.shape)} is the sequence? Pass dim= (dim=2 "
            "for heads-first (B, H, S, D) q/k/v, dim=1 for (B, S, H, D)); without it only (S,), "
            "(B, S) and (B, S, d) tensors are sharded (along S)"
        )
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim={dim} is out of range for x {tuple(x.shape)}")
    return dim % x.dim()


# The sequence dimension when no dim= is given, by x.dim(): (S,), (B, S) and (B, S, d).
_DEFAULT_DIM = {1: 0, 2: 1, 3: 1}


def shard_sequence(x: torch.Tensor, layout: str = "zigzag", group=None, *, dim: int | None = None):
    """This rank's shard of a full-sequence tensor ``x`` (every rank passes the same ``x``).

    ``dim`` is the sequence dimension: by default 1 for hidden states ``(B, S, d)`` and token ids
    ``(B, S)`` (0 for ``(S,)``); any other tensor must name it, e.g. ``dim=2`` for heads-first
    ``(B, H, S, D)`` q/k/v. Returns ``x`` with ``S / W`` positions along ``dim`` (a new tensor for
    zigzag, a view for contiguous); differentiable. No communication.
    """
    W, r = world(group)
    d = seq_dim(x, dim, "shard_sequence")
    S = x.shape[d]
    check_length(S, layout, W, what=f"sequence length (dim {d} of x {tuple(x.shape)})")
    parts = [x.narrow(d, g, n) for g, n in segments(S, layout, r, W)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


_MAX_DIMS = 8  # unshard_sequence's agreement summary holds shapes of up to this many dims


def _describe_shard(summary: list[int]) -> str:
    ndim, shape, (dtype, dim, layout) = summary[0], summary[1 : 1 + _MAX_DIMS], summary[-3:]
    return (
        f"x {tuple(shape[:ndim])} {dtype_name(dtype)}, sequence dim={dim}, "
        f"layout={LAYOUTS[layout]!r}"
    )


def unshard_sequence(
    x: torch.Tensor, layout: str = "zigzag", group=None, *, dim: int | None = None
):
    """The full sequence from every rank's shard ``x`` (an all-gather; the inverse of
    :func:`shard_sequence`, with the same ``dim`` rule). Every rank gets the same tensor with
    ``S = W · x.shape[dim]``.

    Not differentiable: to train, compute the loss on the local shard and all-reduce it.
    Raises :class:`DistributedArgumentError` on every rank if the shards differ in shape or dtype,
    or a check fails on any rank.
    """
    W, _ = world(group)
    hint = "shard with shard_sequence, which cuts equal pieces"
    with rank_checks(
        "unshard_sequence", group, W, _MAX_DIMS + 4, _describe_shard, hint, tensor=x
    ) as check:
        check_layout(layout)
        d = seq_dim(x, dim, "unshard_sequence")
        if x.dim() > _MAX_DIMS:
            raise ValueError(f"unshard_sequence takes at most {_MAX_DIMS} dims, got {x.dim()}")
        shape = [*x.shape, *[0] * (_MAX_DIMS - x.dim())]
        check.summary = [x.dim(), *shape, dtype_code(x.dtype), d, LAYOUTS.index(layout)]
    if W == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(W)]
    dist.all_gather(parts, x, group=group)
    S = W * x.shape[d]
    pieces: list[tuple[int, torch.Tensor]] = []
    for rank, part in enumerate(parts):
        row = 0
        for g, n in segments(S, layout, rank, W):
            pieces.append((g, part.narrow(d, row, n)))
            row += n
    return torch.cat([p for _, p in sorted(pieces, key=lambda gp: gp[0])], dim=d)
