"""The kernels as PyTorch operators (``torch.ops.selfattn.*``), each a ``torch.library`` custom op
with a fake implementation: under ``torch.compile`` the fake gives the outputs' shapes, dtypes and
devices without running anything, so a graph traces through the call and the kernel runs when the
graph does.

=====================================  ==================================  ====================
op                                     kernel                              outputs
=====================================  ==================================  ====================
``selfattn::paged_decode_cpu``         C, ``csrc/paged_decode.c``          ``out`` in q's dtype,
                                       (:mod:`selfattn.kernels.paged_     ``lse`` float32, CPU
                                       decode`)
``selfattn::paged_decode_triton``      Triton, :mod:`selfattn.kernels.     ``out`` in q's dtype,
                                       triton.paged` (imported on first    ``lse`` float32, on
                                       call)                               q's device
``selfattn::attention_triton_fwd``     Triton, :mod:`selfattn.kernels.     ``out`` in q's dtype,
                                       triton.attention` (imported on      ``lse`` float32;
                                       first call)                         differentiable
``selfattn::attention_triton_bwd``     the same module                     ``dq, dk, dv``
``selfattn::attention_fwd_cpu``        C, ``csrc/fused_attention.c``       ``out`` in q's dtype,
                                       (:mod:`selfattn.kernels.fused_      ``lse``, ``m``, ``l``
                                       attention`), with an autograd       float32, ``finite``
                                       formula: the op below               bool (), CPU
``selfattn::attention_bwd_cpu``        the same C library                  ``dq, dk, dv`` float32
=====================================  ==================================  ====================

Both take ``q (B, Hq, Sq, D)``, pages ``(N, P, Hkv, D|Dv)``, ``block_table (B, max_pages)``,
``lo, hi (B, Sq)`` (row ``i`` of sequence ``b`` attends keys ``lo <= t < hi``), the softmax
scale and the dequantisation scales of int8/fp8 pages (None for float pages), learned
attention-sink logits ``sinks (Hq,)`` (None: none; the Triton op after ``num_splits``), then
``holes (B, Hkv, 2)``, each kv head's skipped keys (:func:`~selfattn.kernels.paged_decode.
decode`), and return
``out (B, Hq, Sq, Dv)`` and ``lse (B, Hq, Sq)``. Neither has an autograd formula: they are
decode kernels, and the paged backends send calls that need gradients to PyTorch.

The dense pair (``backend="triton"``) takes the mask and score mod as data (tile lists, key
intervals, document ids, ALiBi slopes, a bias view, a soft cap; see
:mod:`selfattn.kernels.triton.attention`); the forward's autograd formula is the backward op,
so a compiled graph differentiates through both.
"""

# No ``from __future__ import annotations``: custom_op reads the signature's annotations as types.

import torch

from selfattn.kernels import fused_attention, paged_decode

__all__ = [
    "attention_bwd_cpu",
    "attention_fwd_cpu",
    "attention_triton_bwd",
    "attention_triton_fwd",
    "paged_decode_cpu",
    "paged_decode_triton",
]


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
    holes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return paged_decode.decode(
        q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, sinks, holes=holes
    )


@paged_decode_cpu.register_fake
def _(q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, sinks=None,
      holes=None):  # fmt: skip
    (B, Hq, Sq, _), Dv = q.shape, v_pages.shape[3]
    out = q.new_empty((B, Hq, Sq, Dv), device="cpu")  # q's dtype
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
    holes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from selfattn.kernels.triton import paged  # imports Triton (seconds, once)

    return paged.paged_attention_triton(
        q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, num_splits, sinks,
        holes,
    )  # fmt: skip


@paged_decode_triton.register_fake
def _(
    q, k_pages, v_pages, block_table, lo, hi, scale, k_scales, v_scales, num_splits=None,
    sinks=None, holes=None,
):  # fmt: skip
    (B, Hq, Sq, _), Dv = q.shape, v_pages.shape[3]
    out = q.new_empty((B, Hq, Sq, Dv))  # q's dtype and device
    return out, q.new_empty((B, Hq, Sq), dtype=torch.float32)


# -- dense attention (Triton): forward and backward, differentiable through the pair ----------


@torch.library.custom_op("selfattn::attention_triton_fwd", mutates_args=())
def attention_triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_order: torch.Tensor,
    kv_counts: torch.Tensor,
    bwd_kv_order: torch.Tensor,
    bwd_kv_counts: torch.Tensor,
    bwd_q_order: torch.Tensor,
    bwd_q_counts: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    ids: torch.Tensor | None,
    bias: torch.Tensor | None,
    slopes: torch.Tensor | None,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: int,
    q_offset: int,
    blocks: list[int],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``blocks = [fwd block_m, fwd block_n, bwd block_m, bwd block_n]`` of the
    tile lists (the ``bwd_*`` ones are read by the backward only; empty when no gradient is
    needed); see :func:`selfattn.kernels.triton.attention.attention_triton_fwd`."""
    from selfattn.kernels.triton import attention  # imports Triton (seconds, once)

    return attention.attention_triton_fwd(
        q, k, v, kv_order, kv_counts, lo, hi, ids, bias, slopes, scale, softcap, dropout_p,
        seed, q_offset, blocks[0], blocks[1],
    )  # fmt: skip


@attention_triton_fwd.register_fake
def _(q, k, v, *rest):
    (B, Hq, Sq, _), Dv = q.shape, v.shape[3]
    return q.new_empty((B, Hq, Sq, Dv)), q.new_empty((B, Hq, Sq), dtype=torch.float32)


@torch.library.custom_op("selfattn::attention_triton_bwd", mutates_args=())
def attention_triton_bwd(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_order: torch.Tensor,
    kv_counts: torch.Tensor,
    q_order: torch.Tensor,
    q_counts: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    ids: torch.Tensor | None,
    bias: torch.Tensor | None,
    slopes: torch.Tensor | None,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: int,
    q_offset: int,
    block_m: int,
    block_n: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: :func:`selfattn.kernels.triton.attention.attention_triton_bwd`."""
    from selfattn.kernels.triton import attention

    return attention.attention_triton_bwd(
        dout, dlse, q, k, v, out, lse, kv_order, kv_counts, q_order, q_counts, lo, hi, ids,
        bias, slopes, scale, softcap, dropout_p, seed, q_offset, block_m, block_n, deterministic,
    )  # fmt: skip


@attention_triton_bwd.register_fake
def _(dout, dlse, q, k, v, *rest):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    )


def _attention_setup(ctx, inputs, output):
    (q, k, v, _, _, bwd_kv_order, bwd_kv_counts, bwd_q_order, bwd_q_counts, lo,
     hi, ids, bias, slopes, scale, softcap, dropout_p, seed, q_offset, blocks,
     deterministic) = inputs  # fmt: skip
    out, lse = output
    ctx.save_for_backward(
        q, k, v, out, lse, bwd_kv_order, bwd_kv_counts, bwd_q_order, bwd_q_counts, lo, hi, ids,
        bias, slopes,
    )  # fmt: skip
    ctx.consts = (scale, softcap, dropout_p, seed, q_offset, blocks[2], blocks[3], deterministic)


def _attention_backward(ctx, dout, dlse):
    (q, k, v, out, lse, kv_order, kv_counts, q_order, q_counts, lo, hi, ids, bias,
     slopes) = ctx.saved_tensors  # fmt: skip
    dq, dk, dv = attention_triton_bwd(
        dout, dlse, q, k, v, out, lse, kv_order, kv_counts, q_order, q_counts, lo, hi, ids,
        bias, slopes, *ctx.consts,
    )  # fmt: skip
    return (dq, dk, dv) + (None,) * 18


attention_triton_fwd.register_autograd(_attention_backward, setup_context=_attention_setup)


# -- the fused dense attention kernel (dense masks by tiles; see kernels/fused_attention.py) ------
# The tile description tensors come one by one, in Tiles.tensors() order (a tensor list would
# break register_autograd in torch 2.13). ``generic``: run the baseline-ISA build.


@torch.library.custom_op("selfattn::attention_fwd_cpu", mutates_args=(), device_types="cpu")
def attention_fwd_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rowptr: torch.Tensor,
    cols: torch.Tensor,
    pids: torch.Tensor,
    colptr: torch.Tensor,
    rows: torch.Tensor,
    cpids: torch.Tensor,
    bits: torch.Tensor,
    block_q: int,
    mask_b: int,
    mask_h: int,
    scale: float,
    generic: bool = False,
    q_offset: int = 0,
    alibi: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed0: int = 0,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, m, l, finite)``: :func:`fused_attention.forward`'s four and its ``finite``
    (bool, shape ``()``): whether every element of q and out is finite, which the kernel tells
    on data it holds anyway (the backend trusts the result by it: ``exact.fused_or_exact``)."""
    tiles = (rowptr, cols, pids, colptr, rows, cpids, bits)
    t = fused_attention.Tiles(block_q, *tiles, mask_b=mask_b, mask_h=mask_h)
    finite = torch.empty((), dtype=torch.bool)
    out = fused_attention.forward(
        q, k, v, t, scale, generic, q_offset, alibi, dropout_p, seed0, bias, softcap, finite
    )
    return *out, finite


@attention_fwd_cpu.register_fake
def _(q, k, v, *tiles_and_args):
    (B, Hq, Sq, _), Dv = q.shape, v.shape[3]
    out = q.new_empty((B, Hq, Sq, Dv))  # q's dtype
    stats = (q.new_empty((B, Hq, Sq), dtype=torch.float32) for _ in range(3))
    return out, *stats, q.new_empty((), dtype=torch.bool)


@torch.library.custom_op("selfattn::attention_bwd_cpu", mutates_args=(), device_types="cpu")
def attention_bwd_cpu(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    rowptr: torch.Tensor,
    cols: torch.Tensor,
    pids: torch.Tensor,
    colptr: torch.Tensor,
    rows: torch.Tensor,
    cpids: torch.Tensor,
    bits: torch.Tensor,
    block_q: int,
    mask_b: int,
    mask_h: int,
    scale: float,
    generic: bool = False,
    q_offset: int = 0,
    alibi: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed0: int = 0,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    bias_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dbias)`` float32; ``dbias`` has the bias's shape with ``bias_grad``, else
    it is empty (an op returns no None)."""
    tiles = (rowptr, cols, pids, colptr, rows, cpids, bits)
    t = fused_attention.Tiles(block_q, *tiles, mask_b=mask_b, mask_h=mask_h)
    *grads, dbias = fused_attention.backward(
        dout, dlse, q, k, v, out, m, l, t, scale, generic, q_offset, alibi, dropout_p, seed0,
        bias, softcap, bias_grad,
    )  # fmt: skip
    return *grads, (q.new_empty(0, dtype=torch.float32) if dbias is None else dbias)


@attention_bwd_cpu.register_fake
def _(dout, dlse, q, k, v, out, m, l, rowptr, cols, pids, colptr, rows, cpids, bits, block_q,
      mask_b, mask_h, scale, generic=False, q_offset=0, alibi=None, dropout_p=0.0, seed0=0,
      bias=None, softcap=0.0, bias_grad=False):  # fmt: skip
    dbias = q.new_empty(bias.shape if bias_grad else (0,), dtype=torch.float32)
    return *(t.new_empty(t.shape, dtype=torch.float32) for t in (q, k, v)), dbias


_BIAS_ARG = 19  # attention_fwd_cpu's argument index of the bias


def _fwd_setup(ctx, inputs, output):
    out, _, m, l, _ = output
    ctx.save_for_backward(*inputs[:3], out, m, l, *inputs[3:10])  # q, k, v, ..., the tiles
    # block_q, mask_b, mask_h, scale, generic, q_offset, alibi, dropout, bias, cap
    ctx.args = inputs[10:]
    bias = inputs[_BIAS_ARG]
    ctx.bias_dtype = None if bias is None else bias.dtype


def _fwd_backward(ctx, dout, dlse, _dm, _dl, _dfinite):
    """dQ, dK, dV (and dBias where the bias needs it) from the saved output and row statistics;
    dlse: the lse's own gradient (e.g. from attention sinks merged through it)."""
    q, k, v, out, m, l, *tiles = ctx.saved_tensors
    out = out.to(torch.float32)  # q's dtype: Δ = rowsum(dO ∘ O) from it, as sdpa's backward
    dout = torch.zeros_like(out) if dout is None else dout.to(torch.float32).contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    bias_grad = ctx.bias_dtype is not None and ctx.needs_input_grad[_BIAS_ARG]
    dq, dk, dv, dbias = attention_bwd_cpu(
        dout, dlse, q, k, v, out, m, l, *tiles, *ctx.args, bias_grad=bias_grad
    )
    grads = [None] * (len(tiles) + len(ctx.args))
    if bias_grad:
        grads[_BIAS_ARG - 3] = dbias.to(ctx.bias_dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *grads


torch.library.register_autograd(
    "selfattn::attention_fwd_cpu", _fwd_backward, setup_context=_fwd_setup
)
