"""Normalisation layers: torch's ``LayerNorm`` and an ``RMSNorm`` that computes in float32."""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validate import positive_int, positive_number

__all__ = ["LayerNorm", "RMSNorm", "make_norm", "rms_norm"]

# LayerNorm is torch's own: it already accumulates half inputs in float32.
LayerNorm = nn.LayerNorm


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019): ``x / sqrt(mean(x²) + eps) · weight``.

    Input ``(..., dim)`` -> output ``(..., dim)`` in the input dtype. The mean and the rescaling are
    computed in float32 (float64 stays float64), so fp16/bf16 activations do not lose the small
    mean-square to rounding; the weight is applied after casting back, as Llama does.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        positive_int(dim, "RMSNorm dim")
        positive_number(eps, "RMSNorm eps")
        self.dim = dim
        self.eps = float(eps)
        self.weight = (
            nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
            if elementwise_affine
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(
                f"RMSNorm was built for dim={self.dim} but the input's last dim is {x.shape[-1]} "
                f"(shape {tuple(x.shape)})"
            )
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s computation over the last dim of ``x`` (``weight`` None: no weight).

    torch's fused op computes the same float32 (float64) steps bit for bit and rounds back to
    x's dtype, in one op instead of seven (a decode step runs 2 per layer). The weight joins
    the fused op where rounding back is a no-op (float32 / float64 ``x`` and weight: one op
    instead of two); in fp16/bf16 it multiplies after the rounding, as Llama does.
    """
    if weight is not None and x.dtype == weight.dtype and x.dtype in _FUSED_WEIGHT_DTYPES:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    y = torch.rms_norm(x, (x.shape[-1],), None, eps)
    return y if weight is None else y * weight


_FUSED_WEIGHT_DTYPES = (torch.float32, torch.float64)


def make_norm(kind: str, dim: int, eps: float = 1e-6, *, device=None, dtype=None) -> nn.Module:
    """``"rms"`` -> :class:`RMSNorm`, ``"layer"`` -> :class:`LayerNorm`, over the last ``dim``;
    ``"l2"``: an :class:`RMSNorm` without weight (Llama-4's ``L2Norm``: ``x / rms(x)``)."""
    if kind == "rms":
        return RMSNorm(dim, eps, device=device, dtype=dtype)
    if kind == "l2":
        return RMSNorm(dim, eps, elementwise_affine=False, device=device, dtype=dtype)
    if kind == "layer":
        return LayerNorm(dim, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"norm must be 'rms' or 'layer', got {kind!r} (or 'l2': rms without weight)")
