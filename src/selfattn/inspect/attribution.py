"""Attribution beyond one map: attention rollout and attention flow (Abnar & Zuidema 2020),
attention x gradient, and head importance by masking heads (Michel et al. 2019).

Raw attention weights of one layer say where a head looked, not what the output depends on
(Jain & Wallace 2019): tokens mix from layer to layer through attention *and* the residual
stream. Rollout and flow follow information down the layers; attention x gradient weighs each
weight by how much the chosen output changes with it; head masking measures what a head is worth
to a loss.

The residual is handled as Abnar & Zuidema do: each layer's head-averaged weights ``A`` become
``Â = 0.5·A + 0.5·I`` with rows renormalised to sum to 1 (``residual=`` is the identity's share),
so a token keeps half of itself at every layer.

>>> with capture_attention(model) as maps:                              # doctest: +SKIP
...     model(ids)
>>> R = attention_rollout(maps)          # (L, B, S, S): R[-1][b, i, j], output i <- input j
>>> F = attention_flow(maps)             # (B, S, S): max-flow from output i to input j
>>> g = attention_gradients(model, lambda: model(ids)[0, 0].sum())
>>> g.times_gradient(3)                  # (B, H, S, S): A ⊙ ∂y/∂A of layer 3, per head
>>> head_importance(model, lambda: loss(model(ids)))    # (L, H): Δloss when a head is masked
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from selfattn._validate import one_of
from selfattn.inspect.capture import (
    DEFAULT_MAX_BYTES,
    AttentionMaps,
    attention_layers,
    capture_attention,
    selection,
)

__all__ = [
    "attention_flow",
    "attention_gradients",
    "attention_rollout",
    "head_importance",
    "mask_heads",
    "residual_attention",
]

RESIDUAL = 0.5  # Abnar & Zuidema: Â = 0.5·A + 0.5·I, the residual's share of each token
HEAD_REDUCTIONS = ("mean", "max", "min")
# Attention flow solves S² max-flow problems on (L+1)·S nodes and L·S² edges in Python (6 layers:
# ~1 s at 16 tokens, ~10 s at 24, growing as S⁴ and beyond): past this many tokens it would take
# minutes; rollout is the fast approximation (the paper's examples are short sentences).
FLOW_MAX_TOKENS = 32
_FLOW_EPS = 1e-12  # residual capacity below this (relative to 1) counts as saturated


# -- the layer stack ------------------------------------------------------------------------------
def _layer_stack(maps) -> torch.Tensor:
    """``(L, B, H, S, S)`` float64 from AttentionMaps, a dict ``layer -> (B, H, S, S)``, a
    sequence of those, or a tensor ``(L, B, H, S, S)`` / ``(L, H, S, S)``; square maps only."""
    if isinstance(maps, AttentionMaps):
        short = [i for i in maps if len(maps.heads) != maps.modules[i].n_heads]
        if short:
            raise ValueError(
                f"rollout and flow average over all heads of a layer, but heads {maps.heads} were "
                f"captured of layer(s) {short} with {maps.modules[short[0]].n_heads} heads; "
                "capture with heads=None"
            )
        ws = [w for _, w in maps.items()]
    elif isinstance(maps, Mapping):
        ws = [maps[k] for k in sorted(maps)]
    elif isinstance(maps, torch.Tensor):
        if maps.dim() == 4:
            maps = maps.unsqueeze(1)  # (L, H, S, S) -> (L, 1, H, S, S)
        if maps.dim() != 5:
            raise ValueError(
                f"maps must be (L, B, H, S, S) or (L, H, S, S), got shape {tuple(maps.shape)}"
            )
        ws = list(maps)
    else:
        ws = list(maps)
    if not ws:
        raise ValueError("no maps: capture some layers (call the model inside the `with` block)")
    shapes = {tuple(w.shape) for w in ws}
    if len(shapes) > 1:
        raise ValueError(
            f"the layers' maps differ in shape {sorted(shapes)}; rollout and flow need one stack "
            "of self-attention layers over the same tokens (select them with layers=[...])"
        )
    shape = shapes.pop()
    if len(shape) != 4 or shape[-1] != shape[-2]:
        raise ValueError(
            f"rollout and flow need square self-attention maps (B, H, S, S), got {shape}: "
            "cross-attention and cached decode steps (Sq != Sk) have no token-to-token chain"
        )
    return torch.stack([w.detach().to(torch.float64) for w in ws])


def residual_attention(
    maps, *, residual: float = RESIDUAL, head_reduce: str = "mean"
) -> torch.Tensor:
    """Each layer's heads reduced (``"mean"``, as the paper; ``"max"``, ``"min"``) and mixed with
    the residual: ``Â = (1 - r)·A + r·I``, rows renormalised; ``(L, B, S, S)`` float64.

    ``Â[l, b, i, j]`` is the share of token ``j`` (layer ``l``'s input) in token ``i`` (its
    output): the edge capacities of the attention graph that rollout and flow walk.
    """
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1] (the identity's share), got {residual}")
    one_of(head_reduce, "head_reduce", HEAD_REDUCTIONS)
    w = _layer_stack(maps)  # (L, B, H, S, S)
    a = {"mean": w.mean, "max": w.amax, "min": w.amin}[head_reduce](2)  # -> (L, B, S, S)
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    a = (1.0 - residual) * a + residual * eye
    rows = a.sum(-1, keepdim=True)
    # a query row with no visible key (all zeros) keeps only its own token
    return torch.where(rows > 0, a / rows.clamp_min(torch.finfo(a.dtype).tiny), eye)


def attention_rollout(
    maps, *, residual: float = RESIDUAL, head_reduce: str = "mean"
) -> torch.Tensor:
    """Attention rollout after each layer: ``R_l = Â_l · Â_{l-1} ··· Â_0``, ``(L, B, S, S)``.

    ``R[l, b, i, j]``: how much of input token ``j`` reaches token ``i`` after layer ``l``,
    following every path through the layers (:func:`residual_attention` for ``Â``); rows sum
    to 1. ``maps``: :class:`AttentionMaps` of all heads of consecutive self-attention layers, a
    dict ``layer -> (B, H, S, S)`` or a tensor ``(L, B, H, S, S)``.
    """
    a = residual_attention(maps, residual=residual, head_reduce=head_reduce)
    out = torch.empty_like(a)
    r = a[0]
    out[0] = r
    for layer in range(1, a.shape[0]):
        r = a[layer] @ r  # (B, S, S): paths through one more layer
        out[layer] = r
    return out


def attention_flow(
    maps,
    *,
    residual: float = RESIDUAL,
    head_reduce: str = "mean",
    max_tokens: int = FLOW_MAX_TOKENS,
) -> torch.Tensor:
    """Attention flow (Abnar & Zuidema 2020): ``(B, S, S)``, entry ``[b, i, j]`` the maximum
    flow from token ``i`` after the last layer to input token ``j``.

    The layers form a graph with ``(L+1)·S`` nodes: node ``(l+1, i)`` sends to ``(l, j)`` along
    an edge of capacity ``Â_l[i, j]`` (:func:`residual_attention`). Unlike rollout, which
    multiplies along paths, flow is bounded by each path's narrowest edge and by the edges the
    paths share. Solved by Dinic's algorithm (written here; no graph library) once per pair:
    ``S²`` problems, so ``S`` is capped at ``max_tokens``.
    """
    a = residual_attention(maps, residual=residual, head_reduce=head_reduce)
    L, B, S, _ = a.shape
    if S > max_tokens:
        raise ValueError(
            f"attention flow over S={S} tokens solves {S * S} max-flow problems on {(L + 1) * S} "
            f"nodes (above max_tokens={max_tokens}); use attention_rollout, shorten the input "
            "or raise max_tokens"
        )
    out = torch.zeros(B, S, S, dtype=torch.float64)
    for b in range(B):
        cap = a[:, b].tolist()  # cap[l][i][j]: node (l+1, i) -> node (l, j)
        for i in range(S):
            for j in range(S):
                out[b, i, j] = _max_flow(cap, L, S, i, j)
    return out


def _max_flow(cap: list, L: int, S: int, source: int, sink: int) -> float:
    """Dinic's algorithm on the layered graph: from node ``(L, source)`` down to ``(0, sink)``.

    ``flow[l][i][j]`` is the flow on edge ``(l+1, i) -> (l, j)``; the residual graph has that
    edge with ``cap - flow`` left and the reverse edge ``(l, j) -> (l+1, i)`` with ``flow``.
    Each phase labels nodes by breadth-first distance from the source, then saturates every
    shortest path with a depth-first search whose per-node pointer never revisits a dead edge
    (a blocking flow). The first phase's paths run straight down the layers, so few phases
    follow: far fewer searches than one breadth-first search per path (Edmonds-Karp).
    """
    flow = [[[0.0] * S for _ in range(S)] for _ in range(L)]

    def residual(layer: int, t: int, k: int) -> tuple[int, int, float]:
        """Edge ``k`` of node ``(layer, t)``: ``k < S`` down to ``(layer-1, k)``, else back up
        to ``(layer+1, k-S)``; its head and residual capacity (0 where there is no edge)."""
        if k < S:
            if layer == 0:
                return -1, k, 0.0
            return layer - 1, k, cap[layer - 1][t][k] - flow[layer - 1][t][k]
        if layer == L:
            return -1, k - S, 0.0
        return layer + 1, k - S, flow[layer][k - S][t]

    total = 0.0
    while True:
        level = [[-1] * S for _ in range(L + 1)]
        level[L][source] = 0
        queue = deque([(L, source)])
        while queue:
            u = queue.popleft()
            for k in range(2 * S):
                lv, v, room = residual(*u, k)
                if room > _FLOW_EPS and level[lv][v] < 0:
                    level[lv][v] = level[u[0]][u[1]] + 1
                    queue.append((lv, v))
        if level[0][sink] < 0:
            return total
        pointer = [[0] * S for _ in range(L + 1)]
        path = [(L, source)]
        while path:
            u = path[-1]
            if u == (0, sink):  # augment along the path by its narrowest edge
                steps = list(itertools.pairwise(path))
                # edge k of a: down to token k, or (k - S) back up
                push = min(residual(*a, b[1] + (S if b[0] > a[0] else 0))[2] for a, b in steps)
                for a, b in steps:
                    if b[0] < a[0]:
                        flow[b[0]][a[1]][b[1]] += push
                    else:
                        flow[a[0]][b[1]][a[1]] -= push
                total += push
                path = [(L, source)]
                continue
            lu, tu = u
            while pointer[lu][tu] < 2 * S:
                lv, v, room = residual(lu, tu, pointer[lu][tu])
                if room > _FLOW_EPS and level[lv][v] == level[lu][tu] + 1:
                    path.append((lv, v))
                    break
                pointer[lu][tu] += 1
            else:  # a dead end: no shortest path continues from u
                level[lu][tu] = -1
                path.pop()
                if path:
                    pointer[path[-1][0]][path[-1][1]] += 1


# -- attention x gradient -------------------------------------------------------------------------
def attention_gradients(
    model: nn.Module,
    output: Callable[[], torch.Tensor],
    *,
    layers=None,
    heads=None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> AttentionMaps:
    """Run ``output()`` (it calls ``model`` and returns the one number ``y`` to explain, e.g.
    ``lambda: model(ids)[0, -1, token]``), differentiate ``y`` by every captured attention
    weight and return the maps: ``maps[l]`` is ``A``, ``maps.gradient(l)`` is ``∂y/∂A`` and
    ``maps.times_gradient(l)`` is ``A ⊙ ∂y/∂A``, each ``(B, |heads|, Sq, Sk)`` per head.

    Parameters' ``.grad`` are left untouched (``torch.autograd.grad`` on the heads' outputs).
    Put the model in eval mode first: the weights are recomputed without dropout.
    """
    with (
        torch.enable_grad(),
        capture_attention(model, layers, heads, max_bytes=max_bytes, gradients=True) as maps,
    ):
        y = output()
        if not isinstance(y, torch.Tensor) or y.numel() != 1:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(
                f"output() must return the single number to explain, got {got}; reduce it, "
                "e.g. logits[0, -1, token] or embedding[0] @ direction"
            )
        outs = maps.outputs()
        if not outs:
            raise ValueError("output() ran no captured attention layer with gradients enabled")
        torch.autograd.grad(y.reshape(()), outs, allow_unused=True)  # the hooks fill the maps
        maps.release_outputs()
    return maps


# -- head masks -----------------------------------------------------------------------------------
@contextlib.contextmanager
def mask_heads(model: nn.Module, head_masks) -> Iterator[None]:
    """Gate attention heads while the block runs: ``head_masks`` is a dict ``layer -> (Hq,)``
    or ``(B, Hq)`` gates (0 removes a head, 1 keeps it; layers numbered as in
    :func:`capture_attention`), or a tensor ``(L, Hq)`` for every layer. Each gate multiplies
    its head's output before the out projection (``MultiHeadAttention.head_mask``); the model's
    modules are otherwise untouched and their previous gates come back on exit."""
    modules = [m for _, m in attention_layers(model)]
    if isinstance(head_masks, torch.Tensor):
        if head_masks.dim() != 2 or head_masks.shape[0] != len(modules):
            raise ValueError(
                f"a head-mask tensor must be (L={len(modules)}, Hq), one row per attention "
                f"layer, got {tuple(head_masks.shape)}; or pass a dict layer -> (Hq,)"
            )
        head_masks = dict(enumerate(head_masks))
    chosen = {}
    for layer, gates in head_masks.items():
        (i,) = selection(layer, len(modules), "layer", type(model).__name__)
        H = modules[i].n_heads
        if not isinstance(gates, torch.Tensor) or gates.shape[-1:] != (H,) or gates.dim() > 2:
            got = tuple(gates.shape) if isinstance(gates, torch.Tensor) else type(gates).__name__
            raise ValueError(
                f"head mask of layer {layer} must be (Hq={H},) or (B, Hq={H}), got {got}"
            )
        chosen[modules[i]] = gates
    saved = {m: m.head_mask for m in chosen}
    try:
        for m, gates in chosen.items():
            m.head_mask = gates
        yield
    finally:
        for m, gates in saved.items():
            m.head_mask = gates


IMPORTANCE_METHODS = ("ablation", "gradient")


def head_importance(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    *,
    method: str = "ablation",
    layers=None,
) -> torch.Tensor:
    """How much each head matters to ``loss()`` (a function running ``model`` that returns a
    scalar loss): ``(len(layers), Hq)`` float64.

    ``"ablation"``: ``loss`` with the head masked (its gate 0, every other head kept) minus
    ``loss`` with all heads, one forward pass per head (Michel et al. 2019, section 3).
    ``"gradient"``: ``|∂loss/∂ξ_h|`` at ``ξ = 1``, the paper's importance score ``I_h`` from
    one backward pass (for their expectation over data, average per-example scores).
    """
    one_of(method, "method", IMPORTANCE_METHODS)
    modules = [m for _, m in attention_layers(model)]
    chosen = selection(layers, len(modules), "layer", type(model).__name__)
    counts = {modules[i].n_heads for i in chosen}
    if len(counts) > 1:
        raise ValueError(
            f"the selected layers have different head counts {sorted(counts)}; select layers "
            "with the same number of heads (layers=[...]) to get one (L, Hq) table"
        )
    (H,) = counts
    ref = next(iter(modules[chosen[0]].parameters()))
    fk = {"dtype": ref.dtype if ref.is_floating_point() else torch.float32, "device": ref.device}

    def scalar(value) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"loss() must return a scalar tensor, got {got}")
        return value.reshape(())

    out = torch.zeros(len(chosen), H, dtype=torch.float64)
    if method == "gradient":
        gates = {i: torch.ones(H, **fk, requires_grad=True) for i in chosen}
        with torch.enable_grad(), mask_heads(model, gates):
            grads = torch.autograd.grad(scalar(loss()), list(gates.values()), allow_unused=True)
        for row, g in enumerate(grads):
            if g is not None:
                out[row] = g.detach().abs().to(torch.float64).cpu()
        return out
    with torch.no_grad():
        base = scalar(loss()).item()
        for row, i in enumerate(chosen):
            for h in range(H):
                gates = torch.ones(H, **fk)
                gates[h] = 0
                with mask_heads(model, {i: gates}):
                    out[row, h] = scalar(loss()).item() - base
    return out
