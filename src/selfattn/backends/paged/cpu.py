"""``cpu``: paged attention through the C kernel (``torch.ops.selfattn.paged_decode_cpu``,
:mod:`selfattn.kernels.paged_decode`), for decode-like calls on CPU."""

from __future__ import annotations

import os

import torch

from selfattn.backends.base import BASE_FIELDS, Backend, Cost, register
from selfattn.backends.paged import kernel_reject
from selfattn.backends.paged._intervals import key_interval_union, key_intervals
from selfattn.backends.paged.call import PagedCall
from selfattn.kernels import ops, paged_decode

__all__ = ["KERNEL_MAX_SQ", "plan", "run"]

# Longest query chunk the C kernel takes. Measured (B=8, 2,048 keys, Hq=32, D=128, causal, one
# thread, CPU time): the kernel costs 0.34x the PyTorch path at Sq=4, 0.56x at 16 and breaks even
# at 64, where the batched GEMMs of the PyTorch path catch up with its per-row loops.
KERNEL_MAX_SQ = 16


def plan(q, k_pages, v_pages, block_table, seq_lens, call: PagedCall):
    """``(lo, hi, splits, launch)``: each row's key interval ``(B, Sq)`` (or disjoint intervals
    ``(B, Sq, NI)`` for a union mask such as StreamingLLM's sinks | window), the kernel's key
    splits and its arguments (:class:`~selfattn.kernels.paged_decode.Launch`; None for
    quantised pages, whose scales differ per layer), the same for every layer of a step."""
    lo, hi = _intervals(call.mask, seq_lens.to(torch.long), q.shape[2])
    splits = paged_decode.key_splits(lo, hi, k_pages.shape[1])
    launch = None
    if call.k_scales is None and call.v_scales is None:
        launch = paged_decode.Launch(q, k_pages, v_pages, block_table, lo, hi, splits)
    return lo, hi, splits, launch


def _intervals(mask, lens, Sq):
    if mask is None or mask.is_interval:
        return key_intervals(mask, lens, Sq)  # (B, Sq) each
    return key_interval_union(mask, lens, Sq)  # (B, Sq, NI) each


def run(q, k_pages, v_pages, block_table, seq_lens, call: PagedCall):
    """``(out in q.dtype, lse float32)``; lse may be None unless ``call.return_lse``."""
    if call.planned is None:
        lo, hi = _intervals(call.mask, seq_lens.to(torch.long), q.shape[2])
        splits = launch = None
    else:
        lo, hi, splits, launch = call.planned
    args = (q, k_pages, v_pages, block_table, lo, hi, call.scale, call.k_scales, call.v_scales,
            call.sinks)  # fmt: skip
    if torch.compiler.is_compiling():  # the op: traced through its fake, run by the graph
        out, lse = ops.paged_decode_cpu(*args, call.holes)
    elif launch is not None and call.k_scales is None and launch.fits(q, k_pages, v_pages):
        # a planned step's layer: only the pointers change (the table, intervals and splits
        # are the plan's, the tensors block_table and seq_lens it was made from)
        out, lse = launch(q, k_pages, v_pages, call.scale, call.sinks, call.return_lse,
                          call.holes, call.key_scores)  # fmt: skip
    else:  # the op's implementation itself: the dispatcher costs ~14 µs a call
        out, lse = paged_decode.decode(*args, splits=splits, holes=call.holes,
                                       scores=call.key_scores)  # fmt: skip
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse  # (B, Hq, Sq, Dv)


def _reject(q, k_pages, v_pages, block_table, seq_lens, call):
    if q.device.type != "cpu":
        return f"tensors on {q.device}: the C kernel runs on CPU"
    why = kernel_reject(q, k_pages, v_pages, call, unions=True)
    if why is not None:
        return why
    if q.shape[2] > KERNEL_MAX_SQ:
        return (
            f"Sq={q.shape[2]} > {KERNEL_MAX_SQ}: a long query chunk is matmul work, where the "
            "PyTorch path's batched GEMMs catch up"
        )
    if os.environ.get("SELFATTN_DECODE_KERNEL", "1") == "0":
        return "SELFATTN_DECODE_KERNEL=0 turns the C kernel off"
    dtypes = paged_decode.supported_dtypes()
    if not dtypes:
        return "the C kernel could not be built here (no C compiler, or the build failed)"
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dtype not in dtypes:
            return f"{name} is {t.dtype}, which this build of the C kernel does not read"
    return None


# The yardstick of the paged costs (1 per pair): every page read in place, once.
_COST = Cost(1.0, "the C kernel reads each page in place, once")


register(
    Backend(
        "cpu",
        run,
        _reject,
        cost=lambda *args: _COST,
        doc="C kernel: each page read in place, once (decode, Sq <= 16, CPU)",
        kind="paged",
        plan=plan,
        supports=BASE_FIELDS["paged"] | {"sinks", "holes"},
    )
)
