"""Learned attention sinks (gpt-oss): ``attention(..., sinks=(Hq,))`` on every backend that runs
them, against the float64 reference (which adds the sink to each row's denominator), the paged
backends and kernels, ``nn.MultiHeadAttention(sinks=True)``, and the errors."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import selfattn as sa
from selfattn import masks
from selfattn.cache import paged_attention
from selfattn.kernels import paged_decode
from selfattn.testing import (
    GRAD_FACTOR,
    assert_close_to_reference,
    check_against_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)
from tests._kernel_helpers import c_kernel
from tests.cache.test_paged import check, make_paged

DENSE = ["reference", "chunked", "sdpa"]  # flex on CPU has no lse (declines; explain says why)
MASKS = {
    "none": lambda S: None,
    "causal": lambda S: masks.causal(),
    "window": lambda S: masks.sliding_window(3),
    "documents": lambda S: masks.documents(torch.arange(S) * 3 // S),
    "padding": lambda S: masks.padding(torch.tensor([S - 2, S])),
}


def _sinks(Hq, seed, dtype=torch.float32, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(Hq, generator=g, dtype=torch.float64) * scale).to(dtype)


def _explicit(q, k, v, sinks, mask=None):
    """The sink written out as one more key with score ``sink`` and value 0, in float64."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    kk, vv = (t.double().repeat_interleave(Hq // Hkv, 1) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(D)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    s = torch.cat([s, sinks.double().view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], -1)
    p = s.softmax(-1)[..., :-1]
    return p @ vv, torch.logsumexp(s, -1)


def test_reference_is_the_explicit_extra_key():
    q, k, v = make_qkv(2, 4, 7, 8, Hkv=2, Sk=9, dtype=torch.float64, seed=1)
    sinks = _sinks(4, 2, torch.float64)
    out, lse = sa.attention(q, k, v, sinks=sinks, backend="reference", return_lse=True)
    o, l = _explicit(q, k, v, sinks)
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(lse, l)
    w = sa.attention_weights(q, k, v, sinks=sinks)
    assert bool((w.sum(-1) < 1).all())  # the sink keeps part of every row's weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("backend", sa.backends.names())
def test_backends_against_oracle(backend, mask, dtype):
    """out, lse and dq/dk/dv by the ratio rule; GQA, odd sizes, Sq != Sk. Every registered
    backend that runs sinks here (with gradients, else for inference), the others skipped with
    their reason (sdpa: its lse has no gradient; flex on CPU: no backward and no lse, inference
    with the sink as one more key column; triton: only under TRITON_INTERPRET on CPU)."""
    if backend == "flex":
        pytest.skip("flex compiles a kernel per mask and dtype: test_flex_sinks_on_cpu covers it")
    seed = sum(map(ord, f"{backend}{mask}{dtype}")) % 1000
    Sq, Sk = (7, 11) if mask != "documents" else (11, 11)
    q, k, v = make_qkv(2, 6, Sq, 16, Hkv=2, Sk=Sk, dtype=dtype, seed=seed)
    sinks = _sinks(6, seed + 1)
    kw = {"mask": MASKS[mask](Sk), "sinks": sinks, "print_table": False}
    grad = sa.backends.explain(*(t.requires_grad_() for t in (q, k, v)), **kw).reasons[backend]
    q, k, v = (t.detach() for t in (q, k, v))
    grad = grad is None
    if not grad:
        reason = sa.backends.explain(q, k, v, **kw).reasons[backend]
        if reason is not None:
            pytest.skip(f"{backend}: {reason}")
    lse = sa.backends.explain(q, k, v, return_lse=True, **kw).reasons[backend] is None
    check_against_reference(
        functools.partial(sa.attention, backend=backend),
        q, k, v, grad=grad, lse=lse, seed=seed, mask=MASKS[mask](Sk), sinks=sinks,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_sink_gradient_against_oracle(backend, dtype):
    """d(sinks) by the ratio rule (3x the naive low-precision error), with dropout-free causal."""
    q, k, v = make_qkv(2, 4, 9, 16, Hkv=1, Sk=13, dtype=dtype, seed=5)
    sinks = _sinks(4, 6).requires_grad_(True)
    dout = torch.randn(2, 4, 9, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    kw = {"mask": masks.causal(), "sinks": sinks}
    out = sa.attention(q, k, v, backend=backend, **kw)
    (ds,) = torch.autograd.grad(out, sinks, dout.to(dtype))
    s64 = sinks.detach().double().requires_grad_(True)
    o64, _, _ = reference_attention(q, k, v, mask=masks.causal(), sinks=s64)
    (ds64,) = torch.autograd.grad(o64, s64, dout)
    sn = sinks.detach().to(dtype).requires_grad_(True)
    on, _, _ = naive_attention(q, k, v, mask=masks.causal(), sinks=sn)
    (dsn,) = torch.autograd.grad(on, sn, dout.to(dtype))
    assert_close_to_reference(ds, ds64, dsn, factor=GRAD_FACTOR, dtype=dtype, what="dsinks")


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_gradcheck_fp64(backend):
    q, k, v = make_qkv(1, 2, 3, 4, Hkv=1, Sk=5, dtype=torch.float64, seed=3, requires_grad=True)
    sinks = _sinks(2, 4, torch.float64).requires_grad_(True)

    def f(q, k, v, s):
        return sa.attention(
            q, k, v, mask=masks.sliding_window(3), sinks=s, backend=backend, return_lse=True
        )

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_chunked_sink_starts_the_softmax_in_every_tile():
    """Chunked folds the sink into each row's online softmax (m0 = sink, l0 = 1): tiny tiles,
    a query tile with no key at all (rows 0-3), rows empty inside a tile (row 6), a -inf sink
    and +inf (merged after the tiles instead): output, lse and every gradient (gradcheck)."""
    from tests.backends.test_chunked import SMALL_TILES, chunked_attention

    q, k, v = make_qkv(1, 2, 9, 4, Hkv=1, Sk=7, dtype=torch.float64, seed=11, requires_grad=True)
    g = torch.Generator().manual_seed(12)
    allowed = torch.rand(9, 7, generator=g) < 0.6
    allowed[:4] = False
    allowed[6] = False
    sinks = _sinks(2, 13, torch.float64).requires_grad_(True)

    def f(q, k, v, s):
        return chunked_attention(q, k, v, mask=allowed, sinks=s, return_lse=True, **SMALL_TILES)

    out, lse = f(q, k, v, sinks)
    o, ref_lse = _explicit(q.detach(), k, v, sinks.detach(), allowed)
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.autograd.gradcheck(f, (q, k, v, sinks))
    for edge in (-math.inf, math.inf):
        s = torch.tensor([edge, 0.5], dtype=torch.float64)
        out, lse = f(q.detach(), k, v, s)
        o, ref_lse = _explicit(q.detach(), k, v, s, allowed)
        if edge == math.inf:  # the sink takes all the weight, everywhere
            assert bool((out[:, 0] == 0).all()) and bool((lse[:, 0] == math.inf).all())
        else:  # empty rows: no weight anywhere (the oracle's softmax gives NaN there)
            torch.testing.assert_close(out[:, 0], o[:, 0].nan_to_num(0.0))
            torch.testing.assert_close(lse[:, 0], ref_lse[:, 0])
        torch.testing.assert_close(out[:, 1], o[:, 1])


@pytest.mark.parametrize("backend", DENSE)
def test_empty_rows_give_zero_and_the_sink_as_lse(backend):
    """A row with no allowed key: the sink takes all the weight (output 0, lse = sink), and
    gradients stay finite (zero for q; d(sinks) from the other rows only)."""
    q, k, v = make_qkv(1, 2, 4, 8, Sk=4, seed=8)
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[1] = False  # row 1 attends nothing
    sinks = _sinks(2, 9)
    ctx = torch.no_grad() if backend == "sdpa" else torch.enable_grad()
    with ctx:
        q.requires_grad_(backend != "sdpa")
        out, lse = sa.attention(
            q, k, v, mask=allowed, sinks=sinks, backend=backend, return_lse=True
        )
    assert bool((out[:, :, 1] == 0).all())
    torch.testing.assert_close(lse[0, :, 1], sinks)
    o, _ = _explicit(q.detach(), k, v, sinks, allowed)
    torch.testing.assert_close(out.double(), o, atol=1e-5, rtol=1e-5)
    if backend != "sdpa":
        (dq,) = torch.autograd.grad(out.sum() + lse[torch.isfinite(lse)].sum(), q)
        assert bool(torch.isfinite(dq).all()) and bool((dq[:, :, 1] == 0).all())


@pytest.mark.parametrize("backend", DENSE)
def test_minus_inf_sink_is_no_sink(backend):
    q, k, v = make_qkv(2, 2, 5, 8, Sk=5, seed=10)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    allowed[2] = False
    sinks = torch.tensor([-math.inf, 0.5])
    out, lse = sa.attention(q, k, v, mask=allowed, sinks=sinks, backend=backend, return_lse=True)
    plain, plain_lse = sa.attention(q, k, v, mask=allowed, backend=backend, return_lse=True)
    torch.testing.assert_close(out[:, 0], plain[:, 0])
    torch.testing.assert_close(lse[:, 0], plain_lse[:, 0])
    assert not bool(out.isnan().any()) and lse[0, 0, 2] == -math.inf and lse[0, 1, 2] == 0.5


@pytest.mark.slow
def test_flex_sinks_on_cpu():
    """CPU FlexAttention returns no lse to merge the sink through, so flex runs it as one more
    key column (zero K/V, score ``sinks[h]``, attended by every row): inference only (no backward
    on CPU), no lse. Partial tiles (documents), GQA, the sink column in a tile of its own
    (Sk = 128), rows with no key (padding 0) and a -inf sink. (CUDA takes the lse path; untested
    here.)"""
    q, k, v = make_qkv(2, 6, 11, 16, Hkv=2, seed=21)
    sinks = _sinks(6, 22)
    why = sa.backends.explain(q, k, v, print_table=False).reasons["flex"]  # without sinks
    if why is not None:
        pytest.skip(f"flex cannot run here: {why}")
    docs = masks.documents(torch.arange(11) * 3 // 11)
    check_against_reference(
        functools.partial(sa.attention, backend="flex"),
        q, k, v, grad=False, lse=False, mask=docs, sinks=sinks,
    )  # fmt: skip
    q, k, v = make_qkv(2, 2, 5, 16, Sk=128, seed=23)
    sinks = torch.tensor([-math.inf, 0.7])
    pad = masks.padding(torch.tensor([128, 0]))  # sequence 1: no key at all
    out = sa.attention(q, k, v, mask=pad, sinks=sinks, backend="flex")
    ref = sa.attention(q, k, v, mask=pad, sinks=sinks, backend="reference")
    torch.testing.assert_close(out, ref)
    assert bool((out[1] == 0).all())
    grad = sa.backends.explain(q.requires_grad_(), k, v, sinks=sinks, print_table=False)
    assert "no backward on CPU" in grad.reasons["flex"]
    lse = sa.backends.explain(q.detach(), k, v, sinks=sinks, return_lse=True, print_table=False)
    assert "log-sum-exp" in lse.reasons["flex"]


def test_dropout_with_sinks_drops_the_same_pairs():
    """Dropout is counter-based: chunked with sinks equals the reference for one seed."""
    q, k, v = make_qkv(2, 4, 9, 8, Hkv=2, Sk=9, seed=23)
    sinks = _sinks(4, 24)
    outs = [
        sa.attention(q, k, v, mask=masks.causal(), sinks=sinks, dropout_p=0.3, backend=b,
                     generator=torch.Generator().manual_seed(5))
        for b in ("reference", "chunked")
    ]  # fmt: skip
    torch.testing.assert_close(outs[0], outs[1])


def test_no_keys_at_all():
    q, k, v = make_qkv(1, 3, 2, 8, Sk=0, seed=11)
    sinks = _sinks(3, 12)
    out, lse = sa.attention(q, k, v, sinks=sinks, return_lse=True)
    assert bool((out == 0).all())
    torch.testing.assert_close(lse, sinks.view(1, 3, 1).expand(1, 3, 2))


def test_explain_names_the_backends_that_run_sinks():
    q, k, v = make_qkv(1, 2, 4, 8, seed=13, requires_grad=True)
    reasons = sa.backends.explain(q, k, v, sinks=torch.zeros(2), print_table=False).reasons
    assert reasons["reference"] is None and reasons["chunked"] is None
    assert "sinks" in reasons["sdpa"] and "gradients" in reasons["sdpa"]
    assert reasons["triton"] is None or "not installed" in reasons["triton"]  # lse-merged
    with torch.no_grad():
        reasons = sa.backends.explain(q, k, v, sinks=torch.zeros(2), print_table=False).reasons
    assert reasons["sdpa"] is None


@pytest.mark.parametrize(
    "sinks, exc, match",
    [
        (torch.zeros(3), ValueError, r"shape \(Hq,\) = \(4,\).*\(3,\)"),
        (torch.zeros(1, 4), ValueError, r"\(1, 4\)"),
        (torch.zeros(4, dtype=torch.long), TypeError, "float tensor.*int64"),
        ([0.0] * 4, TypeError, "list"),
    ],
)
def test_errors(sinks, exc, match):
    q, k, v = make_qkv(1, 4, 3, 8, seed=14)
    with pytest.raises(exc, match=match):
        sa.attention(q, k, v, sinks=sinks)


# -- paged --------------------------------------------------------------------------------------


@pytest.mark.parametrize("Sq", [1, 3])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_paged_matches_oracle(path, Sq, monkeypatch):
    """paged == dense: the C kernel and the PyTorch path, ragged lengths, GQA, causal."""
    if path == "torch":
        monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    else:
        c_kernel(paged_decode)
    args = make_paged([5, 13, 1 + Sq], 4, 2, 8, 4, Sq=Sq, seed=15)
    sinks = _sinks(4, 16)
    check(*args, mask=masks.causal(), sinks=sinks)
    check(*args, mask=masks.sliding_window(2), sinks=sinks)


def test_paged_empty_row_and_every_backend_runs_it():
    q, kp, vp, table, lens = make_paged([6, 9], 2, 1, 8, 4, Sq=2, seed=17)
    sinks = _sinks(2, 18)
    reasons = sa.backends.explain_paged(q, kp, vp, table, lens, sinks=sinks, print_table=False)
    assert reasons.reasons["torch"] is None
    out, lse = paged_attention(
        q, kp, vp, table, lens, mask=lambda b, h, qi, ki: ki > 100, sinks=sinks, return_lse=True
    )
    assert bool((out == 0).all())
    torch.testing.assert_close(lse, sinks.view(1, 2, 1).expand(2, 2, 2))


def test_triton_kernel_interpreted(monkeypatch):
    """The Triton paged kernel, interpreted on CPU (conftest sets TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    args = make_paged([5, 7], 4, 2, 16, 4, Sq=1, seed=19)
    sinks = _sinks(4, 20)
    reason = sa.backends.explain_paged(*args, sinks=sinks, print_table=False).reasons["triton"]
    if reason is not None:
        pytest.skip(f"the Triton paged backend cannot run here: {reason}")
    out, lse = paged_attention(*args, sinks=sinks, backend="triton", return_lse=True)
    monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    ref, ref_lse = paged_attention(*args, sinks=sinks, backend="torch", return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


# -- nn ----------------------------------------------------------------------------------------


def test_multihead_attention_owns_the_sinks():
    torch.manual_seed(21)
    m = sa.nn.MultiHeadAttention(16, 4, 2, sinks=True, bias=False)
    assert m.sinks.shape == (4,) and bool((m.sinks == 0).all())
    with torch.no_grad():
        m.sinks.normal_()
    x = torch.randn(2, 5, 16)
    m(x, mask=masks.causal()).sum().backward()
    assert m.sinks.grad is not None and bool((m.sinks.grad != 0).all())
    plain = sa.nn.MultiHeadAttention(16, 4, 2, bias=False)
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if k != "sinks"})
    assert plain.sinks is None
    assert not torch.allclose(m(x, mask=masks.causal()), plain(x, mask=masks.causal()))


def test_multihead_attention_paged_decode_equals_full_forward():
    torch.manual_seed(22)
    m = sa.nn.MultiHeadAttention(16, 4, 2, sinks=True, bias=False).eval()
    with torch.no_grad():
        m.sinks.normal_()
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        full = m(x, mask=masks.causal())
        cache = sa.cache.PagedCache(8, 4, 2, 4, max_seqs=2, max_pages_per_seq=4)
        view = cache.view(cache.add_sequences(2))
        steps = [m(x[:, :3], mask=masks.causal(), cache=view)]
        steps += [m(x[:, i : i + 1], mask=masks.causal(), cache=view) for i in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_c_kernel_starts_each_row_from_its_sink():
    """The C kernel merges the sink once per row (key splits included) == its PyTorch twin."""
    c_kernel(paged_decode)
    from selfattn.kernels.paged_twin import paged_attention_twin

    q, kp, vp, table, lens = make_paged([40, 3, 17], 4, 2, 8, 4, Sq=2, seed=25)
    lo = torch.tensor([[0, 0], [2, 3], [20, 20]])  # sequence 2's rows attend nothing
    hi = torch.stack([lens - 1, lens]).T.clamp(max=lens.view(-1, 1)).long()
    hi[2] = 20
    sinks = _sinks(4, 26)
    out, lse = paged_decode.decode(q, kp, vp, table, lo, hi, 0.3, None, None, sinks)
    ref, ref_lse = paged_attention_twin(q, kp, vp, table, lo, hi, 0.3, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert bool((out[2] == 0).all()) and torch.equal(lse[2], sinks.view(4, 1).expand(4, 2))
    torch.library.opcheck(
        torch.ops.selfattn.paged_decode_cpu.default,
        (q, kp, vp, table, lo, hi, 0.3, None, None, sinks),
    )


def test_paged_sinks_with_gradients_take_the_pytorch_path():
    q, kp, vp, table, lens = make_paged([6, 9], 2, 1, 8, 4, Sq=1, seed=27)
    sinks = _sinks(2, 28).requires_grad_(True)
    why = sa.backends.explain_paged(q, kp, vp, table, lens, sinks=sinks, print_table=False)
    assert "gradients" in why.reasons["cpu"]
    paged_attention(q, kp, vp, table, lens, sinks=sinks).sum().backward()
    assert sinks.grad is not None and bool((sinks.grad != 0).all())
