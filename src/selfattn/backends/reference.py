"""The reference backend: the textbook formula, written out. It is the oracle for everything else.

    out = softmax(score_mod(Q Kᵀ · scale) masked to -inf) V

computed in fp32 (fp64 for fp64 inputs) with the full ``(B, Hq, Sq, Sk)`` score matrix, so memory
is quadratic in the sequence length. Fully masked rows give weights 0, output 0 and lse ``-inf``.
Gradients come from autograd through this very formula.
"""

from __future__ import annotations

import torch

from selfattn.backends import AttentionCall, Backend, register
from selfattn.backends._common import (
    accumulation_dtype,
    dropout_keep,
    index_grids,
    unattended_columns_zeroed,
)


def scores_and_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights ``P (B, Hq, Sq, Sk)``, lse ``(B, Hq, Sq)`` and the NaN-guarded ``v`` (compute dtype).

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
        allowed = call.mask.mask_mod(b, h, qi, kvi, q_offset=call.q_offset)
        k, v = unattended_columns_zeroed(k, v, allowed, Hq)

    # GQA: the G query heads of a kv head form one (G·Sq)-row matmul; K/V are never repeated.
    s = q.reshape(B, Hkv, G * Sq, D) @ k.transpose(-1, -2)  # (B, Hkv, G·Sq, Sk)
    s = s.view(B, Hq, Sq, Sk) * call.scale
    if call.score_mod is not None:
        s = call.score_mod.score_mod(s, b, h, qi, kvi, q_offset=call.q_offset)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))

    # -- safe softmax: the max is detached (softmax is shift invariant), empty rows give 0, not NaN
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    nonempty = denom > 0
    safe = torch.where(nonempty, denom, torch.ones_like(denom))
    p = e / safe
    lse = torch.where(nonempty, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return p, lse.squeeze(-1), v


def run(q, k, v, call: AttentionCall, compute_dtype: torch.dtype | None = None):
    B, Hq, Sq, _ = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    p, lse, vv = scores_and_weights(q, k, v, call, compute_dtype)
    if call.dropout_p > 0:
        b, h, qi, kvi = index_grids(B, Hq, Sq, Sk, call.q_offset, q.device)
        keep = dropout_keep(call.dropout_seed, call.dropout_p, b, h, qi, kvi)
        p = torch.where(keep, p / (1.0 - call.dropout_p), torch.zeros_like(p))
    out = p.reshape(B, Hkv, (Hq // Hkv) * Sq, Sk) @ vv  # (B, Hkv, G·Sq, Dv)
    out = out.view(B, Hq, Sq, Dv).to(q.dtype)
    return out, (lse.to(accumulation_dtype(q.dtype)) if call.return_lse else None)


def weights(q, k, v, call: AttentionCall) -> torch.Tensor:
    """Attention weights ``(B, Hq, Sq, Sk)`` in the input dtype (no dropout)."""
    p, _, _ = scores_and_weights(q, k, v, call)
    return p.to(q.dtype)


def _reject(q, k, v, call):
    return None  # the oracle runs everything (memory permitting)


register(
    Backend(
        "reference",
        run,
        _reject,
        doc="explicit softmax(QKᵀ·scale + M)V; the oracle; O(Sq·Sk) memory; returns weights",
    )
)
