"""The decode fast path of :class:`~selfattn.models.decoder.CausalLM`: the blocks of a planned
paged step run as functional calls on the modules' own parameters.

Why: around its matrix products, a decode step of a 12-layer Llama spent ~14 module calls and
~46 small aten ops per layer (norms, head splits and transposes, RoPE on q and on k, the cache
write's views, the merge), and the paged layer re-checked per layer what its first layer had
checked. Here one block is ~28 ops: q and k rotate together in the fused projection's ``(B, S,
H, D)`` layout (:meth:`~selfattn.positions.RoPE.rotate_tokens_first`), the new keys and values
are written as rows of that layout (:meth:`~selfattn.cache.paged.PagedLayer.attend_rows`, whose
checks and backend choice run once per step), and no module is called.

The same ops on the same values in the same order as the modules' forwards, so the logits are
bit for bit those of the module path (``tests/models/test_decode_fast.py``). It runs only where
nothing could tell the difference (:func:`fast_blocks`), else the model calls its modules:

- eager mode without autograd (no ``torch.compile`` trace, ``torch.is_grad_enabled()`` False);
- a planned paged step, not packed: every layer's cache a
  :class:`~selfattn.cache.paged.PagedLayer`;
- every block the plain Llama layout: a pre-norm :class:`~selfattn.nn.DecoderBlock` without
  cross-attention or residual dropout, :class:`~selfattn.nn.RMSNorm` norms, a fused
  :class:`~selfattn.nn.MultiHeadAttention` without qk-norm, ALiBi, query temperature or
  attention dropout, rotating with a :class:`~selfattn.positions.RoPE` (or none), and a
  :class:`~selfattn.nn.SwiGLU`;
- no hooks: neither global module hooks nor any on the blocks' modules, and no attention
  observer or head mask (:mod:`selfattn.inspect` sets those).

The check runs at every step (~20 µs for 12 layers): the module tree it accepted is kept with
each container's children, so a module swapped in later is seen.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from selfattn._log import log_once
from selfattn.cache.paged import PagedLayer
from selfattn.nn import DecoderBlock, MultiHeadAttention, RMSNorm, SwiGLU
from selfattn.nn.norms import rms_norm
from selfattn.positions import RoPE

__all__ = ["FastBlocks", "fast_blocks"]

_silu = torch._C._nn.silu

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# torch.nn.modules.module's hooks registered for every module (register_module_forward_hook...)
_GLOBAL_HOOKS = (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
    "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
)  # fmt: skip


class _Layer:
    """One block's parts and the sizes its forward derives from them."""

    __slots__ = ("att", "down", "gate", "heads", "mlp", "norm1", "norm2", "out", "qkv", "rope",
                 "sizes", "split", "up")  # fmt: skip

    def __init__(self, block: DecoderBlock):
        att, mlp = block.self_attention, block.mlp
        self.att, self.rope = att, att.rope
        self.qkv, self.out = att.qkv_proj._parameters, att.out_proj._parameters
        self.norm1, self.norm2 = block.self_res.norm, block.mlp_res.norm
        self.gate, self.up = mlp.gate._parameters, mlp.up._parameters
        self.down, self.mlp = mlp.down._parameters, mlp
        Hq, Hkv = att.n_heads, att.n_kv_heads
        self.heads = (Hq + 2 * Hkv, att.head_dim)  # the fused projection's heads: q, k, v
        self.sizes = [Hq + Hkv, Hkv]  # rotated (q and k), not (v)
        self.split = [Hq, Hkv]


def _plain(block) -> bool:
    """Whether ``block`` has the layout the fast path computes (module docstring)."""
    if type(block) is not DecoderBlock or block.cross_attention is not None:
        return False
    att, mlp = block.self_attention, block.mlp
    if type(att) is not MultiHeadAttention or type(mlp) is not SwiGLU:
        return False
    projections = (att.qkv_proj, att.out_proj, mlp.gate, mlp.up, mlp.down)
    if any(type(p) is not nn.Linear for p in projections):  # quantised: the module path
        return False
    rope = att.rope
    return (
        all(
            type(r.norm) is RMSNorm and r.norm_first and isinstance(r.dropout, nn.Identity)
            for r in (block.self_res, block.mlp_res)
        )
        and att.fused
        and att.q_norm is None
        and (rope is None or type(rope) is RoPE)
        and isinstance(mlp.dropout, nn.Identity)
    )


class FastBlocks:
    """The fast path's view of a model's blocks (:func:`fast_blocks` builds and checks it)."""

    def __init__(self, layers: nn.ModuleList):
        blocks = list(layers)
        self.layers = [_Layer(b) for b in blocks] if all(map(_plain, blocks)) else None
        # Every module the fast path stands in for: their hook dicts (torch registers hooks
        # into these very dicts), and each container's children dict, live and as it was now:
        # comparing the two lists is one C-level loop (~2 µs a step for 12 layers).
        modules = [layers] + [m for b in blocks for m in b.modules()]
        self.hooks = [getattr(m, name) for m in modules for name in _HOOKS]
        self.children = [m._modules for m in modules]
        self.children_then = [dict(d) for d in self.children]

    def current(self) -> bool:
        """Whether no module of the tree was swapped since this view was built."""
        return self.children == self.children_then

    def unusable(self) -> str | None:
        """Why the fast path may not run now (None: it may): the layout, hooks, inspection."""
        if self.layers is None:
            return "a block is not the plain Llama layout"
        if any(getattr(_module, name, None) for name in _GLOBAL_HOOKS) or any(self.hooks):
            return "module hooks are registered"
        for p in self.layers:
            att = p.att
            if att.attention_observer is not None or att.head_mask is not None:
                return "attention is being inspected (an observer or a head mask)"
            if (
                att.q_temperature is not None
                or att.alibi is not None
                or (att.training and att.dropout > 0)
            ):
                return "an attention layer uses query temperature, ALiBi or dropout"
        return None

    def run(self, h, caches, masks, score_mod, positions):
        """``h (B, S, d_model)`` through every block (the modules' forwards, fused as the
        module docstring says); ``caches[i]`` is layer ``i``'s PagedLayer, ``masks[i]`` its
        self-attention's mask (:meth:`~selfattn.nn.DecoderBlock.causal_mask`)."""
        B, S = h.shape[0], h.shape[1]
        linear = torch._C._nn.linear
        for p, cache, mask in zip(self.layers, caches, masks):
            x = rms_norm(h, p.norm1.weight, p.norm1.eps)
            qkv = linear(x, p.qkv["weight"], p.qkv["bias"]).view(B, S, *p.heads)
            qk, v = qkv.split_with_sizes(p.sizes, 2)  # (B, S, Hq + Hkv, D), (B, S, Hkv, D)
            if p.rope is not None:
                qk = p.rope.rotate_tokens_first(qk, positions)
            q, k = qk.split_with_sizes(p.split, 2)
            att = p.att
            o = cache.attend_rows(
                q.transpose(1, 2),
                k.reshape(B * S, *k.shape[2:]),
                v.reshape(B * S, *v.shape[2:]),
                mask=mask,
                score_mod=score_mod,
                scale=att.scale,
                sinks=att.sinks,
            )  # fmt: skip  (B, Hq, S, Dv)
            # (B, Hq, S, Dv) -> (B, S, Hq·Dv); one row per sequence: a view of the same memory
            o = o.view(B, S, -1) if S == 1 and o.is_contiguous() else att.merge_heads(o)
            h = h + linear(o, p.out["weight"], p.out["bias"])
            x = rms_norm(h, p.norm2.weight, p.norm2.eps)
            act = p.mlp.activation
            act = _silu if act is F.silu else act  # the op without F.silu's Python wrapper
            g = act(linear(x, p.gate["weight"], p.gate["bias"]))
            x = g * linear(x, p.up["weight"], p.up["bias"])
            h = h + linear(x, p.down["weight"], p.down["bias"])
        return h


def fast_blocks(model, caches) -> FastBlocks | None:
    """The model's :class:`FastBlocks` when the fast path may run this step (module
    docstring), else None. ``caches``: the step's layer caches."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return None
    if not all(type(c) is PagedLayer and not c.plan.packed for c in caches):
        return None
    fast = model.__dict__.get("_fast_blocks")
    if fast is None or not fast.current():
        fast = FastBlocks(model.layers)
        model.__dict__["_fast_blocks"] = fast
    why = fast.unusable()
    if why is None:
        return fast
    log_once(("decode fast path", type(model).__name__, why), logging.INFO,
             "selfattn: %s's paged decode steps run module by module (%s), not the fast path",
             type(model).__name__, why)  # fmt: skip
    return None
