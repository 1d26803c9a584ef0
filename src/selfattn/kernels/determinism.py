"""Deterministic mode: every token's result the same whatever else runs in its call.

Batched inference rounds a request differently alone and in a batch when a reduction's split
depends on the batch ("Defeating Nondeterminism in LLM Inference", He et al., Thinking
Machines, 2025; vLLM's batch-invariant mode). Inside :func:`deterministic` the kernels here
reduce each row the same way whatever the other rows, the batch size and the thread count:

- the C paged-decode kernel cuts a sequence's keys into splits of :data:`SPLIT_KEYS` keys
  (:func:`split_pages`), not into as many splits as the threads and the batch size pay for;
  its work items (row, split) run on any thread, and the splits merge in split order;
- ``F.linear`` runs :func:`invariant_linear`: a C kernel whose every output sums in one order
  fixed by the width (``csrc/rows_linear.c``), or, without it, torch's matmul over tiles of
  :data:`ROW_TILE` rows, one call a tile (the last zero-padded): which rows an ``M``-row
  product rounds alike depends on the CPU (MKL 2024.2 on AVX-512 without AMX: ``M`` a
  multiple of 4, but ``M = 1`` runs a GEMV and ``M = 2, 3`` another kernel, and on two
  threads the last rows of ``M = 5..7, 9..11`` differ; with AMX, rows of 4- and 5-row products
  differ, and at SmolLM2's widths fp32 rows differ from ``M = 9`` on, bf16 from ``M = 33``),
  while every row of an 8-row product rounds alike on both, at any position, 1 or 2 threads
  (``benchmarks/determinism.py`` checks a machine);
- SiLU and GELU see every row at the same vector lanes (:func:`invariant_rowwise`);
- the quantised matmul runs its C kernel for every row count (``nn/quant.py``), never the
  dequantising matmul it takes past ``KERNEL_ROWS`` rows;
- a packed paged step attends every chunk's tokens as rows (``cache/paged/plan.py``), each over
  its own keys, never a long chunk as one query block: so chunk boundaries, preemption's
  recompute and prefix-cache hits cannot change a token's attention.

The mode is a context variable (per thread and per asyncio task): an engine or ``generate``
enters it around its own steps; nothing global changes, and other engines in the process keep
their own mode.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from selfattn.kernels import rows_linear

__all__ = [
    "ROW_TILE", "SPLIT_KEYS", "deterministic", "invariant_linear", "invariant_rowwise",
    "is_deterministic", "split_pages",
]  # fmt: skip

# Keys per split of the paged-decode kernel in deterministic mode: a split count that grows with
# the sequence only (flash-decoding's split over the keys, of a fixed size).
SPLIT_KEYS = 256
# Without the rows kernel a deterministic linear hands torch's matmul tiles of this many rows,
# one call each: a product whose every row MKL's GEMM rounds alike on the CPUs measured (module
# docstring); padding adds at most 7 zero rows.
ROW_TILE = 8

_MODE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "selfattn_deterministic", default=False
)


def is_deterministic() -> bool:
    """Whether the calling thread (or task) runs inside :func:`deterministic`."""
    return _MODE.get()


def split_pages(page_size: int) -> int:
    """Pages of ``page_size`` tokens per key split in deterministic mode (at least one)."""
    return max(1, SPLIT_KEYS // page_size)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every row of ``x (..., K)`` rounded as it is in any
    other batch: the C kernel of :mod:`~selfattn.kernels.rows_linear` (float32 or bfloat16 CPU
    tensors of one dtype, no autograd: at a GEMV's speed on one row), else torch's matmul on
    tiles of :data:`ROW_TILE` rows, one call a tile, the last padded with zeros. Which of the
    two runs depends on the machine and the tensors' kind, never on the row count."""
    if _rows_kernel_takes(x, weight, bias):
        return rows_linear.linear(x, weight, bias)
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if M == 0:
        return F.linear(x, weight, bias)
    rows = x.reshape(M, x.shape[-1])  # (..., K) -> (M, K)
    pad = -M % ROW_TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])  # (M + pad, K)
    out = torch.cat([F.linear(t, weight, bias) for t in rows.split(ROW_TILE)])
    return out[:M].reshape(*x.shape[:-1], weight.shape[0])


def _rows_kernel_takes(x, weight, bias) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        x.dtype in (torch.float32, torch.bfloat16)
        and all(t.device.type == "cpu" and t.dtype == x.dtype for t in tensors)
        and weight.dim() == 2
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and rows_linear.library() is not None
    )


def invariant_rowwise(op, x: torch.Tensor) -> torch.Tensor:
    """``op(x)`` for an elementwise ``op`` (SiLU, GELU) with every row of ``x (..., D)``
    computed as it is in any other batch. torch runs such an op over a contiguous tensor as one
    flat loop: vector lanes from the start, scalar code for the tail (and each thread's chunk
    starts where the split falls), and its vector and scalar ``exp`` round differently, so a
    row's element rounds by where the row sits. Here each row starts at a multiple of
    ``64 x threads`` elements (rows zero-padded to that width): every element then takes the
    same lane, and no row reaches a tail or a thread boundary mid-vector."""
    D = x.shape[-1]
    unit = _LANES * torch.get_num_threads()
    width = -(-D // unit) * unit
    if width == D or x.numel() == 0:
        return op(x.contiguous())
    rows = x.reshape(-1, D)  # (..., D) -> (M, D)
    padded = rows.new_zeros(rows.shape[0], width)  # (M, width)
    padded[:, :D] = rows
    return op(padded)[:, :D].reshape(x.shape)


# Elements of the widest vector loop torch's CPU kernels run (two AVX-512 registers of bf16).
_LANES = 64
# The elementwise ops with transcendental functions that a decoder step runs per token.
_ROWWISE = {F.silu, torch._C._nn.silu, F.gelu, torch._C._nn.gelu}


class _Invariant(TorchFunctionMode):
    """Routes ``F.linear`` through :func:`invariant_linear` and SiLU / GELU through
    :func:`invariant_rowwise` (the mode is off inside its own handler, so the calls it makes
    run plain)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return invariant_linear(*args, **kwargs)
        if func in _ROWWISE and not kwargs.get("inplace") and len(args) == 1:
            return invariant_rowwise(lambda t: func(t, **kwargs), args[0])
        return func(*args, **kwargs)


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Run the block in deterministic mode (module docstring); ``enabled=False``: unchanged,
    so that callers can pass their flag through."""
    if not enabled or _MODE.get():
        yield
        return
    token = _MODE.set(True)
    try:
        with _Invariant():
            yield
    finally:
        _MODE.reset(token)
