"""The dense Triton kernels (``backend="triton"``), run by Triton's interpreter on CPU.

Small shapes only (the interpreter runs every program in Python, with 16 × 16 tiles so that
FULL, PARTIAL and EMPTY tiles all occur); the same kernels run compiled on CUDA
(``python -m selfattn.benchmarks.gpu --part triton`` measures them there). The interpreter's
bf16 ``tl.dot`` is broken, so half inputs are multiplied in float32 there.
"""

from __future__ import annotations

import functools
import importlib
import math
import os

import pytest
import torch

import selfattn as sa
from selfattn import masks, scores
from selfattn.testing import check_against_reference, make_qkv

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernel():
    """The kernel module: interpreted on CPU (conftest sets TRITON_INTERPRET), compiled on CUDA."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    return importlib.import_module("selfattn.kernels.triton.attention")


DEV = "cuda" if torch.cuda.is_available() else "cpu"
triton_attention = functools.partial(sa.attention, backend="triton")


def _docs(S: int, cuts) -> torch.Tensor:
    """Document ids ``(S,)`` with documents starting at ``cuts``."""
    ids = torch.zeros(S, dtype=torch.long)
    for c in cuts:
        ids[c:] += 1
    return ids


# (id, mask, Sq, Sk, q_offset or None): every built-in the kernel evaluates from data
MASKS = [
    ("none", None, 21, 35, None),
    ("causal", masks.causal(), 33, 33, None),
    ("causal-bottom-right", masks.causal(), 19, 37, None),  # Sq < Sk: q_offset = 18
    ("causal-offset", masks.causal(), 23, 29, 3),  # any q_offset
    ("causal-Sq>Sk", masks.causal(), 37, 21, 0),  # rows past the keys see them all
    ("window", masks.sliding_window(7), 35, 35, None),
    ("chunked", masks.chunked(10), 34, 34, None),
    ("chunked-bidir", masks.chunked(12, causal=False), 30, 30, None),
    ("padding", masks.padding([17, 30]), 25, 30, None),
    ("prefix-lm", masks.prefix_lm([5, 20]), 31, 31, None),
    ("documents", masks.documents(_docs(34, [9, 10, 25])), 34, 34, None),
    ("causal-documents", masks.causal() & masks.documents(_docs(34, [13, 20])), 34, 34, None),
    ("window-padding", masks.sliding_window(9) & masks.padding([26, 11]), 26, 26, None),
]


@pytest.mark.parametrize("case", MASKS, ids=[c[0] for c in MASKS])
def test_masks_match_the_fp64_oracle_with_gradients(kernel, case):
    _, mask, Sq, Sk, q_offset = case
    q, k, v = make_qkv(2, 4, Sq, 16, Hkv=2, Sk=Sk, seed=Sq + Sk, device=DEV)
    check_against_reference(triton_attention, q, k, v, mask=mask, q_offset=q_offset)


SCORE_MODS = [
    ("alibi", lambda H, S: scores.alibi(H), masks.causal()),
    ("softcap", lambda H, S: scores.softcap(2.0), masks.sliding_window(6)),
    ("alibi-softcap", lambda H, S: scores.alibi(H) >> scores.softcap(3.0), None),
    ("bias", lambda H, S: scores.bias(torch.randn(1, H, S, S)), masks.chunked(9)),
    ("bias-per-batch-row", lambda H, S: scores.bias(torch.randn(2, 1, S, 1)), None),
]


@pytest.mark.parametrize("case", SCORE_MODS, ids=[c[0] for c in SCORE_MODS])
def test_score_mods_in_the_kernel_match_the_oracle(kernel, case):
    _, make, mask = case
    q, k, v = make_qkv(2, 4, 27, 16, Hkv=1, seed=len(case[0]), device=DEV)
    mod = make(4, 27)
    check_against_reference(triton_attention, q, k, v, mask=mask, score_mod=mod)


@pytest.mark.parametrize(
    "Hq, Hkv, D, Dv, Sq, Sk",
    [(8, 8, 8, 8, 1, 17), (8, 1, 24, 40, 19, 19), (6, 2, 59, 16, 17, 40), (4, 4, 16, 16, 1, 1)],
    ids=["mha-decode-row", "mqa-Dv>D", "gqa3-odd-D", "one-by-one"],
)
def test_gqa_and_odd_shapes(kernel, Hq, Hkv, D, Dv, Sq, Sk):
    q, k, v = make_qkv(1, Hq, Sq, D, Hkv=Hkv, Sk=Sk, Dv=Dv, seed=D + Dv, device=DEV)
    check_against_reference(triton_attention, q, k, v, mask=masks.causal())


def test_gqa_heads_share_a_tile_with_their_own_mods_and_dropout(kernel):
    """G = 4 query heads of a kv head are the rows of one forward tile (K/V read once for
    them): each row keeps its own head's ALiBi slope, bias row and dropout pattern. Against
    the fp64 reference with the same dropout seed, gradients included."""
    assert kernel.gqa_pack(4, 16) == 4 and kernel.gqa_pack(3, 16) == 1
    q, k, v = make_qkv(2, 8, 13, 16, Hkv=2, Sk=21, seed=18, device=DEV)
    mod = scores.alibi(8) >> scores.bias(torch.randn(1, 8, 13, 21))
    kernel.launches.clear()
    got, want = [], []
    for backend, out in (("triton", got), ("reference", want)):
        dtype = torch.float64 if backend == "reference" else q.dtype
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o = sa.attention(*leaves, mask=masks.sliding_window(9), score_mod=mod, dropout_p=0.25,
                         generator=torch.Generator().manual_seed(5), backend=backend)  # fmt: skip
        o.pow(2).sum().backward()
        out.extend([o.detach(), *(t.grad for t in leaves)])
    assert any(dict(c).get("PACK") == 4 for _, c, _ in kernel.launches)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_inputs(kernel, dtype):
    q, k, v = make_qkv(2, 2, 29, 32, Sk=29, dtype=dtype, seed=5, device=DEV)
    check_against_reference(triton_attention, q, k, v, mask=masks.sliding_window(11))


def test_noncontiguous_views(kernel):
    """Slices of a fused QKV projection and a transposed V (strides the kernel reads as given)."""
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, 21, 3, 4, 16, generator=g).to(DEV)  # (B, S, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    check_against_reference(triton_attention, q, k, v, mask=masks.causal())


def test_empty_rows_give_zero_output_minus_inf_lse_and_zero_gradients(kernel):
    """Sequence 0 has no valid key (padding 0), sequence 1's first rows none either (a window
    that ends before the keys start): output 0, lse -inf, finite zero gradients, never NaN."""
    q, k, v = make_qkv(2, 2, 20, 16, Sk=20, seed=7, device=DEV, requires_grad=True)
    mask = masks.padding([0, 20]) & masks.causal()
    out, lse = triton_attention(q, k, v, mask=mask, q_offset=-4, return_lse=True)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert (out[1, :, :4] == 0).all() and torch.isneginf(lse[1, :, :4]).all()
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (q.grad[0] == 0).all() and (k.grad[0] == 0).all()
    check_against_reference(triton_attention, q, k, v, mask=mask, q_offset=-4)


def test_lse_gradient(kernel):
    """Gradients through the returned lse (ring attention and sinks merge by it)."""
    q, k, v = make_qkv(1, 2, 18, 16, Sk=26, seed=8, device=DEV)
    got = []
    for backend in ("triton", "reference"):
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        if backend == "triton":
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = sa.attention(*leaves, mask=masks.causal(), backend=backend, return_lse=True)
        (out.sum() + (lse * torch.linspace(-1, 1, 18, dtype=lse.dtype)).sum()).backward()
        got.append([t.grad.double() for t in leaves])
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_dropout_drops_the_same_pairs_as_chunked(kernel):
    """The counter-based hash in uint32 inside the kernel: with V = the identity, each output
    entry is one weight, zero exactly where the pair was dropped; the pattern and the values
    equal chunked's, and so do the gradients."""
    Sk = 32
    q, k, _ = make_qkv(2, 2, 24, 16, Sk=Sk, seed=9, device=DEV)
    v = torch.eye(Sk, device=DEV).expand(2, 2, Sk, Sk).contiguous()
    results = {}
    for backend in ("triton", "chunked"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        gen = torch.Generator().manual_seed(1234)
        out = sa.attention(*leaves, mask=masks.causal(), dropout_p=0.4, generator=gen,
                           backend=backend)  # fmt: skip
        out.pow(2).sum().backward()
        results[backend] = (out.detach(), [t.grad for t in leaves])
    (ot, gt), (oc, gc) = results["triton"], results["chunked"]
    attended = (torch.arange(Sk) <= torch.arange(24).view(-1, 1) + Sk - 24).expand_as(oc)
    share = (oc == 0)[attended].float().mean()
    assert 0.3 < share < 0.5  # about p of the attended pairs are dropped
    assert torch.equal(ot == 0, oc == 0)
    torch.testing.assert_close(ot, oc, rtol=1e-5, atol=1e-6)
    for a, b in zip(gt, gc):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_deterministic_backward_is_bitwise_reproducible(kernel):
    """``torch.use_deterministic_algorithms(True)``: dQ in its own pass, no atomics; equal (to
    rounding) to the atomic path, and bitwise the same run after run."""
    q, k, v = make_qkv(1, 4, 33, 16, Hkv=2, seed=10, device=DEV)
    mask = masks.causal() & masks.documents(_docs(33, [11]))

    def grads():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        triton_attention(*leaves, mask=mask).sum().backward()
        return [t.grad for t in leaves]

    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        first, second = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(before)
    atomic = grads()
    for a, b, c in zip(first, second, atomic):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_new_windows_documents_and_lengths_reuse_the_compiled_kernel(kernel):
    """Ten windows, ten document layouts and ten lengths: every launch is specialised on the
    same constexprs and int properties, so Triton compiles each kernel once (on a GPU the
    benchmark counts the JIT cache itself). A new head dim does compile anew: the check can
    fail."""

    def keys(calls, backward=False):
        kernel.launches.clear()
        for mask, S in calls:
            q, k, v = make_qkv(1, 1, S, 16, seed=S, device=DEV, requires_grad=backward)
            out = triton_attention(q, k, v, mask=mask)
            if backward:
                out.sum().backward()
        return {(name, constexprs, spec) for name, constexprs, spec in kernel.launches}

    g = torch.Generator().manual_seed(11)
    windows = [(masks.sliding_window(w), 33) for w in range(3, 33, 3)]
    cuts = [sorted(torch.randperm(32, generator=g)[:n] + 1) for n in range(1, 11)]
    docs = [(masks.causal() & masks.documents(_docs(33, c)), 33) for c in cuts]
    lengths = [(masks.causal(), S) for S in (1, 16, 17, 18, 31, 32, 33, 40, 47, 48)]
    for calls in (windows, docs, lengths):
        assert len(keys(calls)) == 1, keys(calls)  # the forward kernel
    # the forward and dK/dV kernels (dQ by atomics): one key each
    assert len(keys(windows[:3] + lengths[5:7], backward=True)) == 2
    q, k, v = make_qkv(1, 1, 33, 32, seed=3, device=DEV)  # D = 32: a new specialisation
    before = keys(windows[:1])
    kernel.launches.clear()
    triton_attention(q, k, v, mask=windows[0][0])
    assert not {(n, c, s) for n, c, s in kernel.launches} <= before


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nonfinite_values_at_masked_keys_do_not_leak(kernel):
    """NaN in K and V at keys the mask removes (the padded tail) stays out of every row: the
    call is redone on chunked's exact path (as sdpa's and flex's are)."""
    q, k, v = make_qkv(2, 2, 16, 16, Sk=24, seed=12, device=DEV)
    k[:, :, 20:] = math.nan
    v[:, :, 20:] = math.inf
    mask = masks.padding(20)
    out = triton_attention(q, k, v, mask=mask)
    ref = sa.attention(q[..., :], k[:, :, :20], v[:, :, :20], backend="reference", q_offset=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_sinks_merge_through_the_lse(kernel):
    q, k, v = make_qkv(1, 4, 17, 16, Sk=17, seed=13, device=DEV)
    sinks = torch.randn(4)
    got = triton_attention(q, k, v, mask=masks.causal(), sinks=sinks)
    ref = sa.attention(q, k, v, mask=masks.causal(), sinks=sinks, backend="reference")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"mask": lambda b, h, qi, ki: (qi - ki) % 3 == 0}, "not one key interval per row"),
        ({"mask": masks.causal() | masks.padding(3)}, "not one key interval per row"),
        ({"score_mod": lambda s, b, h, qi, ki: s * 2}, "not made of alibi, bias and softcap"),
        ({"score_mod": scores.softcap(3.0) >> scores.alibi(2)}, "soft cap comes before ALiBi"),
        ({"score_mod": scores.bias(torch.zeros(1, 1, 8, 8, requires_grad=True))}, "requires grad"),
    ],
    ids=["callable-mask", "or-mask", "callable-mod", "cap-then-alibi", "learnable-bias"],
)
def test_declines_what_it_cannot_express_with_the_reason(kernel, kwargs, says):
    q, k, v = make_qkv(1, 2, 8, 16, seed=14, device=DEV)
    why = sa.backends.explain(q, k, v, print_table=False, **kwargs).reasons["triton"]
    assert why is not None and says in why
    with pytest.raises(ValueError, match="backend 'triton' cannot run this call"):
        triton_attention(q, k, v, **kwargs)


def test_declines_cpu_tensors_outside_the_interpreter(kernel, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = make_qkv(1, 2, 8, 16, seed=15)
    why = sa.backends.explain(q, k, v, print_table=False).reasons["triton"]
    assert "Triton kernels run on CUDA" in why


def test_auto_never_picks_it_on_cpu_and_ranks_it_on_cuda(kernel):
    """On CPU (the interpreter) it is a last resort; on CUDA, by the COSTS table, masks it
    expresses go to it before flex, causal and plain work stay with SDPA's flash kernel."""
    from types import SimpleNamespace

    from selfattn.backends import AttentionCall, triton
    from selfattn.backends._auto import rank

    q, k, v = make_qkv(1, 2, 8, 16, seed=16)
    assert (
        sa.backends.explain(q, k, v, mask=masks.sliding_window(3), print_table=False).chosen
        != "triton"
    )
    cuda = SimpleNamespace(device=torch.device("cuda"), shape=(1, 2, 64, 16), dtype=torch.float32)
    names = ("sdpa", "flex", "triton")
    for mask, chosen in ((masks.sliding_window(8), "triton"), (masks.causal(), "sdpa")):
        call = AttentionCall(mask=mask)
        costs = {n: sa.backends.get(n).cost(cuda, cuda, None, call) for n in names}
        assert rank(costs, density=lambda: 0.5)[0] == chosen
    assert triton.cost(cuda, cuda, None, AttentionCall(mask=masks.sliding_window(8))).sparse


def test_custom_ops_have_fakes_and_trace_under_torch_compile(kernel):
    """The forward op's fake gives shapes and dtypes without running; ``attention`` on the
    triton backend traces whole (fullgraph) and the graph runs the kernels, backward too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from selfattn.kernels import ops

    with FakeTensorMode():
        q, k, v = torch.empty(2, 4, 9, 16), torch.empty(2, 2, 11, 16), torch.empty(2, 2, 11, 8)
        lists = torch.empty(1, 1, dtype=torch.int32)
        bounds = torch.empty(1, 9, dtype=torch.int32)
        out, lse = ops.attention_triton_fwd(
            q, k, v, lists, lists, lists, lists, lists, lists, bounds, bounds, None, None, None,
            0.25, 0.0, 0.0, 0, 2, [16, 16, 16, 16], False,
        )  # fmt: skip
        assert out.shape == (2, 4, 9, 8) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32

    def step(q, k, v):
        return sa.attention(q, k, v, mask=masks.sliding_window(5), backend="triton")

    q, k, v = make_qkv(1, 2, 20, 16, seed=17, device=DEV, requires_grad=True)
    # eager first: traced cold, the registry trips on dataclasses.fields(AttentionCall) (an
    # existing graph break, the same for every backend: backends.base.call_fields)
    want = step(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (dq,) = torch.autograd.grad(got.sum(), q)
    (dq_eager,) = torch.autograd.grad(want.sum(), q)
    torch.testing.assert_close(dq, dq_eager, rtol=1e-5, atol=1e-6)


def test_a_kernel_that_does_not_build_falls_back_under_auto(kernel, monkeypatch, caplog):
    """A Triton compile error (or too little shared memory on this GPU) is a BackendCompileError:
    ``auto`` runs the next backend, logs it once, and the variant declines from then on; asked
    for by name, the error is raised with the case."""
    from selfattn.backends import Cost
    from selfattn.backends import triton as backend
    from selfattn.kernels import ops

    def broken(*args):
        raise RuntimeError("PTX assembly failed (simulated)")

    monkeypatch.setattr(backend, "_FAILED", {})
    monkeypatch.setitem(backend.COSTS, "interpreted", Cost(0.01, "made cheapest for this test"))
    monkeypatch.setattr(ops, "attention_triton_fwd", broken)
    q, k, v = make_qkv(1, 2, 9, 16, seed=19, device=DEV)
    mask = masks.sliding_window(4)
    assert sa.backends.explain(q, k, v, mask=mask, print_table=False).chosen == "triton"
    with caplog.at_level("WARNING", logger="selfattn"):
        out = sa.attention(q, k, v, mask=mask)
    torch.testing.assert_close(out, sa.attention(q, k, v, mask=mask, backend="reference"))
    assert "failed to compile" in caplog.text and "simulated" in caplog.text
    why = sa.backends.explain(q, k, v, mask=mask, print_table=False).reasons["triton"]
    assert "failed to build for this case earlier" in why
    monkeypatch.setattr(backend, "_FAILED", {})
    with pytest.raises(sa.backends.BackendCompileError, match=r"triton backend failed on q"):
        sa.attention(q, k, v, mask=mask, backend="triton")


def test_tile_lists_put_full_tiles_first_and_count_them(kernel):
    """The kernel's lists: per row, FULL columns then PARTIAL ones (in column order), EMPTY
    ones never counted; its tile-kind values are the masks' (restated: kernels import no
    module above them)."""
    assert (kernel.PARTIAL, kernel.FULL) == (int(masks.PARTIAL), int(masks.FULL))
    kinds = torch.tensor([[1, 2, 0, 2], [0, 0, 0, 0], [2, 1, 1, 0]], dtype=torch.int8)
    order, counts = kernel.tile_lists(kinds)
    assert counts.tolist() == [[2, 1], [0, 0], [1, 2]]
    assert order[0, :3].tolist() == [1, 3, 0] and order[2, :3].tolist() == [0, 1, 2]
    _, counts_t = kernel.tile_lists(kinds.T)
    assert counts_t.tolist() == [[1, 1], [1, 1], [0, 1], [1, 0]]
