"""How ``auto`` chooses: the cheapest backend that can run the case, by each backend's own cost.

Every backend that can run a case gives its :class:`~selfattn.backends.Cost` for it (its
``cost`` hook, next to its ``run``): a time per (query, key) pair, and whether it computes only
the pairs in the mask's non-empty tiles (``sparse``: time ``per_pair · density``) or all of them.
``auto`` runs the cheapest. The density estimate reads the mask's tiles (a device sync on a GPU,
a graph break under ``torch.compile``), so it is computed only when it decides: when a different
backend is cheapest at density 1 and just above 0. A cost's ``fixed`` part (per-call set-up that
does not shrink with the density, spread over the call's pairs) keeps small calls, decode steps
above all, on sdpa without reading the mask. Equal costs go to the backend registered first.

The dense costs are measured, not guessed (2-thread x86 CPU, torch 2.13, fp32, B=1, H=8, D=64;
numbers in BENCHMARKS.md, ``benchmarks/attention.py``), each in its backend's module:

- ``sdpa`` (the yardstick, 1 per pair): PyTorch's fused CPU flash kernel is PyTorch's fastest
  for dense and causal work, and ours on small calls and fp32 decode steps (S=4096: sdpa
  0.22 s, chunked 0.29 s, compiled flex 0.61 s; causal: sdpa 0.12 s, chunked 0.13 s, flex
  0.45 s). With any other mask it does all ``Sq·Sk`` work.
- ``chunked`` (2 per pair, sparse): skips empty tiles, so for a sparse mask it wins by about the
  inverse density (sliding window 256 at S=16384: chunked 0.12 s, compiled flex 0.14 s, sdpa with
  a dense mask 4.2 s; 8 packed causal documents: chunked 0.29 s, flex 0.36 s). The crossover
  with sdpa-with-a-mask sits near half the tiles empty: hence 2.
- ``cpu_fused`` (sparse, plus a fixed cost per call; CPU only): the fused C kernel over the
  same tiles as chunked. Its per-pair cost and set-up against sdpa are measured per
  regime (dtype, forward or forward + backward, decode-sized or not: ``cpu_fused.FITS``, from
  ``benchmarks/crossover.py``), so it takes no-mask and causal calls where it measured faster
  (fp32 prefills ~0.65x sdpa, bf16 ~0.35x, bf16 GQA decode ~0.2x) and leaves small calls and
  fp32 decode steps to sdpa; masked calls come to it from sdpa's dense mask and from chunked.
- ``flex``: compiled per mask/score-mod code and shape (4-10 s cold on CPU) and no CPU backward,
  so on CPU a last resort before ``reference``; on CUDA its fused block-sparse kernel beats
  everything for masks and, after sdpa, for score mods.
- ``reference``: runs every case but materialises ``Sq·Sk`` scores: the most expensive.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["notes", "rank"]


def rank(costs: dict, density: Callable[[], float]) -> tuple[str, str, float | None]:
    """``(backend name, why, density)``: the cheapest of ``costs`` (name -> Cost, the backends
    that can run the case, in registration order). ``density()`` is called only when it
    decides; the density returned is None otherwise."""

    def total(c, d: float) -> float:
        return (c.per_pair * d if c.sparse else c.per_pair) + c.fixed

    def cheapest(d: float) -> str:
        # At a density just above 0 equal costs go to the smaller slope (the limit from above:
        # an all-empty mask is no case to rank for); otherwise to the first registered.
        def key(name):
            c = costs[name]
            return (total(c, d), c.per_pair if d == 0.0 and c.sparse else 0.0)

        best = None
        for name in costs:
            if best is None or key(name) < key(best):
                best = name
        return best

    # Each cost is linear in the density: a backend cheapest at both ends is cheapest between,
    # and only then is the mask not read.
    d = None
    name = cheapest(1.0)
    if cheapest(0.0) != name:
        d = density()
        name = cheapest(d)
    why = costs[name].why
    return name, why if d is None else f"{why} (mask density {d:.2f})", d


def notes(costs: dict, chosen: str, density: float | None) -> dict[str, str]:
    """For each backend of ``costs`` but ``chosen``: its estimate against the chosen one's."""

    def estimate(c) -> str:
        if c.sparse and density is None:
            per = f"{c.per_pair:g} × density"
            return per if not c.fixed else f"{per} + {c.fixed:.3g}"
        return f"{(c.per_pair * density if c.sparse else c.per_pair) + c.fixed:.3g}"

    mine = estimate(costs[chosen])
    return {
        name: f"{c.why}; costs {estimate(c)} per pair vs {mine}"
        for name, c in costs.items()
        if name != chosen
    }
