"""selfattn as a transformers attention implementation: ``attn_implementation="selfattn"``.

::

    import selfattn.integrations.transformers  # registers "selfattn" when transformers is installed
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="selfattn")
    model.set_attn_implementation("selfattn")  # or switch a loaded model

:func:`register` puts two functions under the name:

- in ``AttentionMaskInterface``, :func:`make_mask`. transformers asks it for each forward's mask
  (causal, sliding window or bidirectional, with the 2-D padding mask, packed sequences found from
  ``position_ids``, and the cache's offsets) and hands the answer to every attention layer. It
  answers with a :class:`PreparedMask`: a selfattn mask in the layer's own key coordinates built
  from ``causal()``, ``sliding_window(w)``, ``documents(ids)`` and ``padding(n)`` /
  ``~padding(starts)`` (right / left padding), so backends keep their tile skipping and no
  ``(B, 1, Sq, Sk)`` tensor is made. A mask function it does not know (a model's own
  ``or_mask_function``, chunked or bidirectional-window attention) becomes transformers' dense
  boolean mask instead (logged once on the ``selfattn`` logger).
- in ``AttentionInterface``, :func:`attention_forward`: each layer's call, run by
  :func:`selfattn.attention` with K/V never repeated for GQA, ``softcap`` as a score mod,
  gpt-oss's sinks (``s_aux``), dropout as the layer asks, and the weights only when
  ``output_attentions`` asks for them.

Importing this module imports transformers only when it is installed; ``import selfattn`` never
imports this module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from typing import ClassVar

import torch

from selfattn import masks, scores
from selfattn.functional import attention, attention_weights

__all__ = ["NAME", "PreparedMask", "attention_forward", "make_mask", "register"]

NAME = "selfattn"
log = logging.getLogger("selfattn")
_LOGGED: set[str] = set()

# transformers gives a name containing one of these its own dispatch checks (sdpa, flash, flex)
_RESERVED = ("sdpa", "flash", "flex_attention", "paged")


def register(name: str = NAME, *, backend: str = "auto") -> str:
    """Register selfattn with transformers under ``name`` and return the name; idempotent.

    ``backend`` pins one selfattn backend (``selfattn.backends.names()``) for every layer;
    ``"auto"`` lets each call choose. Called on import with the defaults.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            "selfattn.integrations.transformers needs transformers: pip install transformers"
        ) from e
    if not isinstance(name, str) or not name or any(r in name for r in _RESERVED):
        raise ValueError(
            f"attention implementation name {name!r} must be a non-empty string without "
            f"{', '.join(_RESERVED)} (transformers routes those names to its own kernels)"
        )
    if backend != "auto":
        from selfattn import backends

        backends.get(backend)  # a misspelt backend fails here, not in the first forward
    forward = attention_forward if backend == "auto" else _pinned(backend)
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, make_mask)
    return name


@functools.cache
def _pinned(backend: str):
    """One function per pinned backend, so that registering twice registers the same object."""
    return functools.partial(attention_forward, backend=backend)


# -- masks ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedMask:
    """The mask :func:`make_mask` hands a forward's attention layers.

    ``mask`` (a :class:`selfattn.masks.Mask`, or None for every key) sees key ``j`` of the layer's
    K/V at position ``j`` and query row ``i`` at ``q_offset + i``, as :func:`selfattn.attention`
    does. ``shape`` and ``ndim`` answer model code that inspects a mask as it would a
    ``(B, 1, Sq, Sk)`` tensor.
    """

    mask: masks.Mask | None
    q_offset: int
    batch_size: int
    q_length: int
    kv_length: int
    ndim: ClassVar[int] = 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def check(self, B: int, Sq: int, Sk: int) -> None:
        if (B, Sq, Sk) != (self.batch_size, self.q_length, self.kv_length):
            raise ValueError(
                f"the selfattn mask was made for (B, Sq, Sk) = {self.shape[:1] + self.shape[2:]} "
                f"but the layer's query/keys have (B, Sq, Sk) = ({B}, {Sq}, {Sk}); a cache layer "
                "whose get_mask_sizes() disagrees with the keys its update() returns cannot be "
                "masked correctly"
            )

    def __repr__(self) -> str:
        return f"PreparedMask({self.mask!r}, q_offset={self.q_offset}, shape={self.shape})"


def make_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> PreparedMask:
    """transformers' mask-interface call (see ``masking_utils.sdpa_mask`` for the arguments):
    query ``i`` sits at absolute position ``q_offset + i``, key ``j`` at ``kv_offset + j``, and
    ``attention_mask (B, >= kv_offset + kv_length)`` marks real tokens (True) by absolute
    position."""
    if isinstance(attention_mask, PreparedMask):  # generate() with a static cache passes it back
        return attention_mask
    from transformers import masking_utils as mu

    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    q_offset, kv_offset = int(q_offset), int(kv_offset)  # a StaticCache gives a 0-d tensor
    local = q_offset - kv_offset  # query row 0's position counted from the layer's first key
    packed_ok = q_offset == kv_offset == 0 and q_length == kv_length
    pattern = _pattern(mask_function, mu, packed_ok)
    if pattern is _UNKNOWN:
        name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
        _log_once(
            f"dense:{name}",
            "selfattn's transformers mask: no selfattn mask for transformers' mask function "
            f"{name}; attending through its dense (B, 1, Sq, Sk) boolean mask",
        )
        dense = mu.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            use_vmap=kwargs.get("use_vmap", False),
            device=kwargs.get("device", "cpu"),
        )
        return PreparedMask(masks.from_tensor(dense), local, batch_size, q_length, kv_length)
    keys = None
    if attention_mask is not None:
        padded = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        keys = _key_padding(padded[:, kv_offset : kv_offset + kv_length].bool())
    return PreparedMask(_and(pattern, keys), local, batch_size, q_length, kv_length)


class _Unknown:
    def __repr__(self) -> str:
        return "<unknown mask function>"


_UNKNOWN = _Unknown()


@functools.cache
def _codes(mu) -> dict[str, object]:
    """The code objects of the transformers mask-function factories' inner functions: a closure
    made by a factory shares its code object, so this identifies it exactly."""
    return {
        "and": mu.and_masks().__code__,
        "window": mu.sliding_window_overlay(1).__code__,
        "remap": mu.remap_positions_for_packed_sequence(None, None).__code__,
        "packed": mu.packed_sequence_mask_function(None).__code__,
    }


def _closure(fn) -> tuple[object, dict]:
    """``(code object, {free variable: value})`` of a function; ``(None, {})`` for others."""
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return None, {}
    return code, {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}


def _pattern(fn, mu, packed_ok: bool):
    """The selfattn mask equal to transformers' mask function ``fn`` on local positions, None for
    "every pair", or ``_UNKNOWN``."""
    if fn is mu.causal_mask_function:
        return masks.causal()
    if fn is mu.bidirectional_mask_function:
        return None
    codes = _codes(mu)
    code, cells = _closure(fn)
    if code is not codes["and"]:
        return _UNKNOWN
    parts = list(cells["mask_functions"])
    found = []
    # sliding_window_overlay(w) & causal: the Mistral window of w keys, the query's own included
    windows = [p for p in parts if _closure(p)[0] is codes["window"]]
    if len(windows) == 1 and mu.causal_mask_function in parts:
        parts = [p for p in parts if p is not windows[0] and p is not mu.causal_mask_function]
        found.append(masks.sliding_window(_closure(windows[0])[1]["sliding_window"]))
    # packed sequences: a per-document mask on per-document positions, & same document. Inside a
    # document positions step by 1 (that is how transformers finds them), so a relative mask on
    # them equals the same mask on the packed row's positions.
    remaps = [p for p in parts if _closure(p)[0] is codes["remap"]]
    packed = [p for p in parts if _closure(p)[0] is codes["packed"]]
    if remaps or packed:
        if not packed_ok or len(remaps) > 1 or len(packed) != 1:
            return _UNKNOWN
        if remaps:
            base = _pattern(_closure(remaps[0])[1]["mask_function"], mu, packed_ok)
            if base is _UNKNOWN or (base is not None and not base.relative):
                return _UNKNOWN
            found.append(base)
        found.append(masks.documents(_closure(packed[0])[1]["packed_sequence_mask"]))
        parts = [p for p in parts if p not in remaps and p not in packed]
    for p in parts:
        found.append(_pattern(p, mu, packed_ok))
        if found[-1] is _UNKNOWN:
            return _UNKNOWN
    return _and(*found)


def _and(*parts):
    """``a & b & ...`` over the parts that are not None (None: every pair)."""
    real = [p for p in parts if p is not None]
    return functools.reduce(lambda a, b: a & b, real) if real else None


def _key_padding(valid: torch.Tensor) -> masks.Mask | None:
    """A mask from ``valid (B, Sk)`` (True = real key): ``padding(n)`` when every row's real keys
    come first, ``~padding(starts)`` when they come last, else the (B, 1, 1, Sk) key tensor."""
    if bool(valid.all()):
        return None
    Sk = valid.shape[1]
    n = valid.sum(-1)  # (B,) real keys per row
    j = torch.arange(Sk, device=valid.device)
    if torch.equal(valid, j < n[:, None]):
        return masks.padding(n)
    if torch.equal(valid, j >= (Sk - n)[:, None]):
        return ~masks.padding(Sk - n)
    return masks.from_tensor(valid[:, None, None, :])  # (B, Sk) -> (B, 1, 1, Sk)


def _log_once(key: str, message: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(message)


# -- attention -----------------------------------------------------------------------------------


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    backend: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One attention layer's call from transformers: ``query (B, Hq, Sq, D)``, ``key
    (B, Hkv, Sk, D)``, ``value (B, Hkv, Sk, Dv)`` -> ``(out (B, Sq, Hq, Dv), weights
    (B, Hq, Sq, Sk) or None)``.

    ``attention_mask``: a :class:`PreparedMask`; or None (causal when ``is_causal`` or the
    module's ``is_causal`` says so, windowed by ``sliding_window``, bottom-right aligned as a KV
    cache needs); or a 4-D tensor, boolean (True = attend) or additive float. Keywords used:
    ``softcap``, ``s_aux`` (gpt-oss sinks: one logit per query head in every row's softmax
    denominator), ``position_bias`` (added to the scores), ``output_attentions``, ``is_causal``,
    ``sliding_window``, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (flash-attn's varlen packing, one
    packed row: each sequence attends only itself); the rest (``position_ids``, ``use_cache``,
    ...) are not needed here.
    """
    B, _, Sq, _ = query.shape
    Sk = key.shape[2]
    mask, q_offset, additive = _layer_mask(module, attention_mask, B, Sq, Sk, kwargs)
    if kwargs.get("cu_seq_lens_q") is not None:  # flash-attn's varlen packing, asked for as such
        mask = _and(mask, _varlen_documents(kwargs, B, Sq, Sk))
    score_mod = _score_mod(kwargs.get("softcap"), additive, kwargs.get("position_bias"))
    # gpt-oss's sinks join the denominator in every backend that runs them (attention(sinks=))
    call = dict(
        mask=mask, score_mod=score_mod, scale=scaling, q_offset=q_offset, sinks=kwargs.get("s_aux")
    )
    out = attention(query, key, value, dropout_p=dropout, backend=backend, **call)
    weights = None
    if _wants_weights(module, kwargs):
        # without dropout, as selfattn.attention_weights gives them
        weights = attention_weights(query, key, value, **call).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights  # (B, Hq, Sq, Dv) -> (B, Sq, Hq, Dv)


def _layer_mask(module, attention_mask, B: int, Sq: int, Sk: int, kwargs):
    """``(mask, q_offset, additive float tensor or None)`` for one layer's call."""
    if isinstance(attention_mask, PreparedMask):
        attention_mask.check(B, Sq, Sk)
        return attention_mask.mask, attention_mask.q_offset, None
    if attention_mask is None:
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        if not causal:
            return None, None, None
        window = kwargs.get("sliding_window")
        return (masks.sliding_window(window) if window else masks.causal()), None, None
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dtype == torch.bool:
            return masks.from_tensor(attention_mask), None, None
        return None, None, attention_mask
    raise TypeError(
        f"attn_implementation='selfattn' got an attention_mask of type "
        f"{type(attention_mask).__name__}; it takes the mask transformers builds for it, None, "
        "or a 4-D (B, 1, Sq, Sk) tensor (bool, True = attend, or additive float)"
    )


def _varlen_documents(kwargs, B: int, Sq: int, Sk: int) -> masks.Mask:
    """``documents(ids)`` from flash-attn's ``cu_seq_lens_q`` (= ``cu_seq_lens_k``): one packed
    row ``(1, total)`` whose sequence ``i`` spans positions ``cu[i] .. cu[i + 1] - 1``."""
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k")
    same = cu_k is None or (cu_k.shape == cu_q.shape and bool((cu_k == cu_q).all()))
    total = int(cu_q[-1]) if cu_q.numel() else -1
    if B != 1 or Sq != Sk or total != Sk or not same:
        raise ValueError(
            f"cu_seq_lens_q {cu_q.tolist()} / cu_seq_lens_k "
            f"{None if cu_k is None else cu_k.tolist()} with (B, Sq, Sk) = ({B}, {Sq}, {Sk}): "
            "selfattn reads them as one packed row (B = 1) of self-attention whose sequences "
            "end at cu_seq_lens_q[-1] = Sq = Sk; pass position_ids restarting at 0 instead"
        )
    pos = torch.arange(Sk, device=cu_q.device)
    return masks.documents(torch.searchsorted(cu_q[1:], pos, right=True))  # (Sk,) sequence ids


def _score_mod(softcap, additive, position_bias):
    """Softcap first, then the additive terms, as transformers' eager attention orders them."""
    mods = []
    if softcap is not None:
        mods.append(scores.softcap(softcap))
    mods += [scores.bias(t) for t in (additive, position_bias) if t is not None]
    return functools.reduce(lambda a, b: a >> b, mods) if mods else None


def _wants_weights(module, kwargs) -> bool:
    want = kwargs.get("output_attentions")
    if want is None:
        want = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(want)


if importlib.util.find_spec("transformers") is not None:
    register()
