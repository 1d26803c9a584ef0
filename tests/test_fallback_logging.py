"""Every fallback off a fast path is said once on the ``selfattn`` logger (and the answer stays
exact): fused kernels redoing non-finite calls, a backend that failed to compile, Triton missing
on CUDA. The C kernel's build failures are tested with the kernel (tests/test_robust_paged.py).
"""

from __future__ import annotations

import logging

import pytest
import torch

import selfattn as sa
from selfattn import _log, backends
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """Nothing said yet in this process, and every ``selfattn`` record captured."""
    monkeypatch.setattr(_log, "_said", set())
    caplog.set_level(logging.INFO, logger="selfattn")
    return lambda: [r for r in caplog.records if r.name == "selfattn"]


def _check(out, q, k, v, **kwargs) -> None:
    """``out`` against the float64 reference, by the ratio rule."""
    oracle, naive = reference_attention(q, k, v, **kwargs)[0], naive_attention(q, k, v, **kwargs)[0]
    assert_close_to_reference(out, oracle, naive)


def _qkv(seed: int, Sq: int = 11, Sk: int = 11):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, Sq, 16, generator=g)
    k, v = (torch.randn(2, 2, Sk, 16, generator=g) for _ in range(2))
    return q, k, v


def test_log_once_says_each_key_once(fresh_log):
    assert _log.log_once(("a", 1), logging.WARNING, "first %s", "x")
    assert not _log.log_once(("a", 1), logging.WARNING, "again %s", "x")
    assert _log.log_once(("a", 2), logging.INFO, "other")
    assert [r.getMessage() for r in fresh_log()] == ["first x", "other"]


def test_sdpa_redo_of_nan_in_padded_keys_is_logged_once(fresh_log):
    """NaN in key slots no row attends (a padded cache): sdpa redoes the call with them zeroed,
    says so once, and the result equals the reference on the clean keys."""
    q, k, v = _qkv(1)
    mask = sa.masks.causal() & sa.masks.padding(torch.tensor([7, 9]))
    k[0, :, 8:] = float("nan")  # beyond sequence 0's 7 keys
    v[1, :, 9:] = float("inf")
    for _ in range(3):
        out = sa.attention(q, k, v, mask=mask, backend="sdpa")
    assert torch.isfinite(out).all()
    clean_k, clean_v = k.nan_to_num(0.0), v.nan_to_num(0.0, posinf=0.0)
    _check(out, q, clean_k, clean_v, mask=mask)
    [record] = fresh_log()
    assert record.levelno == logging.INFO
    assert "sdpa" in record.getMessage() and "zeroed" in record.getMessage()


def test_sdpa_redo_by_the_exact_path_is_logged_once(fresh_log):
    """NaN in V at a key that rows attend: the exact path answers (NaN only in those rows)."""
    q, k, v = _qkv(2)
    v[:, :, 4] = float("nan")
    for _ in range(2):
        out = sa.attention(q, k, v, mask=sa.masks.causal(), backend="sdpa")
    assert torch.isfinite(out[:, :, :4]).all() and out[:, :, 4:].isnan().all()
    [record] = fresh_log()
    assert "sdpa" in record.getMessage() and "exact path" in record.getMessage()


def test_finite_calls_log_nothing(fresh_log):
    q, k, v = _qkv(3)
    sa.attention(q, k, v, mask=sa.masks.causal(), backend="sdpa")
    assert fresh_log() == []


def test_auto_after_a_compile_failure_says_which_backend_runs(fresh_log, monkeypatch):
    """A backend auto chose fails to compile: auto runs the next one and says so, once."""
    real_select = backends.select

    class FailsToCompile:
        name = "flex"

        @staticmethod
        def run(q, k, v, call):
            raise backends.BackendCompileError("inductor: no C++ compiler")

    calls = []

    def select(q, k, v, call, backend):
        calls.append(backend)
        if len(calls) % 2:  # the first choice of each attention() call fails to compile
            return FailsToCompile, None
        return real_select(q, k, v, call, backend)

    monkeypatch.setattr(backends, "select", select)
    q, k, v = _qkv(4)
    for _ in range(2):
        out = sa.attention(q, k, v, mask=sa.masks.causal())
    _check(out, q, k, v, mask=sa.masks.causal())
    [record] = fresh_log()
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "'flex' failed to compile" in message and "no C++ compiler" in message
    chosen = real_select(q, k, v, sa.call.prepare(q, k, v, mask=sa.masks.causal())[3], "auto")
    assert f"auto runs {chosen[0].name!r} instead" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_decode_on_cuda_without_triton_is_logged_once(fresh_log, monkeypatch):
    from selfattn.kernels import triton as triton_kernels

    monkeypatch.setattr(triton_kernels, "available", lambda: False)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 16, generator=g).cuda()
    k_pages, v_pages = (torch.randn(6, 4, 2, 16, generator=g).cuda() for _ in range(2))
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], device="cuda")
    lens = torch.tensor([9, 12], device="cuda")
    for _ in range(2):
        sa.cache.paged_attention(q, k_pages, v_pages, table, lens)
    [record] = [r for r in fresh_log() if "Triton" in r.getMessage()]
    assert "pip install 'selfattn[triton]'" in record.getMessage()
