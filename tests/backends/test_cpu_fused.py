"""The cpu_fused backend (the fused C kernel) through ``attention()``, against the float64 oracle.

Sizes cross the kernel's 64-key tiles and its query tiles (Sq = 97 -> tiles of 49 and 48 rows),
so EMPTY, FULL and PARTIAL tiles, ragged edge tiles and multi-tile online-softmax rescaling all
run; tests/kernels/test_fused_attention.py checks the kernel against its twin directly.
"""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch

import selfattn
from selfattn import _log, backends, masks, scores
from selfattn.kernels import fused_attention
from selfattn.testing import (
    GRAD_FACTOR,
    assert_close_to_reference,
    check_against_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)
from tests._kernel_helpers import c_kernel
from tests.backends.test_chunked import MASKS, NEEDS_NONNEGATIVE_OFFSET

needs_kernel = pytest.mark.c_kernel(fused_attention)
pytestmark = needs_kernel
cpu_attention = functools.partial(selfattn.attention, backend="cpu_fused")


@pytest.mark.parametrize(("Sq", "Sk"), [(97, 150), (150, 97)])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_masks_match_reference(mask_name, Sq, Sk):
    if mask_name in NEEDS_NONNEGATIVE_OFFSET and Sq > Sk:
        pytest.skip("the mask indexes absolute positions, negative when Sq > Sk")
    B, Hq, Hkv = 2, 4, 2
    seed = len(mask_name) * 7 + Sq
    q, k, v = make_qkv(B, Hq, Sq, 24, Hkv=Hkv, Sk=Sk, Dv=20, seed=seed)
    mask = MASKS[mask_name](B, Hq, Sq, Sk, seed)
    check_against_reference(cpu_attention, q, k, v, mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(8, 1), (6, 3)], ids=["MQA", "G2"])
def test_low_precision_and_gqa(dtype, heads):
    Hq, Hkv = heads
    q, k, v = make_qkv(2, Hq, 70, 59, Hkv=Hkv, Sk=131, Dv=40, dtype=dtype, seed=Hq)
    check_against_reference(cpu_attention, q, k, v, mask=masks.sliding_window(45))


@pytest.mark.parametrize("mask_name", ["causal", "sliding_window", "callable"])
def test_dropout_keeps_the_same_pairs_as_the_reference(mask_name):
    """Counter-based dropout: the kernel hashes (seed, b, h, query, key) as _common.dropout_keep
    does, so for one generator seed it drops exactly the reference's pairs, forward and
    backward (any other pair would show as an error far above the ratio rule's bound)."""
    q, k, v = make_qkv(2, 4, 70, 24, Hkv=2, Sk=130, seed=13, requires_grad=True)
    kw = dict(mask=MASKS[mask_name](2, 4, 70, 130, 13), dropout_p=0.3)

    check_dropout_call(q, k, v, 14, **kw)


def check_dropout_call(q, k, v, seed: int, **kw):
    """The fused kernel's output and dq, dk, dv for a dropout call against the float64
    reference's (the naive low-precision run as the noise baseline), every side drawing its
    pattern from a generator seeded with ``seed``. Returns ``(out, generator maker, o64,
    naive)``."""

    def gen():
        return torch.Generator().manual_seed(seed)

    out = cpu_attention(q, k, v, generator=gen(), **kw)
    o64, _, leaves64 = reference_attention(q, k, v, generator=gen(), **kw)
    on, _, leavesn = naive_attention(q, k, v, generator=gen(), **kw)
    assert_close_to_reference(out, o64, on)
    dout = torch.randn(out.shape, generator=gen())
    grads = torch.autograd.grad(out, (q, k, v), dout)
    g64 = torch.autograd.grad(o64, leaves64, dout.double())
    gn = torch.autograd.grad(on, leavesn, dout)
    for name, a, o, n in zip(("dq", "dk", "dv"), grads, g64, gn):
        assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, what=name)
    return out, gen, o64, on


@pytest.mark.parametrize("q_offset", [None, 0, 40], ids=["bottom-right", "0", "40"])
@pytest.mark.parametrize("mask_name", ["causal", "sliding_window", "documents", "callable"])
def test_alibi_matches_reference(mask_name, q_offset):
    """ALiBi's distances are between absolute positions (q_offset + row, key): the kernel adds
    them per tile, FULL tiles included, forward and backward."""
    Sq, Sk = 70, 130
    q, k, v = make_qkv(1, 4, Sq, 24, Hkv=2, Sk=Sk, seed=12)
    mask = MASKS[mask_name](1, 4, Sq, Sk, 12)
    kw = {} if q_offset is None else {"q_offset": q_offset}
    check_against_reference(cpu_attention, q, k, v, mask=mask, score_mod=scores.alibi(4), **kw)


def _bias(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2


# score mods the kernel applies (alibi and bias add, the soft cap comes last; or the bias, the
# cap, then alibi: flash-attn's order)
SCORE_MODS = {
    "softcap": lambda: scores.softcap(3.0),
    "bias": lambda: scores.bias(_bias((2, 4, 70, 130), 1)),
    "bias-broadcast-rows": lambda: scores.bias(_bias((4, 1, 130), 2)),
    "alibi-bias-softcap": lambda: (
        scores.alibi(4) >> scores.bias(_bias((70, 130), 3)) >> scores.softcap(2.0)
    ),
    "bias-softcap-alibi": lambda: (
        scores.bias(_bias((70, 130), 4)) >> scores.softcap(2.0) >> scores.alibi(4)
    ),
}


@pytest.mark.parametrize("mask_name", ["causal", "sliding_window", "callable"])
@pytest.mark.parametrize("mod", list(SCORE_MODS))
def test_score_mods_match_reference_with_gradients(mod, mask_name):
    """Soft cap and bias tensors run in the kernel (forward, and the backward through the cap's
    1 - tanh²), GQA, ragged tiles; scale 1 makes scores large enough for the cap to bend."""
    q, k, v = make_qkv(2, 4, 70, 24, Hkv=2, Sk=130, Dv=20, seed=len(mod) + len(mask_name))
    mask = MASKS[mask_name](2, 4, 70, 130, 5)
    score_mod = SCORE_MODS[mod]()
    assert (
        backends.explain(q, k, v, mask=mask, score_mod=score_mod, print_table=False).reasons[
            "cpu_fused"
        ]
        is None
    )
    check_against_reference(cpu_attention, q, k, v, mask=mask, score_mod=score_mod, scale=1.0)


# bias shapes whose gradient the kernel sums over their broadcast axes (B=2, Hq=4, Sq=70, Sk=130)
BIAS_GRAD_SHAPES = {
    "BHQK": (2, 4, 70, 130), "1HQK": (1, 4, 70, 130), "B1QK": (2, 1, 70, 130), "QK": (70, 130),
    "1K": (1, 130), "Q1": (70, 1), "B11K": (2, 1, 1, 130), "scalar": (),
}  # fmt: skip


def _bias_gradients(q, k, v, bias, mod, seed, **kwargs):
    """``(out, dq, dk, dv, dbias)`` of cpu_fused, of the float64 oracle (the bias in float64 too)
    and of the naive formula in the inputs' dtype, for one random ``dout``; ``mod(bias)`` is the
    score mod."""
    found = []
    for attend in (cpu_attention, reference_attention, naive_attention):
        b = bias.detach().to(torch.float64 if attend is reference_attention else bias.dtype)
        b.requires_grad_(True)
        gen = {"generator": torch.Generator().manual_seed(seed)} if "dropout_p" in kwargs else {}
        qkv = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attend(*qkv, score_mod=mod(b), **kwargs, **gen)
        out, leaves = (out, qkv) if attend is cpu_attention else (out[0], list(out[2]))
        g = torch.Generator().manual_seed(seed + 1)
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
        found.append((out, *torch.autograd.grad(out, [*leaves, b], dout)))
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(BIAS_GRAD_SHAPES))
def test_bias_gradient_matches_reference(shape, dtype):
    """A bias that requires grad stays on cpu_fused (it was sent to chunked): dBias is dS summed
    over the bias's broadcast axes, against the float64 oracle's by the ratio rule, with GQA,
    ragged tiles, a mask (window or causal) and dropout on half the shapes."""
    i = list(BIAS_GRAD_SHAPES).index(shape)
    q, k, v = make_qkv(2, 4, 70, 24, Hkv=2, Sk=130, Dv=20, dtype=dtype, seed=60 + i)
    bias = _bias(BIAS_GRAD_SHAPES[shape], 61 + i).to(dtype).requires_grad_(True)
    kwargs = dict(mask=masks.sliding_window(50) if i % 2 else masks.causal(), scale=0.5)
    if i % 4 < 2:
        kwargs["dropout_p"] = 0.2
    why = backends.explain(q, k, v, score_mod=scores.bias(bias), print_table=False, **kwargs)
    assert why.reasons["cpu_fused"] is None
    ours, oracle, naive = _bias_gradients(q, k, v, bias, scores.bias, 62 + i, **kwargs)
    assert ours[4].shape == bias.shape and ours[4].dtype == dtype
    assert_close_to_reference(ours[0], oracle[0], naive[0], dtype=dtype)
    for name, a, o, n in zip(("dq", "dk", "dv", "dbias"), ours[1:], oracle[1:], naive[1:]):
        assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, dtype=dtype, what=name)


@pytest.mark.usefixtures("every_thread")
def test_bias_gradient_through_the_cap_is_bitwise_deterministic():
    """ALiBi >> bias >> soft cap (dS through 1 - tanh²) on a bias broadcast over the batch: by the
    ratio rule, and bitwise the same on 1 and 2 threads (no atomics: each bias block is summed
    by one work item in a fixed order)."""
    q, k, v = make_qkv(3, 4, 97, 40, Hkv=2, Sk=150, seed=63)
    bias = _bias((1, 4, 97, 150), 64)

    def mod(b):
        return scores.alibi(4) >> scores.bias(b) >> scores.softcap(2.0)

    before, runs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(_bias_gradients(q, k, v, bias, mod, 65, mask=masks.causal(), scale=1.0))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    for name, a, o, n in zip(("dq", "dk", "dv", "dbias"), *(r[1:] for r in runs[0])):
        assert_close_to_reference(a, o, n, factor=GRAD_FACTOR, what=name)


@pytest.mark.parametrize(
    ("dtype", "kernel"),
    [(torch.bfloat16, "1"), (torch.bfloat16, "generic"), (torch.float16, "1")],
    ids=["bf16", "bf16-generic", "fp16"],
)
def test_softcap_in_low_precision(dtype, kernel, monkeypatch):
    """bf16 on a CPU with avx512_bf16 runs vdpbf16ps scores and bf16 P V (forced generic: the
    float32 path); with bias, soft cap, GQA and gradients, within the ratio rule."""
    monkeypatch.setenv(fused_attention.ENV_VAR, kernel)
    q, k, v = make_qkv(1, 6, 70, 40, Hkv=3, Sk=131, dtype=dtype, seed=17)
    mod = scores.bias(_bias((1, 6, 70, 131), 4).to(dtype)) >> scores.softcap(5.0)
    check_against_reference(cpu_attention, q, k, v, mask=masks.causal(), score_mod=mod)


def test_score_mods_on_the_forced_generic_path(monkeypatch):
    monkeypatch.setenv(fused_attention.ENV_VAR, "generic")
    q, k, v = make_qkv(1, 2, 33, 16, Sk=77, seed=18)
    mod = scores.bias(_bias((33, 77), 5)) >> scores.softcap(2.0)
    check_against_reference(cpu_attention, q, k, v, mask=masks.causal(), score_mod=mod, scale=1.0)


@pytest.mark.parametrize(("Sq", "Sk"), [(1, 1), (1, 200), (7, 1), (65, 64)])
def test_odd_shapes(Sq, Sk):
    q, k, v = make_qkv(1, 3, Sq, 8, Sk=Sk, Dv=17, seed=Sq * Sk, contiguous=False)
    check_against_reference(cpu_attention, q, k, v, mask=masks.causal())


def test_empty_rows_give_zero_output_minus_inf_lse_and_zero_grads():
    """Rows the mask leaves without a key (here every row of the first sequence, and rows of
    the second before its first document starts) follow chunked's convention."""
    B, H, S = 2, 2, 90
    q, k, v = make_qkv(B, H, S, 16, seed=3, requires_grad=True)

    def late_start(b, h, q_idx, kv_idx):
        return (b == 1) & (q_idx >= 70) & (kv_idx <= q_idx)

    out, lse = cpu_attention(q, k, v, mask=late_start, return_lse=True)
    _, ref_lse = selfattn.attention(q, k, v, mask=late_start, return_lse=True, backend="chunked")
    empty = torch.zeros(B, H, S, dtype=torch.bool)
    empty[0], empty[1, :, :70] = True, True
    assert bool((out[empty] == 0).all()) and bool((lse[empty] == -math.inf).all())
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and bool((q.grad[empty] == 0).all())
    check_against_reference(cpu_attention, q, k, v, mask=late_start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("var", "value", "isa"),
    [
        ("SELFATTN_ATTN_KERNEL", "generic", "generic"),
        ("SELFATTN_FUSED_ISA", "generic", "generic"),
        ("SELFATTN_FUSED_ISA", "avx2", "avx2+fma"),
    ],
    ids=["attn-kernel-generic", "fused-isa-generic", "fused-isa-avx2"],
)
def test_forced_lower_isa_path_matches(monkeypatch, var, value, isa, dtype):
    """``SELFATTN_FUSED_ISA=avx2|generic`` (and ``SELFATTN_ATTN_KERNEL=generic``) run a lower
    build: what an AVX2-only CPU (Zen 3) or one without the vector features gets; it names its
    instruction sets and is right, forward and backward, with GQA and ragged tiles."""
    if value == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(var, value)
    c_kernel(fused_attention)
    assert fused_attention.isa() == isa
    q, k, v = make_qkv(2, 4, 97, 40, Hkv=2, Sk=130, dtype=dtype, seed=5)
    check_against_reference(cpu_attention, q, k, v, mask=masks.causal())


def test_unknown_fused_isa_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("SELFATTN_FUSED_ISA", "avx9")
    with pytest.raises(ValueError, match=r"SELFATTN_FUSED_ISA='avx9'.*generic, avx2, native"):
        fused_attention.library()


def test_forward_is_bitwise_deterministic():
    q, k, v = make_qkv(2, 4, 97, 40, Hkv=2, Sk=130, seed=6)
    mask = masks.documents(torch.arange(130).div(40, rounding_mode="floor").expand(2, -1))
    first = cpu_attention(q, k, v, mask=mask, return_lse=True)
    for _ in range(2):
        again = cpu_attention(q, k, v, mask=mask, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_sinks_merge_through_the_lse_with_gradients():
    q, k, v = make_qkv(1, 4, 70, 16, Hkv=2, Sk=90, seed=7, requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    out = cpu_attention(q, k, v, mask=masks.causal(), sinks=sinks)
    ref = selfattn.attention(q, k, v, mask=masks.causal(), sinks=sinks, backend="chunked")
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out.square().sum(), (q, sinks))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, sinks))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_nonfinite_values_in_masked_keys_do_not_leak():
    """NaN in the K/V of keys no query attends (padding slots): the checked redo keeps them out."""
    q, k, v = make_qkv(1, 2, 64, 16, Sk=100, seed=8)
    k[:, :, 80:], v[:, :, 80:] = math.nan, math.inf
    out = cpu_attention(q, k, v, mask=masks.padding(torch.tensor([80])))
    ref = selfattn.attention(q, k[:, :, :80], v[:, :, :80], q_offset=36, backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_finite_calls_trust_the_kernels_verdict_without_a_pass_over_q_or_out(dtype, monkeypatch):
    """The kernel tells whether q and out were finite as it reads and writes them, so a finite
    call runs no reduction over either on the host (it was ~4% of a bf16 window forward); a NaN
    in q is still found and the call redone exactly (by chunked, logged once)."""
    summed = []
    all_finite = backends.exact.all_finite
    monkeypatch.setattr(
        backends.exact, "all_finite", lambda *ts: summed.append(ts) or all_finite(*ts)
    )
    q, k, v = (t.to(dtype) for t in make_qkv(1, 2, 97, 40, Sk=150, seed=9))
    out = cpu_attention(q, k, v, mask=masks.sliding_window(70))
    assert summed == [] and torch.isfinite(out).all()
    q[0, 1, 50, 3] = math.nan
    out = cpu_attention(q, k, v, mask=masks.sliding_window(70))
    ref = selfattn.attention(q, k, v, mask=masks.sliding_window(70), backend="chunked")
    assert summed  # the redo's checks
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=0, atol=0)
    assert out[0, 1, 50].isnan().all() and not out[0, 0].isnan().any()


def test_only_calls_needing_gradients_go_through_the_op(monkeypatch):
    """The custom op's dispatcher costs ~35 µs a call (as much as a small call's kernel): a call
    autograd will not differentiate runs the op's implementation directly, one it will runs the
    op (its autograd formula is the kernel's backward)."""
    from selfattn.kernels import ops

    through_op = []
    op = ops.attention_fwd_cpu
    monkeypatch.setattr(ops, "attention_fwd_cpu", lambda *a: through_op.append(1) or op(*a))
    q, k, v = make_qkv(1, 2, 33, 16, Sk=70, seed=10)
    check_against_reference(cpu_attention, q, k, v, grad=False, mask=masks.causal())
    assert through_op == []
    q.requires_grad_()
    with torch.no_grad():
        cpu_attention(q, k, v, mask=masks.causal())
    assert through_op == []
    cpu_attention(q, k, v, mask=masks.causal()).sum().backward()
    assert through_op == [1] and q.grad is not None


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"score_mod": lambda s, b, h, qi, ki: s * 2}, "not made of alibi, bias and softcap"),
        ({"score_mod": scores.softcap(2.0) >> scores.bias(torch.ones(8, 8))}, "caps last"),
        ({"dtype": torch.float64}, "float64"),
    ],
)
def test_declines_with_a_reason(kwargs, why):
    kwargs = dict(kwargs)
    q, k, v = make_qkv(1, 2, 8, 16, dtype=kwargs.pop("dtype", torch.float32), seed=9)
    reasons = backends.explain(q, k, v, print_table=False, **kwargs).reasons
    assert why in reasons["cpu_fused"]
    with pytest.raises(ValueError, match=why):
        cpu_attention(q, k, v, **kwargs)


def test_kernel_turned_off_is_declined_and_logged_once(monkeypatch, caplog):
    monkeypatch.setenv(fused_attention.ENV_VAR, "0")
    monkeypatch.setattr(_log, "_said", set())
    caplog.set_level(logging.INFO, logger="selfattn")
    q, k, v = make_qkv(1, 2, 8, 16, seed=10)
    for _ in range(2):
        reason = backends.explain(q, k, v, print_table=False).reasons["cpu_fused"]
        assert "could not be built" in reason
        selfattn.attention(q, k, v)  # auto runs another backend
    said = [r.getMessage() for r in caplog.records if "cpu_fused backend" in r.getMessage()]
    assert len(said) == 1 and "chunked runs" in said[0]


def test_auto_picks_it_for_a_sparse_mask_on_cpu():
    q, k, v = make_qkv(1, 2, 512, 16, seed=11)
    assert backends.explain(q, k, v, mask=masks.sliding_window(32), print_table=False).chosen == (
        "cpu_fused"
    )


def test_tile_description_is_kept_across_calls_for_the_same_mask(monkeypatch):
    """A second call with the same mask object and geometry reuses the tile description (no
    mask evaluation); another mask, another length or a row-ordered tensor mask builds anew."""
    from selfattn.backends import cpu_fused

    built = []
    build = cpu_fused._build_tiles
    monkeypatch.setattr(cpu_fused, "_build_tiles", lambda *a: built.append(1) or build(*a))
    monkeypatch.setattr(cpu_fused, "_kept", type(cpu_fused._kept)())
    q, k, v = make_qkv(1, 2, 70, 16, seed=21)
    window = masks.sliding_window(9)
    first = cpu_attention(q, k, v, mask=window)
    assert torch.equal(cpu_attention(q, k, v, mask=window), first) and len(built) == 1
    cpu_attention(q, k, v, mask=masks.sliding_window(9))  # equal, but another object
    cpu_attention(q[:, :, :50], k, v, mask=window)
    assert len(built) == 3
    dense = torch.rand(70, 70, generator=torch.Generator().manual_seed(22)) < 0.5
    for _ in range(2):
        cpu_attention(q, k, v, mask=dense)
    assert len(built) == 5
    ids = torch.arange(70) // 30
    docs = masks.documents(ids)
    cpu_attention(q, k, v, mask=docs)
    ids[20:] = 5  # in place: the kept description is stale, so a new one is built
    check_against_reference(cpu_attention, q, k, v, mask=docs, grad=False)
    assert len(built) == 7
    user = masks.CallableMask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
    for _ in range(2):  # a user callable may read state no key sees: never kept
        cpu_attention(q, k, v, mask=user)
    assert len(built) == 9
