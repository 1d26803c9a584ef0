"""``attention()``, ``attention_weights()``, ``paged_attention()``: validate, normalise, run."""

from __future__ import annotations

import logging

import torch

from selfattn import backends as _backends
from selfattn._log import log_once
from selfattn.backends._common import merge_sinks
from selfattn.backends.paged import call as _paged
from selfattn.backends.paged import plan as _paged_plan
from selfattn.call import prepare

__all__ = ["attention", "attention_weights", "paged_attention"]


def _empty(q, k, v, call):
    """A call with no queries or no keys: output 0, lse -inf, gradients 0 (never NaN)."""
    B, Hq, Sq, _ = q.shape
    Dv = v.shape[3]
    # keep the graph connected so that backward yields zero gradients rather than None
    zero = q.sum() * 0 + k.sum() * 0 + v.sum() * 0
    out = q.new_zeros(B, Hq, Sq, Dv) + zero
    lse = torch.full((B, Hq, Sq), float("-inf"), device=q.device, dtype=_lse_dtype(q))
    if call.sinks is not None:  # no key: the sink takes all the weight, output stays 0
        out, lse = merge_sinks(out, lse, call.sinks)
    return out, (lse if call.return_lse else None)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask=None,
    score_mod=None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    q_offset: int | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """Scaled dot-product attention ``softmax(score_mod(Q Kᵀ · scale) + M) V``.

    Args:
        q: ``(B, Hq, Sq, D)`` queries.
        k: ``(B, Hkv, Sk, D)`` keys; ``Hkv`` divides ``Hq`` (GQA / MQA): query head ``h`` reads
            kv head ``h // (Hq // Hkv)``. K/V are never repeated in memory.
        v: ``(B, Hkv, Sk, Dv)`` values; ``Dv`` may differ from ``D``. K and V of batch 1 serve
            every query batch (as in FlexAttention), as stride-0 views: no copy.
        mask: a :class:`selfattn.masks.Mask`, a FlexAttention-style
            ``mask_mod(b, h, q_idx, kv_idx) -> bool`` or a bool tensor broadcastable to
            ``(B, Hq, Sq, Sk)`` (True = attend).
        score_mod: a :class:`selfattn.scores.ScoreMod`, a FlexAttention-style
            ``score_mod(score, b, h, q_idx, kv_idx)`` or a float tensor broadcastable to
            ``(B, Hq, Sq, Sk)``, added to the scaled scores.
        scale: multiplies ``Q Kᵀ``; default ``1/sqrt(D)``. Zero and negative values are allowed.
        dropout_p: attention-weight dropout probability in ``[0, 1)``; ``0`` is bitwise the same
            as no dropout.
        generator: draws the dropout seed (same generator state -> same output and gradients).
        q_offset: absolute position of query row 0; key ``j`` sits at position ``j``. Default
            ``Sk - Sq`` (bottom-right alignment, what a KV cache needs). Masks and score mods see
            absolute positions. For ``Sq=2, Sk=5`` with ``causal()``::

                key position     0 1 2 3 4
                query 0 (pos 3)  █ █ █ █ ·
                query 1 (pos 4)  █ █ █ █ █

            ``q_offset=0`` gives top-left alignment (query 0 sees key 0 only).
        backend: ``"auto"`` or one of ``selfattn.backends.names()``; see
            :func:`selfattn.backends.explain` for what ``auto`` picks and why.
        return_lse: also return the log-sum-exp of each row's (masked) scores.
        sinks: ``(Hq,)`` learned attention-sink logits (gpt-oss; Xiao et al. 2023's sink as a
            parameter): each row of head ``h`` gets one more term ``exp(sinks[h])`` in its softmax
            denominator, a key with no value, so the weights may sum to less than 1 and the lse
            includes it. A keyword, not a score mod: it changes the denominator, not any score.
            Gradients reach ``sinks``. A row with no allowed key gives output 0 and lse
            ``sinks[h]``. Backends that run it: ``explain`` (reference; chunked, which starts
            each row's online softmax from the sink; sdpa and flex where they return the lse:
            merged exactly afterwards, see ``backends._common.merge_sinks``; flex on CPU, which
            has no lse, as one more key column: inference only).

    Returns:
        ``out (B, Hq, Sq, Dv)`` in the input dtype, or ``(out, lse)`` with ``lse (B, Hq, Sq)`` in
        float32 (float64 for float64 inputs). A query row with no allowed key, or whose every
        score the score mod sends to ``-inf``, gives output 0, lse ``-inf`` and zero gradients
        (dropout or not), never NaN. fp16/bf16 inputs accumulate in float32.

    Non-finite values, the same on every backend. A key the mask removes from a row never reaches
    it: NaN/Inf in its K or V, a NaN bias entry there or a ``q·k`` overflowing there leave the row
    as if the key were absent. So does the V of a key the score mod gives ``-inf`` (its K still
    makes the score NaN, as ``NaN + -inf`` is NaN). The V of a key a row attends passes on in
    IEEE arithmetic, ``Σ p_j v_j`` over exactly those keys whatever the weight: NaN there makes
    that output column NaN even when the weight underflows to 0, and ``±Inf`` gives ``±Inf`` (NaN
    with weight 0, or with both signs), as the C decode kernel of
    :func:`selfattn.cache.paged_attention` computes. NaN in a query row, or in the K of a key it
    attends, makes that row's output and lse NaN (a row with no key stays 0 and ``-inf``).
    Gradients follow: ``dv`` is exact everywhere, ``dq`` of rows left finite is exact unless K
    holds NaN at a key other rows attend (``dS K`` forms ``0 · NaN``), and rows made non-finite
    get non-finite ``dq``.
    """
    q, k, v, call = prepare(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        dropout_p=dropout_p,
        generator=generator,
        q_offset=q_offset,
        return_lse=return_lse,
        sinks=sinks,
    )
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] == 0 or q.shape[1] == 0:
        if backend != "auto":
            _backends.get(backend)  # a misspelt name fails on empty inputs too, not only later
        out, lse = _empty(q, k, v, call)
    else:
        chosen, _ = _backends.select(q, k, v, call, backend)
        try:
            out, lse = chosen.run(q, k, v, call)
        except _backends.BackendCompileError as e:
            if backend != "auto":
                raise
            # the failed backend now declines this case: auto picks the next one
            failed = chosen.name
            chosen, _ = _backends.select(q, k, v, call, backend)
            log_once(
                ("compile failed", failed, chosen.name),
                logging.WARNING,
                "selfattn: backend %r failed to compile; auto runs %r instead (and for later "
                "calls of this case). %s",
                failed,
                chosen.name,
                e,
            )
            out, lse = chosen.run(q, k, v, call)
    return (out, lse) if return_lse else out


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask=None,
    score_mod=None,
    scale: float | None = None,
    q_offset: int | None = None,
    sinks: torch.Tensor | None = None,
    scores: bool = False,
) -> torch.Tensor:
    """The attention weights ``softmax(...)`` ``(B, Hq, Sq, Sk)`` of :func:`attention` (no dropout).

    Same arguments and semantics as :func:`attention`; each row sums to 1, or is all 0 when the
    mask allows no key; with ``sinks``, each row sums to 1 minus its sink's weight. Computed by
    the reference backend (the weights are quadratic anyway). ``scores=True`` returns what the
    softmax reads instead: ``QKᵀ·scale`` with the score mod applied, ``-inf`` where the mask
    hides a key (no sink term), in the accumulation dtype (fp32 for half inputs).
    """
    from selfattn.backends import reference

    q, k, v, call = prepare(
        q, k, v, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset, sinks=sinks
    )
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if scores:
        return reference.scores_and_weights(q, k, v, call)[3]
    return reference.weights(q, k, v, call)


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mask=None,
    score_mod=None,
    scale: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    plan: _paged_plan.PagedAttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
    holes: torch.Tensor | None = None,
):
    """Attention of ``q (B, Hq, Sq, D)`` over a paged cache, returning ``out (B, Hq, Sq, Dv)``,
    reading the pages in place.

    ``k_pages (N, P, Hkv, D)``, ``v_pages (N, P, Hkv, Dv)``: the page pool. ``block_table
    (B, max_pages)`` (int32): the pages of each sequence in order; entries past a sequence's
    ``ceil(seq_lens[b] / P)`` used pages are never read (they may be -1). ``seq_lens (B,)``:
    valid tokens per sequence, including the ``Sq`` new ones, which must already be written to
    the pages::

        block_table[b] = [7, 2, 5, ...]      P = 4, seq_lens[b] = 10
        token position   0 1 2 3 | 4 5 6 7 | 8 9 · ·
        page             7       | 2       | 5        (· = unused slot: never read)

    Query row ``i`` of sequence ``b`` sits at position ``seq_lens[b] - Sq + i``; for
    ``Sq = 2``, ``seq_lens[b] = 5`` with ``mask=masks.causal()``::

        key position    0 1 2 3 4
        query at 3      █ █ █ █ ·
        query at 4      █ █ █ █ █

    ``mask`` (a :class:`selfattn.masks.Mask` or a ``mask_mod`` callable) and ``score_mod`` (a
    :class:`selfattn.scores.ScoreMod` or callable) are evaluated at these absolute positions
    with ``b`` the batch index. Tensors given in query-row order (a bool ``mask``, a bias
    ``score_mod``, ``(B, Hq, Sq, max(seq_lens))``) are read per sequence: row ``i`` of sequence
    ``b`` is its query at ``seq_lens[b] - Sq + i``, column ``j`` its key at position ``j``.
    ``mask=None`` attends every valid key. GQA/MQA: query head ``h`` reads kv head
    ``h // (Hq // Hkv)``; K/V are never repeated.

    Returns ``out`` in ``q.dtype``, or ``(out, lse)`` with ``lse (B, Hq, Sq)`` float32 (float64
    for fp64 inputs), ``-inf`` for a row with no allowed key (whose output is exactly 0; also
    when a score mod sets all its scores to ``-inf``). NaN/Inf in unused page slots or pages
    cannot reach the output, nor can NaN/Inf at a key a row does not attend (masked, or scored
    ``-inf`` by the score mod): it reaches only the rows that attend it.

    Quantised pages (:mod:`selfattn.cache.quant`): ``k_pages``/``v_pages`` int8 with bfloat16
    ``k_scales``/``v_scales (N, P, Hkv)``, or float8_e4m3fn with float32 ``(Hkv,)``; the C kernel
    dequantises a key row at a time, the Triton kernel a tile in registers, the PyTorch path
    each gathered group (times its scales, in the accumulation dtype), never the whole cache.
    Scales are required for quantised pages and rejected for float pages.

    ``backend``: ``"auto"`` or a paged backend (``selfattn.backends.names("paged")``: ``"cpu"``,
    the C kernel for decode-like calls on CPU; ``"triton"``, the Triton kernel on CUDA;
    ``"torch"``, plain PyTorch for every case); :func:`selfattn.backends.explain_paged` says
    what ``auto`` picks and why (:mod:`selfattn.backends.paged`). All give the same result
    within float32 rounding.

    ``plan``: a :class:`~selfattn.backends.paged.plan.PagedAttentionPlan` of ``block_table``
    and ``seq_lens``, shared by the calls of one step (one per layer): the checks of the table
    and lengths, the backend choice and the key intervals then run once per step, not per call.
    Same results; ignored under ``torch.compile``, whose graph does that work.

    ``sinks (Hq,)``: learned attention-sink logits, as in :func:`attention`; every paged backend
    runs them (its kernel's exact lse, the sink merged after it: ``backends._common.merge_sinks``).

    ``holes (B, Hkv, 2)`` integer: the rows of sequence ``b`` whose kv head is ``h`` skip keys
    ``holes[b, h, 0] <= t < holes[b, h, 1]`` besides the mask (a sequence compacted to ragged
    per-head kept counts, :meth:`~selfattn.cache.PagedKV.compact`); the C kernel and the
    PyTorch path run them, the Triton kernel declines the call.
    """
    args = (q, k_pages, v_pages, block_table, seq_lens)
    kwargs = dict(
        mask=mask, score_mod=score_mod, scale=scale, k_scales=k_scales, v_scales=v_scales,
        return_lse=return_lse, sinks=sinks, holes=holes,
    )  # fmt: skip
    if plan is not None and (plan.block_table is not block_table or plan.seq_lens is not seq_lens):
        raise ValueError(
            "plan was made for another block_table / seq_lens; pass the tensors it was built "
            "from (PagedAttentionPlan(block_table, seq_lens)) or no plan"
        )
    if plan is not None and not torch.compiler.is_compiling():
        chosen, call = plan.prepare(q, k_pages, v_pages, backend=backend, **kwargs)
    else:
        call = _paged.prepare(*args, **kwargs)
        chosen, _ = _backends.registry("paged").select(*args, call, backend=backend)
    out, lse = chosen.run(*args, call)
    return (out, lse) if return_lse else out
