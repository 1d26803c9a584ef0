"""Decoder-only causal language models: GPT-2 and the Llama family (Llama, Mistral, Qwen2, Gemma-2).

One :class:`CausalLM` holds the stack; the two families differ only in the parts they inject:

=================  =============================  ==============================================
part               GPT-2                          Llama family
=================  =============================  ==============================================
positions          learned table, added           RoPE (any scaling of ``rope_parameters``)
attention          fused ``qkv_proj``, MHA        fused ``qkv_proj`` (q/k/v stacked on load),
                                                  GQA; Qwen2 qkv bias
feed-forward       GELU (tanh) MLP                gated MLP (SiLU; Gemma-2 GELU-tanh)
norm               LayerNorm                      RMSNorm (Gemma-2: ``1 + weight``, folded in)
local layers       none                           Mistral: every layer windowed; Qwen2/Gemma-2:
                                                  ``layer_types`` alternating window/global
=================  =============================  ==============================================

Issue 15's variants, each a config field: QK-norm (``qk_norm``: Qwen-3 and Gemma-3 per head,
OLMo-2 over the whole projection, ``qk_norm_scope="all"``), OLMo-2's norms on the sublayer outputs
only (``post_norm``), Gemma-3's second RoPE base on its sliding layers (``rope_local_base``),
DiffLlama's differential attention (``diff_attention``; :class:`~selfattn.nn.DiffAttention`),
chunked layers (``"chunked_attention"`` with ``attention_chunk_size``) and interleaved RoPE for
Llama-4 (:mod:`selfattn.models.llama4`).

Gemma-2 extras, each a config field: soft-capped attention scores (``attn_softcap``, a
:func:`selfattn.scores.softcap` score mod) and final logits (``final_softcap``),
``query_pre_attn_scalar`` (``attn_scale``), embeddings scaled by ``sqrt(d_model)``, and norms after
the attention and feed-forward outputs (``sandwich_norm``). Gemma-2's RMSNorm multiplies by ``(1 +
weight)`` *before* casting back to the input dtype; we store ``1 + weight`` in
:class:`~selfattn.nn.RMSNorm`, which multiplies after the cast: identical in fp32, one rounding
apart in fp16/bf16. Not implemented (loading raises): GPT-2 cross-attention, bidirectional Gemma
attention.

gpt-oss (:class:`GptOss`): the Llama layout with q/k/v/o biases, learned attention sinks (``sinks=``
of :func:`selfattn.attention`, owned by each layer's MultiHeadAttention), ``layer_types``
alternating window/global, YaRN without rounding (``truncate=False``) and a top-k mixture of
clamped SwiGLU experts in place of the MLP.

Model protocol (generation, serving and benchmarks rely on it)::

    logits = model(input_ids (B, S) long, attention_mask=None, *, cache=None, position_ids=None,
                   logits_to_keep=None)
    # -> (B, S, vocab); (B, n, vocab) for the last n = logits_to_keep positions only, or for
    #    the positions a 1-D int tensor logits_to_keep lists (a packed serving step).
    #    attention_mask (B, S_past + S): 1 = token, 0 = padding, covering the cached tokens
    #    too. position_ids (B, S) or (S,): default attention_mask.cumsum(-1) - 1 (clipped at 0)
    #    for the last S columns, else S_past + arange(S).
    cache = model.make_cache(kind, batch, max_len, *, dtype=None, page_size=16)
    # kind "static" (StaticCache per layer), "window" (SlidingWindowCache for windowed layers,
    # StaticCache for global ones), "kivi" (a 2/4-bit KIVICache per layer, bits=, group=,
    # residual=): a LayerCaches; "paged": one PagedKV for the whole model
    # (one block table, allocator and prefix index; per-layer pages), viewed over `batch`
    # sequences. Pass it back as cache=, read .length. Each forward plans the cache once
    # (cache.plan(S)) and gives layer i step.layers[i]. Without an attention_mask, a paged
    # cache's sequences may differ in length (serving): each row's tokens follow its own
    # length, positions included.

A step with a cache appends its ``S`` tokens after the cached ones; token ``t`` of the padded row
sits at cache position ``t`` (padding included), and masks work on those positions::

    left-padded row  [pad pad a b] + c      attention_mask [0 0 1 1 1]
    cache position    0   1   2 3    4      position_ids    -  -  0 1 2
    query c (pos 4) sees keys 2 3 4: causal() & ~padding(starts=2)

Left padding (leading zeros only) becomes the analytic mask ``~padding(starts)``, right padding
``padding(lengths)``, any other pattern of zeros a bool key mask
(:func:`selfattn.models.masking.padding_mask`, shared with the encoders). Query rows at
left-padded positions attend to nothing and return 0 (transformers returns other values there;
they are never used).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfattn import masks as _masks
from selfattn import scores as _scores
from selfattn._validate import one_of, positive_int, positive_number
from selfattn.cache import (
    KIVICache,
    PagedCacheView,
    PagedKV,
    SlidingWindowCache,
    StaticCache,
    StreamingCache,
    StreamingCaches,
    StreamingPagedKV,
)
from selfattn.cache.layers import LayerCaches
from selfattn.models.decode_fast import fast_blocks
from selfattn.models.hf_mapping import decoder_fields, gpt2_state, llama_state
from selfattn.models.hub import register, unsupported
from selfattn.models.masking import padding_mask
from selfattn.nn import (
    MLP,
    DecoderBlock,
    DiffAttention,
    LayerNorm,
    MultiHeadAttention,
    RMSNorm,
    SwiGLU,
)
from selfattn.nn.mlp import ACTIVATIONS
from selfattn.positions import (
    LearnedPositions,
    RoPE,
)
from selfattn.positions.rope import memoisable

__all__ = [
    "GPT2",
    "CausalLM",
    "DecoderConfig",
    "GptOss",
    "LayerCaches",
    "Llama",
    "layer_mask",
]

_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
CACHE_KINDS = ("static", "window", "paged")
# A causal LM's kinds: the shared ones plus KIVI's quantised per-layer cache.
DECODER_CACHE_KINDS = (*CACHE_KINDS, "kivi")


# -- config ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes and options of a decoder-only LM; :meth:`from_hf` maps transformers' config.json.

    ``layer_types[i]`` is ``"full_attention"`` or ``"sliding_attention"`` (the latter attends to
    the last ``sliding_window`` tokens, its own included). ``positions`` is ``"rope"`` (with
    ``rope_base``, ``rope_scaling`` a :mod:`selfattn.positions` scaling or None, ``rotary_dim``)
    or ``"learned"`` (a table of ``max_positions``). ``attention_bias`` is the q/k/v projections'
    bias, ``out_bias`` the output projection's. Gemma-2 options: ``attn_scale``,
    ``attn_softcap``, ``final_softcap``, ``embed_scale`` and ``sandwich_norm`` (module docstring).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    positions: str = "rope"
    max_positions: int = 2048
    rope_base: float = 10000.0
    rope_scaling: object = None
    rotary_dim: int | None = None
    norm_eps: float = 1e-6
    activation: str = "silu"
    attention_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attn_scale: float | None = None  # default 1/sqrt(head_dim)
    scale_by_layer: bool = False  # GPT-2's scale_attn_by_inverse_layer_idx
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float = 1.0
    sandwich_norm: bool = False
    # Variants: q/k norms ("rms"; scope "head" or OLMo-2's "all"), OLMo-2's norms on
    # the sublayer outputs only, Gemma-3's RoPE base of the sliding layers, DiffLlama's
    # differential attention.
    qk_norm: str | None = None
    qk_norm_scope: str = "head"
    post_norm: bool = False
    rope_local_base: float | None = None
    diff_attention: bool = False
    attention_chunk_size: int | None = None  # "chunked_attention" layers (Llama-4)
    rope_interleaved: bool = False  # RoPE on (x[2i], x[2i+1]) pairs (Llama-4, DeepSeek)
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # gpt-oss: learned attention sinks, a top-k mixture of clamped-SwiGLU experts
    attn_sinks: bool = False
    n_experts: int | None = None
    experts_per_token: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            positive_int(getattr(self, name), f"DecoderConfig {name}")
        n_kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        positive_int(n_kv, "DecoderConfig n_kv_heads")
        object.__setattr__(self, "n_kv_heads", n_kv)
        if self.n_heads % n_kv:
            raise ValueError(
                f"DecoderConfig n_heads ({self.n_heads}) must be divisible by n_kv_heads ({n_kv}); "
                f"pick n_kv_heads among the divisors of {self.n_heads}"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"DecoderConfig d_model ({self.d_model}) must be divisible by n_heads "
                    f"({self.n_heads}), or pass head_dim"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        positive_int(self.head_dim, "DecoderConfig head_dim")
        if self.positions not in ("rope", "learned"):
            raise ValueError(
                f"DecoderConfig positions must be 'rope' or 'learned', got {self.positions!r}"
            )
        one_of(self.activation, "DecoderConfig activation", ACTIVATIONS)
        positive_number(self.norm_eps, "DecoderConfig norm_eps")
        types = (
            ("full_attention",) * self.n_layers if self.layer_types is None else self.layer_types
        )
        types = tuple(types)
        if len(types) != self.n_layers or any(t not in _LAYER_TYPES for t in types):
            raise ValueError(
                f"DecoderConfig layer_types must list {self.n_layers} entries from {_LAYER_TYPES}, "
                f"got {list(types)}"
            )
        object.__setattr__(self, "layer_types", types)
        for kind, field, what in (
            ("sliding_attention", "sliding_window", "the window size (tokens, its own included)"),
            ("chunked_attention", "attention_chunk_size", "the chunk size (tokens)"),
        ):
            if kind not in types:
                continue
            if getattr(self, field) is None:
                raise ValueError(
                    f"DecoderConfig layer_types has {kind} layers but {field} is None; pass {what}"
                )
            positive_int(getattr(self, field), f"DecoderConfig {field}")
        for name in ("attn_softcap", "final_softcap"):
            if getattr(self, name) is not None:
                positive_number(getattr(self, name), f"DecoderConfig {name}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.qk_norm is not None:
            one_of(self.qk_norm, "DecoderConfig qk_norm", ("rms", "layer", "l2"))
        one_of(self.qk_norm_scope, "DecoderConfig qk_norm_scope", ("head", "all"))
        if self.sandwich_norm and self.post_norm:
            raise ValueError(
                "DecoderConfig sandwich_norm and post_norm exclude each other (post_norm drops "
                "the input norms sandwich_norm keeps); pass one"
            )
        if self.rope_local_base is not None:
            positive_number(self.rope_local_base, "DecoderConfig rope_local_base")
        if self.diff_attention and self.n_kv_heads % 2:
            raise ValueError(
                f"DecoderConfig diff_attention pairs the kv heads' values, so n_kv_heads must be "
                f"even, got {self.n_kv_heads}"
            )
        if self.n_experts is not None:
            positive_int(self.n_experts, "DecoderConfig n_experts")
            positive_int(self.experts_per_token, "DecoderConfig experts_per_token")
            if self.experts_per_token > self.n_experts:
                raise ValueError(
                    f"DecoderConfig experts_per_token ({self.experts_per_token}) must be at most "
                    f"n_experts ({self.n_experts})"
                )

    @property
    def value_dim(self) -> int:
        """Width of a cached value head: ``head_dim``, or ``2 · head_dim`` with
        ``diff_attention`` (:class:`~selfattn.nn.DiffAttention` caches its paired values)."""
        return 2 * self.head_dim if self.diff_attention else self.head_dim

    @classmethod
    def from_hf(cls, config: Mapping) -> DecoderConfig:
        """From a transformers ``config.json`` dict (``model_type`` gpt2, llama, mistral, qwen2,
        gemma2; the mapping lives in :mod:`selfattn.models.hf_mapping`); options we do not
        implement raise ``UnsupportedConfigError``."""
        return cls(**decoder_fields(config))

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: global; a chunked layer's chunk size, as a
        :class:`_Chunk`)."""
        kind = self.layer_types[layer]
        if kind == "chunked_attention":
            return _Chunk(self.attention_chunk_size)
        return self.sliding_window if kind == "sliding_attention" else None


class _Chunk(int):
    """A chunked layer's entry in ``CausalLM._windows``: an int, since a query never sees more
    than the chunk size of keys (a window cache of that size serves the layer), that keys its
    own mask (:func:`layer_mask`): it never equals a sliding window of the same size."""

    def __eq__(self, other):
        return type(other) is _Chunk and int(self) == int(other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(("chunk", int(self)))


# -- parts the stack does not find in selfattn.nn ------------------------------------------------


class PostNormed(nn.Module):
    """``norm(inner(x, **kw))``: Gemma-2's norm on a sublayer's output, before the residual add."""

    def __init__(self, inner: nn.Module, norm: nn.Module):
        super().__init__()
        self.inner, self.norm = inner, norm

    def forward(self, x, **kw):
        return self.norm(self.inner(x, **kw))


# -- caches ---------------------------------------------------------------------------------------


# -- the model ------------------------------------------------------------------------------------


class CausalLM(nn.Module):
    """Token embedding, ``n_layers`` pre-norm :class:`~selfattn.nn.DecoderBlock` s, final norm and
    LM head; see the module docstring for the call protocol.

    Built by :meth:`from_config` of a family (:class:`GPT2`, :class:`Llama`); the family decides
    the injected parts through :meth:`_block` and :meth:`_norm`.
    """

    is_encoder_decoder = False
    model_types: tuple[str, ...] = ()  # the config.json model_type values a family builds

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_embed = (
            LearnedPositions(c.max_positions, c.d_model) if c.positions == "learned" else None
        )
        rope = None
        if c.positions == "rope":
            rope = RoPE(
                c.head_dim,
                c.rope_base,
                c.rope_scaling,
                rotary_dim=c.rotary_dim,
                interleaved=c.rope_interleaved,
            )
        self.rope = rope  # one module shared by the layers: one cos/sin table
        self.layers = nn.ModuleList(self._block(i, rope) for i in range(c.n_layers))
        self.norm = self._norm()
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.score_mod = None if c.attn_softcap is None else _scores.softcap(c.attn_softcap)
        self._windows = [c.window(i) for i in range(c.n_layers)]  # None: a global layer
        self.eos_token_id, self.pad_token_id = c.eos_token_id, c.pad_token_id
        self.bos_token_id = c.bos_token_id

    # Families override these two.
    def _norm(self) -> nn.Module:
        raise NotImplementedError

    def _block(self, layer: int, rope) -> DecoderBlock:
        raise NotImplementedError

    def _scale(self, layer: int) -> float | None:
        c = self.config
        scale = c.attn_scale
        if c.scale_by_layer:
            scale = (c.head_dim**-0.5 if scale is None else scale) / (layer + 1)
        return scale

    @classmethod
    def from_config(cls, config: Mapping) -> CausalLM:
        """Build from a transformers ``config.json`` dict (random weights)."""
        if config.get("model_type") not in cls.model_types:
            raise unsupported(config, "model_type", f"{cls.__name__} builds {cls.model_types}")
        return cls(DecoderConfig.from_hf(config))

    # -- forward -----------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cache: LayerCaches | PagedCacheView | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        """``input_ids (B, S)`` -> logits ``(B, S, vocab)`` (see the module docstring).

        ``logits_to_keep=n`` computes the logits of the last ``n`` positions only, ``(B, n,
        vocab)``: generation needs one, and the LM head over a whole prompt costs as much as a
        third of a GPT-2 prefill. A 1-D integer tensor keeps the positions it lists, ``(B,
        len(logits_to_keep), vocab)`` (as transformers': the last token of each sequence of a
        packed step).
        """
        check_call(input_ids, cache, len(self.layers), logits_to_keep)
        B, S = input_ids.shape
        # A ragged paged cache has no single length: read it only where a mask needs it.
        past = 0 if cache is None or attention_mask is None else cache.length
        pad = None  # the key padding, checked before planning
        if attention_mask is not None:
            pad = padding_mask(attention_mask, B, past + S, length="S_past + S")
        step = None if cache is None else cache.plan(S)  # the cache's bookkeeping, once
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            elif step is not None:
                position_ids = step.positions  # (S,), or (B, S) for ragged paged sequences
            else:
                position_ids = torch.arange(S, device=input_ids.device)
        position_ids = memoisable(position_ids)  # the factors once per step, not per layer
        h = self.embed(input_ids)  # (B, S) -> (B, S, d_model)
        if self.pos_embed is not None:
            h = h + self.pos_embed(position_ids)
        if self.config.embed_scale != 1.0:
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        # One mask per kind of layer (window or global), in absolute positions.
        masks = {w: layer_mask(w, pad, attention_mask) for w in set(self._windows)}
        layer_caches = [None] * len(self.layers) if step is None else step.layers
        fast = None if step is None else fast_blocks(self, layer_caches)
        if fast is not None:  # a planned paged step, no hooks: the blocks' ops without modules
            causal = {w: DecoderBlock.causal_mask(m) for w, m in masks.items()}
            layer_masks = [causal[w] for w in self._windows]
            h = fast.run(h, layer_caches, layer_masks, self.score_mod, position_ids)
        else:
            for block, window, layer_cache in zip(self.layers, self._windows, layer_caches):
                h = block(
                    h,
                    mask=masks[window],
                    score_mod=self.score_mod,
                    positions=position_ids,
                    cache=layer_cache,
                )
        if isinstance(logits_to_keep, torch.Tensor):
            h = h[:, logits_to_keep]  # (B, S, d_model) -> (B, n, d_model)
        elif logits_to_keep is not None:
            h = h[:, -logits_to_keep:]  # (B, S, d_model) -> (B, n, d_model)
        return self.unembed(h)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream ``h (..., d_model)`` read as logits ``(..., vocab)``: the final
        norm, the LM head and the final soft-cap (the logit lens reads any layer's stream so)."""
        logits = self.lm_head(self.norm(h))
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- checkpoints and caches --------------------------------------------------------------------
    def _cache_request(self, kind, batch, max_len, page_size, dtype) -> dict:
        """Check a ``make_cache`` request; the ``dtype``/``device`` keywords of its storage
        (the model's unless ``dtype`` says otherwise)."""
        if kind not in DECODER_CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {DECODER_CACHE_KINDS}, got {kind!r}")
        for name, value in (("batch", batch), ("max_len", max_len), ("page_size", page_size)):
            positive_int(value, f"make_cache {name}")
        w = self.norm.weight  # dense in every model (a quantised LM head has no .weight)
        return {"dtype": dtype or w.dtype, "device": w.device}

    def make_cache(
        self,
        kind: str,
        batch: int,
        max_len: int | None = None,
        *,
        dtype=None,
        page_size: int = 16,
        n_sink: int = 4,
        window: int | None = None,
        positions: str = "cache",
        paged: bool = False,
        bits: int | None = None,
        group: int | None = None,
        residual: int | None = None,
    ) -> LayerCaches | PagedCacheView:
        """The model's KV cache for ``batch`` sequences of up to ``max_len`` tokens.

        ``kind``: ``"static"`` (a :class:`~selfattn.cache.StaticCache` per layer), ``"window"``
        (:class:`~selfattn.cache.SlidingWindowCache` on windowed layers, StaticCache on global
        ones), both as a :class:`~selfattn.cache.layers.LayerCaches`; or ``"paged"``: one
        :class:`~selfattn.cache.PagedKV` of ``page_size``-token pages for all layers (one
        allocator and block table, per-layer pages), viewed over ``batch`` fresh sequences
        (``cache.cache`` is the PagedKV, ``cache.seq_ids`` the rows' sequences). ``dtype``
        defaults to the model's.

        ``"streaming"``: StreamingLLM's sinks plus a rolling window (Xiao et al., 2023), a
        :class:`~selfattn.cache.StreamingCache` of ``n_sink`` sinks and ``window`` recent tokens
        per layer, for any length (``max_len`` unused): RoPE ``positions="cache"`` (slots in the
        cache, the paper's) or ``"absolute"`` (text positions). ``paged=True``: a
        :class:`~selfattn.cache.StreamingPagedKV` of ``page_size``-token pages instead (sink
        pages pinned, passed window pages freed; ``"cache"`` positions are the kernel's key
        indices there; ``max_len`` then bounds one step's new tokens, default ``window``).

        ``"kivi"``: a :class:`~selfattn.cache.KIVICache` per layer (Liu et al., 2024): keys
        per channel and values per token in ``bits`` (2, the default, or 4) over groups of
        ``group`` (default 32), the last ``residual`` (default 128) tokens in full precision.
        """
        kivi = {"bits": bits, "group": group, "residual": residual}
        kivi = {name: value for name, value in kivi.items() if value is not None}
        if kivi and kind != "kivi":
            raise ValueError(f"make_cache({kind!r}) takes no {sorted(kivi)}: they are for 'kivi'")
        if kind == "streaming" and paged:
            return self._streaming_pages(
                batch, max_len, n_sink, window, positions, dtype, page_size
            )
        if kind == "streaming":
            return self._streaming_cache(batch, n_sink, window, positions, dtype)
        streaming_only = {"n_sink": n_sink != 4, "window": window is not None, "paged": paged,
                          "positions": positions != "cache"}  # fmt: skip
        if any(streaming_only.values()):
            given = [name for name, set_ in streaming_only.items() if set_]
            raise ValueError(f"make_cache({kind!r}) takes no {given}: they are for 'streaming'")
        if max_len is None:
            raise ValueError(f"make_cache({kind!r}) needs max_len, the most tokens it holds")
        c, fk = self.config, self._cache_request(kind, batch, max_len, page_size, dtype)
        shape = (c.n_kv_heads, c.head_dim, c.value_dim)
        if kind == "paged":
            pages = -(-max_len // page_size)
            kv = PagedKV(
                c.n_layers, batch * pages, page_size, *shape, max_seqs=batch,
                max_pages_per_seq=pages, **fk,
            )  # fmt: skip
            return kv.view(kv.add_sequences(batch))
        if kind == "kivi":
            layers = [KIVICache(batch, max_len, *shape, **kivi, **fk) for _ in self._windows]
            return LayerCaches(kind, layers, fk["device"])
        layers = []
        for window in self._windows:
            if kind == "window" and window is not None:
                # A ring longer than max_len + 1 would never wrap: keep it no longer.
                layers.append(SlidingWindowCache(batch, min(window, max_len + 1), *shape, **fk))
            else:
                layers.append(StaticCache(batch, max_len, *shape, **fk))
        return LayerCaches(kind, layers, fk["device"])

    def _streaming_pages(self, batch, max_step, n_sink, window, positions, dtype, page_size):
        self._streaming_cache(1, n_sink, window, positions, dtype)  # the same checks
        for name, value in (("batch", batch), ("page_size", page_size)):
            positive_int(value, f"make_cache {name}")
        step = window if max_step is None else positive_int(max_step, "make_cache max_len")
        c, w = self.config, self.norm.weight
        pages = StreamingPagedKV.pages_needed(n_sink, window, page_size, step)
        kv = StreamingPagedKV(
            c.n_layers, batch * pages, page_size, c.n_kv_heads, c.head_dim, c.value_dim,
            n_sink=n_sink,
            window=window, positions=positions, rope=self.rope, max_seqs=batch,
            max_pages_per_seq=pages, dtype=dtype or w.dtype, device=w.device,
        )  # fmt: skip
        return kv.view(kv.add_sequences(batch))

    def _streaming_cache(self, batch, n_sink, window, positions, dtype) -> StreamingCaches:
        if window is None:
            raise ValueError("make_cache('streaming') needs window=, the recent tokens kept")
        if any(w is not None for w in self._windows):
            # A sliding-window layer's own mask sits at text positions, which slot-ordered
            # streaming keys cannot honour: such layers need the plain window cache.
            raise ValueError(
                f"make_cache('streaming') needs a model without sliding-window layers (layer "
                f"windows {self._windows}); use make_cache('window', ...)"
            )
        positive_int(batch, "make_cache batch")
        c, w = self.config, self.norm.weight
        fk = {"dtype": dtype or w.dtype, "device": w.device}
        shape = (c.n_kv_heads, c.head_dim, c.value_dim)  # DiffLlama's values are 2·head_dim
        kw = {"positions": positions, "rope": self.rope, **fk}
        layers = [StreamingCache(batch, n_sink, window, *shape, **kw) for _ in range(c.n_layers)]
        return StreamingCaches(layers, w.device)


def check_call(input_ids, cache, n_layers: int, logits_to_keep) -> None:
    """The checks of a causal LM's call (the module docstring's protocol), errors naming the
    offending value and the fix."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ValueError(f"input_ids must be a (B, S) int tensor, got {got!r}")
    if input_ids.is_floating_point():
        raise TypeError(f"input_ids must be integer token ids, got {input_ids.dtype}")
    if cache is not None and not callable(getattr(cache, "plan", None)):
        raise TypeError(f"cache must come from model.make_cache(...), got {type(cache).__name__}")
    if cache is not None and cache.n_layers != n_layers:
        raise ValueError(
            f"cache holds {cache.n_layers} layers but the model has {n_layers}; "
            "build it with this model's make_cache(...)"
        )
    S = input_ids.shape[1]
    if isinstance(logits_to_keep, torch.Tensor):
        _check_positions_to_keep(logits_to_keep, S)
    elif logits_to_keep is not None and not (
        isinstance(logits_to_keep, int) and 1 <= logits_to_keep <= S
    ):
        raise ValueError(
            f"logits_to_keep must be an int in 1..S={S} or None, got {logits_to_keep!r} (or "
            "a 1-D tensor of the positions to keep)"
        )


def _check_positions_to_keep(index: torch.Tensor, S: int) -> None:
    """ValueError unless ``index`` is a 1-D integer tensor of positions in ``0..S-1``."""
    if index.dim() != 1 or index.is_floating_point() or index.dtype == torch.bool:
        raise ValueError(
            f"logits_to_keep as a tensor must be 1-D integer positions, got {index.dtype} "
            f"{tuple(index.shape)}"
        )
    if index.numel() and not bool(((index >= 0) & (index < S)).all()):
        raise ValueError(f"logits_to_keep positions must lie in 0..{S - 1}, got {index.tolist()}")


def layer_mask(window, pad, attention_mask=None):
    """The mask a layer ANDs with causal(): its window and the key padding ``pad`` (absolute key
    positions: a cache that returns part of the history says where it starts)."""
    mask = None if window is None else _masks.sliding_window(window)
    if isinstance(window, _Chunk):
        mask = _chunks(int(window), attention_mask)
    if pad is None:
        return mask
    return pad if mask is None else mask & pad


def _chunks(size: int, attention_mask):
    """Llama-4's chunks of ``size`` tokens counted from each row's first token (transformers
    subtracts the row's leading padding): :func:`~selfattn.masks.chunked` on absolute positions
    without left padding, else document ids ``(position - lead) // size`` over the ``(B, S_past
    + S)`` mask's columns (padding shares chunk 0; the key padding hides it anyway)."""
    if attention_mask is None:
        return _masks.chunked(size)
    lead = (attention_mask.long().cumsum(-1) == 0).sum(-1, keepdim=True)  # (B, 1)
    if not bool(lead.any()):
        return _masks.chunked(size)
    pos = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return _masks.documents(torch.div((pos - lead).clamp(min=0), size, rounding_mode="floor"))


@register("gpt2")
class GPT2(CausalLM):
    """GPT-2 (Radford et al. 2019): learned positions, fused qkv, LayerNorm, GELU-tanh MLP."""

    model_types = ("gpt2",)

    def _norm(self) -> nn.Module:
        return LayerNorm(self.config.d_model, eps=self.config.norm_eps)

    def _block(self, layer: int, rope) -> DecoderBlock:
        c = self.config
        attention = MultiHeadAttention(
            c.d_model, c.n_heads, fused=True, bias=c.attention_bias, scale=self._scale(layer)
        )
        mlp = MLP(c.d_model, c.d_ff, bias=c.mlp_bias, activation=ACTIVATIONS[c.activation])
        return DecoderBlock(attention, mlp, self._norm(), self._norm())

    def convert_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' tensor names -> ours (:func:`~selfattn.models.hf_mapping.gpt2_state`;
        takes the tensors out of ``state``). A tied LM head is filled by ``load_state``."""
        return gpt2_state(state)


_LLAMA_TYPES = (
    "llama", "mistral", "qwen2", "gemma2", "qwen3", "olmo2", "gemma3_text", "diffllama", "phi3",
)  # fmt: skip


@register(*_LLAMA_TYPES)
class Llama(CausalLM):
    """The Llama family: RoPE, GQA, RMSNorm, gated MLP; Mistral/Qwen2/Gemma-2, Qwen-3/OLMo-2
    (QK-norm), Gemma-3 (QK-norm, a second RoPE base on its sliding layers), DiffLlama
    (differential attention) and Phi-3 (fused q/k/v and gate/up in its checkpoints) options by
    config."""

    model_types = _LLAMA_TYPES

    def _layer_rope(self, layer: int, rope):
        """Gemma-3: sliding layers rotate with their own base (one module shared by them)."""
        c = self.config
        if c.rope_local_base is None or c.layer_types[layer] != "sliding_attention":
            return rope
        if getattr(self, "rope_local", None) is None:
            self.rope_local = RoPE(c.head_dim, c.rope_local_base, rotary_dim=c.rotary_dim)
        return self.rope_local

    def _norm(self) -> nn.Module:
        return RMSNorm(self.config.d_model, self.config.norm_eps)

    def _block(self, layer: int, rope) -> DecoderBlock:
        c = self.config
        kw = {}
        if c.diff_attention:
            kw = dict(lambda_init=DiffAttention.default_lambda_init(layer), norm_eps=c.norm_eps)
        attention = (DiffAttention if c.diff_attention else MultiHeadAttention)(
            c.d_model,
            c.n_heads,
            c.n_kv_heads,
            head_dim=c.head_dim,
            fused=True,  # one q/k/v matmul instead of three (the checkpoint's are stacked)
            bias=c.attention_bias,
            out_bias=c.out_bias,
            qk_norm=c.qk_norm,
            qk_norm_eps=c.norm_eps,
            qk_norm_scope=c.qk_norm_scope,
            rope=self._layer_rope(layer, rope),
            scale=self._scale(layer),
            **kw,
        )
        act = ACTIVATIONS[c.activation]
        mlp = (
            SwiGLU(c.d_model, c.d_ff, bias=c.mlp_bias)
            if act is F.silu
            else SwiGLU(c.d_model, c.d_ff, bias=c.mlp_bias, activation=act)
        )
        if c.sandwich_norm or c.post_norm:
            attention, mlp = PostNormed(attention, self._norm()), PostNormed(mlp, self._norm())
        if c.post_norm:  # OLMo-2: x + norm(f(x)), no norm on the sublayer's input
            return DecoderBlock(attention, mlp, nn.Identity(), nn.Identity())
        return DecoderBlock(attention, mlp, self._norm(), self._norm())

    def convert_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' tensor names -> ours (:func:`~selfattn.models.hf_mapping.llama_state`;
        takes the tensors out of ``state``). A tied LM head is filled by ``load_state``."""
        c = self.config
        return llama_state(state, sandwich_norm=c.sandwich_norm, post_norm=c.post_norm)


class ClampedSwiGLUExperts(nn.Module):
    """gpt-oss's feed-forward: a router picks ``k`` of ``E`` experts per token (softmax over the
    top-k logits), each a SwiGLU with clamped inputs, ``(up + 1) · gate · σ(α · gate)``.

    The parameters keep transformers' layout (``gate_up_proj (E, d, 2F)`` with gate and up
    interleaved in the last dim, ``down_proj (E, F, d)``, their biases), so a checkpoint loads
    without copies. Experts run on the tokens routed to them only (a loop over the experts hit).
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int, alpha: float, limit: float):
        super().__init__()
        self.k, self.alpha, self.limit = k, alpha, limit
        self.router = nn.Linear(d_model, n_experts)
        self.experts = nn.Module()
        ex = self.experts
        ex.gate_up_proj = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_ff))
        ex.gate_up_proj_bias = nn.Parameter(torch.zeros(n_experts, 2 * d_ff))
        ex.down_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        ex.down_proj_bias = nn.Parameter(torch.zeros(n_experts, d_model))
        for w in (ex.gate_up_proj, ex.down_proj):
            nn.init.normal_(w, std=d_model**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape
        x = x.reshape(B * S, d)  # (B, S, d) -> (T, d)
        top, idx = self.router(x).topk(self.k, dim=-1)  # (T, k) each
        weights = top.softmax(dim=-1)
        out = torch.zeros_like(x)
        ex = self.experts
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            gate_up = x[tok] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]  # (n, 2F)
            gate = gate_up[:, ::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
            h = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
            y = h @ ex.down_proj[e] + ex.down_proj_bias[e]  # (n, F) -> (n, d)
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
        return out.view(B, S, d)


@register("gpt_oss")
class GptOss(CausalLM):
    """gpt-oss (OpenAI, 2025): GQA with learned attention sinks and q/k/v/o biases, alternating
    sliding-window and global layers, YaRN RoPE, RMSNorm, a top-k mixture of clamped SwiGLU
    experts (:class:`ClampedSwiGLUExperts`)."""

    model_types = ("gpt_oss",)

    def _norm(self) -> nn.Module:
        return RMSNorm(self.config.d_model, self.config.norm_eps)

    def _block(self, layer: int, rope) -> DecoderBlock:
        c = self.config
        attention = MultiHeadAttention(
            c.d_model, c.n_heads, c.n_kv_heads, head_dim=c.head_dim, fused=True,
            bias=c.attention_bias, out_bias=c.out_bias, rope=rope, scale=self._scale(layer),
            sinks=c.attn_sinks,
        )  # fmt: skip
        mlp = ClampedSwiGLUExperts(
            c.d_model, c.d_ff, c.n_experts or 1, c.experts_per_token, c.swiglu_alpha,
            c.swiglu_limit,
        )  # fmt: skip
        return DecoderBlock(attention, mlp, self._norm(), self._norm())

    def convert_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' tensor names -> ours (``llama_state``: the sinks and the experts keep
        their names under ``self_attention`` / ``mlp``)."""
        return llama_state(state, sandwich_norm=False)
