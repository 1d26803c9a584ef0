"""The textbook worked example of scaled dot-product attention, every step computed by selfattn.

One query (token 1) against three keys, ``d_k = 2``. ``worked_example()``
returns each step as plain numbers (scores, scaling, exp, softmax, output, autograd gradients),
then the causal mask and softmax saturation; ``selfattn explain`` prints it.
"""

from __future__ import annotations

import math

import torch

from selfattn import masks
from selfattn.functional import attention, attention_weights

__all__ = ["worked_example"]

EXAMPLE_Q = [1.0, 0.0]
EXAMPLE_K = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
EXAMPLE_V = [[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
SATURATION_FACTOR = 10.0  # the query scaled up by 10: scores 0.707 -> 7.07


def _example_tensors(q_factor: float = 1.0):
    """q ``(1, 1, 1, 2)``, k ``(1, 1, 3, 2)``, v ``(1, 1, 3, 2)`` in float64 (exact to print)."""
    f64 = torch.float64
    q = torch.tensor(EXAMPLE_Q, dtype=f64).view(1, 1, 1, 2) * q_factor
    k = torch.tensor(EXAMPLE_K, dtype=f64).view(1, 1, 3, 2)
    v = torch.tensor(EXAMPLE_V, dtype=f64).view(1, 1, 3, 2)
    return q, k, v


def _middle_score_gradients(q, k, v) -> tuple[float, list[float]]:
    """``∂w₂/∂s₂`` and ``∂out/∂s₂`` by autograd, ``s₂`` being the middle scaled score.

    A zero bias passed as ``score_mod`` is added to the scaled scores, so its gradient is the
    gradient with respect to the scores themselves.
    """
    bias = torch.zeros(1, 1, 1, 3, dtype=q.dtype, requires_grad=True)  # (B, Hq, Sq, Sk)
    w = attention_weights(q, k, v, score_mod=bias)
    (dw_ds,) = torch.autograd.grad(w[0, 0, 0, 1], bias)
    out = attention(q, k, v, score_mod=bias, backend="reference")
    dout_ds = [
        torch.autograd.grad(out[0, 0, 0, c], bias, retain_graph=True)[0][0, 0, 0, 1].item()
        for c in range(out.shape[-1])
    ]
    return dw_ds[0, 0, 0, 1].item(), dout_ds


def _attend(q, k, v) -> dict:
    """Scores, softmax and output of the example's one query; every step as a plain list."""
    d_k = q.shape[-1]
    scale = 1.0 / math.sqrt(d_k)
    scores = (q @ k.transpose(-1, -2))[0, 0, 0]  # (1, 1, 1, 2) @ (1, 1, 2, 3) -> (3,)
    weights = attention_weights(q, k, v)[0, 0, 0]  # (3,)
    out, lse = attention(q, k, v, return_lse=True)
    dw_ds, dout_ds = _middle_score_gradients(q, k, v)
    return {
        "scores": scores.tolist(),
        "scale": scale,
        "scaled_scores": (scores * scale).tolist(),
        "exp": torch.exp(scores * scale).tolist(),
        "total": math.exp(lse.item()),
        "lse": lse.item(),
        "weights": weights.tolist(),
        "output": out[0, 0, 0].tolist(),
        "dw2_ds2": dw_ds,
        "dout_ds2": dout_ds,
    }


def worked_example() -> dict:
    """Every number of the worked example as plain lists and floats (float64, JSON-ready).

    Keys: ``inputs`` (q, k, v, d_k); each step of the unmasked query (``scores``, ``scale``,
    ``scaled_scores``, ``exp``, ``total``, ``lse``, ``weights``, ``output``, and the autograd
    gradients ``dw2_ds2``, ``dout_ds2`` through the middle score); ``causal`` (token 1 at position
    0 sees only itself); ``saturated`` (the same steps with the query scaled by 10).
    """
    q, k, v = _example_tensors()
    base = _attend(q, k, v)
    # Causal, with the query as token 1 at position 0 (q_offset=0): it sees only key 1.
    causal = masks.causal()
    w_causal = attention_weights(q, k, v, mask=causal, q_offset=0)[0, 0, 0]  # (3,)
    out_causal = attention(q, k, v, mask=causal, q_offset=0)[0, 0, 0]  # (2,)
    saturated = _attend(*_example_tensors(SATURATION_FACTOR))
    return {
        "inputs": {"q": EXAMPLE_Q, "k": EXAMPLE_K, "v": EXAMPLE_V, "d_k": len(EXAMPLE_Q)},
        **base,
        "causal": {
            "q_offset": 0,
            "mask": causal.render(1, 3, q_offset=0),
            "weights": w_causal.tolist(),
            "output": out_causal.tolist(),
        },
        "saturated": {"query_factor": SATURATION_FACTOR, **saturated},
    }
