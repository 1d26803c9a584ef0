"""Linear and embedding layers that keep GGML block-quantised weights quantised.

A GGML weight ``(N, K)`` is stored as ``K / 32`` blocks a row; each block scales 32 small
integers (llama.cpp's ``block_q8_0`` / ``block_q4_0`` / ``block_q4_1``)::

    q8_0  34 bytes: fp16 d, 32 int8 q                       w = d · q
    q4_0  18 bytes: fp16 d, 16 bytes of nibbles             w = d · (q - 8)
    q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles     w = d · q + m

(a Q4 block's byte ``j`` holds element ``j`` in its low nibble and ``j + 16`` in its high one).

Storage (registered buffers: ``state_dict``, ``.to(device)``, meta-device construction and
``load_state_dict(assign=True)`` work; ``.to(dtype)`` changes only the compute ``dtype`` and a
bias, never the blocks)::

    d      int16 (N, K/32)   the fp16 scales' bits (bits, so that .to(dtype) cannot round them)
    m      int16 (N, K/32)   q4_1's fp16 minimums' bits
    qs     q8_0: int8 (N, K)
           q4_*: uint8 (N64, K/2), N64 = N rounded up to 64: torch's CPU int4 layout, tiles of
                 64 rows viewed as (N64/64, K, 32): byte [t, k, j] holds row 64t + j, column k
                 in its low nibble and row 64t + 32 + j in its high one

That is the file's bytes (plus at most 63 rows of padding). No float copy of a whole weight is
kept: a forward dequantises at most ``CHUNK_BYTES`` of fp32 weight rows at a time.

Which path a forward runs (the fastest that is exact enough; ``M`` = rows of the input):

- bf16, Q4_0 / Q4_1, CPU, ``M < MANY_ROWS``, no autograd: ``aten._weight_int4pack_mm_for_cpu``,
  which computes ``w = (q - 8) · scale + zero`` from the packed nibbles in one pass (Q4_0:
  zero = 0, Q4_1: zero = m + 8d), faster than even a dense bf16 matmul at decode sizes. Its
  scales are bf16 (it takes no others): each block's scale carries bf16's rounding, which stays
  within bf16 arithmetic's own error (the tests check it by the ratio rule). The bf16
  ``(K/32, N64, 2)`` scales are built once and cached beside the module (4 bytes a block) until
  the buffers change. The op's layout is checked once per process against ours; where it
  differs, the chunked path runs (logged once). At prefill sizes it is slower than the bf16
  matmul on dequantised chunks, so those take the chunked path.
- everything else: rows are dequantised in fp32 (exact: ``d · q`` of an fp16 scale and a small
  integer is exact in fp32, and Q4_1 adds ``m`` with one rounding, as ggml's reference does) a
  chunk of at most ``CHUNK_BYTES`` at a time and multiplied by a matmul. The int4 op has no fast
  fp32 kernel and rounds its output to bf16, and ``aten._weight_int8pack_mm`` takes one scale a
  row, not one a block (and is slow in fp32), so neither serves fp32 or Q8_0. Within it:
  Q4 with ``M < MANY_ROWS`` multiplies the tiles in their stored order (a batched matmul over
  the 64-row tiles), since the transposing copy to ``(n, K)`` rows (made on the nibble bytes)
  costs more than the product; more rows pay that copy for a plain matmul. bf16 with
  ``M < FEW_ROWS`` multiplies in fp32 and rounds once (casting a chunk to bf16 costs more than
  the product); more rows cast the chunk to bf16 for the bf16 matmul.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._log import log_once

__all__ = [
    "CHUNK_BYTES",
    "FORMATS",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "block_bytes",
    "cat_rows",
]

FORMATS = ("q8_0", "q4_0", "q4_1")
BLOCK = 32  # weights a block, along the input dim
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
_HEAD = {"q8_0": 2, "q4_0": 2, "q4_1": 4}  # bytes of fp16 scale (and min) before the integers
CHUNK_BYTES = 4 << 20  # fp32 dequantised weight a forward holds at once
TILE = 64  # rows a tile of torch's CPU int4 layout
# Row counts of an input (M) where the fastest path changes (module docstring):
FEW_ROWS = 16  # bf16 inputs of fewer rows multiply in fp32 (decode)
MANY_ROWS = 128  # Q4: fewer rows multiply the stored tiles, more a plain (n, K) chunk


def _check_fmt(fmt) -> str:
    name = fmt.lower() if isinstance(fmt, str) else fmt
    if name not in FORMATS:
        raise ValueError(f"unknown GGML format {fmt!r}: the formats kept quantised are {FORMATS}")
    return name


def block_bytes(fmt: str) -> int:
    """Bytes of one 32-weight block of ``fmt`` (llama.cpp's ``sizeof(block_q8_0)``, ...)."""
    return _BLOCK_BYTES[_check_fmt(fmt)]


def _check_in_features(in_features: int) -> None:
    if in_features <= 0 or in_features % BLOCK:
        raise ValueError(
            f"in_features ({in_features}) must be a positive multiple of {BLOCK}, the GGML block "
            "size: a weight of another width cannot be kept quantised (dequantise it instead)"
        )


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """Nibble values ``q (N, K)`` in 0..15 -> ``(N64, K/2)`` uint8 in the CPU int4 layout."""
    N, K = q.shape
    n64 = -(-N // TILE) * TILE
    q = F.pad(q.to(torch.uint8), (0, 0, 0, n64 - N)).view(n64 // TILE, 2, TILE // 2, K)
    packed = q[:, 0] | (q[:, 1] << 4)  # (T, 32, K): rows j and 32 + j of each tile
    return packed.transpose(1, 2).contiguous().view(n64, K // 2)  # -> (T, K, 32)


def _unpack4(packed: torch.Tensor, K: int) -> torch.Tensor:
    """Whole tiles of :func:`_pack4`'s layout ``(T·64, K/2)`` -> nibble values, uint8
    ``(T, 2, K, 32)``: ``[t, h, k, j]`` is row ``64t + 32h + j``, column ``k`` (the layout's
    own order: no transposing copy)."""
    tiles = packed.view(-1, K, TILE // 2)  # (T, K, 32)
    q = torch.empty(tiles.shape[0], 2, K, TILE // 2, dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(tiles, 15, out=q[:, 0])
    torch.bitwise_right_shift(tiles, 4, out=q[:, 1])
    return q


@functools.cache
def _int4_op_layout_matches() -> bool:
    """Whether torch's CPU int4 packing is the layout :func:`_pack4` writes (checked once)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (2 * TILE, 2 * BLOCK), generator=g, dtype=torch.int32)
    try:
        theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except (RuntimeError, AttributeError) as e:
        log_once("quant-int4", logging.INFO, "quant: no CPU int4 matmul in this torch (%s); Q4 "
                 "layers dequantise in chunks", e)  # fmt: skip
        return False
    same = theirs.shape == (q.shape[0], q.shape[1] // 2) and torch.equal(theirs, _pack4(q))
    if not same:
        log_once("quant-int4", logging.INFO, "quant: torch's CPU int4 layout differs from ours; Q4 "
                 "layers dequantise in chunks")  # fmt: skip
    return same


class _Blocks(nn.Module):
    """The storage and dequantisation shared by :class:`QuantizedLinear` and
    :class:`QuantizedEmbedding`: ``rows`` weights of ``cols`` inputs (module docstring)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def _init_blocks(self, rows, cols, fmt, dtype, device) -> None:
        self.fmt = fmt = _check_fmt(fmt)
        _check_in_features(cols)
        if rows <= 0:
            raise ValueError(f"a quantised weight needs at least one row, got {rows}")
        self._tied = None  # the module whose buffers this one reads (a tied LM head)
        self._scales = None  # (key, bf16 (K/32, N64, 2)) of the int4 matmul
        B = cols // BLOCK
        if fmt == "q8_0":
            self.register_buffer("qs", torch.empty(rows, cols, dtype=torch.int8, device=device))
        else:
            n64 = -(-rows // TILE) * TILE
            qs = torch.zeros(n64, cols // 2, dtype=torch.uint8, device=device)
            self.register_buffer("qs", qs)
        self.register_buffer("d", torch.empty(rows, B, dtype=torch.int16, device=device))
        if fmt == "q4_1":
            self.register_buffer("m", torch.empty(rows, B, dtype=torch.int16, device=device))
        # An empty float buffer whose dtype .to()/.half()/.bfloat16() convert: the compute dtype.
        probe = torch.empty(0, dtype=dtype, device=device)
        self.register_buffer("_dtype", probe, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (``.to(dtype)`` changes it; forward computes in its input's)."""
        return self._dtype.dtype

    def _store(self) -> _Blocks:
        return self if self._tied is None else self._tied

    def _set_parts(self, q, d_bits, m_bits) -> None:
        """Fill the buffers from integers ``q (N, K)`` (int8 for q8_0, 0..15 for q4) and the
        fp16 bits of the scales (and minimums) ``(N, K/32)``."""
        self.qs = q.to(torch.int8).contiguous() if self.fmt == "q8_0" else _pack4(q)
        self.d = d_bits.contiguous()
        if self.fmt == "q4_1":
            self.m = m_bits.contiguous()

    @classmethod
    def _parse(cls, fmt, blocks) -> tuple:
        """``(rows, cols, q, d_bits, m_bits)`` of GGML ``blocks (N, K/32 · bytes)``."""
        fmt = _check_fmt(fmt)
        size = _BLOCK_BYTES[fmt]
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
        ints = blk[..., _HEAD[fmt] :]
        if fmt == "q8_0":
            q = ints.contiguous().view(torch.int8)
        else:  # byte j: element j (low nibble) and j + 16 (high)
            q = torch.cat((ints & 15, ints >> 4), -1)
        return N, B * BLOCK, q.reshape(N, B * BLOCK), d, m

    @staticmethod
    def _quantize(weight: torch.Tensor, fmt: str) -> tuple:
        """``(q, d_bits, m_bits)`` of ``weight (N, K)`` as ggml's reference quantiser rounds
        (``quantize_row_*_ref``: round to nearest, the scale from the fp32 block before fp16)."""
        N, K = weight.shape
        _check_in_features(K)
        x = weight.detach().float().reshape(N, K // BLOCK, BLOCK)

        def inverse(d):
            return torch.where(d == 0, torch.zeros_like(d), 1 / d)

        m = None
        if fmt == "q8_0":
            d = x.abs().amax(-1, keepdim=True) / 127
            v = x * inverse(d)
            a = v.abs()  # roundf: half away from zero, computed as ggml's reference does
            f = a.floor()
            q = (torch.sign(v) * (f + (2 * (a - f)).floor())).to(torch.int8)
        elif fmt == "q4_0":
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
    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 ``(hi - lo, K)`` dequantised rows ``lo:hi`` (``lo`` a multiple of 64)."""
        s = self._store()
        if s.fmt == "q8_0":
            return self._scale(s.qs[lo:hi].float(), slice(lo, hi))
        end = -(-hi // TILE) * TILE
        # The transposing copy on the nibbles (bytes), not on fp32: it is the costly step.
        q = _unpack4(s.qs[lo:end], s.in_cols).transpose(2, 3)  # (T, 2, K, 32) -> (T, 2, 32, K)
        return self._scale(q.reshape(-1, s.in_cols)[: hi - lo].float(), slice(lo, hi))

    def _tiles(self, lo: int, hi: int) -> torch.Tensor:
        """A Q4 weight's fp32 rows ``lo:hi`` (``lo`` a multiple of 64) dequantised in the
        storage's tile order ``(T, 2, K, 32)`` (:func:`_unpack4`), padding rows zero."""
        s = self._store()
        K, B = s.in_cols, s.in_cols // BLOCK
        end = -(-hi // TILE) * TILE
        q = _unpack4(s.qs[lo:end], K).float()  # (T, 2, K, 32)
        T = q.shape[0]

        def per_tile(bits):  # (N, K/32) fp16 bits -> (T, 2, K/32, 1, 32) fp32 of rows lo:end
            v = F.pad(bits[lo:hi].view(torch.float16).float(), (0, 0, 0, end - hi))
            v = v.view(T, 2, TILE // 2, B).transpose(2, 3).contiguous()  # (T, 2, K/32, 32)
            return v.unsqueeze(3)  # contiguous rows broadcast fast; strided ones do not

        w = q.view(T, 2, B, BLOCK, TILE // 2)  # (T, 2, K, 32) -> (T, 2, K/32, 32, 32)
        if s.fmt == "q4_0":
            w.sub_(8)
        w.mul_(per_tile(s.d))
        if s.fmt == "q4_1":
            w.add_(per_tile(s.m))
        return q

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 ``(n, K)`` dequantised rows ``ids (n,)``."""
        s = self._store()
        if s.fmt == "q8_0":
            q = s.qs[ids].float()
        else:
            half = TILE // 2
            tiles = s.qs.view(-1, s.in_cols, half)  # (T, K, 32)
            b = tiles[ids // TILE, :, ids % half]  # (n, K): the bytes holding each row
            q = torch.where(((ids % TILE) >= half)[:, None], b >> 4, b & 15).float()
        return self._scale(q, ids)

    def _scale(self, q: torch.Tensor, rows) -> torch.Tensor:
        """fp32 weights of integers ``q (n, K)`` (fp32) with the scales of ``rows``, in the
        order of ggml's reference dequantiser (bit-equal to it)."""
        s = self._store()
        n, K = q.shape
        q = q.view(n, K // BLOCK, BLOCK)
        d = s.d[rows].view(torch.float16).float().unsqueeze(-1)  # (n, K/32, 1)
        if s.fmt == "q4_0":
            q.sub_(8)
        q.mul_(d)
        if s.fmt == "q4_1":
            q.add_(s.m[rows].view(torch.float16).float().unsqueeze(-1))
        return q.view(n, K)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``(N, K)`` in ``dtype`` (computed in fp32: exact there)."""
        return self._rows(0, self.out_rows).to(dtype)

    def to_ggml(self) -> torch.Tensor:
        """The weight as GGML blocks: uint8 ``(N, K/32 · block_bytes(fmt))``, the bytes a GGUF
        file stores (:meth:`QuantizedLinear.from_ggml` of them rebuilds this module)."""
        s = self._store()
        N, K = self.out_rows, s.in_cols
        if s.fmt == "q8_0":
            ints = s.qs.view(torch.uint8).view(N, K // BLOCK, BLOCK)
        else:
            q = _unpack4(s.qs, K).transpose(2, 3).reshape(-1, K)[:N]  # (T, 2, K, 32) -> (N, K)
            q = q.view(N, K // BLOCK, 2, BLOCK // 2)
            ints = q[:, :, 0] | (q[:, :, 1] << 4)
        heads = [s.d] + ([s.m] if s.fmt == "q4_1" else [])
        heads = [h.view(torch.uint8).view(N, K // BLOCK, 2) for h in heads]
        return torch.cat([*heads, ints], -1).view(N, -1)


class QuantizedLinear(_Blocks):
    """``y = x · Wᵀ (+ bias)`` with ``W (out_features, in_features)`` kept as GGML blocks of
    format ``fmt`` (module docstring). Build it with :meth:`from_ggml` (a GGUF tensor's bytes)
    or :meth:`from_float`; the constructor makes uninitialised storage (for ``device="meta"``
    and ``load_state_dict(assign=True)``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_blocks(out_features, in_features, fmt, dtype, device)
        b = torch.empty(out_features, dtype=dtype, device=device) if bias else None
        self.bias = None if b is None else nn.Parameter(b)

    in_cols = property(lambda self: self.in_features)
    out_rows = property(lambda self: self.out_features)

    @classmethod
    def _assemble(cls, fmt, q, d, m, *, bias, dtype) -> QuantizedLinear:
        N, K = q.shape
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} must be ({N},), one per row")
        dtype = dtype or (bias.dtype if bias is not None else torch.float32)
        layer = cls(K, N, fmt, bias=bias is not None, dtype=dtype, device="meta")
        layer._set_parts(q, d, m)
        layer._dtype = torch.empty(0, dtype=dtype, device=q.device)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        return layer

    @classmethod
    def from_ggml(cls, fmt, blocks, *, bias=None, dtype=torch.float32) -> QuantizedLinear:
        """The layer of a GGUF tensor's blocks: uint8 ``(out_features, in_features / 32 ·
        block_bytes(fmt))``, rows as the file stores them; ``bias (out_features,)`` or None."""
        _, _, q, d, m = cls._parse(fmt, blocks)
        return cls._assemble(_check_fmt(fmt), q, d, m, bias=bias, dtype=dtype)

    @classmethod
    def from_float(cls, weight, fmt, *, bias=None, dtype=None) -> QuantizedLinear:
        """``weight (out_features, in_features)`` quantised as ggml's reference quantiser does
        (``gguf.quants.quantize`` gives the same blocks); ``dtype`` defaults to the weight's."""
        fmt = _check_fmt(fmt)
        if weight.dim() != 2:
            raise ValueError(
                f"weight must be (out_features, in_features), got {tuple(weight.shape)}"
            )
        q, d, m = cls._quantize(weight, fmt)
        return cls._assemble(fmt, q, d, m, bias=bias, dtype=dtype or weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in_features)`` -> ``(..., out_features)`` in ``x``'s dtype."""
        K, N = self.in_features, self.out_features
        if x.shape[-1] != K:
            raise ValueError(f"input of width {x.shape[-1]} does not match in_features ({K})")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K)  # (..., K) -> (M, K)
        s = self._store()
        if (
            x.dtype == torch.bfloat16
            and s.fmt != "q8_0"
            and x2.shape[0] < MANY_ROWS
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad)
            and _int4_op_layout_matches()
        ):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, s.qs, BLOCK, self._int4_scales())
            y = y[:, :N]  # (M, N64) -> (M, N)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        else:
            y = self._chunked(x2)
        return y.reshape(*lead, N)

    def _chunked(self, x: torch.Tensor) -> torch.Tensor:
        """``x (M, K) · Wᵀ`` dequantising at most ``CHUNK_BYTES`` of fp32 rows at a time."""
        K, N, bias = self.in_features, self.out_features, self.bias
        step = max(TILE, CHUNK_BYTES // (4 * K) // TILE * TILE)
        wide = x.dtype == torch.bfloat16 and x.shape[0] < FEW_ROWS  # decode: one fp32 product
        xc = x.float() if wide else x
        parts = []
        for lo in range(0, N, step):
            hi = min(N, lo + step)
            b = None if bias is None else bias[lo:hi].to(xc.dtype)
            if self.fmt == "q8_0" or x.shape[0] >= MANY_ROWS:
                parts.append(F.linear(xc, self._rows(lo, hi).to(xc.dtype), b))
                continue
            # Fewer rows multiply the Q4 tiles as stored, without the transposing copy that a
            # plain matmul's (n, K) weight needs: (M, K) @ (T·2, K, 32) -> (T·2, M, 32)
            w = self._tiles(lo, hi).to(xc.dtype).view(-1, K, TILE // 2)
            y = torch.matmul(xc, w).transpose(0, 1).reshape(x.shape[0], -1)[:, : hi - lo]
            parts.append(y if b is None else y + b)
        y = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        return y.to(x.dtype)

    def _int4_scales(self) -> torch.Tensor:
        """bf16 ``(K/32, N64, 2)`` scales and zeros of the int4 matmul (``w = (q - 8) · scale +
        zero``), cached until the buffers change (``.to(device)``, a load)."""
        s = self._store()
        key = tuple((t.data_ptr(), t._version) for t in (s.d, getattr(s, "m", s.d)))
        if self._scales is not None and self._scales[0] == key:
            return self._scales[1]
        n64 = s.qs.shape[0]
        d = s.d.view(torch.float16).float().T  # (N, K/32) -> (K/32, N)
        zero = torch.zeros_like(d) if s.fmt == "q4_0" else s.m.view(torch.float16).float().T + 8 * d
        sz = torch.stack((d, zero), -1)  # (K/32, N, 2)
        sz = F.pad(sz, (0, 0, 0, n64 - sz.shape[1])).to(torch.bfloat16).contiguous()
        self._scales = (key, sz)
        return sz

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"bias={self.bias is not None}, dtype={self.dtype}"
        )


def cat_rows(layers: list[QuantizedLinear]) -> QuantizedLinear:
    """One layer whose rows are ``layers``' rows in order (fusing q/k/v projections); the
    parts must share ``fmt`` and ``in_features``, and have a bias all or none."""
    if not layers:
        raise ValueError("cat_rows needs at least one layer")
    first = layers[0]
    for i, part in enumerate(layers[1:], 1):
        if part.fmt != first.fmt or part.in_features != first.in_features:
            raise ValueError(
                f"cat_rows: layer {i} is {part.fmt} with in_features={part.in_features} but "
                f"layer 0 is {first.fmt} with in_features={first.in_features}; fuse only "
                "layers of one format and width"
            )
    biased = [p.bias is not None for p in layers]
    if any(biased) and not all(biased):
        raise ValueError(f"cat_rows: some layers have a bias and some not ({biased})")
    blocks = torch.cat([p.to_ggml() for p in layers])
    bias = torch.cat([p.bias.detach() for p in layers]) if all(biased) else None
    return QuantizedLinear.from_ggml(first.fmt, blocks, bias=bias, dtype=first.dtype)


class QuantizedEmbedding(_Blocks):
    """An ``nn.Embedding`` whose ``(num_embeddings, embedding_dim)`` table is kept as GGML
    blocks; a lookup dequantises only the rows it reads."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        fmt: str,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._init_blocks(num_embeddings, embedding_dim, fmt, dtype, device)

    in_cols = property(lambda self: self.embedding_dim)
    out_rows = property(lambda self: self.num_embeddings)

    @classmethod
    def from_ggml(cls, fmt, blocks, *, dtype=torch.float32) -> QuantizedEmbedding:
        """The table of a GGUF tensor's blocks: uint8 ``(num_embeddings, embedding_dim / 32 ·
        block_bytes(fmt))``."""
        N, K, q, d, m = cls._parse(fmt, blocks)
        table = cls(N, K, fmt, dtype=dtype, device="meta")
        table._set_parts(q, d, m)
        table._dtype = torch.empty(0, dtype=dtype, device=q.device)
        return table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids (...)`` -> ``(..., embedding_dim)`` in the compute dtype."""
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            bad = flat[(flat < 0) | (flat >= self.num_embeddings)][0].item()
            raise IndexError(f"token id {bad} is out of range for {self.num_embeddings} embeddings")
        rows = self._gather(flat).to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantizedLinear:
        """A tied LM head ``(..., embedding_dim) -> (..., num_embeddings)`` reading this table's
        buffers (no copy; it holds no buffers of its own, so ``.to()`` of a model moves the
        table once and ``state_dict`` names it once, under the embedding)."""
        N, K = self.num_embeddings, self.embedding_dim
        head = QuantizedLinear(K, N, self.fmt, dtype=self.dtype, device="meta")
        for name in ("qs", "d", "m"):
            head._buffers.pop(name, None)
        head._dtype = torch.empty(0, dtype=self.dtype, device=self.qs.device)
        object.__setattr__(head, "_tied", self)  # not a submodule: the model holds the table
        return head

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}, dtype={self.dtype}"
