"""Test helpers shipped with the package: input factories and the ratio tolerance rule.

The rule (docs/testing.md): a backend's max error against the float64 reference may be at most
``2×`` (forward) / ``3×`` (gradients) the max error of the same formula computed naively in the
test dtype, plus an absolute floor of a few ulps of that dtype. A naive baseline that overflows
(NaN or inf where the oracle is finite) gives no tolerance: the check raises instead of passing.
"""

from __future__ import annotations

import torch

from selfattn.backends import reference
from selfattn.call import prepare

__all__ = [
    "assert_close_to_reference",
    "check_against_reference",
    "make_qkv",
    "naive_attention",
    "reference_attention",
]

FORWARD_FACTOR = 2.0
GRAD_FACTOR = 3.0
ULPS = 8  # the absolute floor, in ulps of the test dtype at the output's magnitude
# fp64 inputs have no naive baseline (the naive computation is the oracle itself, error 0), so the
# floor alone absorbs a tiled or fused kernel's reordering noise: tens of ulps over ~100 keys.
ULPS_FP64 = 64


def make_qkv(
    B: int = 2,
    Hq: int = 4,
    Sq: int = 16,
    D: int = 32,
    *,
    Hkv: int | None = None,
    Sk: int | None = None,
    Dv: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    requires_grad: bool = False,
    contiguous: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)``.

    ``contiguous=False`` returns non-contiguous views: q/k/v are slices of one fused
    ``(B, S, H, ·)`` projection transposed to ``(B, H, S, ·)``, and v is additionally a
    transposed-storage tensor, as produced by real models.
    """
    Hkv = Hq if Hkv is None else Hkv
    Sk = Sq if Sk is None else Sk
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)

    if contiguous:
        q, k, v = rnd(B, Hq, Sq, D), rnd(B, Hkv, Sk, D), rnd(B, Hkv, Sk, Dv)
    else:
        fused_q = rnd(B, Sq, Hq, D + 3)  # extra columns: the views are strided, not just permuted
        fused_kv = rnd(B, Sk, Hkv, 2 * D + 1)
        q = fused_q[..., :D].transpose(1, 2)
        k = fused_kv[..., 1 : D + 1].transpose(1, 2)
        v = rnd(B, Hkv, Dv, Sk).transpose(-1, -2)
    if requires_grad:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    return q, k, v


def _call(q, k, v, kwargs, compute_dtype=None):
    kwargs = dict(kwargs)
    kwargs.pop("backend", None)
    qq, kk, vv, call = prepare(q, k, v, **{**kwargs, "return_lse": True})
    return reference.run(qq, kk, vv, call, compute_dtype=compute_dtype)


def reference_attention(q, k, v, **kwargs):
    """The float64 oracle: ``(out, lse)`` of the reference backend on fp64 copies of q, k, v."""
    q64, k64, v64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v))
    out, lse = _call(q64, k64, v64, kwargs)
    return out, lse, (q64, k64, v64)


def naive_attention(q, k, v, **kwargs):
    """The same formula computed entirely in the input dtype (the noise baseline)."""
    ql, kl, vl = (t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v))
    out, lse = _call(ql, kl, vl, kwargs, compute_dtype=q.dtype)
    return out, lse, (ql, kl, vl)


def _floor(dtype: torch.dtype, magnitude: float, relative: bool = False) -> float:
    ulps = ULPS_FP64 if dtype == torch.float64 else ULPS
    return ulps * torch.finfo(dtype).eps * (magnitude if relative else max(1.0, magnitude))


def _check_baseline(naive: torch.Tensor, finite: torch.Tensor, what: str, dtype) -> None:
    """Raise where the naive baseline is NaN or inf where the oracle is finite: the tolerance
    would be NaN or inf there, and every answer would pass."""
    bad = finite & ~torch.isfinite(naive)
    if bool(bad.any()):
        where = bad.nonzero()[:5].tolist()
        kinds = sorted({"NaN" if x != x else "inf" for x in naive[bad][:5].tolist()})
        raise ValueError(
            f"{what}: the naive {dtype} baseline is {' and '.join(kinds)} at {where} "
            f"({int(bad.sum())} elements) where the float64 oracle is finite, so the ratio rule "
            "has no tolerance there; compute the baseline in a wider dtype, or draw inputs the "
            "naive formula does not overflow on"
        )


def assert_close_to_reference(
    actual: torch.Tensor,
    oracle: torch.Tensor,
    naive: torch.Tensor,
    *,
    factor: float = FORWARD_FACTOR,
    dtype: torch.dtype | None = None,
    what: str = "out",
    relative_floor: bool = False,
) -> None:
    """``max|actual - oracle| <= factor · max|naive - oracle| + floor``; NaN anywhere fails.

    The floor is :data:`ULPS` ulps of ``dtype`` at the oracle's largest magnitude, or at 1 where
    that is smaller (an absolute floor for values near 0); ``relative_floor``: at the magnitude
    itself, for small values (a gradient of 0.02 in bf16) that an absolute floor would let an
    all-zero answer match. A naive baseline that is NaN or inf where the oracle is finite raises
    ValueError (it gives no tolerance)."""
    dtype = dtype or actual.dtype
    a, o = actual.double(), oracle.double()
    n = naive.double() if naive is not None else None
    finite = torch.isfinite(o)
    if not torch.equal(torch.isfinite(a), finite):
        bad = (torch.isfinite(a) != finite).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: non-finite pattern differs from the oracle at {bad}")
    if n is not None:
        _check_baseline(n, finite, what, dtype)
    if not bool(finite.any()):
        return
    err = (a - o)[finite].abs()
    base = (n - o)[finite].abs().max().item() if n is not None else 0.0
    tol = factor * base + _floor(dtype, o[finite].abs().max().item(), relative_floor)
    if err.max().item() > tol:
        raise AssertionError(
            f"{what}: max error {err.max().item():.3e} (mean {err.mean().item():.3e}) exceeds "
            f"{factor}x the naive {dtype} error {base:.3e} + floor = {tol:.3e}"
        )


def check_against_reference(
    fn,
    q,
    k,
    v,
    *,
    grad: bool = True,
    lse: bool = True,
    seed: int = 1,
    grad_factor: float = GRAD_FACTOR,
    **kwargs,
) -> None:
    """Run ``fn(q, k, v, return_lse=True, **kwargs)`` and check out, lse and dq/dk/dv by the rule.

    ``fn`` is typically ``functools.partial(selfattn.attention, backend=...)``. Gradients use a
    fresh random ``dout`` on the inputs' device. ``lse=False`` calls ``fn`` without
    ``return_lse`` and checks out and gradients only (backends that give no lse, e.g. SDPA on CUDA).
    ``grad_factor``: the gradients' ratio (:data:`GRAD_FACTOR` unless a case says why not).
    """
    q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
    if lse:
        out, lse = fn(q, k, v, return_lse=True, **kwargs)
    else:
        out, lse = fn(q, k, v, **kwargs), None
    o64, lse64, leaves64 = reference_attention(q, k, v, **kwargs)
    onaive, lsenaive, leavesn = naive_attention(q, k, v, **kwargs)
    assert out.dtype == q.dtype, f"out dtype {out.dtype} != input dtype {q.dtype}"
    assert out.shape == o64.shape, f"out shape {tuple(out.shape)} != {tuple(o64.shape)}"
    assert_close_to_reference(out, o64, onaive, dtype=q.dtype, what="out")
    if lse is not None:
        assert_close_to_reference(lse, lse64, lsenaive, dtype=torch.float32, what="lse")
    if not grad:
        return
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype), allow_unused=True)
    g64 = torch.autograd.grad(o64, leaves64, dout, allow_unused=True)
    gn = torch.autograd.grad(onaive, leavesn, dout.to(onaive.dtype), allow_unused=True)
    for name, a, o, n in zip(("dq", "dk", "dv"), grads, g64, gn):
        a = torch.zeros_like(o) if a is None else a
        o = torch.zeros_like(a, dtype=torch.float64) if o is None else o
        n = torch.zeros_like(o) if n is None else n
        assert_close_to_reference(a, o, n, factor=grad_factor, dtype=q.dtype, what=name)


def perturb_parameters(
    model: torch.nn.Module, seed: int, scale: float = 0.1, *, buffers: bool = False
) -> None:
    """Move every floating parameter (and with ``buffers``, buffer) of ``model`` off its initial
    value (norm weights at 1, biases at 0), so that a parity test exercises all of them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*model.parameters(), *(model.buffers() if buffers else ())]:
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * scale)
