"""``press(name, ratio, **knobs)``: a policy by kvpress's name, lower-case without "Press".

``adakv_<scorer>`` wraps any scorer in :class:`AdaKV` (``alpha_safeguard`` goes to AdaKV, the
other knobs to the scorer). ``kivi2`` / ``kivi4`` name quantised pages rather than eviction: they
map to a :class:`Quantized` marker that the cache reads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from selfattn.cache.compress.base import Press, check_count
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

__all__ = ["POLICIES", "QUANTIZED", "Quantized", "names", "press"]

POLICIES: dict[str, type[Press]] = {
    cls.name: cls
    for cls in (StreamingLLM, SnapKV, PyramidKV, KNorm, TOVA, ObservedAttention, ExpectedAttention)
}
QUANTIZED = {"kivi2": 2, "kivi4": 4}
_ADAKV = "adakv_"


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
