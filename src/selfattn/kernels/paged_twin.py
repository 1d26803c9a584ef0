"""The plain-PyTorch twin of the paged-decode kernels (``csrc/paged_decode.c`` and
``triton/paged.py``): the same attention of queries over their pages, stated directly (gather
every page, mask to each row's key interval, softmax). For tests only: it materialises
``(B, Hq, Sq, max_pages * P)`` scores and repeats K/V per query head.
"""

from __future__ import annotations

import torch

__all__ = ["paged_attention_twin"]


def paged_attention_twin(
    q, k_pages, v_pages, block_table, lo, hi, scale, k_scales=None, v_scales=None,
    compute_dtype=None, sinks=None, holes=None, return_scores=False,
):  # fmt: skip
    """The kernels' computation in plain PyTorch: ``(out in q.dtype, lse)``, and with
    ``return_scores`` the scores ``(B, Hq, Sq, max_pages * P)`` too (-inf where a row attends
    no key), as the C kernel's ``scores`` buffer holds them.

    Computes in ``compute_dtype`` (default float32, float64 for fp64 queries). ``sinks (Hq,)``:
    one more score per row, of its head's sink logit, with no value (a softmax column dropped
    after the normalisation). ``holes (B, Hkv, 2)``: the rows of kv head ``h`` also skip keys
    ``holes[b, h, 0] <= t < holes[b, h, 1]``.
    """
    cd = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    Hq, Hkv, P = q.shape[1], k_pages.shape[2], k_pages.shape[1]
    G = Hq // Hkv
    L = block_table.shape[1] * P
    t = torch.arange(L, device=q.device)
    page = block_table.long()[:, t // P]  # (B, L)
    k = k_pages[page, t % P].to(cd)  # (B, L, Hkv, D)
    v = v_pages[page, t % P].to(cd)
    if k_scales is not None:
        if k_scales.dim() == 3:
            k = k * k_scales[page, t % P].to(cd).unsqueeze(-1)
            v = v * v_scales[page, t % P].to(cd).unsqueeze(-1)
        else:
            k, v = k * k_scales.to(cd).view(1, 1, Hkv, 1), v * v_scales.to(cd).view(1, 1, Hkv, 1)
    k = k.permute(0, 2, 1, 3).repeat_interleave(G, dim=1)  # (B, L, Hkv, D) -> (B, Hq, L, D)
    v = v.permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    s = q.to(cd) @ k.transpose(-1, -2) * scale  # (B, Hq, Sq, L)
    allowed = (t >= lo.long().unsqueeze(-1)) & (t < hi.long().unsqueeze(-1))  # (B, Sq, L)
    if lo.dim() == 3:  # (B, Sq, NI, L): a row attends the union of its intervals
        allowed = allowed.any(dim=2)
    allowed = allowed.unsqueeze(1)  # (B, 1, Sq, L)
    if holes is not None:  # (B, Hkv, 2) -> per query head (B, Hq, 1, L)
        h = holes.long().repeat_interleave(G, dim=1).unsqueeze(2)  # (B, Hq, 1, 2)
        allowed = allowed & ~((t >= h[..., :1]) & (t < h[..., 1:]))
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # (B, Hq, Sq, L) -> (B, Hq, Sq, L + 1); the extra column has no value
        col = sinks.to(cd).view(1, Hq, 1, 1).expand(*s.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    if return_scores:
        args = (k_scales, v_scales, compute_dtype, sinks, holes)
        out, lse = paged_attention_twin(q, k_pages, v_pages, block_table, lo, hi, scale, *args)
        return out, lse, s
    if bool(torch.isfinite(v).all()):
        return (p @ v).to(q.dtype), lse
    # NaN/inf in V: the sum over each row's allowed keys alone (0 · NaN would poison the rest),
    # spelled out elementwise: (B, Hq, Sq, L, 1) * (B, Hq, 1, L, Dv) -> (B, Hq, Sq, Dv)
    terms = torch.where(allowed.unsqueeze(-1), p.unsqueeze(-1) * v.unsqueeze(2), 0.0)
    return terms.sum(dim=-2).to(q.dtype), lse
