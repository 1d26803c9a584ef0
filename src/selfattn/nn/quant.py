"""Linear and embedding layers that keep weights quantised: GGML's Q8_0 / Q4_0 / Q4_1 blocks
(a GGUF file's own bytes) and weight-only int8 / int4 of any checkpoint (:func:`quantize_`).

A GGML weight ``(N, K)`` is stored as ``K / 32`` blocks a row; each block scales 32 small
integers (llama.cpp's ``block_q8_0`` / ``block_q4_0`` / ``block_q4_1``)::

    q8_0  34 bytes: fp16 d, 32 int8 q                       w = d · q
    q4_0  18 bytes: fp16 d, 16 bytes of nibbles             w = d · (q - 8)
    q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles     w = d · q + m

(a Q4 block's byte ``j`` holds element ``j`` in its low nibble and ``j + 16`` in its high one).
The formats of :func:`quantize_` are the same three with one scale per ``group`` inputs
(a multiple of 32 dividing ``in_features``): ``int8`` (as q8_0; ``group`` defaults to
``in_features``: one scale per output channel), ``int4`` (as q4_1: scale and minimum, i.e. a
zero point; ``group`` default 32) and ``int4_sym`` (as q4_0: no zero point). Each rounds to
nearest as ggml's reference quantiser does.

Storage (registered buffers: ``state_dict``, ``.to(device)``, meta-device construction and
``load_state_dict(assign=True)`` work; ``.to(dtype)`` changes only the compute ``dtype`` and a
bias, never the integers): the layout of :mod:`selfattn.kernels.quant_matmul`::

    qs     8-bit formats: int8 (N, K); 4-bit: uint8 (N, K/2), GGML's nibble order per block
    d      int16 (N, K/group)   the fp16 scales' bits (bits, so that .to(dtype) cannot round them)
    m      int16 (N, K/group)   q4_1 / int4 minimums' bits

That is the file's bytes, reordered only by moving the scales out of the blocks (a GGUF load
copies each tensor once). No float copy of a whole weight is kept.

Which path a forward runs (``M`` = rows of the input):

- CPU, fp32 or bf16, ``M <= KERNEL_ROWS``, no autograd: the C kernel
  (:mod:`selfattn.kernels.quant_matmul`), which multiplies the stored integers by int8-quantised
  activations (per 32-block, as llama.cpp's Q8 activations): the error of that rounding is
  about that of a bf16 input. BENCHMARKS.md has the speeds against PyTorch's int4/int8 ops and
  dense matmuls.
- everything else (prefill, batches of more rows, autograd, other devices or dtypes, no C
  compiler): rows are dequantised in fp32 (exact: ``d · q`` of an fp16 scale and a small
  integer is exact in fp32, and q4_1 adds ``m`` with one rounding, as ggml's reference does) a
  chunk of at most ``CHUNK_BYTES`` at a time and multiplied by a matmul. bf16 with ``M <
  FEW_ROWS`` multiplies in fp32 and rounds once; more rows round the chunk to bf16 for the bf16
  matmul. On CPU in fp32 or bf16 the C kernel's dequantiser writes the chunk (the same values,
  about 6x faster than tensor ops: past ``KERNEL_ROWS`` rows the dense matmul then beats the
  integer dot products, whose time grows with every row).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._log import log_once
from selfattn.kernels import quant_matmul as qmm
from selfattn.kernels.determinism import is_deterministic

__all__ = [
    "CHUNK_BYTES",
    "FORMATS",
    "KERNEL_ROWS",
    "QUANTIZE_FORMATS",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "block_bytes",
    "cat_rows",
    "kernel_for",
    "quantize_",
]

FORMATS = ("q8_0", "q4_0", "q4_1")  # GGML's: a GGUF file's blocks, group 32
QUANTIZE_FORMATS = ("int8", "int4", "int4_sym")  # any group (quantize_)
BLOCK = qmm.BLOCK  # weights a GGML block, along the input dim
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
_HEAD = {"q8_0": 2, "q4_0": 2, "q4_1": 4}  # bytes of fp16 scale (and min) before the integers
# Each format's weight kind in the kernel's layout, and the GGML format of the same arithmetic.
_KIND = {"q8_0": "s8", "int8": "s8", "q4_0": "u4_offset", "int4_sym": "u4_offset",
         "q4_1": "u4_min", "int4": "u4_min"}  # fmt: skip
_GGML_OF = {"int8": "q8_0", "int4_sym": "q4_0", "int4": "q4_1"}
CHUNK_BYTES = 4 << 20  # fp32 dequantised weight a forward holds at once
# Row counts of an input (M) where the fastest path changes (module docstring):
KERNEL_ROWS = 16  # up to this many rows the C kernel runs
FEW_ROWS = 16  # bf16 inputs of fewer rows multiply in fp32 on the dequantised path
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_CODE_DTYPES = (torch.int8, torch.uint8)  # from_codes: 8-bit signed, 4-bit unsigned


def _check_fmt(fmt) -> str:
    name = fmt.lower() if isinstance(fmt, str) else fmt
    if name not in _KIND:
        raise ValueError(
            f"unknown quantised format {fmt!r}: the GGML formats are {FORMATS}, those of "
            f"quantize_ {QUANTIZE_FORMATS}"
        )
    return name


def block_bytes(fmt: str) -> int:
    """Bytes of one 32-weight block of GGML format ``fmt`` (llama.cpp's ``sizeof(block_q8_0)``,
    ...)."""
    name = _check_fmt(fmt)
    if name not in _BLOCK_BYTES:
        raise ValueError(f"{fmt!r} is not a GGML block format; those are {FORMATS}")
    return _BLOCK_BYTES[name]


def _check_in_features(in_features: int) -> None:
    if in_features <= 0 or in_features % BLOCK:
        raise ValueError(
            f"in_features ({in_features}) must be a positive multiple of {BLOCK}, the GGML block "
            "size: a weight of another width cannot be kept quantised (dequantise it instead)"
        )


def column_groups(lo: int, hi: int, group: int) -> tuple[int, slice]:
    """``(group, groups)`` of the input columns ``lo:hi`` of a weight with groups of ``group``
    inputs: the part's group and which of the weight's groups it reads. ValueError unless the
    columns start and end on group edges or lie inside one group (on 32-wide block edges)."""
    if lo % BLOCK or hi % BLOCK:
        raise ValueError(
            f"columns {lo}:{hi} must start and end on multiples of {BLOCK} (the stored blocks)"
        )
    if lo // group == (hi - 1) // group:  # inside one group: its scale, a narrower group
        return hi - lo, slice(lo // group, lo // group + 1)
    if lo % group or hi % group:
        raise ValueError(
            f"columns {lo}:{hi} cut a group of {group} inputs; pick edges on multiples of {group}"
        )
    return group, slice(lo // group, hi // group)


def _group_of(fmt: str, cols: int, group) -> int:
    """The checked group of ``fmt`` for a ``cols``-wide weight (defaults: module docstring)."""
    if fmt in FORMATS:
        if group not in (None, BLOCK):
            raise ValueError(f"{fmt} has groups of {BLOCK} by definition, got group={group}")
        return BLOCK
    group = (cols if fmt == "int8" else BLOCK) if group is None else group
    if not isinstance(group, int) or group <= 0 or group % BLOCK or cols % group:
        raise ValueError(
            f"group={group!r}: a group must be a positive multiple of {BLOCK} dividing "
            f"in_features ({cols}), e.g. 32, 64 or 128"
        )
    return group


def _kernel():
    """The C kernel, or None (logged once: the dequantising path runs)."""
    lib = qmm.library()
    if lib is None:
        log_once("quant-kernel", logging.INFO, "quant: the C quantised-matmul kernel is not "
                 "available; quantised layers dequantise in chunks (slower decode)")  # fmt: skip
    return lib


def kernel_for(x: torch.Tensor):
    """The C kernel where it runs for inputs ``x (M, K)`` (CPU, float32 or bfloat16, ``M <=
    KERNEL_ROWS`` or any ``M`` in deterministic mode, no autograd), else None (its absence
    logged once). Deterministic mode takes the kernel at every ``M``: one path, so a row rounds
    alike in any batch (:mod:`selfattn.kernels.determinism`)."""
    if (
        (x.shape[0] <= KERNEL_ROWS or is_deterministic())
        and x.dtype in _KERNEL_DTYPES
        and x.device.type == "cpu"
        and not (x.requires_grad and torch.is_grad_enabled())
    ):
        return _kernel()
    return None


class _Blocks(nn.Module):
    """The storage and dequantisation shared by :class:`QuantizedLinear` and
    :class:`QuantizedEmbedding`: ``rows`` weights of ``cols`` inputs (module docstring)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def _init_blocks(self, rows, cols, fmt, group, dtype, device) -> None:
        self.fmt = fmt = _check_fmt(fmt)
        _check_in_features(cols)
        self.group = _group_of(fmt, cols, group)
        self.kind = _KIND[fmt]
        if rows <= 0:
            raise ValueError(f"a quantised weight needs at least one row, got {rows}")
        self._tied = None  # the module whose buffers this one reads (a tied LM head)
        self._kernel_args = None  # qmm.Weights of the buffers (QuantizedLinear.forward)
        if self.kind == "s8":
            qs = torch.empty(rows, cols, dtype=torch.int8, device=device)
        else:
            qs = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
        self.register_buffer("qs", qs)
        G = cols // self.group
        self.register_buffer("d", torch.empty(rows, G, dtype=torch.int16, device=device))
        if self.kind == "u4_min":
            self.register_buffer("m", torch.empty(rows, G, dtype=torch.int16, device=device))
        # An empty float buffer whose dtype .to()/.half()/.bfloat16() convert: the compute dtype.
        probe = torch.empty(0, dtype=dtype, device=device)
        self.register_buffer("_dtype", probe, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (``.to(dtype)`` changes it; forward computes in its input's)."""
        return self._dtype.dtype

    def _store(self) -> _Blocks:
        return self if self._tied is None else self._tied

    def _mins(self):
        return self._buffers.get("m") if self._tied is None else self._tied._buffers.get("m")

    def stored(self) -> tuple:
        """``(qs, d, m)``: the buffers this module reads (a tied head's are its table's; ``m``
        None without minimums), in :mod:`selfattn.kernels.quant_matmul`'s layout."""
        s = self._store()
        return s.qs, s.d, self._mins()

    def _set_parts(self, q, d_bits, m_bits) -> None:
        """Fill the buffers from integers ``q (N, K)`` (int8 codes, or 0..15) and the fp16 bits
        of the scales (and minimums) ``(N, K/group)``."""
        self.qs = qmm.pack_codes(q, self.kind)
        self.d = d_bits.contiguous()
        if self.kind == "u4_min":
            self.m = m_bits.contiguous()

    @classmethod
    def _parse(cls, fmt, blocks) -> tuple:
        """``(rows, cols, qs, d_bits, m_bits)`` of GGML ``blocks (N, K/32 · bytes)``: the
        integers already in the stored layout (``qs``)."""
        fmt = _check_fmt(fmt)
        size = block_bytes(fmt)
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
            got = (
                (blocks.dtype, tuple(blocks.shape)) if isinstance(blocks, torch.Tensor) else blocks
            )
            raise ValueError(
                f"{fmt} blocks must be a 2-D uint8 tensor (rows, row bytes), got {got}"
            )
        N, width = blocks.shape
        if width == 0 or width % size:
            raise ValueError(
                f"{fmt} rows of {width} bytes are not whole {size}-byte blocks; pass the "
                "tensor's (rows, row bytes) bytes as the GGUF file stores them"
            )
        B = width // size
        blk = blocks.contiguous().view(N, B, size)
        d = blk[..., :2].contiguous().view(torch.int16).view(N, B)  # little-endian fp16 bits
        m = blk[..., 2:4].contiguous().view(torch.int16).view(N, B) if fmt == "q4_1" else None
        qs = blk[..., _HEAD[fmt] :].contiguous().view(N, -1)
        return N, B * BLOCK, qs.view(torch.int8) if fmt == "q8_0" else qs, d, m

    def _set_stored(self, qs, d, m) -> None:
        self.qs, self.d = qs, d
        if self.kind == "u4_min":
            self.m = m

    @staticmethod
    def _quantize(weight: torch.Tensor, fmt: str, group: int) -> tuple:
        """``(q, d_bits, m_bits)`` of ``weight (N, K)`` as ggml's reference quantiser rounds
        (``quantize_row_*_ref``: round to nearest, the scale from the fp32 block before fp16),
        one scale (and minimum) per ``group`` inputs."""
        N, K = weight.shape
        _check_in_features(K)
        kind = _KIND[fmt]
        x = weight.detach().float().reshape(N, K // group, group)

        def inverse(d):
            return torch.where(d == 0, torch.zeros_like(d), 1 / d)

        m = None
        if kind == "s8":
            d = x.abs().amax(-1, keepdim=True) / 127
            v = x * inverse(d)
            a = v.abs()  # roundf: half away from zero, computed as ggml's reference does
            f = a.floor()
            q = (torch.sign(v) * (f + (2 * (a - f)).floor())).to(torch.int8)
        elif kind == "u4_offset":
            big = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # the signed value of max |x|
            d = big / -8
            q = torch.trunc(x * inverse(d) + 8.5).clamp(0, 15)
        else:
            lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            d = (hi - lo) / 15
            q = torch.trunc((x - lo) * inverse(d) + 0.5).clamp(0, 15)
            m = lo.squeeze(-1).half().view(torch.int16)
        return q.reshape(N, K), d.squeeze(-1).half().view(torch.int16), m

    # -- dequantisation --------------------------------------------------------------------------
    def _rows(self, rows) -> torch.Tensor:
        """fp32 ``(n, K)`` dequantised rows ``rows`` (a slice or an index tensor)."""
        s, m = self._store(), self._mins()
        return qmm.dequantize(
            s.qs[rows], s.d[rows], None if m is None else m[rows], s.kind, s.group
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``(N, K)`` in ``dtype`` (computed in fp32: exact there)."""
        return self._rows(slice(None)).to(dtype)

    def to_ggml(self) -> torch.Tensor:
        """The weight as GGML blocks: uint8 ``(N, K/32 · block_bytes(fmt))``, the bytes a GGUF
        file stores (:meth:`QuantizedLinear.from_ggml` of them rebuilds this module); a
        :func:`quantize_` format only with groups of 32 (as its GGML format)."""
        s, mins = self._store(), self._mins()
        if s.group != BLOCK:
            raise ValueError(
                f"{s.fmt} with groups of {s.group} has no GGML format (GGML's have groups of "
                f"{BLOCK})"
            )
        N, K = self.out_rows, s.in_cols
        ints = s.qs.view(torch.uint8).view(N, K // BLOCK, -1)
        heads = [s.d] + ([mins] if s.kind == "u4_min" else [])
        heads = [h.view(torch.uint8).view(N, K // BLOCK, 2) for h in heads]
        return torch.cat([*heads, ints], -1).view(N, -1)


class QuantizedLinear(_Blocks):
    """``y = x · Wᵀ (+ bias)`` with ``W (out_features, in_features)`` kept quantised in format
    ``fmt`` (module docstring). Build it with :meth:`from_ggml` (a GGUF tensor's bytes),
    :meth:`from_codes` (another format's integers, e.g. a transformers checkpoint's) or
    :meth:`from_float`; the constructor makes uninitialised storage (for ``device="meta"``
    and ``load_state_dict(assign=True)``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        *,
        group: int | None = None,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_blocks(out_features, in_features, fmt, group, dtype, device)
        b = torch.empty(out_features, dtype=dtype, device=device) if bias else None
        self.bias = None if b is None else nn.Parameter(b)

    in_cols = property(lambda self: self.in_features)
    out_rows = property(lambda self: self.out_features)

    @classmethod
    def _assemble(cls, fmt, group, parts, *, bias, dtype, stored=False) -> QuantizedLinear:
        """The layer of ``parts``: ``(q, d, m)`` codes, or with ``stored`` the buffers."""
        N, K = parts[1].shape[0], parts[1].shape[1] * group
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} must be ({N},), one per row")
        dtype = dtype or (bias.dtype if bias is not None else torch.float32)
        layer = cls(K, N, fmt, group=group, bias=bias is not None, dtype=dtype, device="meta")
        (layer._set_stored if stored else layer._set_parts)(*parts)
        layer._dtype = torch.empty(0, dtype=dtype, device=parts[0].device)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        return layer

    @classmethod
    def from_ggml(cls, fmt, blocks, *, bias=None, dtype=torch.float32) -> QuantizedLinear:
        """The layer of a GGUF tensor's blocks: uint8 ``(out_features, in_features / 32 ·
        block_bytes(fmt))``, rows as the file stores them; ``bias (out_features,)`` or None."""
        _, _, qs, d, m = cls._parse(fmt, blocks)
        fmt = _check_fmt(fmt)
        return cls._assemble(fmt, BLOCK, (qs, d, m), bias=bias, dtype=dtype, stored=True)

    @classmethod
    def from_float(cls, weight, fmt, *, group=None, bias=None, dtype=None) -> QuantizedLinear:
        """``weight (out_features, in_features)`` quantised as ggml's reference quantiser does
        (``gguf.quants.quantize`` gives the same blocks for the GGML formats), one scale per
        ``group`` inputs (module docstring); ``dtype`` defaults to the weight's."""
        fmt = _check_fmt(fmt)
        if weight.dim() != 2:
            raise ValueError(
                f"weight must be (out_features, in_features), got {tuple(weight.shape)}"
            )
        _check_in_features(weight.shape[1])
        group = _group_of(fmt, weight.shape[1], group)
        parts = cls._quantize(weight, fmt, group)
        return cls._assemble(fmt, group, parts, bias=bias, dtype=dtype or weight.dtype)

    @classmethod
    def from_codes(
        cls, q, d, m=None, *, group: int, bias=None, dtype=torch.float32
    ) -> QuantizedLinear:
        """The layer of integer codes ``q (out_features, in_features)`` and the fp16 bits (int16)
        of their scales ``d`` (and minimums ``m``), ``(out_features, in_features / group)``:
        int8 codes make ``int8`` (``w = d · q``); uint8 codes 0..15 make ``int4`` with ``m``
        (``w = d · q + m``) or ``int4_sym`` without (``w = d · (q - 8)``)."""
        if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype not in _CODE_DTYPES:
            got = (q.dtype, tuple(q.shape)) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"codes must be a 2-D int8 or uint8 tensor, got {got}")
        if q.dtype == torch.int8:
            if m is not None:
                raise ValueError("int8 codes have no minimums (w = d · q): pass m=None")
            fmt = "int8"
        else:
            if q.numel() and int(q.max()) > 15:
                raise ValueError(
                    f"uint8 codes are 4-bit (0..15), got {int(q.max())}; 8-bit codes are int8"
                )
            fmt = "int4" if m is not None else "int4_sym"
        N, K = q.shape
        _check_in_features(K)
        group = _group_of(fmt, K, group)
        for name, t in (("d", d), ("m", m)):
            if t is not None and (t.dtype != torch.int16 or tuple(t.shape) != (N, K // group)):
                raise ValueError(
                    f"{name} must be the fp16 bits as int16 ({N}, {K // group}), one per group "
                    f"of {group} inputs, got {t.dtype} {tuple(t.shape)}"
                )
        return cls._assemble(fmt, group, (q, d, m), bias=bias, dtype=dtype)

    def part(self, rows=None, cols: slice | None = None) -> QuantizedLinear:
        """The layer of the weight's output rows ``rows`` (a slice or an index tensor; None:
        all) and input columns ``cols`` (a slice; None: all), its blocks copied as stored (no
        re-quantising): a tensor-parallel rank's shard. ``cols`` must start and end on group
        edges (or lie inside one group, a multiple of 32 wide). The bias follows the rows; a
        part of the columns has none (its product is a partial sum, the bias belongs to the
        sum)."""
        s, mins, K = self._store(), self._mins(), self.in_features
        lo, hi = 0, K
        if cols is not None:
            lo, hi, step = cols.indices(K)
            if step != 1 or hi <= lo:
                raise ValueError(f"cols must be a non-empty slice with step 1, got {cols}")
        group, groups = column_groups(lo, hi, s.group)
        per = 1 if s.kind == "s8" else 2  # codes per stored byte
        r = slice(None) if rows is None else rows
        qs = s.qs[r][:, lo // per : hi // per].contiguous()
        d = s.d[r][:, groups].contiguous()
        m = None if mins is None else mins[r][:, groups].contiguous()
        bias = None if self.bias is None or cols is not None else self.bias[r]
        return type(self)._assemble(s.fmt, group, (qs, d, m), bias=bias, dtype=self.dtype,
                                    stored=True)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in_features)`` -> ``(..., out_features)`` in ``x``'s dtype."""
        K = self.in_features
        if x.shape[-1] != K:
            raise ValueError(f"input of width {x.shape[-1]} does not match in_features ({K})")
        x2 = x.reshape(-1, K)  # (..., K) -> (M, K)
        if (lib := kernel_for(x2)) is not None:
            y = self._weights()(x2, lib)
            b = self.bias
            if b is not None and b.dtype not in _KERNEL_DTYPES:
                y = y + b.to(y.dtype)
        else:
            y = self._chunked(x2)
        return y.reshape(*x.shape[:-1], self.out_features)

    def fused_step(self, *, norm=None, pair=None, rope=None) -> qmm.Step | None:
        """The layer in a decoder block's decode step with its neighbours fused into one kernel
        call (:class:`selfattn.kernels.quant_matmul.Step`): ``norm``: ``(weight or None, eps)``
        of an RMSNorm before it, ``pair``: another QuantizedLinear of this shape and kind
        (``SiLU(self(x)) · pair(x)``), ``rope``: ``(heads, head_dim, rotary_dim)``. Call it on
        inputs :func:`kernel_for` accepts. None where a layer's bias is not float32 or bfloat16
        or the pair differs in shape or kind."""
        layers = (self,) if pair is None else (self, pair)
        if any(p.bias is not None and p.bias.dtype not in _KERNEL_DTYPES for p in layers):
            return None
        if pair is not None and (pair.kind, pair.in_features, pair.out_features) != (
            self.kind,
            self.in_features,
            self.out_features,
        ):
            return None
        other = None if pair is None else pair._weights()
        return qmm.Step(self._weights(), norm=norm, pair=other, rope=rope)

    def kernel_slots(self) -> list[tuple[dict, str]]:
        """``(dict, key)`` of each of :meth:`kernel_tensors`' tensors, in its order: a caller
        checking them at every call reads them there (``d.get(key)``) without the method."""
        bufs = (self if self._tied is None else self._tied)._buffers
        return [(bufs, "qs"), (bufs, "d"), (bufs, "m"), (self._parameters, "bias"),
                (self._buffers, "_dtype")]  # fmt: skip

    def kernel_tensors(self) -> list:
        """``[qs, d, m, bias, probe]``: the tensors the kernel reads (a tied head's buffers are
        its table's; None where absent) and the compute dtype's probe (``.to(dtype)`` replaces
        it), each the object it is now: a caller holding kernel arguments compares them to tell
        whether they were replaced."""
        return [d.get(k) for d, k in self.kernel_slots()]

    def _weights(self) -> qmm.Weights:
        """The kernel's arguments for the current buffers (rebuilt when they were replaced);
        a bias of another dtype than fp32/bf16 is added by the caller."""
        qs, d, m, b, _ = self.kernel_tensors()
        w = self._kernel_args
        if w is None or not w.holds(qs, d, m, b):
            bias = b.detach() if b is not None and b.dtype in _KERNEL_DTYPES else None
            key = (qs, d, m, b)
            w = self._kernel_args = qmm.Weights(qs, d, m, self.kind, self.group, bias, key=key)
        return w

    def _chunked(self, x: torch.Tensor) -> torch.Tensor:
        """``x (M, K) · Wᵀ`` dequantising at most ``CHUNK_BYTES`` of rows at a time."""
        K, N, bias = self.in_features, self.out_features, self.bias
        step = max(1, CHUNK_BYTES // (4 * K))
        wide = x.dtype == torch.bfloat16 and x.shape[0] < FEW_ROWS  # decode: one fp32 product
        xc = x.float() if wide else x
        rows = self._dequantizer(xc.dtype)
        parts = []
        for lo in range(0, N, step):
            hi = min(N, lo + step)
            b = None if bias is None else bias[lo:hi].to(xc.dtype)
            parts.append(F.linear(xc, rows(lo, hi), b))
        y = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        return y.to(x.dtype)

    def _dequantizer(self, dtype: torch.dtype):
        """``rows(lo, hi)``: the weight's rows ``lo:hi`` in ``dtype``, by the C kernel's
        dequantiser where it runs (CPU weights, float32 or bfloat16: the same values, several
        times faster than the tensor ops), else by :meth:`_rows`."""
        cpu = self._store().qs.device.type == "cpu"
        lib = _kernel() if cpu and dtype in _KERNEL_DTYPES else None
        if lib is None:
            return lambda lo, hi: self._rows(slice(lo, hi)).to(dtype)
        w = self._weights()
        return lambda lo, hi: w.dequantize(lo, hi, dtype, lib)

    def extra_repr(self) -> str:
        group = "" if self.fmt in FORMATS else f", group={self.group}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"
            f"{group}, bias={self.bias is not None}, dtype={self.dtype}"
        )


def cat_rows(layers: list[QuantizedLinear]) -> QuantizedLinear:
    """One layer whose rows are ``layers``' rows in order (fusing q/k/v projections); the
    parts must share ``fmt``, ``group`` and ``in_features``, and have a bias all or none."""
    if not layers:
        raise ValueError("cat_rows needs at least one layer")
    first = layers[0]
    for i, part in enumerate(layers[1:], 1):
        if (part.fmt, part.group, part.in_features) != (first.fmt, first.group, first.in_features):
            raise ValueError(
                f"cat_rows: layer {i} is {part.fmt} (group {part.group}) with in_features="
                f"{part.in_features} but layer 0 is {first.fmt} (group {first.group}) with "
                f"in_features={first.in_features}; fuse only layers of one format and width"
            )
    biased = [p.bias is not None for p in layers]
    if any(biased) and not all(biased):
        raise ValueError(f"cat_rows: some layers have a bias and some not ({biased})")
    stores = [(p._store(), p._mins()) for p in layers]
    qs = torch.cat([s.qs for s, _ in stores])
    d = torch.cat([s.d for s, _ in stores])
    m = torch.cat([m for _, m in stores]) if first.kind == "u4_min" else None
    bias = torch.cat([p.bias.detach() for p in layers]) if all(biased) else None
    return QuantizedLinear._assemble(
        first.fmt, first.group, (qs, d, m), bias=bias, dtype=first.dtype, stored=True
    )


class QuantizedEmbedding(_Blocks):
    """An ``nn.Embedding`` whose ``(num_embeddings, embedding_dim)`` table is kept quantised;
    a lookup dequantises only the rows it reads."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        fmt: str,
        *,
        group: int | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._init_blocks(num_embeddings, embedding_dim, fmt, group, dtype, device)

    in_cols = property(lambda self: self.embedding_dim)
    out_rows = property(lambda self: self.num_embeddings)

    @classmethod
    def from_ggml(cls, fmt, blocks, *, dtype=torch.float32) -> QuantizedEmbedding:
        """The table of a GGUF tensor's blocks: uint8 ``(num_embeddings, embedding_dim / 32 ·
        block_bytes(fmt))``."""
        N, K, qs, d, m = cls._parse(fmt, blocks)
        table = cls(N, K, fmt, dtype=dtype, device="meta")
        table._set_stored(qs, d, m)
        table._dtype = torch.empty(0, dtype=dtype, device=qs.device)
        return table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids (...)`` -> ``(..., embedding_dim)`` in the compute dtype."""
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            bad = flat[(flat < 0) | (flat >= self.num_embeddings)][0].item()
            raise IndexError(f"token id {bad} is out of range for {self.num_embeddings} embeddings")
        rows = self._rows(flat).to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantizedLinear:
        """A tied LM head ``(..., embedding_dim) -> (..., num_embeddings)`` reading this table's
        buffers (no copy; it holds no buffers of its own, so ``.to()`` of a model moves the
        table once and ``state_dict`` names it once, under the embedding)."""
        N, K = self.num_embeddings, self.embedding_dim
        head = QuantizedLinear(K, N, self.fmt, group=self.group, dtype=self.dtype, device="meta")
        for name in ("qs", "d", "m"):
            head._buffers.pop(name, None)
        head._dtype = torch.empty(0, dtype=self.dtype, device=self.qs.device)
        object.__setattr__(head, "_tied", self)  # not a submodule: the model holds the table
        return head

    def extra_repr(self) -> str:
        group = "" if self.fmt in FORMATS else f", group={self.group}"
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}{group}, "
            f"dtype={self.dtype}"
        )


# -- weight-only quantisation of any model ---------------------------------------------------------
def quantize_(model: nn.Module, fmt: str = "int8", *, group: int | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (the decoder blocks' projections and the LM
    head, tied or not) by a :class:`QuantizedLinear` of format ``fmt`` (``"int8"``: one scale
    per output channel unless ``group``; ``"int4"``: groups of ``group`` inputs, default 32,
    with a zero point; ``"int4_sym"``: without; or a GGML format), in place; returns
    ``model``. Embeddings stay as they are (a tied head gets its own quantised copy of the
    table). A linear layer whose ``in_features`` is not a multiple of the group stays dense
    (logged once)."""
    fmt = _check_fmt(fmt)
    skipped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type == "meta":
                continue
            K = child.in_features
            if K % BLOCK or (group is not None and K % group) or (fmt in FORMATS and K % BLOCK):
                skipped.append(name)
                continue
            layer = QuantizedLinear.from_float(
                child.weight, fmt, group=group, bias=child.bias, dtype=child.weight.dtype
            )
            setattr(parent, name, layer.to(child.weight.device))
    if skipped:
        log_once(("quantize-skipped", fmt, group), logging.INFO, "quantize_: %d linear layers "
                 "stay dense (in_features not a multiple of the group), e.g. %s", len(skipped),
                 skipped[0])  # fmt: skip
    return model
