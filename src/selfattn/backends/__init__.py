"""Backends: one signature, a registry, and `auto` that can say why it chose.

Every backend is a function ``run(q, k, v, call) -> (out, lse)`` on already-validated inputs
``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)`` and a normalised
:class:`AttentionCall`. ``lse`` is ``None`` unless ``call.return_lse``. A backend also has a
``reject(q, k, v, call) -> str | None`` predicate: ``None`` when it can run the case, otherwise a
sentence saying why not. ``auto`` walks the registry in the measured order of ``_AUTO_RULES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfattn.masks import Mask
from selfattn.scores import ScoreMod

__all__ = [
    "AttentionCall",
    "Backend",
    "Explanation",
    "available",
    "explain",
    "get",
    "names",
    "register",
    "select",
]


@dataclass(frozen=True)
class AttentionCall:
    """Everything about one attention call except the q/k/v tensors, normalised.

    ``q_offset`` is the absolute position of query row 0 (key ``j`` sits at position ``j``).
    ``dropout_seed`` is drawn once per call (from ``generator`` or torch's default one) so that the
    forward and the recomputing backward see the same dropout pattern.
    """

    mask: Mask | None = None
    score_mod: ScoreMod | None = None
    scale: float = 1.0
    dropout_p: float = 0.0
    dropout_seed: int = 0
    q_offset: int = 0
    return_lse: bool = False
    tile_kinds_cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


RunFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionCall], tuple]
RejectFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionCall], "str | None"]


@dataclass(frozen=True)
class Backend:
    name: str
    run: RunFn
    reject: RejectFn
    doc: str = ""


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend in the registry under ``backend.name``."""
    _REGISTRY[backend.name] = backend
    return backend


def names() -> list[str]:
    _load_builtins()
    return list(_REGISTRY)


def get(name: str) -> Backend:
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose 'auto' or one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def available(q, k, v, call: AttentionCall) -> dict[str, str | None]:
    """Map every registered backend to ``None`` (can run this case) or its rejection reason."""
    _load_builtins()
    return {name: b.reject(q, k, v, call) for name, b in _REGISTRY.items()}


class BackendCompileError(RuntimeError):
    """A backend could not build a kernel for this case (e.g. a compiler found no valid
    configuration). Under ``backend="auto"`` the call falls back to the next backend, and the
    failed one declines the same case for the rest of the process."""


@dataclass
class Explanation:
    """What ``auto`` picked for a case and why every other backend was not picked."""

    chosen: str
    why: str
    reasons: dict[str, str | None]
    notes: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"auto -> {self.chosen}: {self.why}"]
        for name, reason in self.reasons.items():
            if name == self.chosen:
                continue
            note = "can run; " + self.notes.get(name, "ranked lower")
            lines.append(f"  {name:<10} {note if reason is None else reason}")
        return "\n".join(lines)


def select(q, k, v, call: AttentionCall, backend: str = "auto") -> tuple[Backend, Explanation]:
    """Resolve ``backend`` (a name or ``"auto"``) for this case; raise if it cannot run it."""
    _load_builtins()
    if backend != "auto":
        chosen = get(backend)
        reason = chosen.reject(q, k, v, call)
        if reason is not None:
            raise ValueError(
                f"backend {backend!r} cannot run this call: {reason}. "
                "Use backend='auto', or see selfattn.backends.explain(...) for the alternatives."
            )
        return chosen, Explanation(backend, "requested explicitly", {backend: None})
    from selfattn.backends._auto import rank

    reasons = available(q, k, v, call)
    name, why, notes = rank(q, k, v, call, reasons)
    return _REGISTRY[name], Explanation(name, why, reasons, notes)


def explain(q, k, v, *, print_table: bool = True, **kwargs) -> Explanation:
    """Which backend ``selfattn.attention(q, k, v, **kwargs)`` picks under "auto", and why.

    Takes exactly the arguments of :func:`selfattn.attention`. Prints the explanation (unless
    ``print_table=False``) and returns it.
    """
    from selfattn.functional import _prepare

    kwargs.pop("backend", None)
    q, k, v, call = _prepare(q, k, v, **kwargs)
    _, explanation = select(q, k, v, call, "auto")
    if print_table:
        print(explanation)
    return explanation


_LOADED = False


def _load_builtins() -> None:
    # Imported lazily so that importing selfattn never probes hardware or compiles anything.
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from selfattn.backends import chunked, flex, reference, sdpa  # noqa: F401
