"""The backend contract: :class:`Backend`, :class:`Cost`, :class:`Registry` and ``register``.

What every backend module imports to register itself; it imports no backend (the package
:mod:`selfattn.backends` loads them and adds the registries), so the arrows run one way:
package -> backends -> this module. The package's docstring states the contract.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from selfattn.backends._auto import notes, rank
from selfattn.call import AttentionCall

# (q, k, v, call) for dense backends; (q, k_pages, v_pages, block_table, seq_lens, call) for paged.
RunFn = Callable[..., tuple]
RejectFn = Callable[..., "str | None"]
CostFn = Callable[..., "Cost"]

# The call fields every backend of a kind understands unless it says otherwise (``supports``):
# those of AttentionCall / PagedCall when the backend contract was written. A field added later
# is run only by the backends that list it.
BASE_FIELDS = {
    "dense": frozenset(
        {"mask", "score_mod", "scale", "dropout_p", "dropout_seed", "q_offset", "return_lse"}
    ),
    "paged": frozenset({"mask", "score_mod", "scale", "k_scales", "v_scales", "return_lse"}),
}


@dataclass(frozen=True)
class Cost:
    """A backend's estimate of its time for one case, comparable within its kind.

    ``per_pair``: time per (query, key) pair it computes, in units of the kind's yardstick
    (dense: PyTorch's fused SDPA kernel on the same device; paged: the C decode kernel). A
    ``sparse`` backend computes only the pairs in the mask's non-empty tiles, a fraction
    ``density`` of them (``chunked.density``), so its time is ``per_pair · density``; a dense one
    computes them all. ``fixed``: the per-call set-up that does not shrink with the density (tile
    plans, per-tile dispatch), spread over the call's pairs in the same unit, so a small call
    (a decode step) is ranked by it without reading the mask. ``why``: the estimate in words, as
    ``explain`` prints it.
    """

    per_pair: float
    why: str
    sparse: bool = False
    fixed: float = 0.0


@dataclass(frozen=True)
class Backend:
    """A registered backend: ``run``, ``reject`` and ``cost`` take the same arguments (module
    docstring). ``cost`` None: no estimate, so ``auto`` picks it only when nothing else can run
    the case. ``supports``: the call fields it understands (None: ``BASE_FIELDS[kind]``)."""

    name: str
    run: RunFn
    reject: RejectFn
    doc: str = ""
    kind: str = "dense"  # "dense" or "paged": which registry, and which arguments run takes
    cost: CostFn | None = None
    supports: frozenset[str] | None = None
    plan: RunFn | None = None  # paged: the per-step part of run, shared by a step's layers

    def __post_init__(self):
        if self.supports is None:
            object.__setattr__(self, "supports", BASE_FIELDS.get(self.kind, frozenset()))
        else:
            object.__setattr__(self, "supports", frozenset(self.supports))


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
    costs: dict[str, Cost] = field(default_factory=dict)  # the capable backends' estimates
    density: float | None = None  # the mask density auto estimated, where it decided
    forced: str | None = None  # why no other backend was considered (an override), if so

    @property
    def notes(self) -> dict[str, str]:
        """For each capable backend not chosen, what it would cost (built when asked: a call
        to attention() never reads it)."""
        if self.forced is not None:
            return dict.fromkeys(self.reasons, self.forced)

        return notes(self.costs, self.chosen, self.density)

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
    selfattn never probes hardware or compiles anything. ``density(*args)`` estimates the
    fraction of pairs a sparse backend computes (:class:`Cost`); None: every pair. ``args`` are
    the backends' own arguments, the call last.
    """

    def __init__(
        self, kind: str, load: Callable[[], None], density: Callable[..., float] | None = None
    ):
        self.kind = kind
        self._load, self._density = load, density
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

    @staticmethod
    def reason(backend: Backend, *args) -> str | None:
        """Why ``backend`` declines this case (``args`` its own arguments), or None: first a call
        field it does not support, then its own ``reject``."""
        call = args[-1]
        defaults = call_fields(type(call))
        if defaults.keys() <= backend.supports:  # every field understood (BASE_FIELDS' calls)
            return backend.reject(*args)
        for name in defaults.keys() - backend.supports:
            if _in_use(getattr(call, name), defaults[name]):
                return (
                    f"the call sets {name}, which this backend does not support (it supports "
                    f"{', '.join(sorted(backend.supports))})"
                )
        return backend.reject(*args)

    def available(self, *args) -> dict[str, str | None]:
        """Map every backend to ``None`` (can run this case) or its rejection reason."""
        self._ensure_loaded()
        return {name: self.reason(b, *args) for name, b in self._backends.items()}

    def select(
        self, *args, backend: str = "auto", source: str = "requested explicitly"
    ) -> tuple[Backend, Explanation]:
        """Resolve ``backend`` (a name or ``"auto"``) for this case; raise if it cannot run it.

        ``source`` says where a named backend came from (the call, or an override), for the
        explanation and the error."""
        if backend != "auto":
            chosen = self.get(backend)
            reason = self.reason(chosen, *args)
            if reason is not None:
                how = "explain" if self.kind == "dense" else f"explain_{self.kind}"
                by = "" if source == "requested explicitly" else f" ({source})"
                raise ValueError(
                    f"backend {backend!r}{by} cannot run this call: {reason}. "
                    f"Use backend='auto', or see selfattn.backends.{how}(...) for the "
                    "alternatives."
                )
            return chosen, Explanation(backend, source, {backend: None})
        reasons = self.available(*args)
        costs = {
            name: _cost_of(self._backends[name], args)
            for name, reason in reasons.items()
            if reason is None
        }
        if not costs:
            raise ValueError(
                f"no {self.kind} backend can run this call: "
                + "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
            )
        density = (lambda: 1.0) if self._density is None else (lambda: self._density(*args))
        name, why, d = rank(costs, density)
        return self._backends[name], Explanation(name, why, reasons, costs, d)


_NO_ESTIMATE = Cost(float("inf"), "no cost estimate (Backend.cost is None)")


def _cost_of(backend: Backend, args) -> Cost:
    return _NO_ESTIMATE if backend.cost is None else backend.cost(*args)


_DEFAULTS: dict[type, dict] = {}


def call_fields(call_type: type) -> dict:
    """``{name: default}`` of the fields of a call dataclass that say what the call asks
    (``compare=False`` fields are caches riding on it), once per type.

    Each call type fills its entry at import (below; PagedCall in its module): Dynamo cannot
    trace ``dataclasses.fields``, so a first fill inside a cold ``torch.compile(fullgraph=True)``
    of ``attention`` broke the graph."""
    found = _DEFAULTS.get(call_type)
    if found is None:
        found = _DEFAULTS[call_type] = {
            f.name: None if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(call_type)
            if f.compare
        }
    return found


call_fields(AttentionCall)


def _in_use(value, default) -> bool:
    """Whether a call field asks for something: set away from its default (a field at its
    default asks nothing of a backend)."""
    if value is default:
        return False
    return default is None or value != default


# The registries by kind, added by the package (selfattn.backends) with the loaders that import
# the built-in backends.
_REGISTRIES: dict[str, Registry] = {}


def add_registry(found: Registry) -> Registry:
    """Make ``found`` the registry of its kind (the package adds ``"dense"`` and ``"paged"``)."""
    _REGISTRIES[found.kind] = found
    return found


def registry(kind: str = "dense") -> Registry:
    """The registry of backends of ``kind`` (``"dense"`` or ``"paged"``)."""
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown backend kind {kind!r}; choose one of {sorted(_REGISTRIES)}")
    return _REGISTRIES[kind]


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend in the registry of its kind, under ``backend.name``."""
    return registry(backend.kind).register(backend)
