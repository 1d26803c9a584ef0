"""paged_attention against the reference on the same K/V made contiguous; BlockPool bookkeeping."""

from __future__ import annotations

import dataclasses
import math
import subprocess

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import selfattn as sa
from selfattn import attention, masks, scores
from selfattn.backends.paged import pytorch as paged_torch
from selfattn.backends.paged.cpu import KERNEL_MAX_SQ
from selfattn.cache import paged_attention
from selfattn.cache.pool import BlockPool
from selfattn.cache.quant import dequantize, quantize_fp8, quantize_int8
from selfattn.kernels import build, paged_decode, rows_linear
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention
from tests._kernel_helpers import c_kernel


def make_paged(lens, Hq, Hkv, D, P, *, Sq, dtype=torch.float32, Dv=None, spare=3, seed=0):
    """Random pages, a permuted block table (with -1 past each sequence's pages), and q."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    B = len(lens)
    max_pages = max(math.ceil(n / P) for n in lens) + 1  # one spare column, never used
    N = B * max_pages + spare

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    k_pages, v_pages = rnd(N, P, Hkv, D), rnd(N, P, Hkv, Dv)
    perm = torch.randperm(N, generator=g)[: B * max_pages].view(B, max_pages)
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        used = math.ceil(n / P)
        table[b, :used] = perm[b, :used].int()
    q = rnd(B, Hq, Sq, D)
    return q, k_pages, v_pages, table, torch.tensor(lens, dtype=torch.int32)


def contiguous(pages, table, b, n):
    """Sequence ``b``'s first ``n`` tokens gathered through the table: ``(1, Hkv, n, ·)``."""
    used = math.ceil(n / pages.shape[1])
    rows = pages[table[b, :used].long()].reshape(-1, *pages.shape[2:])[:n]  # (n, Hkv, ·)
    return rows.transpose(0, 1).unsqueeze(0)


def spy_paged_backends(monkeypatch) -> list[str]:
    """Record the name of each paged backend that runs (the registry is restored afterwards)."""
    registry = sa.backends.registry("paged")
    ran: list[str] = []
    for name in registry.names():
        backend = registry.get(name)

        def run(*args, _backend=backend):
            ran.append(_backend.name)
            return _backend.run(*args)

        monkeypatch.setitem(registry._backends, name, dataclasses.replace(backend, run=run))
    return ran


def check(q, k_pages, v_pages, table, lens, **kw):
    out, lse = paged_attention(q, k_pages, v_pages, table, lens, return_lse=True, **kw)
    assert out.dtype == q.dtype
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert out.shape == (*q.shape[:3], v_pages.shape[3])
    for b, n in enumerate(lens.tolist()):
        qb = q[b : b + 1]
        kb, vb = contiguous(k_pages, table, b, n), contiguous(v_pages, table, b, n)
        o64, l64, _ = reference_attention(qb, kb, vb, **kw)
        if q.dtype == torch.float64:  # no naive baseline: the ulp floor alone (testing.py)
            naive_o, naive_l = o64, l64
        else:
            naive_o, naive_l, _ = naive_attention(qb, kb, vb, **kw)
        assert_close_to_reference(out[b : b + 1], o64, naive_o, dtype=q.dtype, what=f"out[{b}]")
        assert_close_to_reference(
            lse[b : b + 1], l64, naive_l, dtype=torch.float32, what=f"lse[{b}]"
        )
    return out, lse


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Run a test on both implementations: the C kernel and the PyTorch path (env switch)."""
    if request.param == "torch":
        monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    else:
        c_kernel(paged_decode)
    return request.param


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Spy on the C kernel: the list fills with the number of key splits of each call."""
    calls: list[int] = []
    real = paged_decode.decode

    def spy(q, k_pages, v_pages, table, lo, hi, *rest, **kw):
        calls.append(paged_decode.key_splits(lo, hi, k_pages.shape[1])[0])
        return real(q, k_pages, v_pages, table, lo, hi, *rest, **kw)

    monkeypatch.setattr(paged_decode, "decode", spy)
    return calls


@pytest.mark.parametrize("P", [1, 16, 128])
@pytest.mark.parametrize("Sq", [1, 5])
def test_page_sizes_ragged_causal(P, Sq, path):
    lens = [Sq, 37, 300, 129][: 4 if P < 128 else 3]
    q, kp, vp, table, sl = make_paged(lens, Hq=4, Hkv=2, D=24, P=P, Sq=Sq, seed=P + Sq)
    check(q, kp, vp, table, sl, mask=masks.causal())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2), (8, 1), (16, 2)])
def test_dtypes_and_gqa(dtype, Hq, Hkv, path):
    q, kp, vp, table, sl = make_paged([45, 17, 96], Hq, Hkv, D=16, P=16, Sq=1, dtype=dtype, Dv=12)
    check(q, kp, vp, table, sl)


@pytest.mark.parametrize("Sq", [1, 5])
@pytest.mark.parametrize(
    "name",
    ["causal", "window", "window_tiny", "alibi", "softcap", "alibi_window"],
)
def test_masks_and_score_mods(Sq, name):
    Hq = 6
    kw = {
        "causal": dict(mask=masks.causal()),
        "window": dict(mask=masks.causal() & masks.sliding_window(40)),
        "window_tiny": dict(mask=masks.sliding_window(3)),  # excludes whole pages and groups
        "alibi": dict(mask=masks.causal(), score_mod=scores.alibi(Hq)),
        "softcap": dict(score_mod=scores.softcap(2.5), scale=0.9),
        "alibi_window": dict(mask=masks.sliding_window(20), score_mod=scores.alibi(Hq)),
    }[name]
    q, kp, vp, table, sl = make_paged([1100, 23, 200], Hq, 3, D=16, P=8, Sq=Sq, seed=Sq)
    sl[1] = max(sl[1].item(), Sq)
    check(q, kp, vp, table, sl, **kw)


def test_callable_mask_sees_batch_and_absolute_positions():
    lens = [30, 11]
    q, kp, vp, table, sl = make_paged(lens, 4, 2, D=8, P=4, Sq=3)

    def mod(b, h, q_idx, kv_idx):  # sequence 1 also drops even keys
        return (q_idx >= kv_idx) & ((b == 0) | (kv_idx % 2 == 1))

    out = paged_attention(q, kp, vp, table, sl, mask=mod)
    for b, n in enumerate(lens):
        kb, vb = contiguous(kp, table, b, n), contiguous(vp, table, b, n)
        keep = torch.arange(n) % 2 == 1 if b == 1 else torch.ones(n, dtype=torch.bool)
        qpos = torch.arange(n - 3, n).view(3, 1)
        allowed = (qpos >= torch.arange(n)) & keep  # (Sq, n)
        s = (q[b] @ kb[0].repeat_interleave(2, 0).transpose(-1, -2)) / math.sqrt(8)
        w = s.masked_fill(~allowed, -math.inf).softmax(-1)
        ref = w @ vb[0].repeat_interleave(2, 0)
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)


def test_no_allowed_key_gives_zero_and_neg_inf_lse():
    q, kp, vp, table, sl = make_paged([20, 9], 2, 1, D=8, P=4, Sq=2)
    out, lse = paged_attention(
        q, kp, vp, table, sl, mask=lambda b, h, qi, kv: (kv < 0) | (b == 1), return_lse=True
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert bool(torch.isneginf(lse[0]).all()) and bool(torch.isfinite(lse[1]).all())
    assert not bool(out.isnan().any())


def test_sq_zero_and_empty_batch():
    q, kp, vp, table, sl = make_paged([7, 3], 2, 1, D=8, P=4, Sq=0)
    out, lse = paged_attention(q, kp, vp, table, sl, return_lse=True)
    assert out.shape == (2, 2, 0, 8) and lse.shape == (2, 2, 0)


@pytest.mark.parametrize("mask", [None, masks.sliding_window(5)])
def test_nan_in_unused_slots_and_pages(mask, path):
    lens = [13, 6, 33]
    q, kp, vp, table, sl = make_paged(lens, 4, 2, D=8, P=8, Sq=2, spare=4)
    clean = paged_attention(q, kp, vp, table, sl, mask=mask)
    used = set()
    for b, n in enumerate(lens):
        pages = table[b, : math.ceil(n / 8)].tolist()
        used.update(pages)
        last, fill = pages[-1], n % 8
        if fill:
            kp[last, fill:] = math.nan  # tail of the last page
            vp[last, fill:] = math.inf
    for p in set(range(kp.shape[0])) - used:
        kp[p], vp[p] = math.nan, math.nan
    if mask is not None:  # keys outside every window: present in the cache but never attended
        kp[table[2, 0]], vp[table[2, 0]] = math.nan, math.nan
    dirty = paged_attention(q, kp, vp, table, sl, mask=mask)
    assert torch.equal(clean, dirty)


def test_reads_pages_in_groups_not_all_at_once(monkeypatch, gathered_counts):
    """A long sequence is walked in several bounded gathers (the online-softmax merge path)."""
    monkeypatch.setattr(paged_torch, "GROUP_KEYS", 32)
    q, kp, vp, table, sl = make_paged([200, 70], 4, 2, D=8, P=8, Sq=5, dtype=torch.float64)
    calls = gathered_counts
    calls.clear()  # count only the call under test, not the set-up
    check(q, kp, vp, table, sl, mask=masks.causal())
    assert max(calls) <= 2 * 4 and len(calls) >= 2 * math.ceil(200 / 32)


# -- errors --------------------------------------------------------------------------------------


def _ok(**over):
    q, kp, vp, table, sl = make_paged([10, 4], 4, 2, D=8, P=4, Sq=2)
    args = dict(q=q, k_pages=kp, v_pages=vp, block_table=table, seq_lens=sl)
    args.update(over)
    return args


def _call(args, **kw):
    return paged_attention(
        args["q"], args["k_pages"], args["v_pages"], args["block_table"], args["seq_lens"], **kw
    )


def test_capacity_boundary():
    args = _ok()
    cap = args["block_table"].shape[1] * 4
    args["block_table"] = torch.arange(2 * args["block_table"].shape[1]).view(2, -1).int()
    args["seq_lens"] = torch.tensor([cap, 4], dtype=torch.int32)
    _call(args)  # exactly at capacity: fine
    args["seq_lens"] = torch.tensor([cap + 1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"seq_lens\[0\]={cap + 1} exceeds the capacity"):
        _call(args)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(q=torch.randn(2, 4, 8)), ValueError, r"q must be 4-D .* got shape \(2, 4, 8\)"),
        (dict(q=torch.randn(2, 4, 2, 6)), ValueError, "D=6"),
        (dict(q=torch.randn(2, 3, 2, 8)), ValueError, "Hkv=2 must divide Hq=3"),
        (dict(q=torch.randn(3, 4, 2, 8)), ValueError, r"block_table .* B=3"),
        (dict(q=torch.randn(2, 4, 2, 8).double()), TypeError, "torch.float64"),
        (dict(v_pages=torch.randn(11, 4, 3, 8)), ValueError, r"v_pages \(11, 4, 3, 8\)"),
        (dict(seq_lens=torch.tensor([10, 1])), ValueError, r"seq_lens\[1\]=1 .* Sq=2"),
        (dict(seq_lens=torch.tensor([10.0, 4.0])), TypeError, "seq_lens .* torch.float32"),
        (dict(block_table=torch.zeros(2, 4)), TypeError, "block_table .* torch.float32"),
        (dict(seq_lens=torch.tensor([10, 4, 4])), ValueError, r"seq_lens .* shape \(3,\)"),
    ],
)
def test_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        _call(_ok(**over))


@pytest.mark.parametrize("bad", [-1, 99])
def test_block_id_out_of_range_for_used_pages_only(bad):
    args = _ok()
    table = args["block_table"].clone()
    table[1, 2] = bad  # sequence 1 (4 tokens, P = 4) uses one page: column 2 is never read
    args["block_table"] = table
    _call(args)
    table[1, 0] = bad
    N = args["k_pages"].shape[0]
    with pytest.raises(ValueError, match=rf"block_table\[1, 0\]={bad} is out of range for N={N}"):
        _call(args)


# -- BlockPool -----------------------------------------------------------------------------------


def test_pool_allocate_fork_free():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 2 and pool.num_used == 3
    pool.fork(a[:2])
    assert [pool.refcount(p) for p in a] == [2, 2, 1]
    assert pool.free(a) == [a[2]]
    assert pool.num_used == 2
    assert sorted(pool.free(a[:2])) == sorted(a[:2])
    assert pool.num_free == 5
    pool.check()


def test_pool_exhaustion_is_atomic():
    pool = BlockPool(4)
    pool.allocate(3)
    before = (pool.num_free, list(pool._free), list(pool._refs))
    with pytest.raises(RuntimeError, match="cannot allocate 2 pages: only 1 of 4 are free"):
        pool.allocate(2)
    assert (pool.num_free, list(pool._free), list(pool._refs)) == before
    pool.check()


def test_pool_errors_change_nothing():
    pool = BlockPool(3)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="page id 7 is out of range for a pool of 3"):
        pool.free([a[0], 7])
    with pytest.raises(ValueError, match=rf"page {a[1]} has 1 reference\(s\) but 2"):
        pool.free([a[0], a[1], a[1]])
    with pytest.raises(ValueError, match="is free"):
        pool.fork([a[0], 2])
    assert [pool.refcount(p) for p in a] == [1, 1] and pool.refcount(2) == 0
    with pytest.raises(ValueError, match="allocate n must be >= 0, got -1"):
        pool.allocate(-1)
    with pytest.raises(TypeError):
        BlockPool(2.0)
    pool.check()


def test_pool_check_detects_corruption():
    pool = BlockPool(3)
    pool.allocate(1)
    pool._refs[2] = 1  # referenced but still in the free list
    with pytest.raises(AssertionError, match="both free and referenced"):
        pool.check()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / fork / free sequences against a plain dict of reference counts."""

    def __init__(self):
        super().__init__()
        self.total = 12
        self.pool = BlockPool(self.total)
        self.model: dict[int, int] = {}
        self.owners: list[list[int]] = []

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        free = self.total - len(self.model)
        if n > free:
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            return
        pages = self.pool.allocate(n)
        assert len(set(pages)) == n and not set(pages) & set(self.model)
        for p in pages:
            self.model[p] = 1
        self.owners.append(pages)

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        pages = self.owners[i % len(self.owners)]
        self.pool.fork(pages)
        for p in pages:
            self.model[p] += 1
        self.owners.append(list(pages))

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        pages = self.owners.pop(i % len(self.owners))
        freed = self.pool.free(pages)
        for p in pages:
            self.model[p] -= 1
        expect = sorted(p for p in set(pages) if self.model[p] == 0)
        for p in expect:
            del self.model[p]
        assert sorted(freed) == expect

    @invariant()
    def matches_model(self):
        self.pool.check()
        assert self.pool.num_used == len(self.model)
        assert self.pool.num_free == self.total - len(self.model)
        for p in range(self.total):
            assert self.pool.refcount(p) == self.model.get(p, 0)


TestPoolStateful = PoolMachine.TestCase
TestPoolStateful.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_gradients_flow_to_q_and_pages():
    lens = [19, 7]
    q, kp, vp, table, sl = make_paged(lens, 4, 2, D=8, P=4, Sq=3, dtype=torch.float64)
    q, kp, vp = (t.requires_grad_(True) for t in (q, kp, vp))
    out = paged_attention(q, kp, vp, table, sl, mask=masks.causal(), score_mod=scores.softcap(3.0))
    dout = torch.randn_like(out)
    got = torch.autograd.grad((out * dout).sum(), (q, kp, vp))
    ref = 0.0
    for b, n in enumerate(lens):
        kb, vb = contiguous(kp, table, b, n), contiguous(vp, table, b, n)
        o = attention(
            q[b : b + 1],
            kb,
            vb,
            mask=masks.causal(),
            score_mod=scores.softcap(3.0),
            backend="reference",
        )
        ref = ref + (o * dout[b : b + 1]).sum()
    want = torch.autograd.grad(ref, (q, kp, vp))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("Sq", [1, 4])
def test_sliding_window_reads_only_window_pages(monkeypatch, gathered_counts, Sq):
    monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")  # the PyTorch path's gathers are counted
    lens = [1000, 333, Sq]
    q, kp, vp, table, sl = make_paged(lens, 4, 2, D=8, P=8, Sq=Sq, seed=Sq)
    calls = gathered_counts
    calls.clear()  # count only the call under test, not the set-up
    check(q, kp, vp, table, sl, mask=masks.sliding_window(10))
    # window 10 + Sq - 1 keys span at most 3 pages of 8 per sequence: one gather each of K, V
    assert len(calls) == 2 and max(calls) <= 3 * 3, calls


# -- the C kernel (decode, short query chunks) ---------------------------------------------------


needs_kernel = pytest.mark.c_kernel(paged_decode)


@needs_kernel
@pytest.mark.parametrize("Sq", [1, 3, KERNEL_MAX_SQ])
@pytest.mark.parametrize(
    "mask",
    [
        masks.sliding_window(7),
        masks.chunked(6),
        masks.chunked(6, causal=False),
        masks.causal() & masks.sliding_window(20),
        masks.sliding_window(9) & masks.chunked(16),
        masks.prefix_lm(20),
        masks.prefix_lm(5) & masks.sliding_window(9),
        masks.sliding_window(4) & masks.padding(1),  # long sequences: rows with no key
    ],
    ids=repr,
)
def test_kernel_interval_masks(Sq, mask, kernel_calls):
    """Masks that are one key interval per row run in the kernel, exact vs the oracle."""
    lens = [61, Sq, 100]  # D = 20, Dv = 36: vector widths of 8 plus scalar tails
    q, kp, vp, table, sl = make_paged(lens, 6, 3, D=20, P=8, Sq=Sq, Dv=36, seed=Sq)
    check(q, kp, vp, table, sl, mask=mask)
    assert len(kernel_calls) == 1


@needs_kernel
def test_kernel_per_sequence_padding(kernel_calls):
    """padding() with one length per sequence is one key interval per row too (its end depends
    on the sequence): the kernel runs it, each sequence exact vs the oracle with its own length."""
    lens, valid = [61, 3, 100], [40, 2, 100]
    q, kp, vp, table, sl = make_paged(lens, 6, 3, D=20, P=8, Sq=3, Dv=36, seed=11)
    out = paged_attention(q, kp, vp, table, sl, mask=masks.causal() & masks.padding(valid))
    assert len(kernel_calls) == 1
    for b, n in enumerate(lens):
        kb, vb = contiguous(kp, table, b, n), contiguous(vp, table, b, n)
        kw = {"mask": masks.causal() & masks.padding(valid[b])}
        o64, _, _ = reference_attention(q[b : b + 1], kb, vb, **kw)
        naive, _, _ = naive_attention(q[b : b + 1], kb, vb, **kw)
        assert_close_to_reference(out[b : b + 1], o64, naive, dtype=q.dtype, what=f"out[{b}]")


@pytest.mark.usefixtures("every_thread")
@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("mask", [None, masks.sliding_window(30)])
def test_kernel_key_splits_merge(threads, mask, kernel_calls):
    """One long sequence is split over the keys for the threads; the splits merge exactly (a
    window leaves most splits without any allowed key: m = -inf, l = 0 must merge as nothing)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kp, vp, table, sl = make_paged([997], 8, 2, D=16, P=4, Sq=2, seed=threads)
        check(q, kp, vp, table, sl, mask=mask)
    finally:
        torch.set_num_threads(before)
    assert len(kernel_calls) == 1 and kernel_calls[0] > 1, kernel_calls


@needs_kernel
@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_quantised_pages(storage, dtype, kernel_calls):
    """int8 (per token, head) / fp8 (per head) pages dequantised in the kernel, vs the oracle on
    the dequantised values."""
    lens = [70, 9, 33]
    q, kp, vp, table, sl = make_paged(lens, 4, 2, D=24, P=8, Sq=2, seed=5)
    quant = quantize_int8 if storage == "int8" else quantize_fp8
    (kq, ks), (vq, vs) = quant(kp), quant(vp)
    q = q.to(dtype)
    out = paged_attention(q, kq, vq, table, sl, k_scales=ks, v_scales=vs, mask=masks.causal())
    assert len(kernel_calls) == 1 and out.dtype == dtype
    k64, v64 = dequantize(kq, ks, torch.float64), dequantize(vq, vs, torch.float64)
    for b, n in enumerate(lens):
        kb, vb = contiguous(k64, table, b, n), contiguous(v64, table, b, n)
        qb = q[b : b + 1].double()
        o64, _, _ = reference_attention(qb, kb, vb, mask=masks.causal())
        naive, _, _ = naive_attention(q[b : b + 1], kb.to(dtype), vb.to(dtype), mask=masks.causal())
        assert_close_to_reference(out[b : b + 1], o64, naive, dtype=dtype, what=f"out[{b}]")


@needs_kernel
def test_kernel_reads_strided_pages_in_place(kernel_calls):
    """K and V as views of one fused ``(N, P, Hkv, D + Dv)`` pool: read through their strides."""
    lens = [40, 17]
    q, kp, vp, table, sl = make_paged(lens, 4, 2, D=16, P=8, Sq=1, Dv=8, seed=3)
    fused = torch.cat([kp, vp], dim=-1)  # (N, P, Hkv, D + Dv)
    k_view, v_view = fused[..., :16], fused[..., 16:]
    assert not k_view.is_contiguous()
    check(q, k_view, v_view, table, sl)
    assert len(kernel_calls) == 1


@needs_kernel
def test_kernel_rule(monkeypatch, kernel_calls):
    """Which calls the kernel takes (the cpu paged backend's reject); every one stays exact."""
    lens = [23, 18]

    def ran(Sq=1, dtype=torch.float32, grad=False, **kw):
        q, kp, vp, table, sl = make_paged(lens, 4, 2, D=8, P=4, Sq=Sq, dtype=dtype)
        if kw.pop("strided_d", False):  # last dim not contiguous: the kernel needs unit stride
            kp = kp.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
        kernel_calls.clear()
        check(q.requires_grad_(grad), kp, vp, table, sl, **kw)
        return len(kernel_calls) == 1

    assert ran() and ran(Sq=KERNEL_MAX_SQ, dtype=torch.bfloat16, mask=masks.causal())
    assert not ran(Sq=KERNEL_MAX_SQ + 1, mask=masks.causal())  # prefill chunk: batched GEMMs
    assert not ran(dtype=torch.float64)
    assert not ran(score_mod=scores.softcap(5.0))
    assert ran(mask=masks.causal() | masks.sliding_window(3))  # a union: disjoint intervals
    assert not ran(mask=lambda b, h, qi, kv: kv <= qi)
    assert not ran(grad=True)
    with torch.no_grad():
        assert ran(grad=True)
    assert not ran(strided_d=True)
    monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    assert not ran()


def test_kernel_build_failure_falls_back(monkeypatch, tmp_path):
    """No compiler, or one that fails: no library (paged_attention then runs PyTorch)."""
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert build.load(paged_decode.SPEC) is None
    monkeypatch.setattr(build, "compiler", lambda: "false")  # exits 1, builds nothing
    assert build.load(paged_decode.SPEC) is None
    assert list(tmp_path.iterdir()) == []


@needs_kernel
def test_kernel_build_is_cached_per_machine(monkeypatch, tmp_path):
    """The first build leaves one library in the cache dir; the next load compiles nothing
    (the smallest of the kernels' libraries: the cache treats every spec alike)."""
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(tmp_path))
    assert build.load(rows_linear.SPEC) is not None
    (built,) = tmp_path.iterdir()
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert build.load(rows_linear.SPEC) is not None
    assert list(tmp_path.iterdir()) == [built] and built.stat().st_mtime_ns == stamp


@needs_kernel
def test_kernel_pages_shared_by_sequences(kernel_calls):
    """Prefix sharing: sequences whose tables list the same pages each read them (fork, CoW)."""
    lens = [45, 38, 21]
    q, kp, vp, table, sl = make_paged(lens, 4, 2, D=16, P=8, Sq=1, seed=11)
    table[1, :4] = table[0, :4]  # sequence 1 shares sequence 0's first 32 tokens
    table[2, :2] = table[0, :2]
    check(q, kp, vp, table, sl)
    assert len(kernel_calls) == 1
