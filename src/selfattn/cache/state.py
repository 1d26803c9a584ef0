"""The state cache: what a recurrent layer (Mamba-2, gated DeltaNet, linear attention) keeps
between steps, beside the KV cache of the attention layers.

A KV cache grows by one key and value per token; a recurrent layer keeps a fixed-size state per
sequence whatever its length::

    conv   (B, conv_dim, conv_width - 1)   the last inputs of the causal depthwise convolution
    state  (B, H, Dk, Dv)                  the scan's state (float32; float64 models: float64)

so its bytes per sequence are ``conv_dim · (conv_width - 1) · itemsize(dtype) + H · Dk · Dv ·
itemsize(state dtype)`` (:func:`state_bytes`), independent of the context length.

:meth:`LayerState.fork` copies rows (``n > 1`` samples of one prompt, a shared prefix): a state
cannot be shared page by page like a paged KV cache, so a fork is a copy, still of fixed size.
:meth:`HybridCache.fork` does both: its attention layers' pages are shared copy-on-write, its
states copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from selfattn._validate import positive_int
from selfattn.cache.base import Step
from selfattn.cache.size import KV_DTYPES, dtype_name
from selfattn.cache.static import StaticCache

__all__ = [
    "HybridCache",
    "LayerState",
    "StateShape",
    "fork",
    "qwen3_next_layer_types",
    "state_bytes",
    "state_shape_from_config",
]


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The scan accumulates in float32 (float64 stays float64): its state is kept so."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_bytes(conv_dim: int, conv_width: int, state_shape: tuple[int, int, int], dtype) -> int:
    """Bytes of one sequence's :class:`LayerState` (one layer): the conv window in ``dtype`` (a
    torch dtype or a name, ``"bf16"``) plus the ``(H, Dk, Dv)`` state in the scan's dtype
    (float32, or float64). The state is never quantised: int8/fp8 keep the window in bf16."""
    name = dtype_name(dtype)
    width = KV_DTYPES["bf16" if name in ("int8", "fp8") else name]
    H, Dk, Dv = state_shape
    return conv_dim * (conv_width - 1) * width + H * Dk * Dv * (8 if name == "fp64" else 4)


@dataclasses.dataclass(frozen=True)
class StateShape:
    """What a model's recurrent layers keep per sequence: ``layers`` states of ``(heads,
    key_dim, value_dim)`` after a conv window of ``conv_dim`` x ``conv_width - 1``; the other
    ``attention_layers`` keep a KV cache."""

    layers: int
    conv_dim: int
    conv_width: int
    heads: int
    key_dim: int
    value_dim: int
    attention_layers: int

    def bytes(self, dtype, batch: int = 1) -> int:
        """Bytes of the recurrent state of ``batch`` sequences, whatever their length."""
        shape = (self.heads, self.key_dim, self.value_dim)
        return self.layers * batch * state_bytes(self.conv_dim, self.conv_width, shape, dtype)


# transformers' Qwen3NextConfig default: every 4th layer full attention (the released
# config.json files give full_attention_interval, not layer_types)
_QWEN3_NEXT_INTERVAL = 4


def qwen3_next_layer_types(config: Mapping) -> list[str]:
    """A ``qwen3_next`` config's ``layer_types`` (``"linear_attention"`` or ``"full_attention"``
    per layer); without them, layer ``i`` is full attention where ``(i + 1)`` is a multiple of
    ``full_attention_interval``, as transformers fills them in."""
    types = config.get("layer_types")
    if types:
        return list(types)
    interval = config.get("full_attention_interval") or _QWEN3_NEXT_INTERVAL
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(config["num_hidden_layers"])
    ]


def state_shape_from_config(config: Mapping) -> StateShape | None:
    """The recurrent state of a transformers ``config.json`` (a dict): Mamba-2 (``mamba2``),
    Bamba (``bamba``: Mamba-2 layers but ``attn_layer_indices``), Qwen3-Next (``qwen3_next``:
    gated DeltaNet on its ``linear_attention`` layers); None for a model without one."""
    kind, get = config.get("model_type"), config.get
    L = get("num_hidden_layers")
    if kind == "mamba2":
        H, P, N, G = get("num_heads"), get("head_dim"), get("state_size"), get("n_groups", 1)
        return StateShape(L, H * P + 2 * G * N, get("conv_kernel", 4), H, N, P, 0)
    if kind == "bamba":
        H, N, G = get("mamba_n_heads"), get("mamba_d_state"), get("mamba_n_groups", 1)
        P = get("mamba_d_head")
        if P in (None, "auto"):
            P = get("mamba_expand", 2) * get("hidden_size") // H
        attn = len(get("attn_layer_indices") or ())
        return StateShape(L - attn, H * P + 2 * G * N, get("mamba_d_conv", 4), H, N, P, attn)
    if kind == "qwen3_next":
        Hv, Hk = get("linear_num_value_heads"), get("linear_num_key_heads")
        Dk, Dv = get("linear_key_head_dim"), get("linear_value_head_dim")
        linear = sum(t == "linear_attention" for t in qwen3_next_layer_types(config))
        conv = 2 * Hk * Dk + Hv * Dv
        return StateShape(linear, conv, get("linear_conv_kernel_dim", 4), Hv, Dk, Dv, L - linear)
    return None


class LayerState:
    """One recurrent layer's state for ``batch`` sequences: ``conv (B, conv_dim, conv_width-1)``
    in ``dtype`` and ``state (B, H, Dk, Dv)`` in float32 (float64 for float64), both zeros at
    first; ``length`` counts the tokens seen (padding included, as the KV caches do).

    The layer reads ``conv`` and ``state``, runs its step or its chunked scan and hands both back
    through :meth:`write`. Fixed size: ``nbytes`` never changes.
    """

    def __init__(
        self,
        batch: int,
        conv_dim: int,
        conv_width: int,
        state_shape: tuple[int, int, int],
        *,
        dtype=torch.float32,
        device=None,
    ):
        positive_int(batch, "LayerState batch")
        positive_int(conv_width, "LayerState conv_width")
        for i, n in enumerate(state_shape):
            positive_int(n, f"LayerState state_shape[{i}]")
        self.conv_width = conv_width
        self.conv = torch.zeros(batch, conv_dim, conv_width - 1, dtype=dtype, device=device)
        self.state = torch.zeros(
            batch, *state_shape, dtype=_state_dtype(dtype), device=device
        )  # (B, H, Dk, Dv)
        self.length = 0

    @property
    def batch(self) -> int:
        return self.state.shape[0]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes

    def __len__(self) -> int:
        return self.length

    def write(self, conv: torch.Tensor | None, state: torch.Tensor, n_tokens: int) -> None:
        """Keep a step's results: the conv window (None: the layer has no conv), the new state,
        and ``n_tokens`` more tokens seen."""
        if tuple(state.shape) != tuple(self.state.shape):
            raise ValueError(
                f"LayerState holds a state of shape {tuple(self.state.shape)}, got "
                f"{tuple(state.shape)}: the layer and its cache disagree (build the cache with "
                "the model's make_cache)"
            )
        if conv is not None:
            self.conv = conv.detach().to(self.conv.dtype)
        self.state = state.detach().to(self.state.dtype)
        self.length += n_tokens

    def reset(self) -> None:
        self.conv = torch.zeros_like(self.conv)
        self.state = torch.zeros_like(self.state)
        self.length = 0

    def fork(self, rows) -> LayerState:
        """A new LayerState whose row ``i`` is a copy of this one's row ``rows[i]`` (a list or
        a 1-D index tensor; repeat a row for ``n > 1`` continuations of one prompt)."""
        idx = _rows(rows, self.batch, self.state.device)
        new = object.__new__(LayerState)
        new.conv_width, new.length = self.conv_width, self.length
        new.conv, new.state = self.conv[idx].clone(), self.state[idx].clone()
        return new

    def __repr__(self) -> str:
        return (
            f"LayerState(batch={self.batch}, conv={tuple(self.conv.shape[1:])}, "
            f"state={tuple(self.state.shape[1:])}, length={self.length})"
        )


def _rows(rows, batch: int, device) -> torch.Tensor:
    idx = torch.as_tensor(rows, dtype=torch.long, device=device).reshape(-1)
    if idx.numel() == 0 or bool(((idx < 0) | (idx >= batch)).any()):
        raise ValueError(f"fork rows must be row indices in 0..{batch - 1}, got {idx.tolist()}")
    return idx


def _fork_static(cache: StaticCache, idx: torch.Tensor) -> StaticCache:
    new = object.__new__(StaticCache)
    new.__dict__.update(cache.__dict__)
    new.k, new.v = cache.k[idx].clone(), cache.v[idx].clone()
    return new


def fork(cache, rows):
    """Copy rows of a model cache made of :class:`LayerState` and
    :class:`~selfattn.cache.StaticCache` layers (a :class:`~selfattn.cache.layers.LayerCaches`,
    as the recurrent and hybrid models' ``make_cache("static")`` returns): row ``i`` of the
    result continues row ``rows[i]``. Decoding on from the fork equals recomputing the prompt."""
    from selfattn.cache.layers import LayerCaches

    if isinstance(cache, LayerState):
        return cache.fork(rows)
    if isinstance(cache, HybridCache):
        return cache.fork(rows)
    if not isinstance(cache, LayerCaches):
        raise TypeError(
            f"fork takes a LayerState or a LayerCaches of LayerState/StaticCache layers, got "
            f"{type(cache).__name__}"
        )
    layers = []
    for layer in cache.layers:
        if isinstance(layer, LayerState):
            layers.append(layer.fork(rows))
        elif isinstance(layer, StaticCache):
            layers.append(_fork_static(layer, _rows(rows, layer.k.shape[0], layer.k.device)))
        else:
            raise TypeError(
                f"fork cannot copy a {type(layer).__name__} layer (LayerState and StaticCache "
                "only); build the cache with make_cache('static', ...)"
            )
    return LayerCaches(cache.kind, layers, cache.device)


class HybridCache:
    """A hybrid model's cache when its attention layers share one model-level KV cache (a
    :class:`~selfattn.cache.PagedCacheView` over a :class:`~selfattn.cache.PagedKV` with one
    layer per attention layer): ``layout[i]`` is True for an attention layer, whose
    ``plan(S).layers[i]`` is the KV cache's next layer, False for a recurrent one, whose entry is
    its :class:`LayerState` (``states``, in layer order). ``length`` is the KV cache's."""

    def __init__(self, layout, kv, states: list[LayerState]):
        self.layout, self.kv, self.states = [bool(a) for a in layout], kv, list(states)
        if sum(self.layout) != kv.n_layers or len(self.layout) - sum(self.layout) != len(states):
            raise ValueError(
                f"HybridCache layout has {sum(self.layout)} attention and "
                f"{len(self.layout) - sum(self.layout)} recurrent layers but got a KV cache of "
                f"{kv.n_layers} layers and {len(states)} states"
            )

    @property
    def n_layers(self) -> int:
        return len(self.layout)

    @property
    def length(self) -> int:
        return self.kv.length

    def __len__(self) -> int:
        return self.length

    def plan(self, n_tokens: int) -> Step:
        step = self.kv.plan(n_tokens)
        kv, states = iter(step.layers), iter(self.states)
        layers = [next(kv) if a else next(states) for a in self.layout]
        return Step(layers, step.positions, step.past)

    def reset(self) -> None:
        self.kv.reset()
        for s in self.states:
            s.reset()

    def fork(self, rows) -> HybridCache:
        """A new HybridCache on the same :class:`~selfattn.cache.PagedKV` whose row ``i``
        continues row ``rows[i]``: its attention layers get a new sequence sharing every page of
        that row (:meth:`PagedKV.fork`: copy-on-write, nothing copied until a shared page is
        written), its recurrent layers a copy of the row's state (:meth:`LayerState.fork`).

        The KV cache needs room for the new sequences (``make_cache("paged", ..., max_seqs=)``);
        without it nothing is forked and RuntimeError says so. :meth:`free` gives the fork's pages
        back."""
        kv, seq_ids = self.kv.cache, self.kv.seq_ids
        idx = _rows(rows, len(seq_ids), "cpu").tolist()
        live = len(kv.seq_ids)
        if live + len(idx) > kv.max_seqs:
            raise RuntimeError(
                f"cannot fork {len(idx)} rows: the paged KV cache holds {live} of max_seqs="
                f"{kv.max_seqs} sequences; build it with make_cache('paged', ..., "
                f"max_seqs={live + len(idx)}) or free a fork first"
            )
        states = [s.fork(idx) for s in self.states]
        return HybridCache(self.layout, kv.view([kv.fork(seq_ids[r]) for r in idx]), states)

    def free(self) -> None:
        """Drop this cache's sequences from the shared KV cache (pages no other sequence holds
        become free); the cache is unusable afterwards."""
        for s in self.kv.seq_ids:
            self.kv.cache.free(s)
        self.kv.seq_ids, self.states = [], []

    def __repr__(self) -> str:
        return (
            f"HybridCache(kv={type(self.kv).__name__}, attention_layers={sum(self.layout)}, "
            f"states={len(self.states)}, length={self.length})"
        )
