"""Llama-4's text model (``Llama4ForCausalLM``, ``model_type`` ``llama4_text``).

A Llama-family decoder with these differences, each from transformers' ``modeling_llama4.py``:

- layers alternate RoPE layers, whose attention is local in chunks (``chunked_attention``:
  :func:`selfattn.masks.chunked` of ``attention_chunk_size``), with NoPE layers (``no_rope_layers``
  0: no positions at all), which attend globally;
- RoPE rotates interleaved pairs ``(x[2i], x[2i+1])`` (transformers multiplies complex numbers);
- RoPE layers L2-normalise each head of q and k (``use_qk_norm``, an RMSNorm without weight).
  transformers normalises after the rotation, we before (the norm of a head is rotation
  invariant: the same up to rounding);
- NoPE layers scale each query row by a temperature of its position (``attn_temperature_tuning``:
  :class:`~selfattn.nn.attention.QueryTemperature`), at cache positions as transformers counts;
- ``moe_layers`` use :class:`Llama4MoE` (sigmoid top-k router whose scores scale the expert's
  *input*, plus a shared expert), the others a dense SwiGLU of ``intermediate_size_mlp``.

Chunks are counted from each row's first token, as transformers counts them: from cache position
0 without an attention_mask, from the first unmasked column of a left-padded row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validate import positive_int
from selfattn.models.decoder import DecoderConfig, Llama
from selfattn.models.hf_mapping import llama4_fields, llama4_state
from selfattn.models.hub import register, unsupported
from selfattn.nn import DecoderBlock, MultiHeadAttention, SwiGLU
from selfattn.nn.attention import QueryTemperature
from selfattn.nn.mlp import ACTIVATIONS

__all__ = ["Llama4", "Llama4Config", "Llama4MoE"]


@dataclass(frozen=True)
class Llama4Config(DecoderConfig):
    """:class:`DecoderConfig` plus Llama-4's fields: ``nope_layers[i]`` (layer ``i`` has no
    positions), ``l2_qk_norm`` (on the RoPE layers), ``temperature`` (``(floor_scale,
    attn_scale)`` of the NoPE layers, or None), and the MoE: ``moe_layers``, ``n_experts``,
    ``experts_per_token`` (``d_ff`` is an expert's width), ``d_ff_dense`` (the other layers')."""

    nope_layers: tuple[bool, ...] = ()
    l2_qk_norm: bool = True
    temperature: tuple[float, float] | None = None
    moe_layers: tuple[int, ...] = ()
    n_experts: int = 1
    experts_per_token: int = 1
    d_ff_dense: int | None = None

    def __post_init__(self):
        super().__post_init__()
        nope = tuple(bool(x) for x in self.nope_layers) or (False,) * self.n_layers
        if len(nope) != self.n_layers:
            raise ValueError(
                f"Llama4Config nope_layers must have {self.n_layers} entries, got {len(nope)}"
            )
        object.__setattr__(self, "nope_layers", nope)
        positive_int(self.n_experts, "Llama4Config n_experts")
        positive_int(self.experts_per_token, "Llama4Config experts_per_token")
        if self.experts_per_token > self.n_experts:
            raise ValueError(
                f"Llama4Config experts_per_token ({self.experts_per_token}) exceeds n_experts "
                f"({self.n_experts})"
            )
        bad = [i for i in self.moe_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"Llama4Config moe_layers {bad} are not in 0..{self.n_layers - 1}")
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        if self.d_ff_dense is None:
            object.__setattr__(self, "d_ff_dense", self.d_ff)
        positive_int(self.d_ff_dense, "Llama4Config d_ff_dense")


class Llama4MoE(nn.Module):
    """Llama-4's mixture of experts: ``shared(x) + Σ_e expert_e(x · s_e)`` where ``s_e =
    sigmoid(router logit)`` for the token's ``top_k`` experts and 0 for the rest (so the others
    never run: a gated MLP without bias maps 0 to 0). ``(..., d_model) -> (..., d_model)``.

    The experts' weights are stacked as in the checkpoint: ``gate_up (E, d_model, 2·d_ff)``
    (gate columns first), ``down (E, d_ff, d_model)``.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int,
        *,
        activation=F.silu,
        device=None,
        dtype=None,
    ):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.top_k, self.activation = top_k, activation
        self.router = nn.Linear(d_model, n_experts, bias=False, **fk)
        std = d_model**-0.5  # random init only; checkpoints overwrite it
        self.gate_up = nn.Parameter(torch.randn(n_experts, d_model, 2 * d_ff, **fk) * std)
        self.down = nn.Parameter(torch.randn(n_experts, d_ff, d_model, **fk) * d_ff**-0.5)
        self.shared = SwiGLU(d_model, d_ff, activation=activation, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (..., d) -> (T, d)
        top, experts = self.router(x).topk(self.top_k, dim=-1)  # (T, k) each
        scores = torch.sigmoid(top.float()).to(x.dtype)
        out = self.shared(x)
        for e in experts.unique().tolist():  # only the experts some token picked
            tok, slot = (experts == e).nonzero(as_tuple=True)
            h = x[tok] * scores[tok, slot, None]  # the score scales the expert's input
            gate, up = (h @ self.gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, (self.activation(gate) * up) @ self.down[e])
        return out.view(shape)


@register("llama4_text")
class Llama4(Llama):
    """Llama-4's text decoder (module docstring): chunked RoPE layers, global NoPE layers with
    the query temperature, L2 qk-norm, MoE feed-forward."""

    model_types = ("llama4_text",)

    @classmethod
    def from_config(cls, config: Mapping) -> Llama4:
        if config.get("model_type") not in cls.model_types:
            raise unsupported(config, "model_type", f"{cls.__name__} builds {cls.model_types}")
        return cls(Llama4Config(**llama4_fields(config)))

    def _block(self, layer: int, rope) -> DecoderBlock:
        c = self.config
        nope = c.nope_layers[layer]
        temperature = (
            None if c.temperature is None or not nope else QueryTemperature(*c.temperature)
        )
        attention = MultiHeadAttention(
            c.d_model,
            c.n_heads,
            c.n_kv_heads,
            head_dim=c.head_dim,
            fused=True,
            bias=c.attention_bias,
            out_bias=c.out_bias,
            qk_norm="l2" if c.l2_qk_norm and not nope else None,
            qk_norm_eps=c.norm_eps,
            rope=None if nope else rope,
            scale=self._scale(layer),
            q_temperature=temperature,
        )
        act = ACTIVATIONS[c.activation]
        if layer in c.moe_layers:
            mlp = Llama4MoE(c.d_model, c.d_ff, c.n_experts, c.experts_per_token, activation=act)
        else:
            mlp = SwiGLU(c.d_model, c.d_ff_dense, activation=act)
        return DecoderBlock(attention, mlp, self._norm(), self._norm())

    def convert_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' tensor names -> ours (:func:`~selfattn.models.hf_mapping.llama4_state`;
        takes the tensors out of ``state``)."""
        return llama4_state(state)
