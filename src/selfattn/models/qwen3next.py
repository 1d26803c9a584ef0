"""Qwen3-Next (Qwen team, 2025): gated DeltaNet layers with a gated attention layer interleaved
(3 to 1 in the released models), each followed by a mixture of experts with a shared expert.

=================  ==========================================================================
part               Qwen3-Next (``Qwen3NextForCausalLM``)
=================  ==========================================================================
linear layers      :class:`~selfattn.alternatives.GatedDeltaNet`: causal conv + SiLU on q, k, v;
                   l2-normed q, k; the gated delta rule; per-head gated RMSNorm; ``Hk`` key
                   heads each serving ``Hv / Hk`` value heads
attention layers   GQA with RMS qk-norm per head, RoPE on the first ``partial_rotary_factor``
                   of each head (rotate-half), an output gate ``sigmoid(gate_proj(x))`` on the
                   merged heads (:class:`~selfattn.nn.MultiHeadAttention` ``output_gate``)
feed-forward       :class:`SharedExpertMoE`: softmax router, top-k experts (renormalised with
                   ``norm_topk``), plus a shared SwiGLU scaled by ``sigmoid(shared_gate(x))``;
                   dense SwiGLU on ``mlp_only_layers`` (and everywhere with no experts)
norms              RMSNorm; transformers stores ``w`` for ``1 + w``, added when loading
cache              :class:`~selfattn.models.hybrid.HybridLM`'s: a LayerState per DeltaNet layer,
                   KV (static, or one PagedKV) on the attention layers; forkable
=================  ==========================================================================

Everything but the feed-forward is :class:`~selfattn.models.hybrid.HybridLM` with its
``"deltanet"`` and ``"attention"`` layers; this module adds the experts and the gated, qk-normed
attention. transformers' grouped projection layouts are unpicked once, when loading
(:func:`~selfattn.models.hf_mapping.qwen3next_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from selfattn._validate import positive_int
from selfattn.models.deepseek import Experts
from selfattn.models.hf_mapping import qwen3next_fields, qwen3next_state
from selfattn.models.hub import register, unsupported
from selfattn.models.hybrid import HybridConfig, HybridLM
from selfattn.nn import MultiHeadAttention, SwiGLU

__all__ = ["Qwen3Next", "Qwen3NextConfig", "SharedExpertMoE"]


@dataclass(frozen=True)
class Qwen3NextConfig(HybridConfig):
    """:class:`~selfattn.models.hybrid.HybridConfig` (``"deltanet"`` and ``"attention"``
    layers) plus the experts: layer ``i`` is a :class:`SharedExpertMoE` where ``moe_layers[i]``
    (``n_experts`` of ``moe_d_ff``, ``experts_per_token`` per token, a shared expert of
    ``shared_d_ff``), else a SwiGLU of ``d_ff``."""

    moe_layers: tuple[bool, ...] = ()
    n_experts: int = 0
    experts_per_token: int = 1
    moe_d_ff: int = 0
    shared_d_ff: int = 0
    norm_topk: bool = True

    def __post_init__(self):
        super().__post_init__()
        kinds = set(self.layer_types) - {"deltanet", "attention"}
        if kinds:
            raise ValueError(
                f"Qwen3NextConfig layer_types are 'deltanet' and 'attention', got {sorted(kinds)}"
            )
        if self.d_ff is None:
            raise ValueError("Qwen3NextConfig needs d_ff (the dense layers' SwiGLU width)")
        moe = tuple(bool(m) for m in self.moe_layers) or (False,) * len(self.layer_types)
        if len(moe) != len(self.layer_types):
            raise ValueError(
                f"Qwen3NextConfig moe_layers has {len(moe)} entries for "
                f"{len(self.layer_types)} layers; give one per layer"
            )
        object.__setattr__(self, "moe_layers", moe)
        if any(moe):
            for name in ("n_experts", "experts_per_token", "moe_d_ff", "shared_d_ff"):
                positive_int(getattr(self, name), f"Qwen3NextConfig {name} (with moe_layers)")
            if self.experts_per_token > self.n_experts:
                raise ValueError(
                    f"Qwen3NextConfig experts_per_token ({self.experts_per_token}) exceeds "
                    f"n_experts ({self.n_experts})"
                )


class SharedExpertMoE(nn.Module):
    """Qwen3-Next's feed-forward ``(B, S, d) -> (B, S, d)``: a softmax router picks
    ``experts_per_token`` of ``n_experts`` gated MLPs per token (weights the chosen
    probabilities, renormalised to sum 1 with ``norm_topk``), and one shared gated MLP joins
    every token, scaled by ``sigmoid(shared_gate(x))``."""

    def __init__(self, d_model: int, n_experts: int, experts_per_token: int, d_ff: int,
                 shared_d_ff: int, *, norm_topk: bool = True):  # fmt: skip
        super().__init__()
        self.k, self.norm_topk = experts_per_token, norm_topk
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(d_model, n_experts, d_ff)
        self.shared = SwiGLU(d_model, shared_d_ff)
        self.shared_gate = nn.Linear(d_model, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # (B, S, d) -> (B·S, d)
        probs = self.router(h).softmax(-1, dtype=torch.float32)  # (T, E), in fp32
        weights, experts = probs.topk(self.k, dim=-1)  # (T, k) each
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = self.experts(h, experts, weights.to(h.dtype))
        out = out + torch.sigmoid(self.shared_gate(h)) * self.shared(h)
        return out.view_as(x)


@register("qwen3_next")
class Qwen3Next(HybridLM):
    """Qwen3-Next: gated DeltaNet and gated-attention layers, experts after each (module
    docstring)."""

    model_types = ("qwen3_next",)

    def __init__(self, config: Qwen3NextConfig):
        if not isinstance(config, Qwen3NextConfig):
            raise TypeError(f"Qwen3Next takes a Qwen3NextConfig, got {type(config).__name__}")
        super().__init__(config)

    @classmethod
    def from_config(cls, config: Mapping) -> Qwen3Next:
        if config.get("model_type") not in cls.model_types:
            raise unsupported(config, "model_type", f"{cls.__name__} builds {cls.model_types}")
        return cls(Qwen3NextConfig(**qwen3next_fields(config)))

    def _attention(self) -> MultiHeadAttention:
        c = self.config
        return MultiHeadAttention(
            c.d_model, c.n_heads, c.n_kv_heads, head_dim=c.head_dim, fused=True,
            bias=c.attention_bias, rope=self.rope, qk_norm="rms", qk_norm_eps=c.norm_eps,
            output_gate=True,
        )  # fmt: skip

    def _mlp(self, layer: int) -> nn.Module:
        c = self.config
        if not c.moe_layers[layer]:
            return SwiGLU(c.d_model, c.d_ff)
        return SharedExpertMoE(c.d_model, c.n_experts, c.experts_per_token, c.moe_d_ff,
                               c.shared_d_ff, norm_topk=c.norm_topk)  # fmt: skip

    def convert_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        c = self.config
        return qwen3next_state(
            state, k_heads=c.ssm_k_heads or c.ssm_heads, k_dim=c.ssm_head_dim,
            head_dim=c.head_dim or c.d_model,
        )  # fmt: skip
