"""The cpu_fused backend: the fused C kernel (``torch.ops.selfattn.attention_fwd_cpu`` and its
backward, :mod:`selfattn.kernels.fused_attention`) for dense attention on CPU.

Named for what it is, one fused kernel per call on CPU (chunked runs the same algorithm as
composed ops), and not plain ``cpu``: that is the paged registry's C decode kernel, and
``backend="cpu"`` must not mean two kernels. It walks the same tile classification as
``chunked`` (``chunked.fine_grid``, computed once per call and shared with ``auto``'s density
estimate): EMPTY tiles are skipped, FULL ones get no mask work, and each PARTIAL tile's mask is
evaluated with the mask's own ``mask_mod`` (``chunked.partial_masks``) into a byte block the
kernel reads. That tile description is kept across calls for the same mask object and geometry
(a small LRU, as the flex backend keeps its block masks): built anew, its dozens of small torch
ops cost more than the kernel itself on a loaded 2-thread host (window 32 at S=2048, 8 heads:
128 ms against the kernel's 16 ms, wall time), each parallel op waiting for the other thread.
The kernel reads bf16/fp16 inputs as they are, accumulates in float32 and the output goes back
to q's dtype (bf16 scores by ``vdpbf16ps`` where the CPU has
avx512_bf16). Score mods in the kernel: ALiBi, a bias tensor and a soft cap (applied last). GQA
reads each kv head's K/V in place for its G query heads.

Not run (declined with the reason): non-CPU tensors, float64 (it accumulates in float64, the
kernel in float32), score mods not made of ALiBi, bias and softcap terms (a callable, T5's table:
chunked runs them), calls under ``torch.compile`` (the tile plan reads mask values), and
wherever the kernel cannot be built (no compiler: logged once, chunked runs instead). A bias
that requires grad gets its gradient from the kernel's backward (its dQ pass sums dS over the
bias's broadcast axes in a fixed order). Non-finite inputs are checked and redone exactly
(``exact.fused_or_exact``), as sdpa's are, by the kernel's own verdict on q and the output (it
tests them as it reads and writes them: no pass over either on the host); a call needing
gradients whose K/V hold NaN/Inf goes to chunked's exact path up front (the fused backward
multiplies whole tiles)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import threading
from pathlib import Path

import torch

from selfattn._log import log_once
from selfattn.backends import chunked
from selfattn.backends._common import (
    GOLDEN,
    all_finite,
    cap_before_alibi,
    fmix32,
    grad_needed,
    learned_bias,
    run_with_sinks,
    score_terms,
    setup_per_pair,
)
from selfattn.backends.base import BASE_FIELDS, Backend, Cost, register
from selfattn.backends.exact import fused_or_exact
from selfattn.call import AttentionCall
from selfattn.kernels import build, fused_attention, ops

__all__ = [
    "DECODE_ROWS", "FITS", "FITS_FILE", "LEARNED_BIAS", "UNMEASURED", "Fit", "cost", "fit",
    "read_fits", "run", "tiles",
]  # fmt: skip

assert chunked.BLOCK_K == fused_attention.BLOCK_K  # the kernel walks chunked's fine grid


# Tile descriptions kept across calls. Each entry holds its mask object, so the id in its key
# cannot name another mask while it exists; the key also holds the version counter of every
# tensor in the mask (an in-place change to a documents mask's ids builds anew). Kept only for
# analytic masks (the built-ins and their combinations: a user callable may read state the key
# cannot see), not for row-ordered tensors (a new object per call), per-sequence offsets, or
# descriptions over _KEPT_BITS_MAX bytes of mask blocks.
_KEPT_TILES = 8
_KEPT_BITS_MAX = 16 << 20  # 8 entries keep at most 128 MiB of mask blocks alive
_kept: collections.OrderedDict = collections.OrderedDict()
_kept_lock = threading.Lock()


def tiles(q, k, call: AttentionCall) -> fused_attention.Tiles:
    """The kernel's tile description of this call (cached on the call, and across calls for
    the same mask object and geometry)."""
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    key = ("cpu_fused-tiles", B, Hq, Sq, Sk)
    found = call.tile_kinds_cache.get(key)
    if found is not None:
        return found
    versions = _tensor_versions(call.mask)
    keep = isinstance(call.q_offset, int) and versions is not None
    kept_key = (id(call.mask), versions, B, Hq, Hkv, Sq, Sk, call.q_offset)
    with _kept_lock:
        hit = _kept.get(kept_key) if keep else None
        if hit is not None and hit[0] is call.mask:
            _kept.move_to_end(kept_key)
            call.tile_kinds_cache[key] = hit[1]
            return hit[1]
    found = _build_tiles(q, k, call)
    call.tile_kinds_cache[key] = found
    if keep and found.bits.numel() <= _KEPT_BITS_MAX:
        with _kept_lock:
            _kept[kept_key] = (call.mask, found)
            _kept.move_to_end(kept_key)
            while len(_kept) > _KEPT_TILES:
                _kept.popitem(last=False)
    return found


def _tensor_versions(mask) -> tuple | None:
    """``(id, version)`` of each tensor the mask's parts hold, or None when the mask must not be
    kept: not analytic, row-ordered, or holding an inference-mode tensor (no version counter)."""
    if mask is None:
        return ()
    if not mask.analytic or mask.row_ordered:
        return None
    found, todo = [], [mask]
    while todo:
        part = todo.pop()
        for t in vars(part).values():
            if isinstance(t, torch.Tensor):
                if t.is_inference():
                    return None
                found.append((id(t), t._version))
        todo += part.children()
    return tuple(found)


def _build_tiles(q, k, call: AttentionCall) -> fused_attention.Tiles:
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    grid = chunked.fine_grid(call, B, Hq, Sq, Sk, Hq // Hkv, q.device)
    bq, bk = grid.block_q, fused_attention.BLOCK_K
    partial = (grid.nonempty & ~grid.full).nonzero()  # (n, 2), row-major
    blocks = []
    # partial-tile masks in groups of tiles, under chunked's cap on one mask_mod call's indices
    step = max(1, chunked.MASK_BATCH_ELEMENTS // (bq * bk * grid.mask_b * grid.mask_h))
    for p0 in range(0, partial.shape[0], step):
        masked = chunked.partial_masks(
            call, partial[p0 : p0 + step], B, Hq, Hkv, Sq, Sk, bq, bk, q.device, None, True
        )  # (n, Bm, Hk', G', bq, bk) bool, True = masked
        n, Bm = masked.shape[0], masked.shape[1]
        blocks.append((~masked).reshape(n, Bm, -1, bq, bk).to(torch.uint8))
    if blocks:
        mb, mh = blocks[0].shape[1], blocks[0].shape[2]
        bits = torch.cat([b.expand(-1, mb, mh, -1, -1) for b in blocks]).contiguous()
    else:
        mb, mh, bits = 1, 1, torch.zeros(0, 1, 1, bq, bk, dtype=torch.uint8)
    return fused_attention.Tiles.from_grid(grid.nonempty, grid.full, bq, bits, mb, mh)


def _seed0(seed: int) -> int:
    """The first step of ``_common.dropout_keep``'s hash (the seed alone), which the kernel
    continues over (b, h, query, key)."""
    return int(fmix32(torch.tensor(seed & 0xFFFFFFFF) ^ ((seed >> 32) * GOLDEN)))


def _attend(q, k, v, call: AttentionCall, grad: bool):
    """``(out, lse or None, finite)``; ``grad``: autograd will run the call's backward."""
    t = tiles(q, k, call)
    q, k, v = (x.contiguous() for x in (q, k, v))
    terms = score_terms(q, k, call)  # alibi, bias, softcap: checked by reject
    mods = dict(terms)
    cap = float(mods.get("softcap", 0.0)) * (-1.0 if cap_before_alibi(terms) else 1.0)
    drop = (call.dropout_p, _seed0(call.dropout_seed)) if call.dropout_p > 0 else (0.0, 0)
    args = (fused_attention.forced_generic(), call.q_offset, mods.get("alibi"), *drop,
            mods.get("bias"), cap)  # fmt: skip
    if grad:  # the op, whose autograd formula is the kernel's backward
        out, lse, _, _, finite = ops.attention_fwd_cpu(
            q, k, v, *t.tensors(), t.block_q, t.mask_b, t.mask_h, call.scale, *args
        )
    else:  # the op's implementation itself: the dispatcher costs tens of µs a call
        finite = torch.empty((), dtype=torch.bool)
        out, lse, _, _ = fused_attention.forward(q, k, v, t, call.scale, *args, finite=finite)
    return out, (lse if call.return_lse else None), finite


def run(q, k, v, call: AttentionCall):
    """``(out in q's dtype, lse float32 or None)``."""
    if call.sinks is not None:  # merged after the kernel, through its lse (differentiable)
        return run_with_sinks(run, q, k, v, call)
    grad = grad_needed(q, k, v, call)
    if grad and not all_finite(k, v):
        # The backward multiplies whole tiles of K and V (dQ = dS K, dP = dO Vᵀ), so NaN/Inf
        # at a masked key would reach rows that never attend it (0 · NaN): chunked's exact path
        # keeps them out, at its speed.
        log_once(
            ("cpu_fused non-finite K/V backward",),
            logging.INFO,
            "selfattn cpu_fused: K/V hold NaN/Inf and the call needs gradients; chunked's exact "
            "path runs it (logged once)",
        )
        return chunked.run(q, k, v, call, exact=True)
    return fused_or_exact(
        q, k, v, call, lambda: _attend(q, k, v, call, grad), lambda: None, backend="cpu_fused",
        checked=True,
    )  # fmt: skip


def reject(q, k, v, call: AttentionCall) -> str | None:
    if q.device.type != "cpu":
        return f"tensors on {q.device}: the fused C kernel runs on CPU"
    if q.dtype == torch.float64:
        return (
            "float64 inputs accumulate in float64 and the kernel accumulates in float32 "
            "(chunked and reference run them)"
        )
    terms = score_terms(q, k, call)
    if isinstance(terms, str):
        return terms + " (chunked runs it)"
    if torch.compiler.is_compiling():
        return "under torch.compile its tile plan reads mask values (a graph break)"
    if fused_attention.library() is None:
        log_once(
            ("cpu_fused backend unavailable",),
            logging.WARNING,
            "selfattn cpu_fused backend: the fused C kernel could not be built or is turned off "
            "(%s=0); chunked runs dense CPU attention instead",
            fused_attention.ENV_VAR,
        )
        return "the fused C kernel could not be built here (no C compiler, or the build failed)"
    dtypes = fused_attention.supported_dtypes(fused_attention.forced_generic())
    if any(t.dtype != q.dtype for t in (k, v)) or q.dtype not in dtypes:
        return f"q, k, v are {q.dtype}/{k.dtype}/{v.dtype}; this build reads one of {dtypes}"
    return None


@dataclasses.dataclass(frozen=True)
class Fit:
    """cpu_fused's cost against sdpa's in one regime, from ``benchmarks/crossover.py``:
    ``per_pair``, its time per computed (query, key) pair over sdpa's on large calls;
    ``fixed``, its extra per-call set-up (tile plan, packing K/V, the op) in sdpa's pairs of
    the same regime (sdpa's time per pair differs ~10x between a decode row and a prefill)."""

    per_pair: float
    fixed: float
    what: str  # the regime in words, for explain


# The measured regimes, from FITS_FILE (package data, with the machine it was measured on):
# the dtype (bf16 runs vdpbf16ps; sdpa's bf16 CPU kernel is no faster than its fp32 one),
# whether a backward follows (q, k or v needs grad under grad mode), and decode steps
# (Sq <= DECODE_ROWS: sdpa's time per pair is several times its prefill one there, and the
# kernel packs all of K/V for the one row; from Sq = 2 on sdpa's bf16 runs its fast path again).
# ``python -m selfattn.benchmarks.crossover --write`` measures and writes the file: each
# per_pair is about the worst large-call ratio of its regime, so that a call goes to cpu_fused
# only where it wins by a margin, and each fixed puts the crossover where the small calls
# measured it (that module's docstring states the rule). One fit serves every thread count: on
# the persistent thread pool (kernels/threads.py) the kernel gains from a second thread as sdpa
# does. BENCHMARKS.md has the rows where auto's pick still misses the fastest.
FITS_FILE = Path(__file__).with_name("cpu_fused_fits.json")


def read_fits(path: Path = FITS_FILE) -> tuple[int, dict]:
    """``(decode_rows, {(dtype, backward, decode): Fit})`` from a fits file."""
    data = json.loads(path.read_text())
    fits = {
        (getattr(torch, f["dtype"]), f["backward"], f["decode"]): Fit(
            f["per_pair"], f["fixed"], f["what"]
        )
        for f in data["fits"]
    }
    return data["decode_rows"], fits


DECODE_ROWS, FITS = read_fits()
# Not measured (fp16, which the kernel converts to float32; builds without AVX-512F, or bf16
# without avx512_bf16, or bf16 on a CPU with AMX tiles, where sdpa's brgemm micro-kernels run on
# them and our kernel does not): sdpa's equal, so that no-mask and causal calls stay on sdpa
# (equal costs go to it) and masked ones come here (sdpa would run a dense mask, chunked costs
# 2), with the set-up of the fp32 forward.
UNMEASURED = Fit(1.0, 1e5, "not measured for this dtype/build: costed as sdpa's equal")
# A bias that needs its gradient: dBias forces the two-pass backward and its own reduction,
# 1.17-1.33x the time of the same call with a fixed bias (one thread, fp32 causal (1,8,2048²)
# and (2048²) biases, window 256 at S=8192).
LEARNED_BIAS = 1.3


@functools.cache
def _measured_features(isa_name: str) -> tuple[bool, bool]:
    """(AVX-512F, avx512_bf16) of the kernel build ``isa_name`` (the measured machine's)."""
    names = fused_attention.isa(isa_name == "generic").split("+")
    return "avx512f" in names, "avx512_bf16" in names


def fit(q, k, v, call: AttentionCall) -> Fit:
    """The measured regime of this call (:data:`FITS`), or :data:`UNMEASURED`."""
    avx512, bf16 = _measured_features(fused_attention.requested_isa())
    if not avx512 or q.dtype not in (torch.float32, torch.bfloat16):
        return UNMEASURED
    if q.dtype == torch.bfloat16 and (not bf16 or "amx_bf16" in build.cpu_flags()):
        return UNMEASURED
    return FITS[q.dtype, grad_needed(q, k, v, call), q.shape[2] <= DECODE_ROWS]


def cost(q, k, v, call: AttentionCall) -> Cost:
    f = fit(q, k, v, call)
    per_pair, what = f.per_pair, f.what
    terms = score_terms(q, k, call)  # a reason string where reject() declines the call
    if not isinstance(terms, str) and learned_bias(terms):
        per_pair, what = per_pair * LEARNED_BIAS, f"{what}, with the bias gradient"
    return Cost(
        per_pair,
        f"fused C kernel over the mask's tiles, skipping empty ones ({what}: "
        f"{per_pair:g} x sdpa per pair + {f.fixed:.0e} pairs of set-up)",
        sparse=True,
        fixed=setup_per_pair(f.fixed, q, k),
    )


register(
    Backend(
        "cpu_fused",
        run,
        reject,
        cost=cost,
        supports=BASE_FIELDS["dense"] | {"sinks"},
        doc=(
            "fused C kernel (AVX-512/AVX2/generic): skips empty tiles, no mask work on full "
            "ones, fused backward; CPU, fp32/bf16/fp16, ALiBi/bias/softcap, dropout"
        ),
    )
)
