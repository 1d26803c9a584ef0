"""One ``paged_attention`` call, validated and normalised: :class:`PagedCall` and :func:`prepare`.

Every paged backend runs ``run(q, k_pages, v_pages, block_table, seq_lens, call)`` on inputs that
passed :func:`prepare`; see :func:`selfattn.functional.paged_attention` for the arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from selfattn.backends.base import call_fields
from selfattn.call import check_sinks
from selfattn.masks import Mask, as_mask
from selfattn.scores import ScoreMod, as_score_mod

__all__ = [
    "QUANT_DTYPES",
    "PagedCall",
    "check_holes",
    "check_shapes",
    "check_values",
    "layer_call",
    "prepare",
]

# Page dtypes stored quantised, read with scales (selfattn.cache.quant writes them): int8's one
# per token and head in bfloat16, fp8's one per head in float32.
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
SCALE_DTYPES = {torch.int8: torch.bfloat16, torch.float8_e4m3fn: torch.float32}


@dataclass(frozen=True, eq=False)
class PagedCall:
    """Everything about one ``paged_attention`` call except q, the pages, the table and lengths.

    ``k_scales``/``v_scales``: dequantisation scales of int8 (bfloat16) / fp8 (float32) pages,
    None for float pages. ``planned``: what the backend's ``plan`` hook derived from the block
    table, lengths and mask (key intervals, page ranges), computed once per step by a
    :class:`~selfattn.backends.paged.plan.PagedAttentionPlan` for every layer; None: the
    backend derives it in ``run``. ``sinks (Hq,)``: learned attention-sink logits
    (:func:`selfattn.attention`). ``holes (B, Hkv, 2)`` int64: each sequence's and kv head's
    skipped keys ``[holes[b, h, 0], holes[b, h, 1])`` (:func:`~selfattn.paged_attention`).
    """

    mask: Mask | None = None
    score_mod: ScoreMod | None = None
    scale: float = 1.0
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None
    return_lse: bool = False
    sinks: torch.Tensor | None = None
    holes: torch.Tensor | None = None
    planned: object = field(default=None, compare=False)  # a per-step cache
    # (B, Hq, Sq, max_pages * P) float32 -inf: an output the C and Triton kernels fill with each
    # attended key's score (selfattn.cache.paged.scores); other backends leave it
    key_scores: torch.Tensor | None = field(default=None, compare=False)


call_fields(PagedCall)  # at import, not inside a cold torch.compile trace (see base.call_fields)


def prepare(
    q, k_pages, v_pages, block_table, seq_lens, *, mask=None, score_mod=None, scale=None,
    k_scales=None, v_scales=None, return_lse=False, sinks=None, holes=None,
) -> PagedCall:  # fmt: skip
    """Validate the arguments of ``paged_attention`` (TypeError / ValueError naming the
    offending values) and normalise them into a :class:`PagedCall`."""
    check_shapes(q, k_pages, v_pages, block_table, seq_lens)
    check_values(q, k_pages, block_table, seq_lens)
    mask, score_mod = bound_objects(mask, score_mod, q, seq_lens)
    return layer_call(
        q, k_pages, v_pages, mask, score_mod, scale, k_scales, v_scales, return_lse, sinks=sinks,
        holes=holes,
    )  # fmt: skip


def check_holes(holes, q, k_pages) -> torch.Tensor | None:
    """``holes`` as int64 ``(B, Hkv, 2)`` on q's device (None stays None); TypeError /
    ValueError naming the offending shape or dtype."""
    if holes is None:
        return None
    want = (q.shape[0], k_pages.shape[2], 2)
    if not isinstance(holes, torch.Tensor) or holes.is_floating_point() or holes.is_complex():
        got = holes.dtype if isinstance(holes, torch.Tensor) else type(holes).__name__
        raise TypeError(f"holes must be an integer tensor (B, Hkv, 2)={want}, got {got}")
    if tuple(holes.shape) != want or holes.dtype == torch.bool:
        raise ValueError(
            f"holes must be (B, Hkv, 2)={want}: each sequence's and kv head's skipped keys "
            f"[start, end), got {tuple(holes.shape)} {holes.dtype}"
        )
    return holes.to(device=q.device, dtype=torch.int64)


def layer_call(
    q, k_pages, v_pages, mask, score_mod, scale, k_scales, v_scales, return_lse, planned=None,
    sinks=None, holes=None,
) -> PagedCall:  # fmt: skip
    """The :class:`PagedCall` of tensors that passed the shape checks, with ``mask`` and
    ``score_mod`` already normalised and bound (:func:`bound_objects`): the scale and
    dequantisation scales checked (what may differ between the layers of one step)."""
    k_scales = _check_scales("k_scales", k_pages, k_scales)
    v_scales = _check_scales("v_scales", v_pages, v_scales)
    D = q.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number, got {scale!r}")
    return PagedCall(
        mask=mask,
        score_mod=score_mod,
        scale=float(scale),
        k_scales=k_scales,
        v_scales=v_scales,
        return_lse=return_lse,
        sinks=check_sinks(sinks, q),
        holes=check_holes(holes, q, k_pages),
        planned=planned,
    )


def bound_objects(mask, score_mod, q, seq_lens):
    """``(mask, score_mod)`` as objects on absolute positions (None stays None): see
    :func:`_bound`. Once per step: a planned step's layers share them."""
    return (
        None if mask is None else _bound(as_mask(mask), q, seq_lens),
        None if score_mod is None else _bound(as_score_mod(score_mod), q, seq_lens),
    )


def _bound(obj, q, seq_lens):
    """``obj`` (a mask or score mod) on absolute positions: tensors it reads in query-row order
    are bound to each sequence's rows (row ``i`` of sequence ``b`` at ``seq_lens[b] - Sq + i``),
    after a check that they broadcast to ``(B, Hq, Sq, max(seq_lens))``."""
    if not obj.row_ordered:
        return obj
    B, Hq, Sq, _ = q.shape
    Sk = int(seq_lens.max()) if B else 0
    obj.validate(B, Hq, Sq, Sk, Sk - Sq)
    return obj.bind(seq_lens.long() - Sq)


def check_shapes(q, k_pages, v_pages, block_table, seq_lens) -> None:
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
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dtype.itemsize == 1 and t.is_floating_point() and t.dtype not in QUANT_DTYPES:
            raise TypeError(
                f"{name} are {t.dtype}: fp8 pages must be float8_e4m3fn (what "
                "selfattn.cache.quantize_fp8 writes, with float32 scales); requantize them from "
                "the float values, or cast them to q's dtype"
            )
    # Quantised pages (int8 / fp8) are read in q's accumulation dtype; float pages match q.
    if any(p.dtype != q.dtype and p.dtype not in QUANT_DTYPES for p in (k_pages, v_pages)):
        raise TypeError(
            f"q, k_pages and v_pages must share one dtype, got {q.dtype}, {k_pages.dtype} and "
            f"{v_pages.dtype}; cast them with .to(dtype)"
        )
    B, Hq, _, D = q.shape
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


def check_values(q, k_pages, block_table, seq_lens) -> None:
    """The checks that read ``seq_lens`` and ``block_table``: ValueError naming the offending
    entry. Inside a compiled graph, where reading a value would break it, the same conditions
    are asserts the graph checks when it runs (RuntimeError, a generic message): a kernel must
    never read a page id outside the pool."""
    B, Sq = q.shape[0], q.shape[2]
    N, P = k_pages.shape[:2]
    max_pages = block_table.shape[1]
    capacity = max_pages * P
    compiling = torch.compiler.is_compiling()
    if compiling:
        ok = (seq_lens >= Sq) & (seq_lens <= capacity)
        torch._assert_async(ok.all(), "paged_attention: seq_lens[b] must be in [Sq, max_pages × P]")
    else:  # a list of B ints: cheaper than tensor ops for the batch sizes of decode
        for b, n in enumerate(seq_lens.tolist()):
            if n < Sq:
                raise ValueError(
                    f"seq_lens[{b}]={n} is smaller than Sq={Sq}: the {Sq} queries are the last "
                    "tokens of each sequence, so every sequence needs at least Sq cached tokens"
                )
            if n > capacity:
                raise ValueError(
                    f"seq_lens[{b}]={n} exceeds the capacity max_pages × P = {max_pages} × {P} = "
                    f"{capacity} of block_table; allocate more pages"
                )
    # Block ids of the pages each sequence actually uses (the rest may hold anything, e.g. -1).
    used = torch.arange(max_pages, device=block_table.device) * P < seq_lens.view(B, 1)
    bad = used & ((block_table < 0) | (block_table >= N))  # (B, max_pages)
    if compiling:
        torch._assert_async(~bad.any(), "paged_attention: block_table ids in use must be in [0, N)")
    elif bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {j}]={int(block_table[b, j])} is out of range for N={N} pages "
            f"(valid ids are 0..{N - 1}); sequence {b} uses its first "
            f"{math.ceil(int(seq_lens[b]) / P)} pages"
        )


def _check_scales(name: str, pages: torch.Tensor, scales) -> torch.Tensor | None:
    """Validate the scales of one page pool; return them, or None for float pages.

    int8 pages need bfloat16 ``(N, P, Hkv)`` (per token, per head), float8_e4m3fn pages float32
    ``(Hkv,)`` (per head): :data:`SCALE_DTYPES`. Float pages take no scales: a given one would
    silently be ignored.
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
    dtype = SCALE_DTYPES[pages.dtype]
    if scales is None:
        raise ValueError(
            f"{pname} are {pages.dtype} but {name} is None: pass {dtype} {name} of shape "
            f"{want} ({what}), e.g. from selfattn.cache.quant"
        )
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a {dtype} torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != dtype:
        raise TypeError(
            f"{name} of {pages.dtype} pages must be {dtype}, got {scales.dtype}; quantise with "
            "selfattn.cache.quant (int8: bfloat16 scales rounded up, see its docstring)"
        )
    if tuple(scales.shape) != want:
        raise ValueError(
            f"{name} must have shape {want} ({what}) for {pages.dtype} {pname} of shape "
            f"{tuple(pages.shape)}, got {tuple(scales.shape)}"
        )
    if scales.device != pages.device:
        raise ValueError(f"{name} is on {scales.device} but {pname} on {pages.device}")
    return scales
