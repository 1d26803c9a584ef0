"""The Triton paged-attention kernel, run by Triton's interpreter on CPU (TRITON_INTERPRET=1).

Small shapes only: the interpreter executes every program in Python. The same kernel runs
compiled on CUDA (benchmarks/gpu.py measures it there).
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

from selfattn.kernels.paged_twin import paged_attention_twin
from selfattn.testing import assert_close_to_reference

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernel():
    """The kernel module: interpreted on CPU (conftest sets TRITON_INTERPRET), compiled on CUDA."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    return importlib.import_module("selfattn.kernels.triton.paged")


def _case(seed, B, Hq, Hkv, Sq, D, Dv, P, lens, dtype, window=None, extra_pages=3):
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // P) for n in lens]
    max_pages = max(pages_per)
    N = sum(pages_per) + extra_pages
    perm = torch.randperm(N, generator=g)
    table = torch.zeros(B, max_pages, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[used : used + n].int()
        used += n
    k_pages = torch.randn(N, P, Hkv, D, generator=g).to(dtype)
    v_pages = torch.randn(N, P, Hkv, Dv, generator=g).to(dtype)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    lens_t = torch.tensor(lens)
    pos = lens_t.view(-1, 1) - Sq + torch.arange(Sq)  # (B, Sq): bottom-right, causal
    hi = (pos + 1).clamp(min=0)
    lo = torch.zeros_like(hi) if window is None else (pos - window + 1).clamp(min=0)
    return q, k_pages, v_pages, table, lo, torch.maximum(hi, lo)


CASES = [
    # seed, B, Hq, Hkv, Sq, D, Dv, P, lens, window
    (1, 3, 4, 2, 1, 16, 16, 16, [37, 5, 64], None),
    (2, 2, 4, 1, 3, 24, 16, 1, [9, 20], None),  # page size 1, MQA, D not a power of two
    (3, 2, 6, 2, 2, 16, 32, 5, [23, 2], 4),  # G = 3, Dv != D, sliding window
    (4, 1, 2, 2, 1, 16, 16, 7, [50], 8),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_kernel_matches_fp64_oracle(kernel, case, dtype):
    seed, B, Hq, Hkv, Sq, D, Dv, P, lens, window = case
    q, kp, vp, table, lo, hi = _case(seed, B, Hq, Hkv, Sq, D, Dv, P, lens, dtype, window)
    scale = D**-0.5
    out, lse = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, scale, num_splits=3)
    o64, lse64 = paged_attention_twin(q.double(), kp.double(), vp.double(), table, lo, hi, scale)
    # the naive baseline: every step in the input dtype
    naive, lse_n = _naive(q, kp, vp, table, lo, hi, scale)
    assert out.dtype == dtype and out.shape == (B, Hq, Sq, Dv)
    assert_close_to_reference(out, o64, naive, dtype=dtype)
    assert_close_to_reference(lse, lse64, lse_n, dtype=torch.float32, what="lse")


def _naive(q, kp, vp, table, lo, hi, scale):
    """The twin's formula computed in the input dtype (the noise baseline of the ratio rule)."""
    return paged_attention_twin(q, kp, vp, table, lo, hi, scale, compute_dtype=q.dtype)


def test_splits_do_not_change_the_result(kernel):
    q, kp, vp, table, lo, hi = _case(5, 2, 4, 2, 1, 16, 16, 4, [70, 33], torch.float32)
    outs = [
        kernel.paged_attention_triton(q, kp, vp, table, lo, hi, 0.25, num_splits=n)
        for n in (1, 2, 5)
    ]
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, outs[0][1], rtol=1e-5, atol=1e-6)


def test_rows_without_keys_give_zero_and_minus_inf(kernel):
    """Empty intervals (a zero-length sequence, a split past the end) never give NaN."""
    q, kp, vp, table, lo, hi = _case(6, 2, 2, 1, 1, 16, 16, 16, [40, 3], torch.float32)
    hi = hi.clone()
    hi[1] = 0  # sequence 1: nothing to attend
    out, lse = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, 0.25, num_splits=4)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    ref, _ = paged_attention_twin(q, kp, vp, table, lo, hi, 0.25)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("storage", ["int8", "fp8"])
def test_quantised_pages_dequantised_in_kernel(kernel, storage):
    from selfattn.cache import quant

    q, kp, vp, table, lo, hi = _case(7, 2, 4, 2, 1, 16, 16, 8, [30, 17], torch.float32)
    if storage == "int8":
        kq, ks = quant.quantize_int8(kp)
        vq, vs = quant.quantize_int8(vp)
    else:
        if not hasattr(torch, "float8_e4m3fn"):
            pytest.skip("no float8_e4m3fn in this torch")
        kq, ks = quant.quantize_fp8(kp)
        vq, vs = quant.quantize_fp8(vp)
    out, _ = kernel.paged_attention_triton(q, kq, vq, table, lo, hi, 0.25, ks, vs, num_splits=2)
    ref, _ = paged_attention_twin(q.double(), kq, vq, table, lo, hi, 0.25, ks, vs)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("Sq", [1, 4])
@pytest.mark.parametrize("mask_name", ["none", "causal", "window"])
def test_paged_attention_dispatches_to_the_kernel(kernel, monkeypatch, Sq, mask_name):
    """``paged_attention`` sends CUDA calls to the Triton kernel; SELFATTN_PAGED_TRITON=1 does
    the same on CPU (interpreted), so the dispatch and the interval masks are checked here."""
    import selfattn as sa
    from selfattn import masks
    from selfattn.cache import paged_attention

    mask = {"none": None, "causal": masks.causal(), "window": masks.sliding_window(6)}[mask_name]
    q, kp, vp, table, _, _ = _case(8, 3, 4, 2, Sq, 16, 16, 5, [23, 9, 14], torch.float32)
    lens = torch.tensor([23, 9, 14])
    monkeypatch.setenv("SELFATTN_DECODE_KERNEL", "0")
    ref, ref_lse = paged_attention(q, kp, vp, table, lens, mask=mask, return_lse=True)
    monkeypatch.setenv("SELFATTN_PAGED_TRITON", "1")
    calls = []
    real = kernel.paged_attention_triton
    spy = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(kernel, "paged_attention_triton", spy)
    explained = sa.backends.explain_paged(q, kp, vp, table, lens, mask=mask, print_table=False)
    assert explained.chosen == "triton"
    out, lse = paged_attention(q, kp, vp, table, lens, mask=mask, return_lse=True)
    assert calls, "the Triton kernel did not run"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)


# Triton's interpreter multiplies with numpy, which warns when NaN meets the matmul.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nonfinite_v_stays_in_the_rows_that_attend_it(kernel):
    """NaN and ±inf in V at keys only some rows attend (causal, Sq = 3, three key splits): kernel
    and twin put them in exactly the same outputs, and agree on every other one."""
    q, kp, vp, table, lo, hi = _case(9, 2, 4, 2, 3, 16, 16, 4, [21, 11], torch.float32)
    for t, h, d, x in ((19, 0, 2, math.nan), (20, 1, 5, math.inf), (9, 1, 0, -math.inf)):
        b = 0 if t > 10 else 1
        vp[table[b, t // 4], t % 4, h, d] = x
    out, lse = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, 0.25, num_splits=3)
    ref, ref_lse = paged_attention_twin(q.double(), kp, vp.double(), table, lo, hi, 0.25)
    assert out.isnan().any() and out.isinf().any() and torch.isfinite(out[:, :, 0]).all()
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out.double()[finite], ref[finite], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_scores_reach_the_rows_that_attend_them(kernel):
    """A NaN key score makes out and lse NaN in the rows attending that key (the twin's and the
    C kernel's result); the kernel took such a split for one with no key (``l > 0`` is false for
    NaN) and the merge gave it weight 0, so the row came back empty or without those keys."""
    q, kp, vp, table, lo, hi = _case(9, 2, 4, 2, 1, 16, 16, 4, [21, 11], torch.float32)
    kp[int(table[0, 0]), 2, 0, 3] = math.nan  # sequence 0, key 2 of 21, kv head 0
    kp[int(table[1, 2]), 2, 1, 3] = math.nan  # sequence 1, its last key, kv head 1
    for lo_ in (lo, hi - 1):  # every key, or only each sequence's last
        out, lse = kernel.paged_attention_triton(q, kp, vp, table, lo_, hi, 0.25, num_splits=3)
        ref, ref_lse = paged_attention_twin(q.double(), kp, vp.double(), table, lo_, hi, 0.25)
        assert bool(ref_lse.isnan().any())
        assert torch.equal(lse.isnan(), ref_lse.isnan()) and torch.equal(out.isnan(), ref.isnan())
        torch.testing.assert_close(
            out.double().nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("P", [16, 32, 128])
@pytest.mark.parametrize("storage", ["bf16", "int8", "fp8"])
def test_whole_page_tiles_match_the_twin(kernel, P, storage):
    """Pages of a power-of-two size >= 16 are read whole, a tile at a time (one block-table
    read per page): lengths that end mid-page, a window starting mid-page, several splits, and
    bf16 / int8 / fp8 pages all give the twin's result."""
    from selfattn.cache import quant

    assert kernel._tile_keys(P) == (max(P, kernel.PAGE_TILE_KEYS), P)
    assert kernel._tile_keys(24)[1] == 0 and kernel._tile_keys(8)[1] == 0  # per-key walk
    dtype = torch.bfloat16 if storage == "bf16" else torch.float32
    q, kp, vp, table, lo, hi = _case(10 + P, 2, 4, 2, 2, 16, 16, P, [3 * P + 5, P - 1], dtype,
                                     window=P + 3)  # fmt: skip
    scales = (None, None)
    if storage == "int8":
        (kp, ks), (vp, vs) = quant.quantize_int8(kp), quant.quantize_int8(vp)
        scales = (ks, vs)
    elif storage == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            pytest.skip("no float8_e4m3fn in this torch")
        (kp, ks), (vp, vs) = quant.quantize_fp8(kp), quant.quantize_fp8(vp)
        scales = (ks, vs)
    out, lse = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, 0.25, *scales, num_splits=3)
    ref, ref_lse = paged_attention_twin(q.double(), kp, vp, table, lo, hi, 0.25, *scales)
    if storage == "bf16":
        naive, _ = _naive(q, kp, vp, table, lo, hi, 0.25)
        assert_close_to_reference(out, ref, naive, dtype=dtype)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-5)


def test_split_table_fills_the_gpu_and_keeps_splits_long(kernel):
    """The split table: more splits for few programs and long contexts, never a split of fewer
    than MIN_SPLIT_TILES tiles, one split for a short context."""
    split = kernel._num_splits
    assert split(256, 4096, 64) > split(2048, 4096, 64) >= 1
    assert split(32, 65536, 64) >= split(32, 4096, 64)
    assert split(8, 100, 64) == 1
    for programs in (1, 100, 5000):
        for ctx in (64, 1000, 4096, 30000):
            n = split(programs, ctx, 64)
            assert n == 1 or ctx / n >= kernel.MIN_SPLIT_TILES * 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deterministic_mode_is_batch_invariant(kernel, dtype):
    """In deterministic mode a sequence's rows are bitwise the same alone and beside longer
    ones: its keys split at fixed boundaries (``SPLIT_KEYS``) and the splits merged in order.
    By default the split count follows the batch (the programs a GPU needs)."""
    from selfattn.kernels.determinism import SPLIT_KEYS, deterministic

    lens = [
        4 * SPLIT_KEYS - 24,
        12 * SPLIT_KEYS - 72,
        600,
    ]  # default: 3 splits alone, 11 in the batch
    q, kp, vp, table, lo, hi = _case(9, 3, 4, 2, 1, 16, 16, 16, lens, dtype)
    with deterministic():
        both = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, 0.25)
        alone = kernel.paged_attention_triton(q[:1], kp, vp, table[:1], lo[:1], hi[:1], 0.25)
    assert torch.equal(both[0][:1], alone[0]) and torch.equal(both[1][:1], alone[1])
    want = paged_attention_twin(q.double(), kp.double(), vp.double(), table, lo, hi, 0.25)
    naive, _ = _naive(q, kp, vp, table, lo, hi, 0.25)
    assert_close_to_reference(both[0], want[0], naive, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_head_holes_match_the_fp64_twin(kernel, dtype, monkeypatch):
    """``holes (B, Hkv, 2)``: each kv head skips its own keys (a compacted sequence's ragged
    kept counts): a hole mid-page, one over whole pages and past a split boundary, one empty;
    against the float64 twin with the same holes; ``paged_attention`` sends such a call to the
    kernel (it no longer declines holes)."""
    import selfattn as sa
    from selfattn import masks
    from selfattn.cache import paged_attention

    q, kp, vp, table, lo, hi = _case(9, 3, 4, 2, 2, 16, 16, 8, [45, 30, 61], dtype)
    holes = torch.zeros(3, 2, 2, dtype=torch.long)
    holes[0, 0] = torch.tensor([3, 6])
    holes[0, 1] = torch.tensor([9, 33])
    holes[2, 1] = torch.tensor([16, 40])
    scale = 16**-0.5
    out, lse = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, scale, num_splits=3,
                                             holes=holes)  # fmt: skip
    args = (table, lo, hi, scale)
    o64, l64 = paged_attention_twin(q.double(), kp.double(), vp.double(), *args, holes=holes)
    naive, naive_lse = paged_attention_twin(q, kp, vp, *args, compute_dtype=dtype, holes=holes)
    assert_close_to_reference(out, o64, naive, dtype=dtype)
    assert_close_to_reference(lse, l64, naive_lse, dtype=torch.float32, what="lse")
    plain, _ = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, scale, num_splits=3)
    assert not torch.equal(plain[0], out[0]) and torch.equal(plain[1], out[1])
    lens = torch.tensor([45, 30, 61])
    monkeypatch.setenv("SELFATTN_PAGED_TRITON", "1")
    call = dict(mask=masks.causal(), holes=holes)
    explained = sa.backends.explain_paged(q, kp, vp, table, lens, print_table=False, **call)
    assert explained.chosen == "triton"
    via = paged_attention(q, kp, vp, table, lens, **call)
    assert_close_to_reference(via, o64, naive, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["whole-pages", "page-size-5-window", "holes"])
def test_key_scores_match_the_fp64_twin(kernel, case, dtype):
    """Each attended key's score (decode-time eviction's statistic: the weights are exp(score -
    lse)), written as the kernel computes it across splits: exactly at the attended slots (the
    caller's -inf elsewhere), within the ratio rule of the fp64 twin's, the weights too; out
    and lse unchanged by recording."""
    from selfattn.kernels.paged_decode import key_weights

    if case == "page-size-5-window":
        q, kp, vp, table, lo, hi = _case(3, 2, 6, 2, 2, 16, 32, 5, [23, 12], dtype, window=4)
    else:
        q, kp, vp, table, lo, hi = _case(9, 3, 4, 2, 1, 16, 16, 16, [45, 30, 61], dtype)
    holes = None
    if case == "holes":
        holes = torch.zeros(3, 2, 2, dtype=torch.long)
        holes[0, 1] = torch.tensor([9, 33])
        holes[2, 0] = torch.tensor([16, 40])
    scale = q.shape[-1] ** -0.5
    P = kp.shape[1]
    scores = torch.full((*q.shape[:3], table.shape[1] * P), float("-inf"))
    run = dict(num_splits=3, holes=holes)
    out, lse = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, scale, **run,
                                             scores=scores)  # fmt: skip
    plain, plain_lse = kernel.paged_attention_triton(q, kp, vp, table, lo, hi, scale, **run)
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    args = (table, lo, hi, scale)
    _, l64, s64 = paged_attention_twin(q.double(), kp.double(), vp.double(), *args, holes=holes,
                                       return_scores=True)  # fmt: skip
    _, _, naive = paged_attention_twin(q, kp, vp, *args, compute_dtype=dtype, holes=holes,
                                       return_scores=True)  # fmt: skip
    attended = torch.isfinite(s64)
    assert torch.equal(torch.isfinite(scores), attended), "scores written at unattended slots"
    assert_close_to_reference(scores[attended].double(), s64[attended],
                              naive[attended].double(), dtype=dtype, what="scores")  # fmt: skip
    w, w64 = key_weights(scores, lse), torch.exp(s64 - l64.unsqueeze(-1))
    w_naive = torch.exp(naive - torch.logsumexp(naive.float(), -1, keepdim=True))
    assert_close_to_reference(w.double(), w64, w_naive.double(), dtype=dtype, what="weights")


def test_a_triton_score_buffer_of_the_wrong_shape_is_refused(kernel):
    q, kp, vp, table, lo, hi = _case(1, 2, 4, 2, 1, 16, 16, 16, [20, 9], torch.float32)
    bad = torch.full((2, 4, 1, 5), float("-inf"))
    with pytest.raises(ValueError, match=r"\(B, Hq, Sq, >= max_pages \* P\)=\(2, 4, 1, >= 32\)"):
        kernel.paged_attention_triton(q, kp, vp, table, lo, hi, 0.25, scores=bad)
