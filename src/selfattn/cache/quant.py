"""Quantised KV storage: int8 with per-token, per-head scales and fp8 e4m3 with per-head scales.

Pages keep the ``(N, P, Hkv, D)`` layout of the float cache; only their dtype changes, and a
scale tensor travels beside them (K and V each have their own):

=========  ====================  ==========================  =================================
storage    pages dtype           scales                      value read back
=========  ====================  ==========================  =================================
int8       ``torch.int8``        ``(N, P, Hkv)`` bfloat16    ``q[n, p, h, :] * scales[n, p, h]``
fp8        ``float8_e4m3fn``     ``(Hkv,)`` float32          ``q[n, p, h, :] * scales[h]``
=========  ====================  ==========================  =================================

int8's scales are 16-bit because there is one per token and head: with float32 ones a token of a
64-wide head took 64 + 4 bytes (0.531 of bf16's 128), with 16-bit ones 64 + 2 (0.516). bfloat16
rather than float16: the same error once the values are quantised against the stored scale
(below), and float32's exponent range, so no scale overflows (float16 above 65,504, an amax of
8.3e6) or underflows (float16 below 6e-8) and no clamping is needed. Measured against float32
scales, relative RMS error of the attention output (as measured below): real MiniLM K/V mean
0.626 % -> 0.637 %, peak 1.30 % -> 1.44 %; synthetic outlier K/V, 8 seeds, mean 1.62 % -> 1.65 %
(the seeds alone spread 1.0-3.0 %).

Tokens are quantised once, when written (:func:`write_quantized`), and dequantised by
:func:`selfattn.functional.paged_attention` where they are read: the CPU C kernel a few key
rows at a time, the Triton kernel a tile at a time in registers, the PyTorch path one gathered
group of pages at a time. The whole cache is never dequantised.

Error bound (per element, ``amax`` = max |x| over the token's head for int8, over every token of the
head for fp8): int8 rounds to the nearest multiple of its scale, ``amax / 127`` rounded UP to
bfloat16 (so ``amax`` never saturates), so ``|x - x̂| <= amax / 254 · (1 + 2⁻⁷)``; fp8 e4m3 keeps 3
mantissa bits, so ``|x - x̂| <= |x| / 16 + scale / 1024`` (the second term covers subnormals).
Propagated through attention, with ``ε = scale_qk · max_j Σ_d |q_d| |Δk_jd|`` the largest score
error of a row::

    |out_quant - out_exact| <= (exp(2ε) - 1) · max|v| + max|Δv|

(each softmax weight moves by at most a factor ``exp(±2ε)``; the V error adds as a convex
combination). ``tests/test_quant.py`` checks this bound row by row.

Measured on real K/V (``tests/test_quant_real.py``): the queries, keys and values of all 6
layers of all-MiniLM-L6-v2 (12 heads, D=32) for 5 real sentences of 4-41 tokens, pages of 16 in a
permuted table, fp32 queries, against the fp64 oracle on the exact values. Relative RMS error of
the attention output (RMS(out - oracle) / RMS(oracle), per layer and sentence):

=========  ============  ============  ==========================  ==========================
storage    RMS, range    RMS, mean     peak (max|err| / max|out|)  stated bound (asserted)
=========  ============  ============  ==========================  ==========================
bf16       0.15-0.26 %   0.20 %        0.54 %                      (the yardstick)
int8       0.48-0.78 %   0.64 % (3×)   1.4 %                       RMS <= 1.5 %, peak <= 2.5 %
fp8 e4m3   2.4-4.1 %     3.1 % (16×)   6.8 %                       RMS <= 6 %, peak <= 12 %
=========  ============  ============  ==========================  ==========================

and mean RMS int8 <= 6× and fp8 <= 30× a bf16 cache's. The bounds carry about 2× margin; a K
scale off by 10 % gives 3.5-10 % and fails them. On synthetic K/V with outlier channels and
tokens (``tests/test_quant.py::measured_errors``, D=64, 512 keys, 8 seeds) int8 gave 1.0-3.0 %
(3-12× bf16) and fp8 3.1-6.7 % (10-23× bf16); those tests assert int8 <= 16× bf16 and <= 5 %,
fp8 <= 40× and <= 10 %.
"""

from __future__ import annotations

import torch

# the page dtypes stored quantised, and their scales' dtypes
from selfattn.backends.paged.call import QUANT_DTYPES, SCALE_DTYPES

__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "INT8_SCALE_DTYPE",
    "QUANT_DTYPES",
    "dequantize",
    "quantize_fp8",
    "quantize_int8",
    "write_quantized",
]

INT8_MAX = 127.0  # symmetric range: -128 is never produced
INT8_SCALE_DTYPE = SCALE_DTYPES[torch.int8]  # bfloat16: one per token and head (docstring)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _check_float(x, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in QUANT_DTYPES:
        raise TypeError(f"{name} must be a float tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must be (..., Hkv, D), got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or Inf; quantised storage needs finite K/V values")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per (token, head): ``x (..., Hkv, D)`` -> ``(q, scales)``.

    ``q`` is int8 of ``x``'s shape, ``scales (..., Hkv)`` bfloat16 = ``absmax / 127`` over D
    rounded up to bfloat16; ``x / scale`` is rounded to nearest, against the scale as stored.
    An all-zero row gets scale 1.0 (its values are 0 either way), so no division by zero and
    no NaN.
    """
    _check_float(x)
    xf = x.to(torch.float32)
    exact = xf.abs().amax(dim=-1) / INT8_MAX  # (..., Hkv, D) -> (..., Hkv)
    scales = _round_up(torch.where(exact > 0, exact, torch.ones_like(exact)), INT8_SCALE_DTYPE)
    q = torch.round(xf / scales.float().unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive finite float32 ``x`` in 16-bit ``dtype``, rounded up (never below ``x``): the
    next representable value where round-to-nearest went down (one more in the bit pattern,
    which orders positive floats)."""
    y = x.to(dtype)
    up = (y.view(torch.int16) + 1).view(dtype)
    return torch.where(y.float() < x, up, y)


def quantize_fp8(
    x: torch.Tensor, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 with one scale per head: ``x (..., Hkv, D)`` -> ``(q, scales (Hkv,))``.

    Without ``scales``, each head's scale is ``absmax / 448`` over every token of ``x`` (1.0 for
    an all-zero head). With ``scales`` (those of an existing cache, so new tokens share them),
    values beyond ``448 · scale`` saturate to ±448 rather than overflow.
    """
    _check_float(x)
    Hkv = x.shape[-2]
    xf = x.to(torch.float32)
    if scales is None:
        dims = [d for d in range(x.dim()) if d != x.dim() - 2]
        scales = xf.abs().amax(dim=dims) / FP8_MAX if x.numel() else xf.new_ones(Hkv)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # (Hkv,)
    else:
        _check_scales_tensor(scales, (Hkv,), "scales", torch.float32)
    scaled = xf / scales.to(xf.device).view(Hkv, 1)  # (..., Hkv, D)
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def _check_scales_tensor(scales, shape: tuple, name: str, dtype: torch.dtype) -> None:
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} (see selfattn.cache.quant), got {scales.dtype}")
    if tuple(scales.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(scales.shape)}")
    if not bool((torch.isfinite(scales) & (scales > 0)).all()):
        raise ValueError(f"{name} must be finite and > 0, got min {float(scales.min())}")


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Values of ``q (..., Hkv, D)`` in ``dtype``: int8 takes bfloat16 ``scales (..., Hkv)``, fp8
    float32 ``(Hkv,)``.

    Meant for tests and inspection; ``paged_attention`` dequantises as it reads (a few rows, a
    tile or a page group at a time).
    """
    if q.dtype == torch.int8:
        _check_scales_tensor(scales, tuple(q.shape[:-1]), "scales", INT8_SCALE_DTYPE)
        return q.to(dtype) * scales.to(dtype).unsqueeze(-1)
    if q.dtype == torch.float8_e4m3fn:
        _check_scales_tensor(scales, (q.shape[-2],), "scales", torch.float32)
        return q.to(dtype) * scales.to(dtype).view(-1, 1)
    raise TypeError(f"q must be int8 or float8_e4m3fn, got {q.dtype}")


def write_quantized(
    pages: torch.Tensor,
    scales: torch.Tensor,
    page_ids: torch.Tensor,
    offsets: torch.Tensor,
    x: torch.Tensor,
) -> None:
    """Quantise ``x (T, Hkv, D)`` into slots ``pages[page_ids[t], offsets[t]]``, in place.

    ``pages (N, P, Hkv, D)`` int8 with bfloat16 ``scales (N, P, Hkv)`` (the slots' scales are
    written too), or float8_e4m3fn with ``scales (Hkv,)`` (read, not changed: new tokens share the
    cache's per-head scales and saturate beyond them). ``page_ids``/``offsets``: ``(T,)`` ints.
    """
    if not isinstance(pages, torch.Tensor) or pages.dim() != 4:
        raise ValueError("pages must be a 4-D (N, P, Hkv, D) tensor")
    N, P, Hkv, D = pages.shape
    _check_float(x)
    if x.dim() != 3 or tuple(x.shape[1:]) != (Hkv, D):
        raise ValueError(f"x must be (T, {Hkv}, {D}) to fit pages, got {tuple(x.shape)}")
    T = x.shape[0]
    for name, t, hi in (("page_ids", page_ids, N), ("offsets", offsets, P)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor")
        if tuple(t.shape) != (T,):
            raise ValueError(f"{name} must be ({T},) like x's tokens, got {tuple(t.shape)}")
        if T and (int(t.min()) < 0 or int(t.max()) >= hi):
            raise ValueError(f"{name} must lie in 0..{hi - 1}, got {t.tolist()}")
    ids, offs = page_ids.long(), offsets.long()
    if pages.dtype == torch.int8:
        _check_scales_tensor_shape_only(scales, (N, P, Hkv))
        q, s = quantize_int8(x)
        pages[ids, offs] = q
        scales[ids, offs] = s.to(scales.device)
    elif pages.dtype == torch.float8_e4m3fn:
        q, _ = quantize_fp8(x, scales)
        pages[ids, offs] = q
    else:
        raise TypeError(f"pages must be int8 or float8_e4m3fn, got {pages.dtype}")


def _check_scales_tensor_shape_only(scales, shape: tuple) -> None:
    # int8 scales of never-written slots may hold anything (e.g. zeros), so only type/shape.
    if not isinstance(scales, torch.Tensor) or scales.dtype != INT8_SCALE_DTYPE:
        got = getattr(scales, "dtype", scales)
        raise TypeError(f"int8 pages' scales must be a {INT8_SCALE_DTYPE} tensor, got {got}")
    if tuple(scales.shape) != tuple(shape):
        raise ValueError(f"scales must have shape {tuple(shape)}, got {tuple(scales.shape)}")
