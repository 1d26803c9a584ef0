"""Tests of the chunked backend: tiles, online softmax and its recomputing backward.

Most cases run twice: with the default tiles and with tiny ones (``block_q=4, block_k=3,
max_chunk=6``) so that small sizes cross many tile and chunk boundaries, and every tile kind
(EMPTY / PARTIAL / FULL) and the multi-chunk rescaling are exercised. The oracle is the float64
reference with the ratio rule of docs/testing.md.
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import selfattn
from selfattn import masks, scores
from selfattn.backends import chunked, get
from selfattn.call import prepare
from selfattn.testing import (
    assert_close_to_reference,
    check_against_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)

SMALL_TILES = {"block_q": 4, "block_k": 3, "max_chunk": 6}
TILES = {"default": {}, "small": SMALL_TILES}


def chunked_attention(q, k, v, *, block_q=None, block_k=None, max_chunk=None, **kwargs):
    """``selfattn.attention(..., backend="chunked")`` with explicit tile sizes."""
    q, k, v, call = prepare(q, k, v, **kwargs)
    assert get("chunked").reject(q, k, v, call) is None
    out, lse = chunked.run(q, k, v, call, block_q=block_q, block_k=block_k, max_chunk=max_chunk)
    return (out, lse) if call.return_lse else out


def fn_for(tiles: str):
    if tiles == "default":
        return functools.partial(selfattn.attention, backend="chunked")
    return functools.partial(chunked_attention, **TILES[tiles])


def _ids(B, n, seed):
    """Sorted random document ids (packed sequences) of length ``n`` per batch: ``(B, n)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randint(0, 4, (B, n), generator=g), dim=-1).values


# (name, factory(B, Hq, Sq, Sk, seed) -> mask). Masks needing q_offset >= 0 get Sq <= Sk below.
MASKS = {
    "causal": lambda B, H, Sq, Sk, s: masks.causal(),
    "sliding_window": lambda B, H, Sq, Sk, s: masks.sliding_window(5),
    "sliding_window_1": lambda B, H, Sq, Sk, s: masks.sliding_window(1),
    "chunked": lambda B, H, Sq, Sk, s: masks.chunked(6),
    "chunked_bidir": lambda B, H, Sq, Sk, s: masks.chunked(7, causal=False),
    "padding": lambda B, H, Sq, Sk, s: masks.padding(torch.tensor([Sk, 0, Sk // 2][:B])),
    "documents": lambda B, H, Sq, Sk, s: masks.documents(_ids(B, max(Sq, Sk), s)),
    "prefix_lm": lambda B, H, Sq, Sk, s: masks.prefix_lm(4),
    "block_sparse": lambda B, H, Sq, Sk, s: masks.block_sparse(
        torch.rand(H, max(Sq, Sk) // 5 + 1, Sk // 5 + 1, generator=torch.Generator().manual_seed(s))
        > 0.5,
        5,
    ),
    "from_tensor": lambda B, H, Sq, Sk, s: masks.from_tensor(
        torch.rand(B, 1, Sq, Sk, generator=torch.Generator().manual_seed(s)) > 0.3
    ),
    "callable": lambda B, H, Sq, Sk, s: lambda b, h, q, kv: ((q - kv) % 3 == 0) | (h == 1),
    "causal&documents": lambda B, H, Sq, Sk, s: (
        masks.causal() & masks.documents(_ids(B, max(Sq, Sk), s))
    ),
    "window|prefix": lambda B, H, Sq, Sk, s: masks.sliding_window(3) | masks.prefix_lm(2),
    "~causal": lambda B, H, Sq, Sk, s: ~masks.causal(),
}
NEEDS_NONNEGATIVE_OFFSET = {"documents", "block_sparse", "causal&documents"}


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize(("Sq", "Sk"), [(23, 37), (37, 23)])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_masks_match_reference(mask_name, Sq, Sk, tiles):
    B, Hq, Hkv = 3, 4, 2
    seed = zlib.crc32(f"{mask_name}/{Sq}/{Sk}".encode()) % 1000
    q, k, v = make_qkv(B, Hq, Sq, 16, Hkv=Hkv, Sk=Sk, Dv=8, seed=seed)
    kwargs = {"mask": MASKS[mask_name](B, Hq, Sq, Sk, seed)}
    if Sq > Sk and mask_name in NEEDS_NONNEGATIVE_OFFSET:
        kwargs["q_offset"] = 0
    check_against_reference(fn_for(tiles), q, k, v, **kwargs)


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hkv", [8, 4, 2, 1])  # GQA ratios 1, 2, 4 and MQA
def test_dtypes_and_gqa(dtype, Hkv, tiles):
    q, k, v = make_qkv(2, 8, 19, 24, Hkv=Hkv, Sk=29, dtype=dtype, seed=Hkv)
    mask = masks.causal() & masks.padding(torch.tensor([29, 17]))
    check_against_reference(fn_for(tiles), q, k, v, mask=mask)


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Sk", [1, 7])
def test_half_lse_is_fp32_accurate(Sk, dtype, tiles):
    # chunked widens half inputs to fp32 and accumulates there, so its lse must be as accurate as
    # the same formula in fp32 on the widened inputs. It once scaled q by ``scale · log2 e`` in
    # half precision (``torch.mul`` of a half tensor by a 0-d fp32 tensor computes in half),
    # rounding every score: with one key (lse = its score) the error was 3.5e-4, ~2000x fp32's.
    q, k, v = make_qkv(2, 3, 7, 64, Sk=Sk, dtype=dtype, seed=Sk, contiguous=False)
    _, lse = fn_for(tiles)(q, k, v, mask=masks.causal(), return_lse=True)
    _, lse64, _ = reference_attention(q, k, v, mask=masks.causal())
    _, lse32, _ = naive_attention(q.float(), k.float(), v.float(), mask=masks.causal())
    assert_close_to_reference(lse, lse64, lse32, dtype=torch.float32, what="lse")


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize(
    ("Sq", "Sk"), [(1, 1), (1, 97), (7, 97), (97, 7), (97, 97), (2, 1), (1, 2)]
)
def test_odd_sizes(Sq, Sk, tiles):
    q, k, v = make_qkv(2, 2, Sq, 40, Sk=Sk, Dv=59, seed=Sq + 7 * Sk)
    check_against_reference(fn_for(tiles), q, k, v, mask=masks.sliding_window(9))
    check_against_reference(fn_for(tiles), q, k, v)


def test_default_tiles_crossed():
    # Larger than the default tiles in both directions; Sq = 300 is not a multiple of block_q.
    q, k, v = make_qkv(1, 2, 300, 64, Hkv=1, Sk=1025, seed=11)
    bq, bk, _ = chunked.tile_sizes(300, 1025)
    assert 300 > bq and 1025 > bk
    check_against_reference(fn_for("default"), q, k, v, mask=masks.sliding_window(200))
    check_against_reference(fn_for("default"), q, k, v, mask=masks.causal(), q_offset=0)


@pytest.mark.parametrize("mask_name", ["none", "causal", "prefix_lm"])
def test_coarse_tiles_match_reference(mask_name):
    # masks with few PARTIAL tiles get merged (coarser) query tiles; check that path too
    B, Hq, S = 2, 2, 1100
    q, k, v = make_qkv(B, Hq, S, 16, seed=5)
    mask = {
        "none": None,
        "causal": masks.causal(),
        "prefix_lm": masks.prefix_lm(torch.tensor([300, 0])),
    }[mask_name]
    _, _, _, call = prepare(q, k, v, mask=mask)
    bq, bk, _ = chunked.tile_sizes(S, S)
    grid = chunked._grid(call, B, Hq, S, S, bq, bk, q.device)
    assert chunked._choose_rows(grid, G=1) > 1  # the case really takes the coarse path
    check_against_reference(fn_for("default"), q, k, v, mask=mask)


def test_sliding_window_keeps_fine_tiles():
    q, k, v = make_qkv(1, 2, 2000, 8, seed=1)
    _, _, _, call = prepare(q, k, v, mask=masks.sliding_window(256))
    bq, bk, _ = chunked.tile_sizes(2000, 2000)
    assert chunked._choose_rows(chunked._grid(call, 1, 2, 2000, 2000, bq, bk, "cpu"), G=1) == 1


@pytest.mark.parametrize("tiles", ["default", "small"])
def test_non_contiguous_inputs(tiles):
    q, k, v = make_qkv(2, 4, 21, 16, Hkv=2, Sk=26, contiguous=False, seed=3)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check_against_reference(fn_for(tiles), q, k, v, mask=masks.causal())


def _rpb():
    """A T5 bias over 4 heads with weights large enough to matter (the default init is 0.02σ)."""
    rpb = scores.RelativePositionBias(4, num_buckets=8, max_distance=20)
    with torch.no_grad():
        rpb.weight.copy_(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))
    return rpb


SCORE_MODS = {
    "alibi": lambda: scores.alibi(4),
    "softcap": lambda: scores.softcap(2.0),
    "bias": lambda: scores.bias(
        torch.randn(1, 4, 19, 27, generator=torch.Generator().manual_seed(1))
    ),
    "t5": _rpb,
    "callable": lambda: lambda s, b, h, q, kv: s * 0.5 + torch.cos(s) * (h + 1),
    "alibi>>softcap": lambda: scores.alibi(4) >> scores.softcap(3.0),
}


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("mask_name", ["none", "causal", "sliding_window"])
@pytest.mark.parametrize("mod_name", sorted(SCORE_MODS))
def test_score_mods(mod_name, mask_name, tiles):
    q, k, v = make_qkv(2, 4, 19, 16, Hkv=2, Sk=27, seed=5)
    mask = None if mask_name == "none" else MASKS[mask_name](2, 4, 19, 27, 0)
    check_against_reference(fn_for(tiles), q, k, v, mask=mask, score_mod=SCORE_MODS[mod_name]())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.0, -1.5, 3.0])
def test_unusual_scales(scale, dtype):
    q, k, v = make_qkv(2, 4, 17, 16, Hkv=1, Sk=23, dtype=dtype, seed=2)
    check_against_reference(fn_for("small"), q, k, v, mask=masks.causal(), scale=scale)


@pytest.mark.parametrize("q_offset", [-9, -1, 0, 3, 40])
def test_q_offset(q_offset):
    # negative offsets leave the first rows with no key under causal: out 0, lse -inf
    q, k, v = make_qkv(2, 2, 13, 16, Sk=21, seed=4)
    for tiles in ("default", "small"):
        check_against_reference(fn_for(tiles), q, k, v, mask=masks.causal(), q_offset=q_offset)
        check_against_reference(
            fn_for(tiles), q, k, v, mask=masks.sliding_window(4), q_offset=q_offset
        )


def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "case", ["none", "causal", "window+softcap", "documents+alibi", "empty_rows", "dropout"]
)
def test_gradcheck_fp64(case):
    q, k, v = make_qkv(1, 4, 7, 3, Hkv=2, Sk=8, Dv=2, dtype=torch.float64, seed=8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kwargs = {
        "none": {},
        "causal": {"mask": masks.causal()},
        "window+softcap": {"mask": masks.sliding_window(4), "score_mod": scores.softcap(2.0)},
        "documents+alibi": {
            "mask": masks.documents(torch.tensor([0] * 3 + [1] * 5)),
            "score_mod": scores.alibi(4),
        },
        "empty_rows": {"mask": masks.causal(), "q_offset": -3},
        "dropout": {"mask": masks.causal(), "dropout_p": 0.3},
    }[case]

    def fn(q, k, v):
        # a fixed generator makes the dropout pattern the same on every evaluation; lse is -inf
        # on empty rows, where finite differences are NaN, so it is only checked elsewhere
        gen = torch.Generator().manual_seed(3)
        lse = case != "empty_rows"
        return chunked_attention(q, k, v, **SMALL_TILES, return_lse=lse, generator=gen, **kwargs)

    _gradcheck(fn, q, k, v)


def test_gradcheck_score_mod_tensors():
    q, k, v = make_qkv(1, 4, 6, 3, Hkv=1, Sk=8, Dv=2, dtype=torch.float64, seed=9)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bias = torch.randn(1, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    _gradcheck(
        lambda q, k, v, t: chunked_attention(
            q, k, v, mask=masks.causal(), score_mod=scores.bias(t), **SMALL_TILES
        ),
        q, k, v, bias,
    )  # fmt: skip
    rpb = _rpb().double()
    _gradcheck(
        lambda q, k, v, w: chunked_attention(
            q, k, v, mask=masks.sliding_window(5), score_mod=rpb, **SMALL_TILES
        ),
        q, k, v, rpb.weight,
    )  # fmt: skip


@pytest.mark.parametrize("tiles", ["default", "small"])
def test_score_mod_tensor_grads_match_reference(tiles):
    q, k, v = make_qkv(2, 4, 15, 16, Hkv=2, Sk=22, seed=12, requires_grad=True)
    base = torch.randn(2, 1, 15, 22, generator=torch.Generator().manual_seed(0))
    rpb = _rpb()
    dout = torch.randn(2, 4, 15, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (fn_for(tiles), functools.partial(selfattn.attention, backend="reference")):
        t = base.clone().requires_grad_()
        out = fn(q, k, v, mask=masks.causal(), score_mod=scores.bias(t * 2.0) >> rpb)
        grads = torch.autograd.grad(out, (t, rpb.weight, q), dout)
        results.append(grads)
    for name, a, b in zip(("bias", "t5 weight", "dq"), *results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name} grads differ")
    assert results[0][0].abs().sum() > 0 and results[0][1].abs().sum() > 0


def test_grad_through_lse():
    q, k, v = make_qkv(2, 4, 13, 8, Hkv=2, Sk=17, dtype=torch.float64, seed=6)
    results = []
    for fn in (fn_for("small"), functools.partial(selfattn.attention, backend="reference")):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = fn(qq, kk, vv, mask=masks.causal(), q_offset=-2, return_lse=True)
        loss = (out * 0.3).sum() + lse.masked_fill(lse.isinf(), 0).square().sum()
        results.append(torch.autograd.grad(loss, (qq, kk, vv)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_callable_closing_over_grad_tensor_is_rejected():
    q, k, v = make_qkv(1, 2, 9, 8, seed=1)
    w = torch.tensor(0.5, requires_grad=True)

    def mod(s, b, h, q_idx, kv_idx):
        return s + w * (q_idx - kv_idx)

    _, _, _, call = prepare(q, k, v, score_mod=mod)
    reason = get("chunked").reject(q, k, v, call)
    assert reason is not None and "tensors()" in reason and "reference" in reason
    with pytest.raises(ValueError, match=r"tensors\(\)"):
        selfattn.attention(q, k, v, score_mod=mod, backend="chunked")
    with torch.no_grad():  # no gradient to route: runs
        assert get("chunked").reject(q, k, v, call) is None

    class Listed(scores.ScoreMod):  # the fix the message names
        def score_mod(self, s, b, h, q_idx, kv_idx, q_offset=0):
            return s + w * (q_idx - kv_idx)

        def tensors(self):
            return (w,)

    dout = torch.randn(1, 2, 9, 8, generator=torch.Generator().manual_seed(0))
    out = selfattn.attention(q, k, v, score_mod=Listed(), backend="chunked")
    (gw,) = torch.autograd.grad(out, (w,), dout)
    ref = selfattn.attention(q, k, v, score_mod=Listed(), backend="reference")
    (rw,) = torch.autograd.grad(ref, (w,), dout)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-5)
    assert gw != 0


def test_mod_tensor_without_grad_is_accepted():
    q, k, v = make_qkv(1, 2, 9, 8, seed=1, requires_grad=True)
    t = torch.randn(9, 9)

    def mod(s, b, h, q_idx, kv_idx):
        return s + t[q_idx, kv_idx]

    check_against_reference(fn_for("small"), q, k, v, score_mod=mod, mask=masks.causal())


@pytest.mark.parametrize("tiles", ["default", "small"])
def test_dropout_matches_reference(tiles):
    q, k, v = make_qkv(2, 4, 23, 16, Hkv=2, Sk=31, dtype=torch.float64, seed=7, requires_grad=True)
    mask = masks.sliding_window(9)
    dout = torch.randn(2, 4, 23, 16, generator=torch.Generator().manual_seed(2), dtype=q.dtype)
    results = []
    for fn in (fn_for(tiles), functools.partial(selfattn.attention, backend="reference")):
        gen = torch.Generator().manual_seed(123)
        out, lse = fn(q, k, v, mask=mask, dropout_p=0.25, generator=gen, return_lse=True)
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v), dout)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, msg=f"{name} differs from the reference's dropout")
    no_drop = fn_for(tiles)(q, k, v, mask=mask)
    assert not torch.allclose(results[0][0], no_drop)  # dropout did something


@pytest.mark.parametrize("tiles", ["default", "small"])
def test_dropout_zero_is_bitwise_no_dropout(tiles):
    q, k, v = make_qkv(2, 4, 21, 16, Hkv=1, seed=4)
    a = fn_for(tiles)(q, k, v, mask=masks.causal(), dropout_p=0.0)
    b = fn_for(tiles)(q, k, v, mask=masks.causal())
    assert torch.equal(a, b)


@pytest.mark.parametrize("tiles", ["default", "small"])
def test_forward_is_bitwise_deterministic(tiles):
    q, k, v = make_qkv(2, 4, 45, 16, Hkv=2, Sk=60, seed=10, requires_grad=True)
    mask = masks.sliding_window(20) | masks.prefix_lm(3)
    runs = [fn_for(tiles)(q, k, v, mask=mask, score_mod=scores.alibi(4)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows(dtype):
    # row 0..5 of batch 0 see no key (causal, q_offset -6); batch 1 has no valid key at all
    q, k, v = make_qkv(2, 4, 12, 8, Hkv=2, Sk=9, dtype=dtype, seed=3, requires_grad=True)
    mask = masks.causal() & masks.padding(torch.tensor([9, 0]))
    for tiles in ("default", "small"):
        out, lse = fn_for(tiles)(q, k, v, mask=mask, q_offset=-6, return_lse=True)
        assert torch.isfinite(out).all()
        assert (out[0, :, :6] == 0).all() and (out[1] == 0).all()
        assert torch.isneginf(lse[0, :, :6]).all() and torch.isneginf(lse[1]).all()
        assert torch.isfinite(lse[0, :, 6:]).all()
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
        assert (dq[0, :, :6] == 0).all() and (dq[1] == 0).all()
        assert (dk[1] == 0).all() and (dv[1] == 0).all()


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_in_unattended_kv_does_not_leak(poison, tiles):
    q, k, v = make_qkv(2, 4, 14, 16, Hkv=2, Sk=26, seed=13, requires_grad=True)
    lengths = torch.tensor([19, 26])
    # also a stray column that the mask hides from every query
    mask = masks.padding(lengths) & masks.from_tensor((torch.arange(26) != 4).view(1, 26))
    k_bad, v_bad = k.detach().clone(), v.detach().clone()
    k_bad[0, :, 19:], v_bad[0, :, 19:] = poison, poison
    k_bad[:, :, 4], v_bad[:, :, 4] = poison, -poison
    k_bad.requires_grad_(), v_bad.requires_grad_()
    dout = torch.randn(2, 4, 14, 16, generator=torch.Generator().manual_seed(0))
    clean = fn_for(tiles)(q, k, v, mask=mask)
    dirty = fn_for(tiles)(q, k_bad, v_bad, mask=mask)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=1e-6)
    g_clean = torch.autograd.grad(clean, (q, k, v), dout)
    g_dirty = torch.autograd.grad(dirty, (q, k_bad, v_bad), dout)
    for a, b in zip(g_dirty, g_clean):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_memory_is_linear_in_sequence_length():
    B, H, S, D = 1, 2, 2048, 16
    q, k, v = make_qkv(B, H, S, D, seed=0, requires_grad=True)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    def fwd_bwd(backend):
        with _LargestTensor() as probe:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = selfattn.attention(q, k, v, mask=masks.causal(), backend=backend)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return probe.largest

    ref_largest = fwd_bwd("reference")
    assert ref_largest >= B * H * S * S  # the probe sees the reference's n×n scores
    saved.clear()
    largest = fwd_bwd("chunked")
    # no saved tensor and no intermediate grows like S²: the biggest are q/k/v-sized, tiles, or
    # the diagonal's partial-tile masks (S · block_k)
    assert max(saved) <= B * H * S * D
    bq, bk, _ = chunked.tile_sizes(S, S)
    assert largest <= B * H * S * max(D, bq, bk)
    assert largest * 16 < B * H * S * S


def test_empty_tiles_are_skipped_and_full_tiles_are_mask_free():
    calls: list[tuple] = []

    def mask_mod(b, h, q_idx, kv_idx):
        calls.append(tuple(torch.broadcast_shapes(q_idx.shape, kv_idx.shape)))
        return q_idx - kv_idx < 8

    class Band(masks.Mask):  # causal band of 8 with an exact analytic tile classification
        def mask_mod(self, b, h, q_idx, kv_idx, q_offset=0):
            return (kv_idx <= q_idx) & mask_mod(b, h, q_idx, kv_idx)

        def tile_kinds(self, grid, B=1, H=1):
            return masks.sliding_window(8).tile_kinds(grid, B, H)

    S, bq, bk = 64, 8, 8
    q, k, v = make_qkv(1, 1, S, 8, seed=0)
    out = chunked_attention(q, k, v, mask=Band(), block_q=bq, block_k=bk, max_chunk=64)
    ref = selfattn.attention(q, k, v, mask=masks.sliding_window(8), backend="reference")
    torch.testing.assert_close(out, ref)
    # window 8 with 8×8 tiles: each query tile has two partial tiles (the diagonal and the one
    # before it), nothing full; all are evaluated in one batched call of (n_partial · bq) rows
    n_partial = 2 * (S // bq) - 1
    assert calls == [(1, 1, n_partial * bq, bk)]


def test_bad_tile_sizes_name_the_value():
    q, k, v = make_qkv(1, 1, 5, 4)
    with pytest.raises(ValueError, match="block_k must be a positive int, got -2"):
        chunked_attention(q, k, v, block_k=-2)


def test_auto_and_chunked_classify_tiles_once(monkeypatch):
    """auto's density estimate and chunked's plan share one classification per call."""
    calls = []
    original = chunked._grid

    def counting(*args, **kwargs):
        calls.append(args[1:5])
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked, "_grid", counting)
    # float64: auto's pick is chunked (cpu_fused, which auto prefers in fp32, takes no float64)
    # long enough that the tiles skipped outweigh chunked's per-call set-up (its Cost.fixed)
    q, k, v = make_qkv(1, 2, 1000, 16, seed=5, dtype=torch.float64)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 20)

    assert selfattn.backends.explain(q, k, v, mask=window, print_table=False).chosen == "chunked"
    calls.clear()
    out = selfattn.attention(q, k, v, mask=window)
    assert len(calls) == 1, calls
    ref = selfattn.attention(q, k, v, mask=window, backend="reference")
    torch.testing.assert_close(out, ref)
