"""Differential attention (Ye et al., 2024, "Differential Transformer"), DiffLlama's layout.

The ``Hq`` query heads form ``Hq / 2`` pairs ``(h, h + Hq/2)``; the two heads of a pair share a
value of width ``2·D`` and the layer returns the difference of their outputs::

    out_h = (1 - λ_init) · RMSNorm(softmax(q_h k_h^T) V - λ · softmax(q_h' k_h'^T) V)
    λ     = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init

for ``h < Hq/2`` and its partner ``h' = h + Hq/2`` (the λ vectors are learnable ``D``-vectors,
the paper's re-parameterisation).

``RMSNorm`` is the per-head GroupNorm of the paper (over ``2·D``, no weight). The value of kv head
``j`` is ``[v_{j mod Hkv/2} | v_{Hkv/2 + j mod Hkv/2}]`` (transformers' ``DiffLlamaAttention``:
the two halves of the kv heads side by side, repeated for both halves of the query heads).

The layer attends once, through :class:`~selfattn.nn.MultiHeadAttention`'s own path (every
backend, mask and cache): ``Hq`` heads with the ``2·D``-wide values, then pairs the heads up.
transformers instead makes two calls over the ``D``-wide halves (or one over ``2·Hq`` heads of
width ``D``). On CPU (sdpa, fp32, D=64, one thread, best of 7 on a shared machine) one call was
as fast at prefill (S=512: 29-57 ms against 31-53 ms for two calls and 29-59 ms for doubled
heads) and faster at decode (B=4, 2,048 cached keys: 2.5-3.5 ms against 5.9-12.4 and 8.5-9.0
ms); and only this layout lets a cache that attends in place (the paged one) serve the layer:
the caches store the values the call reads (``value_dim = 2·D``, the value cache twice the key
cache's size). On GPUs whose flash kernels need ``Dv == D`` two calls may win: not measured.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from selfattn._validate import positive_number
from selfattn.nn.attention import MultiHeadAttention
from selfattn.nn.norms import RMSNorm

__all__ = ["DiffAttention"]

# DiffLlama's λ_init schedule, λ_init(l) = 0.8 - 0.6 · exp(-0.3 · l) (the paper's, l from 0).
_LAMBDA_BASE, _LAMBDA_SPAN, _LAMBDA_DECAY = 0.8, 0.6, 0.3


class DiffAttention(MultiHeadAttention):
    """Differential attention over ``(B, S, d_model)``; the call is
    :class:`~selfattn.nn.MultiHeadAttention`'s (masks, score mods, positions, every cache).

    Extra args: ``lambda_init`` (default :meth:`default_lambda_init` of layer 0),
    ``lambda_std`` (the init std of the four λ vectors), ``norm_eps`` (the per-head RMSNorm's).
    ``n_heads`` and ``n_kv_heads`` must be even (heads pair up; so do the value halves).
    Caches hold values of width ``value_dim = 2 · head_dim``. ``return_weights`` gives the
    ``Hq`` softmax maps before they are subtracted.
    """

    def __init__(
        self,
        *args,
        lambda_init: float | None = None,
        lambda_std: float = 0.1,
        norm_eps: float = 1e-6,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if self.n_kv_heads % 2:
            raise ValueError(
                f"DiffAttention pairs the halves of the kv heads' values, so n_kv_heads must be "
                f"even, got n_kv_heads={self.n_kv_heads}"
            )
        if lambda_init is None:
            lambda_init = self.default_lambda_init(0)
        if not (isinstance(lambda_init, int | float) and math.isfinite(lambda_init)):
            raise ValueError(f"lambda_init must be a finite number, got {lambda_init!r}")
        positive_number(lambda_std, "DiffAttention lambda_std")
        self.lambda_init = float(lambda_init)
        ref = self.out_proj.weight
        fk = {"device": ref.device, "dtype": ref.dtype}
        D = self.head_dim
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.randn(D, **fk) * lambda_std))
        self.head_norm = RMSNorm(2 * D, norm_eps, elementwise_affine=False)
        self.value_dim = 2 * D

    @staticmethod
    def default_lambda_init(layer: int) -> float:
        """``0.8 - 0.6 · exp(-0.3 · layer)``: the paper's schedule, layers counted from 0."""
        return _LAMBDA_BASE - _LAMBDA_SPAN * math.exp(-_LAMBDA_DECAY * layer)

    def lam(self, dtype: torch.dtype) -> torch.Tensor:
        """The scalar ``λ`` (computed in float32, float64 for float64 parameters)."""
        acc = torch.float64 if self.lambda_q1.dtype == torch.float64 else torch.float32
        l1 = torch.exp((self.lambda_q1.to(acc) * self.lambda_k1.to(acc)).sum())
        l2 = torch.exp((self.lambda_q2.to(acc) * self.lambda_k2.to(acc)).sum())
        return (l1 - l2 + self.lambda_init).to(dtype)

    def heads_qkv(self, x, context=None, *, value=None, positions=None):
        """As :meth:`MultiHeadAttention.heads_qkv`, with ``v (B, Hkv, Sk, 2·D)``: kv head ``j``'s
        value is the two halves' heads ``j mod Hkv/2`` side by side."""
        q, k, v = super().heads_qkv(x, context, value=value, positions=positions)
        first, second = v.chunk(2, dim=1)  # (B, Hkv, Sk, D) -> 2 x (B, Hkv/2, Sk, D)
        v = torch.cat([first, second], dim=-1).repeat(1, 2, 1, 1)  # -> (B, Hkv, Sk, 2·D)
        return q, k, v

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """``(B, Hq, Sq, 2·D)`` -> ``(B, Sq, Hq·D)``: each pair's difference, normed and scaled."""
        B, _, Sq, _ = out.shape
        a, b = out.chunk(2, dim=1)  # (B, Hq, Sq, 2D) -> 2 x (B, Hq/2, Sq, 2D)
        diff = self.head_norm(a - self.lam(out.dtype) * b)
        diff = diff * (1.0 - self.lambda_init)
        return diff.transpose(1, 2).reshape(B, Sq, -1)  # (B, Hq/2, Sq, 2D) -> (B, Sq, Hq·D)
