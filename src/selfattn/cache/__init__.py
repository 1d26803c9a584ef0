"""selfattn.cache: KV caches sharing one contract, and their memory arithmetic.

The contract is :mod:`selfattn.cache.base`: a layer's cache has ``update(k, v, positions) -> KV``
(the keys/values and their absolute positions), ``length`` and ``reset()``, or attends in place
(the paged caches), and plugs into ``selfattn.nn.MultiHeadAttention(..., cache=)``; a model's
cache (``LayerCaches``, ``PagedKV.view``) is planned once per step and hands each layer its own.
"""

from selfattn.cache.decode import paged_attention
from selfattn.cache.paged import PagedCache, PagedCacheView, PagedKV
from selfattn.cache.pool import BlockPool
from selfattn.cache.prefix import PrefixHit, PrefixIndex
from selfattn.cache.quant import dequantize, quantize_fp8, quantize_int8, write_quantized
from selfattn.cache.size import format_bytes, kv_cache_bytes
from selfattn.cache.static import StaticCache
from selfattn.cache.window import SlidingWindowCache

__all__ = [
    "BlockPool",
    "PagedCache",
    "PagedCacheView",
    "PagedKV",
    "PrefixHit",
    "PrefixIndex",
    "SlidingWindowCache",
    "StaticCache",
    "dequantize",
    "format_bytes",
    "kv_cache_bytes",
    "paged_attention",
    "quantize_fp8",
    "quantize_int8",
    "write_quantized",
]
