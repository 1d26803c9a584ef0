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

import logging

import torch
from torch import nn

from selfattn._log import log_once
from selfattn.cache.paged import PagedLayer
from selfattn.nn.blocks import DecoderBlock, hook_dicts, hooks_registered

__all__ = ["FastBlocks", "fast_blocks", "plain_blocks"]


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
        for s in self.steps:
            if s is not None:
                self.children += s.children
                self.children_then += s.children_then

    def current(self) -> bool:
        """Whether no module of the tree was swapped since this view was built."""
        return self.children == self.children_then

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
        (:meth:`~selfattn.nn.DecoderBlock.causal_mask`)."""
        for step, cache, mask in zip(self.steps, caches, masks):
            h = step(h, cache, mask, score_mod, positions)
        return h


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
