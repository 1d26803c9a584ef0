"""The kernels as PyTorch operators (``torch.ops.selfattn.*``), each a ``torch.library`` custom op
with a fake implementation: under ``torch.compile`` the fake gives the outputs' shapes, dtypes and
devices without running anything, so a graph traces through the call and the kernel runs when the
graph does.

=====================================  ==================================  ====================
op                                     kernel                              outputs
=====================================  ==================================  ====================
``selfattn::paged_decode_cpu``         C, ``csrc/paged_decode.c``          ``out`` float32,
                                       (:mod:`selfattn.kernels.paged_     ``lse`` float32, CPU
                                       decode`)
``selfattn::paged_decode_triton``      Triton, :mod:`selfattn.kernels.     ``out`` in q's dtype,
                                       triton.paged` (imported on first    ``lse`` float32, on
                                       call)                               q's device
=====================================  ==================================  ====================

Both take ``q (B, Hq, Sq, D)``, pages ``(N, P, Hkv, D|Dv)``, ``block_table (B, max_pages)``,
``lo, hi (B, Sq)`` (row ``i`` of sequence ``b`` attends keys ``lo <= t < hi``), the softmax
scale and the dequantisation scales of int8/fp8 pages (None for float pages), learned
attention-sink logits ``sinks (Hq,)`` (None: none; the Triton op after ``num_splits``), and return
``out (B, Hq, Sq, Dv)`` and ``lse (B, Hq, Sq)``. Neither has an autograd formula: they are
decode kernels, and the paged backends send calls that need gradients to PyTorch.
"""

# No ``from __future__ import annotations``: custom_op reads the signature's annotations as types.

import torch

from selfattn.kernels import paged_decode

__all__ = ["paged_decode_cpu", "paged_decode_triton"]


@torch.library.custom_op("selfattn::paged_decode_cpu", mutates_args=(), device_types="cpu")
def paged_decode_cpu(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return paged_decode.decode(
        q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, sinks
    )


@paged_decode_cpu.register_fake
def _(q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, sinks=None):
    (B, Hq, Sq, _), Dv = q.shape, v_pages.shape[3]
    out = q.new_empty((B, Hq, Sq, Dv), dtype=torch.float32, device="cpu")
    return out, q.new_empty((B, Hq, Sq), dtype=torch.float32, device="cpu")


@torch.library.custom_op("selfattn::paged_decode_triton", mutates_args=())
def paged_decode_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from selfattn.kernels.triton import paged  # imports Triton (seconds, once)

    return paged.paged_attention_triton(
        q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, num_splits, sinks
    )


@paged_decode_triton.register_fake
def _(
    q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, num_splits=None,
    sinks=None,
):  # fmt: skip
    (B, Hq, Sq, _), Dv = q.shape, v_pages.shape[3]
    out = q.new_empty((B, Hq, Sq, Dv))  # q's dtype and device
    return out, q.new_empty((B, Hq, Sq), dtype=torch.float32)
