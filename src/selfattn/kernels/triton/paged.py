"""Paged attention on CUDA: one Triton kernel reading K/V pages in place (flash-decoding).

Sequence ``b`` owns the pages in row ``b`` of ``block_table``; key ``t`` lives in slot ``t % P`` of
page ``block_table[b, t // P]``. Query row ``i`` may attend keys ``lo[b, i] <= t < hi[b, i]`` (one
interval per row covers causal, sliding-window and chunked masks, bottom-right aligned per
sequence; the caller computes it).

Work split (why): a decode step has one query row per head, far too little to fill a GPU with one
program per (sequence, kv head). So the key axis is also split into ``n_splits`` contiguous
ranges, each program runs the online softmax over its range, and the partial outputs merge
through their float32 log-sum-exp afterwards (FlashDecoding, Dao et al. 2023). How many
splits: :data:`SPLIT_TABLE`, by (programs, context). Pages of a power-of-two size >= 16 are
read whole, several per tile (:func:`_tile_keys`): one block-table read per page, not per key.
The ``G = Hq/Hkv`` query heads of a kv head are the rows of one matmul tile, so K/V are read
once per kv head (GQA without repeating K/V). A split whose keys are all masked gives lse
``-inf`` and weight 0 in the merge, never NaN.

This module imports Triton: import it only where a kernel will run (the op
``torch.ops.selfattn.paged_decode_triton`` of :mod:`selfattn.kernels.ops` does so on its first
call); :func:`selfattn.kernels.triton.available` checks without importing it. Under
``TRITON_INTERPRET=1`` (set before the import) the kernel runs on CPU tensors, which is how the
test suite checks it.

NaN/inf in V reaches only the rows that attend its key (the C kernel's result, where IEEE's
``0 · NaN = NaN`` in ``P @ V`` would poison the tile's other rows): a program whose sums came out
non-finite walks its keys again, this time summing V over each row's allowed keys alone
(:func:`_weighted_sum_attended`); a finite cache pays one check per program.

Quantised pages are dequantised in registers, a tile at a time: int8 with per-token, per-head
bfloat16 scales ``(N, P, Hkv)``, fp8 with per-head float32 scales ``(Hkv,)``
(``selfattn.cache.quant``).

:func:`selfattn.kernels.paged_twin.paged_attention_twin` is the plain-PyTorch statement of the
same computation (gather, mask, softmax) used to test the kernel.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from selfattn.kernels.determinism import SPLIT_KEYS, is_deterministic

__all__ = [
    "interpreted",
    "merge_splits",
    "online_softmax_step",
    "paged_attention_triton",
    "pow2",
]

LOG2E = 1.4426950408889634  # exp(x) = exp2(x · log2 e): exp2 is the native instruction
BLOCK_N = 32  # keys per tile of the per-key walk: >= 16 for tl.dot
# Whole-page tiles (pages of a power-of-two size >= 16): a tile is PAGE_TILE_KEYS keys of whole
# pages (or one page if pages are larger), so each page id is read once per tile and each
# page's slots are one strided run, instead of one block-table read and address per key.
PAGE_TILE_KEYS = 64
# Key splits per (programs = B·Hkv·query tiles, longest context), FlashDecoding's rule: enough
# programs for a few waves on a 132-SM GPU (H100/H200), each split at least MIN_SPLIT_TILES
# tiles long. Rows: programs up to; columns: context up to (last: any). Set from that rule
# before any GPU measurement; ``benchmarks/gpu.py --part triton`` sweeps the splits of the
# issue's decode case ("splits sweep ms"): replace the entries by the fastest.
SPLIT_CONTEXTS = (1024, 4096, 16384, None)
SPLIT_TABLE = (
    (32, (8, 16, 32, 64)),
    (128, (4, 8, 16, 32)),
    (512, (2, 4, 8, 16)),
    (2048, (1, 2, 4, 8)),
    (None, (1, 1, 2, 4)),
)
MIN_SPLIT_TILES = 4
SCALES_NONE, SCALES_PER_TOKEN, SCALES_PER_HEAD = 0, 1, 2


@triton.jit
def _weighted_sum_attended(p, v, allowed):
    """``p @ v`` over each row's allowed keys only, in float32 (the rare walk, after the fast
    one's sums came out non-finite). IEEE gives ``0 · NaN = NaN``, so a NaN at a key only some
    rows attend would poison the others; here a non-finite value reaches exactly the rows that
    attend its key, as in a sum over those keys alone (the C kernel's): NaN gives NaN, ``±inf``
    gives ``±inf`` at a positive weight and NaN at weight 0 or when both signs meet. Indicator
    dots count where each kind lands (0/1 operands: exact). PyTorch twin:
    ``selfattn.backends.paged.pytorch._weighted_sum_attended``."""
    v = v.to(tl.float32)
    inf = float("inf")
    out = tl.dot(p, tl.where(tl.abs(v) < inf, v, 0.0), input_precision="ieee")
    positive = (p > 0).to(tl.float32)  # implies allowed: masked scores are -inf, weight 0
    pos_inf = tl.dot(positive, (v == inf).to(tl.float32), input_precision="ieee") > 0
    neg_inf = tl.dot(positive, (v == -inf).to(tl.float32), input_precision="ieee") > 0
    nan = tl.dot(allowed.to(tl.float32), (v != v).to(tl.float32), input_precision="ieee")
    zero_w = (allowed & (p == 0)).to(tl.float32)
    nan += tl.dot(zero_w, (tl.abs(v) == inf).to(tl.float32), input_precision="ieee")
    out = tl.where(pos_inf, inf, tl.where(neg_inf, -inf, out))
    return tl.where((nan > 0) | (pos_inf & neg_inf), float("nan"), out)


@triton.jit
def online_softmax_step(m_i, l_i, s):
    """One tile of the online softmax on base-2 scores ``s (M, N)``: ``(m_new, p, alpha, l)``,
    the new running max, the tile's weights ``2^(s - m_new)``, the factor that rescales what
    came before, and the new running sum. A row with nothing allowed yet keeps max -inf and
    weight 0, never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, p, alpha, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_keys(
    q, lo, hi, h_lo, h_hi, start, stop, b, kvh,
    K, V, BT, KS, VS, sc_rows,
    s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt, s_ksn, s_ksp,
    qk_scale, P,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SCALES: tl.constexpr,
    IEEE: tl.constexpr, EXACT: tl.constexpr, PAGE: tl.constexpr, SCORES: tl.constexpr,
):  # fmt: skip
    """Online softmax of the tile's rows over keys ``[start, stop)``, less the kv head's hole
    ``[h_lo, h_hi)``: ``(m, l, acc)``, base 2. ``SCORES``: each attended key's score (natural
    base, ``scale · q · k``) is also stored at ``sc_rows + key`` (a pointer per row).

    ``EXACT`` (the second walk, run only when the first left a non-finite value in a row)
    sums V through :func:`_weighted_sum_attended`, so NaN/inf at a key a row does not attend
    stays out of that row.
    """
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # qk_scale = scale · LOG2E (the wrapper's): scores, max and lse in base 2, for exp2
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < stop
        if PAGE > 0:  # whole pages: one block-table read per page, slots in one strided run
            first = n0 // PAGE + tl.arange(0, BLOCK_N // PAGE)
            ids = tl.load(BT + b * s_bt + first, mask=first * PAGE < stop, other=0)
            page = tl.reshape(
                tl.broadcast_to(ids.to(tl.int64)[:, None], [BLOCK_N // PAGE, PAGE]), [BLOCK_N]
            )
        else:
            page = tl.load(BT + b * s_bt + n // P, mask=n_ok, other=0).to(tl.int64)
        slot = n % P
        k_ptrs = K + page[:, None] * s_kn + slot[:, None] * s_kp + kvh * s_kh + d[None, :]
        k = tl.load(k_ptrs, mask=n_ok[:, None] & (d[None, :] < D), other=0.0)
        v_ptrs = V + page[:, None] * s_vn + slot[:, None] * s_vp + kvh * s_vh + dv[None, :]
        v = tl.load(v_ptrs, mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0)
        # -- dequantise in registers (int8: per token and head; fp8: per head)
        if SCALES == 1:
            ks = tl.load(KS + page * s_ksn + slot * s_ksp + kvh, mask=n_ok, other=0.0)  # bf16
            vs = tl.load(VS + page * s_ksn + slot * s_ksp + kvh, mask=n_ok, other=0.0)
            ks, vs = ks.to(tl.float32), vs.to(tl.float32)
            k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        elif SCALES == 2:
            k = (k.to(tl.float32) * tl.load(KS + kvh)).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(VS + kvh)).to(q.dtype)
        # -- scores of the tile, masked to each row's interval (NaN scores of garbage K too)
        if IEEE:  # q is float32 already
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        allowed = (n[None, :] >= lo[:, None]) & (n[None, :] < hi[:, None]) & n_ok[None, :]
        allowed = allowed & ((n[None, :] < h_lo) | (n[None, :] >= h_hi))
        s = tl.where(allowed, s, float("-inf"))
        if SCORES:
            tl.store(sc_rows[:, None] + n[None, :], s * 0.6931471805599453, mask=allowed)  # ln 2
        m_new, p, alpha, l_i = online_softmax_step(m_i, l_i, s)
        # -- weighted V rows
        if EXACT:
            pv = _weighted_sum_attended(p, v, allowed)
        elif IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_fwd(
    Q, K, V, BT, LO, HI, HOLES, KS, VS, O, LSE, SC,
    s_qb, s_qh, s_qs,
    s_kn, s_kp, s_kh,
    s_vn, s_vp, s_vh,
    s_bt, s_lo,
    s_ksn, s_ksp,
    s_ob, s_oh, s_os, s_osp,
    s_lb, s_lh, s_ls,
    s_scb, s_sch, s_scs,
    qk_scale, Hkv, G, Sq, P, split_len,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SCALES: tl.constexpr,
    IEEE: tl.constexpr, PAGE: tl.constexpr, HAS_HOLES: tl.constexpr, SCORES: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    # -- rows of this tile: (query row i, group member g) pairs of one kv head
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq * G
    i = rows // G
    h = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b * s_qb + h[:, None] * s_qh + i[:, None] * s_qs + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    lo = tl.load(LO + b * s_lo + i, mask=row_ok, other=0)
    hi = tl.load(HI + b * s_lo + i, mask=row_ok, other=0)
    # -- this kv head's hole [h_lo, h_hi) (a compacted sequence's ragged kept count); none: 0, 0
    h_lo = 0
    h_hi = 0
    if HAS_HOLES:
        h_lo = tl.load(HOLES + pid_bh * 2)
        h_hi = tl.load(HOLES + pid_bh * 2 + 1)
    # -- this program's keys: its split, cut to the union of the rows' intervals
    start = tl.maximum(split * split_len, tl.min(tl.where(row_ok, lo, 2147483647), axis=0))
    if PAGE > 0:  # tiles start on page boundaries (splits do: split_len is whole tiles)
        start = start // BLOCK_N * BLOCK_N
    stop = tl.minimum(split * split_len + split_len, tl.max(hi, axis=0))
    sc_rows = SC + b * s_scb + h * s_sch + i * s_scs  # each row's score buffer (SCORES)
    m_i, l_i, acc = _attend_keys(
        q, lo, hi, h_lo, h_hi, start, stop, b, kvh, K, V, BT, KS, VS, sc_rows,
        s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt, s_ksn, s_ksp, qk_scale, P,
        D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, SCALES, IEEE, False, PAGE, SCORES,
    )  # fmt: skip
    # -- rare: a NaN/inf reached the sums; walk the keys again, keeping it to the rows that
    # attend it (one check per program: the fast walk pays nothing per tile for it)
    if tl.max(tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1), axis=1), axis=0) > 0:
        m_i, l_i, acc = _attend_keys(
            q, lo, hi, h_lo, h_hi, start, stop, b, kvh, K, V, BT, KS, VS, sc_rows,
            s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt, s_ksn, s_ksp, qk_scale, P,
            D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, SCALES, IEEE, True, PAGE, SCORES,
        )  # fmt: skip
    # -- this split's normalised output and base-2 lse (-inf: no allowed key; NaN, from a NaN
    # score of an attended key, stays NaN: `l_i > 0` alone took such a row for an empty one)
    seen = (l_i > 0) | (l_i != l_i)
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_ptrs = O + b * s_ob + h[:, None] * s_oh + i[:, None] * s_os + split * s_osp + dv[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + b * s_lb + h * s_lh + i * s_ls + split, lse, mask=row_ok)


def interpreted() -> bool:
    """Triton's CPU interpreter (tests): its tl.dot on bfloat16 operands is wrong (triton 3.9:
    errors ~1e10 on a 16×16 product), so it gets float32 operands; a GPU multiplies in bf16."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _tile_keys(P: int) -> tuple[int, int]:
    """``(keys per tile, PAGE)``: whole pages per tile where the page size allows (a power of
    two >= 16, so a tile is whole pages and a page whole tiles' worth of tl.dot rows), else the
    per-key walk (``PAGE`` 0)."""
    if P >= 16 and P & (P - 1) == 0:
        return max(P, PAGE_TILE_KEYS), P
    return BLOCK_N, 0


def _num_splits(programs: int, max_len: int, tile: int) -> int:
    """Key splits from :data:`SPLIT_TABLE`, each split at least ``MIN_SPLIT_TILES`` tiles."""
    col = next(i for i, c in enumerate(SPLIT_CONTEXTS) if c is None or max_len <= c)
    want = next(row for limit, row in SPLIT_TABLE if limit is None or programs <= limit)[col]
    return max(1, min(want, max_len // (MIN_SPLIT_TILES * tile)))


def paged_attention_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
    holes: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Hq, Sq, Dv), lse (B, Hq, Sq) float32)`` of the queries over their pages.

    Args:
        q: ``(B, Hq, Sq, D)`` fp32 / fp16 / bf16.
        k_pages, v_pages: ``(N, P, Hkv, D)`` / ``(N, P, Hkv, Dv)`` in q's dtype, or int8 / fp8
            with ``k_scales``/``v_scales`` (bfloat16 ``(N, P, Hkv)`` for int8, float32
            ``(Hkv,)`` for fp8).
        block_table: ``(B, max_pages)`` int page ids.
        lo, hi: ``(B, Sq)`` int: row ``i`` of sequence ``b`` attends keys ``lo <= t < hi``.
        num_splits: key-axis splits (default: enough programs for the GPU).
        sinks: ``(Hq,)`` learned attention-sink logits, joining where the splits merge.
        holes: ``(B, Hkv, 2)`` int: each sequence's and kv head's skipped keys ``[start,
            end)`` (a compacted sequence's ragged kept counts); None: none.
        scores: ``(B, Hq, Sq, L)`` float32, ``L >= max_pages * P``, last dim contiguous, or
            None: each attended key's score ``scale · q · k`` is written at its slot as the
            kernel computes it (decode-time eviction's statistic: the weights are ``exp(score
            - lse)``); slots a row does not attend are left as they are (the caller's -inf).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Dv, P = k_pages.shape[2], v_pages.shape[3], k_pages.shape[1]
    G = Hq // Hkv
    max_len = int(hi.max()) if hi.numel() else 0
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1 or q.stride(3) != 1:
        raise ValueError("paged_attention_triton needs the last dim of q and the pages contiguous")
    block_m = pow2(Sq * G)
    if block_m > 64:
        block_m = 64
    m_tiles = math.ceil(Sq * G / block_m)
    tile, page = _tile_keys(P)
    if num_splits is None and is_deterministic():  # fixed boundaries whatever the batch
        split_len = math.ceil(SPLIT_KEYS / tile) * tile
        num_splits = max(1, math.ceil(max_len / split_len))
    else:
        if num_splits is None:
            num_splits = _num_splits(B * Hkv * m_tiles, max_len, tile)
        split_len = math.ceil(max(max_len, 1) / num_splits / tile) * tile
    out = torch.empty(B, Hq, Sq, num_splits, Dv, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, Hq, Sq, num_splits, device=q.device, dtype=torch.float32)
    quant = k_pages.dtype not in (torch.float32, torch.float16, torch.bfloat16)
    if quant and (k_scales is None or v_scales is None):
        raise ValueError(f"{k_pages.dtype} pages need k_scales and v_scales")
    mode = SCALES_NONE
    if quant:
        mode = SCALES_PER_TOKEN if k_scales.dim() == 3 else SCALES_PER_HEAD
    # as stored (int8: bfloat16, converted in registers); q: an unused pointer when not quantised
    ks = k_scales.contiguous() if quant else q
    vs = v_scales.contiguous() if quant else q
    s_ksn, s_ksp = (ks.stride(0), ks.stride(1)) if mode == SCALES_PER_TOKEN else (0, 0)
    table = block_table.to(q.device, torch.int32).contiguous()
    lo32, hi32 = (t.to(q.device, torch.int32).contiguous() for t in (lo, hi))
    holes32 = table if holes is None else holes.to(q.device, torch.int32).contiguous()
    sc = _score_buffer(scores, q, table.shape[1] * P)
    grid = (B * Hkv, num_splits, m_tiles)
    _paged_fwd[grid](
        q, k_pages, v_pages, table, lo32, hi32, holes32, ks, vs, out, lse, sc,
        q.stride(0), q.stride(1), q.stride(2),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        table.stride(0), lo32.stride(0),
        s_ksn, s_ksp,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        lse.stride(0), lse.stride(1), lse.stride(2),
        sc.stride(0), sc.stride(1), sc.stride(2),
        float(scale) * LOG2E, Hkv, G, Sq, P, split_len,
        D=D, DV=Dv, BLOCK_M=block_m, BLOCK_N=tile,
        BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv), SCALES=mode,
        IEEE=q.dtype == torch.float32 or interpreted(), PAGE=page, HAS_HOLES=holes is not None,
        SCORES=scores is not None,
    )  # fmt: skip
    return merge_splits(out, lse / LOG2E, q.dtype, sinks)  # base-2 lse -> natural log


def _score_buffer(scores: torch.Tensor | None, q: torch.Tensor, slots: int) -> torch.Tensor:
    """``scores`` checked (ValueError naming the shape, dtype or layout wanted), or, where
    None, an unused float32 tensor of q's first three dims for the kernel's strides."""
    B, Hq, Sq = q.shape[:3]
    if scores is None:
        return torch.empty(B, Hq, Sq, 1, device=q.device, dtype=torch.float32)
    if (
        scores.dtype != torch.float32
        or scores.device != q.device
        or scores.dim() != 4
        or tuple(scores.shape[:3]) != (B, Hq, Sq)
        or scores.shape[3] < slots
        or scores.stride(3) != 1
    ):
        raise ValueError(
            f"scores {tuple(scores.shape)} {scores.dtype} on {scores.device}: the key-score "
            f"buffer must be float32 (B, Hq, Sq, >= max_pages * P)=({B}, {Hq}, {Sq}, >= "
            f"{slots}) on {q.device}, its last dim contiguous"
        )
    return scores


def merge_splits(
    out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, sinks: torch.Tensor | None = None
):
    """Merge per-split ``out (B, Hq, Sq, n, Dv)`` and ``lse (B, Hq, Sq, n)`` through the lse.

    Splits with lse ``-inf`` weigh 0; a row with no allowed key anywhere gives 0 and ``-inf``; a
    split with lse NaN (a NaN score) makes its row's out and lse NaN.
    ``sinks (Hq,)``: each row's sink joins the merge as one more split with no value (output
    0, lse ``sink`` for a row with no key).
    """
    parts = lse
    if sinks is not None:  # (B, Hq, Sq, n) -> (B, Hq, Sq, n + 1)
        sink = sinks.detach().to(lse.device, lse.dtype).view(1, -1, 1, 1)
        parts = torch.cat([lse, sink.expand(*lse.shape[:3], 1)], dim=-1)
    ordered = is_deterministic()  # splits summed one by one: trailing empty ones add exact 0
    total = _in_order_logsumexp(parts) if ordered else torch.logsumexp(parts, dim=-1)
    finite = torch.isfinite(total)
    w = torch.exp(lse - torch.where(finite, total, 0.0).unsqueeze(-1))  # (B, Hq, Sq, n)
    w = torch.where(torch.isfinite(lse) | lse.isnan(), w, 0.0)  # a NaN split makes the row NaN
    terms = w.unsqueeze(-1) * out  # (B, Hq, Sq, n, Dv)
    if ordered:
        merged = terms[..., 0, :]
        for i in range(1, terms.shape[-2]):
            merged = merged + terms[..., i, :]
    else:
        merged = terms.sum(dim=-2)  # (B, Hq, Sq, n, Dv) -> (B, Hq, Sq, Dv)
    return merged.to(dtype), total


def _in_order_logsumexp(parts: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last dim with the exponentials summed first to last."""
    top = parts.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    acc = torch.exp(parts[..., 0] - top[..., 0])
    for i in range(1, parts.shape[-1]):
        acc = acc + torch.exp(parts[..., i] - top[..., 0])
    return torch.log(acc) + top[..., 0]
