"""Structured output: what a request's text must match (:class:`Guide`).

A :class:`Guide` rides on :class:`~selfattn.serving.SamplingParams` (``guide=``); the engine
masks every token that would leave the guide's language before it samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Guide"]

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Guide:
    """The language a request's output must belong to.

    ``kind`` is one of ``json_object`` (any JSON object; ``value`` None), ``json_schema``
    (``value``: the schema as JSON text), ``regex`` (``value``: the pattern), ``choice``
    (``value``: a tuple of the allowed strings) or ``grammar`` (``value``: EBNF / GBNF text).
    """

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    value: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Guide kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "json_object":
            if self.value is not None:
                raise ValueError("Guide('json_object') takes no value")
        elif self.kind == "choice":
            if (
                not isinstance(self.value, tuple)
                or not self.value
                or not all(isinstance(c, str) and c for c in self.value)
            ):
                raise ValueError(
                    f"Guide('choice') needs a tuple of non-empty strings, got {self.value!r}"
                )
        elif not isinstance(self.value, str) or not self.value:
            raise ValueError(f"Guide({self.kind!r}) needs its text as a string, got {self.value!r}")
