"""``paged_attention``: attention of new queries over a paged KV cache, reading pages in place.

The cache stores keys and values in fixed-size pages ``k_pages (N, P, Hkv, D)`` /
``v_pages (N, P, Hkv, Dv)``; sequence ``b`` owns the pages listed in row ``b`` of
``block_table (B, max_pages)``, in order, and its first ``seq_lens[b]`` token slots are valid::

    block_table[b] = [7, 2, 5, ...]      P = 4, seq_lens[b] = 10
    token position   0 1 2 3 | 4 5 6 7 | 8 9 · ·
    page             7       | 2       | 5        (· = unused slot: never read into the result)

The ``Sq`` queries of sequence ``b`` are its LAST ``Sq`` tokens (bottom-right alignment): query
row ``i`` sits at absolute position ``seq_lens[b] - Sq + i``. Masks and score mods see these
absolute positions, per sequence, so ``masks.causal()`` gives chunked prefill and ``Sq = 1``
needs no mask at all (``mask=None`` means "every valid key", nothing more).

Two implementations, one result (both FlashAttention's online softmax, merged in float32):

- The C kernel (:mod:`selfattn.cache._decode_kernels`) reads every page in place, once: per
  ``(sequence, key split)`` it walks the sequence's pages in table order, scoring, softmax-
  updating and V-summing each page before the next. It runs where :func:`_kernel_bounds` says:
  CPU; fp32/bf16/fp16 queries over pages of the same dtype or int8/fp8; ``Sq <= KERNEL_MAX_SQ``
  (decode, speculative decode); no ``score_mod``; ``mask`` None or one key interval per query
  row (``causal``, ``sliding_window``, ``chunked`` and their ``&``); no autograd; and a C
  compiler to build it with (1-4 s, once per machine; ``SELFATTN_DECODE_KERNEL=0``
  turns it off). Decode is memory-bound, and every plain-PyTorch formulation over a permuted
  page pool either copies the pages first (below) or pays a tiny per-page matmul call.
- On CUDA the same calls (any ``Sq``) go to a Triton kernel,
  :mod:`selfattn.backends.triton.paged`: key splits over the pages (flash-decoding), the query
  heads of a kv head in one tile, int8/fp8 dequantised in registers, an fp32 lse merge.
- The PyTorch path (everything else: gradients, score mods, arbitrary masks, fp64, long query
  chunks where batched GEMMs win) walks the key axis a bounded group of logical pages at a
  time, for the whole batch at once: one ``index_select`` over the page dimension gathers
  ``(B, group, P, Hkv, D)``, never a dense copy of the whole cache, and each group's partial
  softmax is merged into a running float32 (float64 for fp64 inputs) max / sum / output.

Either way a group or page where a row has no allowed key (a sliding window that excludes whole
pages, a short sequence in a ragged batch) contributes nothing and never produces NaN. NaN/inf
in V at a key a row does not attend never reaches that row, on every path: the C kernel never
reads it for that row; the PyTorch path and the Triton kernel sum ``P·V`` as usual and, only
where that came out non-finite (``0·NaN = NaN``), sum again over each row's attended keys
(:func:`_weighted_sum_attended`), so finite caches pay one finiteness check of the sums.
"""

from __future__ import annotations

import math
import os

import torch

from selfattn.backends import triton as _triton
from selfattn.backends._common import accumulation_dtype
from selfattn.cache import _decode_kernels
from selfattn.cache.quant import QUANT_DTYPES
from selfattn.masks import (
    And,
    CallableMask,
    Causal,
    Chunked,
    Mask,
    Not,
    SlidingWindow,
    TensorMask,
    TileGrid,
    as_mask,
)
from selfattn.scores import as_score_mod

__all__ = ["GATHER_ELEMENTS", "GROUP_KEYS", "KERNEL_MAX_SQ", "paged_attention"]

# Keys (logical pages × P) gathered per step, at most: bounds the score buffer per query row.
GROUP_KEYS = 1024
# Elements of K gathered per step across the batch (B · keys · Hkv · D): a large batch takes
# fewer keys per step so that the gathered copy stays ~8 MiB in fp32, never the whole cache
# (measured best on a 2-core EPYC for B=32 decode: 4 and 16 MiB were slower).
GATHER_ELEMENTS = 1 << 21
# Longest query chunk the C kernel takes. Measured (B=8, 2,048 keys, Hq=32, D=128, causal, one
# thread, CPU time): the kernel costs 0.34x the PyTorch path at Sq=4, 0.56x at 16 and breaks even
# at 64, where the batched GEMMs of the PyTorch path catch up with its per-row loops.
KERNEL_MAX_SQ = 16


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
    finite part is one matmul; four indicator matmuls count where the non-finite values land.
    Callers take this path only when the plain ``p @ v`` came out non-finite.
    """
    finite = torch.isfinite(v)
    out = p @ v.masked_fill(~finite, 0.0)
    dt = p.dtype

    def hits(w: torch.Tensor, where: torch.Tensor) -> torch.Tensor:  # any weighted key lands
        return (w.to(dt) @ where.to(dt)) > 0

    positive = p > 0  # implies attended: a key no row may attend has score -inf, weight 0
    pos_inf, neg_inf = hits(positive, v == math.inf), hits(positive, v == -math.inf)
    nan = hits(attended, v.isnan()) | hits(attended & (p == 0), v.isinf()) | (pos_inf & neg_inf)
    out = out.masked_fill(pos_inf, math.inf).masked_fill(neg_inf, -math.inf)
    return out.masked_fill(nan, math.nan)


def _check(q, k_pages, v_pages, block_table, seq_lens) -> None:
    """Raise TypeError / ValueError naming the offending values (see :func:`paged_attention`)."""
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "(B, Hq, Sq, D)" if name == "q" else "(N, P, Hkv, D)"
            raise ValueError(f"{name} must be 4-D {want}, got shape {tuple(t.shape)}")
        if not (t.is_floating_point() or (name != "q" and t.dtype in QUANT_DTYPES)):
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if q.dtype in QUANT_DTYPES:
        raise TypeError(f"q must be fp16/bf16/fp32/fp64, got {q.dtype}")
    # Quantised pages (int8 / fp8) are read in q's accumulation dtype; float pages match q.
    if any(p.dtype != q.dtype and p.dtype not in QUANT_DTYPES for p in (k_pages, v_pages)):
        raise TypeError(
            f"q, k_pages and v_pages must share one dtype, got {q.dtype}, {k_pages.dtype} and "
            f"{v_pages.dtype}; cast them with .to(dtype)"
        )
    B, Hq, Sq, D = q.shape
    N, P, Hkv, Dk = k_pages.shape
    if Dk != D:
        raise ValueError(
            f"q has head dim D={D} but k_pages has D={Dk} (shape {tuple(k_pages.shape)})"
        )
    if tuple(v_pages.shape[:3]) != (N, P, Hkv):
        raise ValueError(
            f"v_pages {tuple(v_pages.shape)} must match k_pages {tuple(k_pages.shape)} in "
            "(N, P, Hkv)"
        )
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hkv={Hkv} must divide Hq={Hq} (GQA groups of G = Hq // Hkv heads)")
    for name, t, dims in (("block_table", block_table, 2), ("seq_lens", seq_lens, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an integer torch.Tensor, got {type(t).__name__}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (int32), got {t.dtype}")
        if t.dim() != dims or t.shape[0] != B:
            want = "(B, max_pages)" if dims == 2 else "(B,)"
            raise ValueError(f"{name} must be {want} with B={B}, got shape {tuple(t.shape)}")
    devices = {t.device for t in (q, k_pages, v_pages, block_table, seq_lens)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    max_pages = block_table.shape[1]
    lens = seq_lens.tolist()
    capacity = max_pages * P
    for b, n in enumerate(lens):
        if n < Sq:
            raise ValueError(
                f"seq_lens[{b}]={n} is smaller than Sq={Sq}: the {Sq} queries are the last tokens "
                "of each sequence, so every sequence needs at least Sq cached tokens"
            )
        if n > capacity:
            raise ValueError(
                f"seq_lens[{b}]={n} exceeds the capacity max_pages × P = {max_pages} × {P} = "
                f"{capacity} of block_table; allocate more pages"
            )
    # Block ids of the pages each sequence actually uses (the rest may hold anything, e.g. -1).
    if B and max_pages:
        used = torch.arange(max_pages, device=block_table.device) * P < seq_lens.view(B, 1)
        bad = used & ((block_table < 0) | (block_table >= N))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"block_table[{b}, {j}]={int(block_table[b, j])} is out of range for N={N} pages "
                f"(valid ids are 0..{N - 1}); sequence {b} uses its first "
                f"{math.ceil(lens[b] / P)} pages"
            )


def _check_scales(name: str, pages: torch.Tensor, scales) -> torch.Tensor | None:
    """Validate the scales of one page pool; return them as float32 or None for float pages.

    int8 pages need ``(N, P, Hkv)`` (per token, per head), float8_e4m3fn pages ``(Hkv,)`` (per
    head); both float32. Float pages take no scales: a given one would silently be ignored.
    """
    pname = name.replace("scales", "pages")
    if pages.dtype not in QUANT_DTYPES:
        if scales is not None:
            raise ValueError(
                f"{name} given but {pname} are {pages.dtype}: scales apply only to int8 or "
                "float8_e4m3fn pages; pass quantised pages or drop the scales"
            )
        return None
    N, P, Hkv = pages.shape[:3]
    want = (N, P, Hkv) if pages.dtype == torch.int8 else (Hkv,)
    what = "per token, per head" if pages.dtype == torch.int8 else "per head"
    if scales is None:
        raise ValueError(
            f"{pname} are {pages.dtype} but {name} is None: pass float32 {name} of shape "
            f"{want} ({what}), e.g. from selfattn.cache.quant"
        )
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a float32 torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scales.dtype}; use .float()")
    if tuple(scales.shape) != want:
        raise ValueError(
            f"{name} must have shape {want} ({what}) for {pages.dtype} {pname} of shape "
            f"{tuple(pages.shape)}, got {tuple(scales.shape)}"
        )
    if scales.device != pages.device:
        raise ValueError(f"{name} is on {scales.device} but {pname} on {pages.device}")
    return scales


def _group_scales(scales, ids, B: int, L: int, Hkv: int, cd) -> torch.Tensor:
    """Scales broadcastable to a gathered ``(B, L, Hkv, ·)`` group, in dtype ``cd``."""
    if scales.dim() == 1:  # fp8: per head
        return scales.to(cd).view(1, 1, Hkv, 1)
    # int8: per token, per head, gathered like the pages: (B·g, P, Hkv) -> (B, L, Hkv, 1)
    return scales.index_select(0, ids).to(cd).view(B, L, Hkv, 1)


def _analytic(mask) -> bool:
    """True when ``mask.tile_kinds`` is O(tiles) (built-ins and their combinations)."""
    if isinstance(mask, (And, Not)):  # Or subclasses And
        return all(_analytic(c) for c in ((mask.a, mask.b) if isinstance(mask, And) else (mask.a,)))
    if isinstance(mask, (CallableMask, TensorMask)):
        return False
    return type(mask).tile_kinds is not Mask.tile_kinds


def _page_ranges(mask, lens: list[int], Sq: int, P: int, Hq: int):
    """Per sequence, the logical pages ``[first, last)`` that hold an allowed key.

    Every used page without a mask; with a mask whose tiles classify analytically, the tile
    classification at page granularity (one ``(Sq × P)`` tile per page) trims pages that are
    EMPTY for every head, so a sliding window reads only the pages of its window.
    """
    first, last = [], []
    for b, n in enumerate(lens):
        used = math.ceil(n / P)
        if mask is None or Sq == 0 or used == 0 or not _analytic(mask):
            first.append(0)
            last.append(used)
            continue
        grid = TileGrid(Sq, n, Sq, P, q_offset=n - Sq)
        kinds = torch.as_tensor(mask.tile_kinds(grid, len(lens), Hq))
        while kinds.dim() < 4:
            kinds = kinds.unsqueeze(0)
        row = kinds[b if kinds.shape[0] > 1 else 0].amax(dim=(0, 1)).cpu()  # (used,)
        hit = (row > 0).nonzero().flatten().tolist()
        first.append(hit[0] if hit else 0)
        last.append(hit[-1] + 1 if hit else 0)
    return first, last


def _key_intervals(mask, lens: torch.Tensor, Sq: int):
    """Per query row, the allowed keys as one interval ``[lo, hi)``, or None if the mask is not one.

    ``lo, hi (B, Sq)`` int64 within ``[0, seq_lens[b]]`` (``hi <= lo``: no allowed key). Exact
    for no mask, ``causal``, ``sliding_window``, ``chunked`` and their ``&`` (an intersection of
    intervals is an interval); any other mask is evaluated elementwise on the PyTorch path.
    """
    pos = lens.view(-1, 1) - Sq + torch.arange(Sq, device=lens.device)  # (B, Sq) absolute
    lo, hi = torch.zeros_like(pos), lens.view(-1, 1).expand_as(pos).clone()
    for m in _interval_terms(mask):
        if m is None:
            return None
        if type(m) is Causal:
            m_lo, m_hi = torch.zeros_like(pos), pos + 1
        elif type(m) is SlidingWindow:
            m_lo, m_hi = pos - m.size + 1, pos + 1
        else:  # Chunked: the query's own chunk, up to itself when causal
            m_lo = torch.div(pos, m.size, rounding_mode="floor") * m.size
            m_hi = pos + 1 if m.causal else m_lo + m.size
        lo, hi = torch.maximum(lo, m_lo), torch.minimum(hi, m_hi)
    return lo.clamp(min=0), torch.maximum(hi, lo.clamp(min=0))


def _interval_terms(mask) -> list:
    """The factors of ``mask`` as a list of interval masks, with None for any other factor."""
    if mask is None:
        return []
    if type(mask) is And:  # not Or, which subclasses And
        return _interval_terms(mask.a) + _interval_terms(mask.b)
    return [mask if type(mask) in (Causal, SlidingWindow, Chunked) else None]


def _kernel_bounds(q, k_pages, v_pages, seq_lens, mask, score_mod):
    """``(kernel, lo, hi)`` when a kernel that reads pages in place runs this call, else None
    (the PyTorch path); ``lo, hi`` are the key intervals of :func:`_key_intervals`.

    Both kernels take: fp32/bf16/fp16 queries; pages whose last dim is contiguous; no
    ``score_mod``; a mask that is one key interval per row; nothing that autograd must
    differentiate (no backward); no empty dimension. Then by device:

    - ``"triton"`` (:mod:`selfattn.backends.triton.paged`): CUDA tensors, any ``Sq``, pages in
      the query dtype or int8/fp8, Triton installed. ``SELFATTN_PAGED_TRITON=1`` also sends CPU
      tensors to it, which only works under ``TRITON_INTERPRET=1``: how the tests check it.
    - ``"c"`` (:mod:`selfattn.cache._decode_kernels`): CPU tensors, ``Sq <= KERNEL_MAX_SQ``
      (decode, speculative decode; longer query chunks are matmul work, where the PyTorch path's
      batched GEMMs catch up), pages the built kernel reads (:func:`_decode_kernels.supports`).
    """
    B, _, Sq, D = q.shape
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or score_mod is not None:
        return None
    if 0 in (B, Sq, D, v_pages.shape[3]) or k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pages, v_pages)):
        return None
    if q.device.type == "cuda" or os.environ.get("SELFATTN_PAGED_TRITON") == "1":
        if k_pages.dtype not in (q.dtype, *QUANT_DTYPES) or v_pages.dtype != k_pages.dtype:
            return None
        if not _triton.available():
            return None
        kernel = "triton"
    elif q.device.type == "cpu":
        if Sq > KERNEL_MAX_SQ or not all(
            _decode_kernels.supports(p.dtype) for p in (k_pages, v_pages)
        ):
            return None
        kernel = "c"
    else:
        return None
    bounds = _key_intervals(mask, seq_lens.to(torch.long), Sq)
    return None if bounds is None else (kernel, *bounds)


def _kernel_attention(
    kernel, q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, return_lse
):
    """The kernel's result in ``q.dtype`` (float32 lse), as the PyTorch path returns it."""
    if kernel == "triton":
        from selfattn.backends.triton.paged import paged_attention_triton

        out, lse = paged_attention_triton(
            q.contiguous(), k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales
        )
    else:
        table = block_table.to(torch.int32).contiguous()
        k_scales, v_scales = (None if s is None else s.contiguous() for s in (k_scales, v_scales))
        out, lse = _decode_kernels.decode(
            q.contiguous(), k_pages, v_pages, table, lo.contiguous(), hi.contiguous(), scale,
            k_scales, v_scales,
        )  # fmt: skip
        out = out.to(q.dtype)  # (B, Hq, Sq, Dv)
    return (out, lse) if return_lse else out


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mask=None,
    score_mod=None,
    scale: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Attention of ``q (B, Hq, Sq, D)`` over a paged cache, returning ``out (B, Hq, Sq, Dv)``.

    ``k_pages (N, P, Hkv, D)``, ``v_pages (N, P, Hkv, Dv)``: the page pool. ``block_table
    (B, max_pages)`` (int32): the pages of each sequence in order; entries past a sequence's
    ``ceil(seq_lens[b] / P)`` used pages are never read (they may be -1). ``seq_lens (B,)``:
    valid tokens per sequence, including the ``Sq`` new ones, which must already be written to
    the pages. Query row ``i`` of sequence ``b`` sits at position ``seq_lens[b] - Sq + i``; for
    ``Sq = 2``, ``seq_lens[b] = 5`` with ``mask=masks.causal()``::

        key position    0 1 2 3 4
        query at 3      █ █ █ █ ·
        query at 4      █ █ █ █ █

    ``mask`` (a :class:`selfattn.masks.Mask` or a ``mask_mod`` callable) and ``score_mod`` (a
    :class:`selfattn.scores.ScoreMod` or callable) are evaluated at these absolute positions
    with ``b`` the batch index. Masks given as tensors in row order are not meaningful here
    (sequences have different offsets). ``mask=None`` attends every valid key. GQA/MQA: query
    head ``h`` reads kv head ``h // (Hq // Hkv)``; K/V are never repeated.

    Returns ``out`` in ``q.dtype``, or ``(out, lse)`` with ``lse (B, Hq, Sq)`` float32 (float64
    for fp64 inputs), ``-inf`` for a row with no allowed key (whose output is exactly 0; also
    when a score mod sets all its scores to ``-inf``). NaN/Inf in unused page slots or pages
    cannot reach the output, nor can NaN/Inf at a key a row does not attend (masked, or scored
    ``-inf`` by the score mod): it reaches only the rows that attend it.

    Quantised pages (:mod:`selfattn.cache.quant`): ``k_pages``/``v_pages`` int8 with float32
    ``k_scales``/``v_scales (N, P, Hkv)``, or float8_e4m3fn with ``(Hkv,)``; the C kernel
    dequantises a key row at a time, the PyTorch path each gathered group (times its scales, in
    the accumulation dtype), never the whole cache. Scales are required for quantised pages and
    rejected for float pages.

    Which implementation runs (the C kernel for decode-like calls, else PyTorch) is described in
    the module docstring; both give the same result within float32 rounding.
    """
    _check(q, k_pages, v_pages, block_table, seq_lens)
    k_scales = _check_scales("k_scales", k_pages, k_scales)
    v_scales = _check_scales("v_scales", v_pages, v_scales)
    B, Hq, Sq, D = q.shape
    N, P, Hkv, _ = k_pages.shape
    Dv = v_pages.shape[3]
    G = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number, got {scale!r}")
    mask_obj = None if mask is None else as_mask(mask)
    mod_obj = None if score_mod is None else as_score_mod(score_mod)
    bounds = _kernel_bounds(q, k_pages, v_pages, seq_lens, mask_obj, mod_obj)
    if bounds is not None:  # a kernel reads the pages in place (C on CPU, Triton on CUDA)
        kernel, lo, hi = bounds
        return _kernel_attention(
            kernel, q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, return_lse
        )
    cd = accumulation_dtype(q.dtype)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    device = q.device

    first, last = _page_ranges(mask_obj, seq_lens.tolist(), Sq, P, Hq)
    span = max((b - a for a, b in zip(first, last)), default=0)  # logical pages to walk
    keys = min(GROUP_KEYS, GATHER_ELEMENTS // max(B * Hkv * max(D, Dv), 1))
    group = max(1, keys // max(P, 1))  # logical pages per step

    lens = seq_lens.to(device=device, dtype=torch.long)
    b_idx = torch.arange(B, device=device).view(B, 1, 1, 1)
    h_idx = torch.arange(Hq, device=device).view(1, Hq, 1, 1)
    q_pos = (lens.view(B, 1) - Sq + torch.arange(Sq, device=device)).view(B, 1, Sq, 1)
    # State in (Hkv, B, ·) order: one kv head's slice is a contiguous (B, ·, ·) batch. Gathered
    # pages stay (B, L, Hkv, ·); a kv head of them is a strided (B, L, D) view that bmm reads
    # without a copy (row stride Hkv·D), so one bmm per kv head replaces a transposing copy.
    qg = (q.to(cd) * scale).reshape(B, Hkv, G * Sq, D)  # (B, Hq, Sq, D) -> (B, Hkv, G·Sq, D)
    qg = qg.transpose(0, 1).contiguous()  # (Hkv, B, G·Sq, D)
    min_len = int(seq_lens.min()) if B else 0

    table = block_table.to(device=device, dtype=torch.long)
    first_t = torch.tensor(first, dtype=torch.long, device=device).view(B, 1)
    # Keys past a sequence's last page with an allowed key count as invalid (as past its end).
    ends = torch.minimum(lens, torch.tensor(last, dtype=torch.long, device=device) * P)
    max_pages = table.shape[1]
    # Every step gathers (and converts low-precision or quantised pages) into the same buffers:
    # a fresh multi-MiB tensor per step costs more in page faults than the gather itself (the
    # allocator hands big blocks back to the OS), 2-3x the whole call on a 2-core EPYC. Only
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
            # (B, G·Sq, D) @ (B, D, L) per kv head, stacked: (Hkv, B, G·Sq, L)
            s = torch.stack([torch.bmm(qg[h], k[:, :, h].transpose(1, 2)) for h in range(Hkv)])
            if mod_obj is not None:
                s4 = s.transpose(0, 1).reshape(B, Hq, Sq, L)  # per query head, as mods expect
                s4 = mod_obj.score_mod(s4, b_idx, h_idx, q_pos, kv_pos, q_offset=0)
                s4 = torch.broadcast_to(s4, (B, Hq, Sq, L)).to(cd)
                s = s4.reshape(B, Hkv, G * Sq, L).transpose(0, 1)  # (Hkv, B, G·Sq, L)
            allowed = None  # None: every key of the group is valid and allowed (no work at all)
            if mask_obj is not None:
                mm = torch.as_tensor(mask_obj.mask_mod(b_idx, h_idx, q_pos, kv_pos, q_offset=0))
                if mm.dtype != torch.bool:
                    raise TypeError(f"mask_mod must return a bool tensor, got {mm.dtype}")
                mm = (mm.to(device) & (kv_pos < ends.view(B, 1, 1, 1))).expand(B, Hq, Sq, L)
                allowed = mm.reshape(B, Hkv, G * Sq, L).transpose(0, 1)  # (Hkv, B, G·Sq, L)
            elif j1 * P > min_len:  # some sequence ends inside this group (first = 0 here)
                allowed = kv_pos.view(1, B, 1, L) < ends.view(1, B, 1, 1)
                allowed = allowed.expand(Hkv, B, G * Sq, L)
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
    if not return_lse:
        return out
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(l_sum))
    return out, lse.reshape(B, Hq, Sq).to(lse_dtype)
