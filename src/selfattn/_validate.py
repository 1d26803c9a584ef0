"""Argument checks shared by layers that must not import each other (``cache`` and ``nn``).

A module here imports nothing from selfattn, so any layer may use it.
"""

from __future__ import annotations

import numbers

__all__ = ["checked_int", "int_at_least", "one_of", "positive_int", "positive_number"]


def positive_int(value, name: str, fix: str = "") -> int:
    """``value`` if it is an int >= 1 (bools rejected), else ValueError naming ``name``;
    ``fix``, when given, ends the message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        tail = f"; {fix}" if fix else ""
        raise ValueError(f"{name} must be a positive int, got {value!r}{tail}")
    return value


def int_at_least(value, name: str, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum`` (bools rejected), else ValueError naming ``name``
    (for counts where 0 is allowed, such as ``max_new_tokens``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def checked_int(value, name: str, minimum: int | None = None, fix: str = "") -> int:
    """``value`` if it is an int (else TypeError: bools and floats rejected) of at least
    ``minimum`` when given (else ValueError); ``fix``, when given, ends both messages."""
    tail = f"; {fix}" if fix else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}{tail}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}{tail}")
    return value


def positive_number(value, name: str):
    """``value`` if it is a number > 0 (NaN rejected), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def one_of(value, name: str, choices):
    """``value`` if it is one of ``choices`` (a collection of names), else ValueError listing
    them."""
    if value not in choices:
        raise ValueError(f"{name} {value!r} is not one of {sorted(choices)}")
    return value
