"""Recurrent and hybrid decoders: Mamba-2 (every layer a Mamba-2 mixer) and Bamba (Mamba-2 layers
with a few attention layers interleaved, each layer followed by a gated MLP).

=================  ==========================================  ================================
part               Mamba-2 (``Mamba2ForCausalLM``)             Bamba (``BambaForCausalLM``)
=================  ==========================================  ================================
layer              RMSNorm, Mamba2Mixer, residual              RMSNorm, Mamba2Mixer or GQA
                                                               attention (partial RoPE: half of
                                                               each head), residual; RMSNorm,
                                                               SwiGLU, residual
cache              a LayerState per layer (fixed size)         LayerState on Mamba layers,
                                                               StaticCache on attention layers
=================  ==========================================  ================================

Why Bamba for the hybrid: it is the plainest of transformers' attention + Mamba-2 hybrids. Its
attention layers are Llama's (only the RoPE is partial) and its Mamba layers are transformers'
``Mamba2Mixer``, so both kinds of layer are parts selfattn already has; FalconH1 runs attention
and Mamba in parallel inside each layer with learned multipliers, and Zamba2 shares one attention
block across depths with LoRA adapters: each would test more glue than the claim needs.

The call protocol is :mod:`selfattn.models.decoder`'s (``model(input_ids, attention_mask, *,
cache, position_ids, logits_to_keep)``, ``make_cache(kind, batch, max_len)``), so
:func:`~selfattn.models.generate.generate` drives both. Padding (zeros in ``attention_mask``)
is zeroed before it reaches a recurrent state, so a left-padded row decodes as the unpadded one.
``make_cache("paged")`` gives Bamba's attention layers one :class:`~selfattn.cache.PagedKV`
(a :class:`~selfattn.cache.state.HybridCache` beside the states); Mamba-2 has no KV cache and
takes any kind. Qwen3-Next (:mod:`selfattn.models.qwen3next`) is a HybridLM of ``"deltanet"``
and ``"attention"`` layers whose hooks (``_attention``, ``_mlp``) add its gated attention and
experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from selfattn._validate import positive_int
from selfattn.alternatives import GatedDeltaNet, LinearAttention, Mamba2Mixer
from selfattn.cache import PagedKV, SlidingWindowCache, StaticCache
from selfattn.cache.layers import LayerCaches
from selfattn.cache.state import HybridCache
from selfattn.models.decoder import CACHE_KINDS, check_call, layer_mask
from selfattn.models.hf_mapping import bamba_state, hybrid_fields, mamba2_state
from selfattn.models.hub import register, unsupported
from selfattn.models.masking import padding_mask
from selfattn.nn import DecoderBlock, MultiHeadAttention, RMSNorm, SwiGLU
from selfattn.nn.blocks import Residual
from selfattn.positions import RoPE
from selfattn.positions.rope import memoisable

__all__ = ["Bamba", "HybridConfig", "HybridLM", "Mamba2", "MixerBlock"]

# the delta rule's chunks solve a (C, C) triangular system: 64 as flash-linear-attention
_DELTA_CHUNK = 64
_KINDS = ("mamba", "attention", "deltanet", "linear")


@dataclass(frozen=True)
class HybridConfig:
    """A stack of ``layer_types`` of width ``d_model``: ``"mamba"``, ``"attention"``,
    ``"deltanet"`` (gated DeltaNet) or ``"linear"`` (causal linear attention).

    Mamba layers: ``ssm_heads`` heads of ``ssm_head_dim``, ``state_size`` (N), ``n_groups`` of
    B/C, ``conv_width``, ``chunk_size``, ``dt_limit``; DeltaNet and linear layers: ``ssm_heads``
    heads of ``ssm_head_dim`` (keys and values), chunks of ``min(chunk_size, 64)``; DeltaNet
    layers may have fewer key heads ``ssm_k_heads`` and values of ``ssm_v_head_dim``. Attention
    layers (any ``"attention"`` entry needs ``n_heads``): GQA with RoPE on ``rotary_dim`` of each
    head, over the last ``window`` tokens if set. ``d_ff``: a SwiGLU after every layer (None:
    none, as Mamba-2).
    """

    vocab_size: int
    d_model: int
    layer_types: tuple[str, ...]
    ssm_heads: int
    ssm_head_dim: int
    ssm_k_heads: int | None = None
    ssm_v_head_dim: int | None = None
    state_size: int = 128
    n_groups: int = 1
    conv_width: int = 4
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    d_ff: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rope_base: float = 10000.0
    rotary_dim: int | None = None
    attention_bias: bool = False
    window: int | None = None
    mlp_bias: bool = False
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "ssm_heads", "ssm_head_dim", "state_size"):
            positive_int(getattr(self, name), f"HybridConfig {name}")
        types = tuple(self.layer_types)
        if not types or any(t not in _KINDS for t in types):
            raise ValueError(
                f"HybridConfig layer_types must be a non-empty list of {_KINDS}, got {list(types)}"
            )
        object.__setattr__(self, "layer_types", types)
        if "attention" in types:
            if self.n_heads is None:
                raise ValueError("HybridConfig has attention layers but n_heads is None")
            kv = self.n_kv_heads or self.n_heads
            if self.n_heads % kv:
                raise ValueError(
                    f"HybridConfig n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})"
                )
            object.__setattr__(self, "n_kv_heads", kv)
            object.__setattr__(self, "head_dim", self.head_dim or self.d_model // self.n_heads)
        if self.window is not None:
            positive_int(self.window, "HybridConfig window")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))


class MixerBlock(nn.Module):
    """``x + mixer(norm(x))`` then, with an ``mlp``, ``x + mlp(norm(x))``: a pre-norm block whose
    sequence mixer is recurrent (names as :class:`~selfattn.nn.DecoderBlock`'s)."""

    def __init__(self, mixer: nn.Module, norm: nn.Module, mlp=None, mlp_norm=None):
        super().__init__()
        self.mixer, self.mlp = mixer, mlp
        self.self_res = Residual(norm, True, 0.0)
        self.mlp_res = None if mlp is None else Residual(mlp_norm, True, 0.0)

    def forward(self, x, *, cache=None, rows=None):
        x = self.self_res(x, lambda h: self.mixer(h, cache=cache, rows=rows))
        return x if self.mlp is None else self.mlp_res(x, self.mlp)


class HybridLM(nn.Module):
    """Embedding, the ``layer_types`` stack, final RMSNorm and LM head; the call protocol of
    :mod:`selfattn.models.decoder` (module docstring)."""

    is_encoder_decoder = False
    model_types: tuple[str, ...] = ()

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.rope = None
        if "attention" in c.layer_types:
            self.rope = RoPE(c.head_dim, c.rope_base, rotary_dim=c.rotary_dim)
        self.layers = nn.ModuleList(self._block(kind, i) for i, kind in enumerate(c.layer_types))
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.eos_token_id, self.pad_token_id = c.eos_token_id, c.pad_token_id
        self.bos_token_id = c.bos_token_id

    def _mlp(self, layer: int) -> nn.Module | None:
        """Layer ``layer``'s feed-forward (families override: Qwen3-Next's experts)."""
        c = self.config
        return None if c.d_ff is None else SwiGLU(c.d_model, c.d_ff, bias=c.mlp_bias)

    def _attention(self) -> MultiHeadAttention:
        c = self.config
        return MultiHeadAttention(
            c.d_model, c.n_heads, c.n_kv_heads, head_dim=c.head_dim, fused=True,
            bias=c.attention_bias, rope=self.rope,
        )  # fmt: skip

    def _mixer(self, kind: str) -> nn.Module:
        c = self.config
        chunk = min(c.chunk_size, _DELTA_CHUNK)
        if kind == "deltanet":
            return GatedDeltaNet(c.d_model, c.ssm_heads, c.ssm_head_dim, n_k_heads=c.ssm_k_heads,
                                 v_head_dim=c.ssm_v_head_dim, conv_width=c.conv_width,
                                 chunk_size=chunk, norm_eps=c.norm_eps)  # fmt: skip
        if kind == "linear":
            return LinearAttention(c.d_model, c.ssm_heads, c.ssm_head_dim, chunk_size=chunk)
        return Mamba2Mixer(
            c.d_model, c.ssm_heads, c.ssm_head_dim, state_size=c.state_size,
            n_groups=c.n_groups, conv_width=c.conv_width, chunk_size=c.chunk_size,
            dt_limit=c.dt_limit, conv_bias=c.conv_bias, bias=c.proj_bias, norm_eps=c.norm_eps,
        )  # fmt: skip

    def _block(self, kind: str, layer: int) -> nn.Module:
        c = self.config
        norm = RMSNorm(c.d_model, c.norm_eps)
        mlp_norm = None if c.d_ff is None else RMSNorm(c.d_model, c.norm_eps)
        if kind == "attention":
            return DecoderBlock(self._attention(), self._mlp(layer), norm, mlp_norm)
        return MixerBlock(self._mixer(kind), norm, self._mlp(layer), mlp_norm)

    @classmethod
    def from_config(cls, config: Mapping) -> HybridLM:
        """Build from a transformers ``config.json`` dict (random weights)."""
        if config.get("model_type") not in cls.model_types:
            raise unsupported(config, "model_type", f"{cls.__name__} builds {cls.model_types}")
        return cls(HybridConfig(**hybrid_fields(config)))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cache: LayerCaches | HybridCache | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids (B, S)`` -> logits ``(B, S, vocab)`` (``(B, n, vocab)`` with
        ``logits_to_keep``), as :meth:`selfattn.models.decoder.CausalLM.forward`."""
        check_call(input_ids, cache, len(self.layers), logits_to_keep)
        B, S = input_ids.shape
        past = 0 if cache is None else cache.length
        pad = rows = None
        if attention_mask is not None:
            pad = padding_mask(attention_mask, B, past + S, length="S_past + S")
            rows = attention_mask[:, -S:]  # (B, S): the new tokens, 1 = token
        step = None if cache is None else cache.plan(S)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = past + torch.arange(S, device=input_ids.device)
        position_ids = memoisable(position_ids)  # the factors once per step, not per layer
        mask = layer_mask(self.config.window, pad)
        h = self.embed(input_ids)  # (B, S) -> (B, S, d_model)
        caches = [None] * len(self.layers) if step is None else step.layers
        for block, layer_cache in zip(self.layers, caches):
            if isinstance(block, MixerBlock):
                h = block(h, cache=layer_cache, rows=rows)
            else:
                h = block(h, mask=mask, positions=position_ids, cache=layer_cache)
        if isinstance(logits_to_keep, torch.Tensor):
            h = h[:, logits_to_keep]
        elif logits_to_keep is not None:
            h = h[:, -logits_to_keep:]
        return self.unembed(h)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream ``h (..., d_model)`` read as logits: final norm, LM head."""
        return self.lm_head(self.norm(h))

    def make_cache(self, kind: str, batch: int, max_len: int | None = None, *, dtype=None,
                   page_size: int = 16, max_seqs: int | None = None) -> LayerCaches:  # fmt: skip
        """A :class:`~selfattn.cache.state.LayerState` per Mamba layer (fixed size: ``max_len``
        does not change it) and a :class:`~selfattn.cache.StaticCache` of ``max_len`` tokens
        per attention layer, as one :class:`~selfattn.cache.layers.LayerCaches`. ``kind``:
        ``"static"``, ``"window"`` (a :class:`~selfattn.cache.SlidingWindowCache` of ``window``
        tokens on attention layers with a window); ``"paged"``: the attention layers
        share one :class:`~selfattn.cache.PagedKV` of ``page_size``-token pages (a
        :class:`~selfattn.cache.state.HybridCache`), with room for ``max_seqs`` sequences
        (default ``batch``; more leaves room for :meth:`HybridCache.fork`)."""
        if kind not in CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {kind!r}")
        positive_int(batch, "make_cache batch")
        c, w = self.config, self.lm_head.weight
        fk = {"dtype": dtype or w.dtype, "device": w.device}
        attention = "attention" in c.layer_types
        if attention and max_len is None:
            raise ValueError(f"make_cache({kind!r}) needs max_len for the attention layers")
        if attention and kind == "paged":
            layout = [isinstance(b, DecoderBlock) for b in self.layers]
            pages = -(-max_len // positive_int(page_size, "make_cache page_size"))
            seqs = batch if max_seqs is None else positive_int(max_seqs, "make_cache max_seqs")
            if seqs < batch:
                raise ValueError(f"make_cache max_seqs={seqs} is below batch={batch}")
            # a page per max_len/page_size for every sequence: forks never run out of pages
            kv = PagedKV(
                sum(layout), seqs * pages, page_size, c.n_kv_heads, c.head_dim, max_seqs=seqs,
                max_pages_per_seq=pages, **fk,
            )  # fmt: skip
            states = [
                b.mixer.make_state(batch, **fk)
                for b in self.layers
                if not isinstance(b, DecoderBlock)
            ]
            return HybridCache(layout, kv.view(kv.add_sequences(batch)), states)
        layers = []
        for block in self.layers:
            if isinstance(block, MixerBlock):
                layers.append(block.mixer.make_state(batch, **fk))
            elif kind == "window" and c.window is not None:
                # a ring longer than max_len + 1 would never wrap (as CausalLM.make_cache)
                size = min(c.window, max_len + 1)
                layers.append(SlidingWindowCache(batch, size, c.n_kv_heads, c.head_dim, **fk))
            else:
                layers.append(StaticCache(batch, max_len, c.n_kv_heads, c.head_dim, **fk))
        return LayerCaches(kind, layers, fk["device"])


@register("mamba2")
class Mamba2(HybridLM):
    """Mamba-2 (Dao & Gu, 2024): every layer ``x + Mamba2Mixer(RMSNorm(x))``, no MLP."""

    model_types = ("mamba2",)

    def convert_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return mamba2_state(state)


@register("bamba")
class Bamba(HybridLM):
    """Bamba (IBM, 2024): Mamba-2 layers with GQA attention at ``attn_layer_indices``, a SwiGLU
    after each; the attention's RoPE turns half of each head."""

    model_types = ("bamba",)

    def convert_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return bamba_state(state)
