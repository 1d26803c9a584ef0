"""Backends: one signature per kind, one registry, and `auto` that can say why it chose.

Two kinds of backend share the registry machinery (:class:`Registry`: register, select, explain):

- ``"dense"``: ``run(q, k, v, call) -> (out, lse)`` on already-validated inputs
  ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)`` and a normalised
  :class:`selfattn.call.AttentionCall` (what :func:`selfattn.attention` runs).
- ``"paged"``: ``run(q, k_pages, v_pages, block_table, seq_lens, call) -> (out, lse)`` with a
  :class:`selfattn.backends.paged.call.PagedCall` (what ``paged_attention`` runs; see
  :mod:`selfattn.backends.paged`).

``lse`` is ``None`` unless ``call.return_lse``. Every backend also has a ``reject(...)``
predicate and a ``cost(...)`` hook taking the same arguments as its ``run``: ``reject`` gives
``None`` when it can run the case, otherwise a sentence saying why not; ``cost`` gives its
:class:`Cost` for the case, and ``auto`` runs the cheapest backend that can run it
(:mod:`selfattn.backends._auto`). A backend understands the call fields it lists in
``supports`` (default: the fields the call had when the contract was written, ``BASE_FIELDS``);
a call that sets any other field (a newer feature) is declined with a reason naming the field,
before ``reject`` sees it. A paged backend may have a ``plan(...)`` hook, same arguments
again, returning what it derives from the block table, lengths and mask (key intervals, page
ranges): a planned step (:class:`selfattn.backends.paged.plan.PagedAttentionPlan`) asks it once
and hands it to every layer's ``run`` as ``call.planned``. :func:`explain` (dense) and
:func:`explain_paged` take exactly the
arguments of the function they explain, which is why they are two functions and not a flag.

A global override forces one dense backend wherever a call says ``backend="auto"``: the context
manager :func:`use` (per thread, nestable) or else the environment variable ``SELFATTN_BACKEND``
(read at each call), as ``torch.nn.attention.sdpa_kernel`` and vLLM's
``VLLM_ATTENTION_BACKEND`` do. A ``backend=`` named in the call wins over both; :func:`explain`
reports the override.

Layout, arrows pointing down: this package (loads the backends, the override, explain) ->
the backends (``reference``, ``chunked``; then :mod:`~selfattn.backends.exact`, the exact redo
of a non-finite fused result; then the fused ``sdpa``, ``flex``, ``triton``, ``cpu_fused``) ->
:mod:`~selfattn.backends.base` (the contract and the registries, which import no backend),
:mod:`~selfattn.backends._auto` (the ranking) and ``_common`` (shared numerics).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from selfattn.backends.base import (
    BASE_FIELDS,
    Backend,
    BackendCompileError,
    Cost,
    Explanation,
    Registry,
    add_registry,
    register,
    registry,
)
from selfattn.call import AttentionCall, prepare

__all__ = [
    "BASE_FIELDS",
    "ENV_VAR",
    "AttentionCall",
    "Backend",
    "BackendCompileError",
    "Cost",
    "Explanation",
    "Registry",
    "available",
    "explain",
    "explain_paged",
    "get",
    "names",
    "override",
    "register",
    "registry",
    "select",
    "use",
]


def _load_dense() -> None:
    from selfattn.backends import chunked, cpu_fused, flex, reference, sdpa, triton  # noqa: F401


def _density_dense(q, k, v, call) -> float:
    from selfattn.backends.chunked import density

    return density(q, k, call)


def _load_paged() -> None:
    from selfattn.backends.paged import cpu, pytorch, triton  # noqa: F401


_DENSE = add_registry(Registry("dense", _load_dense, _density_dense))
_PAGED = add_registry(Registry("paged", _load_paged))


def names(kind: str = "dense") -> list[str]:
    return registry(kind).names()


def get(name: str, kind: str = "dense") -> Backend:
    return registry(kind).get(name)


def available(q, k, v, call: AttentionCall) -> dict[str, str | None]:
    """Map every dense backend to ``None`` (can run this case) or its rejection reason."""
    return _DENSE.available(q, k, v, call)


def select(q, k, v, call: AttentionCall, backend: str = "auto") -> tuple[Backend, Explanation]:
    """Resolve ``backend`` (a name or ``"auto"``) for this dense case; raise if it cannot run
    it. ``"auto"`` takes the :func:`override` when one is set."""
    forced = override() if backend == "auto" else None
    if forced is not None:
        return _DENSE.select(q, k, v, call, backend=forced[0], source=forced[1])
    return _DENSE.select(q, k, v, call, backend=backend)


# -- the global override ---------------------------------------------------------------------

ENV_VAR = "SELFATTN_BACKEND"
# .name: the backend use() set in this thread ("auto" included), absent outside any use(). A
# thread-local rather than a ContextVar: torch.compile traces (and guards on) its attribute,
# whereas ContextVar.get breaks the graph.
_forced = threading.local()


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run ``backend="auto"`` calls in this block (this thread only) on the dense backend ``name``.

    ``with sa.backends.use("chunked"): model(x)`` forces ``chunked`` on every attention call
    that does not name a backend itself; one that it cannot run raises ``ValueError`` with the
    reason, as an explicit ``backend=`` would. Blocks nest, the innermost wins, and the previous
    setting is restored on exit (exceptions included). ``use("auto")`` restores ``auto`` inside
    an outer block and over ``SELFATTN_BACKEND``. Compiled code is traced again when the
    setting changes.
    """
    if not isinstance(name, str):
        raise TypeError(f"use() takes a backend name (str), got {type(name).__name__} {name!r}")
    if name != "auto":
        get(name)  # an unknown name fails here, listing the registered ones
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def override() -> tuple[str, str] | None:
    """``(backend name, where it was set)`` that ``backend="auto"`` calls run on now, or None.

    The innermost :func:`use` block of this thread, else the environment variable
    ``SELFATTN_BACKEND`` (unset, empty or ``auto``: no override). An unknown name in the
    variable raises ``ValueError`` listing the registered backends.
    """
    name = getattr(_forced, "name", None)
    if name is not None:
        return None if name == "auto" else (name, f"set by sa.backends.use({name!r})")
    env = os.environ.get(ENV_VAR, "").strip()
    if env in ("", "auto"):
        return None
    if env not in names():
        raise ValueError(
            f"the environment variable {ENV_VAR}={env!r} names no dense backend; set it to "
            f"'auto' or one of {sorted(names())}, or unset it"
        )
    return env, f"set by the environment variable {ENV_VAR}={env}"


def explain(q, k, v, *, print_table: bool = True, **kwargs) -> Explanation:
    """Which backend ``selfattn.attention(q, k, v, **kwargs)`` picks under "auto", and why.

    Under an :func:`override` it names the forced backend and where it was set, and still gives
    every backend's verdict. Takes exactly the arguments of :func:`selfattn.attention`. Prints
    the explanation (unless ``print_table=False``) and returns it.
    """
    kwargs.pop("backend", None)
    q, k, v, call = prepare(q, k, v, **kwargs)
    forced = override()
    if forced is None:
        _, explanation = select(q, k, v, call, "auto")
    else:
        name, source = forced
        reasons = available(q, k, v, call)
        why = source
        if reasons[name] is not None:
            why += f", but it cannot run this call ({reasons[name]}): attention() raises"
        forced = f"not considered: {name!r} is {source}"
        explanation = Explanation(name, why, reasons, forced=forced)
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
    _, explanation = _PAGED.select(*args, paged_call.prepare(*args, **kwargs))
    if print_table:
        print(explanation)
    return explanation
