"""``press(name, ratio, **knobs)``: a policy by kvpress's name, lower-case without "Press".

``adakv_<scorer>`` wraps any scorer in :class:`AdaKV` (``alpha_safeguard`` goes to AdaKV, the
other knobs to the scorer). ``kivi2`` / ``kivi4`` name quantised pages rather than eviction: they
map to a :class:`Quantized` marker that the cache reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from selfattn.cache.compress.base import Press, check_count
from selfattn.cache.compress.decode import DECODE_POLICIES
from selfattn.cache.compress.policies import (
    TOVA,
    AdaKV,
    ExpectedAttention,
    KNorm,
    ObservedAttention,
    PyramidKV,
    SnapKV,
    StreamingLLM,
)

__all__ = [
    "DECODE_INTERVAL",
    "DEFAULT_RATIO",
    "INT_KEYS",
    "POLICIES",
    "QUANTIZED",
    "KVCompression",
    "Quantized",
    "compression",
    "names",
    "press",
]

POLICIES: dict[str, type[Press]] = {
    cls.name: cls
    for cls in (StreamingLLM, SnapKV, PyramidKV, KNorm, TOVA, ObservedAttention, ExpectedAttention)
}
QUANTIZED = {"kivi2": 2, "kivi4": 4}
_ADAKV = "adakv_"
# the ratio of a policy named without one ("snapkv"): half the prompt's KV removed
DEFAULT_RATIO = 0.5
# decode-time eviction's default: tokens generated between two cuts back to decode_budget
# (kvpress's DecodingPress compression_interval)
DECODE_INTERVAL = 64
# the integer knobs a string spec takes after its policy: "tova:0,decode_budget=256"
INT_KEYS = ("budget", "decode_budget", "decode_interval")


@dataclass(frozen=True)
class Quantized:
    """KIVI's quantised pages (Liu et al., 2024, arXiv:2402.02750): keys per channel and values
    per token at ``bits`` bits in groups of ``group_size``, the last ``window`` tokens kept in
    full precision (the paper's residual). A marker: the cache does the quantising."""

    bits: int = 2
    window: int = 128
    group_size: int = 32

    def __post_init__(self):
        if self.bits not in QUANTIZED.values():
            choices = sorted(QUANTIZED.values())
            raise ValueError(f"kivi bits must be one of {choices}, got {self.bits!r}")
        check_count(self.window, "kivi window", 0)
        check_count(self.group_size, "kivi group_size", 1)

    @property
    def name(self) -> str:
        return f"kivi{self.bits}"


def names() -> list[str]:
    """Every accepted policy name (``adakv_`` over each scorer included)."""
    scorers = sorted(POLICIES)
    return scorers + [_ADAKV + n for n in scorers] + sorted(QUANTIZED)


def _knobs(cls: type, knobs: dict, name: str, taken: tuple[str, ...] = ()) -> dict:
    valid = sorted(f.name for f in fields(cls) if f.name not in ("compression_ratio", "scorer"))
    valid = [v for v in valid if v not in taken]
    unknown = sorted(set(knobs) - set(valid))
    if unknown:
        raise ValueError(f"{name} has no knob {', '.join(map(repr, unknown))}; its knobs: {valid}")
    return knobs


def press(name: str, ratio: float = 0.0, **knobs) -> Press | Quantized:
    """The policy ``name`` removing the fraction ``ratio`` of each layer's prompt KV, with its
    own ``knobs`` (kvpress's defaults otherwise). ValueError for an unknown name or knob, a
    ratio outside [0, 1) or a knob out of range, naming the value and the choices."""
    if not isinstance(name, str) or name not in names():
        raise ValueError(f"unknown KV-compression policy {name!r}; choose one of {names()}")
    if name in QUANTIZED:
        if ratio != 0:
            raise ValueError(
                f"{name} quantises pages instead of evicting tokens: ratio must be 0, got {ratio!r}"
            )
        return Quantized(bits=QUANTIZED[name], **_knobs(Quantized, knobs, name, ("bits",)))
    if name.startswith(_ADAKV):
        inner = name[len(_ADAKV) :]
        own = {k: knobs.pop(k) for k in ("alpha_safeguard",) if k in knobs}
        scorer = press(inner, ratio, **_knobs(POLICIES[inner], knobs, name))
        return AdaKV(ratio, scorer.window, scorer=scorer, **own)
    return POLICIES[name](ratio, **_knobs(POLICIES[name], knobs, name))


@dataclass(frozen=True)
class KVCompression:
    """One request's KV compression: its ``press`` and optionally ``budget``, the most prompt
    tokens kept per head (kept = ``min(press's budget, budget)``). Built by :func:`compression`
    from what users write.

    ``decode_budget``: tokens kept per KV head during generation, for presses that evict while
    decoding (``observed_attention``, ``tova``, ``streaming_llm``: :class:`DecodeScores`): once
    a sequence caches ``decode_budget + decode_interval`` tokens it is cut back to
    ``decode_budget``; None: the prompt alone is compressed."""

    press: Press
    budget: int | None = None
    decode_budget: int | None = None
    decode_interval: int = DECODE_INTERVAL

    def __post_init__(self):
        if self.decode_budget is not None:
            self._check_decoding()
        if self.budget is not None:
            check_count(self.budget, "kv_compression budget", 1)
            need = self.press.sinks + self.press.window
            if self.budget < need:
                raise ValueError(
                    f"kv_compression budget {self.budget} is below the {need} tokens "
                    f"{self.press.name} always keeps (sinks {self.press.sinks} + window "
                    f"{self.press.window}); raise the budget or lower the window"
                )

    def _check_decoding(self) -> None:
        p = self.press
        if not p.decodes:
            raise ValueError(
                f"kv_compression decode_budget: {p.name!r} scores the prompt only; decode-time "
                f"eviction supports {list(DECODE_POLICIES)}"
            )
        check_count(self.decode_budget, "kv_compression decode_budget", 1)
        check_count(self.decode_interval, "kv_compression decode_interval", 1)
        if self.decode_budget < p.sinks + p.window:
            raise ValueError(
                f"kv_compression decode_budget {self.decode_budget} is below the "
                f"{p.sinks + p.window} tokens {p.name} always keeps (sinks {p.sinks} + window "
                f"{p.window}); raise decode_budget or lower the window"
            )

    @property
    def name(self) -> str:
        return self.press.name

    @property
    def prompt(self) -> bool:
        """Whether the prompt is compressed (a ratio or a budget), not only the generation."""
        return self.press.compression_ratio > 0 or self.budget is not None

    def kept(self, seq_len: int) -> int | None:
        """Tokens per head a ``seq_len``-token prompt keeps, or None where it stays whole:
        nothing would be removed, or the prompt is no longer than the tokens the policy always
        keeps (its budget could not hold them)."""
        p = self.press
        n = seq_len if p.compression_ratio == 0 else p.layer_budget(seq_len, 0, 1)
        if self.budget is not None:
            n = min(n, self.budget)
        if n >= seq_len or n < max(1, p.protected(seq_len)) or seq_len <= p.protected(seq_len):
            return None
        return n

    def __str__(self) -> str:
        cap = "" if self.budget is None else f", budget {self.budget}"
        if self.decode_budget is not None:
            cap += f", decode_budget {self.decode_budget} every {self.decode_interval}"
        return f"{self.name}:{self.press.compression_ratio:g}{cap}"


def _ratio(value, where: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"{where} ratio must be a number in [0, 1) (the fraction of the prompt's KV "
            f"removed), got {value!r}"
        )
    return float(value)


def compression(spec) -> KVCompression | None:
    """A request's KV compression from ``spec``: None; a :class:`Press`; a
    :class:`KVCompression`; ``"POLICY"`` or ``"POLICY:RATIO"`` (``"snapkv:0.5"``); or a dict
    ``{"policy": "snapkv", "ratio": 0.5, "window": 32, "budget": 1024, ...}`` (other keys are
    the policy's knobs). A policy without a ratio removes :data:`DEFAULT_RATIO` of the prompt
    (with a ``budget``: what the budget leaves out). None where nothing would be removed
    (ratio 0, no budget): an exact no-op. ValueError naming the offending value otherwise;
    ``kivi2``/``kivi4`` (pages, not eviction) are refused here."""
    if spec is None or isinstance(spec, KVCompression):
        found = spec
    elif isinstance(spec, Press):
        found = KVCompression(spec)
    elif isinstance(spec, str):  # "POLICY[:RATIO][,KEY=INT...]"
        head, *extra = spec.split(",")
        name, _, ratio = head.partition(":")
        knobs = _int_knobs(extra, spec)
        found = _build(name, _ratio(ratio, f"kv_compression {spec!r}") if ratio else None, knobs)
    elif isinstance(spec, dict):
        knobs = dict(spec)
        name = knobs.pop("policy", None)
        if name is None:
            raise ValueError(
                f"kv_compression {spec!r} names no policy; give {{'policy': NAME, 'ratio': R}} "
                f"with NAME one of {names()}"
            )
        ratio = knobs.pop("ratio", None)
        found = _build(name, None if ratio is None else _ratio(ratio, "kv_compression"), knobs)
    else:
        raise TypeError(
            "kv_compression must be 'POLICY:RATIO', a dict {'policy', 'ratio', 'window', "
            f"'budget'}} or a press, got {type(spec).__name__}"
        )
    if found is None or (not found.prompt and found.decode_budget is None):
        return None
    return found


def _int_knobs(extra: list[str], spec: str) -> dict:
    """``["decode_budget=256", ...]`` of a string spec as ``{name: int}``."""
    knobs = {}
    for item in extra:
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in INT_KEYS or not value.strip().lstrip("-").isdigit():
            raise ValueError(
                f"kv_compression {spec!r}: {item!r} must be KEY=INT with KEY one of "
                f"{list(INT_KEYS)} (e.g. 'tova:0,decode_budget=256')"
            )
        knobs[key.strip()] = int(value)
    return knobs


def _build(name: str, ratio: float | None, knobs: dict) -> KVCompression:
    budget = knobs.pop("budget", None)
    decoding = {k: knobs.pop(k) for k in ("decode_budget", "decode_interval") if k in knobs}
    for key, value in decoding.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"kv_compression {key} must be an int >= 1, got {value!r}")
    if ratio is None:  # a policy named alone removes DEFAULT_RATIO; with a budget, the budget;
        # with a decode_budget alone, nothing of the prompt (decode-time eviction only)
        alone = budget is None and "decode_budget" not in decoding and name not in QUANTIZED
        ratio = DEFAULT_RATIO if alone else 0.0
    made = press(name, ratio, **knobs)
    if isinstance(made, Quantized):
        raise ValueError(
            f"kv_compression={name!r} quantises the cache's pages instead of evicting tokens; "
            f"it is the pool's dtype, not a per-request policy: serve with --kv-dtype {name} "
            f"(EngineConfig(kv_dtype={name!r})), build make_cache('kivi', bits=...), or use "
            "an eviction policy such as 'snapkv:0.5'"
        )
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise ValueError(f"kv_compression budget must be an int >= 1, got {budget!r}")
    return KVCompression(made, budget, **decoding)
