"""KV compression in generation: each layer's prompt KV compressed once, after the prefill.

As kvpress does on transformers' dense cache: the prompt (the context) is prefilled normally,
then a press (:mod:`selfattn.cache.compress`) keeps part of each layer's K/V, and decoding
attends to the kept tokens only::

    cache = model.make_cache("static", B, S + new)
    logits = compress_prefill(model, input_ids, cache, press("snapkv", 0.5))   # (B, 1, vocab)
    # layer i's StaticCache holds its n_i kept tokens in slots 0 .. n_i - 1
    logits = model(next_ids, cache=cache)   # new tokens at their true positions S, S + 1, ...

``context_len=C`` compresses the first ``C`` prompt tokens only and prefills the rest (a
question) after them uncompressed, as kvpress's pipeline does with its ``question``.

The presses read each layer's last ``press.query_rows(S)`` queries: a forward pre-hook on each
:class:`~selfattn.nn.MultiHeadAttention` records its input's last rows (and their positions)
during the prefill and :meth:`~selfattn.nn.MultiHeadAttention.queries` projects them after, so
the prompt is run once. A press reading every row (``press.statistic()`` not None: observed and
expected attention) folds them into its statistic as each layer's forward ends (its keys are
in the cache then) and drops them, so one layer's rows are held at a time. Decode-time
policies (H2O's ``observed_attention``, TOVA) score at the prefill only, as kvpress does.

Positions are decoupled from slots (``StaticCache.position``): a kept token keeps its RoPE
rotation, new tokens continue at ``S + t`` in the slots after the kept ones, and a decode query
attends every kept slot (causal over slots holds: every kept token is in its past). Hence the
refusals: layers whose masks read absolute key positions (sliding-window and chunked layers,
ALiBi, left-padded batches) and the paged cache.

Per-head budgets (AdaKV's ragged counts ``n[b, h]``) compact each KV head's kept tokens into
slots ``0 .. n[b, h] - 1`` of a layer holding ``n_max = max n`` slots; slots
``[n[b, h], n_max)`` are that head's hole, which every later attention of the layer skips
(``StaticCache.compact(..., counts)``, ``KV.holes``), as the Engine's paged holes do.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from selfattn._validate import int_at_least
from selfattn.cache import StaticCache
from selfattn.cache.compress import Press, Quantized, compression
from selfattn.nn import MultiHeadAttention

__all__ = ["after_each", "as_press", "check_compressible", "compress_prefill", "recorded_inputs"]


def as_press(spec) -> Press | None:
    """A press from ``spec``: None, a :class:`~selfattn.cache.compress.Press`, or a string
    ``"POLICY[:RATIO]"`` (``"snapkv:0.5"``; :func:`~selfattn.cache.compress.compression` reads
    it). None for None or ratio 0 (an exact no-op)."""
    if isinstance(spec, Quantized):
        raise ValueError(
            f"kv_compression={spec.name!r} quantises the cache instead of evicting tokens; "
            "pass it as the cache kind, or an eviction policy such as 'snapkv:0.5'"
        )
    if spec is not None and not isinstance(spec, (str, Press)):
        raise TypeError(
            f"kv_compression must be a press (selfattn.cache.compress.press(name, ratio)) or "
            f"a 'POLICY:RATIO' string, got {type(spec).__name__}"
        )
    found = compression(spec)
    if found is None:
        return None
    if found.decode_budget is not None:
        raise ValueError(
            f"kv_compression {spec!r}: generate compresses the prompt only; decode_budget "
            "(eviction while generating) runs in the Engine (selfattn.serving)"
        )
    return found.press


def attention_layers(model) -> list[MultiHeadAttention]:
    """Each block's self-attention module, in layer order (ValueError where one has none)."""
    found = []
    for i, block in enumerate(model.layers):
        own = getattr(block, "self_attention", None)
        inner = [] if own is None else own.modules()
        mods = [m for m in inner if isinstance(m, MultiHeadAttention)]
        if len(mods) != 1:
            raise ValueError(
                f"kv_compression needs one MultiHeadAttention per block; block {i} "
                f"({type(block).__name__}) has {len(mods)}: use a model of attention blocks"
            )
        found.append(mods[0])
    return found


def check_compressible(model, cache_kind, attention_mask=None) -> None:
    """ValueError naming what stops ``model`` from compressing its prompt's KV: a cache kind
    other than ``"static"``/``"auto"``, an encoder-decoder, layers whose masks read absolute key
    positions (windows, chunks, ALiBi) or a left-padded batch."""
    if cache_kind not in ("static", "auto"):
        raise ValueError(
            f"kv_compression runs on the static cache, got cache={cache_kind!r}; pass "
            "cache='static' (or 'auto')"
        )
    if getattr(model, "is_encoder_decoder", False):
        raise ValueError(
            f"kv_compression compresses a decoder-only model's prompt, not "
            f"{type(model).__name__}'s encoder output; drop kv_compression"
        )
    config = getattr(model, "config", None)
    kinds = set(getattr(config, "layer_types", ()) or ()) - {"full_attention"}
    if kinds:
        raise ValueError(
            f"kv_compression needs global attention in every layer; this model has "
            f"{sorted(kinds)} layers, whose masks read each kept key's original position; "
            "drop kv_compression for it"
        )
    if any(m.alibi is not None for m in attention_layers(model)):
        raise ValueError(
            "kv_compression cannot keep ALiBi's biases, which read each key's original "
            "position; drop kv_compression for this model"
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(
            "kv_compression takes rows of equal length (no padding in attention_mask): the "
            "padding mask reads key positions; generate the rows one at a time"
        )


@contextmanager
def recorded_inputs(layers: list[MultiHeadAttention], rows):
    """Within the block, each forward of ``layers[i]`` records ``(x's rows, positions of those
    rows or None)`` into the yielded dict under ``i`` (the last call wins); the hooks are
    removed on exit. ``rows``: an int, the last ``rows`` tokens (``x[:, -rows:]``), or a 1-D
    int64 tensor of token indices (a packed step's rows of several sequences)."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def pick(t: torch.Tensor, dim: int) -> torch.Tensor:
        if isinstance(rows, int):
            return t.narrow(dim, t.shape[dim] - rows, rows).clone()
        return t.index_select(dim, rows.to(t.device))

    def hook(i):
        def record(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            pos = kwargs.get("positions")
            seen[i] = (pick(x, 1), None if pos is None else pick(pos, pos.dim() - 1))

        return record

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextmanager
def after_each(layers: list[MultiHeadAttention], fn):
    """Within the block, ``fn(i)`` runs after each forward of ``layers[i]`` (its output
    unchanged); the hooks are removed on exit."""

    def hook(i):
        def run(module, args, output):
            fn(i)

        return run

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def compress_prefill(
    model, input_ids: torch.Tensor, cache, kv_compression, context_len: int | None = None
) -> torch.Tensor:
    """Prefill ``input_ids (B, S)`` into ``cache`` (``model.make_cache("static", ...)``, empty)
    compressing the first ``context_len`` tokens' KV (default all) by ``kv_compression`` (as
    :func:`as_press` reads it); returns the last token's logits ``(B, 1, vocab)`` (module
    docstring)."""
    check_compressible(model, "static")
    press_ = as_press(kv_compression)
    layers = attention_layers(model)
    caches = getattr(cache, "layers", None)
    if caches is None or not all(isinstance(c, StaticCache) for c in caches) or cache.position:
        raise ValueError(
            "compress_prefill needs an empty model.make_cache('static', ...), got "
            f"{type(cache).__name__}"
        )
    S = input_ids.shape[1]
    C = S if context_len is None else int_at_least(context_len, "context_len", 1)
    if C > S:
        raise ValueError(f"context_len={C} exceeds the prompt's {S} tokens; pass at most {S}")
    if press_ is None:
        return model(input_ids, cache=cache, logits_to_keep=1)
    rows = max(0, min(C, press_.query_rows(C)))
    stats = [press_.statistic() for _ in layers] if rows else []
    streamed = bool(stats) and stats[0] is not None
    positions = torch.arange(C, device=input_ids.device)

    def queries_of(i: int) -> torch.Tensor:
        x, pos = seen.pop(i)
        pos = positions[-rows:] if pos is None else pos
        return layers[i].queries(x, pos, rotate=press_.rotated_queries)

    def fold(i: int) -> None:  # layer i's keys are in its cache: its rows fold in and go
        stats[i].update(queries_of(i), caches[i].k[:, :, :C], C - rows, layers[i].scale)

    with (
        recorded_inputs(layers if rows else [], rows) as seen,
        after_each(layers if streamed else [], fold),
    ):
        logits = model(input_ids[:, :C], cache=cache, logits_to_keep=1)
    for i, (att, layer) in enumerate(zip(layers, caches)):
        if streamed:
            given = {"statistic": stats[i]}
        else:
            given = {"queries": queries_of(i) if rows else None}
        kept = press_.apply(
            layer.k[:, :, :C], layer.v[:, :, :C], layer=i, n_layers=len(layers),
            rope=att.rope, positions=positions, scale=att.scale, **given,
        )  # fmt: skip
        layer.compact(kept.keys, kept.values, kept.counts)
    if C < S:
        logits = model(input_ids[:, C:], cache=cache, logits_to_keep=1)
    return logits
