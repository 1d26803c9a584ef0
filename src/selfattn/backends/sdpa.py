"""The sdpa backend: ``torch.nn.functional.scaled_dot_product_attention`` where it can say the case.

How each part of an :class:`~selfattn.backends.AttentionCall` is expressed:

- no mask: a plain call.
- ``causal()``: ``is_causal=True`` only when ``q_offset == 0`` (SDPA's causal is top-left: query
  ``i`` sees keys ``<= i``, which is ours exactly then); no mask at all when ``q_offset >= Sk - 1``
  (every row sees every key, e.g. decoding one token); ``causal_lower_right`` when
  ``q_offset == Sk - Sq`` (``Sq < Sk``, MHA); otherwise a dense bool mask.
- any other mask: the dense bool mask ``mask.to_dense(...)``, broadcast dims kept at size 1.
- additive score mods (ALiBi, bias tensors, T5 tables): materialised into a float ``attn_mask`` with
  ``-inf`` where the mask forbids. Other score mods cannot be said to SDPA and are rejected.
- GQA: ``enable_gqa=True`` when SDPA's chosen kernel handles it natively; when SDPA would fall back
  to its math kernel (which repeats K/V) the ``G`` query heads of a kv head are folded into the rows
  instead, ``q (B, Hq, Sq, D) -> (B, Hkv, G·Sq, D)``, so K/V are never repeated.
- ``return_lse``: public SDPA does not return it; on CPU the flash kernel behind it,
  ``aten._scaled_dot_product_flash_attention_for_cpu``, does (without gradients for the lse).

Rows the mask leaves empty are given every key inside the kernel and zeroed afterwards (output 0,
lse ``-inf``, zero gradients on every torch version).

Non-finite values: SDPA's kernels add masks to the scores and multiply every weight by every V row,
so NaN/Inf at a masked entry would leak (``NaN + -inf``, ``0 · NaN``), and the CPU kernel turns a
NaN query row into 0; the result is checked and such calls redone (``exact.fused_or_exact``,
which states the rule).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from selfattn.backends._common import (
    accumulation_dtype,
    all_finite,
    causal_as_flag,
    grad_needed,
    index_grids,
    run_with_sinks,
    sinkless,
    unattended_columns_zeroed,
)
from selfattn.backends.base import BASE_FIELDS, Backend, Cost, register
from selfattn.backends.exact import fused_or_exact
from selfattn.call import AttentionCall
from selfattn.kernels.markers import assume_constant_result
from selfattn.scores import Bias, Compose

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MATH = 0  # int(torch.nn.attention.SDPBackend.MATH), what aten._fused_sdp_choice returns for it


# -- feature detection (what this torch has; never what hardware is present) --------------------


# A property of this torch: asked once while tracing, not traced (Dynamo cannot walk a schema).
@assume_constant_result
def _has_enable_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (added in torch 2.5)."""
    return _schema_has_enable_gqa()


@functools.cache
def _schema_has_enable_gqa() -> bool:
    schema = torch.ops.aten.scaled_dot_product_attention.default._schema
    return any(a.name == "enable_gqa" for a in schema.arguments)


@functools.cache
def _cpu_lse_op():
    """``aten._scaled_dot_product_flash_attention_for_cpu`` if it takes ``attn_mask``, else None.

    It is the CPU flash kernel behind public SDPA and, unlike it, also returns the log-sum-exp.
    """
    try:
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        names = [a.name for a in op.default._schema.arguments]
    except (AttributeError, RuntimeError):
        return None
    return op if "attn_mask" in names else None


@functools.cache
def _lower_right_bias():
    """``torch.nn.attention.bias.causal_lower_right`` if this torch has it, else None."""
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        return None
    return causal_lower_right


def _sdpa_would_use_math(q, k, v, attn_mask, is_causal: bool) -> bool:
    """Whether SDPA would route this GQA call to its math kernel (which repeats K/V)."""
    if not _has_enable_gqa():
        return True
    choice = getattr(torch.ops.aten, "_fused_sdp_choice", None)
    if choice is None or torch.compiler.is_compiling():
        # cannot ask (the choice is an int, which a graph cannot return): trust enable_gqa
        return False
    try:
        return int(choice(q, k, v, attn_mask, 0.0, is_causal, enable_gqa=True)) == _MATH
    except (RuntimeError, TypeError):
        return False


# -- reject ------------------------------------------------------------------------------------


def _reject(q, k, v, call: AttentionCall) -> str | None:
    if call.sinks is not None:
        if grad_needed(q, k, v, call):
            return (
                "sinks are merged through SDPA's log-sum-exp, which its CPU flash kernel returns "
                "without gradients, and this call needs gradients (chunked runs it)"
            )
        reason = _reject(q, k, v, sinkless(call))
        return None if reason is None else f"sinks are merged through the lse: {reason}"
    if q.dtype not in _DTYPES:
        return f"SDPA supports float16, bfloat16, float32 and float64, not {q.dtype}"
    if call.dropout_p > 0:
        return (
            "selfattn's dropout is counter-based so that every backend drops the same pairs for a "
            "seed, and SDPA draws its own pattern, so sdpa cannot run dropout"
        )
    if call.score_mod is not None and not call.score_mod.additive:
        return (
            f"SDPA only adds a float mask to the scores, and score mod {call.score_mod!r} is not "
            "additive (softcap and custom callables need flex, chunked or reference)"
        )
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv and not _has_enable_gqa():
        return (
            f"this torch ({torch.__version__}) has no SDPA enable_gqa, and repeating K/V for "
            f"Hq={Hq}, Hkv={Hkv} is not allowed"
        )
    if call.return_lse:
        if q.device.type != "cpu":
            return f"PyTorch's SDPA does not return the log-sum-exp on {q.device.type}"
        if _cpu_lse_op() is None:
            return (
                f"this torch ({torch.__version__}) has no CPU flash kernel with masks, the only "
                "SDPA kernel that returns the log-sum-exp"
            )
        D, Dv = q.shape[3], v.shape[3]
        if D != Dv:
            return (
                "SDPA's CPU flash kernel, the only one that returns the log-sum-exp, needs "
                f"D == Dv (got D={D}, Dv={Dv})"
            )
        if grad_needed(q, k, v, call):
            return (
                "SDPA's CPU flash kernel returns the log-sum-exp without gradients, and this call "
                "needs gradients; call it without return_lse, or use chunked"
            )
    return None


# -- masks and biases --------------------------------------------------------------------------


def _collapsed(t: torch.Tensor) -> torch.Tensor:
    """Undo ``expand`` on the batch and head dims (stride 0 -> size 1) to keep masks small."""
    for dim in (0, 1):
        if t.shape[dim] > 1 and t.stride(dim) == 0:
            t = t.narrow(dim, 0, 1)
    return t


def _additive_bias(mod, B, Hq, Sq, Sk, q_offset, device, dtype) -> torch.Tensor:
    """The float bias of an additive score mod, broadcastable to ``(B, Hq, Sq, Sk)``.

    Computed as ``mod.score_mod(0)`` in ``dtype`` (the accumulation dtype), i.e. with exactly the
    arithmetic the reference uses on real scores (ALiBi in fp64 for fp64 inputs, say). Bias
    tensors are sliced to the call's rows, not gathered, so a ``(1, 1, Sq, Sk)`` bias is not
    blown up to ``(B, Hq, Sq, Sk)`` by indexing.
    """
    if isinstance(mod, Bias):
        t = mod.dense(q_offset, Sq, Sk).to(device=device, dtype=dtype)
    elif isinstance(mod, Compose):
        parts = [_additive_bias(m, B, Hq, Sq, Sk, q_offset, device, dtype) for m in mod.mods]
        t = functools.reduce(torch.add, parts)
    else:
        b, h, qi, kvi = index_grids(B, Hq, Sq, Sk, q_offset, device)
        zero = torch.zeros((), dtype=dtype, device=device)
        t = mod.score_mod(zero, b, h, qi, kvi)
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def _bias_dtype(q: torch.Tensor) -> torch.dtype:
    # On CPU the flash kernel reads a float32 mask for half inputs, so biases keep fp32 precision;
    # CUDA kernels want the mask in the query's dtype.
    return accumulation_dtype(q.dtype) if q.device.type == "cpu" else q.dtype


class _Plan:
    """How one call is said to SDPA: kernel arguments plus the rows to zero afterwards."""

    def __init__(self, k, v, attn_mask=None, is_causal=False, empty=None):
        self.k, self.v = k, v
        self.attn_mask = attn_mask  # None, bool / float (B', H', Sq, Sk), or a CausalBias
        self.is_causal = is_causal
        self.empty = empty  # bool (B', H', Sq, 1): rows with no allowed key, or None


def _plan(q, k, v, call: AttentionCall, *, flags: bool, lower_right: bool, guard=False) -> _Plan:
    """Turn the call's mask and score mod into SDPA arguments.

    ``flags``: allow ``is_causal``; ``lower_right``: allow ``causal_lower_right``. Both are off
    when the result must be a plain tensor (folded GQA, the lse kernel). ``guard``: zero the K/V
    columns that no query attends (the mask or a ``-inf`` bias removes them from every row).
    """
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    off = call.q_offset
    mask = call.mask
    # Under torch.compile the shortcuts that look at values (an all-True mask, no empty row) would
    # break the graph; the general plan gives the same result.
    _compiling = torch.compiler.is_compiling()
    flags = flags and call.score_mod is None  # SDPA refuses is_causal together with attn_mask
    lower_right = lower_right and flags and Hq == Hkv and _lower_right_bias() is not None

    if mask is not None and mask.is_causal:
        if off >= Sk - 1:
            mask = None  # even query row 0 sees every key
        elif off == 0 and flags:
            # Keys past the last query position are never attended: drop them (a view), so that
            # whatever they hold cannot leak, and SDPA's top-left causal is exactly ours.
            return _Plan(k[:, :, :Sq], v[:, :, :Sq], is_causal=True)
        elif lower_right and off == Sk - Sq and off > 0:
            # 0 < off < Sk - 1, so Sq < Sk: no empty row, and the last row sees every key. (With
            # Sq > Sk the first rows would be empty, where PyTorch warns it produces NaN.)
            return _Plan(k, v, attn_mask=_lower_right_bias()(Sq, Sk))

    dense = None
    if mask is not None:
        dense = _collapsed(mask.to_dense(Sq, Sk, B=B, H=Hq, q_offset=off, device=q.device))
        if not _compiling and bool(dense.all()):
            dense = None
        elif guard:
            k, v = unattended_columns_zeroed(k, v, dense, Hq)

    if call.score_mod is None:
        if dense is None:
            return _Plan(k, v)
        empty = ~dense.any(dim=-1, keepdim=True)  # (B', H', Sq, 1)
        if not _compiling and not bool(empty.any()):
            return _Plan(k, v, attn_mask=dense)
        return _Plan(k, v, attn_mask=dense | empty, empty=empty)

    acc = accumulation_dtype(q.dtype)
    bias = _additive_bias(call.score_mod, B, Hq, Sq, Sk, off, q.device, acc).to(_bias_dtype(q))
    if dense is not None:
        bias = bias.masked_fill(~dense, float("-inf"))
    # -inf entries of the bias act as a mask too, so empty rows are found on the final bias.
    attended = bias > float("-inf")
    if guard:  # V only: NaN in K makes the score NaN, which a -inf bias cannot mask (NaN + -inf)
        _, v = unattended_columns_zeroed(k, v, attended, Hq)
    empty = ~attended.any(dim=-1, keepdim=True)  # (B', H', Sq, 1)
    if not _compiling and not bool(empty.any()):
        return _Plan(k, v, attn_mask=bias)
    # masked_fill (not arithmetic) so that those rows pass zero gradients back to the bias
    return _Plan(k, v, attn_mask=bias.masked_fill(empty, 0.0), empty=empty)


def _fold(t: torch.Tensor, Hkv: int, G: int) -> torch.Tensor:
    """``(B', Hq or 1, Sq, X) -> (B', Hkv or 1, G·Sq, X)``: the rows of kv head ``h // G``.

    Query head ``h`` becomes rows ``(h % G)·Sq ..`` of kv head ``h // G``; a head-broadcast mask
    is repeated ``G`` times along the rows (the mask, never K/V).
    """
    Bp, Hp, Sq, X = t.shape
    if Hp == 1:
        return t.expand(Bp, G, Sq, X).reshape(Bp, 1, G * Sq, X)  # (B', 1, G·Sq, X)
    return t.reshape(Bp, Hkv, G * Sq, X)  # (B', Hkv, G·Sq, X)


def _float_mask(attn_mask, q: torch.Tensor):
    """A bool mask as the additive float mask the CPU lse kernel needs (it refuses bool)."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.zeros((), dtype=_bias_dtype(q), device=q.device)
    return zero.expand(attn_mask.shape).masked_fill(~attn_mask, float("-inf"))


# -- run ---------------------------------------------------------------------------------------


def _run(q, k, v, call: AttentionCall):
    if call.sinks is not None:  # merged after the kernel, from its lse (_common.merge_sinks)
        return run_with_sinks(_run, q, k, v, call)

    def attend_zeroed():
        try:
            return _attend(q, k, v, call, guard=True)
        except _StillNonFinite:
            return None

    return fused_or_exact(
        q, k, v, call, lambda: _attend(q, k, v, call), attend_zeroed, backend="sdpa"
    )


class _StillNonFinite(Exception):
    """K/V still hold NaN/Inf at keys some query attends, which SDPA's kernels would leak."""


def _attend(q, k, v, call: AttentionCall, guard: bool = False):
    """``(out, lse)`` from SDPA's kernels; with ``guard``, K/V columns no query attends are zeroed
    first, and :class:`_StillNonFinite` is raised if non-finite values remain."""
    B, Hq, Sq, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    G = Hq // Hkv

    def plan_for(flags, lower_right):
        plan = _plan(q, k, v, call, flags=flags, lower_right=lower_right, guard=guard)
        if guard and not torch.compiler.is_compiling() and not all_finite(plan.k, plan.v):
            raise _StillNonFinite
        return plan

    if call.return_lse:
        plan = plan_for(True, False)
        attn = _float_mask(plan.attn_mask, q)
        qq, kk, vv = q, plan.k, plan.v
        fold = G > 1 and _sdpa_would_use_math(qq, kk, vv, attn, plan.is_causal)
        if fold:
            plan = plan_for(False, False)
            attn = _float_mask(plan.attn_mask, q)
            kk, vv = plan.k, plan.v
            qq = q.reshape(B, Hkv, G * Sq, q.shape[3])  # (B, Hq, Sq, D) -> (B, Hkv, G·Sq, D)
            attn = None if attn is None else _fold(attn, Hkv, G)
        # The kernel reads rows as if their last dim were contiguous (public SDPA copies such
        # inputs first, e.g. a V stored transposed); without this it silently gives wrong output.
        qq, kk, vv = (t if t.stride(-1) == 1 else t.contiguous() for t in (qq, kk, vv))
        out, lse = _cpu_lse_op()(qq, kk, vv, 0.0, plan.is_causal, attn_mask=attn, scale=call.scale)
        out = out.reshape(B, Hq, Sq, Dv)  # (B, Hkv, G·Sq, Dv) -> (B, Hq, Sq, Dv) when folded
        lse = lse.reshape(B, Hq, Sq).to(accumulation_dtype(q.dtype))
        if plan.empty is not None:
            out = out.masked_fill(plan.empty, 0.0)
            lse = lse.masked_fill(plan.empty.squeeze(-1), float("-inf"))
        return out, lse

    plan = plan_for(True, True)
    kwargs = {}
    qq = q
    if G > 1:
        mask_t = plan.attn_mask if isinstance(plan.attn_mask, torch.Tensor) else None
        if _sdpa_would_use_math(q, plan.k, plan.v, mask_t, plan.is_causal):
            if plan.is_causal:
                plan = plan_for(False, False)
            qq = q.reshape(B, Hkv, G * Sq, q.shape[3])  # (B, Hq, Sq, D) -> (B, Hkv, G·Sq, D)
            if plan.attn_mask is not None:
                plan.attn_mask = _fold(plan.attn_mask, Hkv, G)
        else:
            kwargs["enable_gqa"] = True
    out = F.scaled_dot_product_attention(
        qq,
        plan.k,
        plan.v,
        attn_mask=plan.attn_mask,
        is_causal=plan.is_causal,
        scale=call.scale,
        **kwargs,
    )
    out = out.reshape(B, Hq, Sq, Dv)  # (B, Hkv, G·Sq, Dv) -> (B, Hq, Sq, Dv) when folded
    if plan.empty is not None:
        out = out.masked_fill(plan.empty, 0.0)
    return out, None


# -- cost (the yardstick of the dense costs: 1 per pair; see backends/_auto.py) -------------------

# A dense bool mask bigger than this is not worth materialising when a backend that skips tiles
# can run the case.
_DENSE_MASK_BYTES = 1 << 30
# Per pair past that size: above chunked's, so that tile skipping wins at any density, below the
# last resorts (flex on CPU, reference).
_BIG_MASK_PER_PAIR = 3.0


# Dv != D on CPU: SDPA's CPU flash kernel needs Dv == D, so it runs its unfused math kernel,
# measured 2-3x slower than chunked (benchmarks/mla.py's absorbed MLA decode: D 576, Dv 512):
# ranked just above chunked's 2 per pair.
_MATH_PER_PAIR = 2.5
_FLAG = Cost(1.0, "dense or causal work in PyTorch's fused kernel (the yardstick)", sparse=True)
_DENSE_MASK = Cost(1.0, "fused kernel with a dense mask: does all Sq·Sk work")


def _cost(q, k, v, call: AttentionCall) -> Cost:
    if q.device.type == "cpu" and v.shape[3] != q.shape[3]:
        return Cost(_MATH_PER_PAIR, "Dv != D: on CPU only SDPA's unfused math kernel runs it")
    if causal_as_flag(k, call):
        return _FLAG
    B, Hq, Sq, _ = q.shape
    n = B * Hq * Sq * k.shape[2]  # bytes of the dense bool mask
    if n > _DENSE_MASK_BYTES:
        return Cost(_BIG_MASK_PER_PAIR, f"a dense mask would take {n / 2**30:.1f} GiB")
    return _DENSE_MASK


register(
    Backend(
        "sdpa",
        _run,
        _reject,
        cost=_cost,
        supports=BASE_FIELDS["dense"] | {"sinks"},
        doc=(
            "torch.nn.functional.scaled_dot_product_attention: fused CPU/CUDA kernels; masks other "
            "than top-left causal are materialised densely; additive score mods only"
        ),
    )
)
