"""How ``auto`` ranks the backends that can run a case (rules measured on our machines)."""

from __future__ import annotations

_ORDER = ("sdpa", "flex", "chunked", "reference")


def rank(q, k, v, call, reasons: dict) -> tuple[str, str]:
    """Return ``(backend name, why)`` for the first capable backend in measured order."""
    for name in _ORDER:
        if reasons.get(name, "unregistered") is None:
            return name, "first capable backend"
    return "reference", "the oracle runs every case"
