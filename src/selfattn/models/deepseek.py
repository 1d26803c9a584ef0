"""DeepSeek-V3 (arXiv:2412.19437): multi-head latent attention and a routed mixture of experts.

A :class:`~selfattn.models.decoder.CausalLM` whose blocks inject

=================  ==========================================================================
part               DeepSeek-V3
=================  ==========================================================================
attention          :class:`~selfattn.nn.LatentAttention` (low-rank KV latent + decoupled RoPE
                   key; optional low-rank queries ``q_lora_rank``), RoPE over the
                   ``qk_rope_head_dim`` dims only, pairs interleaved (``rope_interleave``),
                   softmax scale times YaRN's ``mscale²`` when the RoPE is YaRN-scaled
feed-forward       the first ``first_k_dense_replace`` layers a gated MLP; the others
                   :class:`MoE`: sigmoid router with a score-correction bias, group-limited
                   top-k, shared experts added
cache              latents only: :class:`~selfattn.cache.latent.LatentCache` per layer
                   (``"static"``, ``"window"``), one :class:`~selfattn.cache.latent.PagedLatentKV`
                   (``"paged"``); decode runs the absorbed order
=================  ==========================================================================

transformers' DeepSeek-V3 also caches the latent (``kv_nope``, ``k_rot``) rather than per-head K/V,
but always attends in the naive order (it decompresses the whole cache at every step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validate import positive_int
from selfattn.cache.latent import LatentCache, PagedLatentKV
from selfattn.cache.layers import LayerCaches
from selfattn.models.decoder import CausalLM, DecoderConfig
from selfattn.models.hf_mapping import deepseek_fields, deepseek_state
from selfattn.models.hub import register, unsupported
from selfattn.nn import DecoderBlock, LatentAttention, RMSNorm, SwiGLU
from selfattn.nn.mlp import ACTIVATIONS

__all__ = ["DeepseekConfig", "DeepseekV3", "MoE"]

# Added to the sum of the chosen experts' scores before normalising them (transformers' value):
# keeps a row whose scores all underflow to 0 finite.
_NORM_EPS = 1e-20
# Each group's score is the sum of its best two experts' scores (DeepSeek-V3 §2.1.2).
_GROUP_TOP = 2


@dataclass(frozen=True)
class DeepseekConfig(DecoderConfig):
    """:class:`DecoderConfig` plus MLA and MoE sizes; ``head_dim`` is the RoPE part
    ``qk_rope_head_dim``. ``first_dense`` layers use the dense MLP of ``d_ff``, the rest an
    :class:`MoE` of ``n_experts`` experts of ``moe_d_ff`` (``experts_per_token`` chosen among
    the best ``groups_per_token`` of ``n_groups`` groups) plus ``n_shared_experts``."""

    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    moe_d_ff: int = 2048
    n_experts: int = 8
    n_shared_experts: int = 1
    experts_per_token: int = 2
    n_groups: int = 1
    groups_per_token: int = 1
    norm_topk: bool = True
    routed_scale: float = 1.0
    first_dense: int = 1

    def __post_init__(self):
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "moe_d_ff", "n_experts"):
            positive_int(getattr(self, name), f"DeepseekConfig {name}")
        for name in ("experts_per_token", "n_groups", "groups_per_token"):
            positive_int(getattr(self, name), f"DeepseekConfig {name}")
        if self.n_experts % self.n_groups or self.n_experts // self.n_groups < _GROUP_TOP:
            raise ValueError(
                f"DeepseekConfig n_experts ({self.n_experts}) must split into n_groups "
                f"({self.n_groups}) groups of at least {_GROUP_TOP} experts"
            )
        if self.groups_per_token > self.n_groups:
            raise ValueError(
                f"DeepseekConfig groups_per_token ({self.groups_per_token}) exceeds n_groups "
                f"({self.n_groups})"
            )
        per_token = self.groups_per_token * self.n_experts // self.n_groups
        if self.experts_per_token > per_token:
            raise ValueError(
                f"DeepseekConfig experts_per_token ({self.experts_per_token}) exceeds the "
                f"{per_token} experts of the {self.groups_per_token} chosen groups"
            )

    @classmethod
    def from_hf(cls, config: Mapping) -> DeepseekConfig:
        return cls(**deepseek_fields(config))


class Router(nn.Module):
    """DeepSeek-V3's router: sigmoid affinities, a per-expert bias used only to choose
    (auxiliary-loss-free balancing), top-k inside the best groups."""

    def __init__(self, d_model: int, c: DeepseekConfig):
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.n_experts, d_model).normal_(std=d_model**-0.5))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_experts))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h (T, d)`` -> ``(weights (T, k) float32, experts (T, k) int64)``."""
        c = self.c
        scores = F.linear(h.float(), self.weight.float()).sigmoid()  # (T, d) -> (T, E), in fp32
        choice = scores + self.e_score_correction_bias
        T = h.shape[0]
        groups = choice.view(T, c.n_groups, -1)  # (T, E) -> (T, G, E/G)
        group_score = groups.topk(_GROUP_TOP, dim=-1)[0].sum(-1)  # (T, G)
        best = group_score.topk(c.groups_per_token, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view(T, -1)
        experts = choice.topk(c.experts_per_token, dim=-1, sorted=False)[1]  # (T, k)
        weights = scores.gather(1, experts)
        if c.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + _NORM_EPS)
        return weights * c.routed_scale, experts


class Experts(nn.Module):
    """``n_experts`` gated MLPs of width ``d_ff`` (I) stored as ``gate_up_proj (E, 2·I, d)``,
    ``down_proj (E, d, I)`` (DeepSeek-V3's and Qwen3-Next's layout)."""

    def __init__(self, d_model: int, n_experts: int, d_ff: int, activation=F.silu):
        super().__init__()
        E = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * d_ff, d_model).normal_(std=0.02))
        self.down_proj = nn.Parameter(torch.empty(E, d_model, d_ff).normal_(std=0.02))
        self.activation = activation

    def forward(self, h, experts, weights) -> torch.Tensor:
        """``h (T, d)``, ``experts``/``weights (T, k)`` -> ``Σ weight · expert(h)`` ``(T, d)``."""
        out = torch.zeros_like(h)
        for e in experts.unique().tolist():  # only the experts some token chose
            token, slot = torch.where(experts == e)
            gate, up = F.linear(h[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.activation(gate) * up, self.down_proj[e])  # (t, I) -> (t, d)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    """Routed experts plus always-on shared experts: ``(B, S, d) -> (B, S, d)``."""

    def __init__(self, d_model: int, c: DeepseekConfig):
        super().__init__()
        self.router = Router(d_model, c)
        act = ACTIVATIONS[c.activation]
        self.experts = Experts(d_model, c.n_experts, c.moe_d_ff, act)
        self.shared = (
            SwiGLU(d_model, c.moe_d_ff * c.n_shared_experts, activation=act)
            if c.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # (B, S, d) -> (B·S, d)
        weights, experts = self.router(h)
        out = self.experts(h, experts, weights).view_as(x)
        return out if self.shared is None else out + self.shared(x)


@register("deepseek_v3")
class DeepseekV3(CausalLM):
    """DeepSeek-V3: MLA attention, dense then MoE feed-forward, RMSNorm (module docstring)."""

    model_types = ("deepseek_v3",)

    @classmethod
    def from_config(cls, config: Mapping) -> DeepseekV3:
        if config.get("model_type") not in cls.model_types:
            raise unsupported(config, "model_type", f"{cls.__name__} builds {cls.model_types}")
        return cls(DeepseekConfig.from_hf(config))

    def _norm(self) -> nn.Module:
        return RMSNorm(self.config.d_model, self.config.norm_eps)

    def _block(self, layer: int, rope) -> DecoderBlock:
        c = self.config
        attention = LatentAttention(
            c.d_model,
            c.n_heads,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.head_dim,
            v_head_dim=c.v_head_dim,
            q_lora_rank=c.q_lora_rank,
            rope=rope,
            scale=c.attn_scale,
            bias=c.attention_bias,
            norm_eps=c.norm_eps,
        )
        if layer < c.first_dense:
            mlp = SwiGLU(c.d_model, c.d_ff, activation=ACTIVATIONS[c.activation])
        else:
            mlp = MoE(c.d_model, c)
        return DecoderBlock(attention, mlp, self._norm(), self._norm())

    def convert_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' tensor names -> ours (:func:`~selfattn.models.hf_mapping.deepseek_state`;
        takes the tensors out of ``state``)."""
        return deepseek_state(state, self.config.n_layers)

    def make_cache(self, kind: str, batch: int, max_len: int, *, dtype=None, page_size: int = 16):
        """A latent cache (module docstring): ``"static"`` and ``"window"`` (no layer is
        windowed) give a :class:`~selfattn.cache.latent.LatentCache` per layer, ``"paged"`` one
        :class:`~selfattn.cache.latent.PagedLatentKV` viewed over ``batch`` fresh sequences.
        Each holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer."""
        c, fk = self.config, self._cache_request(kind, batch, max_len, page_size, dtype)
        if kind == "paged":
            pages = -(-max_len // page_size)
            kv = PagedLatentKV(
                c.n_layers, batch * pages, page_size, c.kv_lora_rank, c.head_dim, max_seqs=batch,
                max_pages_per_seq=pages, **fk,
            )  # fmt: skip
            return kv.view(kv.add_sequences(batch))
        layers = [
            LatentCache(batch, max_len, c.kv_lora_rank, c.head_dim, **fk) for _ in self.layers
        ]
        return LayerCaches(kind, layers, fk["device"])
