"""``triton``: paged attention through the Triton kernel
(``torch.ops.selfattn.paged_decode_triton``, :mod:`selfattn.kernels.triton.paged`), on CUDA; on
CPU in Triton's interpreter only."""

from __future__ import annotations

import logging
import os

import torch

from selfattn._log import log_once
from selfattn.backends.base import BASE_FIELDS, Backend, Cost, register
from selfattn.backends.paged import kernel_reject
from selfattn.backends.paged._intervals import key_intervals
from selfattn.backends.paged.call import QUANT_DTYPES, PagedCall
from selfattn.kernels import ops
from selfattn.kernels import triton as triton_kernels

__all__ = ["plan", "run"]


def plan(q, k_pages, v_pages, block_table, seq_lens, call: PagedCall):
    """``(lo, hi)``: each row's key interval ``(B, Sq)``, the same for every layer of a step."""
    return key_intervals(call.mask, seq_lens.to(torch.long), q.shape[2])


def run(q, k_pages, v_pages, block_table, seq_lens, call: PagedCall):
    """``(out in q.dtype, lse float32)``."""
    lo, hi = call.planned or plan(q, k_pages, v_pages, block_table, seq_lens, call)  # (B, Sq)
    args = (q.contiguous(), k_pages, v_pages, block_table, lo, hi, call.scale, call.k_scales,
            call.v_scales, None, call.sinks, call.holes)  # fmt: skip
    if torch.compiler.is_compiling():  # the op: traced through its fake, run by the graph
        return ops.paged_decode_triton(*args)
    # The op's implementation itself, as the cpu backend does (the dispatcher's cost per call).
    from selfattn.kernels.triton import paged  # imports Triton (seconds, once)

    return paged.paged_attention_triton(*args, scores=call.key_scores)


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
        why = "Triton is not installed (pip install 'selfattn[triton]')"
        if q.device.type == "cuda":  # the kernel this device would run: say it once
            log_once(
                "paged triton missing",
                logging.WARNING,
                "selfattn paged_attention on CUDA: %s; the PyTorch path runs instead",
                why,
            )
        return why
    return None


# Per pair against the C kernel's 1. On CUDA: in place, key splits over the pages. On CPU it
# runs only in Triton's interpreter (TRITON_INTERPRET=1): far slower than plain PyTorch, unless
# SELFATTN_PAGED_TRITON=1 asks for it (how the tests check the kernel without a GPU).
_FAST = Cost(0.5, "the Triton kernel reads the pages in place (flash-decoding)")
_INTERPRETED = Cost(
    100.0,
    "on CPU only in Triton's interpreter (slow; for tests): SELFATTN_PAGED_TRITON=1 prefers it",
)


def _cost(q, *args) -> Cost:
    fast = q.device.type == "cuda" or os.environ.get("SELFATTN_PAGED_TRITON") == "1"
    return _FAST if fast else _INTERPRETED


register(
    Backend(
        "triton",
        run,
        _reject,
        cost=_cost,
        doc="Triton kernel: pages read in place, flash-decoding key splits (CUDA)",
        kind="paged",
        plan=plan,
        supports=BASE_FIELDS["paged"] | {"sinks", "holes"},
    )
)
