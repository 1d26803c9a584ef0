"""Plan once per step, run per layer: :class:`PagedAttentionPlan`.

A decode step over a model's paged KV calls ``paged_attention`` once per layer with the same
block table, lengths and (layer kinds aside) mask; only ``q`` and the layer's pages change. A
plan does the shared part once::

    plan = PagedAttentionPlan(block_table, seq_lens)        # once per step
    for i in range(L):                                      # per layer: q and the pages only
        out = paged_attention(q_i, k_pages[i], v_pages[i], block_table, seq_lens, mask=m,
                              plan=plan)

What it keeps per step: the value checks of the table and lengths (per pool shape), and per
distinct ``(mask, score_mod)`` object and layer layout (shapes, dtypes, strides, devices,
gradients) the normalised mask and score mod, the backend ``auto`` picks, and what that backend's
``plan`` hook derives from the table, lengths and mask (the kernels' key intervals and key
splits, the PyTorch path's page ranges). Masks are told apart by object identity: a model
that builds one mask per kind of layer for the step (``CausalLM``) prepares each once.

A plan is an eager-mode cache: under ``torch.compile`` ``paged_attention`` ignores it and traces
the unplanned call (the graph computes the intervals itself). An in-place change of the table or
the lengths (seen by their version counters) makes the plan check and prepare again, so a page id
outside the pool never reaches a kernel; inference-mode tensors have no version counter, and
there the plan trusts that they do not change while it is used (build one per step).
"""

from __future__ import annotations

import dataclasses

import torch

from selfattn.backends.base import registry
from selfattn.backends.paged.call import (
    PagedCall,
    bound_objects,
    check_shapes,
    check_values,
    layer_call,
)

__all__ = ["PagedAttentionPlan"]


class PagedAttentionPlan:
    """The per-step half of ``paged_attention`` over ``block_table (B, max_pages)`` int32 and
    ``seq_lens (B,)`` (module docstring); pass it as ``paged_attention(..., plan=plan)`` with
    these very tensors. ``valid_for=(N, P, Sq)``: the maker of the tensors vouches that they
    pass the value checks for pools of ``N`` pages of ``P`` tokens and ``Sq`` queries (a
    :class:`~selfattn.cache.PagedKV` for its own step), which then never read them."""

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, *, valid_for=None):
        self.block_table, self.seq_lens = block_table, seq_lens
        # (N, P, Sq) found valid; ``valid_for``: one its maker vouches for (a PagedKV's own
        # table and lengths, for its pool and step), not read again
        self._values_checked: set[tuple[int, int, int]] = set()
        if valid_for is not None:
            self._values_checked.add(tuple(valid_for))
        # layer key -> (mask and score mod as given: they keep their ids unique while the plan
        # lives, the backend, the normalised mask and score mod, the backend's planned state)
        self._prepared: dict[tuple, tuple] = {}
        # (layer key, scale, ids of the scales and sinks, return_lse) -> the checked PagedCall:
        # the layers of a step mostly pass equal ones (it holds the tensors: ids stay unique)
        self._calls: dict[tuple, PagedCall] = {}
        # Versioned: both tensors (not inference-mode ones, which have no counter; a tensor's
        # mode never changes), read at every layer.
        self._versioned = all(
            isinstance(t, torch.Tensor) and not t.is_inference() for t in (block_table, seq_lens)
        )
        self._versions = self._versions_now()

    def prepare(
        self, q, k_pages, v_pages, *, mask=None, score_mod=None, scale=None, k_scales=None,
        v_scales=None, backend: str = "auto", return_lse: bool = False, sinks=None, holes=None,
    ):  # fmt: skip
        """``(backend, PagedCall)`` for one layer's call: checked and chosen at the first layer
        of each layout, then only the layer's scale and dequantisation scales."""
        tensor = torch.Tensor
        if not (
            isinstance(q, tensor) and isinstance(k_pages, tensor) and isinstance(v_pages, tensor)
        ):
            check_shapes(q, k_pages, v_pages, self.block_table, self.seq_lens)  # names the bad one
        grad = torch.is_grad_enabled() and (
            q.requires_grad or k_pages.requires_grad or v_pages.requires_grad
        )
        # sinks are per layer (checked in layer_call); whether they are given or need gradients
        # can change the backend (the kernels have no backward)
        sink_kind = None if sinks is None else bool(torch.is_grad_enabled() and sinks.requires_grad)
        key = (
            id(mask), id(score_mod), backend, grad, sink_kind, holes is None,
            q.shape, q.dtype, q.device,
            k_pages.shape, k_pages.dtype, k_pages.device, k_pages.stride(),
            v_pages.shape, v_pages.dtype, v_pages.device, v_pages.stride(),
        )  # fmt: skip
        versions = self._versions_now()
        if versions != self._versions:  # changed in place: check and prepare again
            self._prepared.clear()
            self._values_checked.clear()  # the maker's word was for the tensors as they were
            self._calls.clear()
            self._versions = versions
        # A scale of another type (a bool, a tensor) is never memoised: layer_call rejects it.
        plain = scale is None or type(scale) is float or type(scale) is int
        call_key = (
            (key, scale, id(k_scales), id(v_scales), id(sinks), id(holes), return_lse)
            if plain
            else None
        )
        hit = self._prepared.get(key)
        if hit is None:  # the layer's call comes with it, planned: not built a second time
            hit, call = self._prepare(q, k_pages, v_pages, mask, score_mod, scale, k_scales,
                                      v_scales, backend, return_lse, sinks, holes)  # fmt: skip
            self._prepared[key] = hit
        else:
            call = self._calls.get(call_key) if plain else None
            if call is not None:
                return hit[2], call
            _, _, _, mask_obj, mod_obj, planned = hit
            call = layer_call(q, k_pages, v_pages, mask_obj, mod_obj, scale, k_scales, v_scales,
                              return_lse, planned, sinks=sinks, holes=holes)  # fmt: skip
        if plain:
            self._calls[call_key] = call
        return hit[2], call

    def _versions_now(self) -> tuple[int, int] | None:
        if not self._versioned:  # not tensors (check_shapes names them at the first call)
            return None
        return self.block_table._version, self.seq_lens._version

    def _prepare(self, q, k_pages, v_pages, mask, score_mod, scale, k_scales, v_scales, backend,
                 return_lse, sinks, holes=None) -> tuple[tuple, PagedCall]:  # fmt: skip
        """``(entry of _prepared, this layer's planned PagedCall)``."""
        args = (q, k_pages, v_pages, self.block_table, self.seq_lens)
        check_shapes(*args)
        shape = (k_pages.shape[0], k_pages.shape[1], q.shape[2])  # (N, P, Sq)
        if shape not in self._values_checked:
            check_values(q, k_pages, self.block_table, self.seq_lens)
            self._values_checked.add(shape)
        mask_obj, mod_obj = bound_objects(mask, score_mod, q, self.seq_lens)
        call: PagedCall = layer_call(
            q,
            k_pages,
            v_pages,
            mask_obj,
            mod_obj,
            scale,
            k_scales,
            v_scales,
            return_lse,
            sinks=sinks,
            holes=holes,
        )
        chosen, _ = registry("paged").select(*args, call, backend=backend)
        planned = None if chosen.plan is None else chosen.plan(*args, call)
        entry = (mask, score_mod, chosen, mask_obj, mod_obj, planned)
        return entry, dataclasses.replace(call, planned=planned)

    def __repr__(self) -> str:
        return (
            f"PagedAttentionPlan(B={self.block_table.shape[0]}, "
            f"max_pages={self.block_table.shape[1]}, prepared={len(self._prepared)})"
        )
