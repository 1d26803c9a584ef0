"""Transformer blocks built from injected parts: ``EncoderBlock`` and ``DecoderBlock``.

Each block takes its attention, feed-forward and norm modules ready-made (torchtune's component
style), so one block class serves BERT (post-norm, LayerNorm, GELU) and Llama (pre-norm, RMSNorm,
SwiGLU) alike.

A :class:`DecoderBlock` of the plain Llama layout also has a lean step over a cache that attends
rows (:class:`RowsStep`, the block's :meth:`~DecoderBlock.rows_step`): the same ops on the same
values in the same order as its modules' forwards, without calling them. Its forward takes it for
a planned paged step's layer when nothing could tell the difference, and a
:class:`~selfattn.models.CausalLM` runs every block's lean step in one loop
(:mod:`selfattn.models.decode_fast`): one definition of a block's step for ``generate``, the
serving engine and the server.
"""

from __future__ import annotations

from operator import is_

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from selfattn import masks as _masks
from selfattn.cache.paged import PagedLayer
from selfattn.kernels.quant_matmul import isa_code
from selfattn.nn.attention import MultiHeadAttention, positions_after
from selfattn.nn.mlp import MLP, SwiGLU, apply_dropout
from selfattn.nn.norms import LayerNorm, RMSNorm, rms_norm
from selfattn.nn.quant import QuantizedLinear, kernel_for
from selfattn.positions import RoPE

__all__ = [
    "MLP",
    "DecoderBlock",
    "EncoderBlock",
    "LayerNorm",
    "RMSNorm",
    "Residual",
    "RowsStep",
    "SwiGLU",
    "hooks_registered",
]


class Residual(nn.Module):
    """``x + dropout(f(norm(x)))`` (pre-norm) or ``norm(x + dropout(f(x)))`` (post-norm)."""

    def __init__(self, norm: nn.Module, norm_first: bool, dropout: float):
        super().__init__()
        self.norm = norm
        self.norm_first = norm_first
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x, f):
        if self.norm_first:
            return x + apply_dropout(self.dropout, f(self.norm(x)))
        return self.norm(x + apply_dropout(self.dropout, f(x)))


# Masks are immutable: one causal() serves every block. ``causal() & mask`` is kept for the last
# few mask objects, so that the blocks of one step pass the same mask object to their caches (a
# planned paged step prepares each mask object once, not once per layer).
_CAUSAL = _masks.causal()
_WITH_CAUSAL: dict[int, tuple] = {}  # id(mask) -> (mask, causal & mask)
_WITH_CAUSAL_KEEP = 8  # masks a model uses in one step: one per kind of layer


def _with_causal(mask):
    """``causal() & mask`` (``causal()`` for None); the same object for the same ``mask``."""
    if mask is None:
        return _CAUSAL
    if not isinstance(mask, _masks.Mask) or torch.compiler.is_compiling():
        return _CAUSAL & mask
    hit = _WITH_CAUSAL.get(id(mask))  # the entry holds the mask: its id is not reused
    if hit is None:
        if len(_WITH_CAUSAL) >= _WITH_CAUSAL_KEEP:
            _WITH_CAUSAL.clear()  # masks of earlier steps
        hit = _WITH_CAUSAL[id(mask)] = (mask, _CAUSAL & mask)
    return hit[1]


# -- the lean step of a plain Llama-layout block ---------------------------------------------------

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# torch.nn.modules.module's hooks registered for every module (register_module_forward_hook...)
_GLOBAL_HOOKS = (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
    "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
)  # fmt: skip
_linear = torch._C._nn.linear  # F.linear's op, without its Python wrapper
_silu = torch._C._nn.silu


def hooks_registered() -> bool:
    """Whether a global module hook is registered (``register_module_forward_hook`` ...): it
    would see every module a lean step stands in for."""
    return any(getattr(_module, name, None) for name in _GLOBAL_HOOKS)


def hook_dicts(modules) -> list:
    """The hook dicts of ``modules``: torch registers a module's hooks into these very dicts,
    so ``any(hook_dicts(...))`` taken once stays current."""
    return [getattr(m, name) for m in modules for name in _HOOKS]


def _projection(m: nn.Module) -> tuple:
    """How a lean step calls the projection ``m`` without the module call's hook dispatch:
    ``(parameters, None)`` for an ``nn.Linear`` (the functional op on its weight and bias, read
    at each call), else ``(None, m)``, called as ``m.forward(x)`` (a quantised linear, any
    Linear-like module; its forward looked up at each call, as the module call does)."""
    if type(m) is nn.Linear:
        return m._parameters, None
    return None, m


def _project(proj: tuple, x: torch.Tensor) -> torch.Tensor:
    params, module = proj
    if params is None:
        return module.forward(x)
    return _linear(x, params["weight"], params["bias"])


def plain_layout(block) -> bool:
    """Whether ``block`` has the layout a :class:`RowsStep` computes: a pre-norm
    :class:`DecoderBlock` without cross-attention or residual dropout, :class:`RMSNorm` norms, a
    fused :class:`MultiHeadAttention` without qk-norm or output gate, rotating with a
    :class:`~selfattn.positions.RoPE` (or none), and a :class:`SwiGLU` without dropout. Its
    projections may be any modules (``nn.Linear``, a quantised linear)."""
    if type(block) is not DecoderBlock or block.cross_attention is not None:
        return False
    att, mlp = block.self_attention, block.mlp
    if type(att) is not MultiHeadAttention or type(mlp) is not SwiGLU:
        return False
    rope = att.rope
    return (
        all(
            type(r.norm) is RMSNorm and r.norm_first and isinstance(r.dropout, nn.Identity)
            for r in (block.self_res, block.mlp_res)
        )
        and att.fused
        and att.q_norm is None
        and att.gate_proj is None
        and (rope is None or type(rope) is RoPE)
        and isinstance(mlp.dropout, nn.Identity)
    )


class RowsStep:
    """A plain Llama-layout :class:`DecoderBlock`'s step (:func:`plain_layout`) over a planned
    paged step's layer (:class:`~selfattn.cache.paged.PagedLayer`, whose ``attend_rows`` it
    calls), without calling a module: norm, the fused q/k/v projection, RoPE on q and k
    together in the projection's ``(B, S, H, D)`` layout
    (:meth:`~selfattn.positions.RoPE.rotate_tokens_first`), the new keys and values written as
    rows of that layout, the out projection and residual, norm, SwiGLU and residual: about 30
    ops where the modules' forwards make ~14 module calls and ~46 small ops (head splits and
    transposes, RoPE on q and on k, the cache write's views).

    The same ops on the same values in the same order as the modules' forwards, so its output
    is bit for bit theirs. Where every projection is a :class:`~selfattn.nn.QuantizedLinear`
    the C kernel runs (a GGUF model's, ``quantize_``'s), a step of at most ``KERNEL_ROWS``
    tokens is four kernel calls and the attention (:meth:`kernel_step`): the norm before a
    projection, RoPE after the q/k/v one, SwiGLU's gate and up together, and each residual sum
    fused into its projection's call, each rounded as its op rounds (the same values but for
    the order of the norm's sum of squares). Built by :meth:`DecoderBlock.rows_step`, which
    keeps the block's module tree as it was (:meth:`current`); :meth:`unusable` says when it
    may not stand in for the modules (hooks, inspection).
    """

    __slots__ = ("att", "children", "children_then", "down", "fused", "gate", "heads", "hooks",
                 "kernel", "kernel_slots", "mlp", "norm1", "norm2", "out", "qkv", "rope", "sizes",
                 "split", "up")  # fmt: skip

    def __init__(self, block: DecoderBlock):
        modules = list(block.modules())
        # The block's own hooks run around its forward (the lean step runs inside it): only
        # its parts' hooks tell whether the step may stand in for their forwards.
        self.hooks = hook_dicts(modules[1:])
        self.children = [m._modules for m in modules]
        self.children_then = [dict(d) for d in self.children]
        self.att = self.kernel = self.fused = self.kernel_slots = None
        if not plain_layout(block):
            return
        att, mlp = block.self_attention, block.mlp
        self.att, self.rope, self.mlp = att, att.rope, mlp
        self.qkv, self.out = _projection(att.qkv_proj), _projection(att.out_proj)
        self.gate, self.up, self.down = map(_projection, (mlp.gate, mlp.up, mlp.down))
        self.norm1, self.norm2 = block.self_res.norm, block.mlp_res.norm
        Hq, Hkv = att.n_heads, att.n_kv_heads
        self.heads = (Hq + 2 * Hkv, att.head_dim)  # the fused projection's heads: q, k, v
        self.sizes = [Hq + Hkv, Hkv]  # rotated (q and k), not (v)
        self.split = [Hq, Hkv]
        self.kernel = _kernel_parts(block)
        if self.kernel is not None:  # what fused_steps compares at each step, where it is read
            norms = (self.norm1, self.norm2)
            self.kernel_slots = [(n.__dict__, "eps") for n in norms]
            self.kernel_slots += [(n._parameters, "weight") for n in norms]
            for p in self.kernel:
                self.kernel_slots += p.kernel_slots()

    def current(self) -> bool:
        """Whether no module of the block was swapped since this step was built."""
        return self.children == self.children_then

    def unusable(self) -> str | None:
        """Why the step may not stand in for the block's modules now (None: it may): the
        layout, hooks on its parts, :meth:`inspected`. Global hooks: :func:`hooks_registered`."""
        if self.att is None:
            return "a block is not the plain Llama layout"
        if any(self.hooks):
            return "module hooks are registered"
        return self.inspected()

    def inspected(self) -> str | None:
        """Why the attention's forward must run (None: it need not): an attention observer
        or a head mask (:mod:`selfattn.inspect` sets those), query temperature, ALiBi or
        attention dropout."""
        att = self.att
        if att.attention_observer is not None or att.head_mask is not None or att.hooks is not None:
            return "attention is being inspected (an observer, hooks or a head mask)"
        if (
            att.q_temperature is not None
            or att.alibi is not None
            or (att.training and att.dropout > 0)
        ):
            return "an attention layer uses query temperature, ALiBi or dropout"
        return None

    def __call__(self, h, cache, mask, score_mod, positions):
        """``h (B, S, d_model)`` through the block; ``cache``: its layer's cache of the step
        (``attend_rows``), ``mask``: its self-attention's (:meth:`DecoderBlock.causal_mask`),
        ``positions``: the tokens' RoPE positions, ``(S,)`` or ``(B, S)``."""
        if self.kernel is not None:
            out = self.kernel_step(h, cache, mask, score_mod, positions)
            if out is not None:
                return out
        B, S = h.shape[0], h.shape[1]
        norm = self.norm1
        x = rms_norm(h, norm.weight, norm.eps)
        qkv = _project(self.qkv, x).view(B, S, *self.heads)
        qk, v = qkv.split_with_sizes(self.sizes, 2)  # (B, S, Hq + Hkv, D), (B, S, Hkv, D)
        if self.rope is not None:
            qk = self.rope.rotate_tokens_first(qk, positions)
        q, k = qk.split_with_sizes(self.split, 2)
        o = self._attend(cache, q, k, v, mask, score_mod)
        h = h + _project(self.out, o)
        norm = self.norm2
        x = rms_norm(h, norm.weight, norm.eps)
        act = self.mlp.activation
        act = _silu if act is F.silu else act  # the op without F.silu's Python wrapper
        x = act(_project(self.gate, x)) * _project(self.up, x)
        return h + _project(self.down, x)

    def _attend(self, cache, q, k, v, mask, score_mod):
        """``q (B, S, Hq, D)``, this step's ``k``, ``v (B, S, Hkv, ·)`` through the layer's
        cache (``attend_rows``): the merged heads ``(B, S, Hq·Dv)``."""
        B, S, att = q.shape[0], q.shape[1], self.att
        return cache.attend_rows(
            q,
            k.reshape(B * S, *k.shape[2:]),
            v.reshape(B * S, *v.shape[2:]),
            mask=mask,
            score_mod=score_mod,
            scale=att.scale,
            sinks=att.sinks,
        )

    def kernel_step(self, h, cache, mask, score_mod, positions):
        """:meth:`__call__` as four quantised-kernel calls and the attention (class docstring);
        None where the kernel does not run for ``h`` (the caller runs the ops)."""
        B, S, d = h.shape
        x = h.reshape(B * S, d)
        lib = kernel_for(x)
        steps = None if lib is None else self.fused_steps(h.dtype)
        if steps is None:
            return None
        qkv_s, out_s, mlp_s, down_s = steps
        isa = isa_code(lib)
        factors = None if self.rope is None else self.rope.rotation_factors(positions, h)
        qkv = qkv_s(x.contiguous(), lib, isa, factors=factors)
        q, k, v = qkv.view(B, S, *self.heads).split_with_sizes(self.split + self.split[1:], 2)
        o = self._attend(cache, q, k, v, mask, score_mod)
        x = out_s(o.reshape(B * S, -1).contiguous(), lib, isa, residual=x)
        a = mlp_s(x, lib, isa)
        return down_s(a, lib, isa, residual=x).view(B, S, d)

    def fused_steps(self, dtype) -> tuple | None:
        """The kernel calls ``(qkv, out, gate with up, down)``
        (:meth:`~selfattn.nn.QuantizedLinear.fused_step`), rebuilt when a layer's tensors (its
        weights, its dtype: :meth:`~selfattn.nn.QuantizedLinear.kernel_tensors`), a norm's
        weight or eps, or ``dtype`` changed; None where the modules' dtypes are not all
        ``dtype`` (their rounding would differ) or a layer cannot be fused."""
        key = [dtype, *[d.get(k) for d, k in self.kernel_slots]]
        fused = self.fused
        if fused is not None and len(fused[0]) == len(key) and all(map(is_, fused[0], key)):
            return fused[1]
        norm1, norm2 = self.norm1, self.norm2
        n1, n2 = norm1.weight, norm2.weight
        qkv_m, out_m, gate_m, up_m, down_m = self.kernel
        if any(p.dtype != dtype for p in self.kernel) or any(
            w is not None and w.dtype != dtype for w in (n1, n2)
        ):
            self.fused = (key, None)
            return None
        rope = None
        if self.rope is not None:
            rope = (self.sizes[0], self.heads[1], self.rope.rotary_dim)
        steps = (
            qkv_m.fused_step(norm=(n1, norm1.eps), rope=rope),
            out_m.fused_step(),
            gate_m.fused_step(norm=(n2, norm2.eps), pair=up_m),
            down_m.fused_step(),
        )
        steps = None if any(s is None for s in steps) else steps
        self.fused = (key, steps)
        return steps


def _kernel_parts(block) -> tuple | None:
    """A plain-layout block's projections ``(qkv, out, gate, up, down)`` when a
    :class:`RowsStep` may run them as fused kernel calls: every one a
    :class:`~selfattn.nn.QuantizedLinear`, gate and up of one kind, SiLU, RoPE half-split (or
    none); else None. (The dtypes are checked at each step: ``.to()`` changes them.)"""
    att, mlp = block.self_attention, block.mlp
    parts = (att.qkv_proj, att.out_proj, mlp.gate, mlp.up, mlp.down)
    if not all(type(p) is QuantizedLinear for p in parts) or mlp.activation is not F.silu:
        return None
    gate, up = mlp.gate, mlp.up
    if (gate.kind, gate.out_features) != (up.kind, up.out_features):
        return None
    if att.rope is not None and att.rope.interleaved:
        return None
    return parts


def _rows_cache(cache) -> bool:
    """Whether ``cache`` is a layer cache a :class:`RowsStep` may attend through now: a
    planned paged step's layer (exactly: a subclass may attend otherwise, as the streaming
    pages' re-rotating layer does), in eager mode without autograd."""
    return (
        type(cache) is PagedLayer
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


class EncoderBlock(nn.Module):
    """Bidirectional self-attention then feed-forward, each with a residual and a norm.

    ``x (B, S, d_model) -> (B, S, d_model)``. ``norm_first=True`` is pre-norm (GPT-2, Llama);
    ``False`` is post-norm (the original Transformer, BERT). ``dropout`` applies to each residual
    branch (attention dropout lives in ``attention``).
    """

    def __init__(
        self,
        attention: MultiHeadAttention,
        mlp: nn.Module,
        attn_norm: nn.Module,
        mlp_norm: nn.Module,
        *,
        norm_first: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.attention, self.mlp = attention, mlp
        self.attn_res = Residual(attn_norm, norm_first, dropout)
        self.mlp_res = Residual(mlp_norm, norm_first, dropout)

    def forward(self, x: torch.Tensor, *, mask=None, score_mod=None, positions=None):
        """``mask``/``score_mod``/``positions`` go to the attention (e.g. a key-padding mask)."""
        x = self.attn_res(
            x, lambda h: self.attention(h, mask=mask, score_mod=score_mod, positions=positions)
        )
        return self.mlp_res(x, self.mlp)


class DecoderBlock(nn.Module):
    """Causal self-attention, optional cross-attention to an encoder output, then feed-forward.

    ``x (B, Sq, d_model)``, ``context (B, Sk, kdim)`` -> ``(B, Sq, d_model)``. Self-attention is
    always causal (``masks.causal()`` at absolute positions, so a ``ContiguousCache`` decode sees
    exactly the keys a full forward would); ``mask`` is ANDed with it (key padding, documents).
    """

    def __init__(
        self,
        self_attention: MultiHeadAttention,
        mlp: nn.Module,
        self_norm: nn.Module,
        mlp_norm: nn.Module,
        *,
        cross_attention: MultiHeadAttention | None = None,
        cross_norm: nn.Module | None = None,
        norm_first: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        if (cross_attention is None) != (cross_norm is None):
            raise ValueError("cross_attention and cross_norm go together: pass both or neither")
        self.self_attention, self.cross_attention, self.mlp = self_attention, cross_attention, mlp
        self.self_res = Residual(self_norm, norm_first, dropout)
        self.cross_res = None if cross_norm is None else Residual(cross_norm, norm_first, dropout)
        self.mlp_res = Residual(mlp_norm, norm_first, dropout)

    @staticmethod
    def causal_mask(mask):
        """The mask of the self-attention: ``causal() & mask`` (``causal()`` for None), the same
        object for the same ``mask`` (across the blocks of one step)."""
        return _with_causal(mask)

    def rows_step(self) -> RowsStep:
        """The block's lean step (:class:`RowsStep`), rebuilt when a module of the block was
        swapped since it was built."""
        step = self.__dict__.get("_rows_step")
        if step is None or not step.current():
            step = self.__dict__["_rows_step"] = RowsStep(self)
        return step

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask=None,
        context_mask=None,
        score_mod=None,
        positions=None,
        cache=None,
    ):
        """``context_mask`` (bool ``(B, 1, 1, Sk)``, True = attend) masks the encoder keys.

        Over a planned paged step's layer (a :class:`~selfattn.cache.paged.PagedLayer`), without
        autograd, hooks on the block's parts or inspection, the block runs its lean step
        (:class:`RowsStep`): the same output bit for bit."""
        if context is None and cache is not None and _rows_cache(cache):
            step = self.rows_step()
            if step.unusable() is None and not hooks_registered():
                if positions is None and step.rope is not None:
                    positions = positions_after(cache, x.shape[0], x.shape[1], x.device)
                return step(x, cache, self.causal_mask(mask), score_mod, positions)
        if (context is None) != (self.cross_attention is None):
            raise ValueError(
                "context must be given exactly when the block has cross_attention "
                f"(has cross_attention: {self.cross_attention is not None}, "
                f"context given: {context is not None})"
            )
        causal = self.causal_mask(mask)
        x = self.self_res(
            x,
            lambda h: self.self_attention(
                h, mask=causal, score_mod=score_mod, positions=positions, cache=cache
            ),
        )
        if self.cross_res is not None:
            x = self.cross_res(x, lambda h: self.cross_attention(h, context, mask=context_mask))
        return self.mlp_res(x, self.mlp)
