"""How many bytes a KV cache needs: :func:`kv_cache_bytes` and :func:`format_bytes`."""

from __future__ import annotations

import torch

from selfattn._validate import int_at_least, positive_int

__all__ = ["KV_DTYPES", "dtype_name", "format_bytes", "kv_cache_bytes"]

# Storage bytes per element of each dtype name; int8 and fp8 also carry float32 scales (below).
KV_DTYPES = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}
_ALIASES = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "half": "fp16"}
_ALIASES |= {"bfloat16": "bf16", "float": "fp32", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
_SCALE_BYTES = 4  # quantisation scales are stored as float32


def dtype_name(dtype) -> str:
    """The :data:`KV_DTYPES` name of ``dtype`` (a torch dtype or a string such as ``"bf16"``)."""
    if isinstance(dtype, torch.dtype):
        if dtype == torch.int8:
            return "int8"
        if dtype.is_floating_point and dtype.itemsize == 1:  # float8_e4m3fn, float8_e5m2, ...
            return "fp8"
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.lower()
    else:
        raise TypeError(f"dtype must be a torch.dtype or a string, got {type(dtype).__name__}")
    name = _ALIASES.get(name, name)
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    return name


def _count(value, name: str) -> int:
    return positive_int(value, f"kv_cache_bytes {name}")


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, dtype, batch: int = 1):
    """Bytes a KV cache of ``batch`` sequences of ``tokens`` tokens occupies.

    ``2 × layers × kv_heads × head_dim × tokens × bytes(dtype) × batch``: the 2 is K and V. Query
    heads do not appear: only KV heads are cached, which is why GQA and MQA shrink the cache by
    ``Hq / Hkv``. ``dtype`` is a torch dtype or one of ``fp64 fp32 fp16 bf16 int8 fp8``.
    Quantised storage adds its float32 scales: int8 keeps one per token and KV head
    (``2 × layers × kv_heads × tokens × 4 × batch``), fp8 one per KV head
    (``2 × layers × kv_heads × 4``).

    A Llama-2-7B-shaped model (32 layers, 32 KV heads of dimension 128, 16-bit) needs 512 KiB
    per token and 2 GiB for one 4,096-token sequence:

    >>> kv_cache_bytes(32, 32, 128, 1, "fp16")
    524288
    >>> kv_cache_bytes(32, 32, 128, 4096, "bf16") == 2 * 2**30
    True
    """
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        _count(value, name)
    _count(tokens, "tokens")
    _count(batch, "batch")
    name = dtype_name(dtype)
    total = 2 * layers * kv_heads * head_dim * tokens * KV_DTYPES[name] * batch
    if name == "int8":
        total += 2 * layers * kv_heads * tokens * _SCALE_BYTES * batch
    elif name == "fp8":
        total += 2 * layers * kv_heads * _SCALE_BYTES
    return total


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``format_bytes(524288) == "512 KiB"``, ``"1.5 GiB"``."""
    int_at_least(n, "format_bytes n", 0)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    k = 0
    while k + 1 < len(units) and n >= 1024 ** (k + 1):
        k += 1
    text = f"{n / 1024**k:.2f}".rstrip("0").rstrip(".")
    return f"{text} {units[k]}"
