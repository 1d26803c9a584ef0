"""Backends: one signature per kind, one registry, and `auto` that can say why it chose.

Two kinds of backend share the registry machinery (:class:`Registry`: register, select, explain):

- ``"dense"``: ``run(q, k, v, call) -> (out, lse)`` on already-validated inputs
  ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)`` and a normalised
  :class:`selfattn.call.AttentionCall` (what :func:`selfattn.attention` runs). ``auto`` walks
  them in the measured order of ``_auto.rank``.
- ``"paged"``: ``run(q, k_pages, v_pages, block_table, seq_lens, call) -> (out, lse)`` with a
  :class:`selfattn.backends.paged.call.PagedCall` (what ``paged_attention`` runs; see
  :mod:`selfattn.backends.paged`). ``auto`` takes the kernel for the device, else PyTorch.

``lse`` is ``None`` unless ``call.return_lse``. Every backend also has a ``reject(...)``
predicate taking the same arguments as its ``run``: ``None`` when it can run the case, otherwise
a sentence saying why not. A paged backend may have a ``plan(...)`` hook, same arguments again,
returning what it derives from the block table, lengths and mask (key intervals, page ranges):
a planned step (:class:`selfattn.backends.paged.plan.PagedAttentionPlan`) asks it once and
hands it to every layer's ``run`` as ``call.planned``. :func:`explain` (dense) and
:func:`explain_paged` take exactly the arguments of the function they explain, which is why they
are two functions and not a flag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from selfattn.call import AttentionCall, prepare

__all__ = [
    "AttentionCall",
    "Backend",
    "Explanation",
    "Registry",
    "available",
    "explain",
    "explain_paged",
    "get",
    "names",
    "register",
    "registry",
    "select",
]


# (q, k, v, call) for dense backends; (q, k_pages, v_pages, block_table, seq_lens, call) for paged.
RunFn = Callable[..., tuple]
RejectFn = Callable[..., "str | None"]


@dataclass(frozen=True)
class Backend:
    name: str
    run: RunFn
    reject: RejectFn
    doc: str = ""
    kind: str = "dense"  # "dense" or "paged": which registry, and which arguments run takes
    plan: RunFn | None = None  # paged: the per-step part of run, shared by a step's layers


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


class Registry:
    """The backends of one kind, by name, and how ``auto`` chooses among them.

    ``load`` imports the built-in backends (each registers itself) on first use, so importing
    selfattn never probes hardware or compiles anything; ``rank(*args, reasons)`` returns
    ``(name, why, notes)`` for the capable backends. ``args`` are the backends' own arguments.
    """

    def __init__(self, kind: str, load: Callable[[], None], rank: Callable[..., tuple]):
        self.kind = kind
        self._load, self._rank = load, rank
        self._loaded = False
        self._backends: dict[str, Backend] = {}

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self._loaded = True
            self._load()

    def register(self, backend: Backend) -> Backend:
        self._backends[backend.name] = backend
        return backend

    def names(self) -> list[str]:
        self._ensure_loaded()
        return list(self._backends)

    def get(self, name: str) -> Backend:
        self._ensure_loaded()
        if name not in self._backends:
            what = "backend" if self.kind == "dense" else f"{self.kind} backend"
            raise ValueError(
                f"unknown {what} {name!r}; choose 'auto' or one of {sorted(self._backends)}"
            )
        return self._backends[name]

    def available(self, *args) -> dict[str, str | None]:
        """Map every backend to ``None`` (can run this case) or its rejection reason."""
        self._ensure_loaded()
        return {name: b.reject(*args) for name, b in self._backends.items()}

    def select(self, *args, backend: str = "auto") -> tuple[Backend, Explanation]:
        """Resolve ``backend`` (a name or ``"auto"``) for this case; raise if it cannot run it."""
        if backend != "auto":
            chosen = self.get(backend)
            reason = chosen.reject(*args)
            if reason is not None:
                how = "explain" if self.kind == "dense" else f"explain_{self.kind}"
                raise ValueError(
                    f"backend {backend!r} cannot run this call: {reason}. "
                    f"Use backend='auto', or see selfattn.backends.{how}(...) for the "
                    "alternatives."
                )
            return chosen, Explanation(backend, "requested explicitly", {backend: None})
        reasons = self.available(*args)
        name, why, notes = self._rank(*args, reasons)
        return self._backends[name], Explanation(name, why, reasons, notes)


def _load_dense() -> None:
    from selfattn.backends import chunked, flex, reference, sdpa, triton  # noqa: F401


def _rank_dense(q, k, v, call, reasons):
    from selfattn.backends._auto import rank

    return rank(q, k, v, call, reasons)


def _load_paged() -> None:
    from selfattn.backends.paged import cpu, pytorch, triton  # noqa: F401


def _rank_paged(*args):
    from selfattn.backends.paged import rank

    return rank(*args)


_REGISTRIES = {
    "dense": Registry("dense", _load_dense, _rank_dense),
    "paged": Registry("paged", _load_paged, _rank_paged),
}


def registry(kind: str = "dense") -> Registry:
    """The registry of backends of ``kind`` (``"dense"`` or ``"paged"``)."""
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown backend kind {kind!r}; choose one of {sorted(_REGISTRIES)}")
    return _REGISTRIES[kind]


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend in the registry of its kind, under ``backend.name``."""
    return registry(backend.kind).register(backend)


def names(kind: str = "dense") -> list[str]:
    return registry(kind).names()


def get(name: str, kind: str = "dense") -> Backend:
    return registry(kind).get(name)


def available(q, k, v, call: AttentionCall) -> dict[str, str | None]:
    """Map every dense backend to ``None`` (can run this case) or its rejection reason."""
    return _REGISTRIES["dense"].available(q, k, v, call)


def select(q, k, v, call: AttentionCall, backend: str = "auto") -> tuple[Backend, Explanation]:
    """Resolve ``backend`` (a name or ``"auto"``) for this dense case; raise if it cannot run
    it."""
    return _REGISTRIES["dense"].select(q, k, v, call, backend=backend)


def explain(q, k, v, *, print_table: bool = True, **kwargs) -> Explanation:
    """Which backend ``selfattn.attention(q, k, v, **kwargs)`` picks under "auto", and why.

    Takes exactly the arguments of :func:`selfattn.attention`. Prints the explanation (unless
    ``print_table=False``) and returns it.
    """
    kwargs.pop("backend", None)
    q, k, v, call = prepare(q, k, v, **kwargs)
    _, explanation = select(q, k, v, call, "auto")
    if print_table:
        print(explanation)
    return explanation


def explain_paged(
    q, k_pages, v_pages, block_table, seq_lens, *, print_table: bool = True, **kwargs
) -> Explanation:
    """Which paged backend ``selfattn.cache.paged_attention(q, k_pages, v_pages, block_table,
    seq_lens, **kwargs)`` picks under "auto", and why.

    Takes exactly the arguments of ``paged_attention``. Prints the explanation (unless
    ``print_table=False``) and returns it.
    """
    from selfattn.backends.paged import call as paged_call

    kwargs.pop("backend", None)
    args = (q, k_pages, v_pages, block_table, seq_lens)
    _, explanation = _REGISTRIES["paged"].select(*args, paged_call.prepare(*args, **kwargs))
    if print_table:
        print(explanation)
    return explanation
