"""KIVI: 2-bit and 4-bit KV caches, keys per channel and values per token (Liu et al., 2024,
"KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750).

The rule, asymmetric round-to-nearest over min/max groups::

    scale = (max - min) / (2**bits - 1),  zero = min       (both stored in the cache dtype)
    code  = clamp(round((x - zero) / scale), 0, 2**bits - 1)     (round half to even)
    x'    = code * scale + zero                |x - x'| <= scale / 2 (a half step)

Keys (:func:`quantize_keys`): one ``(scale, zero)`` per channel over each group of ``group``
consecutive tokens, since key outliers sit in fixed channels. Values (:func:`quantize_values`):
one per token over each group of ``group`` channels, since attention mixes values per token. A
group whose max equals its min has scale 0 and every code 0 (``x' = zero``, exact).

Bit packing: codes are packed along the channel dimension into uint8, ``8 // bits`` codes a
byte, channel ``c`` at byte ``c * bits // 8``, bits ``(c % (8 // bits)) * bits`` upwards (the
first channel in the low bits); the channel count must be a multiple of ``8 // bits``.

:class:`KIVICache` keeps the most recent tokens in full precision (the residual): at least
``residual`` of them (a multiple of ``group``) and fewer than ``residual + group``; each time
the residual reaches ``residual + group`` tokens, its oldest ``group`` are quantised. The
paper's reference code flushes keys ``residual`` tokens at a time and values one token at a
time; here keys and values share one boundary, so the same tokens are quantised in both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from selfattn._validate import int_at_least, positive_int
from selfattn.cache.base import KV
from selfattn.cache.size import KV_DTYPES, dtype_name
from selfattn.cache.static import check_new_kv

__all__ = [
    "KIVI_BITS",
    "KIVICache",
    "Quantized",
    "check_kivi",
    "dequantize_keys",
    "dequantize_values",
    "kivi_bytes",
    "pack_codes",
    "quantize_keys",
    "quantize_values",
    "unpack_codes",
    "value_group",
]

KIVI_BITS = (2, 4)


class Quantized(NamedTuple):
    """Packed codes ``(..., T, C * bits // 8)`` uint8 with their ``scale`` and ``zero``
    (keys: ``(..., T // group, C)``; values: ``(..., T, C // group)``)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int


def check_kivi(bits, group, residual=0) -> tuple[int, int, int]:
    """``(bits, group, residual)`` checked: bits 2 or 4, group >= 1, residual >= 0 and a
    multiple of group (ValueError naming the value otherwise)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in KIVI_BITS:
        raise ValueError(f"KIVI bits must be one of {KIVI_BITS}, got {bits!r}")
    positive_int(group, "KIVI group")
    int_at_least(residual, "KIVI residual", 0)
    if residual % group:
        raise ValueError(
            f"KIVI residual ({residual}) must be a multiple of group ({group}): the residual "
            "is quantised a whole group at a time"
        )
    return bits, group, residual


def value_group(group: int, value_dim: int) -> int:
    """Channels per value group: ``min(group, value_dim)``, which must divide ``value_dim``."""
    g = min(group, value_dim)
    if value_dim % g:
        raise ValueError(
            f"KIVI group ({group}) must divide the value dim ({value_dim}) to group its "
            "channels; choose a group that divides it"
        )
    return g


def _check_channels(channels: int, bits: int, what: str) -> None:
    per = 8 // bits
    if channels % per:
        raise ValueError(
            f"{what} ({channels}) must be a multiple of {per} to pack {bits}-bit codes into bytes"
        )


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``(..., C)`` in ``0 .. 2**bits - 1`` -> ``(..., C * bits // 8)`` uint8
    (the module docstring's layout)."""
    per = 8 // bits
    _check_channels(codes.shape[-1], bits, "the channel count")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    grouped = codes.to(torch.uint8).unflatten(-1, (-1, per))  # (..., C) -> (..., C/per, per)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)  # disjoint bits: the sum is an OR


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., C * bits // 8)`` uint8 -> the codes ``(..., C)`` uint8 (:func:`pack_codes`)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., n) -> (..., n, per)
    return codes.flatten(-2)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _quantize(x: torch.Tensor, dim: int, bits: int, dtype):
    """Codes of ``x`` (same shape) and ``scale``, ``zero`` reduced over ``dim`` (kept, size 1),
    stored in ``dtype``; the codes come from the stored scale and zero."""
    xc = x.to(_compute_dtype(x.dtype))
    lo, hi = xc.amin(dim, keepdim=True), xc.amax(dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).to(dtype)
    zero = lo.to(dtype)
    s = scale.to(xc.dtype)
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))  # a constant group: every code 0
    codes = ((xc - zero.to(xc.dtype)) * inv).round_().clamp_(0, 2**bits - 1)
    return codes.to(torch.uint8), scale, zero


def quantize_keys(k: torch.Tensor, bits: int = 2, group: int = 32, dtype=None) -> Quantized:
    """Keys ``k (B, Hkv, T, D)`` per channel over groups of ``group`` tokens (``T`` a multiple
    of ``group``): codes ``(B, Hkv, T, D * bits // 8)``, scale and zero ``(B, Hkv, T //
    group, D)`` in ``dtype`` (default ``k``'s)."""
    check_kivi(bits, group)
    T, D = k.shape[-2], k.shape[-1]
    if T % group:
        raise ValueError(f"quantize_keys needs a multiple of group={group} tokens, got {T}")
    _check_channels(D, bits, "the head dim")
    grouped = k.unflatten(-2, (T // group, group))  # (B, H, T, D) -> (B, H, T/G, G, D)
    codes, scale, zero = _quantize(grouped, -2, bits, dtype or k.dtype)
    codes = pack_codes(codes.flatten(-3, -2), bits)  # (B, H, T/G, G, D) -> (B, H, T, D/per)
    return Quantized(codes, scale.squeeze(-2), zero.squeeze(-2), bits, group)


def quantize_values(v: torch.Tensor, bits: int = 2, group: int = 32, dtype=None) -> Quantized:
    """Values ``v (B, Hkv, T, Dv)`` per token over groups of ``group`` channels (a divisor of
    ``Dv``): codes ``(B, Hkv, T, Dv * bits // 8)``, scale and zero ``(B, Hkv, T, Dv //
    group)`` in ``dtype`` (default ``v``'s)."""
    check_kivi(bits, group)
    Dv = v.shape[-1]
    if Dv % group:
        raise ValueError(f"quantize_values needs group={group} to divide the value dim {Dv}")
    _check_channels(Dv, bits, "the value dim")
    grouped = v.unflatten(-1, (Dv // group, group))  # (B, H, T, Dv) -> (B, H, T, Dv/g, g)
    codes, scale, zero = _quantize(grouped, -1, bits, dtype or v.dtype)
    return Quantized(pack_codes(codes.flatten(-2), bits), scale.squeeze(-1), zero.squeeze(-1),
                     bits, group)  # fmt: skip


def dequantize_keys(q: Quantized, dtype=None) -> torch.Tensor:
    """``(B, Hkv, T, D)`` keys of :func:`quantize_keys`'s result, in ``dtype`` (default the
    scale's), computed per group: ``code * scale + zero``."""
    cd = _compute_dtype(q.scale.dtype)
    codes = unpack_codes(q.codes, q.bits).to(cd).unflatten(-2, (-1, q.group))  # (.., T/G, G, D)
    x = codes * q.scale.to(cd).unsqueeze(-2) + q.zero.to(cd).unsqueeze(-2)
    return x.flatten(-3, -2).to(dtype or q.scale.dtype)  # (B, H, T/G, G, D) -> (B, H, T, D)


def dequantize_values(q: Quantized, dtype=None) -> torch.Tensor:
    """``(B, Hkv, T, Dv)`` values of :func:`quantize_values`'s result, in ``dtype`` (default
    the scale's)."""
    cd = _compute_dtype(q.scale.dtype)
    codes = unpack_codes(q.codes, q.bits).to(cd).unflatten(-1, (-1, q.group))  # (.., Dv/g, g)
    x = codes * q.scale.to(cd).unsqueeze(-1) + q.zero.to(cd).unsqueeze(-1)
    return x.flatten(-2).to(dtype or q.scale.dtype)


def quantized_tokens(length: int, group: int, residual: int) -> int:
    """Tokens of ``length`` held quantised: ``group * floor((length - residual) / group)``
    once ``length >= residual``, else 0; the rest are the residual."""
    return group * (max(0, length - residual) // group)


def kivi_bytes(
    layers: int, kv_heads: int, head_dim: int, tokens: int, bits: int = 2, group: int = 32,
    residual: int = 128, dtype="bf16", batch: int = 1, *, value_dim: int | None = None,
) -> int:  # fmt: skip
    """Bytes a :class:`KIVICache` holding ``tokens`` tokens of ``batch`` sequences occupies.

    With ``n_q`` quantised tokens (:func:`quantized_tokens`), ``n_r = tokens - n_q`` residual
    ones, ``s`` bytes per element of ``dtype`` (the residual's and the scales'),
    ``Dv = value_dim or head_dim`` and ``g = min(group, Dv)``, per layer, KV head and sequence::

        n_q * (D + Dv) * bits / 8             the packed codes
        + 2 * s * (n_q / group * D + n_q * Dv / g)   key scale+zero per channel and group,
                                                     value scale+zero per token and group
        + n_r * (D + Dv) * s                  the full-precision residual

    Against :func:`~selfattn.cache.kv_cache_bytes`'s ``(D + Dv) * s`` per token, a long
    sequence costs ``(D + Dv) * bits / 8 + 2 * s * (D / group + Dv / g)`` bytes per token:
    Llama-2-7B's shape (32 layers, 32 KV heads of 128) at 2 bits with bf16 scales takes 96
    bytes per head and layer against bf16's 512, 5.3x less:

    >>> from selfattn.cache import kv_cache_bytes
    >>> kivi_bytes(32, 32, 128, 4096, residual=0)
    402653184
    >>> kv_cache_bytes(32, 32, 128, 4096, "bf16") // kivi_bytes(32, 32, 128, 4096, residual=0)
    5
    """
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("tokens", tokens), ("batch", batch)):  # fmt: skip
        positive_int(value, f"kivi_bytes {name}")
    bits, group, residual = check_kivi(bits, group, residual)
    dv = head_dim if value_dim is None else positive_int(value_dim, "kivi_bytes value_dim")
    name = dtype_name(dtype)
    if name in ("int8", "fp8"):
        raise ValueError(f"kivi_bytes dtype is the residual's and scales' float type, got {name}")
    s = KV_DTYPES[name]
    n_q = quantized_tokens(tokens, group, residual)
    n_r = tokens - n_q
    per_head = (
        n_q * (head_dim + dv) * bits // 8
        + 2 * s * (n_q // group * head_dim + n_q * (dv // value_group(group, dv)))
        + n_r * (head_dim + dv) * s
    )
    return layers * kv_heads * batch * per_head


class KIVICache:
    """A per-layer KV cache of KIVI-quantised history plus a full-precision residual.

    ``KIVICache(batch, max_len, n_kv_heads, head_dim, value_dim=None, *, bits=2, group=32,
    residual=128, dtype, device)``: the :class:`~selfattn.cache.StaticCache` interface
    (``update``, ``length``, ``reset``), appends only. Memory layout, for ``n_q`` quantised
    tokens (the first ones) and ``n_r`` residual ones (the last):

    - ``k_codes (B, Hkv, Q, D * bits // 8)`` uint8, ``k_scale``, ``k_zero (B, Hkv, Q //
      group, D)``: tokens ``0 .. n_q - 1``, keys per channel over groups of ``group`` tokens;
    - ``v_codes (B, Hkv, Q, Dv * bits // 8)`` uint8, ``v_scale``, ``v_zero (B, Hkv, Q, Dv //
      g)``: the same tokens' values per token over ``g = min(group, Dv)`` channels;
    - ``k_res (B, Hkv, R', D)``, ``v_res (B, Hkv, R', Dv)`` in ``dtype``: tokens ``n_q ..
      length - 1`` at slots ``0 .. n_r - 1``,

    where ``Q`` is the most tokens ever quantised for ``max_len`` and ``R' = min(max_len,
    residual + group - 1)``. :meth:`update` returns the whole history for this step's
    attention: the quantised groups dequantised (into a temporary, never kept) followed by the
    residual, key ``j`` at position ``j``, so any attention backend reads it.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        bits: int = 2,
        group: int = 32,
        residual: int = 128,
        dtype=torch.float32,
        device=None,
    ):
        self.bits, self.group, self.residual = check_kivi(bits, group, residual)
        for name, x in (("batch", batch), ("max_len", max_len), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim)):  # fmt: skip
            positive_int(x, f"KIVICache {name}")
        dv = head_dim if value_dim is None else positive_int(value_dim, "KIVICache value_dim")
        _check_channels(head_dim, bits, "KIVICache head_dim")
        _check_channels(dv, bits, "KIVICache value_dim")
        self.value_group = value_group(group, dv)
        self.max_len, self.dtype = max_len, dtype
        B, H, per = batch, n_kv_heads, 8 // bits
        Q = quantized_tokens(max_len, group, residual)
        R = min(max_len, residual + group - 1)
        codes = {"dtype": torch.uint8, "device": device}
        fk = {"dtype": dtype, "device": device}
        self.k_codes = torch.zeros(B, H, Q, head_dim // per, **codes)
        self.k_scale = torch.zeros(B, H, Q // group, head_dim, **fk)
        self.k_zero = torch.zeros_like(self.k_scale)
        self.v_codes = torch.zeros(B, H, Q, dv // per, **codes)
        self.v_scale = torch.zeros(B, H, Q, dv // self.value_group, **fk)
        self.v_zero = torch.zeros_like(self.v_scale)
        self.k_res = torch.zeros(B, H, R, head_dim, **fk)
        self.v_res = torch.zeros(B, H, R, dv, **fk)
        self.length = 0

    @property
    def n_quantized(self) -> int:
        """Tokens held quantised (the first ones)."""
        return quantized_tokens(self.length, self.group, self.residual)

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every token (the storage is kept and overwritten by later updates)."""
        self.length = 0

    def stored_bytes(self) -> int:
        """Bytes of what the cache holds now (:func:`kivi_bytes` of its length): the used
        codes, scales and residual, not the preallocated room."""
        n_q, n_r = self.n_quantized, self.length - self.n_quantized
        used = (
            (self.k_codes, n_q), (self.v_codes, n_q), (self.k_scale, n_q // self.group),
            (self.k_zero, n_q // self.group), (self.v_scale, n_q), (self.v_zero, n_q),
            (self.k_res, n_r), (self.v_res, n_r),
        )  # fmt: skip
        return sum(t[:, :, :n].numel() * t.element_size() for t, n in used)

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None) -> KV:
        """Append ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` after the cached tokens
        (``positions``, when given, must be those next slots) and return ``KV(k_all, v_all)``:
        ``(B, Hkv, length, D)`` and ``(B, Hkv, length, Dv)`` in the cache dtype."""
        S = check_new_kv(self.k_res, self.v_res, k, v)
        self._check_positions(positions, S)
        end = self.length + S
        if end > self.max_len:
            raise ValueError(
                f"KIVICache holds {self.max_len} tokens (max_len); {self.length} cached plus "
                f"{S} new exceed it: build it with a larger max_len or reset() it"
            )
        n_q, n_r = self.n_quantized, self.length - self.n_quantized
        new_q = quantized_tokens(end, self.group, self.residual)
        if new_q == n_q:  # no group completes: the new tokens join the residual
            self.k_res[:, :, n_r : n_r + S] = k
            self.v_res[:, :, n_r : n_r + S] = v
        else:  # tokens n_q .. end - 1: the residual then the new ones; quantise the full groups
            ks = torch.cat([self.k_res[:, :, :n_r], k.to(self.dtype)], 2)
            vs = torch.cat([self.v_res[:, :, :n_r], v.to(self.dtype)], 2)
            self._store(n_q, ks[:, :, : new_q - n_q], vs[:, :, : new_q - n_q])
            left = end - new_q
            self.k_res[:, :, :left] = ks[:, :, new_q - n_q :]
            self.v_res[:, :, :left] = vs[:, :, new_q - n_q :]
        self.length = end
        return KV(*self._history())

    def _store(self, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise whole groups of tokens ``first ..`` into the packed storage."""
        n, g = k.shape[2], self.group
        qk = quantize_keys(k, self.bits, g)
        qv = quantize_values(v, self.bits, self.value_group)
        self.k_codes[:, :, first : first + n] = qk.codes
        self.k_scale[:, :, first // g : (first + n) // g] = qk.scale
        self.k_zero[:, :, first // g : (first + n) // g] = qk.zero
        self.v_codes[:, :, first : first + n] = qv.codes
        self.v_scale[:, :, first : first + n] = qv.scale
        self.v_zero[:, :, first : first + n] = qv.zero

    def quantized(self) -> tuple[Quantized, Quantized]:
        """Views of the quantised keys and values (the first :attr:`n_quantized` tokens)."""
        n, g = self.n_quantized, self.group
        qk = Quantized(self.k_codes[:, :, :n], self.k_scale[:, :, : n // g],
                       self.k_zero[:, :, : n // g], self.bits, g)  # fmt: skip
        qv = Quantized(self.v_codes[:, :, :n], self.v_scale[:, :, :n], self.v_zero[:, :, :n],
                       self.bits, self.value_group)  # fmt: skip
        return qk, qv

    def _history(self) -> tuple[torch.Tensor, torch.Tensor]:
        n_q = self.n_quantized
        n_r = self.length - n_q
        if not n_q:
            return self.k_res[:, :, :n_r], self.v_res[:, :, :n_r]
        qk, qv = self.quantized()
        k = torch.cat([dequantize_keys(qk, self.dtype), self.k_res[:, :, :n_r]], 2)
        v = torch.cat([dequantize_values(qv, self.dtype), self.v_res[:, :, :n_r]], 2)
        return k, v

    def _check_positions(self, positions, S: int) -> None:
        if positions is None:
            return
        got = torch.as_tensor(positions).flatten().tolist()
        want = list(range(self.length, self.length + S))
        if got != want:
            raise ValueError(
                f"KIVICache appends only: positions must be the next slots {want[:1]}..., got "
                f"{got[:8]}; call update without positions"
            )

    def __repr__(self) -> str:
        return (
            f"KIVICache(bits={self.bits}, group={self.group}, residual={self.residual}, "
            f"length={self.length}, quantized={self.n_quantized})"
        )
