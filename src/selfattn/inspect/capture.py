"""``capture_attention``: record per-layer, per-head attention weights of any selfattn model.

The explicit form ``softmax(QKᵀ/√d + M)`` is what makes attention maps available at all: a
fused kernel never materialises them. Inside the context manager every
:class:`selfattn.nn.MultiHeadAttention` of the model (numbered in ``model.modules()`` order: the
"layers") still computes its output exactly as before; the selected layers additionally recompute
``selfattn.attention_weights`` on the same q, k, v, mask and score mod, for the selected query
heads only.

>>> with capture_attention(model, layers=[0, -1], heads=[3]) as maps:   # doctest: +SKIP
...     model(input_ids)
>>> maps[0].shape                  # (B, 1, Sq, Sk): layer 0, head 3
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from selfattn import scores as _scores
from selfattn._validate import checked_int, positive_int
from selfattn.cache.base import InPlaceKVCache, attends_in_place
from selfattn.cache.size import format_bytes
from selfattn.functional import attention_weights
from selfattn.masks import Mask, as_mask
from selfattn.nn import MultiHeadAttention

__all__ = [
    "AttentionMaps",
    "attention_layers",
    "capture_attention",
    "selection",
]

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB of recorded maps: a 12-layer, 12-head model at Sk ≈ 1.3k


def selection(value, n: int, what: str, fix: str) -> list[int]:
    """``None`` -> all of ``range(n)``; an int or ints (negatives count from the end) -> list."""
    if value is None:
        return list(range(n))
    items = [value] if isinstance(value, int) else list(value)
    if not items:
        raise ValueError(f"{what} selection is empty; pass None for all {n}, or some indices")
    out = []
    for i in items:
        if not -n <= checked_int(i, f"{what} index") < n:
            raise ValueError(f"{what} {i} is out of range: {fix} has {n} (0..{n - 1})")
        out.append(i % n)
    return sorted(set(out))


class AttentionMaps:
    """What :func:`capture_attention` recorded.

    ``maps[layer]`` is the last call's weights of that layer, ``(B, len(heads), Sq, Sk)``: rows
    are queries, columns keys, each row sums to 1 (0 for a query with no visible key). All calls
    are kept in ``maps.calls[layer]`` (a model called twice, or a decoder stepping through a
    cache, records one map per call).

    Attributes:
        layers: the selected layer numbers (indices into ``maps.modules``).
        heads: the selected query heads (the same for every layer).
        names: ``layer -> module name`` (``model.named_modules()``), for labels.
        modules: every ``MultiHeadAttention`` of the model, in layer order.
    """

    def __init__(self, modules, names, layers, heads, max_bytes, gradients=False):
        self.modules, self.layers, self.heads = modules, layers, heads
        self.names = {i: names[i] for i in layers}
        self.max_bytes = max_bytes
        self.calls: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
        # what each call's mask allowed, bool (B, 1 or |heads|, Sq, Sk); None: no mask
        self.allowed: dict[int, list[torch.Tensor | None]] = {i: [] for i in layers}
        self.record_gradients = gradients
        # per call: [v (B, Hkv, Sk, Dv), the output's gradient once filled, the output itself]
        self._grad_parts: dict[int, list[list]] = {i: [] for i in layers}
        self.nbytes = 0

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self.calls:
            raise KeyError(f"layer {layer} was not captured; captured layers: {self.layers}")
        if not self.calls[layer]:
            raise KeyError(f"layer {layer} recorded nothing: was the model called inside `with`?")
        return self.calls[layer][-1]

    def __contains__(self, layer: int) -> bool:
        return bool(self.calls.get(layer))

    def __iter__(self) -> Iterator[int]:
        return (i for i in self.layers if self.calls[i])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def items(self) -> Iterator[tuple[int, torch.Tensor]]:
        return ((i, self[i]) for i in self)

    def mask(self, layer: int) -> torch.Tensor | None:
        """What the mask of ``layer``'s last call allowed: bool ``(B, 1 or len(heads), Sq, Sk)``
        (True = attend), or None when the call had no mask (every pair allowed) or ran through a
        cache that attends itself (the paged view; not recorded)."""
        self[layer]  # the errors of a layer that recorded nothing
        return self.allowed[layer][-1]

    def gradient(self, layer: int) -> torch.Tensor:
        """``∂y/∂A`` of the last call of ``layer``, ``(B, len(heads), Sq, Sk)``, once
        ``y.backward()`` ran (capture with ``gradients=True``, gradients enabled).

        The attention output of head ``h`` is ``O_h = A_h V_h``, so ``∂y/∂A_h = (∂y/∂O_h) V_hᵀ``:
        the gradient of each head's output is hooked, and ``V`` kept, in the forward pass.
        """
        self[layer]
        if not self.record_gradients:
            raise ValueError(
                "no gradients recorded: capture with capture_attention(gradients=True)"
            )
        parts = self._grad_parts[layer]
        if not parts or parts[-1][1] is None:
            raise ValueError(
                f"layer {layer} has no gradient: run the model with gradients enabled inside the "
                "`with` block and call .backward() on the chosen output before asking"
            )
        v, grad_out, _ = parts[-1]
        group = grad_out.shape[1] // v.shape[1]  # query heads per kv head
        index = torch.tensor(self.heads, device=v.device)
        g = grad_out.index_select(1, index)  # (B, Hq, Sq, Dv) -> (B, |heads|, Sq, Dv)
        vh = v.index_select(1, index // group)  # (B, Hkv, Sk, Dv) -> (B, |heads|, Sk, Dv)
        return g @ vh.transpose(-1, -2)  # -> (B, |heads|, Sq, Sk)

    def times_gradient(self, layer: int) -> torch.Tensor:
        """Attention x gradient of ``layer``: ``A ⊙ ∂y/∂A``, ``(B, len(heads), Sq, Sk)``; the
        share of ``y``'s first-order change carried by each weight, per head."""
        g = self.gradient(layer)
        return self[layer].to(g.dtype) * g

    def stack(self) -> torch.Tensor:
        """The last call of every recorded layer as one ``(L, B, len(heads), Sq, Sk)`` tensor."""
        maps = [w for _, w in self.items()]
        if not maps:
            raise ValueError("nothing was recorded: call the model inside the `with` block")
        shapes = {tuple(w.shape) for w in maps}
        if len(shapes) > 1:
            raise ValueError(
                f"layers recorded maps of different shapes {sorted(shapes)} (cross-attention or "
                "different lengths); index maps[layer] instead"
            )
        return torch.stack(maps)

    # -- recording -------------------------------------------------------------------------------
    def _reserve(self, layer: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Refuse before computing when the maps would exceed ``max_bytes``.

        The first call of a forward pass does not know the later layers' lengths, so it assumes
        every selected layer not yet recorded is as large as this one: a too-large selection
        fails at its first layer rather than after filling memory.
        """
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        pending = sum(1 for i in self.layers if not self.calls[i] and i != layer) + 1
        projected = self.nbytes + size * pending
        if projected > self.max_bytes:
            B, H, Sq, Sk = shape
            raise ValueError(
                f"capturing attention maps needs about {format_bytes(projected)}: "
                f"{format_bytes(size)} per layer (B={B} x heads={H} x Sq={Sq} x Sk={Sk} x "
                f"{torch.empty((), dtype=dtype).element_size()} bytes) for {len(self.layers)} "
                f"layer(s), above max_bytes={format_bytes(self.max_bytes)}. Narrow the selection "
                "(layers=[...], heads=[...]), shorten the input, or raise max_bytes"
            )
        self.nbytes += size

    def _record(self, layer: int, weights: torch.Tensor, allowed=None) -> None:
        self.calls[layer].append(weights.detach())
        self.allowed[layer].append(allowed)

    def _gradient_hook(self, layer: int, v: torch.Tensor):
        """The observer's return: hooks the gradient of the layer's per-head output. An output
        that needs no gradient (frozen parameters, integer inputs) becomes a leaf that does, so
        a gradient reaches every captured layer; its value is unchanged."""
        part: list = [v.detach(), None, None]
        self._grad_parts[layer].append(part)

        def hook(out: torch.Tensor) -> torch.Tensor:
            if not out.requires_grad:
                out = out.detach().requires_grad_()
            part[2] = out
            out.register_hook(lambda g: part.__setitem__(1, g.detach()))
            return out

        return hook

    def outputs(self) -> list[torch.Tensor]:
        """The hooked per-head outputs of the recorded calls (for ``torch.autograd.grad``)."""
        return [p[2] for parts in self._grad_parts.values() for p in parts if p[2] is not None]

    def release_outputs(self) -> None:
        """Drop the outputs (and the autograd graph they hold) once their gradients are in."""
        for parts in self._grad_parts.values():
            for p in parts:
                p[2] = None


# -- head subsets ---------------------------------------------------------------------------------
# Masks and score mods may depend on the query head `h` (ALiBi slopes, per-head biases). When only
# some heads are computed, head `i` of the sliced call is model head `heads[i]`: these wrappers
# translate the index back so every head sees its own mask and bias.


class _HeadSubsetMask(Mask):
    def __init__(self, inner: Mask, heads: torch.Tensor, n_heads: int):
        self.inner, self.heads, self.n_heads = inner, heads, n_heads

    def children(self) -> tuple[Mask, ...]:
        return (self.inner,)

    def _with_children(self, parts):
        return _HeadSubsetMask(parts[0], self.heads, self.n_heads)

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.inner.mask_mod(b, self.heads.to(h.device)[h], q_idx, kv_idx)

    def validate(self, B, H, Sq, Sk, q_offset):
        self.inner.validate(B, self.n_heads, Sq, Sk, q_offset)

    def __repr__(self) -> str:
        return f"{self.inner!r}[heads={self.heads.tolist()}]"


class _HeadSubsetScoreMod(_scores.ScoreMod):
    def __init__(self, inner: _scores.ScoreMod, heads: torch.Tensor, n_heads: int):
        self.inner, self.heads, self.n_heads = inner, heads, n_heads
        self.additive = inner.additive

    def score_mod(self, score, b, h, q_idx, kv_idx):
        h = self.heads.to(h.device)[h]
        return self.inner.score_mod(score, b, h, q_idx, kv_idx)

    def bias(self, b, h, q_idx, kv_idx):
        return self.inner.bias(b, self.heads.to(h.device)[h], q_idx, kv_idx)

    def bind(self, q_offset):
        inner = self.inner.bind(q_offset)
        return self if inner is self.inner else _HeadSubsetScoreMod(inner, self.heads, self.n_heads)

    def tensors(self):
        return self.inner.tensors()

    def validate(self, B, H, Sq, Sk, q_offset):
        self.inner.validate(B, self.n_heads, Sq, Sk, q_offset)

    def __repr__(self) -> str:
        return f"{self.inner!r}[heads={self.heads.tolist()}]"


def _weights_of_heads(q, k, v, heads, *, mask, score_mod, scale, q_offset, sinks=None):
    """``attention_weights`` for query heads ``heads`` only: ``(B, len(heads), Sq, Sk)``.

    ``q (B, Hq, Sq, D)``, ``k``/``v (B, Hkv, Sk, ·)``. Query head ``h`` reads kv head ``h // G``;
    the sliced call pairs each kept query head with its own kv head one to one.
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    if len(heads) == Hq:  # all heads: exactly the layer's own call
        return attention_weights(
            q, k, v, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset, sinks=sinks
        )
    G = Hq // Hkv
    index = torch.tensor(heads, device=q.device)
    kv_index = index // G
    if mask is not None:
        mask = _HeadSubsetMask(as_mask(mask), index, Hq)
    if score_mod is not None:
        score_mod = _HeadSubsetScoreMod(_scores.as_score_mod(score_mod), index, Hq)
    return attention_weights(
        q.index_select(1, index),  # (B, Hq, Sq, D) -> (B, |heads|, Sq, D)
        k.index_select(1, kv_index),  # (B, Hkv, Sk, D) -> (B, |heads|, Sk, D)
        v.index_select(1, kv_index),
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        q_offset=q_offset,
        sinks=None if sinks is None else sinks.index_select(0, index),  # (Hq,) -> (|heads|,)
    )


def _allowed(mask, heads, n_heads, B, Sq, Sk, q_offset, device):
    """What ``mask`` allowed for the selected ``heads``: bool ``(B, 1 or |heads|, Sq, Sk)``."""
    if mask is None:
        return None
    m = as_mask(mask)
    if len(heads) != n_heads:
        m = _HeadSubsetMask(m, torch.tensor(heads, device=device), n_heads)
    dense = m.to_dense(Sq, Sk, B=B, H=len(heads), q_offset=q_offset, device=device)
    if dense.stride(1) == 0:  # the same for every head: keep one
        dense = dense[:, :1]
    return dense.contiguous()


def _cached_tokens(cache: InPlaceKVCache) -> int:
    """Tokens already in an in-place ``cache``: its longest sequence."""
    lengths = cache.lengths
    return int(lengths.max()) if len(lengths) else 0


def _observer(layer: int, maps: AttentionMaps):
    """Records the selected heads' weights from the exact q/k/v a layer attends with."""

    def observe(q, k, v, *, mask, score_mod, scale, q_offset, sinks=None):
        B, Hq, Sq, Sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        with torch.no_grad():
            maps._reserve(layer, (B, len(maps.heads), Sq, Sk), q.dtype)
            w = _weights_of_heads(
                q, k, v, maps.heads, mask=mask, score_mod=score_mod, scale=scale,
                q_offset=q_offset, sinks=sinks,
            )  # fmt: skip
            allowed = _allowed(mask, maps.heads, Hq, B, Sq, Sk, q_offset, q.device)
        maps._record(layer, w, allowed)
        if maps.record_gradients and torch.is_grad_enabled():
            return maps._gradient_hook(layer, v)
        return None

    return observe


def _capturing_forward(m: MultiHeadAttention, original, layer: int, maps: AttentionMaps):
    """A per-instance ``forward`` for caches that attend themselves (the paged view reads its
    pages in place, so no q/k/v pass through the observer): it asks for the layer's own
    all-head weights and records the selected heads. Returns exactly what ``original`` does."""

    def forward(x, context=None, **kwargs):
        cache = kwargs.get("cache")
        if not attends_in_place(cache):
            return original(x, context, **kwargs)
        B, Sq = x.shape[:2]
        maps._reserve(layer, (B, m.n_heads, Sq, Sq + _cached_tokens(cache)), x.dtype)
        out, w = original(x, context, **{**kwargs, "return_weights": True})
        maps._record(layer, w[:, maps.heads])  # no mask picture: the cache applies its own
        return (out, w) if kwargs.get("return_weights") else out

    return forward


def attention_layers(model: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """``(name, module)`` of every :class:`~selfattn.nn.MultiHeadAttention` of ``model`` in
    ``model.modules()`` order: the layer numbering of everything in :mod:`selfattn.inspect`."""
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not named:
        raise ValueError(
            f"{type(model).__name__} has no selfattn.nn.MultiHeadAttention layers to inspect; "
            "selfattn.inspect works on models built from selfattn.nn"
        )
    return named


@contextlib.contextmanager
def capture_attention(
    model: nn.Module,
    layers: int | Iterable[int] | None = None,
    heads: int | Iterable[int] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    gradients: bool = False,
) -> Iterator[AttentionMaps]:
    """Record attention weights of ``model``'s attention layers while the block runs.

    Args:
        model: any module containing :class:`selfattn.nn.MultiHeadAttention` layers (numbered
            0, 1, ... in ``model.modules()`` order; a ``MultiHeadAttention`` itself is layer 0).
        layers: layer numbers to record (negative: from the end); ``None``: all.
        heads: query heads to record, the same for every selected layer; ``None``: all.
        max_bytes: refuse (``ValueError``, before computing) when the recorded maps,
            ``B · |heads| · Sq · Sk · bytes`` per layer summed over the selected layers, would
            exceed this.
        gradients: also hook the gradient of each selected layer's per-head output so that,
            after ``y.backward()`` on an output of a forward run inside the block with gradients
            enabled, ``maps.gradient(layer)`` is ``∂y/∂A`` (see
            :func:`selfattn.inspect.attention_times_gradient`).

    Yields:
        :class:`AttentionMaps`; ``maps[layer]`` is ``(B, |heads|, Sq, Sk)`` after the model ran.

    Model outputs are unchanged: each layer's output is computed by its own forward; the maps
    are a second, no-grad ``selfattn.attention_weights`` call on the very q/k/v, mask and score
    mod the layer attends with (handed over by ``MultiHeadAttention.attention_observer``; no
    dropout). Only the selected heads are computed, except with a cache that attends itself (the
    paged view), where the layer's own all-head weights are sliced.
    """
    named = attention_layers(model)
    positive_int(max_bytes, "max_bytes")
    modules = [m for _, m in named]
    names = [n or type(model).__name__ for n, _ in named]
    layers = selection(layers, len(modules), "layer", f"{type(model).__name__}")
    n_heads = min(modules[i].n_heads for i in layers)
    heads = selection(heads, n_heads, "head", "each selected layer")
    maps = AttentionMaps(modules, names, layers, heads, max_bytes, gradients)
    saved = {}
    try:
        for i in layers:
            m = modules[i]  # named_modules() lists a shared module once
            # a forward or observer set by someone else is restored on exit
            saved[m] = (m.__dict__.get("forward"), m.attention_observer)
            m.attention_observer = _observer(i, maps)
            m.forward = _capturing_forward(m, m.forward, i, maps)
        yield maps
    finally:
        for m, (forward, observer) in saved.items():
            del m.forward
            if forward is not None:
                m.forward = forward
            m.attention_observer = observer
