"""The batch-invariant linear of deterministic mode (``csrc/rows_linear.c``): ``x @ w.T`` with
every output summed in one order fixed by the input width alone, whatever the rows, their
positions and the threads (the source's header has the order and why torch's matmul is not).

A decode step reads each weight row once, as a GEMV does; rows share each weight block while it
sits in L1. Called through :mod:`ctypes` on the threads of ``csrc/thread_pool.h`` (work items
are blocks of weight rows; which thread runs one changes nothing in it). Its plain-PyTorch
twin is :func:`twin` (the same order, for the tests). No compiler, a failed build or
``SELFATTN_ROWS_KERNEL=0``: :func:`library` returns None.
"""

from __future__ import annotations

import ctypes

import torch

from selfattn.kernels import threads
from selfattn.kernels.build import CLibrary, Function, loader

__all__ = ["ENV_VAR", "LANES", "SPEC", "library", "linear", "twin"]

# rows_linear(x, w, out, M, N, K, wdt, n_threads) -> 0, or 1 when a participant failed
_ARGS = (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3 + (ctypes.c_int,) * 2
_ENTRY = Function("rows_linear", _ARGS)
SPEC = CLibrary(
    name="rows_linear",
    sources=("rows_linear.c",),
    functions=(_ENTRY, *threads.POOL_FUNCTIONS),
    # gnu11 keeps FMA contraction (ISO mode turns it off): the lanes' a += x * w is one FMA
    flags=("-O3", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-ffp-contract=fast"),
    targets=(("-march=native",), ()),
    openmp=True,
)
LANES = 16  # VW of the C source: partial sums over k = 16 j + lane
_WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1}  # W_* of the C source


# The compiled kernel, built on first use; None where it cannot be (or is switched off).
ENV_VAR = "SELFATTN_ROWS_KERNEL"
library = loader(SPEC, ENV_VAR)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x (..., K) @ weight (N, K).T + bias`` in x's dtype: float32 or bfloat16 CPU tensors,
    no autograd (the caller checks). Summed in float32 in the fixed order, then the bias added
    and the sum rounded to x's dtype once."""
    lib = library()
    K, N = x.shape[-1], weight.shape[0]
    x32 = x.reshape(-1, K).to(torch.float32).contiguous()  # (..., K) -> (M, K)
    w = weight.contiguous()
    out = torch.empty(x32.shape[0], N, dtype=torch.float32)
    n = threads.for_bytes(w.numel() * w.element_size(), openmp_threads=threads.openmp(lib))
    status = lib.rows_linear(x32.data_ptr(), w.data_ptr(), out.data_ptr(), x32.shape[0], N, K,
                             _WEIGHT_CODES[w.dtype], n)  # fmt: skip
    if status:
        raise MemoryError("rows_linear: a thread could not allocate its scratch")
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], N)


def twin(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's sum in plain PyTorch, in its order (each product rounded before its add,
    where the kernel fuses them): ``(M, N)`` float32 for ``x (M, K)``."""
    K = x.shape[1]
    K16 = K // LANES * LANES
    x32, w32 = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0], LANES)
    for k in range(0, K16, LANES):  # one FMA per lane and chunk
        acc = torch.addcmul(acc, x32[:, None, k : k + LANES], w32[None, :, k : k + LANES])
    tail = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(K16, K):
        tail = tail + x32[:, None, k] * w32[None, :, k]
    width = LANES // 2
    while width:  # the lanes pairwise
        acc = acc[..., :width] + acc[..., width : 2 * width]
        width //= 2
    return acc[..., 0] + tail
