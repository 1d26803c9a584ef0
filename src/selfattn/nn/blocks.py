"""Transformer blocks built from injected parts: ``EncoderBlock`` and ``DecoderBlock``.

Each block takes its attention, feed-forward and norm modules ready-made (torchtune's component
style), so one block class serves BERT (post-norm, LayerNorm, GELU) and Llama (pre-norm, RMSNorm,
SwiGLU) alike.
"""

from __future__ import annotations

import torch
from torch import nn

from selfattn import masks as _masks
from selfattn.nn.attention import MultiHeadAttention
from selfattn.nn.mlp import MLP, SwiGLU, apply_dropout
from selfattn.nn.norms import LayerNorm, RMSNorm

__all__ = [
    "MLP",
    "DecoderBlock",
    "EncoderBlock",
    "LayerNorm",
    "RMSNorm",
    "Residual",
    "SwiGLU",
]


class Residual(nn.Module):
    """``x + dropout(f(norm(x)))`` (pre-norm) or ``norm(x + dropout(f(x)))`` (post-norm)."""

    def __init__(self, norm: nn.Module, norm_first: bool, dropout: float):
        super().__init__()
        self.norm = norm
        self.norm_first = norm_first
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x, f):
        if self.norm_first:
            return x + apply_dropout(self.dropout, f(self.norm(x)))
        return self.norm(x + apply_dropout(self.dropout, f(x)))


# Masks are immutable: one causal() serves every block. ``causal() & mask`` is kept for the last
# few mask objects, so that the blocks of one step pass the same mask object to their caches (a
# planned paged step prepares each mask object once, not once per layer).
_CAUSAL = _masks.causal()
_WITH_CAUSAL: dict[int, tuple] = {}  # id(mask) -> (mask, causal & mask)
_WITH_CAUSAL_KEEP = 8  # masks a model uses in one step: one per kind of layer


def _with_causal(mask):
    """``causal() & mask`` (``causal()`` for None); the same object for the same ``mask``."""
    if mask is None:
        return _CAUSAL
    if not isinstance(mask, _masks.Mask) or torch.compiler.is_compiling():
        return _CAUSAL & mask
    hit = _WITH_CAUSAL.get(id(mask))  # the entry holds the mask: its id is not reused
    if hit is None:
        if len(_WITH_CAUSAL) >= _WITH_CAUSAL_KEEP:
            _WITH_CAUSAL.clear()  # masks of earlier steps
        hit = _WITH_CAUSAL[id(mask)] = (mask, _CAUSAL & mask)
    return hit[1]


class EncoderBlock(nn.Module):
    """Bidirectional self-attention then feed-forward, each with a residual and a norm.

    ``x (B, S, d_model) -> (B, S, d_model)``. ``norm_first=True`` is pre-norm (GPT-2, Llama);
    ``False`` is post-norm (the original Transformer, BERT). ``dropout`` applies to each residual
    branch (attention dropout lives in ``attention``).
    """

    def __init__(
        self,
        attention: MultiHeadAttention,
        mlp: nn.Module,
        attn_norm: nn.Module,
        mlp_norm: nn.Module,
        *,
        norm_first: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.attention, self.mlp = attention, mlp
        self.attn_res = Residual(attn_norm, norm_first, dropout)
        self.mlp_res = Residual(mlp_norm, norm_first, dropout)

    def forward(self, x: torch.Tensor, *, mask=None, score_mod=None, positions=None):
        """``mask``/``score_mod``/``positions`` go to the attention (e.g. a key-padding mask)."""
        x = self.attn_res(
            x, lambda h: self.attention(h, mask=mask, score_mod=score_mod, positions=positions)
        )
        return self.mlp_res(x, self.mlp)


class DecoderBlock(nn.Module):
    """Causal self-attention, optional cross-attention to an encoder output, then feed-forward.

    ``x (B, Sq, d_model)``, ``context (B, Sk, kdim)`` -> ``(B, Sq, d_model)``. Self-attention is
    always causal (``masks.causal()`` at absolute positions, so a ``ContiguousCache`` decode sees
    exactly the keys a full forward would); ``mask`` is ANDed with it (key padding, documents).
    """

    def __init__(
        self,
        self_attention: MultiHeadAttention,
        mlp: nn.Module,
        self_norm: nn.Module,
        mlp_norm: nn.Module,
        *,
        cross_attention: MultiHeadAttention | None = None,
        cross_norm: nn.Module | None = None,
        norm_first: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        if (cross_attention is None) != (cross_norm is None):
            raise ValueError("cross_attention and cross_norm go together: pass both or neither")
        self.self_attention, self.cross_attention, self.mlp = self_attention, cross_attention, mlp
        self.self_res = Residual(self_norm, norm_first, dropout)
        self.cross_res = None if cross_norm is None else Residual(cross_norm, norm_first, dropout)
        self.mlp_res = Residual(mlp_norm, norm_first, dropout)

    @staticmethod
    def causal_mask(mask):
        """The mask of the self-attention: ``causal() & mask`` (``causal()`` for None), the same
        object for the same ``mask`` (across the blocks of one step)."""
        return _with_causal(mask)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask=None,
        context_mask=None,
        score_mod=None,
        positions=None,
        cache=None,
    ):
        """``context_mask`` (bool ``(B, 1, 1, Sk)``, True = attend) masks the encoder keys."""
        if (context is None) != (self.cross_attention is None):
            raise ValueError(
                "context must be given exactly when the block has cross_attention "
                f"(has cross_attention: {self.cross_attention is not None}, "
                f"context given: {context is not None})"
            )
        causal = self.causal_mask(mask)
        x = self.self_res(
            x,
            lambda h: self.self_attention(
                h, mask=causal, score_mod=score_mod, positions=positions, cache=cache
            ),
        )
        if self.cross_res is not None:
            x = self.cross_res(x, lambda h: self.cross_attention(h, context, mask=context_mask))
        return self.mlp_res(x, self.mlp)
