"""How ``auto`` ranks the backends that can run a case.

The rules are measured, not guessed (2-thread x86 CPU, torch 2.13, fp32, B=1, H=8, D=64; numbers in
BENCHMARKS.md, ``benchmarks/attention.py``):

- Dense and causal work: PyTorch's fused CPU flash kernel (``sdpa``) is the fastest we have
  (S=4096: sdpa 0.22 s, chunked 0.29 s, compiled flex 0.61 s; causal: sdpa 0.12 s, chunked
  0.13 s, flex 0.45 s). It skips tiles only for ``is_causal``, so causal goes to sdpa only where
  ``is_causal`` (or no mask at all) expresses it; other alignments are a mask like any other.
- Sparse masks: ``sdpa`` with a dense mask does all ``Sq·Sk`` work, so when a mask leaves most
  tiles empty the tile-skipping ``chunked`` backend wins by about the inverse density (sliding
  window 256 at S=16384: chunked 0.12 s, compiled flex 0.14 s, sdpa with a dense mask 4.2 s;
  8 packed causal documents: chunked 0.29 s, flex 0.36 s). The crossover sits near half the
  tiles empty: ``_SPARSE_DENSITY``.
- ``flex`` must be compiled per mask/score-mod code and shape (4–10 s cold on CPU) and has no CPU
  backward, so on CPU it is never picked automatically; ask for it with ``backend="flex"``. On CUDA
  its fused kernel beats the Python-tiled ``chunked`` for masks and score mods, so it ranks there.
- ``reference`` is the last resort: it can run every case but materialises ``Sq·Sk`` scores.
"""

from __future__ import annotations

import torch

# Fraction of (query, key) pairs in non-empty tiles below which skipping tiles beats the fused
# dense kernel. Measured: at density 0.5 chunked and sdpa-with-mask take about the same time.
_SPARSE_DENSITY = 0.5
# Dense bool masks bigger than this are not worth materialising for sdpa when chunked can run.
_DENSE_MASK_BYTES = 1 << 30


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


def _causal_as_flag(q, k, call) -> bool:
    """True when sdpa runs this causal mask without a dense mask (``is_causal`` or no mask)."""
    if call.mask is None or not call.mask.is_causal:
        return False
    Sk = k.shape[2]
    # sdpa drops the mask when every row sees every key, and uses is_causal for top-left
    # alignment (which SDPA refuses together with a float mask, i.e. an additive score mod).
    return call.q_offset >= Sk - 1 or (call.q_offset == 0 and call.score_mod is None)


def _dense_mask_bytes(q, k) -> int:
    B, Hq, Sq, _ = q.shape
    return B * Hq * Sq * k.shape[2]


def rank(q, k, v, call, reasons: dict) -> tuple[str, str, dict[str, str]]:
    """``(backend name, why, notes)``: the measured-fastest backend that can run this case.

    ``notes`` says, for capable backends that were not picked, why they rank lower.
    """
    name, why = _pick(q, k, v, call, reasons)
    notes = {}
    if call.mask is not None and not call.mask.is_causal:
        notes["sdpa"] = "does all Sq·Sk work with a dense mask"
    if q.device.type != "cuda":
        notes["flex"] = "auto never picks it on CPU (compiles per shape, 4-10 s cold)"
    notes["reference"] = "materialises the Sq·Sk scores (the oracle)"
    notes["chunked"] = "a fused kernel is faster for this case"
    notes.pop(name, None)
    return name, why, notes


def _pick(q, k, v, call, reasons: dict) -> tuple[str, str]:

    def ok(name: str) -> bool:
        return reasons.get(name, "unregistered") is None

    on_cuda = q.device.type == "cuda"
    if call.mask is None or _causal_as_flag(q, k, call):
        if ok("sdpa"):
            return "sdpa", "dense or causal work: PyTorch's fused kernel is fastest"
    else:
        if on_cuda and ok("flex"):  # no density estimate: on a GPU it costs syncs per call
            return "flex", "mask: compiled FlexAttention skips empty blocks"
        if torch.compiler.is_compiling() and ok("sdpa"):
            # the density estimate reads the mask's tiles (a graph break), and the choice must
            # not depend on values while tracing: the fused kernel runs every mask
            return "sdpa", "mask under torch.compile: fused kernel with a dense mask"
        d = density(q, k, call)
        if d < _SPARSE_DENSITY and ok("chunked"):
            return "chunked", f"sparse mask (density {d:.2f} < {_SPARSE_DENSITY}): tiles skipped"
        if ok("sdpa") and (_dense_mask_bytes(q, k) <= _DENSE_MASK_BYTES or not ok("chunked")):
            return "sdpa", f"dense-ish mask (density {d:.2f}): fused kernel with a dense mask"
        if ok("sdpa") and ok("chunked"):
            gib = _dense_mask_bytes(q, k) / 2**30
            return "chunked", f"a dense mask for sdpa would take {gib:.1f} GiB; tiles instead"
    if call.score_mod is not None and on_cuda and ok("flex"):
        return "flex", "score mod: compiled FlexAttention fuses it"
    if ok("chunked"):
        why = "sdpa cannot run this case" if not ok("sdpa") else "chunked is fastest here"
        return "chunked", f"{why}; online softmax over tiles, O(S·tile) memory"
    for name in ("sdpa", "flex"):
        if ok(name):
            return name, "the fastest backend able to run this case"
    return "reference", "only the reference can run this case"
