"""``triton``: paged attention through the Triton kernel
(``torch.ops.selfattn.paged_decode_triton``, :mod:`selfattn.kernels.triton.paged`), on CUDA; on
CPU in Triton's interpreter only."""

from __future__ import annotations

import os

import torch

from selfattn.backends import Backend, register
from selfattn.backends.paged import kernel_reject
from selfattn.backends.paged._intervals import _key_intervals
from selfattn.backends.paged.call import QUANT_DTYPES, PagedCall
from selfattn.kernels import ops
from selfattn.kernels import triton as triton_kernels

__all__ = ["plan", "run"]


def plan(q, k_pages, v_pages, block_table, seq_lens, call: PagedCall):
    """``(lo, hi)``: each row's key interval ``(B, Sq)``, the same for every layer of a step."""
    return _key_intervals(call.mask, seq_lens.to(torch.long), q.shape[2])


def run(q, k_pages, v_pages, block_table, seq_lens, call: PagedCall):
    """``(out in q.dtype, lse float32)``."""
    lo, hi = call.planned or plan(q, k_pages, v_pages, block_table, seq_lens, call)  # (B, Sq)
    args = (q.contiguous(), k_pages, v_pages, block_table, lo, hi, call.scale, call.k_scales,
            call.v_scales)  # fmt: skip
    if torch.compiler.is_compiling():  # the op: traced through its fake, run by the graph
        return ops.paged_decode_triton(*args)
    # The op's implementation itself, as the cpu backend does (the dispatcher's cost per call).
    from selfattn.kernels.triton import paged  # imports Triton (seconds, once)

    return paged.paged_attention_triton(*args)


def _reject(q, k_pages, v_pages, block_table, seq_lens, call):
    if q.device.type != "cuda" and not (
        q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    ):
        return (
            f"tensors on {q.device}: the Triton kernel runs on CUDA (or, for tests, on CPU in "
            "Triton's interpreter: TRITON_INTERPRET=1 before triton is imported)"
        )
    why = kernel_reject(q, k_pages, v_pages, call)
    if why is not None:
        return why
    if k_pages.dtype not in (q.dtype, *QUANT_DTYPES) or v_pages.dtype != k_pages.dtype:
        return (
            f"k_pages {k_pages.dtype} and v_pages {v_pages.dtype} with {q.dtype} queries: the "
            "Triton kernel reads K and V of one dtype, q's or int8/fp8"
        )
    if not triton_kernels.available():
        return "Triton is not installed (pip install selfattn[triton])"
    return None


register(
    Backend(
        "triton",
        run,
        _reject,
        doc="Triton kernel: pages read in place, flash-decoding key splits (CUDA)",
        kind="paged",
        plan=plan,
    )
)
