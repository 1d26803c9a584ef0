"""``MultiHeadAttention`` (self / cross, MHA / GQA / MQA), and the ``torch.nn.MultiheadAttention``
drop-in built by :meth:`MultiHeadAttention.from_torch`. ``ContiguousCache`` is
:class:`selfattn.cache.StaticCache` under the layer's name."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from selfattn import scores as _scores
from selfattn._validate import one_of, positive_int, positive_number
from selfattn.cache.base import KV, attends_in_place, next_position, next_positions
from selfattn.cache.static import StaticCache
from selfattn.functional import attention, attention_weights
from selfattn.masks import causal
from selfattn.nn.norms import make_norm

__all__ = [
    "ContiguousCache",
    "MultiHeadAttention",
    "QueryTemperature",
    "TorchMultiheadAttention",
    "gate_heads",
    "positions_after",
]


# The layer's name for the preallocated cache; the class lives with the other caches.
ContiguousCache = StaticCache


def positions_after(cache, B: int, Sq: int, device) -> torch.Tensor:
    """RoPE positions of ``Sq`` new tokens: ``(Sq,)`` after the cache's tokens seen
    (:func:`~selfattn.cache.base.next_position`), or after each
    sequence's own ``lengths`` for an :class:`InPlaceKVCache` (``(B, Sq)`` when they differ)."""
    if cache is None:
        return next_positions(0, Sq, device)
    if callable(getattr(cache, "next_positions", None)):  # a cache that assigns them (streaming)
        return cache.next_positions(Sq, device)
    if not attends_in_place(cache):
        return next_positions(next_position(cache), Sq, device)
    lengths = cache.lengths.to(device)
    if lengths.shape != (B,):
        raise ValueError(
            f"the cache holds {lengths.numel()} sequence(s) but x has batch B={B}; pass a view "
            "over one sequence per row of x"
        )
    if lengths.numel() and bool((lengths == lengths[0]).all()):  # equal: one row serves all
        lengths = lengths[0]
    return next_positions(lengths, Sq)


def gate_heads(out: torch.Tensor, head_mask: torch.Tensor | None) -> torch.Tensor:
    """``out (B, Hq, Sq, Dv)`` with head ``h`` multiplied by ``head_mask[..., h]``: ``(Hq,)`` for
    every sequence or ``(B, Hq)`` per sequence; None returns ``out`` itself."""
    if head_mask is None:
        return out
    B, H = out.shape[:2]
    if not isinstance(head_mask, torch.Tensor) or tuple(head_mask.shape) not in ((H,), (B, H)):
        got = tuple(head_mask.shape) if isinstance(head_mask, torch.Tensor) else head_mask
        raise ValueError(
            f"head_mask must be a tensor of shape (Hq={H},) or (B={B}, Hq={H}), got {got}; "
            "one gate per query head (0 removes the head, 1 keeps it)"
        )
    gates = head_mask.to(out.dtype).view(-1, H, 1, 1)  # (Hq,) or (B, Hq) -> (B|1, Hq, 1, 1)
    return out * gates


class QueryTemperature:
    """Llama-4's attention temperature for long context (Nakanishi, 2025, arXiv 2501.19399):
    query row at position ``p`` scaled by ``1 + attn_scale · log1p(floor((p + 1) / floor_scale))``
    (1 below ``floor_scale - 1``, growing with the log of the length). Computed in float32."""

    def __init__(self, floor_scale: float, attn_scale: float):
        positive_number(floor_scale, "QueryTemperature floor_scale")
        if not (isinstance(attn_scale, int | float) and math.isfinite(attn_scale)):
            raise ValueError(f"QueryTemperature attn_scale must be finite, got {attn_scale!r}")
        self.floor_scale, self.attn_scale = float(floor_scale), float(attn_scale)

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        p = positions.to(torch.float32)
        return torch.log1p(torch.floor((p + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def __repr__(self) -> str:
        return f"QueryTemperature(floor_scale={self.floor_scale}, attn_scale={self.attn_scale})"


class MultiHeadAttention(nn.Module):
    """Multi-head attention over ``(B, S, d_model)`` sequences: self or cross, MHA / GQA / MQA.

    ``n_heads`` query heads share ``n_kv_heads`` key/value heads (default ``n_heads``: MHA; ``1``:
    MQA); query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``, never repeated in memory.

    Args:
        d_model: model width of the queries and of the output.
        n_heads, n_kv_heads: query and key/value head counts.
        head_dim: per-head width ``D`` (default ``d_model // n_heads``).
        kdim, vdim: widths of the key and value inputs for cross-attention (default ``d_model``).
        fused: one ``qkv_proj`` Linear (``d_model -> (Hq + 2 Hkv) · D``) instead of separate
            ``q_proj``, ``k_proj``, ``v_proj``; needs ``kdim == vdim == d_model``. Cross-attention
            still works: the query rows of the weight read ``x``, the K/V rows read the context.
        bias: bias on the input projections; ``out_bias`` (default ``bias``) on ``out_proj``.
        qk_norm: ``None``, ``"rms"`` or ``"layer"``: normalise each head of q and k over ``D``
            before positions are applied (Qwen-3, Gemma-3, ViT-22B).
        qk_norm_scope: ``"head"`` (default: one norm of width ``D`` shared by the heads) or
            ``"all"``: one norm over the whole projected q (``Hq·D``) and k (``Hkv·D``) before
            the head split, as OLMo-2 does (its statistics mix the heads).
        dropout: attention-weight dropout probability, active in training mode only.
        rope: a callable ``rope(x (B, H, S, D), positions (S,) or (B, S)) -> x`` rotating q and k
            of self-attention at their positions (e.g. ``selfattn.positions.RoPE``).
        alibi: add ALiBi biases (``selfattn.scores.alibi(n_heads)``) to the scores.
        sinks: own a learned attention-sink logit per query head (``self.sinks (n_heads,)``,
            zeros at init; gpt-oss), passed as ``selfattn.attention(..., sinks=)``: it joins
            every row's softmax denominator with no value.
        scale: score scale (default ``1/sqrt(D)``); ``backend``: passed to ``selfattn.attention``.
        q_temperature: a callable ``t(positions) -> scales`` of the same shape (e.g.
            :class:`QueryTemperature`, Llama-4's long-context tuning) multiplying each query row
            by a factor of its cache position (``cache.length + i``, padding included, as
            transformers counts), after positions and qk-norm.
        output_gate: own a ``gate_proj`` (``d_model -> Hq·Dv``) and multiply the merged heads by
            ``sigmoid(gate_proj(x))`` before ``out_proj`` (gated attention, Qiu et al. 2025,
            arXiv 2505.06708; Qwen3-Next): each query row can switch its heads off.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        fused: bool = True,
        bias: bool = True,
        out_bias: bool | None = None,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_scope: str = "head",
        dropout: float = 0.0,
        rope=None,
        alibi: bool = False,
        sinks: bool = False,
        scale: float | None = None,
        backend: str = "auto",
        q_temperature=None,
        output_gate: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        positive_int(d_model, "d_model")
        positive_int(n_heads, "n_heads")
        n_kv_heads = n_heads if n_kv_heads is None else positive_int(n_kv_heads, "n_kv_heads")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by n_heads ({n_heads}); change one "
                    "or pass head_dim explicitly"
                )
            head_dim = d_model // n_heads
        positive_int(head_dim, "head_dim")
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads}); pick "
                f"n_kv_heads among the divisors of {n_heads}"
            )
        kdim = d_model if kdim is None else positive_int(kdim, "kdim")
        vdim = d_model if vdim is None else positive_int(vdim, "vdim")
        if fused and (kdim != d_model or vdim != d_model):
            raise ValueError(
                f"fused projections need kdim == vdim == d_model ({d_model}), got kdim={kdim}, "
                f"vdim={vdim}; pass fused=False"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if rope is not None and not callable(rope):
            raise TypeError(f"rope must be callable as rope(x, positions), got {type(rope)}")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = (
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
        )
        self.kdim, self.vdim, self.fused = kdim, vdim, fused
        self.dropout, self.scale, self.backend = float(dropout), scale, backend
        self.rope = rope
        if q_temperature is not None and not callable(q_temperature):
            raise TypeError(
                f"q_temperature must be callable as t(positions), got {type(q_temperature)}"
            )
        self.q_temperature = q_temperature
        # Called with the exact q, k, v (and mask, score mod, scale, q_offset, sinks) of each call
        # that attends through selfattn.attention; set by selfattn.inspect.capture_attention.
        # What it returns, when not None, is called with the per-head output (B, Hq, Sq, Dv)
        # before the heads merge (attention x gradient hooks the output's gradient there).
        self.attention_observer = None
        # Per-head gates xi_h (Michel et al. 2019) multiplying each head's output before the out
        # projection: None, or (Hq,) / (B, Hq); 0 removes a head. Set by
        # selfattn.inspect.mask_heads; the forward's head_mask= argument takes precedence.
        self.head_mask = None
        # Named hook points inside the layer (q, k, v, scores, pattern, z), set by
        # selfattn.inspect.hooks for the duration of its block: None, or an object with
        # ``qkv(q, k, v) -> (q, k, v)``, ``wants_pattern``, ``pattern(...) -> out``,
        # ``weights(w)`` and ``z(out) -> out`` (see selfattn.inspect.hooks.LayerHooks).
        self.hooks = None
        self.alibi = _scores.alibi(n_heads) if alibi else None
        fk = {"device": device, "dtype": dtype}
        # zeros: every row starts as if one extra key scored 0 (gpt-oss loads trained values)
        self.sinks = nn.Parameter(torch.zeros(n_heads, **fk)) if sinks else None
        q_out, kv_out = n_heads * head_dim, n_kv_heads * head_dim
        if fused:
            self.qkv_proj = nn.Linear(d_model, q_out + 2 * kv_out, bias=bias, **fk)
        else:
            self.q_proj = nn.Linear(d_model, q_out, bias=bias, **fk)
            self.k_proj = nn.Linear(kdim, kv_out, bias=bias, **fk)
            self.v_proj = nn.Linear(vdim, kv_out, bias=bias, **fk)
        self.out_proj = nn.Linear(q_out, d_model, bias=bias if out_bias is None else out_bias, **fk)
        self.gate_proj = nn.Linear(d_model, q_out, bias=bias, **fk) if output_gate else None
        one_of(qk_norm_scope, "qk_norm_scope", ("head", "all"))
        self.qk_norm_scope = qk_norm_scope
        if qk_norm is None:
            self.q_norm = self.k_norm = None
        else:
            whole = qk_norm_scope == "all"
            q_dim, k_dim = (q_out, kv_out) if whole else (head_dim, head_dim)
            self.q_norm = make_norm(qk_norm, q_dim, qk_norm_eps, **fk)
            self.k_norm = make_norm(qk_norm, k_dim, qk_norm_eps, **fk)

    # -- projections -----------------------------------------------------------------------------
    def _project(self, x, key, value):
        """``(q, k, v)`` as ``(B, S, H·D)`` tensors from the query, key and value inputs."""
        if not self.fused:
            return self.q_proj(x), self.k_proj(key), self.v_proj(value)
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        sizes, proj = [q_out, kv_out, kv_out], self.qkv_proj
        if key is x and value is x:
            # split_with_sizes: Tensor.split's own op, without its Python wrapper (per layer)
            return proj(x).split_with_sizes(sizes, dim=-1)
        if not isinstance(proj, nn.Linear):  # no float weight to slice (a quantised layer)
            q = proj(x)[..., :q_out]
            if value is key:
                return q, *proj(key)[..., q_out:].split_with_sizes(sizes[1:], dim=-1)
            return q, proj(key)[..., q_out : q_out + kv_out], proj(value)[..., q_out + kv_out :]
        w, b = proj.weight, proj.bias
        wq, wk, wv = w.split(sizes, dim=0)
        bq, bk, bv = (None, None, None) if b is None else b.split(sizes)
        return F.linear(x, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _heads(self, t: torch.Tensor, H: int) -> torch.Tensor:
        B, S, _ = t.shape
        return t.view(B, S, H, -1).transpose(1, 2)  # (B, S, H·D) -> (B, H, S, D)

    def heads_qkv(self, x, context=None, *, value=None, positions=None):
        """The per-head ``q (B, Hq, Sq, D)``, ``k``, ``v (B, Hkv, Sk, ·)`` this layer attends
        with: projected, qk-normed and (self-attention only) rotated at ``positions`` (default
        ``arange(Sq)``). Wrappers that attend differently (ring attention) start from here."""
        cross = context is not None
        key = context if cross else x
        value = key if value is None else value
        q, k, v = self._project(x, key, value)
        whole = self.q_norm is not None and self.qk_norm_scope == "all"
        if whole:  # OLMo-2: the norm sees every head of the projection at once
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._heads(q, self.n_heads)  # (B, Sq, Hq·D) -> (B, Hq, Sq, D)
        k = self._heads(k, self.n_kv_heads)  # (B, Sk, Hkv·D) -> (B, Hkv, Sk, D)
        v = self._heads(v, self.n_kv_heads)  # (B, Sk, Hkv·D) -> (B, Hkv, Sk, D)
        if self.q_norm is not None and not whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None and not cross:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            q, k = self.rope(q, positions), self.rope(k, positions)
        return q, k, v

    def queries(self, x: torch.Tensor, positions=None, *, rotate: bool = True) -> torch.Tensor:
        """The per-head queries ``(B, Hq, Sq, D)`` this layer's self-attention computes from
        ``x (B, Sq, d_model)``: projected, qk-normed and, with ``rotate``, rotated at
        ``positions`` (default ``arange(Sq)``); ``rotate=False`` gives them before RoPE (what
        KV-compression policies predicting future queries read)."""
        if rotate:
            return self.heads_qkv(x, positions=positions)[0]
        # attending from x to x as context: the same projections and norms, no rotation
        return self.heads_qkv(x, x)[0]

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output ``(B, Hq, Sq, Dv)`` as the out projection's input ``(B, Sq,
        Hq·Dv)`` (variants that combine heads, :class:`~selfattn.nn.DiffAttention`, override)."""
        B, _, Sq, _ = out.shape
        return out.transpose(1, 2).reshape(B, Sq, -1)  # (B, Hq, Sq, Dv) -> (B, Sq, Hq·Dv)

    def project_out(self, merged: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The merged heads ``(B, Sq, Hq·Dv)`` of the queries ``x (B, Sq, d_model)`` through the
        output gate (if any) and ``out_proj`` -> ``(B, Sq, d_model)``."""
        if self.gate_proj is not None:
            merged = merged * torch.sigmoid(self.gate_proj(x))
        return self.out_proj(merged)

    def score_mod_for(self, score_mod=None):
        """The layer's own score mod (ALiBi) composed with a call's ``score_mod``, or None."""
        alibi = self.alibi
        if alibi is None or score_mod is None:
            return score_mod if alibi is None else alibi
        return _scores.compose(alibi, score_mod)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask=None,
        score_mod=None,
        positions=None,
        cache=None,
        q_offset: int | None = None,
        return_weights: bool = False,
        value=None,
        head_mask: torch.Tensor | None = None,
    ):
        """Attend from ``x (B, Sq, d_model)`` to itself or to ``context (B, Sk, kdim)``.

        Args:
            mask, score_mod: passed to :func:`selfattn.attention` (e.g. ``masks.causal()``; a
                bool tensor broadcastable to ``(B, Hq, Sq, Sk)``, True = attend).
            positions: int ``(Sq,)`` or ``(B, Sq)`` position ids of ``x`` for ``rope``; default
                ``cache.length + arange(Sq)`` (``arange(Sq)`` without a cache; per sequence
                ``cache.lengths[b] + arange(Sq)`` for a cache with ``lengths``;
                ``cache.next_positions(Sq)`` for one that assigns them, a StreamingCache).
                Left-padded batches pass ``attention_mask.cumsum(-1) - 1`` here. Unused
                without ``rope`` (ALiBi and masks work on cache/index positions, whose
                differences padding keeps).
            cache: a :class:`ContiguousCache`, ``StaticCache``, ``SlidingWindowCache`` or
                ``PagedCache.view(seq_ids)`` (self-attention only; the contract is
                :mod:`selfattn.cache.base`): this step's K/V are written after the cached ones
                and the queries attend to all of them, query row ``i`` at absolute position
                ``cache.length + i``; masks and score mods see absolute positions, also for the
                keys of a ring buffer that returns only its window. An
                :class:`~selfattn.cache.base.InPlaceKVCache` (a paged step's layer, a paged
                view) stores K/V and attends itself through ``attend``, reading its pages in
                place; its sequences may differ in length (each sequence's queries follow its
                own length, RoPE positions default to ``cache.lengths[b] + i``).
            q_offset: absolute position of query row 0 for masks (default bottom-right).
            return_weights: also return the per-head weights ``(B, Hq, Sq, Sk)`` (no dropout).
            value: the value input ``(B, Sk, vdim)`` when it differs from ``context``.
            head_mask: ``(Hq,)`` or ``(B, Hq)`` gates multiplying each query head's output
                before the out projection (0 = the head removed, 1 = kept; Michel et al. 2019);
                default ``self.head_mask`` (None: every head as is). The weights are unchanged.

        Returns:
            ``out (B, Sq, d_model)``, or ``(out, weights)`` with ``return_weights``.
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must be (B, Sq, d_model={self.d_model}), got shape {tuple(x.shape)}"
            )
        cross = context is not None
        if cross and cache is not None:
            raise ValueError(
                "cache is for self-attention; cross-attention recomputes K/V from context "
                "(pass cache=None)"
            )
        B, Sq, _ = x.shape
        if self.rope is not None and not cross and positions is None:
            positions = positions_after(cache, B, Sq, x.device)
        q, k, v = self.heads_qkv(x, context, value=value, positions=positions)
        if self.q_temperature is not None:  # at cache positions, not the (padded) position ids
            t = self.q_temperature(positions_after(cache, B, Sq, x.device))  # (Sq,) or (B, Sq)
            t = t.view(-1, 1, Sq, 1) if t.dim() == 2 else t.view(1, 1, Sq, 1)
            q = (q * t).to(q.dtype)
        hooks = self.hooks
        if hooks is not None:
            q, k, v = hooks.qkv(q, k, v)
        pattern = hooks is not None and hooks.wants_pattern
        mod = self.score_mod_for(score_mod)
        p = self.dropout if self.training else 0.0
        w, out_hook = None, None
        if attends_in_place(cache):  # it attends over its own storage (paged pages)
            if q_offset is not None:
                raise ValueError(
                    f"q_offset={q_offset} cannot be combined with a cache that attends itself "
                    f"({type(cache).__name__}): its queries sit after each sequence's own "
                    "length; drop q_offset"
                )
            if p > 0:
                raise ValueError(
                    f"attention dropout ({p}) is not supported with {type(cache).__name__}; "
                    "call model.eval() for cached inference"
                )
            out = cache.attend(
                q, k, v, mask=mask, score_mod=mod, scale=self.scale,
                return_weights=return_weights or pattern,
                **({} if self.sinks is None else {"sinks": self.sinks}),
            )  # fmt: skip
            if return_weights or pattern:
                out, w = out
            if pattern:
                hooks.weights(w)
        else:
            if cache is not None:
                kv = cache.update(k, v)  # (B, Hkv, Sq, D) -> (B, Hkv, Sk, D)
                k, v = kv
                if isinstance(kv, KV):  # masks see the keys' true positions (a ring's start)
                    mask, mod, q_offset = kv.at_key_positions(mask, mod, q_offset, q)
            if self.attention_observer is not None:  # selfattn.inspect.capture_attention
                out_hook = self.attention_observer(
                    q, k, v, mask=mask, score_mod=mod, scale=self.scale, q_offset=q_offset,
                    sinks=self.sinks,
                )  # fmt: skip
            out = attention(
                q,
                k,
                v,
                mask=mask,
                score_mod=mod,
                scale=self.scale,
                dropout_p=p,
                q_offset=q_offset,
                backend=self.backend,
                sinks=self.sinks,
            )
            if pattern:  # the scores and weights this call's softmax read (hooks may edit them)
                out = hooks.pattern(
                    q, k, v, out, mask=mask, score_mod=mod, scale=self.scale,
                    q_offset=q_offset, sinks=self.sinks,
                )  # fmt: skip
            if return_weights:
                w = attention_weights(
                    q, k, v, mask=mask, score_mod=mod, scale=self.scale, q_offset=q_offset,
                    sinks=self.sinks,
                )  # fmt: skip
        if out_hook is not None:
            out = out_hook(out)
        if hooks is not None:
            out = hooks.z(out)
        out = gate_heads(out, self.head_mask if head_mask is None else head_mask)
        out = self.project_out(self.merge_heads(out), x)
        return (out, w) if return_weights else out

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> TorchMultiheadAttention:
        """A drop-in for ``m``: same call signature and returns, our attention inside.

        The weights are copied (the result does not share parameters with ``m``).
        """
        return TorchMultiheadAttention(m)


class TorchMultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention``'s interface over a :class:`MultiHeadAttention`.

    Built by :meth:`MultiHeadAttention.from_torch`. Called like torch's module, it returns
    ``(out, weights)``: ``out (L, B, E)`` (``(B, L, E)`` when ``batch_first``),
    ``weights (B, L, S)`` averaged over heads, ``(B, H, L, S)`` with
    ``average_attn_weights=False``, or ``None`` with ``need_weights=False``. Torch's mask
    conventions: a bool ``key_padding_mask (B, S)`` or ``attn_mask`` ``(L, S)`` /
    ``(B·H, L, S)`` is True where attention is NOT allowed; float masks are added to the scores
    (their ``-inf`` entries act as masks). Differences: a query row with every key masked gives 0
    here, NaN in torch; in training mode with dropout, torch returns the dropped-out weights and
    draws its own mask, we return the weights before dropout (outputs agree in eval mode).
    """

    def __init__(self, m: nn.MultiheadAttention):
        super().__init__()
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch needs a torch.nn.MultiheadAttention, got {type(m)}")
        if m.bias_k is not None or m.bias_v is not None:
            raise ValueError(
                "from_torch does not support add_bias_kv=True (learned extra key/value rows); "
                "build the torch module with add_bias_kv=False"
            )
        if m.add_zero_attn:
            raise ValueError(
                "from_torch does not support add_zero_attn=True; build the torch module with "
                "add_zero_attn=False"
            )
        E, H = m.embed_dim, m.num_heads
        ref = m.out_proj.weight
        has_bias = m.in_proj_bias is not None
        self.attn = MultiHeadAttention(
            E,
            H,
            kdim=m.kdim,
            vdim=m.vdim,
            fused=False,
            bias=has_bias,
            out_bias=m.out_proj.bias is not None,
            dropout=m.dropout,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                wq, wk, wv = m.in_proj_weight.chunk(3)
            else:
                wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            for lin, w in zip((self.attn.q_proj, self.attn.k_proj, self.attn.v_proj), (wq, wk, wv)):
                lin.weight.copy_(w)
            if has_bias:
                for lin, b in zip(
                    (self.attn.q_proj, self.attn.k_proj, self.attn.v_proj), m.in_proj_bias.chunk(3)
                ):
                    lin.bias.copy_(b)
            self.attn.out_proj.weight.copy_(m.out_proj.weight)
            if m.out_proj.bias is not None:
                self.attn.out_proj.bias.copy_(m.out_proj.bias)
        self.batch_first = m.batch_first
        self.train(m.training)

    def _masks(self, key_padding_mask, attn_mask, B, H, L, S, dtype):
        """Torch's masks as our ``(mask, score_mod)``: bool True = attend, float added."""
        allowed, added = None, None
        for name, t in (
            ("key_padding_mask", key_padding_mask),
            ("attn_mask", attn_mask),
        ):
            if t is None:
                continue
            if name == "key_padding_mask":
                if tuple(t.shape) != (B, S):
                    raise ValueError(
                        f"key_padding_mask must be (B={B}, S={S}), got {tuple(t.shape)}"
                    )
                t = t.view(B, 1, 1, S)  # (B, S) -> (B, 1, 1, S)
            elif t.dim() == 2 and tuple(t.shape) == (L, S):
                t = t.view(1, 1, L, S)  # (L, S) -> (1, 1, L, S)
            elif t.dim() == 3 and tuple(t.shape) == (B * H, L, S):
                t = t.view(B, H, L, S)  # (B·H, L, S) -> (B, H, L, S)
            else:
                raise ValueError(
                    f"attn_mask must be (L={L}, S={S}) or (B·H={B * H}, L={L}, S={S}), got "
                    f"{tuple(t.shape)}"
                )
            if t.dtype == torch.bool:
                ok = ~t
            elif t.is_floating_point():
                # -inf entries are masks (generate_square_subsequent_mask); the rest is a bias
                ok = t != float("-inf")
                bias = torch.where(ok, t, torch.zeros((), dtype=t.dtype, device=t.device))
                if bool(bias.any()):  # an all-zero bias (a pure -inf mask) adds nothing
                    added = bias.to(dtype) if added is None else added + bias.to(dtype)
            else:
                raise TypeError(f"{name} must be bool or float, got {t.dtype}")
            allowed = ok if allowed is None else allowed & ok
        return allowed, added

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True is a hint that needs attn_mask, as in torch.nn.MultiheadAttention;"
                " pass attn_mask=nn.Transformer.generate_square_subsequent_mask(L)"
            )
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            batch_first = False
        else:
            batch_first = self.batch_first
        if not batch_first:
            # (L, B, E) -> (B, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, _ = query.shape
        S = key.shape[1]
        # is_causal asserts that attn_mask is the causal mask (torch's contract for the hint), so
        # the mask is taken as causal(): a fused kernel can then skip the masked half.
        allowed, added = self._masks(
            key_padding_mask,
            None if is_causal else attn_mask,
            B,
            self.attn.n_heads,
            L,
            S,
            query.dtype,
        )
        if is_causal:
            allowed = causal() if allowed is None else causal() & allowed
        # separate projections: passing key as context is the same as self-attention when
        # key is query, and never touches a cache
        out = self.attn(
            query,
            key,
            mask=allowed,
            score_mod=added,
            return_weights=need_weights,
            value=value,
            q_offset=0,
        )
        w = None
        if need_weights:
            out, w = out
            if average_attn_weights:
                w = w.mean(dim=1)  # (B, H, L, S) -> (B, L, S)
        if not batch_first:
            out = out.transpose(0, 1)  # (B, L, E) -> (L, B, E)
        if unbatched:
            out = out.squeeze(1)
            w = None if w is None else w.squeeze(0)
        return out, w
