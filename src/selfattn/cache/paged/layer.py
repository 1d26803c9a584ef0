"""The attention views of a paged KV cache: what a model's attention module receives.

:class:`PagedLayer` is layer ``i``'s cache for one planned step (the in-place contract,
:class:`~selfattn.cache.base.InPlaceKVCache`): its ``attend`` writes the step's K/V at the
planned slots and runs :func:`~selfattn.functional.paged_attention` with the plan's block table
and lengths. A packed plan's layer (rows of several sequences' tokens) attends its short chunks
as rows of one call and each long chunk as a query block over its gathered K/V
(:mod:`selfattn.cache.paged.plan`). :class:`PagedCacheView` is a model batch over a
:class:`~selfattn.cache.PagedKV`'s sequences: the model cache contract (``plan(S)`` -> a
:class:`~selfattn.cache.base.Step` of :class:`PagedLayer`).

Invariant: a layer that fails during a planned step (bad input, a failing write) undoes the
step's bookkeeping (:meth:`PagedKV.undo`) before the error propagates, so the cache is as it
was before the step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from selfattn.cache.base import Step, hole_mask
from selfattn.cache.paged.plan import PACKED_ROWS_MAX, StepPlan
from selfattn.cache.paged.scores import record_from_pages, score_call, store_kernel_scores
from selfattn.cache.paged.store import check_attend, check_new_kv
from selfattn.functional import attention, attention_weights, paged_attention
from selfattn.masks import as_mask, from_tensor
from selfattn.scores import as_score_mod

if TYPE_CHECKING:
    from selfattn.cache.paged.kv import PagedKV

__all__ = ["PagedCacheView", "PagedLayer"]


class PagedLayer:
    """Layer ``layer``'s cache for one planned step (:class:`~selfattn.cache.base.InPlaceKVCache`):
    :meth:`attend` writes this step's K/V at the planned slots of the layer's pages and runs
    :func:`~selfattn.functional.paged_attention` with the planned block table and lengths.
    ``lengths``: tokens cached per sequence before the step. Over a packed plan
    (:meth:`PagedKV.plan_packed`) the model's batch is one row of ``T`` tokens from several
    sequences; token ``t`` is row ``t`` of the plan (its sequence's pages, its own length)."""

    __slots__ = ("kv", "layer", "plan")

    def __init__(self, kv: PagedKV, plan: StepPlan, layer: int):
        self.kv, self.plan, self.layer = kv, plan, layer

    @property
    def lengths(self) -> torch.Tensor:
        return self.plan.lengths

    @property
    def length(self) -> int:
        if self.plan.past is None:
            raise ValueError(_ragged(self.plan.seq_ids, self.plan.lengths.tolist()))
        return self.plan.past

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask=None,
        score_mod=None,
        scale: float | None = None,
        return_weights: bool = False,
        sinks: torch.Tensor | None = None,
    ):
        """Write ``k (B, Hkv, Sq, D)`` / ``v (B, Hkv, Sq, Dv)``, then attend ``q (B, Hq, Sq, D)``
        (query row ``i`` of sequence ``b`` at position ``lengths[b] + i``).

        Returns ``out (B, Hq, Sq, Dv)``, or ``(out, weights)`` with ``weights
        (B, Hq, Sq, max length)`` (zero past each sequence's end; gathered, for inspection).
        Bool tensor masks and bias tensors are read in query-row order, columns by key position.
        Any error undoes the step's bookkeeping (:meth:`PagedKV.undo`) before it propagates.

        Over a packed plan: ``k (1, Hkv, T, D)``, ``v (1, Hkv, T, Dv)``, ``q (1, Hq, T, D)``,
        each token over its own sequence up to its own position; returns ``(1, Hq, T, Dv)``.
        Masks and score mods see absolute positions (tensor masks in row order are refused:
        the rows are not one sequence's), and there are no weights.
        """
        if self.plan.packed:
            self._check_packed(q, k, v, mask, score_mod, return_weights)
            out = self._run_packed(q, k, v, mask, score_mod, scale, sinks)
            record_from_pages(self.kv, self.plan, self.layer, _token_rows(q), scale)
            return out
        mask, score_mod = self._checked(q, k, v, mask, score_mod)
        return self._run(q, k, v, mask, score_mod, scale, return_weights, sinks)

    def _checked(self, q, k, v, mask, score_mod):
        """:meth:`attend`'s checks; ``(mask, score_mod)`` bound to each sequence's rows."""
        plan = self.plan
        try:
            check_attend(self.kv, plan.seq_ids, q, k, v)
            if q.shape[2] != plan.n_tokens:
                raise ValueError(
                    f"this step was planned for {plan.n_tokens} new token(s) per sequence but q "
                    f"has Sq={q.shape[2]}"
                )
            shape = (len(plan.seq_ids), q.shape[1], q.shape[2], plan.max_len)
            mask = _per_sequence_rows(mask, plan.lengths, shape)
            score_mod = _per_sequence_rows(score_mod, plan.lengths, shape)
        except BaseException:
            self.kv.undo(plan)
            raise
        return mask, score_mod

    def attend_rows(self, q, k_rows, v_rows, *, mask=None, score_mod=None, scale=None, sinks=None):
        """:meth:`attend` (no weights) in a fused projection's tokens-first layout: ``q (B, S,
        Hq, D)``, this step's keys and values as rows ``k_rows (B·S, Hkv, D)``, ``v_rows (B·S,
        Hkv, Dv)`` (row ``b·S + s`` token ``s`` of sequence ``b``), written without
        transposing; returns the merged heads ``(B, S, Hq·Dv)``, the out projection's input.
        Over a packed plan ``B = 1`` and ``S = T``, token ``t`` row ``t``.

        The blocks' lean step (:class:`~selfattn.nn.blocks.RowsStep`): the checks of
        :meth:`attend`, the backend choice and its call run at the first layer of each kind
        (shapes, dtypes, mask, score mod, scale and sinks objects) of the step; its other layers
        only write their rows and run the chosen backend (float pages; quantised pages take
        :meth:`attend`'s path at every layer, their scales being per layer). A packed step whose
        chunks are all short (decode tokens, speculative verify chunks) attends as rows of one
        call, each token over its own sequence; one with a long chunk takes :meth:`attend`'s
        packed path.
        """
        plan, kv = self.plan, self.kv
        key = _rows_key(q, k_rows, v_rows, mask, score_mod, scale, sinks)
        hit = plan.fast.get(key)
        packed = plan.packed
        if hit is None or kv.k_scales is not None:
            out = self._rows_miss(q, k_rows, v_rows, mask, score_mod, scale, sinks)
            if out is not None:  # attend's path ran the call
                return out
            hit = plan.fast[key]
        chosen, call, layer = hit[0], hit[1], self.layer
        if plan.holes is not None:  # per layer (the memo's call holds its first layer's)
            call = dataclasses.replace(call, holes=plan.holes[layer])
        B, S, Hq, D = q.shape
        # packed: every token a row of one query (T, Hq, 1, D), a view of the same memory
        qh = q.view(S, Hq, 1, D) if packed else q.transpose(1, 2)
        call = score_call(kv, plan, call, qh, chosen.name) if plan.scores else call
        try:
            kv.write_rows(layer, plan, k_rows, v_rows)
            out, lse = chosen.run(qh, kv.k_layers[layer], kv.v_layers[layer], plan.block_table,
                                  plan.seq_lens, call)  # fmt: skip
            if plan.scores and not store_kernel_scores(plan, layer, call, lse):
                record_from_pages(kv, plan, layer, qh, call.scale)
        except BaseException:
            kv.undo(plan)
            raise
        # (T, Hq, 1, Dv) or (B, Hq, 1, Dv) -> (B, S, Hq·Dv): a view; (B, Hq, S, Dv) transposed
        if packed or (S == 1 and out.is_contiguous()):
            return out.view(B, S, -1)
        return out.transpose(1, 2).reshape(B, S, -1)

    def native_rows(self, q_shape, k_shape, v_shape, dtype, *, mask=None, score_mod=None,
                    scale=None, sinks=None):  # fmt: skip
        """The C kernel's launch a caller may run itself for this layer in place of
        :meth:`attend_rows` with arguments of these shapes (``q (B, S, Hq, D)``, rows ``(B·S,
        Hkv, D)`` and ``(B·S, Hkv, Dv)``), ``dtype`` and these objects: ``(launch, slots,
        scale)`` (:meth:`~selfattn.kernels.paged_decode.Launch.native`; ``slots`` the step's
        int64 slot per row, at which the caller stores each row's key and value in the layer's
        pages, whose dtype is ``dtype``; ``scale`` the float the call runs with). The checks and
        the backend choice of the step run here if no call made them yet. None where the call
        takes another path: another backend, quantised pages, a long chunk, a uniform step of
        more than one token (its queries are not rows-first)."""
        plan, kv = self.plan, self.kv
        if kv.k_scales is not None or not kv.writes_rows or not (plan.packed or q_shape[1] == 1):
            return None
        if (plan.packed and plan.blocks) or plan.holes is not None or plan.scores:
            return None
        key = (id(mask), id(score_mod), scale, id(sinks), q_shape, dtype, k_shape, dtype,
               v_shape, dtype)  # fmt: skip
        hit = plan.fast.get(key)
        if hit is None:  # prepare as attend_rows' first call does: zeros of the shapes
            q = torch.zeros(q_shape, dtype=dtype, device=kv.k_store.device)
            k_rows, v_rows = (q.new_zeros(shape) for shape in (k_shape, v_shape))
            if self._rows_miss(q, k_rows, v_rows, mask, score_mod, scale, sinks) is not None:
                return None  # not reached: the conditions above exclude attend's path
            hit = plan.fast[key]
        planned = None if hit is None or hit[0].name != "cpu" else hit[1].planned
        launch = None if planned is None else planned[3]
        if launch is None or kv.k_layers[self.layer].dtype != dtype:
            return None
        return launch, plan.slots, hit[1].scale

    def _rows_miss(self, q, k_rows, v_rows, mask, score_mod, scale, sinks):
        """:meth:`attend_rows` at the first layer of its kind: checks, then the backend chosen
        and memoised in ``plan.fast`` (None returned), or :meth:`attend`'s path run where the
        rows path does not serve the step (its merged output returned)."""
        plan, kv = self.plan, self.kv
        B, S = len(plan.seq_ids), plan.n_tokens  # packed: T rows of one token
        if plan.packed:
            B, S = 1, B
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or tuple(q.shape[:2]) != (B, S):
            kv.undo(plan)
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be (B={B}, S={S}, Hq, D), tokens first, got {got}")
        if k_rows.dim() != 3 or v_rows.dim() != 3 or k_rows.shape[0] != B * S:
            kv.undo(plan)
            raise ValueError(
                f"k_rows and v_rows must be (B·S={B * S}, Hkv, ·) for this step of {B} "
                f"sequence(s) × {S} token(s), got {tuple(k_rows.shape)}, {tuple(v_rows.shape)}"
            )
        qh = q.transpose(1, 2)  # (B, Hq, S, D)
        # (B·S, H, ·) -> (B, H, S, ·)
        k = k_rows.view(B, S, *k_rows.shape[1:]).transpose(1, 2)
        v = v_rows.view(B, S, *v_rows.shape[1:]).transpose(1, 2)
        long = plan.blocks if plan.packed else S > PACKED_ROWS_MAX
        if long or not kv.writes_rows:
            # a long chunk (a query block over gathered K/V), quantised pages, a cache with its
            # own write: attend's path (every layer: the step's plan memoises no backend)
            out = self.attend(qh, k, v, mask=mask, score_mod=score_mod, scale=scale, sinks=sinks)
            return out.transpose(1, 2).reshape(B, S, -1)
        if plan.packed:
            self._check_packed(qh, k, v, mask, score_mod, False)
            qh, k, v = _token_rows(qh), _token_rows(k), _token_rows(v)
        mask_obj, mod_obj = self._checked(qh, k, v, mask, score_mod)
        try:
            hit = plan.attention.prepare(
                qh, kv.k_layers[self.layer], kv.v_layers[self.layer], mask=mask_obj,
                score_mod=mod_obj, scale=scale, sinks=sinks, holes=self._holes(),
            )  # fmt: skip
        except BaseException:
            kv.undo(plan)
            raise
        # the entry holds the objects keyed by id, so that their ids stay unique
        key = _rows_key(q, k_rows, v_rows, mask, score_mod, scale, sinks)
        plan.fast[key] = (*hit, mask, score_mod, sinks)
        return None

    def _run(self, q, k, v, mask, score_mod, scale, return_weights, sinks=None):
        """:meth:`attend` once its inputs are checked (masks already per sequence). A step of
        more than :data:`~selfattn.cache.paged.plan.PACKED_ROWS_MAX` tokens a sequence (a
        prefill chunk) attends each sequence's gathered keys with :func:`attention` (a query
        block, as the packed plan's long chunks do: dense kernels win there), a shorter one
        through :func:`paged_attention`."""
        kv, plan, layer = self.kv, self.plan, self.layer
        try:
            kv.write(layer, plan, k, v)
            if plan.n_tokens > PACKED_ROWS_MAX and self._blocks_serve():
                out = q.new_empty(*q.shape[:3], kv.v_layers[layer].shape[-1])
                out = self._per_sequence(attention, out, q, mask, score_mod, scale, sinks)
            else:
                kp, vp, table, attn, k_scales, v_scales = kv.attention_pages(layer, plan)
                out = paged_attention(
                    q, kp, vp, table, plan.seq_lens, mask=mask, score_mod=score_mod,
                    scale=scale, k_scales=k_scales, v_scales=v_scales, plan=attn, sinks=sinks,
                    holes=self._holes(),
                )  # fmt: skip
        except BaseException:
            kv.undo(plan)
            raise
        if not return_weights:
            return out
        w = q.new_zeros(*q.shape[:3], plan.max_len)
        return out, self._per_sequence(attention_weights, w, q, mask, score_mod, scale, sinks)

    def _holes(self) -> torch.Tensor | None:
        """This layer's ``(rows, Hkv, 2)`` holes of the step, or None."""
        return None if self.plan.holes is None else self.plan.holes[self.layer]

    def _blocks_serve(self) -> bool:
        """Whether a long step may attend as query blocks over gathered keys: a plain layer of
        a pool whose ``query_blocks`` says so (a streaming pool's kernel positions skip freed
        pages, a latent pool's values are views of its keys)."""
        return type(self) is PagedLayer and self.kv.query_blocks

    def _per_sequence(self, fn, out, q, mask, score_mod, scale, sinks):
        """``out[b, ..., :r]`` = ``fn(q_b, k_b, v_b, ...)`` (``r`` its last size) for each
        sequence ``b`` of the written step over its gathered keys, its mask and score mod
        shifted to its batch row; the default q_offset (bottom-right, ``n - Sq``) places its
        queries as :func:`paged_attention` does. Returns ``out``."""
        holes = self._holes()
        for b, s in enumerate(self.plan.seq_ids):
            ks, vs = self.kv.gather(s, self.layer)
            mask_b = None if mask is None else as_mask(mask).shifted(batch=b)
            mask_b = mask_b if holes is None else hole_mask(mask_b, holes[b], q.shape[1])
            mod_b = None if score_mod is None else as_score_mod(score_mod).shifted(batch=b)
            r = fn(q[b : b + 1], ks[None].to(q.dtype), vs[None].to(q.dtype), mask=mask_b,
                   score_mod=mod_b, scale=scale, sinks=sinks)  # fmt: skip
            out[b, ..., : r.shape[-1]] = r[0]
        return out

    def _check_packed(self, q, k, v, mask, score_mod, return_weights) -> None:
        """:meth:`attend`'s checks over a packed plan (undoing the step when one fails)."""
        T = len(self.plan.seq_ids)
        try:
            if return_weights:
                raise ValueError("a packed step does not return attention weights")
            for name, x in (("q", q), ("k", k), ("v", v)):
                if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[::2] != (1, T):
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise ValueError(
                        f"{name} must be (1, H, T={T}, ·) for this packed step of {T} tokens, "
                        f"got {got}"
                    )
            for name, obj in (("mask", mask), ("score_mod", score_mod)):
                if isinstance(obj, torch.Tensor) or getattr(obj, "row_ordered", False):
                    raise ValueError(
                        f"a packed step takes {name}s of positions only (causal, windows, "
                        "soft-caps): its rows are tokens of several sequences"
                    )
        except BaseException:
            self.kv.undo(self.plan)
            raise

    def _run_packed(self, q, k, v, mask, score_mod, scale, sinks=None):
        """:meth:`attend` over a packed plan once its inputs are checked."""
        kv, plan, layer = self.kv, self.plan, self.layer
        T, Hq, Dv = q.shape[2], q.shape[1], v.shape[3]
        try:
            kv.write(layer, plan, _token_rows(k), _token_rows(v))
            R = plan.rows.numel()
            if R:
                kp, vp, table, attn, k_scales, v_scales = kv.attention_pages(layer, plan)
                kw = dict(mask=mask, score_mod=score_mod, scale=scale, k_scales=k_scales,
                          v_scales=v_scales, sinks=sinks, holes=self._holes(),
                          plan=attn)  # fmt: skip
            if R == T:  # no long chunk: the whole step is one call
                out = paged_attention(_token_rows(q), kp, vp, table, plan.seq_lens, **kw)
                return out.squeeze(2).transpose(0, 1).unsqueeze(0)  # (T, Hq, 1, Dv) -> (1, ·)
            out = q.new_empty(Hq, T, Dv)
            if R:
                qr = q[0].index_select(1, plan.rows).transpose(0, 1).unsqueeze(2)  # (R, Hq, 1, D)
                o = paged_attention(qr, kp, vp, table, plan.seq_lens, **kw)
                out.index_copy_(1, plan.rows, o.squeeze(2).transpose(0, 1))  # (Hq, R, Dv)
            for i, (start, n, ids, length) in enumerate(plan.blocks):  # a query block a chunk
                ks, vs = kv.gather_pages(ids, length, layer)  # (Hkv, length, ·)
                qb = q[:, :, start : start + n]  # (1, Hq, n, D)
                held = plan.block_holes[i] if plan.block_holes else None
                mb = mask if held is None else hole_mask(mask, held[layer], Hq)
                # keys from position 0, queries the last n: attention's default bottom-right
                o = attention(qb, ks[None].to(qb.dtype), vs[None].to(qb.dtype), mask=mb,
                              score_mod=score_mod, scale=scale, sinks=sinks)  # fmt: skip
                out[:, start : start + n] = o[0]
            return out.unsqueeze(0)  # (Hq, T, Dv) -> (1, Hq, T, Dv)
        except BaseException:
            kv.undo(plan)
            raise


def _rows_key(q, k_rows, v_rows, mask, score_mod, scale, sinks) -> tuple:
    """:meth:`PagedLayer.attend_rows`' memo key: what its checks and backend choice read."""
    return (id(mask), id(score_mod), scale, id(sinks), q.shape, q.dtype, k_rows.shape,
            k_rows.dtype, v_rows.shape, v_rows.dtype)  # fmt: skip


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """A packed step's ``(1, H, T, ·)`` as ``(T, H, 1, ·)``: every token a row of length 1."""
    return x[0].transpose(0, 1).unsqueeze(2)


def _ragged(seq_ids, lengths) -> str:
    return (
        f"sequences {seq_ids} have different lengths {lengths}; use .lengths for ragged "
        "batches (MultiHeadAttention handles them through attend())"
    )


class PagedCacheView:
    """A model batch over a :class:`PagedKV`'s sequences: row ``b`` is sequence ``seq_ids[b]``.

    The model cache contract (:class:`~selfattn.cache.base.ModelKVCache`): ``plan(S)`` plans
    the step once (:meth:`PagedKV.plan`) and returns a :class:`~selfattn.cache.base.Step`
    whose ``layers[i]`` is a :class:`PagedLayer`. Each sequence's queries follow its OWN length,
    so the sequences may have different lengths (ragged)::

        seq_ids = [4, 9]   lengths before the step 5, 2;   S = 2 new tokens each
        seq 4   keys 0 1 2 3 4 [5 6]    queries at positions 5, 6
        seq 9   keys 0 1 [2 3]          queries at positions 2, 3   ([·] = appended now)

    Queries are bottom-right per sequence, masks and score mods see those absolute positions,
    and RoPE positions default to ``lengths[b] + arange(S)`` per sequence (``step.positions``).

    Over a one-layer cache (:class:`PagedCache`) the view is also a layer's cache itself:
    ``MultiHeadAttention(..., cache=cache.view(seq_ids))`` calls :meth:`attend`, which plans
    and runs the step in one go (one :class:`PagedCache` per layer: the older, per-layer way).
    :meth:`update` is the plain contract (append, then contiguous K/V) for callers that attend
    themselves; it needs equal lengths. ``reset()`` empties the sequences (their page references
    dropped), keeping their ids.

    A decoder stack over one model-level cache, prefill then decode::

        kv = PagedKV(L, N, P, Hkv, D, max_seqs=B, max_pages_per_seq=M)
        batch = kv.view(kv.add_sequences(B))
        step = batch.plan(x.shape[1])                       # x (B, S, d): S > 1 or 1
        for i, layer in enumerate(layers):
            x = layer(x, mask=masks.causal(), cache=step.layers[i], positions=step.positions)
    """

    def __init__(self, cache: PagedKV, seq_ids: list[int]):
        self.cache = cache
        self.seq_ids = list(seq_ids)

    @property
    def n_layers(self) -> int:
        return self.cache.n_layers

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` int64 cached tokens of each sequence, on the cache's device."""
        return self.cache.seq_lens(self.seq_ids).long()

    @property
    def length(self) -> int:
        """The common length of the sequences (raises ValueError when they differ)."""
        lens = {self.cache.length(s) for s in self.seq_ids}
        if len(lens) > 1:
            raise ValueError(_ragged(self.seq_ids, [self.cache.length(s) for s in self.seq_ids]))
        return lens.pop() if lens else 0

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        for s in self.seq_ids:
            self.cache.truncate(s)

    def plan(self, n_tokens: int) -> Step:
        """Plan ``n_tokens`` new tokens per sequence for every layer (:meth:`PagedKV.plan`)."""
        plan = self.cache.plan(self.seq_ids, n_tokens)
        layers = [PagedLayer(self.cache, plan, i) for i in range(self.cache.n_layers)]
        return Step(layers, plan.positions, plan.past)

    def _one_layer(self, what: str) -> None:
        if self.cache.n_layers != 1:
            raise TypeError(
                f"{what}() serves a one-layer cache; this {type(self.cache).__name__} has "
                f"{self.cache.n_layers} layers: plan each step once with view.plan(S) and give "
                "layer i step.layers[i]"
            )

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None):
        """Append ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``; returns the gathered
        ``(B, Hkv, length, D)`` and ``(B, Hkv, length, Dv)`` (equal lengths only)."""
        self._one_layer("update")
        n = self.length
        if positions is not None:
            pos = torch.as_tensor(positions).flatten().tolist()
            if pos != list(range(n, n + k.shape[2])):
                raise ValueError(
                    f"a paged cache appends only: positions must be {n}..{n + k.shape[2] - 1}, "
                    f"got {pos}"
                )
        S = check_new_kv(self.cache.store, len(self.seq_ids), k, v)
        self.cache.write(0, self.cache.plan(self.seq_ids, S), k, v)
        ks, vs = zip(*(self.cache.gather(s) for s in self.seq_ids))
        return torch.stack(ks), torch.stack(vs)  # B × (Hkv, length, ·) -> (B, Hkv, length, ·)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask=None,
        score_mod=None,
        scale: float | None = None,
        return_weights: bool = False,
        sinks: torch.Tensor | None = None,
    ):
        """Plan one step of a one-layer cache and run it (:meth:`PagedLayer.attend`); bad input
        is refused before anything changes."""
        self._one_layer("attend")
        check_attend(self.cache, self.seq_ids, q, k, v)
        B, Hq, Sq, _ = q.shape
        # Validate before planning, so that bad input leaves the cache as it was.
        lengths = self.lengths
        shape = (B, Hq, Sq, int(lengths.max()) + Sq if B else 0)  # (B, Hq, Sq, max length)
        mask = _per_sequence_rows(mask, lengths, shape)
        score_mod = _per_sequence_rows(score_mod, lengths, shape)
        layer = PagedLayer(self.cache, self.cache.plan(self.seq_ids, Sq), 0)
        return layer._run(q, k, v, mask, score_mod, scale, return_weights, sinks)


# -- tensors in query-row order ----------------------------------------------------------------
# Masks and score mods see absolute positions. A bool tensor mask or a bias tensor is read by
# query ROW, so it is bound to each sequence's own first query position (Mask.bind with one
# offset per sequence); built-ins are returned as they are, analytic page trimming intact.


def _per_sequence_rows(obj, offsets: torch.Tensor, shape: tuple[int, int, int, int]):
    """``obj`` (a mask or score mod, any accepted form) with row ``i`` of sequence ``b`` at
    position ``offsets[b] + i`` when it holds row-ordered tensors, which must broadcast to
    ``shape`` ``(B, Hq, Sq, max length)`` (checked here, before anything changes)."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        obj = from_tensor(obj) if obj.dtype == torch.bool else as_score_mod(obj)
    if not obj.row_ordered:
        return obj
    B, H, Sq, Sk = shape
    obj.validate(B, H, Sq, Sk, Sk - Sq)
    return obj.bind(offsets)
