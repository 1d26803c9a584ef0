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

Gemma-2 extras, each a config field: soft-capped attention scores (``attn_softcap``, a
:func:`selfattn.scores.softcap` score mod) and final logits (``final_softcap``),
``query_pre_attn_scalar`` (``attn_scale``), embeddings scaled by ``sqrt(d_model)``, and norms after
the attention and feed-forward outputs (``sandwich_norm``). Gemma-2's RMSNorm multiplies by ``(1 +
weight)`` *before* casting back to the input dtype; we store ``1 + weight`` in
:class:`~selfattn.nn.RMSNorm`, which multiplies after the cast: identical in fp32, one rounding
apart in fp16/bf16. Not implemented (loading raises): GPT-2 cross-attention, YaRN with
``truncate=False``, bidirectional Gemma attention.

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
    # StaticCache for global ones): a LayerCaches; "paged": one PagedKV for the whole model
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

Left padding (leading zeros only) becomes the analytic mask ``~padding(starts)``; any other
pattern of zeros becomes a bool key mask. Query rows at padded positions attend to nothing and
return 0 (transformers returns other values there; they are never used).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfattn import masks as _masks
from selfattn import scores as _scores
from selfattn.cache import PagedCacheView, PagedKV, SlidingWindowCache, StaticCache
from selfattn.cache.layers import LayerCaches
from selfattn.models.hub import register, unsupported
from selfattn.nn import MLP, DecoderBlock, LayerNorm, MultiHeadAttention, RMSNorm, SwiGLU
from selfattn.nn.mlp import ACTIVATIONS
from selfattn.positions import (
    DynamicNTK,
    LearnedPositions,
    Linear,
    Llama3,
    LongRoPE,
    RoPE,
    YaRN,
)

__all__ = ["GPT2", "CausalLM", "DecoderConfig", "LayerCaches", "Llama"]

_LAYER_TYPES = ("full_attention", "sliding_attention")
CACHE_KINDS = ("static", "window", "paged")


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
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            _check_positive(name, getattr(self, name))
        n_kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        _check_positive("n_kv_heads", n_kv)
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
        _check_positive("head_dim", self.head_dim)
        if self.positions not in ("rope", "learned"):
            raise ValueError(
                f"DecoderConfig positions must be 'rope' or 'learned', got {self.positions!r}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"DecoderConfig activation {self.activation!r} is not one of {sorted(ACTIVATIONS)}"
            )
        if not self.norm_eps > 0:
            raise ValueError(f"DecoderConfig norm_eps must be > 0, got {self.norm_eps}")
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
        if "sliding_attention" in types:
            if self.sliding_window is None:
                raise ValueError(
                    "DecoderConfig layer_types has sliding_attention layers but sliding_window is "
                    "None; pass the window size (tokens, the query's own included)"
                )
            _check_positive("sliding_window", self.sliding_window)
        for name in ("attn_softcap", "final_softcap"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ValueError(f"DecoderConfig {name} must be > 0 or None, got {cap}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @classmethod
    def from_hf(cls, config: Mapping) -> DecoderConfig:
        """From a transformers ``config.json`` dict (``model_type`` gpt2, llama, mistral, qwen2,
        gemma2); options we do not implement raise ``UnsupportedConfigError``."""
        if config.get("model_type") == "gpt2":
            return _gpt2_config(config)
        if config.get("model_type") in ("llama", "mistral", "qwen2", "gemma2"):
            return _llama_config(config)
        raise unsupported(config, "model_type", "not a decoder family of this module")

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: global)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DecoderConfig {name} must be a positive int, got {value!r}")


# -- transformers config.json -> DecoderConfig ----------------------------------------------------


def _rope_from_hf(config: Mapping, head_dim: int) -> tuple[float, object, int]:
    """``(base, scaling, rotary_dim)`` from transformers 5's ``rope_parameters`` (or the older
    top-level ``rope_theta`` + ``rope_scaling``)."""
    params = config.get("rope_parameters")
    if not params:
        params = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta")}
    if "full_attention" in params and isinstance(params["full_attention"], Mapping):
        raise unsupported(config, "rope_parameters", "per-layer-type RoPE parameters")
    base = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    max_pos = config.get("max_position_embeddings")
    original = params.get("original_max_position_embeddings", max_pos)
    factor = params.get("factor")
    if kind == "default":
        return base, None, rotary_dim
    if kind == "linear":
        return base, Linear(factor), rotary_dim
    if kind == "dynamic":  # transformers scales from max_position_embeddings
        return base, DynamicNTK(factor, max_pos), rotary_dim
    if kind == "yarn":
        if params.get("truncate", True) is False:
            raise unsupported(config, "rope_parameters", "YaRN with truncate=False")
        scaling = YaRN(
            factor if factor is not None else max_pos / original,
            original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
        )
        return base, scaling, rotary_dim
    if kind == "llama3":
        scaling = Llama3(
            factor,
            original,
            low_freq_factor=params.get("low_freq_factor", 1.0),
            high_freq_factor=params.get("high_freq_factor", 4.0),
        )
        return base, scaling, rotary_dim
    if kind == "longrope":
        attention_factor = params.get("attention_factor")
        if factor is not None and attention_factor is None and factor != max_pos / original:
            raise unsupported(
                config, "rope_parameters", "LongRoPE with a factor other than max/original length"
            )
        scaling = LongRoPE(
            params["short_factor"], params["long_factor"], original, attention_factor, max_pos
        )
        return base, scaling, rotary_dim
    raise unsupported(config, "rope_parameters", f"rope_type {kind!r} is not implemented")


def _eos(config: Mapping):
    eos = config.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else eos


def _gpt2_config(config: Mapping) -> DecoderConfig:
    if config.get("add_cross_attention"):
        raise unsupported(config, "add_cross_attention", "GPT-2 here is decoder-only")
    d = config["n_embd"]
    return DecoderConfig(
        vocab_size=config["vocab_size"],
        d_model=d,
        n_layers=config["n_layer"],
        n_heads=config["n_head"],
        d_ff=config.get("n_inner") or 4 * d,
        positions="learned",
        max_positions=config.get("n_positions", 1024),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        activation=config.get("activation_function", "gelu_new"),
        attention_bias=True,
        out_bias=True,
        mlp_bias=True,
        attn_scale=None if config.get("scale_attn_weights", True) else 1.0,
        scale_by_layer=bool(config.get("scale_attn_by_inverse_layer_idx", False)),
        tie_embeddings=config.get("tie_word_embeddings", True),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=_eos(config),
        pad_token_id=config.get("pad_token_id"),
    )


def _llama_config(config: Mapping) -> DecoderConfig:
    model_type = config.get("model_type")
    d, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or d // n_heads
    base, scaling, rotary_dim = _rope_from_hf(config, head_dim)
    n_layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if model_type == "qwen2" and not config.get("use_sliding_window", False):
        window, layer_types = None, None
    if layer_types is None and window is not None:
        layer_types = ["sliding_attention"] * n_layers  # Mistral: every layer is windowed
    gemma = model_type == "gemma2"
    if gemma and config.get("use_bidirectional_attention"):
        raise unsupported(config, "use_bidirectional_attention", "decoders here are causal")
    qkv_bias = config.get("attention_bias", model_type == "qwen2")
    pre_attn = config.get("query_pre_attn_scalar")
    return DecoderConfig(
        vocab_size=config["vocab_size"],
        d_model=d,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=config["intermediate_size"],
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        positions="rope",
        max_positions=config.get("max_position_embeddings", 2048),
        rope_base=base,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        activation=config.get("hidden_activation") or config.get("hidden_act", "silu"),
        attention_bias=qkv_bias,
        out_bias=qkv_bias and model_type != "qwen2",  # Qwen2: bias on q/k/v only
        mlp_bias=config.get("mlp_bias", False),
        sliding_window=window if layer_types and "sliding_attention" in layer_types else None,
        layer_types=None if layer_types is None else tuple(layer_types),
        attn_scale=None if not (gemma and pre_attn) else pre_attn**-0.5,
        attn_softcap=config.get("attn_logit_softcapping") if gemma else None,
        final_softcap=config.get("final_logit_softcapping") if gemma else None,
        embed_scale=math.sqrt(d) if gemma else 1.0,
        sandwich_norm=gemma,
        tie_embeddings=config.get("tie_word_embeddings", gemma),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=_eos(config),
        pad_token_id=config.get("pad_token_id"),
    )


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
            rope = RoPE(c.head_dim, c.rope_base, c.rope_scaling, rotary_dim=c.rotary_dim)
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
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
            raise ValueError(f"input_ids must be a (B, S) int tensor, got {got!r}")
        if input_ids.is_floating_point():
            raise TypeError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if cache is not None and not callable(getattr(cache, "plan", None)):
            raise TypeError(
                f"cache must come from model.make_cache(...), got {type(cache).__name__}"
            )
        if cache is not None and cache.n_layers != len(self.layers):
            raise ValueError(
                f"cache holds {cache.n_layers} layers but the model has {len(self.layers)}; "
                "build it with this model's make_cache(...)"
            )
        B, S = input_ids.shape
        if isinstance(logits_to_keep, torch.Tensor):
            _check_positions_to_keep(logits_to_keep, S)
        elif logits_to_keep is not None and not (
            isinstance(logits_to_keep, int) and 1 <= logits_to_keep <= S
        ):
            raise ValueError(
                f"logits_to_keep must be an int in 1..S={S} or None, got {logits_to_keep!r} (or "
                "a 1-D tensor of the positions to keep)"
            )
        # A ragged paged cache has no single length: read it only where a mask needs it.
        past = 0 if cache is None or attention_mask is None else cache.length
        starts, keep = self._key_padding(attention_mask, B, past + S)  # checked before planning
        step = None if cache is None else cache.plan(S)  # the cache's bookkeeping, once
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            elif step is not None:
                position_ids = step.positions  # (S,), or (B, S) for ragged paged sequences
            else:
                position_ids = torch.arange(S, device=input_ids.device)
        h = self.embed(input_ids)  # (B, S) -> (B, S, d_model)
        if self.pos_embed is not None:
            h = h + self.pos_embed(position_ids)
        if self.config.embed_scale != 1.0:
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        # One mask per kind of layer (window or global), in absolute positions.
        masks = {w: _layer_mask(w, starts, keep) for w in set(self._windows)}
        layer_caches = [None] * len(self.layers) if step is None else step.layers
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
        logits = self.lm_head(self.norm(h))  # (B, S, d_model) -> (B, S, vocab)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @staticmethod
    def _key_padding(attention_mask, B: int, Sk: int):
        """``(starts (B,) or None, keep (B, Sk) bool or None)`` from a 0/1 ``attention_mask``.

        Left padding (zeros then ones in every row) gives ``starts``, the first real position of
        each row: an analytic mask. Any other pattern gives the bool ``keep`` columns.
        """
        if attention_mask is None:
            return None, None
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, Sk):
            got = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise ValueError(
                f"attention_mask must be (B={B}, S_past + S={Sk}) with 1 at tokens and 0 at "
                f"padding (cached tokens included), got {got}"
            )
        keep = attention_mask.bool()
        if Sk > 1 and not bool((keep[:, 1:] >= keep[:, :-1]).all()):
            return None, keep
        return Sk - keep.sum(-1), None

    # -- checkpoints and caches --------------------------------------------------------------------
    def make_cache(
        self, kind: str, batch: int, max_len: int, *, dtype=None, page_size: int = 16
    ) -> LayerCaches | PagedCacheView:
        """The model's KV cache for ``batch`` sequences of up to ``max_len`` tokens.

        ``kind``: ``"static"`` (a :class:`~selfattn.cache.StaticCache` per layer), ``"window"``
        (:class:`~selfattn.cache.SlidingWindowCache` on windowed layers, StaticCache on global
        ones), both as a :class:`~selfattn.cache.layers.LayerCaches`; or ``"paged"``: one
        :class:`~selfattn.cache.PagedKV` of ``page_size``-token pages for all layers (one
        allocator and block table, per-layer pages), viewed over ``batch`` fresh sequences
        (``cache.cache`` is the PagedKV, ``cache.seq_ids`` the rows' sequences). ``dtype``
        defaults to the model's.
        """
        if kind not in CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {kind!r}")
        for name, value in (("batch", batch), ("max_len", max_len), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"make_cache {name} must be a positive int, got {value!r}")
        c = self.config
        w = self.lm_head.weight
        fk = {"dtype": dtype or w.dtype, "device": w.device}
        shape = (c.n_kv_heads, c.head_dim)
        if kind == "paged":
            pages = -(-max_len // page_size)
            kv = PagedKV(
                c.n_layers, batch * pages, page_size, *shape, max_seqs=batch,
                max_pages_per_seq=pages, **fk,
            )  # fmt: skip
            return kv.view(kv.add_sequences(batch))
        layers = []
        for window in self._windows:
            if kind == "window" and window is not None:
                # A ring longer than max_len + 1 would never wrap: keep it no longer.
                layers.append(SlidingWindowCache(batch, min(window, max_len + 1), *shape, **fk))
            else:
                layers.append(StaticCache(batch, max_len, *shape, **fk))
        return LayerCaches(kind, layers, w.device)

    def convert_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' tensor names -> ours; the tied LM head is filled from the embedding."""
        out = self._rename(state)
        if self.config.tie_embeddings:
            out.setdefault("lm_head.weight", out.get("embed.weight"))
            if out["lm_head.weight"] is None:
                del out["lm_head.weight"]
        return out

    def _rename(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def _check_positions_to_keep(index: torch.Tensor, S: int) -> None:
    """ValueError unless ``index`` is a 1-D integer tensor of positions in ``0..S-1``."""
    if index.dim() != 1 or index.is_floating_point() or index.dtype == torch.bool:
        raise ValueError(
            f"logits_to_keep as a tensor must be 1-D integer positions, got {index.dtype} "
            f"{tuple(index.shape)}"
        )
    if index.numel() and not bool(((index >= 0) & (index < S)).all()):
        raise ValueError(f"logits_to_keep positions must lie in 0..{S - 1}, got {index.tolist()}")


def _layer_mask(window, starts, keep):
    """The mask a layer ANDs with causal(): its window and the key padding (absolute key
    positions: a cache that returns part of the history says where it starts)."""
    mask = None if window is None else _masks.sliding_window(window)
    pad = None
    if starts is not None:
        if bool((starts > 0).any()):
            pad = ~_masks.padding(starts)
    elif keep is not None:
        pad = _masks.from_tensor(keep[:, None, None, :])  # (B, Sk) -> (B, 1, 1, Sk)
    if pad is None:
        return mask
    return pad if mask is None else mask & pad


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

    def _rename(self, state):
        out = {}
        for name, t in state.items():
            name = name.removeprefix("transformer.")
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # old checkpoints store the causal mask as a buffer
            parts = name.split(".")
            if parts[0] == "h":
                rest = ".".join(parts[2:])
                ours = _GPT2_LAYER.get(rest)
                if ours is None:
                    out[name] = t  # load_state names it as unexpected
                    continue
                # Conv1D stores (in, out): a Linear wants (out, in).
                if rest.endswith("weight") and not rest.startswith("ln_"):
                    t = t.t()
                out[f"layers.{parts[1]}.{ours}"] = t
            else:
                out[_GPT2_TOP.get(name, name)] = t
        return out


_GPT2_TOP = {
    "wte.weight": "embed.weight",
    "wpe.weight": "pos_embed.weight",
    "ln_f.weight": "norm.weight",
    "ln_f.bias": "norm.bias",
}
_GPT2_LAYER = {
    "ln_1.weight": "self_res.norm.weight",
    "ln_1.bias": "self_res.norm.bias",
    "attn.c_attn.weight": "self_attention.qkv_proj.weight",
    "attn.c_attn.bias": "self_attention.qkv_proj.bias",
    "attn.c_proj.weight": "self_attention.out_proj.weight",
    "attn.c_proj.bias": "self_attention.out_proj.bias",
    "ln_2.weight": "mlp_res.norm.weight",
    "ln_2.bias": "mlp_res.norm.bias",
    "mlp.c_fc.weight": "mlp.fc1.weight",
    "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight",
    "mlp.c_proj.bias": "mlp.fc2.bias",
}


@register("llama", "mistral", "qwen2", "gemma2")
class Llama(CausalLM):
    """The Llama family: RoPE, GQA, RMSNorm, gated MLP; Mistral/Qwen2/Gemma-2 options by config."""

    model_types = ("llama", "mistral", "qwen2", "gemma2")

    def _norm(self) -> nn.Module:
        return RMSNorm(self.config.d_model, self.config.norm_eps)

    def _block(self, layer: int, rope) -> DecoderBlock:
        c = self.config
        attention = MultiHeadAttention(
            c.d_model,
            c.n_heads,
            c.n_kv_heads,
            head_dim=c.head_dim,
            fused=True,  # one q/k/v matmul instead of three (the checkpoint's are stacked)
            bias=c.attention_bias,
            out_bias=c.out_bias,
            rope=rope,
            scale=self._scale(layer),
        )
        act = ACTIVATIONS[c.activation]
        mlp = (
            SwiGLU(c.d_model, c.d_ff, bias=c.mlp_bias)
            if act is F.silu
            else SwiGLU(c.d_model, c.d_ff, bias=c.mlp_bias, activation=act)
        )
        if c.sandwich_norm:
            attention, mlp = PostNormed(attention, self._norm()), PostNormed(mlp, self._norm())
        return DecoderBlock(attention, mlp, self._norm(), self._norm())

    def _rename(self, state):
        names = _llama_layer_names(self.config.sandwich_norm)
        plus_one = self.config.sandwich_norm  # Gemma's RMSNorm weight w means (1 + w)
        out = {}
        for name, t in state.items():
            name = name.removeprefix("model.")
            parts = name.split(".")
            if parts[0] == "layers" and len(parts) > 3:
                module, leaf = ".".join(parts[2:-1]), parts[-1]
                ours = names.get(module)
                if ours is None:
                    out[name] = t  # load_state names it as unexpected
                    continue
                if plus_one and module.endswith("layernorm"):
                    t = t + 1
                out[f"layers.{parts[1]}.{ours}.{leaf}"] = t
            elif name == "embed_tokens.weight":
                out["embed.weight"] = t
            elif name == "norm.weight":
                out["norm.weight"] = t + 1 if plus_one else t
            else:
                out[name] = t  # lm_head.weight keeps its name
        return _stack_qkv(out, "self_attention.inner" if plus_one else "self_attention")


def _stack_qkv(state: dict, attn: str) -> dict:
    """Each layer's ``q_proj``, ``k_proj``, ``v_proj`` tensors stacked into ``qkv_proj`` (rows
    q, then k, then v: MultiHeadAttention's fused layout). Incomplete triples stay as they are,
    so loading names them."""
    for key in [k for k in state if k.endswith(".q_proj.weight") or k.endswith(".q_proj.bias")]:
        head, leaf = key.rsplit(".q_proj.", 1)
        parts = [f"{head}.{p}_proj.{leaf}" for p in "qkv"]
        if head.endswith(attn) and all(p in state for p in parts):
            state[f"{head}.qkv_proj.{leaf}"] = torch.cat([state.pop(p) for p in parts], 0)
    return state


def _llama_layer_names(sandwich: bool) -> dict[str, str]:
    """Llama-family module names inside a layer -> ours. With Gemma-2's sandwich norms the
    attention and MLP sit inside :class:`PostNormed` (``.inner``), their output norms beside."""
    attn, mlp = ("self_attention.inner", "mlp.inner") if sandwich else ("self_attention", "mlp")
    names = {
        "input_layernorm": "self_res.norm",
        "self_attn.q_proj": f"{attn}.q_proj",
        "self_attn.k_proj": f"{attn}.k_proj",
        "self_attn.v_proj": f"{attn}.v_proj",
        "self_attn.o_proj": f"{attn}.out_proj",
        "mlp.gate_proj": f"{mlp}.gate",
        "mlp.up_proj": f"{mlp}.up",
        "mlp.down_proj": f"{mlp}.down",
    }
    if sandwich:
        names.update(
            post_attention_layernorm="self_attention.norm",
            pre_feedforward_layernorm="mlp_res.norm",
            post_feedforward_layernorm="mlp.norm",
        )
    else:
        names["post_attention_layernorm"] = "mlp_res.norm"
    return names
