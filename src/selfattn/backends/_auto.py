"""How ``auto`` chooses: the cheapest backend that can run the case, by each backend's own cost.

Every backend that can run a case gives its :class:`~selfattn.backends.Cost` for it (its
``cost`` hook, next to its ``run``): a time per (query, key) pair, and whether it computes only
the pairs in the mask's non-empty tiles (``sparse``: time ``per_pair · density``) or all of them.
``auto`` runs the cheapest. The density estimate reads the mask's tiles (a device sync on a GPU,
a graph break under ``torch.compile``), so it is computed only when it decides: when the best
sparse backend is not cheaper than the best dense one even at density 1. Equal costs go to the
backend registered first.

The dense costs are measured, not guessed (2-thread x86 CPU, torch 2.13, fp32, B=1, H=8, D=64;
numbers in BENCHMARKS.md, ``benchmarks/attention.py``), each in its backend's module:

- ``sdpa`` (the yardstick, 1 per pair): PyTorch's fused CPU flash kernel is the fastest we have
  for dense and causal work (S=4096: sdpa 0.22 s, chunked 0.29 s, compiled flex 0.61 s; causal:
  sdpa 0.12 s, chunked 0.13 s, flex 0.45 s). With any other mask it does all ``Sq·Sk`` work.
- ``chunked`` (2 per pair, sparse): skips empty tiles, so for a sparse mask it wins by about the
  inverse density (sliding window 256 at S=16384: chunked 0.12 s, compiled flex 0.14 s, sdpa with
  a dense mask 4.2 s; 8 packed causal documents: chunked 0.29 s, flex 0.36 s). The crossover
  with sdpa-with-a-mask sits near half the tiles empty: hence 2.
- ``cpu_fused`` (1 per pair plus a fixed cost per call, sparse; CPU only): the fused C kernel
  over the same tiles as chunked (issue 16; figures in its module). Costed as sdpa's equal, it
  takes every masked CPU call big enough for its ~0.35 ms of per-call set-up, while no mask and
  ``causal()`` (sdpa's own flag) stay on sdpa, conservatively: in CPU time it measured faster
  there too.
- ``flex``: compiled per mask/score-mod code and shape (4-10 s cold on CPU) and no CPU backward,
  so on CPU a last resort before ``reference``; on CUDA its fused block-sparse kernel beats
  everything for masks and, after sdpa, for score mods.
- ``reference``: runs every case but materialises ``Sq·Sk`` scores: the most expensive.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["density", "notes", "rank"]


def density(q, k, call) -> float:
    """Fraction of the tiles (chunked's own fine tiling) the mask does not classify as EMPTY.

    The classification is cached on the call, so the chunked backend reuses it when picked.
    """
    if call.mask is None:
        return 1.0
    from selfattn.backends.chunked import fine_grid

    B, Hq, Sq, _ = q.shape
    Sk, G = k.shape[2], Hq // k.shape[1]
    return float(fine_grid(call, B, Hq, Sq, Sk, G, q.device).nonempty.float().mean())


def rank(costs: dict, density: Callable[[], float]) -> tuple[str, str, float | None]:
    """``(backend name, why, density)``: the cheapest of ``costs`` (name -> Cost, the backends
    that can run the case, in registration order). ``density()`` is called only when it
    decides; the density returned is None otherwise."""
    best: dict[bool, str] = {}  # the cheapest dense and sparse backends (first on ties)
    for name, c in costs.items():
        held = best.get(c.sparse)
        if held is None or c.per_pair < costs[held].per_pair:
            best[c.sparse] = name
    d = None
    if len(best) == 1:
        name = next(iter(best.values()))
    elif costs[best[True]].per_pair < costs[best[False]].per_pair:
        name = best[True]  # cheaper even if it computed every pair
    else:
        d = density()
        sparse, dense = costs[best[True]], costs[best[False]]
        name = best[True] if sparse.per_pair * d < dense.per_pair else best[False]
    why = costs[name].why
    return name, why if d is None else f"{why} (mask density {d:.2f})", d


def notes(costs: dict, chosen: str, density: float | None) -> dict[str, str]:
    """For each backend of ``costs`` but ``chosen``: its estimate against the chosen one's."""

    def estimate(c) -> str:
        if not c.sparse:
            return f"{c.per_pair:g}"
        return f"{c.per_pair:g} × density" if density is None else f"{c.per_pair * density:.3g}"

    mine = estimate(costs[chosen])
    return {
        name: f"{c.why}; costs {estimate(c)} per pair vs {mine}"
        for name, c in costs.items()
        if name != chosen
    }
