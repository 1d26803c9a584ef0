"""Graph attention (GAT, Veličković et al., 2018) as self-attention restricted to neighbours.

GAT is self-attention whose keys for node ``i`` are its in-neighbours ``j`` (edges ``j -> i``)::

    e_ij  = LeakyReLU(a_dst · W x_i + a_src · W x_j)        per head
    α_ij  = softmax over j ∈ N(i) of e_ij
    out_i = Σ_j α_ij · W x_j                                 heads concatenated or averaged

The score is a query·key product in disguise (the "2-dim trick"): with ``q_i = [a_dst·Wx_i, 1]``
and ``k_j = [1, a_src·Wx_j]``, ``q_i · k_j`` is the sum inside the LeakyReLU, and the LeakyReLU
is a :class:`selfattn.scores.ScoreMod`. So one layer runs two ways:

- ``forward`` (default): *ragged* attention over the edge list, ``O(E·H·C)`` time and memory.
  Each edge's score is ``q[dst]·k[src]``, the score mod is called on the edges with
  ``(q_idx, kv_idx) = (dst, src)``, and the softmax is a segment softmax over each target's
  incoming edges with a segment max subtracted first (stable). Chosen over a ``selfattn.masks``
  mask because any mask over node ids costs ``O(N²)`` to classify or evaluate for a graph whose
  neighbours are scattered over the id range; a sparse graph should cost ``O(E)``.
- ``forward(..., dense=True)``: :func:`selfattn.attention` with the adjacency as a bool mask and
  the same score mod, ``O(N²)``: the check for small graphs (and the library's oracle path).

A node without incoming edges (isolated, ``add_self_loops=False``) gets 0 before the bias, as in
``torch_geometric.nn.GATConv`` and as ``selfattn.attention`` does for a fully masked row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selfattn import masks
from selfattn._validate import positive_int
from selfattn.functional import attention
from selfattn.scores import ScoreMod

__all__ = ["GATLayer", "LeakyReLUScore", "gat_qk", "neighbour_attention", "segment_softmax"]


class LeakyReLUScore(ScoreMod):
    """GAT's score mod: ``LeakyReLU(s, negative_slope)``; the same on dense and ragged scores."""

    def __init__(self, negative_slope: float = 0.2):
        self.negative_slope = float(negative_slope)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return F.leaky_relu(score, self.negative_slope)

    def __repr__(self) -> str:
        return f"LeakyReLUScore({self.negative_slope})"


def gat_qk(alpha_dst: torch.Tensor, alpha_src: torch.Tensor):
    """The 2-dim trick: ``alpha_dst, alpha_src (N, H)`` -> ``q, k (N, H, 2)`` with
    ``q_i · k_j = alpha_dst_i + alpha_src_j`` (use ``scale=1``)."""
    one = torch.ones_like(alpha_dst)
    q = torch.stack([alpha_dst, one], dim=-1)  # (N, H) -> (N, H, 2)
    k = torch.stack([one, alpha_src], dim=-1)  # (N, H) -> (N, H, 2)
    return q, k


def segment_softmax(scores: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Softmax of ``scores (E, H)`` within each group of rows sharing ``index (E,)`` in
    ``[0, n)``. The group max is subtracted first (it is a constant shift, so no gradient flows
    through it); every group with a member has a denominator >= 1."""
    H = scores.shape[1]
    idx = index[:, None].expand(-1, H)
    m = scores.new_full((n, H), float("-inf")).scatter_reduce(0, idx, scores.detach(), "amax")
    e = (scores - m[index]).exp()
    denom = e.new_zeros(n, H).index_add_(0, index, e)  # (E, H) -> (n, H)
    return e / denom[index]


def neighbour_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    edge_index: torch.Tensor,
    *,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
):
    """Ragged self-attention: node ``i`` attends to the sources of its incoming edges only.

    Args:
        q, k: ``(N, H, D)``; v: ``(N, H, Dv)``.
        edge_index: int ``(2, E)``, row 0 the source (key) node, row 1 the target (query) node.
        score_mod: applied to the scaled edge scores ``(E, H)`` with ``b = 0``,
            ``h (1, H)``, ``q_idx = dst (E, 1)``, ``kv_idx = src (E, 1)``.
        scale: default ``1/sqrt(D)``. ``dropout_p``: dropout on the normalised edge weights.

    Returns:
        ``out (N, H, Dv)`` (0 for a node without incoming edges), and the edge weights
        ``(E, H)`` with ``return_weights``.
    """
    N, H, D = q.shape
    src, dst = edge_index[0], edge_index[1]
    scale = D**-0.5 if scale is None else scale
    s = (q[dst] * k[src]).sum(-1) * scale  # (E, H, D) -> (E, H)
    if score_mod is not None:
        h = torch.arange(H, device=q.device)[None]
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        s = score_mod.score_mod(s, zero, h, dst[:, None], src[:, None])
    w = segment_softmax(s, dst, N)
    wd = F.dropout(w, dropout_p) if dropout_p > 0 else w
    out = v.new_zeros(N, H, v.shape[-1]).index_add_(0, dst, wd[..., None] * v[src])
    return (out, w) if return_weights else out


class GATLayer(nn.Module):
    """A graph attention layer equal to ``torch_geometric.nn.GATConv`` (same parameters).

    ``x (N, in_dim)``, ``edge_index (2, E)`` (source row 0, target row 1) ->
    ``(N, heads·out_dim)`` with ``concat``, else ``(N, out_dim)`` (mean over heads).

    Parameters: ``lin`` (``in_dim -> heads·out_dim``, no bias), ``att_src`` and ``att_dst``
    ``(heads, out_dim)``, ``bias``. ``add_self_loops`` first drops the self loops present and then
    adds one per node, as GATConv does. ``dropout`` applies to the attention weights in training.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        add_self_loops: bool = True,
        bias: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        for name, val in (("in_dim", in_dim), ("out_dim", out_dim), ("heads", heads)):
            positive_int(val, f"GATLayer {name}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"GATLayer dropout must be in [0, 1), got {dropout}")
        self.in_dim, self.out_dim, self.heads, self.concat = in_dim, out_dim, heads, concat
        self.add_self_loops, self.dropout = add_self_loops, float(dropout)
        self.score = LeakyReLUScore(negative_slope)
        self.lin = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(heads, out_dim))
        width = heads * out_dim if concat else out_dim
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)

    def _edges(self, edge_index, N: int, device) -> torch.Tensor:
        if not isinstance(edge_index, torch.Tensor):
            raise TypeError(f"edge_index must be an int tensor (2, E), got {type(edge_index)}")
        if edge_index.is_floating_point() or edge_index.dtype == torch.bool:
            raise TypeError(f"edge_index must hold integer node ids, got {edge_index.dtype}")
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(
                f"edge_index must be (2, E) (sources in row 0, targets in row 1), got shape "
                f"{tuple(edge_index.shape)}; transpose an (E, 2) edge list"
            )
        e = edge_index.to(device=device, dtype=torch.long)
        if e.numel() and (int(e.min()) < 0 or int(e.max()) >= N):
            raise ValueError(
                f"edge_index holds node ids {int(e.min())}..{int(e.max())} but x has N={N} "
                f"nodes; ids must lie in [0, {N})"
            )
        if self.add_self_loops:
            loops = torch.arange(N, device=device).expand(2, N)
            e = torch.cat([e[:, e[0] != e[1]], loops], dim=1)
        return e

    def forward(
        self,
        x: torch.Tensor,
        edge_index: torch.Tensor,
        *,
        dense: bool = False,
        return_weights: bool = False,
    ):
        """``x (N, in_dim)``, ``edge_index (2, E)`` -> ``(N, heads·out_dim)`` or ``(N, out_dim)``.

        ``dense=True`` runs :func:`selfattn.attention` over the ``(N, N)`` adjacency (small,
        duplicate-free graphs only; no attention dropout). ``return_weights`` (ragged path) also
        returns ``(edge_index_used (2, E'), weights (E', heads))``, self loops included.
        """
        if x.dim() != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"x must be (N, in_dim={self.in_dim}), got shape {tuple(x.shape)}")
        if dense and return_weights:
            raise ValueError("return_weights needs the ragged path (dense=False)")
        N, H, C = x.shape[0], self.heads, self.out_dim
        e = self._edges(edge_index, N, x.device)
        h = self.lin(x).view(N, H, C)  # (N, in_dim) -> (N, H, C)
        q, k = gat_qk((h * self.att_dst).sum(-1), (h * self.att_src).sum(-1))
        if dense:
            out = self._dense(q, k, h, e, N)
        else:
            p = self.dropout if self.training else 0.0
            out, w = neighbour_attention(
                q, k, h, e, score_mod=self.score, scale=1.0, dropout_p=p, return_weights=True
            )
        out = out.reshape(N, H * C) if self.concat else out.mean(dim=1)  # (N, H, C) -> ...
        if self.bias is not None:
            out = out + self.bias
        return (out, (e, w)) if return_weights else out

    def _dense(self, q, k, h, e, N):
        """``selfattn.attention`` with mask[i, j] = edge j -> i, O(N²): the small-graph check."""
        adj = torch.zeros(N, N, dtype=torch.bool, device=q.device)
        adj[e[1], e[0]] = True
        if int(adj.sum()) != e.shape[1]:
            raise ValueError(
                f"dense=True needs duplicate-free edges: {e.shape[1]} edges give only "
                f"{int(adj.sum())} distinct (target, source) pairs; use the ragged path"
            )
        out = attention(
            q.transpose(0, 1)[None],  # (N, H, 2) -> (1, H, N, 2)
            k.transpose(0, 1)[None],
            h.transpose(0, 1)[None],  # (N, H, C) -> (1, H, N, C)
            mask=masks.from_tensor(adj),
            score_mod=self.score,
            scale=1.0,
        )
        return out[0].transpose(0, 1)  # (1, H, N, C) -> (N, H, C)

    def extra_repr(self) -> str:
        return (
            f"{self.in_dim}, {self.out_dim}, heads={self.heads}, concat={self.concat}, "
            f"negative_slope={self.score.negative_slope}, add_self_loops={self.add_self_loops}"
        )
