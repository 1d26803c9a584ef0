"""The backend registry serves dense and paged attention alike: names, select, explain.

Numbers are checked per backend elsewhere (test_attention.py, test_paged.py); here: which backend
runs, that explain says so for paged calls too, and that every "no" comes with its reason.
"""

from __future__ import annotations

import pytest
import torch

import selfattn as sa
from selfattn import masks, scores
from selfattn.cache import paged_attention
from selfattn.kernels import paged_decode
from selfattn.testing import make_qkv
from test_paged import check, make_paged, spy_paged_backends

needs_c_kernel = pytest.mark.skipif(
    paged_decode.library() is None, reason="no C compiler here: the kernel cannot be built"
)


def test_dense_triton_is_registered_and_declines_with_its_reason():
    """DESIGN lists backend="triton"; until a dense Triton kernel exists it declines every call,
    saying so, in explain and when asked for by name."""
    assert "triton" in sa.backends.names()
    q, k, v = make_qkv(1, 2, 5, 8, seed=2)
    why = sa.backends.explain(q, k, v, print_table=False).reasons["triton"]
    assert "no dense Triton kernel" in why
    with pytest.raises(ValueError, match="backend 'triton' cannot run this call: no dense Triton"):
        sa.attention(q, k, v, backend="triton")


def test_paged_backends_are_their_own_kind():
    assert set(sa.backends.names("paged")) == {"torch", "cpu", "triton"}
    assert all(sa.backends.get(n, "paged").kind == "paged" for n in sa.backends.names("paged"))
    assert "cpu" not in sa.backends.names()  # not offered to attention()
    with pytest.raises(ValueError, match=r"unknown paged backend 'sdpa'.*'cpu'"):
        sa.backends.get("sdpa", kind="paged")
    with pytest.raises(ValueError, match="unknown backend kind 'sparse'"):
        sa.backends.names("sparse")


@needs_c_kernel
def test_explain_paged_names_the_choice_and_every_reason(monkeypatch):
    """explain_paged takes paged_attention's arguments; auto runs what it names."""
    monkeypatch.delenv("SELFATTN_PAGED_TRITON", raising=False)
    args = make_paged([23, 9], 4, 2, D=8, P=4, Sq=1, seed=5)
    ex = sa.backends.explain_paged(*args, mask=masks.causal(), print_table=False)
    assert ex.chosen == "cpu" and "C kernel" in ex.why
    assert set(ex.reasons) == {"torch", "cpu", "triton"} and ex.reasons["torch"] is None
    text = str(ex)
    assert text.splitlines()[0].startswith("auto -> cpu")
    assert all(any(ln.split()[:1] == [n] for ln in text.splitlines()) for n in ("torch", "triton"))
    ran = spy_paged_backends(monkeypatch)
    paged_attention(*args, mask=masks.causal())
    assert ran == ["cpu"]

    ex = sa.backends.explain_paged(*args, score_mod=scores.softcap(5.0), print_table=False)
    assert ex.chosen == "torch" and "score_mod" in ex.reasons["cpu"]
    ex = sa.backends.explain_paged(*make_paged([23, 40], 4, 2, D=8, P=4, Sq=17), print_table=False)
    assert ex.chosen == "torch" and "Sq=17 > 16" in ex.reasons["cpu"]
    monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    ex = sa.backends.explain_paged(*args, print_table=False)
    assert ex.chosen == "torch" and "SELFATTN_DECODE_KERNEL=0" in ex.reasons["cpu"]


def test_explain_paged_prints_by_default_and_validates_like_paged_attention(capsys):
    args = make_paged([7], 2, 1, D=8, P=4, Sq=1, seed=6)
    ex = sa.backends.explain_paged(*args)
    assert str(ex) in capsys.readouterr().out
    q, kp, vp, table, _ = args  # table (1, 3), P = 4: room for 12 tokens
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=13 exceeds the capacity"):
        sa.backends.explain_paged(q, kp, vp, table, torch.tensor([13]))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_paged_backend_by_name_runs_that_backend(monkeypatch, backend):
    if backend == "cpu" and paged_decode.library() is None:
        pytest.skip("no C compiler here: the kernel cannot be built")
    q, kp, vp, table, lens = make_paged([23, 9, 14], 4, 2, D=8, P=4, Sq=2, seed=7)
    ran = spy_paged_backends(monkeypatch)
    check(q, kp, vp, table, lens, mask=masks.sliding_window(5), backend=backend)
    assert ran == [backend]


def test_paged_backend_by_name_that_cannot_run_says_why():
    q, kp, vp, table, lens = make_paged([23, 9], 4, 2, D=8, P=4, Sq=1, seed=8)
    with pytest.raises(ValueError, match=r"backend 'cpu' cannot run this call: a score_mod.*"):
        paged_attention(q, kp, vp, table, lens, score_mod=scores.softcap(5.0), backend="cpu")
    with pytest.raises(ValueError, match="explain_paged"):
        paged_attention(q.double(), kp.double(), vp.double(), table, lens, backend="cpu")
    with pytest.raises(ValueError, match="unknown paged backend 'sdpa'"):
        paged_attention(q, kp, vp, table, lens, backend="sdpa")
