"""Named hook points on every selfattn model: capture activations into a cache, edit them.

The names follow TransformerLens where the idea is the same, so that recipes carry over::

    hook_embed                        token embedding output           (B, S, d)
    blocks.{i}.hook_resid_pre         block input (the residual stream) (B, S, d)
    blocks.{i}.attn.hook_q            queries after norms and RoPE      (B, Hq, S, D)
    blocks.{i}.attn.hook_k, hook_v    this call's keys / values         (B, Hkv, S, D)
    blocks.{i}.attn.hook_attn_scores  scores·scale + score mod, -inf where masked (B, Hq, Sq, Sk)
    blocks.{i}.attn.hook_pattern      attention weights                 (B, Hq, Sq, Sk)
    blocks.{i}.attn.hook_z            each head's output before out_proj (B, Hq, S, Dv)
    blocks.{i}.hook_attn_out          what attention adds to the stream (B, S, d)
    blocks.{i}.hook_mixer_out         a recurrent mixer's output (hybrids)
    blocks.{i}.hook_cross_out         cross-attention's output (encoder-decoders), with
                                      blocks.{i}.cross_attn.hook_* inside it
    blocks.{i}.hook_resid_mid         the stream between attention and MLP
    blocks.{i}.hook_mlp_out           what the MLP adds to the stream
    blocks.{i}.hook_resid_post        block output
    ln_final.hook_out                 the final norm's output (decoders)

Per-head tensors keep selfattn's ``(B, H, S, ·)`` layout (TransformerLens: ``(B, S, H, ·)``).
A block is named by its path with ``layers.{i}`` read as ``blocks.{i}`` (``blocks.3``;
``encoder.0`` / ``decoder.0`` in encoder-decoders); :func:`hook_points` lists a model's names.

>>> with hooks(model, capture=["blocks.*.hook_resid_post", "blocks.2.attn.hook_pattern"]) as cache:
...     logits = model(ids)                                               # doctest: +SKIP
>>> cache["blocks.2.attn.hook_pattern"].shape                             # doctest: +SKIP
>>> with hooks(model, edit={"blocks.2.attn.hook_z": zero_ablation(heads=[4])}):
...     ablated = model(ids)                                              # doctest: +SKIP

The layer's attention call runs as it would without hooks (whatever backend it picks): what is
captured is what the forward computes, bit for bit. The scores are recomputed from the very q,
k, mask and score mod of the call (quadratic, as a pattern is), in fp32 for half inputs, and the
pattern is ``exp(scores - lse)`` with their lse (a learned sink keeps its term). Torch
module hooks and the layers' ``hooks`` attribute are set on entry and removed on exit: outside
the block nothing is left behind (the lean decode step and fast path run again).
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from selfattn._validate import positive_int
from selfattn.cache.size import format_bytes
from selfattn.functional import attention_weights
from selfattn.inspect.capture import DEFAULT_MAX_BYTES
from selfattn.nn import MultiHeadAttention

__all__ = [
    "ActivationCache",
    "HookPoint",
    "RequestHooks",
    "hook_points",
    "hooks",
    "mean_ablation",
    "patch",
    "resample_ablation",
    "steer",
    "zero_ablation",
]

Edit = Callable[[torch.Tensor, "HookPoint"], "torch.Tensor | None"]

# the points inside an attention layer: (name, head dim, position dim)
_ATTN = {
    "hook_q": (1, 2),
    "hook_k": (1, 2),
    "hook_v": (1, 2),
    "hook_attn_scores": (1, 2),
    "hook_pattern": (1, 2),
    "hook_z": (1, 2),
}


@dataclass(frozen=True)
class HookPoint:
    """One named point: ``module`` and how its tensor is reached (``kind``: ``"input"``, the
    module's first argument; ``"output"``, its output; ``"attn"``, inside a
    :class:`~selfattn.nn.MultiHeadAttention`, ``part`` naming which), and the tensor's
    ``head_dim`` (None for the residual stream's ``(B, S, d)``) and ``pos_dim`` (the sequence
    axis; the query axis of a pattern)."""

    name: str
    module: nn.Module
    kind: str
    part: str = ""
    head_dim: int | None = None
    pos_dim: int = 1


def _block_prefix(path: str) -> str:
    return re.sub(r"(^|\.)layers\.(\d+)$", r"\1blocks.\2", path)


def _attention_points(prefix: str, module: nn.Module) -> list[HookPoint]:
    inner = next((m for m in module.modules() if isinstance(m, MultiHeadAttention)), None)
    if inner is None:  # latent attention (MLA): its output only
        return []
    return [
        HookPoint(f"{prefix}.{part}", inner, "attn", part, h, p) for part, (h, p) in _ATTN.items()
    ]


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of ``model`` by name, in forward order (module docstring)."""
    points: list[HookPoint] = []
    if isinstance(getattr(model, "embed", None), nn.Embedding):
        points.append(HookPoint("hook_embed", model.embed, "output"))
    for path, m in model.named_modules():
        if not (hasattr(m, "mlp_res") and (hasattr(m, "self_res") or hasattr(m, "attn_res"))):
            continue  # not a block (DecoderBlock, EncoderBlock, a hybrid's MixerBlock)
        b = _block_prefix(path)
        points.append(HookPoint(f"{b}.hook_resid_pre", m, "input"))
        mixer = getattr(m, "mixer", None)
        if mixer is not None:
            points.append(HookPoint(f"{b}.hook_mixer_out", mixer, "output"))
        else:
            att = m.self_attention if hasattr(m, "self_attention") else m.attention
            points += _attention_points(f"{b}.attn", att)
            points.append(HookPoint(f"{b}.hook_attn_out", att, "output"))
        cross = getattr(m, "cross_attention", None)
        if cross is not None:
            points += _attention_points(f"{b}.cross_attn", cross)
            points.append(HookPoint(f"{b}.hook_cross_out", cross, "output"))
        if m.mlp_res is not None:
            points.append(HookPoint(f"{b}.hook_resid_mid", m.mlp_res, "input"))
            points.append(HookPoint(f"{b}.hook_mlp_out", m.mlp, "output"))
        points.append(HookPoint(f"{b}.hook_resid_post", m, "output"))
    norm = getattr(model, "norm", None)
    if isinstance(norm, nn.Module) and hasattr(model, "lm_head"):
        points.append(HookPoint("ln_final.hook_out", norm, "output"))
    if not points:
        raise ValueError(
            f"{type(model).__name__} has no hook points: selfattn.inspect.hooks works on models "
            "built from selfattn.nn blocks (the selfattn.models families)"
        )
    return {p.name: p for p in points}


def _matching(patterns, points: Mapping[str, HookPoint], what: str) -> list[str]:
    """Names of ``points`` matched by ``patterns`` (names or fnmatch patterns: ``blocks.*.hook_z``);
    a pattern matching none is an error naming the model's points."""
    found: list[str] = []
    for pat in [patterns] if isinstance(patterns, str) else list(patterns):
        if not isinstance(pat, str):
            raise TypeError(f"{what} takes hook point names or patterns, got {pat!r}")
        hit = [n for n in points if fnmatch.fnmatchcase(n, pat)]
        if not hit:
            some = ", ".join(list(points)[:8])
            raise ValueError(
                f"{what}: no hook point matches {pat!r}; this model has {len(points)} "
                f"(hook_points(model) lists them): {some}, ..."
            )
        found += [n for n in hit if n not in found]
    return found


class ActivationCache(Mapping):
    """What :func:`hooks` captured: ``cache[name]`` is the last call's tensor at ``name``;
    ``cache.calls[name]`` every call's (a decoder stepping through ``generate`` calls the model
    once per step); :meth:`stacked` joins the calls along the sequence axis."""

    def __init__(self, points: dict[str, HookPoint], names: list[str], positions, max_bytes):
        self.points, self.positions, self.max_bytes = points, positions, max_bytes
        self.calls: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.nbytes = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.calls:
            raise KeyError(f"{name!r} was not captured; captured: {sorted(self.calls)}")
        if not self.calls[name]:
            raise KeyError(f"{name!r} recorded nothing: was the model called inside `with`?")
        return self.calls[name][-1]

    def __iter__(self) -> Iterator[str]:
        return (n for n, c in self.calls.items() if c)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def stacked(self, name: str) -> torch.Tensor:
        """Every call's tensor at ``name`` joined along the sequence axis (prompt then each
        generated token); points whose key axis grows (patterns, scores) cannot be joined."""
        parts = self.calls.get(name) or [self[name]]
        if len(parts) > 1 and name.endswith(("hook_pattern", "hook_attn_scores")):
            raise ValueError(f"{name}: each call has its own key length; read cache.calls[name]")
        return torch.cat(parts, dim=self.points[name].pos_dim)

    def _record(self, name: str, value: torch.Tensor) -> None:
        if self.positions is not None:
            p = self.points[name].pos_dim
            index = self.positions
            if isinstance(index, slice):
                value = value[(slice(None),) * p + (index,)]
            else:
                value = value.index_select(p, torch.as_tensor(index, device=value.device))
        size = value.numel() * value.element_size()
        if self.nbytes + size > self.max_bytes:
            raise ValueError(
                f"capturing {name} {tuple(value.shape)} would bring the cache to "
                f"{format_bytes(self.nbytes + size)}, above max_bytes="
                f"{format_bytes(self.max_bytes)}: capture fewer points (patterns are B·H·Sq·Sk), "
                "pass positions=, or raise max_bytes"
            )
        self.nbytes += size
        self.calls[name].append(value.detach().clone())


class _Point:
    """One point's work at a call: apply the edits in order, then record; with ``rows`` (a
    slice of the position axis: one request's tokens of a packed step) on those rows only."""

    def __init__(self, point: HookPoint, cache: ActivationCache | None, edits: list[Edit],
                 rows: slice | None = None):  # fmt: skip
        self.point, self.cache, self.edits, self.rows = point, cache, edits, rows

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return self._apply(value)
        index = (slice(None),) * self.point.pos_dim + (self.rows,)
        part = value[index]
        new = self._apply(part)
        if new is part:
            return value
        value = value.clone()
        value[index] = new
        return value

    def _apply(self, value: torch.Tensor) -> torch.Tensor:
        for fn in self.edits:
            new = fn(value, self.point)
            if new is None:
                continue
            if not isinstance(new, torch.Tensor) or new.shape != value.shape:
                got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                raise ValueError(
                    f"the edit of {self.point.name} returned {got}; it must return a tensor of "
                    f"the input's shape {tuple(value.shape)} (or None to leave it)"
                )
            value = new.to(value.dtype)
        if self.cache is not None and self.point.name in self.cache.calls:
            self.cache._record(self.point.name, value)
        return value

    @property
    def edits_anything(self) -> bool:
        return bool(self.edits)


class LayerHooks:
    """The points inside one :class:`~selfattn.nn.MultiHeadAttention`: its ``hooks`` attribute
    while a :func:`hooks` block runs (the layer's forward calls these methods)."""

    def __init__(self, points: dict[str, _Point], inner: LayerHooks | None):
        self.at = points  # part ("hook_q", ...) -> _Point
        self.inner = inner  # an enclosing hooks block's hooks on the same layer
        self.wants_pattern = any(p in points for p in ("hook_attn_scores", "hook_pattern")) or (
            inner is not None and inner.wants_pattern
        )

    def _run(self, part: str, value: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            value = self.inner._run(part, value)
        point = self.at.get(part)
        return value if point is None else point(value)

    def qkv(self, q, k, v):
        return self._run("hook_q", q), self._run("hook_k", k), self._run("hook_v", v)

    def z(self, out: torch.Tensor) -> torch.Tensor:
        return self._run("hook_z", out)

    def _edited(self, parts) -> bool:
        h = self
        while h is not None:
            if any(h.at[p].edits_anything for p in parts if p in h.at):
                return True
            h = h.inner
        return False

    def weights(self, w: torch.Tensor) -> None:
        """The weights of a cache that attends itself (paged pages): recorded; not editable
        (the values it weighs stay in its pages)."""
        if self._edited(("hook_attn_scores", "hook_pattern")):
            raise ValueError(
                "editing hook_attn_scores / hook_pattern needs the values the layer attends: a "
                "paged cache keeps them in its pages; run with a static cache (generate's "
                "default) or edit hook_z"
            )
        self._run("hook_pattern", w)

    def pattern(self, q, k, v, out, *, mask, score_mod, scale, q_offset, sinks):
        """The scores and pattern of an attention call whose backend gave ``out``: recorded
        and edited; an edit recomputes ``out`` from the edited weights."""
        with torch.no_grad():
            s = attention_weights(
                q, k, v, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset,
                scores=True,
            )  # fmt: skip
        scores = self._run("hook_attn_scores", s)
        lse = _logsumexp(scores, sinks)  # a learned sink keeps its term (no value)
        w = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # -inf rows (no key) give 0
        pattern = self._run("hook_pattern", w)
        if scores is s and pattern is w:
            return out
        B, Hq, Sq, Sk = pattern.shape
        Hkv = v.shape[1]
        p = pattern.to(v.dtype).reshape(B, Hkv, Hq // Hkv * Sq, Sk)  # query heads by kv head
        return (p @ v).reshape(B, Hq, Sq, v.shape[-1]).to(out.dtype)


def _logsumexp(scores: torch.Tensor, sinks) -> torch.Tensor:
    if sinks is None:
        return torch.logsumexp(scores, dim=-1)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.logsumexp(torch.cat((scores, sink), dim=-1), dim=-1)


@contextlib.contextmanager
def hooks(
    model: nn.Module,
    capture=None,
    edit: Mapping[str, Edit] | None = None,
    *,
    positions=None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    rows: slice | None = None,
    cache: ActivationCache | None = None,
) -> Iterator[ActivationCache]:
    """Capture and edit ``model``'s activations at named points while the block runs.

    Args:
        capture: hook point names or fnmatch patterns (``"blocks.*.hook_resid_post"``, ``"*"``
            for all) to record into the yielded :class:`ActivationCache`.
        edit: ``{name or pattern: fn}``; ``fn(value, point)`` returns the new tensor (same
            shape) or None to leave it. Edits run before capture: a point both edited and
            captured records the edited value. :func:`zero_ablation`, :func:`mean_ablation`,
            :func:`resample_ablation`, :func:`patch` and :func:`steer` make common ones.
        positions: record only these positions of the sequence axis (a slice or indices of
            each call's tokens; the query axis of patterns); edits see every position.
        max_bytes: refuse (ValueError) when the captured tensors would exceed this.
        rows: capture and edit only this slice of the sequence axis (one sequence's tokens of
            a packed step, as the Engine runs :class:`RequestHooks`).
        cache: record into this :class:`ActivationCache` (from an earlier block with the same
            ``capture``), not a new one.

    Blocks nest: an inner block's edits run after the outer's at the same point.
    """
    points = hook_points(model)
    positive_int(max_bytes, "max_bytes")
    names = _matching(capture, points, "capture") if capture is not None else []
    edits: dict[str, list[Edit]] = {}
    for pat, fn in (edit or {}).items():
        if not callable(fn):
            raise TypeError(f"edit[{pat!r}] must be callable as fn(value, point), got {fn!r}")
        for n in _matching(pat, points, "edit"):
            edits.setdefault(n, []).append(fn)
    if cache is None:
        cache = ActivationCache(points, names, positions, max_bytes)
    used = [n for n in points if n in edits or n in names]
    handles, layers = [], {}
    try:
        for n in used:
            pt = points[n]
            work = _Point(pt, cache, edits.get(n, []), rows)
            if pt.kind == "attn":
                layers.setdefault(pt.module, {})[pt.part] = work
            elif pt.kind == "input":
                handles.append(pt.module.register_forward_pre_hook(_input_hook(work)))
            else:
                handles.append(pt.module.register_forward_hook(_output_hook(work)))
        saved = {m: m.hooks for m in layers}
        for m, parts in layers.items():
            m.hooks = LayerHooks(parts, saved[m])
        yield cache
    finally:
        for h in handles:
            h.remove()
        for m in layers:
            m.hooks = saved.get(m)


def _input_hook(work: _Point):
    def hook(module, args):
        return (work(args[0]), *args[1:])

    return hook


def _output_hook(work: _Point):
    def hook(module, args, output):
        if isinstance(output, tuple):  # (out, weights)
            return (work(output[0]), *output[1:])
        return work(output)

    return hook


@dataclass
class RequestHooks:
    """What one :class:`~selfattn.serving.Engine` request captures and edits (``capture`` and
    ``edit`` as :func:`hooks` takes them): ``Engine.add_request(..., hooks=RequestHooks(...))``.

    The engine applies them to the request's own rows of each packed step, so its neighbours in
    a batch are untouched; ``cache`` then holds, call by call, the prompt's chunks and each
    generated token (``cache.stacked(name)``: the whole sequence). The request computes its
    prompt itself (no prefix-cache hit), and a request that edits offers no pages to the prefix
    cache. A packed step computes no attention weights: patterns and scores are refused here
    (``generate`` captures them).
    """

    capture: object = None
    edit: Mapping[str, Edit] | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    cache: ActivationCache | None = field(default=None, init=False)

    def bind(self, model: nn.Module) -> RequestHooks:
        """Check the names against ``model`` and start an empty cache; returns ``self``."""
        points = hook_points(model)
        names = _matching(self.capture, points, "capture") if self.capture is not None else []
        edited = [n for pat in (self.edit or {}) for n in _matching(pat, points, "edit")]
        weights = [n for n in names + edited if n.endswith(("hook_pattern", "hook_attn_scores"))]
        if weights:
            raise ValueError(
                f"{weights[0]}: an Engine step attends over pages in place and computes no "
                "attention weights; capture patterns with selfattn.models.generate, or hook "
                "hook_q / hook_k / hook_z here"
            )
        self.cache = ActivationCache(points, names, None, positive_int(self.max_bytes, "max_bytes"))
        return self

    @property
    def edits(self) -> bool:
        return bool(self.edit)

    def on_rows(self, model: nn.Module, rows: slice, *, restart: bool):
        """:func:`hooks` for one step over ``rows`` of the packed tokens, into :attr:`cache`
        (emptied first with ``restart``: a preempted request computes its prompt again)."""
        if restart:
            for calls in self.cache.calls.values():
                calls.clear()
            self.cache.nbytes = 0
        return hooks(model, self.capture, self.edit, max_bytes=self.max_bytes, rows=rows,
                     cache=self.cache)  # fmt: skip


# -- edits ----------------------------------------------------------------------------------------


def _where(point: HookPoint, value: torch.Tensor, heads, positions) -> tuple:
    """The index of ``value`` that ``heads`` and ``positions`` select at ``point``."""
    index = [slice(None)] * value.dim()
    if heads is not None:
        if point.head_dim is None:
            raise ValueError(
                f"{point.name} has no head axis (it is the residual stream, (B, S, d)); select "
                "heads at a per-head point such as blocks.{i}.attn.hook_z"
            )
        n = value.shape[point.head_dim]
        heads = [heads] if isinstance(heads, int) else list(heads)
        bad = [h for h in heads if not -n <= h < n]
        if bad:
            raise ValueError(f"heads {bad} out of range at {point.name}: it has {n} heads")
        index[point.head_dim] = torch.tensor(heads, dtype=torch.long)
    if positions is not None:
        if not isinstance(positions, slice):
            positions = torch.as_tensor(positions, dtype=torch.long)
        index[point.pos_dim] = positions
    if sum(isinstance(i, torch.Tensor) for i in index) > 1:  # two index lists: select in turn
        h, p = index[point.head_dim], index[point.pos_dim]
        index[point.head_dim] = h.view(-1, 1)
        index[point.pos_dim] = p.view(1, -1)
    return tuple(index)


def _replace(value, point, heads, positions, source: torch.Tensor) -> torch.Tensor:
    where = _where(point, value, heads, positions)
    out = value.clone()
    out[where] = source.to(value.dtype)[where] if source.shape == value.shape else source
    return out


def zero_ablation(heads=None, positions=None) -> Edit:
    """An edit setting the point (its ``heads`` and ``positions`` only, when given) to 0."""

    def edit(value, point):
        return _replace(value, point, heads, positions, torch.zeros_like(value))

    return edit


def _source(source, point: HookPoint) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        return source
    if point.name not in source:
        raise ValueError(
            f"the source cache has no {point.name}: capture it in the source run "
            f"(hooks(model, capture=[{point.name!r}]))"
        )
    return source[point.name]


def mean_ablation(source, heads=None, positions=None, *, over_positions: bool = False) -> Edit:
    """An edit replacing the point by its mean over the batch of ``source`` (an
    :class:`ActivationCache` of a reference run, or a tensor), per position; with
    ``over_positions`` also over the sequence axis."""

    def edit(value, point):
        ref = _source(source, point)
        mean = ref.to(torch.promote_types(ref.dtype, torch.float32)).mean(0, keepdim=True)
        if over_positions:
            mean = mean.mean(point.pos_dim, keepdim=True)
        _check_broadcast(mean, value, point)
        return _replace(value, point, heads, positions, mean.expand_as(value).to(value.dtype))

    return edit


def resample_ablation(source, heads=None, positions=None, *, seed: int = 0) -> Edit:
    """An edit replacing the point by ``source``'s value of another batch item (a random
    item per row, drawn with ``seed``): the ablation that keeps the point's distribution."""

    def edit(value, point):
        ref = _source(source, point)
        _check_broadcast(ref[:1], value, point)
        g = torch.Generator().manual_seed(seed)
        pick = torch.randint(ref.shape[0], (value.shape[0],), generator=g)
        return _replace(value, point, heads, positions, ref[pick.to(ref.device)].to(value.dtype))

    return edit


def patch(source, heads=None, positions=None) -> Edit:
    """An edit copying ``source``'s value (a cache of another run of the same shapes, or a
    tensor) into the point, at ``heads`` and ``positions`` when given: activation patching."""

    def edit(value, point):
        ref = _source(source, point)
        if ref.shape != value.shape:
            raise ValueError(
                f"cannot patch {point.name}: the source holds {tuple(ref.shape)}, this run "
                f"{tuple(value.shape)} (patching needs prompts of the same length)"
            )
        return _replace(value, point, heads, positions, ref)

    return edit


def steer(vector: torch.Tensor, scale: float = 1.0, positions=None) -> Edit:
    """An edit adding ``scale · vector`` (``(d,)``, or anything broadcastable to the point) to
    the point at ``positions`` (all by default): a steering vector on the residual stream."""

    def edit(value, point):
        add = torch.zeros_like(value) + scale * vector.to(value.dtype)
        if positions is not None:
            keep = torch.zeros_like(value, dtype=torch.bool)
            keep[_where(point, value, None, positions)] = True
            add = add * keep
        return value + add

    return edit


def _check_broadcast(ref: torch.Tensor, value: torch.Tensor, point: HookPoint) -> None:
    try:
        torch.broadcast_shapes(ref.shape, value.shape)
    except RuntimeError:
        raise ValueError(
            f"the source of {point.name} is {tuple(ref.shape)}, which does not fit this run's "
            f"{tuple(value.shape)}: use a source run with prompts of the same length, or "
            "over_positions=True"
        ) from None
