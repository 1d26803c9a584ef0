"""``triton``: our dense Triton kernels, forward and backward, over the mask's tile lists.

The mask and the score mod reach the kernel as data (:mod:`selfattn.kernels.triton.attention`):

- the tile lists, from ``mask.tile_kinds`` at the kernel's block sizes (reduced over batch and
  heads: a tile is skipped only if EMPTY for all, mask-free only if FULL for all);
- each query row's key interval ``lo <= j < hi`` from ``mask.key_interval`` and, for packed
  documents, their ids (``mask.kernel_form()``): causal with any ``q_offset``, sliding window,
  chunked, padding, prefix-LM, documents and their ``&``;
- ALiBi slopes, an additive bias view and a soft cap (``score_mod.kernel_terms()``).

A mask or score mod with no such form (a callable, a bool tensor, ``|``/``~``, a learnable bias,
T5's bucketed table) is declined with the reason; FlexAttention compiles those. It runs on CUDA,
and on CPU tensors in Triton's interpreter when ``TRITON_INTERPRET=1`` (tests; ``auto`` never
picks it there). ``torch.use_deterministic_algorithms(True)`` makes the backward deterministic
(dQ in its own pass, no atomics). Inputs with NaN/Inf are redone on chunked's exact path
(``exact.fused_or_exact``), as sdpa's and flex's are.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from selfattn._log import log_once
from selfattn.backends._common import (
    GOLDEN,
    M32,
    cap_before_alibi,
    fmix32,
    grad_needed,
    learned_bias,
    run_with_sinks,
    score_terms,
)
from selfattn.backends.base import BASE_FIELDS, Backend, BackendCompileError, Cost, register
from selfattn.backends.exact import fused_or_exact
from selfattn.call import AttentionCall
from selfattn.kernels import ops
from selfattn.kernels import triton as triton_kernels
from selfattn.masks.tiles import FULL, PARTIAL, TileGrid, classify

__all__ = ["COSTS", "cost", "plan", "reject", "run"]

_INT32_MAX = (1 << 31) - 1  # the kernels index with int32
MAX_HEAD_DIM = 256  # q·k and the output accumulator of one tile must fit in registers
# Kernel variants that failed to build in this process (a Triton compile error, too little
# shared memory on this GPU): {variant: why}; reject declines them, so auto runs the next backend.
_FAILED: dict = {}


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _seed_word(seed: int) -> int:
    """``dropout_keep``'s state after hashing the seed (its first line), as a signed int32 with
    the same bits: the kernel goes on with b, h, positions (:mod:`~selfattn.backends._common`).
    Python ints (``fmix32`` takes them too): no tensor, no device work."""
    x = fmix32((seed & M32) ^ (((seed >> 32) * GOLDEN) & M32))
    return x - (1 << 32) if x >= 1 << 31 else x


def _form(q, k, call: AttentionCall):
    """``(interval mask or None, ids or None, terms)`` or the reason the kernel cannot run it."""
    interval, ids = None, None
    if call.mask is not None:
        form = call.mask.kernel_form()
        if form is None:
            return (
                f"mask {call.mask!r} is not one key interval per row (and document ids): the "
                "Triton kernel evaluates causal, sliding_window, chunked, padding, prefix_lm, "
                "documents and their '&'; flex compiles the others"
            )
        interval, ids = form
    terms = score_terms(q, k, call)
    if isinstance(terms, str):
        return terms + ": flex compiles it"
    return interval, ids, terms


def reject(q, k, v, call: AttentionCall) -> str | None:
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _interpreter()):
        return (
            f"tensors on {q.device}: the Triton kernels run on CUDA (or, for tests, on CPU in "
            "Triton's interpreter: TRITON_INTERPRET=1 before triton is imported)"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{q.dtype} inputs: the Triton kernels take float16, bfloat16 or float32"
    if not (k.dtype == v.dtype == q.dtype):
        return f"q {q.dtype}, k {k.dtype}, v {v.dtype}: the Triton kernels take one dtype"
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    sizes = (q.numel(), k.numel(), v.numel(), B * Hq * Sq * max(D, v.shape[3]))
    if max(Sk, abs(call.q_offset) + Sq, *sizes) > _INT32_MAX:
        return (
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, q_offset "
            f"{call.q_offset}: positions or elements beyond int32, which the Triton kernels "
            "index with; split the batch"
        )
    if max(D, v.shape[3]) > MAX_HEAD_DIM:
        return (
            f"head dims D={D}, Dv={v.shape[3]} above {MAX_HEAD_DIM}: too large for the kernels' "
            "tiles"
        )
    form = _form(q, k, call)
    if isinstance(form, str):
        return form
    _, ids, terms = form
    failed = _FAILED.get(_variant(q, k, v, call, ids, terms))
    if failed is not None:
        return f"the Triton kernel failed to build for this case earlier in this process ({failed})"
    if ids is not None and ids.shape[0] not in (1, B):
        return f"document ids of batch {ids.shape[0]} for B={B}"
    if cap_before_alibi(terms):
        return "the soft cap comes before ALiBi (flash-attn's order): the Triton kernel caps last"
    if any(name == "alibi" and value.dim() != 1 for name, value in terms):
        return "ALiBi slopes per sequence (B, Hq): the Triton kernel takes one slope per head"
    if learned_bias(terms):
        return "the bias requires grad: the Triton backward does not route it (chunked and flex do)"
    if not triton_kernels.available():
        why = "Triton is not installed (pip install 'selfattn[triton]')"
        if q.device.type == "cuda":
            log_once("dense triton missing", logging.WARNING, "selfattn attention on CUDA: %s", why)
        return why
    return None


def _kinds(call: AttentionCall, B, Hq, Sq, Sk, bm: int, bn: int, device) -> torch.Tensor:
    """Tile kinds ``(n_q, n_k)`` int8 at ``bm × bn`` reduced over batch and heads; the ragged last
    key block is never FULL (its columns past ``Sk`` need masking)."""
    n_q, n_k = math.ceil(Sq / bm), math.ceil(Sk / bn)
    key = ("triton-kinds", B, Hq, Sq, Sk, bm, bn)
    if key in call.tile_kinds_cache:
        return call.tile_kinds_cache[key]
    if call.mask is None:
        kinds = torch.full((n_q, n_k), int(FULL), dtype=torch.int8, device=device)
    else:
        grid = TileGrid(Sq, Sk, bm, bn, q_offset=call.q_offset, device=device)
        k4 = classify(call.mask, grid, B, Hq).to(device)  # (B', H', n_q, n_k)
        nonempty = k4.amax(dim=(0, 1)) > 0
        full = k4.amin(dim=(0, 1)) == int(FULL)
        kinds = nonempty.to(torch.int8) + full.to(torch.int8)  # EMPTY 0, PARTIAL 1, FULL 2
    if Sk % bn:
        kinds = kinds.clone()
        kinds[:, -1] = kinds[:, -1].clamp(max=int(PARTIAL))
    call.tile_kinds_cache[key] = kinds
    return kinds


def _intervals(interval, B, Sq, Sk, q_offset, device):
    """``lo, hi (B, Sq)`` int32 key bounds per row, clamped to ``[0, Sk]``."""
    if interval is None:
        lo = torch.zeros(1, Sq, dtype=torch.int32, device=device)
        return lo, torch.full((1, Sq), Sk, dtype=torch.int32, device=device)
    b = torch.arange(B, device=device).view(B, 1)
    pos = (torch.arange(Sq, device=device) + q_offset).view(1, Sq)
    lo, hi = interval.key_interval(b, pos)
    lo = torch.as_tensor(lo, device=device).expand(B, Sq).clamp(0, Sk).to(torch.int32)
    hi = torch.as_tensor(hi, device=device).expand(B, Sq).clamp(0, Sk).to(torch.int32)
    return lo.contiguous(), hi.contiguous()


def plan(q, k, v, call: AttentionCall) -> tuple:
    """The arguments of ``torch.ops.selfattn.attention_triton_fwd`` for this call: the tile
    lists, key intervals, ids, score-mod data and constants (what :func:`run` launches; the GPU
    benchmark times the kernel alone with it)."""
    from selfattn.kernels.triton.attention import blocks, gqa_pack, tile_lists

    B, Hq, Sq, D = q.shape
    Sk, Dv = k.shape[2], v.shape[3]
    q, k, v = (t if t.stride(3) == 1 else t.contiguous() for t in (q, k, v))
    interval, ids, terms = _form(q, k, call)
    lo, hi = _intervals(interval, B, Sq, Sk, call.q_offset, q.device)
    if ids is not None:
        ids = ids.to(device=q.device, dtype=torch.int32).contiguous()
    bias = slopes = None
    softcap = 0.0
    for name, value in terms:
        if name == "alibi":
            slopes = value.to(device=q.device, dtype=torch.float32).contiguous()
        elif name == "bias":
            bias = value.to(q.device)
        else:
            softcap = float(value)
    fwd = blocks("fwd", max(D, Dv))
    pack = gqa_pack(Hq // k.shape[1], fwd.m)  # query heads per forward tile
    kv_order, kv_counts = tile_lists(_kinds(call, B, Hq, Sq, Sk, fwd.m // pack, fwd.n, q.device))
    bwd = blocks("bwd", max(D, Dv))
    if grad_needed(q, k, v, call):
        kinds = _kinds(call, B, Hq, Sq, Sk, bwd.m, bwd.n, q.device)
        b_kv, b_kv_counts = tile_lists(kinds)
        b_q, b_q_counts = tile_lists(kinds.T)
    else:
        b_kv = b_kv_counts = b_q = b_q_counts = kv_order.new_empty(0, 2)
    return (
        q, k, v, kv_order, kv_counts, b_kv, b_kv_counts, b_q, b_q_counts, lo, hi, ids, bias,
        slopes, call.scale, softcap, call.dropout_p, _seed_word(call.dropout_seed),
        call.q_offset, [fwd.m, fwd.n, bwd.m, bwd.n], torch.are_deterministic_algorithms_enabled(),
    )  # fmt: skip


def _variant(q, k, v, call: AttentionCall, ids, terms) -> tuple:
    """What the kernels are specialised on for this call (the key of ``_FAILED``)."""
    names = tuple(sorted(name for name, _ in terms))
    return (q.device.type, q.dtype, q.shape[3], v.shape[3], q.shape[1] // k.shape[1],
            ids is not None, names, call.dropout_p > 0)  # fmt: skip


def _attend(q, k, v, call: AttentionCall):
    args = plan(q, k, v, call)
    try:
        out, lse = ops.attention_triton_fwd(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a kernel that does not build here: auto falls back (logged once)
        if torch.compiler.is_compiling():
            raise
        _, ids, terms = _form(q, k, call)
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        _FAILED[_variant(q, k, v, call, ids, terms)] = why
        raise BackendCompileError(
            f"the triton backend failed on q {tuple(q.shape)}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)} ({q.dtype}, {q.device}) with mask={call.mask!r}, score_mod="
            f"{call.score_mod!r}: {why}. Use backend='flex' or 'chunked' (or 'auto')"
        ) from e
    return out, (lse if call.return_lse else None)


def run(q, k, v, call: AttentionCall):
    """``(out, lse or None)``; see the module docstring."""
    if call.sinks is not None:  # merged after the kernel, from its lse (_common.merge_sinks)
        return run_with_sinks(run, q, k, v, call)
    return fused_or_exact(
        q, k, v, call, lambda: _attend(q, k, v, call), lambda: None, backend="triton"
    )


# -- cost (per pair against sdpa's 1: backends/_auto.py) ----------------------------------------

# Per pair against SDPA's fused kernel on the same GPU, sparse: the kernel skips EMPTY tiles.
# Set before any GPU measurement (from the targets: at least SDPA's causal speed, at
# most hand-compiled FlexAttention's time on masks, which flex's dynamic-shape compile misses by
# 1.2-1.45x); `python -m selfattn.benchmarks.gpu --part triton` measures them: replace each by
# its measured ratio.
COSTS = {
    # no mask, or a causal SDPA runs as a flag: SDPA's flash kernel stays first
    "plain": Cost(1.1, "no mask work to skip: SDPA's flash kernel is as fast", sparse=True),
    "mask": Cost(0.45, "mask as data: skips empty tiles, no compile per mask", sparse=True),
    "score_mod": Cost(1.2, "alibi/bias/softcap in the kernel, tiles skipped", sparse=True),
    # on CPU only in Triton's interpreter (tests): never auto's choice
    "interpreted": Cost(1e4, "on CPU only in Triton's interpreter (slow; for tests)"),
}


def cost(q, k, v, call: AttentionCall) -> Cost:
    if q.device.type != "cuda":
        return COSTS["interpreted"]
    if call.score_mod is not None:
        return COSTS["score_mod"]
    if call.mask is None or call.mask.is_causal:
        return COSTS["plain"]
    return COSTS["mask"]


register(
    Backend(
        "triton",
        run,
        reject,
        cost=cost,
        supports=BASE_FIELDS["dense"] | {"sinks"},
        doc=(
            "our Triton kernels: online softmax over the mask's tile lists, masks and score "
            "mods as data (no recompile per window, documents or length); CUDA"
        ),
    )
)
