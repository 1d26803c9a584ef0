"""Paged backends: the implementations of ``paged_attention``, in the one backend registry.

Each is ``run(q, k_pages, v_pages, block_table, seq_lens, call) -> (out, lse)`` with a
``reject(...)`` predicate of the same arguments (``kind="paged"``), chosen by the same
``select`` / ``explain`` machinery as the dense backends
(:func:`selfattn.backends.explain_paged`):

- ``triton`` (:mod:`.triton`): the Triton kernel ``torch.ops.selfattn.paged_decode_triton``, on
  CUDA: key splits over the pages (flash-decoding), the query heads of a kv head in one tile,
  int8/fp8 dequantised in registers, an fp32 lse merge. Any ``Sq``.
- ``cpu`` (:mod:`.cpu`): the C kernel ``torch.ops.selfattn.paged_decode_cpu``: per
  ``(sequence, key split)`` it walks the pages in table order, scoring, softmax-updating and
  V-summing each page before the next; every page is read in place, once. Decode and
  speculative decode (``Sq <= KERNEL_MAX_SQ``).
- ``torch`` (:mod:`.pytorch`): plain PyTorch over bounded groups of gathered pages; every case.

Both kernels take fp32/bf16/fp16 queries, pages with a contiguous last dim, no ``score_mod``, a mask
that is one key interval per query row (``Mask.is_interval``: None, ``causal``, ``sliding_window``,
``chunked``, ``padding``, ``prefix_lm`` and their ``&``), and nothing autograd must differentiate.
``auto`` picks ``triton`` for CUDA tensors, else ``cpu``, else ``torch`` (each backend's ``cost``
hook): decode is memory-bound, and every plain-PyTorch formulation over a permuted page pool either
copies the pages first or pays a tiny matmul per page. Environment: ``SELFATTN_DECODE_KERNEL=0``
turns the C kernel off; ``SELFATTN_PAGED_TRITON=1`` makes ``auto`` prefer ``triton`` for CPU
tensors too, which runs only in Triton's interpreter (``TRITON_INTERPRET=1``): how the tests check
the kernel without a GPU. All three give the same result within float32 rounding, and NaN/inf in V
at a key a row does not attend never reaches that row.
"""

from __future__ import annotations

import torch

from selfattn.backends._common import needs_grad
from selfattn.backends.paged._intervals import MAX_KEY_INTERVALS, interval_count

__all__ = ["kernel_reject"]

_KERNEL_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_reject(q, k_pages, v_pages, call, unions: bool = False) -> str | None:
    """Why neither paged kernel can run this call, or None: what the C and Triton kernels share.
    ``unions``: the kernel also takes a few disjoint key intervals per row (the C kernel)."""
    if q.dtype not in _KERNEL_QUERY_DTYPES:
        return f"{q.dtype} queries: the kernels compute in float32 (fp32/bf16/fp16 inputs)"
    if call.score_mod is not None:
        return "a score_mod: the kernels take masks only"
    if unions and call.mask is not None and not call.mask.is_interval:
        n = interval_count(call.mask)
        if n is None or n > MAX_KEY_INTERVALS:
            return (
                f"the mask {call.mask!r} is not a union of at most {MAX_KEY_INTERVALS} key "
                "intervals per query row (interval masks, their &, | and ~); the PyTorch path "
                "evaluates it elementwise"
            )
    elif call.mask is not None and not call.mask.is_interval:
        return (
            f"the mask {call.mask!r} is not one key interval per query row (causal, "
            "sliding_window, chunked, padding, prefix_lm and their &); the PyTorch path "
            "evaluates it elementwise"
        )
    if 0 in (*q.shape, v_pages.shape[3]):
        return f"an empty dimension (q {tuple(q.shape)}, v_pages {tuple(v_pages.shape)})"
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        return "pages whose last dim is not contiguous (the kernels read rows with unit stride)"
    sinks = () if call.sinks is None else (call.sinks,)
    if needs_grad((q, k_pages, v_pages, *sinks)):
        return "gradients: the kernels have no backward"
    return None
