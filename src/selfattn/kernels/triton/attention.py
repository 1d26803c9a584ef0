"""Dense attention on CUDA: Triton forward and backward over block-sparse tile lists.

The ``(Sq, Sk)`` score matrix is cut into ``BLOCK_M × BLOCK_N`` tiles that the mask classifies
(``Mask.tile_kinds``: EMPTY / PARTIAL / FULL, reduced over batch and heads). Each query block gets
a list of its non-empty key blocks, FULL ones first (:func:`tile_lists`)::

    kv_order[i] = [FULL blocks ..., PARTIAL blocks ..., unused]   kv_counts[i] = (n_full, n_partial)

A program runs the online softmax (Milakov & Gimelshein; FlashAttention-2, Dao 2023) over its
FULL blocks with no mask work at all, then over its PARTIAL blocks with the mask evaluated in the
kernel, and never touches an EMPTY block. The mask arrives as data, never as code:

- ``lo, hi (B' or 1, Sq)`` int32: query row ``i`` may attend keys ``lo <= j < hi``. Causal (any
  ``q_offset``), sliding window, chunked, padding (per-batch lengths), prefix-LM and their ``&``
  are all one key interval per row (``Mask.key_interval``), computed by the caller in O(B·Sq).
- ``ids (B' or 1, S)`` int32 (optional): document ids by absolute position, ``ids[q] == ids[j]``
  also required (packed documents).

So a new window size, document layout or sequence length changes only tensors and unspecialised
integers: the compiled kernel is reused (only the constexpr block sizes, head dims and feature
flags specialise it; ``launches`` records what each launch was specialised on, for the test).
Score mods are also data: ALiBi slopes ``(Hq,)``, an additive bias (a strided view broadcast
over ``(B, Hq, Sq, Sk)``) and a soft cap, applied in that order to the scaled score.

GQA without repeating K/V: a forward tile's rows are the ``G`` query heads of one kv head
times ``BLOCK_M / G`` positions (:func:`gqa_pack`; ``G`` a power of two), so each K/V tile is
read once for the group; the backward's dK/dV program of a kv block loops over the group's
heads, so their sum needs no atomics. dQ is either a second pass over per-query-block lists
(``deterministic``: no atomics, the result is bitwise reproducible) or accumulated with float32
atomics in the dK/dV pass.

Dropout drops the same pairs as every other backend: the counter-based hash of
``selfattn.backends._common.dropout_keep`` (murmur3's finaliser over seed, b, h, position, key)
computed in uint32 in the kernel; the caller hashes the seed (``seed_word``).

Under ``TRITON_INTERPRET=1`` (set before Triton is imported) the kernels run on CPU tensors, which
is how the test suite checks them; there, ``tl.dot`` gets float32 operands (the interpreter's
bf16 dot is wrong, see :func:`selfattn.kernels.triton.paged.interpreted`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from selfattn.kernels.triton.paged import interpreted, online_softmax_step, pow2

__all__ = [
    "BLOCKS",
    "Blocks",
    "attention_triton_bwd",
    "attention_triton_fwd",
    "blocks",
    "gqa_pack",
    "launches",
    "tile_lists",
]

# Tile kinds as the caller passes them: selfattn.masks.TileKind's values (kernels import nothing
# above them, so the values are restated here; EMPTY is 0).
PARTIAL, FULL = 1, 2
LOG2E = 1.4426950408889634  # exp(x) = exp2(x · log2 e): exp2 is the native instruction
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class Blocks:
    """Tile sizes of one kernel: ``m`` query rows by ``n`` keys, and its launch shape."""

    m: int
    n: int
    warps: int = 4
    stages: int = 2


# Per head dim bucket (<= 64, <= 128, larger), chosen for an H100/H200 (FlashAttention-2's and
# FlexAttention's defaults); to be tuned on the first GPU run (benchmarks/gpu.py --part triton).
# The backward's tiles are smaller: it holds q, dO, K, V, dK, dV at once.
BLOCKS = {
    "fwd": {64: Blocks(128, 64, 4, 3), 128: Blocks(128, 64, 8, 3), 256: Blocks(64, 32, 8, 2)},
    "bwd": {64: Blocks(64, 64, 4, 2), 128: Blocks(64, 64, 8, 2), 256: Blocks(32, 32, 8, 1)},
}
# Under the interpreter every program runs in Python: small tiles, so that small test shapes
# still cross tile boundaries and exercise FULL, PARTIAL and EMPTY tiles.
INTERPRETED_BLOCKS = Blocks(16, 16, 1, 1)


def blocks(kind: str, head_dim: int) -> Blocks:
    """The tile sizes of ``kind`` ("fwd" or "bwd") for a head dim (the larger of D and Dv)."""
    if interpreted():
        return INTERPRETED_BLOCKS
    table = BLOCKS[kind]
    return table[min((d for d in table if d >= head_dim), default=max(table))]


# ----------------------------------------------------------------------------------------------
# Host side: tile lists and the compile-key record
# ----------------------------------------------------------------------------------------------


def gqa_pack(G: int, block_m: int) -> int:
    """Query heads per forward tile: all ``G`` of a kv head (K/V read once for them) when ``G``
    is a power of two that fits the tile, else 1 (K/V shared through the cache only). The
    forward's tile lists are then over blocks of ``block_m // pack`` query positions."""
    return G if G & (G - 1) == 0 and G <= block_m else 1


def tile_lists(kinds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order (R, C) int32, counts (R, 2) int32)`` from tile kinds ``(R, C)`` (0 EMPTY,
    1 PARTIAL, 2 FULL): row ``r`` lists its FULL columns, then its PARTIAL ones, each in
    increasing order; ``counts[r] = (n_full, n_partial)``. No host sync (a sort, not nonzero):
    the lists have a fixed size and the kernel reads only the counted entries. Pass ``kinds.T``
    for the backward's per-key-block lists of query blocks."""
    kinds = kinds.to(torch.int32)
    cols = torch.arange(kinds.shape[1], device=kinds.device, dtype=torch.int32)
    # FULL first, then PARTIAL, then EMPTY, by column inside each kind
    key = (FULL - kinds) * kinds.shape[1] + cols
    order = torch.argsort(key, dim=1).to(torch.int32)
    counts = torch.stack([(kinds == FULL).sum(1), (kinds == PARTIAL).sum(1)], dim=1)
    return order.contiguous(), counts.to(torch.int32).contiguous()


# What each launch was specialised on: (kernel name, constexprs, specialised int arguments by
# Triton's rule). The test checks that new windows, documents and lengths add no new key; the
# GPU benchmark counts the real JIT cache entries.
launches: set[tuple] = set()  # bounded: one entry per distinct specialisation

# Arguments that vary with the mask's data, the lengths or the seed: never specialised (Triton
# would otherwise compile anew when one of them turns 1 or a multiple of 16).
_FREE = ("Sq", "Sk", "q_offset", "seed_word", "s_lb", "s_ib", "s_o")


def _launch(kernel, grid, args: dict, constexprs: dict, blk: Blocks):
    """Launch ``kernel`` and record its specialisation (Triton specialises an int argument on
    ``== 1`` and ``% 16 == 0`` unless listed in ``do_not_specialize``, a tensor on its dtype)."""
    spec = []
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            spec.append((name, value.dtype))
        elif isinstance(value, bool) or name in _FREE:
            continue
        elif isinstance(value, int):
            spec.append((name, value == 1, value % 16 == 0, abs(value) >= 1 << 31))
    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
    launches.add((name, tuple(sorted(constexprs.items())), tuple(spec)))
    opts = {} if interpreted() else {"num_warps": blk.warps, "num_stages": blk.stages}
    kernel[grid](**args, **constexprs, **opts)


# ----------------------------------------------------------------------------------------------
# Device side
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh from exp2 (the interpreter has no libdevice tanh): odd, saturating, |err| ~ ulp(1)."""
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _dropout_keep(seed_word, b, h, q_pos, k_pos, p_drop):
    """``dropout_keep(seed, p, b, h, q_idx, kv_idx)`` of ``backends/_common`` on a tile: each
    row's head ``h (M,)`` and position ``q_pos (M,)``, key positions ``k_pos (N,)`` -> bool
    ``(M, N)``. uint32 arithmetic wraps like the PyTorch version's ``& 0xFFFFFFFF``."""
    golden = 0x9E3779B9
    x = seed_word.to(tl.uint32, bitcast=True)
    x = _fmix32(x ^ (b.to(tl.uint32) + golden))
    xh = _fmix32(x ^ (h.to(tl.uint32) + golden))  # (M,)
    xq = _fmix32(xh ^ (q_pos.to(tl.uint32, bitcast=True) + golden))  # (M,)
    xk = _fmix32(xq[:, None] ^ (k_pos.to(tl.uint32, bitcast=True)[None, :] + golden))  # (M, N)
    u = (xk >> 8).to(tl.float32) * (1.0 / 16777216.0)
    return u >= p_drop


@triton.jit
def _scores(
    q, k, rows, cols, b, h, slope, BIAS, s_bb, s_bh, s_bm, s_bn, Sq, Sk, scale, softcap,
    ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    q_offset,
):  # fmt: skip
    """The modded score in natural units ``(M, N)`` float32, and ``tanh`` of the soft cap's
    argument (for the backward's ``1 - t²``; zeros without a cap)."""
    s = _mma(q, tl.trans(k), IEEE) * scale
    if ALIBI:  # -slope[h] · |i - j| on absolute positions
        dist = tl.abs((q_offset + rows)[:, None] - cols[None, :]).to(tl.float32)
        s = s - slope[:, None] * dist
    if HAS_BIAS:
        ptrs = BIAS + b * s_bb + (h * s_bh + rows * s_bm)[:, None] + cols[None, :] * s_bn
        s = s + tl.load(ptrs, mask=(rows[:, None] < Sq) & (cols[None, :] < Sk), other=0.0).to(
            tl.float32
        )
    t = tl.zeros_like(s)
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = softcap * t
    return s, t


@triton.jit
def _allowed(rows_lo, rows_hi, ids_q, cols, b, IDS, s_ib, Sk, HAS_IDS: tl.constexpr):
    """The mask on a PARTIAL tile: the row's key interval, and the same document."""
    ok = (cols[None, :] >= rows_lo[:, None]) & (cols[None, :] < rows_hi[:, None])
    if HAS_IDS:
        ids_k = tl.load(IDS + b * s_ib + cols, mask=cols < Sk, other=-1)
        ok = ok & (ids_q[:, None] == ids_k[None, :])
    return ok


@triton.jit
def _mma(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32: IEEE float32 products under ``IEEE`` (float32 inputs,
    the interpreter), else tensor cores on ``b``'s dtype (``a``, weights in float32, cast)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _load_block(BASE, offs, width, LIMIT: tl.constexpr, idx_ok, IEEE: tl.constexpr):
    """Rows at element offsets ``offs`` by columns ``width`` (contiguous, ``< LIMIT``) of a
    tensor, zeros outside; float32 under ``IEEE``."""
    x = tl.load(BASE + offs[:, None] + width[None, :],
                mask=idx_ok[:, None] & (width[None, :] < LIMIT), other=0.0)  # fmt: skip
    if IEEE:
        x = x.to(tl.float32)
    return x


@triton.jit
def _kv_tile(ENTRY, K_bh, V_bh, s_kn, s_vn, Sk, D: tl.constexpr, DV: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
             IEEE: tl.constexpr):  # fmt: skip
    """The key block a list entry names: its key indices ``cols``, K and V."""
    cols = tl.load(ENTRY) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Sk
    k = _load_block(K_bh, cols * s_kn, tl.arange(0, BLOCK_D), D, col_ok, IEEE)
    v = _load_block(V_bh, cols * s_vn, tl.arange(0, BLOCK_DV), DV, col_ok, IEEE)
    return cols, k, v


@triton.jit
def _row_data(LO, HI, IDS, SLOPES, b, h, rows, row_ok, s_lb, s_ib, q_offset,
              BLOCK_M: tl.constexpr, HAS_IDS: tl.constexpr, ALIBI: tl.constexpr):  # fmt: skip
    """A query block's mask and mod data: key bounds ``lo, hi``, document ids and the ALiBi
    slope of each row (``h``: each row's query head, ``(BLOCK_M,)``)."""
    lo = tl.load(LO + b * s_lb + rows, mask=row_ok, other=0)
    hi = tl.load(HI + b * s_lb + rows, mask=row_ok, other=0)
    ids_q = tl.zeros([BLOCK_M], tl.int32)
    if HAS_IDS:
        ids_q = tl.load(IDS + b * s_ib + q_offset + rows, mask=row_ok, other=-2)
    slope = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32)
    return lo, hi, ids_q, slope


@triton.jit
def _fwd_range(
    acc, m_i, l_i, t0, t1, ORDER_ROW, q, rows, lo, hi, ids_q, slope, b, h, K_bh, V_bh,
    s_kn, s_vn, IDS, s_ib, BIAS, s_bb, s_bh, s_bm, s_bn, Sq, Sk, q_offset, scale, softcap,
    p_drop, seed_word,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_IDS: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """The online softmax over list entries ``[t0, t1)`` of a query block: FULL tiles
    (``MASKED`` False: no mask work at all) or PARTIAL ones (the mask evaluated here). Two
    loops, not one with a branch, so that each is a plain loop the compiler pipelines."""
    for t in range(t0, t1):
        cols, k, v = _kv_tile(ORDER_ROW + t, K_bh, V_bh, s_kn, s_vn, Sk, D, DV, BLOCK_D,
                              BLOCK_DV, BLOCK_N, False)  # fmt: skip
        s, _ = _scores(q, k, rows, cols, b, h, slope, BIAS, s_bb, s_bh, s_bm, s_bn, Sq, Sk,
                       scale, softcap, ALIBI, HAS_BIAS, SOFTCAP, IEEE, q_offset)  # fmt: skip
        s = s * 1.4426950408889634  # base 2 from here on
        if MASKED:
            ok = _allowed(lo, hi, ids_q, cols, b, IDS, s_ib, Sk, HAS_IDS)
            s = tl.where(ok, s, float("-inf"))
        # -- update running max and sum
        m_new, p, alpha, l_i = online_softmax_step(m_i, l_i, s)
        if DROPOUT:  # l (and so lse) is the undropped normaliser
            keep = _dropout_keep(seed_word, b, h, q_offset + rows, cols, p_drop)
            p = tl.where(keep, p / (1.0 - p_drop), 0.0)
        # -- weighted V rows
        acc = acc * alpha[:, None] + _mma(p, v, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=_FREE)
def _attn_fwd(
    Q, K, V, O, LSE, SCHED, ORDER, COUNTS, LO, HI, IDS, BIAS, SLOPES,
    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
    s_lb, s_ib, s_bb, s_bh, s_bm, s_bn, s_o,
    Sq, Sk, Hq, G, q_offset, scale, softcap, p_drop, seed_word,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_IDS: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr, PACK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.load(SCHED + tl.program_id(0))  # the query blocks with most tiles go first
    pid_bh = tl.program_id(1)
    # -- this tile's rows: PACK query heads of one kv head times BLOCK_M // PACK positions, so
    # K and V are read once for the PACK heads (GQA without repeating K/V)
    b = pid_bh // (Hq // PACK)
    h0 = pid_bh % (Hq // PACK) * PACK
    kvh = h0 // G
    r = tl.arange(0, BLOCK_M)
    h = h0 + r % PACK  # each row's query head
    rows = pid_m * (BLOCK_M // PACK) + r // PACK  # each row's query position (row of q)
    row_ok = rows < Sq
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = _load_block(Q + b * s_qb, h * s_qh + rows * s_qm, d, D, row_ok, IEEE)
    lo, hi, ids_q, slope = _row_data(LO, HI, IDS, SLOPES, b, h, rows, row_ok, s_lb, s_ib,
                                     q_offset, BLOCK_M, HAS_IDS, ALIBI)  # fmt: skip
    K_bh = K + b * s_kb + kvh * s_kh
    V_bh = V + b * s_vb + kvh * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    n_full = tl.load(COUNTS + pid_m * 2)
    n_part = tl.load(COUNTS + pid_m * 2 + 1)
    # -- FULL tiles first (no mask work), then PARTIAL ones (the mask evaluated here)
    for MASKED in tl.static_range(2):
        acc, m_i, l_i = _fwd_range(
            acc, m_i, l_i, n_full * MASKED, n_full + n_part * MASKED, ORDER + pid_m * s_o, q,
            rows, lo, hi, ids_q, slope, b, h, K_bh, V_bh, s_kn, s_vn, IDS, s_ib, BIAS, s_bb,
            s_bh, s_bm, s_bn, Sq, Sk, q_offset, scale, softcap, p_drop, seed_word, D, DV,
            BLOCK_D, BLOCK_DV, BLOCK_N, MASKED == 1, HAS_IDS, ALIBI, HAS_BIAS, SOFTCAP, DROPOUT,
            IEEE,
        )  # fmt: skip
    # -- normalise; a row with no allowed key gives 0 and lse -inf, never NaN
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + b * s_ob + (h * s_oh + rows * s_om)[:, None] + dv[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))  # fmt: skip
    tl.store(LSE + (b * Hq + h) * Sq + rows, lse, mask=row_ok)


@triton.jit
def _bwd_tile(
    q, do, lse2, delta, k, v, rows, cols, b, h, slope, lo, hi, ids_q, MASKED: tl.constexpr,
    IDS, s_ib, BIAS, s_bb, s_bh, s_bm, s_bn, Sq, Sk, q_offset, scale, softcap, p_drop, seed_word,
    HAS_IDS: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Recompute one tile's weights from the lse: ``(p_v, ds)``: the (dropped, rescaled) weights
    that multiply V, and ``dS`` w.r.t. the raw scaled score ``q·k·scale``.

    ``dS = P ∘ (dP − Δ)``, ``dP = dO Vᵀ`` (times ``keep / (1 - p)``), ``Δ = rowsum(dO ∘ O) −
    dlse``; through the soft cap ``d(c·tanh(s/c))/ds = 1 − t²``; ALiBi and the bias add.
    """
    s, t = _scores(q, k, rows, cols, b, h, slope, BIAS, s_bb, s_bh, s_bm, s_bn, Sq, Sk,
                   scale, softcap, ALIBI, HAS_BIAS, SOFTCAP, IEEE, q_offset)  # fmt: skip
    s = s * 1.4426950408889634
    if MASKED:
        ok = _allowed(lo, hi, ids_q, cols, b, IDS, s_ib, Sk, HAS_IDS)
        s = tl.where(ok, s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])  # lse2 = +inf on empty rows: weight 0
    dp = _mma(do, tl.trans(v), IEEE)
    p_v = p
    if DROPOUT:
        keep = _dropout_keep(seed_word, b, h, q_offset + rows, cols, p_drop)
        p_v = tl.where(keep, p / (1.0 - p_drop), 0.0)
        dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return p_v, ds


@triton.jit
def _load_rows(Q, DO, LSE, DELTA, b, h, rows, s_qb, s_qh, s_qm, s_ob, s_oh, s_om, Sq, Hq,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """q, dO, base-2 lse (+inf where a row has no key) and Δ of one query block of head ``h``."""
    row_ok = rows < Sq
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = _load_block(Q + b * s_qb + h * s_qh, rows * s_qm, d, D, row_ok, IEEE)
    do = _load_block(DO + b * s_ob + h * s_oh, rows * s_om, dv, DV, row_ok, IEEE)
    lse = tl.load(LSE + (b * Hq + h) * Sq + rows, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + (b * Hq + h) * Sq + rows, mask=row_ok, other=0.0)
    return q, do, lse2, delta


@triton.jit
def _dkdv_range(
    dk, dv_acc, t0, t1, ORDER_ROW, k, v, cols, b, h, Q, DO, LSE, DELTA, DQ, LO, HI, IDS, BIAS,
    SLOPES, s_qb, s_qh, s_qm, s_ob, s_oh, s_om, s_lb, s_ib, s_bb, s_bh, s_bm, s_bn, Sq, Sk, Hq,
    q_offset, scale, softcap, p_drop, seed_word,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_IDS: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):  # fmt: skip
    """dK, dV of a key block over the query blocks of list entries ``[t0, t1)`` of head ``h``
    (FULL ones, or PARTIAL ones with ``MASKED``)."""
    d = tl.arange(0, BLOCK_D)
    for t in range(t0, t1):
        rows = tl.load(ORDER_ROW + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < Sq
        q, do, lse2, delta = _load_rows(Q, DO, LSE, DELTA, b, h, rows, s_qb, s_qh, s_qm, s_ob,
                                        s_oh, s_om, Sq, Hq, D, DV, BLOCK_D, BLOCK_DV,
                                        IEEE)  # fmt: skip
        hv = h + tl.zeros([BLOCK_M], tl.int32)  # the head of every row
        lo, hi, ids_q, slope = _row_data(LO, HI, IDS, SLOPES, b, hv, rows, row_ok, s_lb, s_ib,
                                         q_offset, BLOCK_M, HAS_IDS, ALIBI)  # fmt: skip
        p_v, ds = _bwd_tile(q, do, lse2, delta, k, v, rows, cols, b, hv, slope, lo, hi, ids_q,
                            MASKED, IDS, s_ib, BIAS, s_bb, s_bh, s_bm, s_bn, Sq, Sk, q_offset,
                            scale, softcap, p_drop, seed_word, HAS_IDS, ALIBI, HAS_BIAS,
                            SOFTCAP, DROPOUT, IEEE)  # fmt: skip
        # -- dV += P_dropᵀ dO, dK += dSᵀ q (· scale at the end)
        dv_acc += _mma(tl.trans(p_v), do, IEEE)
        dk += _mma(tl.trans(ds), q, IEEE)
        if ATOMIC_DQ:
            dq = _mma(ds, k, IEEE)
            tl.atomic_add(DQ + ((b * Hq + h) * Sq + rows[:, None]) * BLOCK_D + d[None, :],
                          dq * scale, mask=row_ok[:, None])  # fmt: skip
    return dk, dv_acc


@triton.jit(do_not_specialize=_FREE)
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV_, SCHED, ORDER, COUNTS, LO, HI, IDS, BIAS, SLOPES,
    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
    s_lb, s_ib, s_bb, s_bh, s_bm, s_bn, s_o,
    Sq, Sk, Hq, G, q_offset, scale, softcap, p_drop, seed_word,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_IDS: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block of one kv head: its ``G`` query heads' blocks in turn (from the
    per-key-block lists), summed in registers. ``ATOMIC_DQ``: also add each tile's dQ share to
    the float32 ``DQ`` with atomics (else the dQ pass computes it)."""
    pid_n = tl.load(SCHED + tl.program_id(0))  # the key blocks with most tiles go first
    pid_bh = tl.program_id(1)
    Hkv = Hq // G
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Sk
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = _load_block(K + b * s_kb + kvh * s_kh, cols * s_kn, d, D, col_ok, IEEE)
    v = _load_block(V + b * s_vb + kvh * s_vh, cols * s_vn, dv, DV, col_ok, IEEE)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    n_full = tl.load(COUNTS + pid_n * 2)
    n_part = tl.load(COUNTS + pid_n * 2 + 1)
    for g in range(0, G):
        h = kvh * G + g
        # -- FULL tiles first (no mask work), then PARTIAL ones
        for MASKED in tl.static_range(2):
            dk, dv_acc = _dkdv_range(
                dk, dv_acc, n_full * MASKED, n_full + n_part * MASKED, ORDER + pid_n * s_o, k,
                v, cols, b, h, Q, DO, LSE, DELTA, DQ, LO, HI, IDS, BIAS, SLOPES, s_qb, s_qh,
                s_qm, s_ob, s_oh, s_om, s_lb, s_ib, s_bb, s_bh, s_bm, s_bn, Sq, Sk, Hq,
                q_offset, scale, softcap, p_drop, seed_word, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                MASKED == 1, HAS_IDS, ALIBI, HAS_BIAS, SOFTCAP, DROPOUT, IEEE, ATOMIC_DQ,
            )  # fmt: skip
    tl.store(DK + b * s_kb + kvh * s_kh + cols[:, None] * s_kn + d[None, :],
             (dk * scale).to(DK.dtype.element_ty),
             mask=col_ok[:, None] & (d[None, :] < D))  # fmt: skip
    tl.store(DV_ + b * s_vb + kvh * s_vh + cols[:, None] * s_vn + dv[None, :],
             dv_acc.to(DV_.dtype.element_ty),
             mask=col_ok[:, None] & (dv[None, :] < DV))  # fmt: skip


@triton.jit
def _dq_range(
    dq, t0, t1, ORDER_ROW, q, do, lse2, delta, rows, lo, hi, ids_q, slope, b, h, K_bh, V_bh,
    s_kn, s_vn, IDS, s_ib, BIAS, s_bb, s_bh, s_bm, s_bn, Sq, Sk, q_offset, scale, softcap,
    p_drop, seed_word,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_IDS: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dQ of a query block over the key blocks of list entries ``[t0, t1)``."""
    for t in range(t0, t1):
        cols, k, v = _kv_tile(ORDER_ROW + t, K_bh, V_bh, s_kn, s_vn, Sk, D, DV, BLOCK_D,
                              BLOCK_DV, BLOCK_N, IEEE)  # fmt: skip
        _, ds = _bwd_tile(q, do, lse2, delta, k, v, rows, cols, b, h, slope, lo, hi, ids_q,
                          MASKED, IDS, s_ib, BIAS, s_bb, s_bh, s_bm, s_bn, Sq, Sk, q_offset,
                          scale, softcap, p_drop, seed_word, HAS_IDS, ALIBI, HAS_BIAS,
                          SOFTCAP, DROPOUT, IEEE)  # fmt: skip
        dq += _mma(ds, k, IEEE)
    return dq


@triton.jit(do_not_specialize=_FREE)
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, SCHED, ORDER, COUNTS, LO, HI, IDS, BIAS, SLOPES,
    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
    s_lb, s_ib, s_bb, s_bh, s_bm, s_bn, s_o,
    Sq, Sk, Hq, G, q_offset, scale, softcap, p_drop, seed_word,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_IDS: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dQ of one query block (the deterministic pass: no atomics), over the forward's lists."""
    pid_m = tl.load(SCHED + tl.program_id(0))
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    kvh = h // G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    d = tl.arange(0, BLOCK_D)
    q, do, lse2, delta = _load_rows(Q, DO, LSE, DELTA, b, h, rows, s_qb, s_qh, s_qm, s_ob,
                                    s_oh, s_om, Sq, Hq, D, DV, BLOCK_D, BLOCK_DV, IEEE)  # fmt: skip
    hv = h + tl.zeros([BLOCK_M], tl.int32)  # the head of every row
    lo, hi, ids_q, slope = _row_data(LO, HI, IDS, SLOPES, b, hv, rows, row_ok, s_lb, s_ib,
                                     q_offset, BLOCK_M, HAS_IDS, ALIBI)  # fmt: skip
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full = tl.load(COUNTS + pid_m * 2)
    n_part = tl.load(COUNTS + pid_m * 2 + 1)
    for MASKED in tl.static_range(2):
        dq = _dq_range(
            dq, n_full * MASKED, n_full + n_part * MASKED, ORDER + pid_m * s_o, q, do, lse2,
            delta, rows, lo, hi, ids_q, slope, b, hv, K + b * s_kb + kvh * s_kh,
            V + b * s_vb + kvh * s_vh, s_kn, s_vn, IDS, s_ib, BIAS, s_bb, s_bh, s_bm, s_bn, Sq,
            Sk, q_offset, scale, softcap, p_drop, seed_word, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
            MASKED == 1, HAS_IDS, ALIBI, HAS_BIAS, SOFTCAP, DROPOUT, IEEE,
        )  # fmt: skip
    tl.store(DQ + b * s_qb + h * s_qh + rows[:, None] * s_qm + d[None, :],
             (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < D))  # fmt: skip


def _common_args(q, k, v, lo, ids, bias, slopes, scale, softcap, dropout_p, seed, q_offset):
    """The arguments every kernel shares, and the feature constexprs."""
    Hq, Sq, D = q.shape[1:]
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if bias is not None:
        sb = [0 if n == 1 else st for n, st in zip(bias.shape, bias.stride())]
    else:
        sb = [0, 0, 0, 0]
    ieee = interpreted() or q.dtype == torch.float32
    args = {
        "s_qb": q.stride(0), "s_qh": q.stride(1), "s_qm": q.stride(2),
        "s_kb": k.stride(0), "s_kh": k.stride(1), "s_kn": k.stride(2),
        "s_vb": v.stride(0), "s_vh": v.stride(1), "s_vn": v.stride(2),
        "s_lb": lo.stride(0) if lo.shape[0] > 1 else 0,
        "s_ib": 0 if ids is None or ids.shape[0] == 1 else ids.stride(0),
        "s_bb": sb[0], "s_bh": sb[1], "s_bm": sb[2], "s_bn": sb[3],
        "Sq": Sq, "Sk": Sk, "Hq": Hq, "G": Hq // Hkv, "q_offset": q_offset,
        "scale": float(scale), "softcap": float(softcap or 1.0), "p_drop": float(dropout_p),
        "seed_word": seed,
    }  # fmt: skip
    constexprs = {
        "D": D, "DV": Dv, "BLOCK_D": pow2(D), "BLOCK_DV": pow2(Dv),
        "HAS_IDS": ids is not None, "ALIBI": slopes is not None, "HAS_BIAS": bias is not None,
        "SOFTCAP": bool(softcap), "DROPOUT": dropout_p > 0, "IEEE": ieee,
    }  # fmt: skip
    return args, constexprs


def _check(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1:
            raise ValueError(f"attention_triton needs {name}'s last dim contiguous")


def attention_triton_fwd(
    q, k, v, kv_order, kv_counts, lo, hi, ids, bias, slopes,
    scale: float, softcap: float, dropout_p: float, seed: int, q_offset: int, block_m: int,
    block_n: int,
):  # fmt: skip
    """``(out (B, Hq, Sq, Dv) in q's dtype, lse (B, Hq, Sq) float32)``.

    ``kv_order, kv_counts``: :func:`tile_lists` of the tile kinds at ``block_m × block_n``;
    ``lo, hi (B' , Sq)`` int32; ``ids (B', S)`` int32 or None; ``bias`` a view broadcast to
    ``(B, Hq, Sq, Sk)`` or None; ``slopes (Hq,)`` or None; ``softcap`` 0 for none; ``seed`` from
    the backend (``dropout_keep``'s state after the seed, as a signed int32).
    """
    _check(q, k, v)
    B, Hq, Sq, _ = q.shape
    Dv = v.shape[3]
    out = torch.empty(B, Hq, Sq, Dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, Sq, device=q.device, dtype=torch.float32)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    args, constexprs = _common_args(q, k, v, lo, ids, bias, slopes, scale, softcap, dropout_p,
                                    seed, q_offset)  # fmt: skip
    args.update(s_ob=out.stride(0), s_oh=out.stride(1), s_om=out.stride(2), s_o=kv_order.stride(0))
    blk = blocks("fwd", max(q.shape[3], Dv))
    tensors = {"Q": q, "K": k, "V": v, "O": out, "LSE": lse, "SCHED": _schedule(kv_counts),
               "ORDER": kv_order,
               "COUNTS": kv_counts, "LO": lo, "HI": hi, "IDS": _or(ids, lo),
               "BIAS": _or(bias, q), "SLOPES": _or(slopes, q)}  # fmt: skip
    pack = gqa_pack(Hq // k.shape[1], block_m)
    grid = (math.ceil(Sq * pack / block_m), B * Hq // pack)
    _launch(_attn_fwd, grid, {**tensors, **args},
            {**constexprs, "BLOCK_M": block_m, "BLOCK_N": block_n, "PACK": pack}, blk)  # fmt: skip
    return out, lse


def _schedule(counts: torch.Tensor) -> torch.Tensor:
    """The order programs take their blocks in: most tiles first (a causal mask's last query
    blocks), so that the long programs do not start last and leave the GPU idle at the end."""
    return torch.argsort(counts.sum(1), descending=True, stable=True).to(torch.int32)


def _or(t, other):
    """A pointer argument for an absent tensor (never read: its feature flag is off)."""
    return other if t is None else t


def attention_triton_bwd(
    dout, dlse, q, k, v, out, lse, kv_order, kv_counts, q_order, q_counts, lo, hi, ids, bias,
    slopes, scale: float, softcap: float, dropout_p: float, seed: int, q_offset: int,
    block_m: int, block_n: int, deterministic: bool,
):  # fmt: skip
    """``(dq, dk, dv)``. ``kv_order, kv_counts`` / ``q_order, q_counts``: :func:`tile_lists` of
    the tile kinds at ``block_m × block_n`` and of their transpose. ``deterministic``: dQ by its
    own pass (no atomics) instead of float32 atomics in the dK/dV pass."""
    _check(q, k, v)
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    dout = dout.contiguous()
    # Δ = rowsum(dO ∘ O) − dlse: the softmax backward's per-row constant (FlashAttention-2)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.contiguous()
    # dQ, dK, dV are written with the strides of q, K and V: all contiguous
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args, constexprs = _common_args(q, k, v, lo, ids, bias, slopes, scale, softcap, dropout_p,
                                    seed, q_offset)  # fmt: skip
    args.update(s_ob=dout.stride(0), s_oh=dout.stride(1), s_om=dout.stride(2))
    blk = blocks("bwd", max(D, Dv))
    common = {"Q": q, "K": k, "V": v, "DO": dout, "LSE": lse.contiguous(), "DELTA": delta,
              "LO": lo, "HI": hi, "IDS": _or(ids, lo), "BIAS": _or(bias, q),
              "SLOPES": _or(slopes, q)}  # fmt: skip
    sizes = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    if deterministic:
        dq = torch.empty_like(q)
        dq_acc = dq
    else:  # float32, padded to BLOCK_D columns for the atomics' addressing
        dq_acc = torch.zeros(B, Hq, Sq, constexprs["BLOCK_D"], device=q.device,
                             dtype=torch.float32)  # fmt: skip
    _launch(_attn_bwd_dkdv, (math.ceil(Sk / block_n), B * Hkv),
            {**common, "DQ": dq_acc, "DK": dk, "DV_": dv, "SCHED": _schedule(q_counts),
             "ORDER": q_order, "COUNTS": q_counts,
             **args, "s_o": q_order.stride(0)},
            {**constexprs, **sizes, "ATOMIC_DQ": not deterministic}, blk)  # fmt: skip
    if deterministic:
        _launch(_attn_bwd_dq, (math.ceil(Sq / block_m), B * Hq),
                {**common, "DQ": dq, "SCHED": _schedule(kv_counts), "ORDER": kv_order,
                 "COUNTS": kv_counts, **args,
                 "s_o": kv_order.stride(0)},
                {**constexprs, **sizes}, blk)  # fmt: skip
    else:
        dq = dq_acc[..., :D].to(q.dtype)
    return dq, dk, dv
