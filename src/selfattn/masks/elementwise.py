"""Calling a FlexAttention-style callable (``mask_mod`` or ``score_mod``) on broadcast index
tensors: broadcasting first, ``torch.vmap`` element by element when the callable was written for
0-d tensors, and the classification of what it raises (its own failure vs. "does not broadcast").

Shared by :class:`selfattn.masks.CallableMask`, every mask's dense form and
:class:`selfattn.scores.CallableScoreMod`; it knows nothing of the mask classes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch


def index_grids(B: int, H: int, Sq: int, Sk: int, q_offset: int, device, kv_offset: int = 0):
    """Broadcastable index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q (1,1,Sq,1)`` (absolute
    positions ``q_offset + row``), ``kv (1,1,1,Sk)`` (positions ``kv_offset + column``)."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = (torch.arange(Sq, device=device) + q_offset).view(1, 1, Sq, 1)
    kv = (torch.arange(Sk, device=device) + kv_offset).view(1, 1, 1, Sk)
    return b, h, q, kv


class _CallableError(Exception):
    """Mixin for our verdicts on a user callable; the vmap fallback re-raises them untouched."""


class ReturnTypeError(_CallableError, TypeError):
    pass


class ReturnShapeError(_CallableError, ValueError):
    pass


def fn_name(fn) -> str:
    if isinstance(fn, functools.partial):
        return fn_name(fn.func)
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        return f"{owner!r}.{fn.__name__}"
    return getattr(fn, "__name__", type(fn).__name__)


def check_arity(fn: Callable, n: int, what: str, params: str, fix: str) -> None:
    """TypeError unless ``fn`` can be called with ``n`` positional arguments (when inspectable).

    Skipped under torch.compile, whose ``Signature.bind`` rejects valid calls; a wrong arity then
    fails at the callable's first call instead (and here in eager mode).
    """
    if torch.compiler.is_compiling():
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return
    try:
        sig.bind(*range(n))
    except TypeError:
        raise TypeError(
            f"{what} {fn_name(fn)}{sig} cannot be called as {what}({params}); {fix}"
        ) from None


# What a callable written for 0-d tensors raises on broadcast index tensors: the ambiguous truth
# value of a Python `if`/`and`/`or` (RuntimeError), `.item()`/`int()`/`math.*` of a many-element
# tensor (RuntimeError, ValueError), a tensor used as a Python list index (TypeError), shape
# mismatches of stack/cat/view (RuntimeError) and tensor indexing (IndexError). Only these exact
# types mean "this code does not broadcast": a subclass (torch.OutOfMemoryError is a RuntimeError,
# the user's own error classes) and every other exception (MemoryError, KeyboardInterrupt) is the
# callable's real failure and propagates as it is, after one call.
_NOT_BROADCASTING = (RuntimeError, ValueError, TypeError, IndexError)
# Exceptions from these packages may be a backend's own failure (a compiler, a kernel); any other
# class was defined by the user's code.
_LIBRARY_PACKAGES = frozenset({"builtins", "torch", "triton", "sympy", "selfattn"})


def callable_failure(error: BaseException) -> bool:
    """Whether ``error`` is out of memory or of the user's own exception class: what a backend
    that traces a callable (flex's compiler) must pass on untouched instead of retrying or
    falling back, so that the callable fails once and with its own error."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return type(error).__module__.partition(".")[0] not in _LIBRARY_PACKAGES


def call_elementwise(fn: Callable, args: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """``fn(*args)`` on broadcastable tensors, falling back to ``torch.vmap`` over every element.

    User callables are written for FlexAttention, which calls them on 0-d tensors under vmap;
    most also broadcast, which is much faster, so that is tried first. When the broadcast call
    fails the way code written for 0-d tensors fails (see ``_NOT_BROADCASTING``) or returns a
    shape that is not the broadcast shape of the arguments, ``fn`` is vmapped once per dimension
    (every argument expanded to the broadcast shape, a free view). The result has as many
    dimensions as that shape. Any other exception (out of memory, the callable's own error types)
    propagates unchanged from the first call.
    """
    shape = torch.broadcast_shapes(*(a.shape for a in args))
    first_error: Exception | None = None
    try:
        out = fn(*args)
        if not isinstance(out, torch.Tensor):
            out = torch.tensor(out, device=args[-1].device)
        if torch.broadcast_shapes(out.shape, shape) == shape:
            if out.dim() < len(shape):  # (only then: keep traced graphs free of no-op views)
                out = out.reshape((1,) * (len(shape) - out.dim()) + tuple(out.shape))
            return out
        bad_shape = tuple(out.shape)
    except Exception as e:
        if type(e) not in _NOT_BROADCASTING:
            raise
        first_error, bad_shape = e, None
    if len(shape) == 0:  # already elementwise: nothing to vmap over
        if first_error is not None:
            raise first_error
        raise ReturnShapeError(
            f"{what} {fn_name(fn)} returned shape {bad_shape} for 0-d index tensors; "
            "it must return one value per element"
        )
    f = fn
    for _ in shape:  # each level peels the leading dim of every argument
        f = torch.vmap(f, in_dims=0, out_dims=0)
    try:
        out = f(*(a.expand(shape) for a in args))
    except Exception as e:
        if type(e) not in _NOT_BROADCASTING:
            raise
        got = (
            f"raised {type(first_error).__name__}: {first_error}"
            if first_error
            else f"returned shape {bad_shape}"
        )
        raise ReturnShapeError(
            f"{what} {fn_name(fn)} failed: on broadcast index tensors of shape {tuple(shape)} it "
            f"{got}; element by element under torch.vmap it raised {type(e).__name__}: {e}. "
            "Write it with tensor operations (torch.where, &, |, comparisons) rather than Python "
            "`if`/`and`/`or` on tensors"
        ) from e
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ReturnShapeError(
            f"{what} {fn_name(fn)} returned {got} for index tensors of shape {tuple(shape)}; "
            "it must return one value per (b, h, q_idx, kv_idx) element"
        )
    return out


def check_bool(out: torch.Tensor, fn) -> torch.Tensor:
    if out.dtype != torch.bool:
        raise ReturnTypeError(
            f"mask_mod {fn_name(fn)} must return a bool tensor (True = attend), got {out.dtype}; "
            "return a comparison such as `q_idx >= kv_idx`, or `.bool()` a 0/1 tensor "
            "(additive float biases belong in score_mod=)"
        )
    return out


def evaluate(fn, B, H, Sq, Sk, q_offset, device, kv_offset=0):
    """Evaluate a mask_mod on the whole grid -> bool, 4-D, broadcastable to ``(B, H, Sq, Sk)``:
    queries at positions ``q_offset + row``, keys at ``kv_offset + column``.

    Broadcasting is tried first, then FlexAttention-style vmap (see :func:`call_elementwise`).
    """
    b, h, q, kv = index_grids(B, H, Sq, Sk, q_offset, device, kv_offset)
    out = check_bool(call_elementwise(fn, (b, h, q, kv), "mask_mod"), fn)
    return out.to(q.device)
