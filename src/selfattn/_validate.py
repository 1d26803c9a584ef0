"""Argument checks shared by layers that must not import each other (``cache`` and ``nn``).

A module here imports nothing from selfattn, so any layer may use it.
"""

from __future__ import annotations

__all__ = ["positive_int"]


def positive_int(value, name: str) -> int:
    """``value`` if it is an int >= 1 (bools rejected), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
