"""``torch``: the paged backend in plain PyTorch, for every case (gradients, score mods,
arbitrary masks, fp64, long query chunks where batched GEMMs win).

It walks the key axis a bounded group of logical pages at a time, for the whole batch at once:
one ``index_select`` over the page dimension gathers ``(B, group, P, Hkv, D)``, never a dense
copy of the whole cache, and each group's partial softmax is merged into a running float32
(float64 for fp64 inputs) max / sum / output (FlashAttention's online softmax). A group where a
row has no allowed key (a sliding window that excludes whole pages, a short sequence in a ragged
batch) contributes nothing and never produces NaN. NaN/inf in V at a key a row does not attend
never reaches that row: ``P·V`` is summed as usual and, only where that came out non-finite
(``0·NaN = NaN``), summed again over each row's attended keys (:func:`_weighted_sum_attended`),
so finite caches pay one finiteness check of the sums.
"""

from __future__ import annotations

import math

import torch

from selfattn.backends._common import accumulation_dtype, nonfinite_v_part, sinks_merged
from selfattn.backends.base import BASE_FIELDS, Backend, Cost, register
from selfattn.backends.paged._intervals import page_ranges
from selfattn.backends.paged.call import PagedCall

__all__ = ["GATHER_ELEMENTS", "GROUP_KEYS", "plan", "run"]

# Keys (logical pages × P) gathered per step, at most: bounds the score buffer per query row.
GROUP_KEYS = 1024
# Elements of K gathered per step across the batch (B · keys · Hkv · D): a large batch takes
# fewer keys per step so that the gathered copy stays ~8 MiB in fp32, never the whole cache
# (measured best for a B=32 decode: 4 and 16 MiB were slower).
GATHER_ELEMENTS = 1 << 21


def _weighted_sum_attended(
    p: torch.Tensor, v: torch.Tensor, attended: torch.Tensor
) -> torch.Tensor:
    """``p @ v`` summed over each row's attended keys only: ``p (..., R, L)``, ``v (..., L, Dv)``,
    ``attended (..., R, L)`` bool -> ``(..., R, Dv)``.

    A key a row does not attend has weight 0 there, but IEEE gives ``0 · NaN = 0 · inf = NaN``:
    a NaN in V (an unwritten slot, a key another row of the group attends) would poison every
    row of the matmul. Here it reaches only the rows that attend it, with IEEE's result for a
    sum over those keys alone (the C kernel's, which never reads other keys): a NaN gives NaN;
    ``±inf`` gives ``±inf`` at a positive weight, NaN at weight 0 or when both signs meet. The
    finite part is one matmul; ``_common.nonfinite_v_part`` (the dense backends' rule, by
    indicator matmuls) adds where the non-finite values land.
    Callers take this path only when the plain ``p @ v`` came out non-finite.
    """
    return p @ v.masked_fill(~torch.isfinite(v), 0.0) + nonfinite_v_part(p, attended, v)


def _group_scales(scales, ids, B: int, L: int, Hkv: int, cd) -> torch.Tensor:
    """Scales broadcastable to a gathered ``(B, L, Hkv, ·)`` group, in dtype ``cd``."""
    if scales.dim() == 1:  # fp8: per head
        return scales.to(cd).view(1, 1, Hkv, 1)
    # int8: per token, per head, gathered like the pages: (B·g, P, Hkv) -> (B, L, Hkv, 1)
    return scales.index_select(0, ids).to(cd).view(B, L, Hkv, 1)


def plan(q, k_pages, v_pages, block_table, seq_lens, call: PagedCall):
    """``(first, last)``: per sequence, the logical pages ``[first, last)`` holding an allowed
    key, the same for every layer of a step."""
    return page_ranges(call.mask, seq_lens.tolist(), q.shape[2], k_pages.shape[1], q.shape[1])


def run(q, k_pages, v_pages, block_table, seq_lens, call: PagedCall):
    """``(out, lse)``: out in ``q.dtype``; lse float32 (float64 for fp64 queries) or None unless
    ``call.return_lse``."""
    B, Hq, Sq, D = q.shape
    N, P, Hkv, _ = k_pages.shape
    Dv = v_pages.shape[3]
    G = Hq // Hkv
    scale, mask_obj, mod_obj = call.scale, call.mask, call.score_mod
    k_scales, v_scales = call.k_scales, call.v_scales
    cd = accumulation_dtype(q.dtype)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    device = q.device

    first, last = call.planned or plan(q, k_pages, v_pages, block_table, seq_lens, call)
    span = max((b - a for a, b in zip(first, last)), default=0)  # logical pages to walk
    keys = min(GROUP_KEYS, GATHER_ELEMENTS // max(B * Hkv * max(D, Dv), 1))
    group = max(1, keys // max(P, 1))  # logical pages per step

    lens = seq_lens.to(device=device, dtype=torch.long)
    b_idx = torch.arange(B, device=device).view(B, 1, 1, 1)
    h_idx = torch.arange(Hq, device=device).view(1, Hq, 1, 1)
    q_pos = (lens.view(B, 1) - Sq + torch.arange(Sq, device=device)).view(B, 1, Sq, 1)
    last_key = (lens - 1).clamp(min=0).view(B, 1, 1, 1)
    no_mods = mask_obj is None and mod_obj is None
    # State in (Hkv, B, ·) order: one kv head's slice is a contiguous (B, ·, ·) batch. Gathered
    # pages stay (B, L, Hkv, ·); a kv head of them is a strided (B, L, D) view that bmm reads
    # without a copy (row stride Hkv·D), so one bmm per kv head replaces a transposing copy.
    qg = (q.to(cd) * scale).reshape(B, Hkv, G * Sq, D)  # (B, Hq, Sq, D) -> (B, Hkv, G·Sq, D)
    qg = qg.transpose(0, 1).contiguous()  # (Hkv, B, G·Sq, D)
    min_len = int(seq_lens.min()) if B else 0
    # (B, Hkv, 2) -> (Hkv, B, 1, 2): a kv head's [start, end) per sequence, as the state's order
    holes = None if call.holes is None else call.holes.transpose(0, 1).unsqueeze(2)

    table = block_table.to(device=device, dtype=torch.long)
    first_t = torch.tensor(first, dtype=torch.long, device=device).view(B, 1)
    # Keys past a sequence's last page with an allowed key count as invalid (as past its end).
    ends = torch.minimum(lens, torch.tensor(last, dtype=torch.long, device=device) * P)
    max_pages = table.shape[1]
    # Every step gathers (and converts low-precision or quantised pages) into the same buffers:
    # a fresh multi-MiB tensor per step costs more in page faults than the gather itself (the
    # allocator hands big blocks back to the OS), 2-3x the whole call. Only
    # where autograd cannot have saved a buffer for backward (it would see it overwritten):
    # grad disabled, or nothing requires grad and no score_mod could capture such a tensor.
    needs_grad = any(t.requires_grad for t in (q, k_pages, v_pages)) or mod_obj is not None
    reuse = not torch.is_grad_enabled() or not needs_grad
    n_buf = B * min(group, span) if reuse else 0  # pages gathered per step, at most
    k_buf = k_pages.new_empty((n_buf, P, Hkv, D))
    v_buf = v_pages.new_empty((n_buf, P, Hkv, Dv))
    kc_buf = k_buf.new_empty(k_buf.shape, dtype=cd) if reuse and k_pages.dtype != cd else None
    vc_buf = v_buf.new_empty(v_buf.shape, dtype=cd) if reuse and v_pages.dtype != cd else None

    # The first walk sums P·V with plain matmuls. IEEE's 0·NaN = NaN lets a NaN/inf in V reach
    # rows that do not attend its key too; when that made the sums non-finite (one reduction
    # per call: NaN/inf propagate through a sum), a second walk re-sums each group whose P·V
    # came out non-finite over each row's attended keys alone.
    for exact in (False, True):
        m = torch.full((Hkv, B, G * Sq, 1), -math.inf, dtype=cd, device=device)  # running max
        l_sum = torch.zeros(Hkv, B, G * Sq, 1, dtype=cd, device=device)  # running sum of exp
        acc = torch.zeros(Hkv, B, G * Sq, Dv, dtype=cd, device=device)  # running weighted V sum
        # Step j covers logical pages first[b] + [j0, j1) of each sequence b: a sliding window
        # over a long context walks only the pages in its window, whatever each sequence's length.
        for j0 in range(0, span, group):
            j1 = min(j0 + group, span)
            L = (j1 - j0) * P
            cols = first_t + j0 + torch.arange(j1 - j0, device=device)  # (B, g) logical pages
            # Pages past a sequence's used ones (table entries -1 or stale) are clamped to a
            # valid id; their slots are masked invalid below and their V zeroed.
            ids = table.gather(1, cols.clamp(max=max(max_pages - 1, 0)))
            ids = ids.clamp(0, max(N - 1, 0)).reshape(-1)  # (B·g,)
            n_ids = ids.numel()
            if reuse:
                k = torch.index_select(k_pages, 0, ids, out=k_buf[:n_ids])  # (B·g, P, Hkv, D)
                v = torch.index_select(v_pages, 0, ids, out=v_buf[:n_ids])  # (B·g, P, Hkv, Dv)
            else:
                k = k_pages.index_select(0, ids)
                v = v_pages.index_select(0, ids)
            # bf16 / fp16 / quantised pages are read in cd (into the reused buffers if allowed).
            k = k.to(cd) if kc_buf is None else kc_buf[:n_ids].copy_(k)
            v = v.to(cd) if vc_buf is None else vc_buf[:n_ids].copy_(v)
            k = k.view(B, L, Hkv, D)  # (B·g, P, Hkv, D) -> (B, L, Hkv, D)
            v = v.view(B, L, Hkv, Dv)  # (B, L, Hkv, Dv)
            if k_scales is not None:  # dequantise this group only (in place in our own buffer)
                ks = _group_scales(k_scales, ids, B, L, Hkv, cd)
                k = k * ks if kc_buf is None else k.mul_(ks)
            if v_scales is not None:
                vs = _group_scales(v_scales, ids, B, L, Hkv, cd)
                v = v * vs if vc_buf is None else v.mul_(vs)
            kv_pos = (cols[:, :1] * P + torch.arange(L, device=device)).view(B, 1, 1, L)
            # Mods see slots past a sequence's end (masked below whatever they say) as its last
            # key, so a tensor read by key position is never indexed past the sequence.
            kv_mod = kv_pos if no_mods else torch.minimum(kv_pos, last_key)
            # (B, G·Sq, D) @ (B, D, L) per kv head, stacked: (Hkv, B, G·Sq, L)
            s = torch.stack([torch.bmm(qg[h], k[:, :, h].transpose(1, 2)) for h in range(Hkv)])
            if mod_obj is not None:
                s4 = s.transpose(0, 1).reshape(B, Hq, Sq, L)  # per query head, as mods expect
                s4 = mod_obj.score_mod(s4, b_idx, h_idx, q_pos, kv_mod)
                s4 = torch.broadcast_to(s4, (B, Hq, Sq, L)).to(cd)
                s = s4.reshape(B, Hkv, G * Sq, L).transpose(0, 1)  # (Hkv, B, G·Sq, L)
            allowed = None  # None: every key of the group is valid and allowed (no work at all)
            if mask_obj is not None:
                mm = torch.as_tensor(mask_obj.mask_mod(b_idx, h_idx, q_pos, kv_mod))
                if mm.dtype != torch.bool:
                    raise TypeError(f"mask_mod must return a bool tensor, got {mm.dtype}")
                mm = (mm.to(device) & (kv_pos < ends.view(B, 1, 1, 1))).expand(B, Hq, Sq, L)
                allowed = mm.reshape(B, Hkv, G * Sq, L).transpose(0, 1)  # (Hkv, B, G·Sq, L)
            elif j1 * P > min_len or holes is not None:  # a sequence ends here, or holes
                allowed = kv_pos.view(1, B, 1, L) < ends.view(1, B, 1, 1)
                allowed = allowed.expand(Hkv, B, G * Sq, L)
            if holes is not None:  # each kv head's rows skip its hole's keys
                at = kv_pos.view(1, B, 1, L)
                hole = (at >= holes[..., :1]) & (at < holes[..., 1:])  # (Hkv, B, 1, L)
                allowed = allowed & ~hole
            if allowed is not None:
                # masked_fill (not an additive -inf): NaN scores from garbage K are replaced too.
                s = s.masked_fill(~allowed, -math.inf)
                # A key no query of its (b, kv head) attends has weight 0, and 0 · NaN = NaN.
                cols = allowed.any(dim=2).permute(1, 2, 0).unsqueeze(-1)  # (B, L, Hkv, 1)
                v = v.masked_fill(~cols, 0.0)

            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            # Rows with no key so far keep m = -inf; subtracting 0 instead keeps exp() NaN-free.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)  # rescales the old sums; 0 when m was -inf
            p = torch.exp(s - m_safe)  # (Hkv, B, G·Sq, L)
            l_sum = l_sum * alpha + p.sum(dim=-1, keepdim=True)
            # (B, G·Sq, L) @ (B, L, Dv) per kv head, stacked: (Hkv, B, G·Sq, Dv)
            pv = torch.stack([torch.bmm(p[h], v[:, :, h]) for h in range(Hkv)])
            if exact and not bool(torch.isfinite(pv.sum())):
                pv = _weighted_sum_attended(p, v.permute(2, 0, 1, 3), s != -math.inf)
            acc = acc * alpha + pv
            m = m_new
        if exact or bool(torch.isfinite(acc.sum())):
            break

    acc, l_sum, m = (t.transpose(0, 1) for t in (acc, l_sum, m))  # (B, Hkv, G·Sq, ·)
    empty = l_sum == 0
    out = acc / torch.where(empty, torch.ones_like(l_sum), l_sum)
    out = out.masked_fill(empty, 0.0).reshape(B, Hq, Sq, Dv).to(q.dtype)  # (B, Hq, Sq, Dv)
    if not call.return_lse:
        return out, None
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(l_sum))
    return out, lse.reshape(B, Hq, Sq).to(lse_dtype)


def _reject(q, k_pages, v_pages, block_table, seq_lens, call):
    return None  # runs every case


# Per pair against the C kernel's 1: decode is memory-bound, and every plain-PyTorch form over a
# permuted page pool either copies the pages first or pays a tiny matmul per page.
_COST = Cost(10.0, "gathers groups of pages before its matmuls (a copy the kernels avoid)")


register(
    Backend(
        "torch",
        sinks_merged(run),  # the kernel's exact lse, the sink merged after it
        _reject,
        cost=lambda *args: _COST,
        doc="plain PyTorch: bounded groups of pages gathered, online softmax; every case",
        kind="paged",
        plan=plan,
        supports=BASE_FIELDS["paged"] | {"sinks", "holes"},
    )
)
