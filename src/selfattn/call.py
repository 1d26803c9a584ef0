"""What one attention call is, checked and normalised: :class:`AttentionCall` and :func:`prepare`.

Below functional and backends: :func:`selfattn.attention` and :func:`selfattn.backends.explain`
both turn their arguments into ``(q, k, v, AttentionCall)`` here, so neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from selfattn.masks import Mask, as_mask
from selfattn.masks.tiles import check_position_span
from selfattn.scores import ScoreMod, as_score_mod

__all__ = ["AttentionCall", "check_sinks", "check_tensors", "prepare"]


@dataclass(frozen=True)
class AttentionCall:
    """Everything about one attention call except the q/k/v tensors, normalised.

    ``q_offset`` is the absolute position of query row 0 (key ``j`` sits at position ``j``).
    ``mask`` and ``score_mod`` are bound to these positions (tensors given in query-row order
    included: :meth:`selfattn.masks.Mask.bind`), so they take absolute ``q_idx``/``kv_idx``.
    ``dropout_seed`` is drawn once per call (from ``generator`` or torch's default one) so that the
    forward and the recomputing backward see the same dropout pattern. ``sinks (Hq,)``: learned
    attention-sink logits (gpt-oss), one per query head, in the accumulation dtype's units of the
    scaled scores; each joins its head's softmax denominators as a key with no value.
    """

    mask: Mask | None = None
    score_mod: ScoreMod | None = None
    scale: float = 1.0
    dropout_p: float = 0.0
    dropout_seed: int = 0
    q_offset: int = 0
    return_lse: bool = False
    sinks: torch.Tensor | None = None
    tile_kinds_cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensors(q, k, v) -> None:
    """Type, rank, dtype, device and shape agreement of ``q``, ``k``, ``v``; raise naming the
    offending shapes and the fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; attention needs float16, bfloat16, float32 or "
                f"float64 (cast with {name}.float())"
            )
    names = ("q (B, Hq, Sq, D)", "k (B, Hkv, Sk, D)", "v (B, Hkv, Sk, Dv)")
    for name, t in zip(names, (q, k, v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D, got shape {tuple(t.shape)}; add a batch or head dim with "
                "unsqueeze, or move heads before the sequence with transpose(1, 2)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; "
            "move them with .to(device)"
        )
    (B, Hq, _, D), (Bk, Hkv, Sk, Dk), (Bv, Hv, Sv, _) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv):
        raise ValueError(
            f"batch sizes differ: q has B={B}, k has {Bk}, v has {Bv}; k and v need q's batch "
            "size (or 1 each, in attention(), to share one K/V across the batch)"
        )
    if D != Dk:
        raise ValueError(
            f"q and k head dims differ: q {tuple(q.shape)} has D={D}, k {tuple(k.shape)} has {Dk}"
        )
    if Hkv != Hv or Sk != Sv:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (B, Hkv, Sk): "
            f"k has Hkv={Hkv}, Sk={Sk} but v has Hkv={Hv}, Sk={Sv}"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"Hq ({Hq}) must be a multiple of Hkv ({Hkv}) for grouped-query attention; "
            f"query head h reads kv head h // (Hq // Hkv)"
        )


def check_sinks(sinks, q):
    """``sinks`` checked against ``q (B, Hq, Sq, D)``: None, or a float tensor of shape ``(Hq,)``
    on q's device (any float dtype: it is used in the accumulation dtype, and its gradient flows
    back in its own)."""
    if sinks is None:
        return None
    Hq = q.shape[1]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"sinks must be a float tensor of shape (Hq,) = ({Hq},), got {type(sinks).__name__}"
        )
    if not sinks.is_floating_point():
        raise TypeError(
            f"sinks must be a float tensor, got dtype {sinks.dtype}; cast with .float()"
        )
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(
            f"sinks must have shape (Hq,) = ({Hq},), one logit per query head, got "
            f"{tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(
            f"sinks are on {sinks.device} but q is on {q.device}; move them with .to(q.device)"
        )
    return sinks


def _broadcast_kv_batch(q, k, v):
    """K and V of batch 1 against a larger query batch as stride-0 views of q's batch (no copy;
    FlexAttention allows the same). Anything else passes unchanged, for check_tensors to judge."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return k, v
    B = q.shape[0]
    if B <= 1 or (k.shape[0], v.shape[0]) != (1, 1):
        return k, v
    return k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)


def prepare(
    q,
    k,
    v,
    *,
    mask=None,
    score_mod=None,
    scale=None,
    dropout_p=0.0,
    generator=None,
    q_offset=None,
    return_lse=False,
    sinks=None,
):
    """Validate and normalise :func:`selfattn.attention`'s arguments into
    ``(q, k, v, AttentionCall)``, the mask and score mod bound to the call's positions. K/V of
    batch 1 come back expanded to q's batch."""
    k, v = _broadcast_kv_batch(q, k, v)
    check_tensors(q, k, v)
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise TypeError(f"scale must be a number, got a tensor of shape {tuple(scale.shape)}")
        scale = float(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a finite number, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__} {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if q_offset is None:
        q_offset = Sk - Sq
    if (
        isinstance(q_offset, torch.Tensor)
        and q_offset.numel() == 1
        and not q_offset.is_floating_point()
    ):
        q_offset = int(q_offset)
    if isinstance(q_offset, bool) or not isinstance(q_offset, int):
        raise TypeError(f"q_offset must be an int (position of query row 0), got {q_offset!r}")
    check_position_span(q_offset, Sq, "q_offset")

    # Tensors given in query-row order are bound to absolute positions here, once: every backend
    # then calls mask_mod(b, h, q_idx, kv_idx) / score_mod(score, b, h, q_idx, kv_idx) on
    # positions, FlexAttention's signatures, and never passes q_offset to them.
    mask_obj = None if mask is None else as_mask(mask)
    if mask_obj is not None:
        mask_obj.validate(B, Hq, Sq, Sk, q_offset)
        mask_obj = mask_obj.bind(q_offset)
    mod_obj = None if score_mod is None else as_score_mod(score_mod)
    if mod_obj is not None:
        mod_obj.validate(B, Hq, Sq, Sk, q_offset)
        mod_obj = mod_obj.bind(q_offset)

    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    seed = 0
    if dropout_p > 0:
        dev = generator.device if generator is not None else "cpu"
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=dev))
    call = AttentionCall(
        sinks=check_sinks(sinks, q),
        mask=mask_obj,
        score_mod=mod_obj,
        scale=float(scale),
        dropout_p=float(dropout_p),
        dropout_seed=seed,
        q_offset=q_offset,
        return_lse=bool(return_lse),
    )
    return q, k, v, call
