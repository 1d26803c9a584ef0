"""The decode fast path of :class:`~selfattn.models.decoder.CausalLM`: a planned paged step runs
every block's lean step (:class:`~selfattn.nn.blocks.RowsStep`) in one loop, no module called.

Why: a module call costs a few microseconds of hook dispatch, several per layer; the lean step
itself (the block's ops without its modules' forwards, q and k rotated together, the new keys
and values written as rows) is defined once, with the block, in :mod:`selfattn.nn.blocks`, and
a block's forward over a paged step's layer runs it too. Here only the checks and the loop.

It runs where nothing could tell it from the module path (:func:`fast_blocks`), the logits then
bit for bit those of the modules (``tests/models/test_decode_fast.py``):

- eager mode without autograd (no ``torch.compile`` trace, ``torch.is_grad_enabled()`` False);
- a planned paged step: every layer's cache a :class:`~selfattn.cache.paged.PagedLayer`, over
  a uniform plan (``generate``'s paged cache) or a packed one (the serving engine's steps: decode
  tokens, short chunks, prefill chunks; the layer attends each as its plan says);
- every block the plain Llama layout (:func:`~selfattn.nn.blocks.plain_layout`), whatever its
  projections are (``nn.Linear``, a GGUF model's kept-quantised linears);
- no hooks: neither global module hooks nor any on the blocks or their parts (tensor-parallel
  ranks' projections carry them), and no attention observer or head mask (:mod:`selfattn.inspect`
  sets those).

The check runs at every step (C-level loops over lists): the module tree it accepted is kept with
each container's children, so a module swapped in later is seen.
"""

from __future__ import annotations

import ctypes
import logging
from operator import is_

import torch
from torch import nn

from selfattn._log import log_once
from selfattn.cache.paged import PagedLayer
from selfattn.kernels.quant_matmul import DTYPE_CODES, float_bits, isa_code
from selfattn.nn.blocks import DecoderBlock, hook_dicts, hooks_registered
from selfattn.nn.quant import kernel_for

__all__ = ["FastBlocks", "fast_blocks", "native_blocks", "plain_blocks"]


class FastBlocks:
    """The fast path's view of a model's blocks (:func:`fast_blocks` builds and checks it)."""

    def __init__(self, layers: nn.ModuleList):
        blocks = list(layers)
        self.steps = [b.rows_step() if type(b) is DecoderBlock else None for b in blocks]
        self.plain = all(s is not None and s.att is not None for s in self.steps)
        # The hook dicts of the container, the blocks and their parts (torch registers hooks
        # into these very dicts), and each container's children dict, live and as it was now:
        # comparing the two lists is one C-level loop a step.
        own = [layers, *blocks]
        self.hooks = hook_dicts(own) + [d for s in self.steps if s is not None for d in s.hooks]
        self.children = [m._modules for m in own]
        self.children_then = [dict(d) for d in self.children]
        self.native_memo = None  # native_blocks' arguments of the blocks, kept between steps
        # Where every block's fused kernel calls read their tensors (RowsStep.kernel_slots), as
        # two flat lists, and the calls made for them last: one C-level loop a step tells
        # whether any was replaced (fused_steps then rebuilds them).
        slots = [x for s in self.steps if s is not None and s.kernel_slots for x in s.kernel_slots]
        self.slot_dicts, self.slot_keys = [d for d, _ in slots], [k for _, k in slots]
        self.fused_memo = None
        for s in self.steps:
            if s is not None:
                self.children += s.children
                self.children_then += s.children_then

    def current(self) -> bool:
        """Whether no module of the tree was swapped since this view was built."""
        return self.children == self.children_then

    def fused_steps(self, dtype) -> list:
        """Each block's fused kernel calls in ``dtype`` (:meth:`RowsStep.fused_steps
        <selfattn.nn.blocks.RowsStep.fused_steps>`; None for a block without), kept while no
        tensor they read was replaced."""
        now = list(map(dict.get, self.slot_dicts, self.slot_keys))
        memo = self.fused_memo
        if memo is not None and memo[0] is dtype and all(map(is_, memo[1], now)):
            return memo[2]
        fused = [None if s.kernel is None else s.fused_steps(dtype) for s in self.steps]
        self.fused_memo = (dtype, now, fused)
        return fused

    def unusable(self) -> str | None:
        """Why the fast path may not run now (None: it may): the layout, hooks, inspection."""
        if not self.plain:
            return "a block is not the plain Llama layout"
        if hooks_registered() or any(self.hooks):
            return "module hooks are registered"
        for s in self.steps:
            why = s.inspected()
            if why is not None:
                return why
        return None

    def run(self, h, caches, masks, score_mod, positions):
        """``h (B, S, d_model)`` through every block's lean step; ``caches[i]`` is layer
        ``i``'s PagedLayer, ``masks[i]`` its self-attention's mask
        (:meth:`~selfattn.nn.DecoderBlock.causal_mask`). Where every block's step is fused
        kernel calls and the step's attention the C paged kernel, the blocks run as one C call
        (:func:`native_blocks`)."""
        if score_mod is None:
            native = native_blocks(self, caches, masks, h, positions)
            if native is not None:
                return native(h)
        for step, cache, mask in zip(self.steps, caches, masks):
            h = step(h, cache, mask, score_mod, positions)
        return h


def native_blocks(fast: FastBlocks, caches, masks, h, positions):
    """``run(h) -> h`` through the blocks of ``fast.steps`` as one call of the quantised
    kernel's ``quant_block_steps`` (``csrc/quant_matmul.c``: each block's four fused kernel
    calls, its keys and values stored at the step's slots and the C paged-attention kernel
    called with the step's launch, :meth:`~selfattn.cache.paged.PagedLayer.native_rows`), or
    None where a block may not run there: a block whose step is not fused kernel calls in
    ``h``'s dtype, another mask or scale than the first block's, sinks, or an attention that
    does not take the C paged kernel with a launch. The same calls on the same buffers as the
    blocks' own steps (:meth:`~selfattn.nn.blocks.RowsStep.kernel_step`), so the same values.
    The blocks' arguments are kept in ``fast`` between steps (rebuilt when a block's fused
    calls were)."""
    steps = fast.steps
    B, S, d = h.shape
    M, dtype = B * S, h.dtype
    lib = kernel_for(h.view(M, d))
    if lib is None:  # a dtype or a size the kernel does not take
        return None
    fused = fast.fused_steps(dtype)
    first, mask = steps[0], masks[0]
    if any(f is None for f in fused) or any(m is not mask for m in masks):
        return None
    atts = [s.att for s in steps]
    if any(a.sinks is not None or a.scale != atts[0].scale for a in atts):
        return None
    Hq, Hkv = first.split
    D = first.heads[1]
    kv = caches[0].kv
    k_pages, v_pages = kv.k_layers, kv.v_layers
    Dv = v_pages[0].shape[-1]
    got = caches[0].native_rows(
        (B, S, Hq, D), (M, Hkv, D), (M, Hkv, Dv), dtype, mask=mask, scale=atts[0].scale
    )
    if got is None or any(c.kv is not kv or c.plan is not caches[0].plan for c in caches):
        return None
    launch, slots, scale = got
    ks, vs = k_pages[0].stride(), v_pages[0].stride()
    if ks[2:] != (D, 1) or vs[2:] != (Dv, 1):
        return None  # a slot's heads are not one contiguous row
    entry, iargs, ptrs, attn_threads, at, lse = launch.native()
    ptrs[at["SINKS"]] = None
    # every layer's page addresses: another pool may reuse the first one's memory
    values = (dtype, scale, *[t.data_ptr() for t in k_pages], *[t.data_ptr() for t in v_pages])
    objects = [part for f in fused for part in f]
    memo = fast.native_memo
    if memo is None or memo[0] != values or not all(map(is_, memo[1], objects)):
        fields = []
        for i in range(len(steps)):
            for part in fused[i]:
                fields += part.addresses()
            fields += [k_pages[i].data_ptr(), v_pages[i].data_ptr(), float_bits(scale)]
        memo = fast.native_memo = (values, objects, (ctypes.c_int64 * len(fields))(*fields))
    layers = memo[2]
    mlp_s = fused[0][2]
    factors = None if first.rope is None else first.rope.rotation_factors(positions, h)
    buffers = [torch.empty(M, n, dtype=dtype) for n in
               ((Hq + Hkv) * D + Hkv * Dv, Hq * D, Hq * Dv, mlp_s.shape[0], d)]  # fmt: skip
    rope = (0, 0, 0) if factors is None else (*(f.data_ptr() for f in factors), len(factors[0]))
    st = [
        M, d, Hq, Hkv, D, Dv, *rope,
        slots.data_ptr(), k_pages[0].shape[1], ks[0], ks[1], vs[0], vs[1],
        entry, ctypes.addressof(iargs), ctypes.addressof(ptrs),
        at["Q"], at["K"], at["V"], at["OUT"], at["LSE"],
        *(part.threads(lib) for part in fused[0]), attn_threads,
        *(b.data_ptr() for b in buffers), lse.data_ptr(),
    ]  # fmt: skip
    step_args = (ctypes.c_int64 * len(st))(*st)
    held = (factors, buffers, slots, lse, fused, memo, launch, iargs, ptrs)

    def run(h):
        h = h.reshape(M, d).clone()
        status = lib.quant_block_steps(
            layers, len(steps), step_args, h.data_ptr(), DTYPE_CODES[h.dtype],
            isa_code(lib),
        )  # fmt: skip
        if status:
            raise (MemoryError if status == 1 else RuntimeError)(
                f"quant_block_steps failed (status {status}) for {M} rows of {d}"
            )
        return h.view(B, S, d)

    run.held = held  # the tensors and arrays the call's addresses point into
    return run


def plain_blocks(model) -> bool:
    """Whether every block of ``model`` is the plain Llama layout, so that its paged decode
    steps can take the fast path (``generate``'s ``cache="auto"`` then picks the paged cache)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return False
    fast = model.__dict__.get("_fast_blocks")
    if fast is None or not fast.current():
        fast = FastBlocks(layers)
    return fast.plain


def fast_blocks(model, caches) -> FastBlocks | None:
    """The model's :class:`FastBlocks` when the fast path may run this step (module
    docstring), else None. ``caches``: the step's layer caches."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return None
    if not all(type(c) is PagedLayer for c in caches):
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
