"""selfattn.cache: KV caches sharing one contract, and their memory arithmetic.

Every cache has ``update(k, v, positions) -> (k_all, v_all)``, ``length`` and ``reset()``, and
plugs into ``selfattn.nn.MultiHeadAttention(..., cache=)``.
"""

from selfattn.backends.paged.plan import PagedAttentionPlan
from selfattn.cache.kivi import (
    KIVICache,
    dequantize_keys,
    dequantize_values,
    kivi_bytes,
    quantize_keys,
    quantize_values,
)
from selfattn.cache.latent import LatentCache, PagedLatentKV
from selfattn.cache.paged import PagedCache, PagedCacheView, PagedKV
from selfattn.cache.pool import BlockPool
from selfattn.cache.prefix import PrefixHit, PrefixIndex
from selfattn.cache.quant import dequantize, quantize_fp8, quantize_int8, write_quantized
from selfattn.cache.size import format_bytes, kv_cache_bytes, latent_cache_bytes
from selfattn.cache.static import StaticCache
from selfattn.cache.streaming import StreamingCache, StreamingCaches
from selfattn.cache.streaming_paged import StreamingPagedKV
from selfattn.cache.window import SlidingWindowCache
from selfattn.functional import paged_attention

__all__ = [
    "BlockPool",
    "KIVICache",
    "LatentCache",
    "PagedAttentionPlan",
    "PagedCache",
    "PagedCacheView",
    "PagedKV",
    "PagedLatentKV",
    "PrefixHit",
    "PrefixIndex",
    "SlidingWindowCache",
    "StaticCache",
    "StreamingCache",
    "StreamingCaches",
    "StreamingPagedKV",
    "dequantize",
    "dequantize_keys",
    "dequantize_values",
    "format_bytes",
    "kivi_bytes",
    "kv_cache_bytes",
    "latent_cache_bytes",
    "paged_attention",
    "quantize_fp8",
    "quantize_int8",
    "quantize_keys",
    "quantize_values",
    "write_quantized",
]
