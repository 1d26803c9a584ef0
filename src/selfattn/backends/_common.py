"""Pieces every backend shares: index grids, GQA views, the counter-based dropout and NaN guards.

How non-finite inputs behave, on every backend (each guard below serves this rule):

- A key the mask removes from a row never reaches it: NaN/Inf stored in its K or V, NaN in a
  bias entry there, or a ``q·k`` that overflows there leave the row as if the key were absent.
  A key the score mod gives ``-inf`` is not attended either, so its V never reaches the row
  (its K does: a NaN score stays NaN whatever the mod adds).
- A key a row attends passes its V on in IEEE arithmetic, ``Σ_j p_j·v_j`` over exactly the
  attended keys, whatever their weight: NaN there gives NaN, even when the weight underflows to
  0 (``0·NaN``), and ``±Inf`` gives ``±Inf`` (NaN with weight 0, or with Infs of both signs).
  That is what the C decode kernel computes, which reads every key of a row's interval and no
  other.
- NaN in a query row, or in the K of a key it attends, makes that row NaN (output and lse).

Learned attention sinks (``sinks``, :func:`merge_sinks`) add a key with no value to every row: a
row with no attended key and a finite sink gives output 0 and lse ``sink`` (the sink takes all
the weight, so "no key" still means output 0, as above); a ``-inf`` sink is no sink.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from selfattn.masks.elementwise import index_grids

__all__ = [
    "GOLDEN",
    "M32",
    "accumulation_dtype",
    "all_finite",
    "causal_as_flag",
    "dropout_keep",
    "fmix32",
    "index_grids",
    "merge_sinks",
    "needs_grad",
    "nonfinite_v_part",
    "run_with_sinks",
    "setup_per_pair",
    "sinkless",
    "sinks_merged",
    "unattended_columns_zeroed",
]

M32 = 0xFFFFFFFF
# murmur3's 32-bit finaliser constants (Appleby): a cheap, well-mixing integer hash.
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35
GOLDEN = 0x9E3779B9  # 2^32 / golden ratio, separates the hashed coordinates


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16/fp32 accumulate in fp32; fp64 stays fp64 (docs/design.md)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * _FMIX1) & M32
    x = x ^ (x >> 13)
    x = (x * _FMIX2) & M32
    return x ^ (x >> 16)


def dropout_keep(seed: int, p: float, b, h, q_idx, kv_idx) -> torch.Tensor:
    """Bool keep-mask for attention dropout, a pure function of ``(seed, b, h, q_idx, kv_idx)``.

    Counter-based (like Philox in fused kernels) rather than drawn from a generator stream, so that
    a tiled forward, its recomputing backward and the reference all drop exactly the same
    (query, key) pairs for the same seed, whatever their tiling. Each coordinate is hashed in turn
    with murmur3's finaliser; the top 24 bits give a uniform ``u`` in [0, 1) and ``u >= p`` keeps.
    """
    x = fmix32(torch.as_tensor(seed & M32, device=q_idx.device) ^ ((seed >> 32) * GOLDEN))
    for coord in (b, h, q_idx, kv_idx):
        x = fmix32(x ^ ((coord.long() + GOLDEN) & M32))
    u = (x >> 8).to(torch.float32) * (1.0 / (1 << 24))
    return u >= p


def unattended_columns_zeroed(
    k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, Hq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero K/V rows that no query of their group attends, so NaN/Inf there cannot leak.

    ``allowed`` is a bool mask broadcastable to ``(B, Hq, Sq, Sk)``. A masked key's weight is 0, but
    ``0 · NaN = NaN`` in ``P @ V``; uninitialised cache slots and padding must not poison it.
    """
    Hkv, Sk = k.shape[1], k.shape[2]
    cols = allowed.any(dim=-2)  # (B', Hq', Sk)
    if cols.shape[1] == Hq and Hq != Hkv:
        cols = cols.view(cols.shape[0], Hkv, Hq // Hkv, Sk).any(dim=2)
    # (under torch.compile the shortcut would be a data-dependent branch: always fill)
    if not torch.compiler.is_compiling() and bool(cols.all()):
        return k, v
    keep = cols.unsqueeze(-1)  # (B', Hkv', Sk, 1)
    return k.masked_fill(~keep, 0), v.masked_fill(~keep, 0)


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, inplace=False):
    """``(out', lse')`` of attention whose rows also have the learned sink logit of their head in
    the softmax denominator, from ``(out, lse)`` computed without it: exact, not an approximation.

    ``out (B, Hq, Sq, Dv)``, ``lse (B, Hq, Sq)`` (its dtype is the accumulation dtype), ``sinks
    (Hq,)``. The sink is one more key with score ``sink`` and value 0, so the weights of the real
    keys shrink by ``w = exp(lse - lse')`` with ``lse' = logaddexp(lse, sink)``, i.e. ``w =
    sigmoid(lse - sink)``, and nothing is added to the output. Differentiable in ``out``, ``lse``
    and ``sinks`` (the backends whose lse has gradients run sinks this way, a ring merges them
    once after its blocks): ``d sink = -Σ (1 - w) · (rowsum(dO' ∘ O') - dlse')``, the sink's
    weight times ``-Δ`` of the flash backward. Rows with ``lse' = -inf`` (no key, sink ``-inf``)
    keep output 0 with zero gradients. ``inplace``: scale ``out`` itself (a backend's fresh
    output that autograd does not track; one pass less over it).
    """
    acc = lse.dtype
    s = sinks.to(acc).view(1, -1, 1)  # (Hq,) -> (1, Hq, 1)
    merged = torch.logaddexp(lse, s)
    dead = merged == -math.inf  # both -inf: exp(-inf - -inf) would be NaN
    w = torch.exp(lse.masked_fill(dead, 0) - merged.masked_fill(dead, 0)).masked_fill(dead, 0)
    if inplace:  # computed in acc, rounded once into out's dtype (type promotion)
        return out.mul_(w.unsqueeze(-1)), merged
    return (out.to(acc) * w.unsqueeze(-1)).to(out.dtype), merged  # one rounding, as the kernels'


def sinkless(call):
    """The call without its sinks and with the lse it needs to merge them (:func:`merge_sinks`)."""
    return dataclasses.replace(call, sinks=None, return_lse=True)


def run_with_sinks(run, *args):
    """``run(*args)`` (a backend's arguments, the call last) for a call with sinks, through the lse
    of the call without them: what chunked, sdpa, flex and the PyTorch paged path do (their lse
    is exact and differentiable, the sink merged after it; the C and Triton decode kernels merge
    it where their key splits merge)."""
    call = args[-1]
    out, lse = run(*args[:-1], sinkless(call))
    out, lse = merge_sinks(out, lse, call.sinks, inplace=not needs_grad([out, lse, call.sinks]))
    return out, (lse if call.return_lse else None)


def sinks_merged(run):
    """``run`` that also runs calls with sinks (:func:`run_with_sinks`): the PyTorch paged
    backend's."""

    @functools.wraps(run)
    def wrapped(*args):
        return run(*args) if args[-1].sinks is None else run_with_sinks(run, *args)

    return wrapped


def setup_per_pair(setup_pairs: float, q, k) -> float:
    """A per-call set-up worth ``setup_pairs`` yardstick pairs, spread over the call's
    ``B·Hq·Sq·Sk`` (query, key) pairs: a :class:`~selfattn.backends.base.Cost`'s ``fixed``."""
    return setup_pairs / max(1, q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])


def needs_grad(tensors) -> bool:
    """Whether autograd will differentiate through ``tensors``: grad mode is on and one of them
    requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def grad_needed(q, k, v, call) -> bool:
    """Whether autograd will run this call's backward: q, k, v or a tensor the score mod reads
    (a learnable bias) or the sinks need grad."""
    mod = call.score_mod.tensors() if call.score_mod is not None else ()
    sinks = () if call.sinks is None else (call.sinks,)
    return needs_grad([q, k, v, *mod, *sinks])


def causal_as_flag(k, call) -> bool:
    """Whether the call has no mask, or a ``causal()`` that SDPA runs without a dense mask: with
    ``is_causal`` (top-left, ``q_offset == 0``; SDPA refuses it together with a float mask, i.e.
    an additive score mod) or with no mask at all (every row sees every key, ``q_offset >=
    Sk - 1``: decoding). For the cost hooks: on such work PyTorch's fused kernels are fastest."""
    if call.mask is None:
        return True
    if not call.mask.is_causal:
        return False
    return call.q_offset >= k.shape[2] - 1 or (call.q_offset == 0 and call.score_mod is None)


def score_terms(q, k, call) -> tuple | str:
    """The call's score mod as kernel data (``ScoreMod.kernel_terms``: alibi, bias, softcap
    terms, each at most once, in order: the soft cap last, as the triton and cpu_fused kernels
    apply them, or followed by ALiBi alone, flash-attn's order, which cpu_fused also applies
    (:func:`cap_before_alibi`)); ``()`` without a score mod; else the reason a kernel cannot run
    it."""
    if call.score_mod is None:
        return ()
    found = call.score_mod.kernel_terms(call.q_offset, q.shape[2], k.shape[2])
    if found is None:
        return f"score_mod {call.score_mod!r} is not made of alibi, bias and softcap terms"
    kinds = [name for name, _ in found]
    if any(kinds.count(name) > 1 for name in kinds):
        return f"score_mod {call.score_mod!r} repeats a term (the kernel applies each once)"
    if "softcap" in kinds and kinds[kinds.index("softcap") + 1 :] not in ([], ["alibi"]):
        return (
            f"score_mod {call.score_mod!r} adds a bias after its softcap (the kernel caps last, "
            "or before ALiBi alone)"
        )
    return found


def cap_before_alibi(terms: tuple) -> bool:
    """Whether :func:`score_terms`' ``terms`` put the soft cap before ALiBi (flash-attn's order)."""
    kinds = [name for name, _ in terms]  # each at most once (score_terms)
    return "softcap" in kinds and kinds[-1] == "alibi"


def learned_bias(terms: tuple) -> bool:
    """Whether ``terms`` (:func:`score_terms`) hold a bias that needs a gradient now."""
    return any(
        name == "bias" and value.requires_grad and torch.is_grad_enabled() for name, value in terms
    )


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of ``tensors`` is finite: one sum per tensor and one sync.

    A sum is finite iff every term is, barring overflow of the sum itself (fp16's range, huge
    finite values, ``inf - inf`` across tensors), which only costs an exact elementwise check.
    ``t.sum()`` accumulates half types in float32 internally; ``sum(dtype=float32)`` would
    convert the tensor first (5x slower for bf16 on CPU).
    """
    total = functools.reduce(torch.add, [t.detach().sum() for t in tensors])  # one sync, few ops
    return math.isfinite(total) or all(bool(torch.isfinite(t).all()) for t in tensors)


def nonfinite_v_part(p: torch.Tensor, attended: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What the non-finite entries of ``v`` add to ``P V`` when each row reads only its keys.

    ``p (..., R, n)`` weights, ``attended (..., R, n)`` bool, ``v (..., n, Dv)`` the values of
    those ``n`` keys (typically only the keys whose V holds NaN/Inf). Returns ``(..., R, Dv)``, to
    add to ``P V`` computed with those entries replaced by 0: IEEE arithmetic on the attended
    terms only (module docstring), found by counting with matmuls, so that no ``0 · NaN`` of an
    unattended key is ever formed.
    """
    f = p.dtype
    att = attended.to(f)
    weightless = (attended & (p == 0)).to(f)  # 0 · ±Inf = NaN
    positive = (p > 0).to(f)
    nan = att @ v.isnan().to(f) + weightless @ v.isinf().to(f)
    up = positive @ (v == math.inf).to(f)
    down = positive @ (v == -math.inf).to(f)
    out = torch.zeros_like(nan)
    out.masked_fill_(up > 0, math.inf).masked_fill_(down > 0, -math.inf)
    return out.masked_fill_((nan > 0) | ((up > 0) & (down > 0)), math.nan)
