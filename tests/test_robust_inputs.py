"""Robustness of user inputs: user callables' own failures, out-of-range positions.

Errors raised inside a mask/score-mod callable reach the caller as they are, after one call;
only the failures that mean "this code does not broadcast" are retried element by element.
Positions that would overflow int64 (or float64's exact integers, for RoPE angles) are refused
with a ValueError naming the value and the valid range.
"""

from __future__ import annotations

import re

import pytest
import torch

import selfattn
from selfattn import masks
from selfattn.positions import RoPE, Sinusoidal
from selfattn.testing import make_qkv


def raises(exc, *fragments):
    """``pytest.raises`` requiring every fragment (matched literally) in the message."""
    return pytest.raises(exc, match="".join(f"(?=.*{re.escape(f)})" for f in fragments))


@pytest.fixture
def qkv():
    return make_qkv(2, 4, 5, 8, Hkv=2, Sk=7, Dv=6, seed=11)


class UserError(Exception):
    """An error class of the user's own."""


class UserValueError(ValueError):
    """A user error that subclasses a built-in the vmap fallback handles: still the user's."""


def _oom() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


FAILURES = {
    "MemoryError": lambda: MemoryError("no room"),
    "torch.OutOfMemoryError": _oom,
    "user class": lambda: UserError("document table is stale"),
    "user ValueError subclass": lambda: UserValueError("bad document id"),
}


def _counting(n_args: int, error: BaseException):
    """A callable of ``n_args`` arguments that counts its calls and raises ``error``."""
    calls = []

    def fn(*args):
        assert len(args) == n_args
        calls.append(1)
        raise error

    return fn, calls


@pytest.mark.parametrize(
    ("kind", "backend"),
    [
        ("mask", "auto"),
        ("mask", "reference"),
        ("mask", "chunked"),
        ("score_mod", "auto"),
        ("score_mod", "reference"),
        ("score_mod", "chunked"),
    ],
)
@pytest.mark.parametrize("failure", list(FAILURES))
def test_callable_failure_arrives_unchanged_after_one_call(qkv, failure, kind, backend):
    # q requires grad: chunked then probes a score_mod for unlisted gradient sources first
    q, k, v = qkv
    q = q.detach().requires_grad_(True)
    error = FAILURES[failure]()
    fn, calls = _counting(4 if kind == "mask" else 5, error)
    with pytest.raises(type(error)) as got:
        selfattn.attention(q, k, v, **{kind: fn}, backend=backend)
    assert got.value is error
    assert len(calls) == 1


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failure_under_the_vmap_fallback_also_arrives_unchanged(qkv, failure):
    # torch.stack needs equal shapes, so the broadcast call fails as non-broadcasting code does
    # and the vmap retry runs; the user's error raised there is not rewrapped either.
    q, k, v = qkv
    error = FAILURES[failure]()
    calls = []

    def fn(b, h, q_idx, kv_idx):
        calls.append(1)
        torch.stack([q_idx, kv_idx])
        raise error

    with pytest.raises(type(error)) as got:
        selfattn.attention(q, k, v, mask=fn, backend="reference")
    assert got.value is error
    assert len(calls) == 2  # once broadcast, once under vmap


def test_python_if_on_a_tensor_still_gets_the_helpful_error(qkv):
    q, k, v = qkv

    def python_if(b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return torch.tensor(True)
        return torch.tensor(False)

    with raises(ValueError, "python_if", "Boolean value of Tensor", "Python `if`"):
        selfattn.attention(q, k, v, mask=python_if, backend="reference")


@pytest.mark.parametrize(
    "fn",
    [
        lambda b, h, q_idx, kv_idx: torch.stack([q_idx, kv_idx]).diff(dim=0)[0] <= 0,  # stack
        lambda b, h, q_idx, kv_idx: q_idx.reshape(1)[0] >= kv_idx.reshape(1)[0],  # reshape(1)
    ],
    ids=["stack", "reshape"],
)
def test_non_broadcasting_callables_still_run_under_vmap(qkv, fn):
    q, k, v = qkv
    got = selfattn.attention(q, k, v, mask=fn, backend="reference")
    want = selfattn.attention(q, k, v, mask=masks.causal(), backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- positions -------------------------------------------------------------------------------------
LIMIT = 1 << 62


@pytest.mark.parametrize("q_offset", [2**63 - 3, 2**63 - 1, 2**64, -(2**63), LIMIT - 3], ids=str)
@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa", "cpu_fused", "triton"])
def test_q_offset_past_int64_is_refused(qkv, q_offset, backend):
    # Sq = 5: positions q_offset .. q_offset + 4; on main 2**63 - 3 wrapped silently and the
    # wrapped rows saw no key at all.
    q, k, v = qkv
    with raises(ValueError, f"q_offset={q_offset}", "2**62", str(LIMIT)):
        selfattn.attention(q, k, v, mask=masks.causal(), q_offset=q_offset, backend=backend)


def test_q_offset_at_the_limit_is_accepted(qkv):
    q, k, v = qkv
    far = selfattn.attention(q, k, v, mask=masks.sliding_window(3), q_offset=LIMIT - 4)
    near = selfattn.attention(q, k, v, mask=masks.causal(), q_offset=-LIMIT)
    assert far.isfinite().all() and near.isfinite().all()


@pytest.mark.parametrize("offset", ["q_offset", "kv_offset"])
def test_tile_grid_positions_past_int64_are_refused(offset):
    with raises(ValueError, f"TileGrid {offset}={2**63 - 2}", "2**62"):
        masks.TileGrid(5, 7, 2, 2, **{offset: 2**63 - 2})


def test_to_dense_q_offset_past_int64_is_refused():
    with raises(ValueError, "to_dense q_offset", "2**62"):
        masks.causal().to_dense(3, 4, q_offset=2**63 - 2)


def test_window_size_past_the_position_range_is_refused():
    # q_idx - size wraps for a negative q_idx once size > 2**62
    with raises(ValueError, "sliding_window size", "2**62", str(2**63 - 1)):
        masks.sliding_window(2**63 - 1)


@pytest.mark.parametrize("module", ["rope", "sinusoidal"])
def test_positions_past_float64_exact_integers_are_refused(module):
    # float64 holds integers exactly up to 2**53: 2**60 and 2**60 + 1 got one angle on main
    positions = torch.tensor([0, 2**60, 2**60 + 1])
    with raises(ValueError, "positions must be <= 2**53", f"got max {2**60 + 1}"):
        if module == "rope":
            RoPE(8)(torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(3)), positions)
        else:
            Sinusoidal(8)(positions)


@pytest.mark.parametrize("failure", list(FAILURES))
def test_flex_passes_a_callable_failure_on_without_retrying(qkv, failure, monkeypatch):
    # flex traces score mods inside its compiled kernel; a compile failure is retried with static
    # shapes and then declined (auto falls back), but the user's own error or an out-of-memory is
    # no compile failure: it arrives unchanged from the first attempt. (The fake compiled kernel
    # stands in for torch.compile, which takes ~10 s on CPU and raises the user's error as is.)
    from selfattn.backends import flex as flex_backend

    if flex_backend._api() is None:
        pytest.skip("this torch has no FlexAttention")
    error = FAILURES[failure]()
    attempts = []

    def compiled(mode=None, case=None):
        def run(q, k, v, **kwargs):
            attempts.append(mode)
            raise error

        return run

    monkeypatch.setattr(flex_backend, "_compiled", compiled)
    monkeypatch.setattr(flex_backend, "_FAILED", {})
    q, k, v = qkv
    with torch.no_grad(), pytest.raises(type(error)) as got:
        selfattn.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s, backend="flex")
    assert got.value is error and len(attempts) == 1
    assert flex_backend._FAILED == {}  # not recorded as a case flex cannot compile
