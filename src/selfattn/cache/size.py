"""How many bytes a KV cache needs: :func:`kv_cache_bytes`, :func:`format_bytes`, and the cache
shape of any transformers-style model config (:func:`kv_shape_from_config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from selfattn._validate import int_at_least, positive_int

__all__ = [
    "KV_DTYPES",
    "KVShape",
    "dtype_name",
    "format_bytes",
    "kv_cache_bytes",
    "kv_shape_from_config",
    "latent_cache_bytes",
]

# Storage bytes per element of each dtype name; int8 and fp8 also carry scales (below).
KV_DTYPES = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}
_ALIASES = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "half": "fp16"}
_ALIASES |= {"bfloat16": "bf16", "float": "fp32", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
# Quantisation scales (selfattn.cache.quant): int8's one per token and head in bfloat16, fp8's
# one per head in float32.
_INT8_SCALE_BYTES, _FP8_SCALE_BYTES = 2, 4


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


def kv_cache_bytes(
    layers: int, kv_heads: int, head_dim: int, tokens: int, dtype, batch: int = 1, *,
    value_dim: int | None = None,
):  # fmt: skip
    """Bytes a KV cache of ``batch`` sequences of ``tokens`` tokens occupies.

    ``2 × layers × kv_heads × head_dim × tokens × bytes(dtype) × batch``: the 2 is K and V
    (with ``value_dim`` ``Dv != D``: ``layers × kv_heads × (head_dim + value_dim) × ...``). Query
    heads do not appear: only KV heads are cached, which is why GQA and MQA shrink the cache by
    ``Hq / Hkv``. ``dtype`` is a torch dtype or one of ``fp64 fp32 fp16 bf16 int8 fp8``.
    Quantised storage adds its scales: int8 keeps a bfloat16 one per token and KV head
    (``2 × layers × kv_heads × tokens × 2 × batch``), fp8 a float32 one per KV head
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
    width = 2 * head_dim if value_dim is None else head_dim + _count(value_dim, "value_dim")
    name = dtype_name(dtype)
    total = layers * kv_heads * width * tokens * KV_DTYPES[name] * batch
    if name == "int8":
        total += 2 * layers * kv_heads * tokens * _INT8_SCALE_BYTES * batch
    elif name == "fp8":
        total += 2 * layers * kv_heads * _FP8_SCALE_BYTES
    return total


def latent_cache_bytes(
    layers: int, kv_lora_rank: int, rope_dim: int, tokens: int, dtype, batch: int = 1
) -> int:
    """Bytes a multi-head latent attention cache (DeepSeek-V2/V3, :mod:`selfattn.cache.latent`)
    of ``batch`` sequences of ``tokens`` tokens occupies.

    ``layers × (kv_lora_rank + rope_dim) × tokens × bytes(dtype) × batch``: one latent row per
    token and layer, shared by every head, with no separate V (the values are the latent's
    first ``kv_lora_rank`` columns). Quantised storage adds scales as
    :func:`kv_cache_bytes` does, for one tensor of one head. DeepSeek-V3 (61 layers,
    ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64) needs 68.6 KiB per token in bf16, against
    4.8 MiB for the same heads cached as MHA (128 heads of K 192 + V 128):

    >>> latent_cache_bytes(61, 512, 64, 1, "bf16")
    70272
    >>> kv_cache_bytes(61, 128, 192, 1, "bf16", value_dim=128)
    4997120
    """
    for name, value in (("layers", layers), ("kv_lora_rank", kv_lora_rank)):
        positive_int(value, f"latent_cache_bytes {name}")
    positive_int(rope_dim, "latent_cache_bytes rope_dim")
    _count(tokens, "tokens")
    _count(batch, "batch")
    name = dtype_name(dtype)
    total = layers * (kv_lora_rank + rope_dim) * tokens * KV_DTYPES[name] * batch
    if name == "int8":
        total += layers * tokens * _INT8_SCALE_BYTES * batch
    elif name == "fp8":
        total += layers * _FP8_SCALE_BYTES
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


@dataclasses.dataclass(frozen=True)
class KVShape:
    """What a model's KV cache holds per token: ``layers`` x ``kv_heads`` x ``head_dim`` for K and
    for V; ``sliding_layers`` of the layers keep only the last ``sliding_window`` tokens.
    ``heads`` (query heads) does not change the size; ``dtype`` is the checkpoint's, if known.
    ``value_dim``: V's width when it differs from ``head_dim``. Multi-head latent attention
    sets ``kv_lora_rank`` and ``rope_dim``: the cache then holds one latent row of ``kv_lora_rank
    + rope_dim`` per token and layer (:func:`latent_cache_bytes`), and ``kv_heads`` ×
    (``head_dim``, ``value_dim``) describe the equivalent per-head cache (:meth:`mha_bytes`).
    ``stream_sinks`` / ``stream_window``: a StreamingLLM cache (:class:`~selfattn.cache.
    StreamingCache`, ``make_cache("streaming", n_sink=, window=)``) on every layer, which
    holds ``stream_sinks + stream_window`` tokens at any length (allocated up front)."""

    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    sliding_window: int | None = None
    sliding_layers: int = 0
    dtype: str | None = None
    value_dim: int | None = None
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    stream_sinks: int | None = None
    stream_window: int | None = None

    @property
    def streaming(self) -> bool:
        """Whether every layer holds a StreamingLLM cache (``stream_window`` set)."""
        return self.stream_window is not None

    @property
    def latent(self) -> bool:
        """Whether the cache holds MLA latents (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    def bytes(self, tokens: int, dtype, batch: int = 1) -> int:
        """Bytes for ``batch`` sequences of ``tokens`` tokens (:func:`latent_cache_bytes` for a
        latent cache, else :func:`kv_cache_bytes` per kind of layer: the sliding ones cache
        ``min(tokens, sliding_window)``)."""
        if self.latent:
            args = (self.layers, self.kv_lora_rank, self.rope_dim, tokens, dtype)
            return latent_cache_bytes(*args, batch=batch)
        return self.mha_bytes(tokens, dtype, batch)

    def mha_bytes(self, tokens: int, dtype, batch: int = 1) -> int:
        """Bytes of the per-head cache of ``kv_heads`` K/V heads (for a latent cache: the cache
        its heads would need without the latent compression)."""
        size = lambda layers, n: kv_cache_bytes(  # noqa: E731
            layers, self.kv_heads, self.head_dim, n, dtype, batch=batch, value_dim=self.value_dim
        )
        if self.streaming:  # sinks + window slots on every layer, whatever the length
            return size(self.layers, (self.stream_sinks or 0) + self.stream_window)
        full = self.layers - self.sliding_layers
        total = size(full, tokens) if full else 0
        if self.sliding_layers:
            total += size(self.sliding_layers, min(tokens, self.sliding_window))
        return total


# transformers spells each quantity differently per family; the first key present wins.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_DECODER_LAYER_KEYS = ("decoder_layers", "num_decoder_layers")  # encoder-decoders: the decoder's
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "num_kv_groups")
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")


def _first(config: Mapping, keys: tuple[str, ...]):
    return next((config[k] for k in keys if config.get(k) is not None), None)


def kv_shape_from_config(config: Mapping) -> KVShape:
    """The KV cache shape of a transformers-style ``config.json`` (as a dict).

    Reads the layer count (the decoder's for encoder-decoders: its self-attention cache; the
    cross-attention cache depends on the encoder's length and is not counted), query and KV heads
    (``multi_query``: one), ``head_dim`` (else ``d_kv``, else the width over the heads), the
    sliding window with the layers it applies to (``layer_types``; Gemma-2's alternation,
    ``sliding_window_pattern``, Qwen2's ``use_sliding_window`` / ``max_window_layers``; else
    every layer, as Mistral) and the checkpoint dtype (``dtype`` / ``torch_dtype``). A
    multimodal config is read through its ``text_config``.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (a parsed config.json), got {type(config)}")
    if _first(config, _LAYER_KEYS + _DECODER_LAYER_KEYS) is None and isinstance(
        config.get("text_config"), Mapping
    ):
        return kv_shape_from_config({**config["text_config"], **_dtype_keys(config)})
    model = config.get("model_type", "?")
    if config.get("kv_lora_rank"):
        return _latent_shape(config, model)
    layers = _first(config, _DECODER_LAYER_KEYS) or _first(config, _LAYER_KEYS)
    heads = _first(config, _HEAD_KEYS)
    for name, value, keys in (("layers", layers, _LAYER_KEYS), ("heads", heads, _HEAD_KEYS)):
        if value is None:
            raise ValueError(f"config ({model}) has none of {', '.join(keys)}: its {name}")
    kv_heads = 1 if config.get("multi_query") else (_first(config, _KV_HEAD_KEYS) or heads)
    head_dim = config.get("head_dim") or config.get("d_kv")
    if head_dim is None:
        width = _first(config, _WIDTH_KEYS)
        if width is None:
            raise ValueError(
                f"config ({model}) has no head_dim and none of {', '.join(_WIDTH_KEYS)} to "
                "divide by the heads"
            )
        head_dim = width // heads
    window, sliding = _sliding(config, layers)
    # DiffLlama: selfattn's layer attends once with the paired values of width 2·head_dim
    # (nn.DiffAttention), so its caches hold V twice as wide as K: 1.5x transformers' cache.
    value_dim = 2 * head_dim if model == "diffllama" else None
    return KVShape(
        layers=_count(layers, "layers"),
        kv_heads=_count(kv_heads, "kv_heads"),
        head_dim=_count(head_dim, "head_dim"),
        heads=_count(heads, "heads"),
        sliding_window=window,
        sliding_layers=sliding,
        dtype=_checkpoint_dtype(config),
        value_dim=value_dim,
    )


def _latent_shape(config: Mapping, model: str) -> KVShape:
    """Multi-head latent attention (DeepSeek-V2/V3): one latent of ``kv_lora_rank`` plus the
    shared rope key of ``qk_rope_head_dim`` per token and layer; the equivalent per-head cache
    has K of ``qk_nope_head_dim + qk_rope_head_dim`` and V of ``v_head_dim`` per KV head."""
    missing = [
        k for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim") if config.get(k) is None
    ]
    if missing:
        raise ValueError(
            f"config ({model}) has kv_lora_rank={config['kv_lora_rank']} (multi-head latent "
            f"attention) but no {', '.join(missing)}: the latent cache needs them"
        )
    layers, heads = _first(config, _LAYER_KEYS), _first(config, _HEAD_KEYS)
    for name, value, keys in (("layers", layers, _LAYER_KEYS), ("heads", heads, _HEAD_KEYS)):
        if value is None:
            raise ValueError(f"config ({model}) has none of {', '.join(keys)}: its {name}")
    rope = _count(config["qk_rope_head_dim"], "qk_rope_head_dim")
    return KVShape(
        layers=_count(layers, "layers"),
        kv_heads=_count(_first(config, _KV_HEAD_KEYS) or heads, "kv_heads"),
        head_dim=_count(config["qk_nope_head_dim"], "qk_nope_head_dim") + rope,
        heads=_count(heads, "heads"),
        dtype=_checkpoint_dtype(config),
        value_dim=_count(config["v_head_dim"], "v_head_dim"),
        kv_lora_rank=_count(config["kv_lora_rank"], "kv_lora_rank"),
        rope_dim=rope,
    )


def _dtype_keys(config: Mapping) -> dict:
    return {k: config[k] for k in ("dtype", "torch_dtype") if config.get(k) is not None}


def _sliding(config: Mapping, layers: int) -> tuple[int | None, int]:
    """``(sliding_window, how many layers use it)``, ``(None, 0)`` without a window."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None, 0
    window = _count(window, "sliding_window")
    types = config.get("layer_types")
    if types is not None:
        return window, sum(t == "sliding_attention" for t in types)
    if config.get("model_type") == "qwen2":  # windowed from layer max_window_layers on
        return window, max(0, layers - config.get("max_window_layers", layers))
    pattern = config.get("sliding_window_pattern")
    if pattern is None and config.get("model_type") == "gemma2":
        pattern = 2  # sliding, global, sliding, ...
    if pattern:
        return window, sum((i + 1) % pattern != 0 for i in range(layers))
    return window, layers  # Mistral: every layer


def _checkpoint_dtype(config: Mapping) -> str | None:
    value = _dtype_keys(config)
    try:
        return dtype_name(next(iter(value.values()))) if value else None
    except (TypeError, ValueError):  # a dtype the cache table does not list: the caller picks
        return None
