"""Ring attention (context parallelism): exact attention over a sequence sharded across ranks.

Each of the ``W`` ranks of a process group holds ``S / W`` positions of q, k and v
(:mod:`selfattn.distributed.shard`). The K/V shards travel around the ring, each rank sending to
``rank + 1`` and receiving from ``rank - 1`` while it computes on the shard it holds (Liu et al.,
2023, "Ring attention with blockwise transformers")::

    step 0: rank r attends to its own K/V   (sending them to r+1, receiving those of r-1)
    step s: rank r attends to the K/V of r-s
    after W steps every query has met every key once

Partial results merge through their log-sum-exp in float32 (:func:`blocks.merge`), so the error
does not grow with ``W``. The backward re-circulates K/V the same way; dQ stays local while the
dK/dV of a shard travel with it and arrive back at their owner after a full turn. Each block's
gradient is that of its contribution under the GLOBAL softmax: the block's own attention is
recomputed and differentiated with ``dout_b = w·dout`` and ``dlse_b = w·(rowsum(dout∘(o_b - out))
+ dlse)``, ``w = exp(lse_b - lse)``, which is ``dS = P(dP - Δ)`` with ``P = exp(s - lse)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from selfattn.backends._common import merge_sinks
from selfattn.call import check_sinks, check_tensors
from selfattn.distributed.blocks import Pair, attend, merge, pairs
from selfattn.distributed.checks import dtype_code, dtype_name, rank_checks
from selfattn.distributed.shard import LAYOUTS, check_layout, check_length, segments, world
from selfattn.functional import attention
from selfattn.masks import Mask, as_mask
from selfattn.scores import ScoreMod, as_score_mod

__all__ = ["METHODS", "ring_attention"]

METHODS = ("ring", "allgather")
_TAG_KV, _TAG_GRAD = 0, 2  # K, V on tags 0, 1; dK, dV on 2, 3 (gloo matches messages by tag)


# ----------------------------------------------------------------------------------------------
# Point-to-point exchange around the ring
# ----------------------------------------------------------------------------------------------


def _post(ops: list, group, batched: bool) -> list:
    """Start ``ops`` (``dist.P2POp``); the requests to wait on. Every byte a ring step sends goes
    through here (benchmarks/ring.py counts them)."""
    if batched:  # NCCL: one fused group call, or paired sends and receives can deadlock
        return dist.batch_isend_irecv(ops)
    return [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]


class _Pending:
    def __init__(self, reqs, sent, received):
        self.reqs, self.sent, self.received = reqs, sent, received  # keep `sent` alive until done

    def wait(self) -> tuple[torch.Tensor, ...]:
        for req in self.reqs:
            req.wait()
        return self.received


class _Ring:
    """Sends tensors to ``rank + 1`` while receiving tensors of the same shapes from ``rank - 1``.

    K and V travel as separate messages (no packed copy: the local shard is sent as it is).
    """

    def __init__(self, group, W: int, rank: int):
        self.group = group

        def peer(r: int) -> int:  # P2P ops address global ranks
            return r if group is None else dist.get_global_rank(group, r)

        self.next, self.prev = peer((rank + 1) % W), peer((rank - 1) % W)
        self.batched = dist.get_backend(group) == "nccl"

    def shift(self, tensors: tuple[torch.Tensor, ...], tag: int) -> _Pending:
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = []
        for i, (t, r) in enumerate(zip(tensors, received)):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i))
        return _Pending(_post(ops, self.group, self.batched), tensors, received)


# ----------------------------------------------------------------------------------------------
# The ring: forward and backward
# ----------------------------------------------------------------------------------------------


@dataclass
class _Config:
    group: object
    W: int
    rank: int
    S: int
    layout: str
    mask: Mask | None
    score_mod: ScoreMod | None
    scale: float | None
    backend: str
    method: str

    def q_segments(self):
        return segments(self.S, self.layout, self.rank, self.W)

    def kv_segments(self, owner: int):
        return segments(self.S, self.layout, owner, self.W)

    def attend(self, q, k, v, p: Pair):
        return attend(q, k, v, p, self.mask, self.score_mod, self.scale, self.backend)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _forward(q, k, v, cfg: _Config):
    B, Hq, Sl, _ = q.shape
    out_acc = torch.zeros(B, Hq, Sl, v.shape[3], dtype=_acc_dtype(q), device=q.device)
    lse_acc = torch.full((B, Hq, Sl), -math.inf, dtype=out_acc.dtype, device=q.device)
    ring, q_segs = _Ring(cfg.group, cfg.W, cfg.rank), cfg.q_segments()
    kb, vb = k.contiguous(), v.contiguous()
    for step in range(cfg.W):
        pending = ring.shift((kb, vb), _TAG_KV) if step < cfg.W - 1 else None  # overlaps compute
        owner = (cfg.rank - step) % cfg.W
        for p in pairs(q_segs, cfg.kv_segments(owner), cfg.mask, B, Hq, q.device):
            o, lse = cfg.attend(*_slices(q, kb, vb, p), p)
            rows = slice(p.row, p.row + p.n_q)
            merge(out_acc[:, :, rows], lse_acc[:, :, rows], o, lse)
        if pending is not None:
            kb, vb = pending.wait()
    return out_acc.to(q.dtype), lse_acc


def _slices(q, k, v, p: Pair):
    return q.narrow(2, p.row, p.n_q), k.narrow(2, p.col, p.n_k), v.narrow(2, p.col, p.n_k)


def _pair_grads(q, kb, vb, out, dout, lse, dlse, p: Pair, cfg: _Config):
    """``(dq, dk, dv)`` of one pair's contribution to the merged output, given the global lse."""
    qs, ks, vs = (t.detach().requires_grad_(True) for t in _slices(q, kb, vb, p))
    with torch.enable_grad():
        o, lse_b = cfg.attend(qs, ks, vs, p)
    rows = slice(p.row, p.row + p.n_q)
    acc = lse.dtype
    lb = lse_b.detach()
    w = torch.where(lb == -math.inf, 0.0, (lb - lse[:, :, rows]).exp())  # (B, Hq, n_q)
    do = dout[:, :, rows].to(acc)
    delta = (do * (o.detach().to(acc) - out[:, :, rows].to(acc))).sum(-1)  # (B, Hq, n_q)
    dlse_b = w * (delta + dlse[:, :, rows].to(acc))
    do_b = (w.unsqueeze(-1) * do).to(o.dtype)
    grads = (do_b, dlse_b.to(lse_b.dtype))
    # a backend may leave an input out of the graph (no key of the pair attends): zeros then
    return torch.autograd.grad(
        (o, lse_b), (qs, ks, vs), grads, allow_unused=True, materialize_grads=True
    )


def _backward(q, k, v, out, lse, dout, dlse, cfg: _Config):
    B, Hq, Sl, D = q.shape
    acc = lse.dtype
    dq = torch.zeros(B, Hq, Sl, D, dtype=acc, device=q.device)
    ring, q_segs = _Ring(cfg.group, cfg.W, cfg.rank), cfg.q_segments()
    kb, vb = k.contiguous(), v.contiguous()
    grads = None
    for step in range(cfg.W):
        pending = ring.shift((kb, vb), _TAG_KV) if step < cfg.W - 1 else None
        # the dK/dV of the visiting shard so far (from the ranks it visited before) come from
        # rank - 1; they are added to in place, so only one pair of accumulators is alive
        if grads is None:
            dkb = torch.zeros(k.shape, dtype=acc, device=k.device)
            dvb = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            (dkb, dvb), grads = grads.wait(), None  # frees the buffers our last send used
        owner = (cfg.rank - step) % cfg.W
        for p in pairs(q_segs, cfg.kv_segments(owner), cfg.mask, B, Hq, q.device):
            gq, gk, gv = _pair_grads(q, kb, vb, out, dout, lse, dlse, p, cfg)
            dq[:, :, p.row : p.row + p.n_q] += gq
            dkb[:, :, p.col : p.col + p.n_k] += gk
            dvb[:, :, p.col : p.col + p.n_k] += gv
        grads = ring.shift((dkb, dvb), _TAG_GRAD)
        del dkb, dvb  # the send holds them until it completes
        if pending is not None:
            kb, vb = pending.wait()
    dk, dv = grads.wait()  # after a full turn: our own shard's
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Forward saves the local ``q, k, v, out, lse``; backward runs the ring again."""

    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out, lse = _forward(q, k, v, cfg)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(q, k, v, out, lse, dout, dlse, ctx.cfg), None)


# ----------------------------------------------------------------------------------------------
# All-gather variant
# ----------------------------------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """``(B, H, S/W, ·)`` shards -> ``(B, H, S, ·)`` in rank order; backward sums the gradient
    over ranks and keeps this rank's rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, W, rank):
        ctx.group, ctx.W, ctx.rank, ctx.n = group, W, rank, x.shape[2]
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(W)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        if dist.get_backend(ctx.group) == "nccl":
            chunks = [c.contiguous() for c in g.chunk(ctx.W, dim=2)]
            mine = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(mine, chunks, group=ctx.group)
            return mine, None, None, None
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)  # gloo has no reduce_scatter
        return g.narrow(2, ctx.rank * ctx.n, ctx.n), None, None, None


def _allgather(q, k, v, cfg: _Config):
    """Gather K/V once, reorder them to global positions, attend locally (autograd throughout)."""
    kg = _GatherSequence.apply(k, cfg.group, cfg.W, cfg.rank)  # (B, Hkv, S, D) in rank order
    vg = _GatherSequence.apply(v, cfg.group, cfg.W, cfg.rank)
    if cfg.layout != "contiguous":
        segs = [s for r in range(cfg.W) for s in cfg.kv_segments(r)]
        pos = torch.cat([torch.arange(g, g + n) for g, n in segs])
        order = torch.argsort(pos).to(k.device)  # gathered row holding each global position
        kg, vg = kg.index_select(2, order), vg.index_select(2, order)
    outs, lses, row = [], [], 0
    for gq, n in cfg.q_segments():
        p = Pair(row, n, gq, 0, cfg.S, 0, full=cfg.mask is None)
        o, lse = cfg.attend(q.narrow(2, row, n), kg, vg, p)
        outs.append(o)
        lses.append(lse)
        row += n
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------


def _check_global(mask, score_mod, B, Hq, S, W, Sl):
    """Masks and score mods see global positions 0..S-1: validate them for the whole call."""
    for what, obj in (("mask", mask), ("score_mod", score_mod)):
        if obj is None:
            continue
        try:
            obj.validate(B, Hq, S, S, 0)
        except ValueError as e:
            raise ValueError(
                f"ring_attention evaluates the {what} on global positions 0..{S - 1} "
                f"(S = {W} ranks x {Sl} local rows), and {obj!r} cannot: {e}. Build it for the "
                "whole sequence on every rank (e.g. documents(global_ids), not the local ids)"
            ) from e


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    mask=None,
    score_mod=None,
    scale: float | None = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    method: str = "ring",
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
):
    """Self-attention over a sequence sharded across the ranks of ``group`` (context parallelism).

    Every rank calls this with its own shard; the result is this rank's rows of
    ``selfattn.attention`` on the whole sequence (``q_offset = 0``, self-attention).

    Args:
        q: ``(B, Hq, S/W, D)`` this rank's queries, ``S`` the global length, ``W`` the group size.
        k: ``(B, Hkv, S/W, D)`` its keys (``Hkv`` divides ``Hq``; K/V are never repeated).
        v: ``(B, Hkv, S/W, Dv)`` its values.
        group: the process group (default: the world). Size 1, or no initialised process group,
            is exactly :func:`selfattn.attention`.
        mask, score_mod: as in :func:`selfattn.attention`, on GLOBAL positions ``0..S-1`` (build
            ``documents(ids)``/``padding(lengths)``/``from_tensor`` for the whole sequence on
            every rank). Pairs of query and key chunks the mask leaves empty are skipped
            (causal: about half the blocks; a sliding window: every rank out of reach).
        layout: how the sequence is sharded (:mod:`selfattn.distributed.shard`): ``"zigzag"``
            (rank ``r`` holds chunks ``r`` and ``2W-1-r`` of ``2W``: balanced causal work) or
            ``"contiguous"`` (one slice per rank). Shard with ``shard_sequence`` and the same
            layout; ``position_ids`` gives the global positions of the local rows (for RoPE).
        return_lse: also return the ``(B, Hq, S/W)`` float32 lse (float64 for fp64 inputs).
        method: ``"ring"`` passes K/V around the ring, overlapping each transfer with a block's
            compute; each rank holds two K/V shards at a time, so memory stays ``O(S/W)`` at any
            ``W``. ``"allgather"`` (Llama-3's context parallelism) gathers the whole K/V once,
            then attends locally: the same bytes, but in one collective and one long matmul per
            query chunk instead of ``W`` steps, so it wins on short rings (a few ranks on one
            node, fast links) and with GQA, where K/V are small next to Q; it holds the whole
            ``(B, Hkv, S, D + Dv)`` K/V per rank. The ring wins on long rings and long
            sequences, where the overlap hides the transfers and the full K/V would not fit.
        backend: the :func:`selfattn.attention` backend of each block; the ring's backward
            differentiates blocks through their lse, so it must support ``return_lse`` with
            gradients (``"auto"`` picks one that does).
        sinks: ``(Hq,)`` learned attention-sink logits (as in :func:`selfattn.attention`, the
            same on every rank). A sink is one term of a row's GLOBAL denominator, so the blocks
            run without it and it is merged once into the merged ``(out, lse)``
            (``backends._common.merge_sinks``), not once per shard.

    Returns:
        ``out (B, Hq, S/W, Dv)`` or ``(out, lse)``. Gradients flow to q, k, v (the ring method
        does not route gradients into score-mod tensors; use ``method="allgather"`` for those).

    Raises:
        DistributedArgumentError: on EVERY rank, before any transfer, when an argument check
            fails on any rank (its message names the ranks and their errors), or when the ranks'
            local shapes, dtype, layout, method or need for gradients differ. One small
            all-gather per call makes this agreement (the ranks would otherwise wait for each
            other until the process-group timeout).
    """
    W, _ = world(group)
    with rank_checks("ring_attention", group, W, *RING_CHECKS, tensor=q) as check:
        cfg = prepare(q, k, v, group=group, mask=mask, score_mod=score_mod, scale=scale,
                      layout=layout, method=method, backend=backend)  # fmt: skip
        check.summary = summary(q, k, v, cfg)
        sinks = check_sinks(sinks, q)
    return run(q, k, v, cfg, return_lse, sinks)


def prepare(
    q, k, v, *, group, mask, score_mod, scale, layout, method="ring", backend="auto"
) -> _Config:
    """Check one rank's arguments of :func:`ring_attention` (no communication: call it inside
    :func:`rank_checks`, with :func:`summary`); the configuration :func:`run` takes."""
    check_tensors(q, k, v)
    check_layout(layout)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    B, Hq, Sl, D = q.shape
    if k.shape[2] != Sl:
        raise ValueError(
            f"ring_attention is self-attention: q {tuple(q.shape)} and k {tuple(k.shape)} must "
            f"hold the same local positions, got Sq={Sl} and Sk={k.shape[2]}"
        )
    W, rank = world(group)
    S = Sl * W
    check_length(S, layout, W, what=f"global sequence length (W={W} x local {Sl})")
    if W > 1:  # one rank is selfattn.attention, which checks the rest itself
        mask = None if mask is None else as_mask(mask)
        score_mod = None if score_mod is None else as_score_mod(score_mod)
        _check_global(mask, score_mod, B, Hq, S, W, Sl)
        # the whole call's rows are the global positions (q_offset 0): every block reads its
        # slice of a row-ordered tensor from there
        mask = None if mask is None else mask.bind(0)
        score_mod = None if score_mod is None else score_mod.bind(0)
        if scale is None:
            scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
        scale = float(scale)
        if (
            method == "ring"
            and score_mod is not None
            and torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad for t in score_mod.tensors())
        ):
            raise ValueError(
                f"score_mod {score_mod!r} has tensors that require grad; the ring method does "
                "not route their gradients: use method='allgather', or detach them"
            )
    return _Config(group, W, rank, S, layout, mask, score_mod, scale, backend, method)


def summary(q, k, v, cfg: _Config) -> list[int]:
    """What must agree across ranks (else the ranks' collectives do not pair up): local shapes,
    dtype, layout, method, and whether the call is differentiated (the backward is a ring too)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return [
        *q.shape,
        *k.shape,
        *v.shape,
        dtype_code(q.dtype),
        LAYOUTS.index(cfg.layout),
        METHODS.index(cfg.method),
        int(grad),
    ]


def _describe(s: list[int]) -> str:
    return (
        f"q {tuple(s[0:4])}, k {tuple(s[4:8])}, v {tuple(s[8:12])} {dtype_name(s[12])}, "
        f"layout={LAYOUTS[s[13]]!r}, method={METHODS[s[14]]!r}, "
        f"{'with' if s[15] else 'without'} gradients"
    )


# rank_checks' arguments for ring_attention: summary length, description, the fix
RING_CHECKS = (16, _describe, "shard every tensor with shard_sequence(..., dim=2), under the same "
          "torch.no_grad() / requires_grad on every rank")  # fmt: skip


def run(q, k, v, cfg: _Config, return_lse: bool, sinks: torch.Tensor | None = None):
    """:func:`ring_attention` on arguments that passed :func:`prepare` on every rank."""
    if cfg.W == 1:
        return attention(
            q, k, v, mask=cfg.mask, score_mod=cfg.score_mod, scale=cfg.scale, q_offset=0,
            return_lse=return_lse, backend=cfg.backend, sinks=sinks,
        )  # fmt: skip
    if cfg.method == "allgather":
        out, lse = _allgather(q, k, v, cfg)
    else:
        out, lse = _RingAttention.apply(q, k, v, cfg)
    if sinks is not None:  # once, into the global (out, lse) of the merged blocks
        out, lse = merge_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out
