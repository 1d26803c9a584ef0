"""Head statistics: what each attention head does, in five numbers.

For weights ``w (B, H, Sq, Sk)`` (rows = queries at absolute positions ``q_offset + i``, columns =
keys at positions ``j``), averaged over the batch and the query rows that attend somewhere:

- ``entropy``: ``-Σ_j w_ij log w_ij`` in nats; 0 for a head that looks at one key, ``log Sk`` for
  a uniform one;
- ``distance``: mean attention distance ``Σ_j w_ij |pos_i - j|`` in tokens (local vs global
  heads, as in the ViT paper's Figure 7);
- ``previous``: the weight on the previous token ``w[i, pos_i - 1]`` (previous-token heads);
- ``first``: the weight on key 0 (``[CLS]`` / BOS, the "attention sink");
- ``self``: the weight on the query's own position ``w[i, pos_i]``.

Different heads specialise in such relations, although a head should not automatically be read as
a clean human-readable concept (Jain & Wallace 2019, "Attention is not Explanation").
"""

from __future__ import annotations

import torch

__all__ = ["STAT_NAMES", "head_stats", "head_stats_table"]

STAT_NAMES = ("entropy", "distance", "previous", "first", "self")


def _at(w: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[..., i, cols[i]]`` ``(B, H, Sq)`` and where ``cols[i]`` is a valid key ``(Sq,)``."""
    Sk = w.shape[-1]
    ok = (cols >= 0) & (cols < Sk)
    index = cols.clamp(0, max(Sk - 1, 0)).view(1, 1, -1, 1).expand(*w.shape[:-1], 1)
    return w.gather(-1, index).squeeze(-1), ok


def head_stats(
    weights: torch.Tensor, *, q_offset: int | None = None, query_mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The five statistics of the module docstring per head: ``{name: (H,) float64}``.

    Args:
        weights: ``(B, H, Sq, Sk)`` (or ``(H, Sq, Sk)``), each row summing to 1 or 0.
        q_offset: absolute position of query row 0 (default ``Sk - Sq``, as in
            :func:`selfattn.attention`).
        query_mask: bool ``(B, Sq)``, False for query rows to leave out (padding tokens).

    A statistic with no row to average (e.g. ``previous`` for a single query at position 0) is NaN.
    """
    if weights.dim() == 3:
        weights = weights.unsqueeze(0)  # (H, Sq, Sk) -> (1, H, Sq, Sk)
    if weights.dim() != 4:
        raise ValueError(
            f"weights must be (B, H, Sq, Sk) or (H, Sq, Sk), got shape {tuple(weights.shape)}"
        )
    w = weights.detach().double()
    B, H, Sq, Sk = w.shape
    q_offset = Sk - Sq if q_offset is None else q_offset
    pos = torch.arange(Sq, device=w.device) + q_offset  # (Sq,) absolute query positions
    rows = w.sum(-1) > 0  # (B, H, Sq): rows that attend somewhere
    if query_mask is not None:
        if tuple(query_mask.shape) != (B, Sq):
            raise ValueError(f"query_mask must be (B={B}, Sq={Sq}), got {tuple(query_mask.shape)}")
        rows = rows & query_mask.bool().to(w.device).view(B, 1, Sq)
    keys = torch.arange(Sk, device=w.device, dtype=w.dtype)
    per_row = {
        "entropy": -torch.special.xlogy(w, w).sum(-1),
        "distance": (w * (pos.to(w.dtype).view(-1, 1) - keys).abs()).sum(-1),
        "first": w[..., 0] if Sk else w.new_zeros(B, H, Sq),
    }
    valid = {name: rows for name in per_row}
    for name, cols in (("previous", pos - 1), ("self", pos)):
        per_row[name], ok = _at(w, cols)
        valid[name] = rows & ok
    out = {}
    for name in STAT_NAMES:
        m = valid[name].to(w.dtype)
        out[name] = (per_row[name] * m).sum((0, 2)) / m.sum((0, 2))  # (B, H, Sq) -> (H,)
    return out


def head_stats_table(maps, **kwargs) -> list[dict]:
    """One row per captured (layer, head): ``{"layer", "head", "entropy", ...}``.

    ``maps``: an :class:`~selfattn.inspect.AttentionMaps` (its last call per layer) or a dict
    ``layer -> (B, H, Sq, Sk)``; ``kwargs`` go to :func:`head_stats`.
    """
    heads = getattr(maps, "heads", None)
    rows = []
    for layer, w in maps.items():
        stats = head_stats(w, **kwargs)
        for i in range(w.shape[-3]):
            head = heads[i] if heads is not None else i
            rows.append({"layer": layer, "head": head, **{n: stats[n][i].item() for n in stats}})
    return rows
