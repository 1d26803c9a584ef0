"""The flex backend: PyTorch FlexAttention, compiled, with block masks from our tile classification.

FlexAttention calls ``mask_mod`` / ``score_mod`` with query *row* indices; ours take absolute
positions (the call bound them: :meth:`selfattn.masks.Mask.bind`), so both are wrapped to add
``q_offset`` to ``q_idx`` (held in a 0-d tensor, so that a new offset, e.g. the next decode step,
does not recompile); a user's FlexAttention callable is called as it is. The ``BlockMask`` comes
from ``mask.tile_kinds(...)`` on ``BLOCK × BLOCK`` tiles: EMPTY tiles are skipped, FULL tiles run
without ``mask_mod``, PARTIAL tiles evaluate it. For the built-in masks that classification is
analytic, O(tiles) instead of ``create_block_mask``'s O(Sq·Sk) evaluation; block masks are cached
per (mask object, B, Hq, Sq, Sk, q_offset, device) in a small LRU. (It is ``Mask.to_block_mask``:
a FlexAttention ``BlockMask`` given as ``mask=`` runs as it is, blocks and ``mask_mod``.)

``torch.compile(flex_attention)`` is built on first use, never at import, with automatic dynamic
shapes: the first call compiles for its shape, a second shape recompiles once with symbolic
sizes, later sizes reuse that kernel (``Sq = 1``, new head dims, dtypes, masks and score mods
still compile anew: a few seconds each on CPU). A case whose symbolic-size kernel fails to build
falls back to static shapes (one kernel per shape) for the rest of the process. Dynamo counts its
recompile limit per code object, past which torch would run FlexAttention uncompiled (correct,
but slow and O(Sq·Sk) in memory, and a hand-made BlockMask then follows eager's rule): each
kernel signature calls it through a function of its own (``_case_function``), and a case that
still reaches the limit is compiled afresh, logged once (``_call_compiled``).

Limits (see :func:`_reject`): CPU needs torch >= 2.6 and an AVX2 x86 CPU, runs float32 / float16 /
bfloat16, has no backward and no log-sum-exp; CUDA needs head dims >= 16. Dropout is not
available. Empty rows give output 0 (and lse ``-inf`` where lse is available). Learned sinks:
merged through the lse on CUDA (``_common.merge_sinks``); on CPU, which has no lse, one more key
column with zero K/V whose score is the sink (``_sink_column_call``), exact and inference only.

Non-finite values: FlexAttention computes ``P V`` over whole blocks, so NaN/Inf in V at a masked
key inside a partial block leaks through ``0 · NaN``, and it turns a NaN query row into 0; the
result is checked and such calls redone (``exact.fused_or_exact``, which states the rule).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
import logging
import os
import sys
import threading
import types

import torch

from selfattn._log import log_once
from selfattn.backends._common import (
    accumulation_dtype,
    all_finite,
    causal_as_flag,
    grad_needed,
    needs_grad,
    run_with_sinks,
    setup_per_pair,
    sinkless,
)
from selfattn.backends.base import BASE_FIELDS, Backend, BackendCompileError, Cost, register
from selfattn.backends.exact import fused_or_exact
from selfattn.call import AttentionCall
from selfattn.kernels.markers import assume_constant_result
from selfattn.masks import FULL, PARTIAL, Mask
from selfattn.masks.block_mask import FLEX_BLOCK, flex_api, wrapped_mask_mod
from selfattn.masks.elementwise import callable_failure, evaluate
from selfattn.scores import Compose, ScoreMod

BLOCK = FLEX_BLOCK  # FlexAttention's default sparse block size; its kernels tile inside it
_CACHE_SIZE = 16  # block masks kept (each holds O(B·Hq·n_q·n_k) int32 indices and its mask)
_HALF_AND_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
# Elements of mask evaluated at once when looking for attended non-finite K/V columns.
_GUARD_CHUNK = 1 << 24


# -- feature detection (what this torch has; nothing here probes hardware) ---------------------


_api = flex_api  # ``torch.nn.attention.flex_attention`` if this torch has it (2.5+), else None


@functools.cache
def _features() -> dict[str, bool]:
    fa = _api()
    flex = inspect.signature(fa.flex_attention).parameters
    return {
        "enable_gqa": "enable_gqa" in flex,
        "return_aux": "return_aux" in flex and hasattr(fa, "AuxRequest"),
        "return_lse": "return_lse" in flex,
    }


@functools.cache
def _compiled(dynamic: bool | None = None, case: tuple | None = None):
    """The compiled ``flex_attention``, made on first use.

    ``dynamic=None`` (automatic dynamic shapes) is the default; ``dynamic=False`` (one kernel per
    shape) is the fallback for cases whose dynamic-shape kernel fails to build (see ``_run``).
    ``case``: ``(kernel signature, generation)``, which gets a function of its own (below); None
    compiles ``flex_attention`` itself.
    """
    _raise_recompile_limit()
    fn = _api().flex_attention if case is None else _case_function(next(_CASE_NUMBERS))
    return torch.compile(fn, dynamic=dynamic)


# Dynamo keeps its compiled kernels and counts its recompile limit per *code object*: had every
# case shared flex_attention's, a long process (many masks, score mods, dtypes, head dims) would
# pass the limit and from then on run FlexAttention uncompiled, silently. Each kernel signature
# (_signature) therefore calls flex_attention through a function with a code object of its own,
# so that only its own shapes count against its limit.
_CASE_NUMBERS = itertools.count()


def _case_function(n: int):
    """``flex_attention`` behind a fresh code object (named ``flex_attention_case_<n>``)."""
    flex_attention = _api().flex_attention

    def case(q, k, v, **kwargs):
        return flex_attention(q, k, v, **kwargs)

    code = case.__code__.replace(co_name=f"flex_attention_case_{n}")
    return types.FunctionType(code, case.__globals__, code.co_name, None, case.__closure__)


# Generation of each kernel signature's function: a case that still passes Dynamo's recompile
# limit (one signature recompiled for too many shapes) starts over with a new function, logged.
_GENERATIONS: dict = {}


def _call_compiled(mode, signature, q, k, v, kwargs):
    """The case's compiled kernel on ``q, k, v``; past the recompile limit, a fresh one (WARNING,
    logged once) instead of Dynamo's silent fallback to uncompiled FlexAttention."""
    if torch.compiler.is_compiling():  # inside a user's compiled graph: its cache and rules
        return _compiled(mode)(q, k, v, **kwargs)
    generation = _GENERATIONS.get(signature, 0)
    fn = _compiled(mode, (signature, generation))
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return fn(q, k, v, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        _GENERATIONS[signature] = generation + 1
        log_once(
            ("flex recompile limit",),
            logging.WARNING,
            "selfattn flex: torch.compile's recompile limit (%s) was reached for one FlexAttention "
            "case (%s, %s); compiling it afresh rather than running it uncompiled (logged once)",
            torch._dynamo.config.recompile_limit,
            q.dtype,
            q.device.type,
        )
        return _compiled(mode, (signature, generation + 1))(q, k, v, **kwargs)


# Dynamo compiles ``flex_attention`` once per mask/score-mod code, dtype and head dim; all of
# them count against one per-function limit (8 by default), past which torch silently runs
# FlexAttention *uncompiled* (O(Sq·Sk) memory, ~100× slower on a GPU).
_RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    """Let Dynamo keep up to ``_RECOMPILE_LIMIT`` FlexAttention kernels (never lowers a limit)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # torch >= 2.6 / older name
        if hasattr(cfg, name) and getattr(cfg, name) < _RECOMPILE_LIMIT:
            setattr(cfg, name, _RECOMPILE_LIMIT)


# Kernel signatures whose automatic-dynamic compile failed in this process; they go straight to
# static shapes. (torch 2.13's CPU template emits C++ with an undeclared `cur_kvSplitSize<n>` for
# e.g. a bool-tensor mask with ALiBi once the sequence lengths turn symbolic.)
_STATIC_ONLY: set = set()
# Cases (signature and shapes) that failed to compile even with static shapes: the backend then
# declines them (auto falls back; measured: torch 2.11 on an H200 finds no kernel configuration
# for some GQA shapes with Sq < 128 that need gradients).
_FAILED: dict = {}


def _signature(q, k, v, call: AttentionCall) -> tuple:
    """What selects a compiled FlexAttention kernel, apart from the sizes."""
    return (
        q.device.type, q.dtype, q.shape[3], v.shape[3], q.shape[1] != k.shape[1],
        call.return_lse, grad_needed(q, k, v, call),
        _mod_key(call.mask), _mod_key(call.score_mod),
    )  # fmt: skip


def _case_key(q, k, v, call: AttentionCall) -> tuple:
    """One case exactly: its kernel signature and its sizes (the key of ``_FAILED``)."""
    return _signature(q, k, v, call), tuple(q.shape), tuple(k.shape), tuple(v.shape)


def _mod_key(obj) -> tuple:
    """What a mask / score mod contributes to the compiled kernel: its classes and code."""
    if obj is None:
        return ()
    parts = [type(obj).__qualname__]
    inner = obj.children() if isinstance(obj, Mask) else getattr(obj, "mods", ())
    parts.extend(_mod_key(c) for c in inner)
    fn = getattr(obj, "fn", None)  # a user callable: its code
    if fn is not None:
        parts.append(getattr(fn, "__code__", type(fn)))
    return tuple(parts)


@functools.cache
def _torch_at_least(major: int, minor: int) -> bool:
    return torch.torch_version.TorchVersion(torch.__version__) >= (major, minor)


# A constant of the process: asked once while tracing, not traced (torch marks
# torch.cpu._is_avx2_supported as never to be traced, which would break the graph of any
# compiled attention() call, since auto asks every backend whether it can run the case).
@assume_constant_result
def _cpu_reason() -> str | None:
    """Why torch.compile cannot run FlexAttention on this CPU, or None.

    Mirrors inductor's own check (x86 with AVX2, not macOS); CPU FlexAttention arrived in 2.6.
    """
    if not _torch_at_least(2, 6):
        return f"FlexAttention on CPU needs torch >= 2.6 (this is {torch.__version__})"
    if sys.platform == "darwin":
        return "torch.compile has no FlexAttention kernel for CPUs on macOS"
    avx2 = getattr(torch.cpu, "_is_avx2_supported", None)
    if (avx2 is not None and not avx2()) or os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        return "torch.compile's CPU FlexAttention kernel needs an x86 CPU with AVX2"
    return None


# -- reject ------------------------------------------------------------------------------------


def _reject(q, k, v, call: AttentionCall) -> str | None:
    if call.sinks is not None:
        if q.device.type == "cpu":  # no lse on CPU: the sink is one more key column
            if grad_needed(q, k, v, call):
                return (
                    "FlexAttention has no backward on CPU (inference only) and this call needs "
                    "gradients (sinks included); use chunked, or run under torch.no_grad()"
                )
            reason = _reject(q, k, v, dataclasses.replace(call, sinks=None))
            return None if reason is None else f"sinks run as one more key column: {reason}"
        reason = _reject(q, k, v, sinkless(call))
        return None if reason is None else f"sinks are merged through the lse: {reason}"
    if _api() is None:
        return f"this torch ({torch.__version__}) has no FlexAttention (needs torch >= 2.5)"
    if call.dropout_p > 0:
        return (
            "FlexAttention has no dropout that matches selfattn's counter-based pattern (the same "
            "pairs dropped as the reference for a seed)"
        )
    Hq, Hkv, Sq = q.shape[1], k.shape[1], q.shape[2]
    D, Dv = q.shape[3], v.shape[3]
    G = Hq // Hkv
    dev = q.device.type
    if q.dtype not in _HALF_AND_FLOAT:
        return f"FlexAttention kernels run float32, float16 and bfloat16, not {q.dtype}"
    if dev == "cpu":
        reason = _cpu_reason()
        if reason is not None:
            return reason
        if grad_needed(q, k, v, call):
            return (
                "FlexAttention has no backward on CPU (inference only) and this call needs "
                "gradients; use chunked or sdpa, or run under torch.no_grad()"
            )
        if call.return_lse:
            return "torch.compile's CPU FlexAttention kernel cannot return the log-sum-exp"
    elif dev == "cuda":
        if D < 16 or Dv < 16:
            return f"FlexAttention's CUDA kernels need head dims >= 16 (got D={D}, Dv={Dv})"
        mod = call.score_mod
        if not _torch_at_least(2, 6) and mod is not None and needs_grad(mod.tensors()):
            return (
                f"FlexAttention before torch 2.6 (this is {torch.__version__}) cannot "
                "differentiate tensors a score mod reads (learnable biases)"
            )
        if G > 1 and G & (G - 1) and Sq < BLOCK:
            return (
                f"FlexAttention's CUDA decoding kernel (Sq < {BLOCK}) needs Hq / Hkv to be a "
                f"power of two (got Hq={Hq}, Hkv={Hkv})"
            )
    else:
        return f"the flex backend runs on cpu and cuda, not {dev}"
    failed = _FAILED.get(_case_key(q, k, v, call))
    if failed is not None:
        return f"FlexAttention failed to compile this case earlier in this process ({failed})"
    feats = _features()
    if G > 1 and not feats["enable_gqa"]:
        return f"this torch's FlexAttention has no enable_gqa (Hq={Hq}, Hkv={Hkv})"
    if call.return_lse and not (feats["return_aux"] or feats["return_lse"]):
        return "this torch's FlexAttention cannot return the log-sum-exp"
    return None


# -- block masks -------------------------------------------------------------------------------

# Kept under their old names here: the flex backend's block masks are ``Mask.to_block_mask``'s.
_wrapped_mask_mod = wrapped_mask_mod


def build_block_mask(
    mask: Mask, B: int, Hq: int, Sq: int, Sk: int, q_offset: int, device, block: int | None = None
):
    """The ``BlockMask`` this backend runs ``mask`` with (not cached): ``mask.to_block_mask``
    (``block`` None: ``BLOCK``), which a FlexAttention ``BlockMask`` given as ``mask=`` answers
    with itself."""
    return mask.to_block_mask(B, Hq, Sq, Sk, q_offset=q_offset, device=device, block_size=block)


def _wrapped_score_mod(mod, off: torch.Tensor):
    """Our score mod (absolute query positions) as FlexAttention's ``score_mod`` (query rows)."""
    inner = mod.as_score_mod()

    def score_mod(score, b, h, q_idx, kv_idx):
        return inner(score, b, h, q_idx + off, kv_idx)

    return score_mod


class _BlockMaskCache:
    """A small LRU of block masks keyed by mask identity and call geometry.

    Each entry keeps its mask object alive, so an ``id`` in the key cannot be reused by another
    mask while the entry exists. A mask mutated in place after its first use is not noticed.
    Masks holding a bool tensor in row order (``Mask.row_ordered``) are not cached: a tensor
    passed as ``mask=`` becomes a new mask object every call (so it would never hit), the entry
    would keep an ``(B, H, Sq, Sk)`` tensor alive, and its blocks cost one pass over that tensor
    to rebuild anyway.
    """

    def __init__(self, size: int):
        self.size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, mask: Mask, B, Hq, Sq, Sk, q_offset, device):
        if torch.compiler.is_compiling():  # the graph builds it; a lock and a dict cannot trace
            return build_block_mask(mask, B, Hq, Sq, Sk, q_offset, device)
        device = torch.device(device)
        key = (id(mask), B, Hq, Sq, Sk, q_offset, str(device))
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] is mask:
                self._entries.move_to_end(key)
                return hit[1]
        block_mask = build_block_mask(mask, B, Hq, Sq, Sk, q_offset, device)
        if mask.row_ordered:
            return block_mask
        with self._lock:
            self._entries[key] = (mask, block_mask)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return block_mask

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_block_masks = _BlockMaskCache(_CACHE_SIZE)


# -- NaN guard ---------------------------------------------------------------------------------


def _unattended_nonfinite_zeroed(k, v, call: AttentionCall, Hq: int, Sq: int):
    """Zero the non-finite K/V rows that no query attends, without a dense mask.

    FlexAttention computes ``P @ V`` over whole blocks, so NaN/Inf stored at a masked key inside
    a partial block would leak through ``0 · NaN``. Only keys that actually hold a non-finite
    value (few, if any) are checked against the mask, by evaluating it on those columns.
    """
    bad = ~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))  # (B, Hkv, Sk)
    if not bool(bad.any()):
        return k, v
    B, Hkv, _ = bad.shape
    cols = bad.any(dim=1).any(dim=0).nonzero().flatten()  # key positions to check
    attended = []
    step = max(1, _GUARD_CHUNK // max(1, B * Hq * Sq))
    for c in cols.split(step):
        # evaluate the mask on columns c only: key index j of this sub-grid is position c[j]
        def sub_mod(b, h, q_idx, kv_idx, c=c):
            return call.mask.mask_mod(b, h, q_idx, c[kv_idx])

        dense = evaluate(sub_mod, B, Hq, Sq, c.numel(), call.q_offset, k.device)
        a = dense.expand(B, Hq, Sq, c.numel()).any(dim=2)  # (B, Hq, n)
        attended.append(a.view(B, Hkv, Hq // Hkv, c.numel()).any(dim=2))  # (B, Hkv, n)
    zero = torch.zeros_like(bad)
    zero[:, :, cols] = bad[:, :, cols] & ~torch.cat(attended, dim=-1)
    if not bool(zero.any()):
        return k, v
    keep = ~zero.unsqueeze(-1)  # (B, Hkv, Sk, 1)
    return k.masked_fill(~keep, 0), v.masked_fill(~keep, 0)


# -- sinks as a key column (CPU: its kernel returns no lse to merge them through) ---------------


class _SinkColumn(Mask):
    """``inner`` over keys ``0 .. Sk-1``, and key column ``Sk`` (the sink's) attended by every
    row. ``Sk`` is a 0-d tensor, so that a new length (the next decode step) reuses the kernel."""

    def __init__(self, inner: Mask, Sk: int, col: torch.Tensor):
        self.inner, self.Sk, self.col = inner, Sk, col

    def children(self) -> tuple[Mask, ...]:
        return (self.inner,)

    def _with_children(self, parts):
        return _SinkColumn(parts[0], self.Sk, self.col)

    def mask_mod(self, b, h, q_idx, kv_idx):
        inside = self.inner.mask_mod(b, h, q_idx, torch.minimum(kv_idx, self.col - 1))
        return inside | (kv_idx == self.col)

    def tile_kinds(self, grid, B=1, H=1):
        inner = self.inner.tile_kinds(dataclasses.replace(grid, Sk=self.Sk), B, H)
        inner = inner.reshape((1,) * (4 - inner.dim()) + tuple(inner.shape))
        if grid.n_k > inner.shape[-1]:  # the sink column starts a tile of its own: FULL
            last = torch.full_like(inner[..., -1:], int(FULL))
            return torch.cat([inner, last], dim=-1)
        # the sink column joins the last tile: no longer EMPTY (FULL stays FULL)
        return torch.cat([inner[..., :-1], inner[..., -1:].clamp_min(int(PARTIAL))], dim=-1)

    def validate(self, B, H, Sq, Sk, q_offset):
        self.inner.validate(B, H, Sq, self.Sk, q_offset)

    def batch_heads(self):
        return self.inner.batch_heads()

    def __repr__(self) -> str:
        return f"{self.inner!r} | sink column {self.Sk}"


class _SinkScore(ScoreMod):
    """The sink's logit as the score of key column ``col`` (a 0-d tensor), every other score
    as it is."""

    def __init__(self, sinks: torch.Tensor, col: torch.Tensor):
        self.sinks, self.col = sinks, col

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == self.col, self.sinks[h].to(score.dtype), score)

    def tensors(self):
        return (self.sinks,)

    def __repr__(self) -> str:
        return "sink column"


def _sink_column_call(q, k, v, call: AttentionCall):
    """``(k', v', call')``: the sinks as one more key (zero K and V, score ``sinks[h]``, attended
    by every row): exact, ``softmax`` over the keys and the sink with nothing added to the
    output, without the lse that CPU FlexAttention cannot return."""
    B, Hkv, Sk, _ = k.shape
    col = torch.tensor(Sk, device=q.device)
    k1 = torch.cat([k, k.new_zeros(B, Hkv, 1, k.shape[3])], dim=2)
    v1 = torch.cat([v, v.new_zeros(B, Hkv, 1, v.shape[3])], dim=2)
    mask = None if call.mask is None else _SinkColumn(call.mask, Sk, col)
    sink = _SinkScore(call.sinks, col)
    mod = sink if call.score_mod is None else Compose(call.score_mod, sink)
    return k1, v1, dataclasses.replace(call, sinks=None, mask=mask, score_mod=mod)


# -- run ---------------------------------------------------------------------------------------


def _run(q, k, v, call: AttentionCall):
    if call.sinks is not None:
        if q.device.type == "cpu":  # one more key column (_sink_column_call)
            k, v, call = _sink_column_call(q, k, v, call)
            return _run(q, k, v, call)
        return run_with_sinks(_run, q, k, v, call)  # merged after the kernel, from its lse
    if not torch.is_grad_enabled():
        # CPU FlexAttention refuses inputs that merely require grad, even under no_grad.
        q, k, v = q.detach(), k.detach(), v.detach()

    def attend_zeroed():
        if call.mask is None:  # every key is attended: nothing to zero
            return None
        if torch.compiler.is_compiling():  # finding the non-finite keys reads values
            return None
        kz, vz = _unattended_nonfinite_zeroed(k, v, call, q.shape[1], q.shape[2])
        return _attend(q, kz, vz, call) if all_finite(kz, vz) else None

    return fused_or_exact(
        q, k, v, call, lambda: _attend(q, k, v, call), attend_zeroed, backend="flex"
    )


def _attend(q, k, v, call: AttentionCall):
    """``(out, lse)`` from compiled FlexAttention."""
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_mask = None
    if isinstance(call.mask, _SinkColumn):  # made per call: nothing to cache it by
        block_mask = build_block_mask(call.mask, B, Hq, Sq, Sk, call.q_offset, q.device)
    elif call.mask is not None:
        block_mask = _block_masks.get(call.mask, B, Hq, Sq, Sk, call.q_offset, q.device)
    kwargs = {"block_mask": block_mask, "scale": call.scale}
    if call.score_mod is not None:
        off = torch.tensor(call.q_offset, device=q.device)
        kwargs["score_mod"] = _wrapped_score_mod(call.score_mod.to(q.device), off)
    if Hq != Hkv:
        kwargs["enable_gqa"] = True
    feats = _features()
    if call.return_lse:
        if feats["return_aux"]:
            kwargs["return_aux"] = _api().AuxRequest(lse=True)
        else:
            kwargs["return_lse"] = True
    signature = _signature(q, k, v, call)
    modes = (False,) if signature in _STATIC_ONLY else (None, False)
    for mode in modes:
        try:
            result = _call_compiled(mode, signature, q, k, v, kwargs)
            break
        except Exception as e:
            if callable_failure(e):  # out of memory, or the user's score_mod/mask_mod raised
                raise
            if mode is None:  # retry with static shapes, and remember to start there next time
                _STATIC_ONLY.add(signature)
                log_once(
                    ("flex dynamic shapes", type(e).__name__),
                    logging.INFO,
                    "selfattn flex: compiling with dynamic shapes failed (%s: %s); compiling "
                    "with static shapes instead (one compile per shape)",
                    type(e).__name__,
                    str(e).splitlines()[0][:160] if str(e) else "",
                )
                continue
            _FAILED[_case_key(q, k, v, call)] = (
                f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            )
            raise BackendCompileError(
                f"the flex backend failed on q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)} ({q.dtype}, {q.device}) with mask={call.mask!r}, "
                f"score_mod={call.score_mod!r}, q_offset={call.q_offset}: "
                f"{type(e).__name__}: {e}. Use backend='chunked' (or 'auto') for this case"
            ) from e
    if not call.return_lse:
        return result, None
    out, aux = result
    lse = aux.lse if feats["return_aux"] else aux
    # FlexAttention gives -inf for rows with no allowed key, like ours.
    return out, lse.to(accumulation_dtype(q.dtype))


# -- cost (per pair against sdpa's 1: backends/_auto.py) ------------------------------------------

# On CUDA its fused block-sparse kernel beats sdpa with a dense mask and the Python-tiled
# chunked for masks; for plain or causal work with a score mod it beats chunked but not SDPA's
# flash kernel (which runs additive mods); with nothing to fuse it goes after chunked. On CPU it
# compiles per shape (4-10 s cold) and has no backward: a last resort before reference.
_CUDA_MASK = Cost(0.5, "mask: compiled FlexAttention skips empty blocks", sparse=True)
_CUDA_SCORE_MOD = Cost(1.5, "score mod: compiled FlexAttention fuses it", sparse=True)
_CUDA_PLAIN = Cost(20.0, "no mask or score mod to fuse: a compile for nothing")
_CPU = Cost(100.0, "on CPU a last resort: compiles per shape (4-10 s cold), no backward")
# The cold compile as set-up, in sdpa-pairs (sdpa runs ~1e9 pairs a second on one core): without
# it a small call's per-pair price alone would rank flex above backends whose set-up is fixed
# in pairs (chunked, cpu_fused) and compile for seconds to save microseconds.
_CPU_COMPILE_PAIRS = 1e9


def _cost(q, k, v, call: AttentionCall) -> Cost:
    if q.device.type != "cuda":
        return dataclasses.replace(_CPU, fixed=setup_per_pair(_CPU_COMPILE_PAIRS, q, k))
    if not causal_as_flag(k, call):
        return _CUDA_MASK
    return _CUDA_PLAIN if call.score_mod is None else _CUDA_SCORE_MOD


register(
    Backend(
        "flex",
        _run,
        _reject,
        cost=_cost,
        supports=BASE_FIELDS["dense"] | {"sinks"},
        doc=(
            "PyTorch FlexAttention (torch.compile): block-sparse over our tile classification, "
            "any mask and score mod; CPU: inference only, fp32/fp16/bf16, no lse"
        ),
    )
)
