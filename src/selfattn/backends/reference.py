"""The reference backend: the textbook formula, written out. It is the oracle for everything else.

    out = softmax(score_mod(Q Kᵀ · scale) masked to -inf) V

computed in fp32 (fp64 for fp64 inputs) with the full ``(B, Hq, Sq, Sk)`` score matrix, so memory
is quadratic in the sequence length. Rows with no attended key (masked, or ``-inf`` from the score
mod) give weights 0, output 0 and lse ``-inf`` (``sink`` with learned sinks: the sink's weight
is 1, its value 0); ``P V`` reads only the keys a row attends
(``_common``'s rule for NaN/Inf). Gradients come from autograd through this very formula.
"""

from __future__ import annotations

import torch

from selfattn.backends._common import (
    accumulation_dtype,
    all_finite,
    dropout_keep,
    index_grids,
    nonfinite_v_part,
    unattended_columns_zeroed,
)
from selfattn.backends.base import BASE_FIELDS, Backend, Cost, register
from selfattn.call import AttentionCall


def scores_and_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights ``P (B, Hq, Sq, Sk)``, lse ``(B, Hq, Sq)``, the NaN-guarded ``v`` (compute dtype)
    and the masked scores ``(B, Hq, Sq, Sk)`` (``-inf`` where a row does not attend a key).

    ``compute_dtype`` overrides the accumulation dtype; tests use it to build the naive
    low-precision baseline of the tolerance rule.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    acc = compute_dtype or accumulation_dtype(q.dtype)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    b, h, qi, kvi = index_grids(B, Hq, Sq, Sk, call.q_offset, q.device)

    allowed = None
    if call.mask is not None:
        allowed = call.mask.mask_mod(b, h, qi, kvi)
        k, v = unattended_columns_zeroed(k, v, allowed, Hq)

    # GQA: the G query heads of a kv head form one (G·Sq)-row matmul; K/V are never repeated.
    s = q.reshape(B, Hkv, G * Sq, D) @ k.transpose(-1, -2)  # (B, Hkv, G·Sq, Sk)
    s = s.view(B, Hq, Sq, Sk) * call.scale
    if call.score_mod is not None:
        s = call.score_mod.score_mod(s, b, h, qi, kvi)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))

    # -- safe softmax: the max is detached (softmax is shift invariant), empty rows give 0, not NaN
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    sink = None
    if call.sinks is not None:  # a key with score `sink` and no value: only the denominator
        sink = call.sinks.to(acc).view(1, Hq, 1, 1)
        m = torch.maximum(m, sink.detach().masked_fill(~torch.isfinite(sink.detach()), 0))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    nonempty = denom != 0  # NaN (a NaN score) counts: the row's output and lse are NaN
    safe = torch.where(nonempty, denom, torch.ones_like(denom))
    p = e / safe
    lse = torch.where(nonempty, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return p, lse.squeeze(-1), v, s


class _FinitePart(torch.autograd.Function):
    """``v`` with NaN/Inf replaced by 0, passing gradients through unchanged: ``dV = Pᵀ dO``
    holds at every entry, a non-finite one included (it does not depend on ``V``)."""

    @staticmethod
    def forward(ctx, v):
        return v.masked_fill(~torch.isfinite(v), 0)

    @staticmethod
    def backward(ctx, grad):
        return grad


def weighted_values(p: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``P V`` over the keys each row attends: ``p, s (B, Hkv, R, Sk)``, ``v (B, Hkv, Sk, Dv)``.

    A plain matmul forms ``0 · v_j`` for every key a row does not attend, so NaN/Inf stored in V
    there would reach the row; non-finite V entries are therefore taken out of the matmul and
    added back for the rows whose score ``s`` attends them (``_common.nonfinite_v_part``).
    """
    if all_finite(v):
        return p @ v
    bad = (~torch.isfinite(v)).any(-1).flatten(0, 1).any(0).nonzero().squeeze(1)  # key indices
    part = nonfinite_v_part(p[..., bad], s[..., bad] != float("-inf"), v[:, :, bad])
    # ties the non-finite part to P, so that a row it makes non-finite gets non-finite
    # gradients too (0 · NaN = NaN) instead of those of the finite rest
    part = part * (1 + 0 * p.sum(-1, keepdim=True))
    return p @ _FinitePart.apply(v) + part


def run(q, k, v, call: AttentionCall, compute_dtype: torch.dtype | None = None):
    B, Hq, Sq, _ = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    p, lse, vv, s = scores_and_weights(q, k, v, call, compute_dtype)
    if call.dropout_p > 0:
        b, h, qi, kvi = index_grids(B, Hq, Sq, Sk, call.q_offset, q.device)
        keep = dropout_keep(call.dropout_seed, call.dropout_p, b, h, qi, kvi)
        p = torch.where(keep, p / (1.0 - call.dropout_p), torch.zeros_like(p))
    p, s = (t.reshape(B, Hkv, G * Sq, Sk) for t in (p, s))  # (B, Hq, Sq, Sk) -> (B, Hkv, G·Sq, Sk)
    out = weighted_values(p, s, vv)  # (B, Hkv, G·Sq, Dv)
    out = out.view(B, Hq, Sq, Dv).to(q.dtype)
    return out, (lse.to(accumulation_dtype(q.dtype)) if call.return_lse else None)


def weights(q, k, v, call: AttentionCall) -> torch.Tensor:
    """Attention weights ``(B, Hq, Sq, Sk)`` in the input dtype (no dropout)."""
    p, _, _, _ = scores_and_weights(q, k, v, call)
    return p.to(q.dtype)


def _reject(q, k, v, call):
    return None  # the oracle runs everything (memory permitting)


# Per pair against sdpa's 1: it materialises the Sq·Sk scores and weights in fp32, so it runs
# only where nothing else can.
_COST = Cost(1000.0, "materialises the Sq·Sk scores (the oracle)")


register(
    Backend(
        "reference",
        run,
        _reject,
        cost=lambda q, k, v, call: _COST,
        supports=BASE_FIELDS["dense"] | {"sinks"},
        doc="explicit softmax(QKᵀ·scale + M)V; the oracle; O(Sq·Sk) memory; returns weights",
    )
)
