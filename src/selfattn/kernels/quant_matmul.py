"""The C quantised-matmul kernel (``csrc/quant_matmul.c``): ``y = x · Wᵀ (+ bias)`` for a few
input rows (decode) with ``W`` kept as 8- or 4-bit integers and fp16 scales per group, the
activations quantised to int8 per 32-block on the fly.

Why C: a decode step reads every weight once, so its time is the weight bytes read per second.
PyTorch's CPU int4 op (``aten._weight_int4pack_mm_for_cpu``) needs a tile layout of its own and
bf16 inputs; ``aten._weight_int8pack_mm`` takes one scale a row; dequantising to float before a
matmul writes and reads 4-8x the bytes. The kernel multiplies the stored integers by int8
activations (VNNI's ``vpdpbusd``, AVX2's ``vpmaddubsw``) and applies each block's scale once:
how llama.cpp's Q8_0/Q4 paths work. Its design: the header of ``csrc/quant_matmul.c``.

The weight layout (:data:`KINDS`; ``selfattn.nn.quant`` stores these buffers):

- ``"s8"``: ``qs`` int8 ``(N, K)``, ``w = d · q``;
- ``"u4_offset"``: ``qs`` uint8 ``(N, K/2)`` in GGML's Q4 order (32-weight blocks of 16 bytes;
  byte ``j`` holds element ``j`` low, ``j + 16`` high), ``w = d · (q - 8)``;
- ``"u4_min"``: the same nibbles, ``w = d · q + m``;

with ``d`` (and ``m``) int16 ``(N, K / group)``: fp16 bits, one per ``group`` inputs (a
multiple of 32 dividing ``K``). :func:`dequantize` is the layout's reference; :func:`twin` the
kernel's arithmetic in plain PyTorch (tests).

Build: :data:`SPEC` through :mod:`selfattn.kernels.build` (first use; cached). Instruction-set
paths :data:`ISAS`, the best this CPU runs unless ``SELFATTN_QUANT_ISA`` names another it runs.
Threads (``csrc/thread_pool.h``) split the output rows, as many as the weight bytes pay for
(:func:`selfattn.kernels.threads.for_bytes`). No compiler, a failed build or
``SELFATTN_QUANT_KERNEL=0``: :func:`library` returns None (the caller dequantises instead).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct

import torch

from selfattn.kernels import threads
from selfattn.kernels.build import CLibrary, Function, load

__all__ = [
    "BLOCK",
    "ENV_VAR",
    "ISAS",
    "KINDS",
    "SPEC",
    "Step",
    "Weights",
    "dequantize",
    "isa",
    "isa_code",
    "library",
    "matmul",
    "quantize_activations",
    "step_twin",
    "twin",
]  # fmt: skip

BLOCK = 32  # weights an activation block (and the smallest weight group) spans
# Weight kinds -> (codes, zero mode) of the C enums W_* and Z_*.
KINDS = {"s8": (0, 0), "u4_offset": (1, 1), "u4_min": (1, 2)}
# The kernel's instruction-set paths (ISA_* in the C source), lowest first.
ISAS = ("generic", "avx2", "avxvnni", "avx512vnni")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the C source's D_* codes of x, y and bias
_P = ctypes.c_void_p
_I64 = ctypes.c_int64

ENV_VAR = "SELFATTN_QUANT_KERNEL"  # 0 turns the kernel off
SPEC = CLibrary(
    name="quant_matmul",
    sources=("quant_matmul.c",),
    functions=(
        # quant_matmul(weights' args, M, x, y, xdt, isa, n_threads) -> 0, 1 (out of memory)
        # or 2 (bad sizes)
        Function(
            "quant_matmul",
            (ctypes.POINTER(_I64), _I64, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int),
        ),
        # quant_linear_step(weights' args, a Step's options, M, x, y, residual, cos2, sin2,
        # rope rows, xdt, isa, n_threads): quant_matmul's statuses
        Function(
            "quant_linear_step",
            (
                ctypes.POINTER(_I64),
                ctypes.POINTER(_I64),
                _I64,
                _P,
                _P,
                _P,
                _P,
                _P,
                _I64,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
            ),
        ),
        # quant_block_steps(blocks' fields, n blocks, the step's fields, h, xdt, isa): 0, 1 (out
        # of memory), 2 (bad sizes), 3 (the attention kernel failed)
        Function(
            "quant_block_steps",
            (ctypes.POINTER(_I64), _I64, ctypes.POINTER(_I64), _P, ctypes.c_int, ctypes.c_int),
        ),
        # quant_dequantize(weights' args, n0, n1, out, odt, isa, n_threads) -> 0, 1 (out of
        # memory) or 2 (bad sizes or rows)
        Function(
            "quant_dequantize",
            (ctypes.POINTER(_I64), _I64, _I64, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int),
        ),
        Function("qmm_supports", (ctypes.c_int,), ctypes.c_int),
        *threads.POOL_FUNCTIONS,
    ),
    flags=("-O3", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-ffp-contract=fast"),
    targets=(("-march=native",), ()),
    libraries=("m",),
    openmp=True,
)


@functools.cache
def _library_once() -> ctypes.CDLL | None:
    return load(SPEC)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be (or is switched off)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    return _library_once()


@functools.cache
def _openmp(lib: ctypes.CDLL) -> bool:
    return threads.openmp(lib)


def _threads(lib: ctypes.CDLL, n_bytes: int) -> int:
    return threads.for_bytes(n_bytes, openmp_threads=_openmp(lib))


@functools.cache
def _best(lib: ctypes.CDLL) -> int:
    return max(i for i in range(len(ISAS)) if lib.qmm_supports(i))


@functools.cache
def _forced(name: str, lib: ctypes.CDLL) -> int:
    if name not in ISAS:
        raise ValueError(f"SELFATTN_QUANT_ISA={name!r}: expected one of {', '.join(ISAS)}")
    if not lib.qmm_supports(ISAS.index(name)):
        raise ValueError(
            f"SELFATTN_QUANT_ISA={name!r}: this CPU does not run that path; it runs "
            f"{', '.join(n for i, n in enumerate(ISAS) if lib.qmm_supports(i))}"
        )
    return ISAS.index(name)


def isa_code(lib: ctypes.CDLL) -> int:
    """The instruction-set path's code (an index of :data:`ISAS`) a call runs now."""
    name = os.environ.get("SELFATTN_QUANT_ISA")
    return _best(lib) if not name else _forced(name, lib)


def isa() -> str | None:
    """The instruction-set path a call runs now; None without the kernel."""
    lib = library()
    return None if lib is None else ISAS[isa_code(lib)]


def supported_isas() -> tuple[str, ...]:
    """Every path this CPU runs (empty without the kernel)."""
    lib = library()
    return () if lib is None else tuple(n for i, n in enumerate(ISAS) if lib.qmm_supports(i))


class Weights:
    """One weight's kernel arguments (shapes, kind, pointers), built once: a call passes only
    the input's. Holds the tensors it points into; :meth:`holds` tells a caller whether it was
    built for these tensors, or for ``key``'s (a module rebuilds it when ``.to()`` or a load
    replaced its buffers)."""

    __slots__ = ("_args", "_bytes", "_held", "_key", "_shape")

    def __init__(self, qs, d, m, kind: str, group: int, bias=None, *, key=None):
        wt, zp = KINDS[kind]
        N, K = d.shape[0], d.shape[1] * group
        if bias is not None and bias.dtype not in DTYPE_CODES:
            raise TypeError(
                f"bias dtype {bias.dtype}: the kernel takes {', '.join(map(str, DTYPE_CODES))}"
            )
        for t in (qs, d, m, bias):
            if t is not None and not t.is_contiguous():
                raise ValueError("the kernel's weights, scales and bias must be contiguous")
        ptr = [0 if t is None else t.data_ptr() for t in (qs, d, m, bias)]
        bdt = 0 if bias is None else DTYPE_CODES[bias.dtype]
        self._args = (_I64 * 10)(N, K, wt, zp, group // BLOCK, bdt, *ptr)
        self._held = (qs, d, m, bias)
        self._key = self._held if key is None else tuple(key)
        self._bytes = sum(t.numel() * t.element_size() for t in (qs, d, m) if t is not None)
        self._shape = (N, K)

    def __reduce__(self):
        # a copy (deepcopy or pickle of a module holding one) must not keep pointers into the
        # original's tensors: it gets nothing, and its owner builds its own
        return (_nothing, ())

    def holds(self, *tensors) -> bool:
        """Whether these are the tensors (or key) it was built for, each the same object."""
        return len(tensors) == len(self._key) and all(a is b for a, b in zip(tensors, self._key))

    def __call__(self, x: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
        """``x (M, K)`` float32 or bfloat16 on CPU -> ``(M, N)`` in x's dtype."""
        x = x.contiguous()
        M = x.shape[0]
        y = torch.empty(M, self._shape[0], dtype=x.dtype)
        if M == 0:  # no rows (an Engine step that keeps no logits): the kernel refuses M = 0
            return y
        status = lib.quant_matmul(
            self._args, M, x.data_ptr(), y.data_ptr(), DTYPE_CODES[x.dtype], isa_code(lib),
            _threads(lib, self._bytes),
        )  # fmt: skip
        if status:
            _failed("quant_matmul", status, x, self._shape)
        return y

    def dequantize(self, lo: int, hi: int, dtype: torch.dtype, lib: ctypes.CDLL) -> torch.Tensor:
        """Rows ``lo:hi`` of the weight ``(hi - lo, K)`` in ``dtype`` (float32 or bfloat16):
        :func:`dequantize`'s values, bit for bit, computed by the kernel's threads (a matmul
        of many rows multiplies them densely)."""
        N, K = self._shape
        if not 0 <= lo < hi <= N:
            raise ValueError(f"rows {lo}:{hi} of a weight of {N} rows")
        out = torch.empty(hi - lo, K, dtype=dtype)
        status = lib.quant_dequantize(
            self._args, lo, hi, out.data_ptr(), DTYPE_CODES[dtype], isa_code(lib),
            _threads(lib, out.numel() * out.element_size()),
        )  # fmt: skip
        if status:
            _failed("quant_dequantize", status, out, self._shape)
        return out


def _failed(name: str, status: int, x: torch.Tensor, shape: tuple):
    raise (MemoryError if status == 1 else ValueError)(
        f"{name} failed (status {status}) for x {tuple(x.shape)}, weights {shape}"
    )


class Step:
    """A decoder block's linear layer with its neighbours, one kernel call (``csrc``'s
    ``quant_linear_step``), its fixed parts built once:

    - ``norm``: ``(weight or None, eps)``: x goes through RMSNorm first (rounded as
      ``selfattn.nn.norms.rms_norm`` rounds; the weight in x's dtype);
    - ``pair``: another :class:`Weights` of the same K, N and kind: ``SiLU(x · Wᵀ) · (x · pairᵀ)``
      (SwiGLU's gate and up);
    - ``rope``: ``(heads, head_dim, rotary_dim)``: RoPE on the first ``heads`` heads of
      ``head_dim`` outputs, its factors given per call;

    and per call a residual added last. Each part rounds as the same PyTorch op would in x's
    dtype (:func:`step_twin`). :meth:`holds` tells a caller whether it was built for these
    weights and norm weight (it keeps pointers into them)."""

    __slots__ = ("_args", "_bytes", "_held", "_shape", "weights")

    def __init__(self, weights: Weights, *, norm=None, pair: Weights | None = None, rope=None):
        f = [0] * _STEP_ARGS
        weight = None
        if norm is not None:
            weight, eps = norm
            f[0], f[3] = 1, float_bits(eps)
            if weight is not None:
                if weight.dtype not in DTYPE_CODES or not weight.is_contiguous():
                    raise ValueError("the norm's weight must be contiguous float32 or bfloat16")
                f[1], f[2] = weight.data_ptr(), DTYPE_CODES[weight.dtype]
        if pair is not None:
            if pair._shape != weights._shape:
                raise ValueError(f"paired weights {pair._shape} must match {weights._shape}")
            f[4] = ctypes.addressof(pair._args)
        if rope is not None:
            f[5], f[6], f[7] = rope
        self._args = (_I64 * _STEP_ARGS)(*f)
        self.weights = weights
        self._held = (weights, pair, weight)
        self._bytes = weights._bytes + (0 if pair is None else pair._bytes)
        self._shape = weights._shape

    def __reduce__(self):
        return (_nothing, ())

    @property
    def shape(self) -> tuple[int, int]:
        """The weights' ``(N, K)``: outputs and inputs."""
        return self._shape

    def addresses(self) -> tuple[int, int]:
        """The addresses of the weights' and the options' argument arrays (what csrc's
        ``quant_block_steps`` takes per step; valid while this object lives)."""
        return ctypes.addressof(self.weights._args), ctypes.addressof(self._args)

    def threads(self, lib: ctypes.CDLL) -> int:
        """The threads a call uses now."""
        return _threads(lib, self._bytes)

    def holds(self, weights, pair, norm_weight) -> bool:
        """Whether it was built for these objects (each the same object)."""
        return all(a is b for a, b in zip(self._held, (weights, pair, norm_weight)))

    def __call__(self, x, lib, isa: int, residual=None, factors=None) -> torch.Tensor:
        """``x (M, K)`` float32 or bfloat16, contiguous, on CPU -> ``(M, N)`` in x's dtype;
        ``isa``: :func:`isa_code`; ``residual (M, N)`` contiguous in x's dtype or None;
        ``factors``: ``(cos2, sin2)`` float32 ``(rows, rotary_dim)`` contiguous, row ``m % rows``
        for input row m (:meth:`selfattn.positions.RoPE.rotation_factors`), where built with
        ``rope``."""
        M = x.shape[0]
        y = torch.empty(M, self._shape[0], dtype=x.dtype)
        cos2 = sin2 = None
        rows = 0
        if factors is not None:
            cos2, sin2 = factors
            rows = cos2.shape[0]
        status = lib.quant_linear_step(
            self.weights._args, self._args, M, x.data_ptr(), y.data_ptr(),
            None if residual is None else residual.data_ptr(),
            None if cos2 is None else cos2.data_ptr(), None if sin2 is None else sin2.data_ptr(),
            rows, DTYPE_CODES[x.dtype], isa, self.threads(lib),
        )  # fmt: skip
        if status:
            _failed("quant_linear_step", status, x, self._shape)
        return y


_STEP_ARGS = 8  # the fixed options of csrc's quant_linear_step (its F_* enum)


@functools.cache
def float_bits(v: float) -> int:
    """The bits of ``v`` as a float32 (how the kernels' int64 argument arrays carry a float)."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _nothing() -> None:
    return None


def matmul(x, qs, d, m, kind: str, group: int, bias=None) -> torch.Tensor:
    """``x (M, K) · Wᵀ + bias`` in ``x``'s dtype (float32 or bfloat16, CPU) for weights of
    ``kind`` (module docstring; ``m`` None unless ``"u4_min"``); ``bias (N,)`` float32 or
    bfloat16, or None. A layer called often keeps a :class:`Weights` instead."""
    lib = library()
    if lib is None:
        raise RuntimeError(
            "the C quantised-matmul kernel is not available (no C compiler, a failed build, or "
            "SELFATTN_QUANT_KERNEL=0); use selfattn.nn.QuantizedLinear, which falls back"
        )
    return Weights(qs, d, m, kind, group, bias)(x, lib)


# -- plain PyTorch: the layout's reference and the kernel's arithmetic ----------------------------
def codes(qs: torch.Tensor, kind: str) -> torch.Tensor:
    """The integer codes ``(n, K)`` of stored rows ``qs`` (int8 for s8, uint8 0..15 for u4)."""
    if kind == "s8":
        return qs
    n = qs.shape[0]
    blk = qs.view(n, -1, BLOCK // 2)  # (n, K/32, 16): byte j holds elements j and j + 16
    return torch.cat((blk & 15, blk >> 4), -1).view(n, -1)


def pack_codes(q: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`codes`' inverse: codes ``(n, K)`` -> the stored rows."""
    if kind == "s8":
        return q.to(torch.int8).contiguous()
    n = q.shape[0]
    q = q.to(torch.uint8).view(n, -1, 2, BLOCK // 2)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).view(n, -1)


def dequantize(qs, d, m, kind: str, group: int, dtype=torch.float32) -> torch.Tensor:
    """The weights ``(n, K)`` of stored rows, computed in fp32 (``d · q`` of an fp16 scale and a
    small integer is exact there; ``u4_min`` adds ``m`` with one rounding, as ggml does) and
    returned in ``dtype``."""
    q = codes(qs, kind).float()
    n, K = q.shape
    q = q.view(n, K // group, group)
    if kind == "u4_offset":
        q.sub_(8)
    q.mul_(d.view(torch.float16).float().unsqueeze(-1))
    if kind == "u4_min":
        q.add_(m.view(torch.float16).float().unsqueeze(-1))
    return q.view(n, K).to(dtype)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x (M, K)`` rounded as the kernel rounds it: int8 per 32-block with scale
    ``max|x| / 127`` (fp32, round to nearest even), returned dequantised in fp32."""
    M, K = x.shape
    xb = x.float().view(M, K // BLOCK, BLOCK)
    s = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(s == 0, torch.zeros_like(s), 1 / s)
    q = torch.round(xb * inv).clamp(-127, 127)
    return (q * s).view(M, K)


def twin(x, qs, d, m, kind: str, group: int, bias=None, dtype=torch.float64) -> torch.Tensor:
    """The kernel's result computed in ``dtype`` (float64: its exact value): the activations
    rounded by :func:`quantize_activations` times the dequantised weights, plus the bias."""
    w = dequantize(qs, d, m, kind, group).to(dtype)
    xq = quantize_activations(x).to(dtype)
    return torch.nn.functional.linear(xq, w, None if bias is None else bias.to(dtype))


def step_twin(x, weights, *, norm=None, pair=None, rope=None, residual=None, dtype=None):
    """:class:`Step` in plain PyTorch, op by op as the modules run it: ``weights`` and ``pair``
    each ``(qs, d, m, kind, group, bias)``, their products :func:`twin`'s (the activations
    rounded as the kernel rounds them) computed in float64 and rounded to ``dtype`` (default:
    x's); ``norm``, ``rope`` ``(cos2, sin2, heads, head_dim)`` and ``residual`` as the step's."""
    dt = dtype or x.dtype
    x = x.to(dt)
    if norm is not None:  # selfattn.nn.norms.rms_norm's rounding
        w, eps = norm
        x = torch.rms_norm(x, (x.shape[-1],), None, eps)
        x = x if w is None else x * w.to(dt)

    def product(w):
        return twin(x, *w).to(dt)

    y = product(weights)
    if pair is not None:
        y = torch.nn.functional.silu(y) * product(pair)
    if rope is not None:
        cos2, sin2, heads, D = rope
        r = cos2.shape[1]
        M = y.shape[0]
        rows = torch.arange(M) % cos2.shape[0]
        work = torch.float64 if dt == torch.float64 else torch.float32
        c, s = cos2[rows].unsqueeze(1).to(work), sin2[rows].unsqueeze(1).to(work)
        head = y[:, : heads * D].view(M, heads, D)[..., :r].to(work)
        out = head * c + head.roll(r // 2, -1) * s
        y = y.clone()
        y[:, : heads * D].view(M, heads, D)[..., :r] = out.to(dt)
    if residual is not None:
        y = residual.to(dt) + y
    return y
