"""FlexAttention's conventions: a ``BlockMask`` as ``mask=``, ``Mask.to_block_mask`` for
``flex_attention`` called directly, K/V of batch 1 against a larger query batch, and the global
backend override (``sa.backends.use``, ``SELFATTN_BACKEND``).

FlexAttention runs uncompiled here (its eager path: exact, fine for small sizes) except through
``backend="flex"``, which compiles (seconds on CPU), so each flex case does all it needs at once.
"""

from __future__ import annotations

import re
import threading
import warnings

import pytest
import torch

import selfattn as sa
from selfattn import backends, masks
from selfattn.backends import flex as flex_backend
from selfattn.call import prepare
from selfattn.testing import (
    assert_close_to_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)

fa = pytest.importorskip("torch.nn.attention.flex_attention")

DENSE = ["reference", "chunked", "sdpa", "flex"]


def _cases(low: torch.dtype, name: str) -> list:
    """(backend, dtype) over every backend in fp32 and in ``low``, except flex in ``low``: each
    flex dtype is one more CPU compile (seconds) for the same code path."""
    return [
        pytest.param(b, dt, id=f"{b}-{dn}")
        for dt, dn in ((torch.float32, "fp32"), (low, name))
        for b in DENSE
        if not (b == "flex" and dt != torch.float32)
    ]


NO_CPU_FLEX = flex_backend._api() is None or flex_backend._cpu_reason() is not None


def _flex_eager(*args, **kwargs):
    """``flex_attention`` uncompiled (its eager path warns that it is slow: it is small here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fa.flex_attention(*args, **kwargs)


def _skip_unless_runs(backend: str, grad: bool):
    if backend == "flex" and NO_CPU_FLEX:
        pytest.skip("no CPU FlexAttention in this torch / on this CPU")
    if backend == "flex" and grad:
        pytest.skip("FlexAttention has no backward on CPU")


def _check(out, q, k, v, *, mask, grad_inputs=None, **kw):
    """``out`` against the float64 oracle run with ``mask`` (a bool tensor), by the ratio rule;
    with ``grad_inputs`` also their gradients."""
    o64, _, leaves64 = reference_attention(q, k, v, mask=mask, **kw)
    naive, _, leavesn = naive_attention(q, k, v, mask=mask, **kw)
    assert_close_to_reference(out, o64, naive)
    if grad_inputs is None:
        return
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad(out, grad_inputs, dout.to(out.dtype))
    want = torch.autograd.grad(o64, leaves64, dout)
    base = torch.autograd.grad(naive, leavesn, dout.to(naive.dtype))
    for name, a, o, n in zip(("dq", "dk", "dv"), got, want, base):
        assert_close_to_reference(a, o, n, factor=3.0, dtype=q.dtype, what=name)


# ================================================================================================
# a BlockMask as mask=
# ================================================================================================

B, H, SQ, SK, D, BLOCK = 2, 4, 37, 101, 16, 16


def _per_head_mod(b, h, q_idx, kv_idx):  # rows; varies over heads and batch
    return (kv_idx <= q_idx + 40) & ((kv_idx + b) % (h + 2) != 1)


def _dense(mod, Bm=B, Hm=H, Sq=SQ, Sk=SK):
    b, h = torch.arange(Bm).view(-1, 1, 1, 1), torch.arange(Hm).view(1, -1, 1, 1)
    qi, ki = torch.arange(Sq).view(1, 1, -1, 1), torch.arange(Sk).view(1, 1, 1, -1)
    return mod(b, h, qi, ki).expand(Bm, Hm, Sq, Sk)


@pytest.mark.parametrize("backend,dtype", _cases(torch.bfloat16, "bf16"))
def test_block_mask_is_a_mask_on_every_backend(backend, dtype):
    grad = backend != "flex"
    _skip_unless_runs(backend, grad)
    bm = fa.create_block_mask(_per_head_mod, B, H, SQ, SK, device="cpu", BLOCK_SIZE=BLOCK)
    q, k, v = make_qkv(B, H, SQ, D, Hkv=2, Sk=SK, dtype=dtype, seed=3, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        out = sa.attention(q, k, v, mask=bm, backend=backend)
    # q_offset moves score mods, never a BlockMask: it is read by query row, as FlexAttention does
    with torch.set_grad_enabled(grad):
        shifted = sa.attention(q, k, v, mask=bm, backend=backend, q_offset=5)
    _check(out, q, k, v, mask=_dense(_per_head_mod), grad_inputs=(q, k, v) if grad else None)
    torch.testing.assert_close(shifted, out, rtol=0, atol=0)
    if dtype == torch.float32:  # FlexAttention itself, on the same BlockMask (GQA by repeat)
        kr, vr = (t.detach().repeat_interleave(2, 1) for t in (k, v))
        want = _flex_eager(q.detach(), kr, vr, block_mask=bm)
        torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-5)


def _full_blocks_disagree(Sq=70, Sk=90, blk=32):
    """A hand-made BlockMask whose mask_mod disagrees with its full blocks, and the dense mask
    of FlexAttention's rule for it (what its compiled kernel does; eager FlexAttention applies
    mask_mod inside full blocks too): a full block attends whole, a partial block where mask_mod
    says so, an absent block never. Full: the diagonal block; partial: the next key block
    (cyclically), where mask_mod is False on odd keys, though even keys alone would make the
    diagonal blocks partial too."""
    n_q = n_k = 3
    num = torch.ones(1, 1, n_q, dtype=torch.int32)
    full_idx = torch.tensor([[0, 1, 2], [1, 2, 0], [2, 0, 1]], dtype=torch.int32)[None, None]
    idx = full_idx.roll(-1, dims=-1)

    def even(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    bm = fa.BlockMask.from_kv_blocks(
        num, idx, torch.ones(1, 1, n_q, dtype=torch.int32), full_idx,
        BLOCK_SIZE=blk, mask_mod=even, seq_lengths=(Sq, Sk),
    )  # fmt: skip
    qi, ki = torch.arange(Sq)[:, None], torch.arange(Sk)[None]
    dense = (qi // blk == ki // blk) | ((ki // blk == (qi // blk + 1) % n_k) & (ki % 2 == 0))
    return bm, dense


def test_block_mask_full_blocks_skip_mask_mod():
    """FlexAttention's rule (:func:`_full_blocks_disagree`): every backend follows it, flex late
    in a long process too (each case has its own compile cache: test_flex_keeps_compiling)."""
    Sq, Sk = 70, 90
    bm, dense = _full_blocks_disagree(Sq, Sk)
    q, k, v = make_qkv(1, 2, Sq, D, Sk=Sk, seed=9)
    runs = [b for b in DENSE if not (b == "flex" and NO_CPU_FLEX)]
    with torch.no_grad():
        for backend in runs:
            out = sa.attention(q, k, v, mask=bm, backend=backend)
            try:
                _check(out, q, k, v, mask=dense)
            except AssertionError as e:
                raise AssertionError(f"backend {backend}: {e}") from None
    assert sa.masks.as_mask(bm).to_dense(Sq, Sk, q_offset=0)[0, 0].equal(dense)


@pytest.mark.skipif(NO_CPU_FLEX, reason="no CPU FlexAttention in this torch / on this CPU")
def test_flex_keeps_compiling(monkeypatch, caplog):
    """Dynamo counts its recompile limit per code object, and past it runs FlexAttention
    uncompiled, silently (seen late in a long test process). With the limit at 1: other cases
    compiled before do not count against this one (each kernel signature has a function of its
    own), and a case recompiled past the limit (a new shape) is compiled afresh, logged once;
    eager would break FlexAttention's full-block rule (:func:`_full_blocks_disagree`)."""
    monkeypatch.setattr(flex_backend, "_RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(flex_backend, "_GENERATIONS", {}, raising=False)
    monkeypatch.setattr(flex_backend, "_STATIC_ONLY", set())
    q, k, v = make_qkv(1, 2, 33, D, seed=31)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        sa.attention(q, k, v, mask=masks.sliding_window(5), backend="flex")  # another case first
        for Sq, Sk in ((70, 90), (66, 96)):  # the second shape passes the limit of 1
            bm, dense = _full_blocks_disagree(Sq, Sk)
            q, k, v = make_qkv(1, 2, Sq, D, Sk=Sk, seed=Sq)
            with caplog.at_level("WARNING", logger="selfattn"):
                out = sa.attention(q, k, v, mask=bm, backend="flex")
            _check(out, q, k, v, mask=dense)
    assert "recompile limit" in caplog.text


def test_block_mask_tile_kinds_are_sound_on_other_grids():
    """Tiles of another size than the BlockMask's blocks (chunked's tiles) get kinds that agree
    with the dense mask: EMPTY only where nothing attends, FULL only where everything does."""
    bm = fa.create_block_mask(_per_head_mod, B, H, SQ, SK, device="cpu", BLOCK_SIZE=BLOCK)
    mask = sa.masks.as_mask(bm)
    dense = _dense(_per_head_mod)
    for bq, bk in [(7, 11), (16, 16), (40, 24), (64, 128)]:
        grid = masks.TileGrid(SQ, SK, bq, bk, q_offset=0)
        kinds = mask.tile_kinds(grid, B, H).expand(B, H, grid.n_q, grid.n_k)
        for t in range(grid.n_q):
            for u in range(grid.n_k):
                tile = dense[:, :, t * bq : (t + 1) * bq, u * bk : (u + 1) * bk]
                anyv, allv = tile.flatten(2).any(-1), tile.flatten(2).all(-1)
                kind = kinds[:, :, t, u]
                assert not ((kind == int(masks.EMPTY)) & anyv).any(), (bq, bk, t, u)
                assert not ((kind == int(masks.FULL)) & ~allv).any(), (bq, bk, t, u)
        if (bq, bk) == (BLOCK, BLOCK):  # the BlockMask's own grid: exactly its block kinds
            assert (kinds != int(masks.PARTIAL)).any()


def test_block_mask_of_another_geometry_is_refused():
    bm = fa.create_block_mask(_per_head_mod, B, H, SQ, SK, device="cpu", BLOCK_SIZE=BLOCK)
    q, k, v = make_qkv(B, H, SQ + 1, D, Sk=SK, seed=1)
    with pytest.raises(ValueError, match=re.escape("(2, 4, 37, 101)") + ".*(2, 4, 38, 101)"):
        sa.attention(q, k, v, mask=bm)
    q, k, v = make_qkv(3, H, SQ, D, Sk=SK, seed=1)
    with pytest.raises(ValueError, match="create_block_mask"):
        sa.attention(q, k, v, mask=bm)


# ================================================================================================
# Mask.to_block_mask for flex_attention called directly
# ================================================================================================

ALIGN = {
    "causal": masks.causal(),
    "window": masks.causal() & masks.sliding_window(17),
    "documents&causal": masks.causal() & masks.documents(torch.arange(120) // 23),
}


@pytest.mark.parametrize("name", list(ALIGN))
@pytest.mark.parametrize("Sq,Sk", [(45, 120), (120, 120), (1, 97)])
def test_to_block_mask_gives_flex_attention_selfattn_result(name, Sq, Sk):
    """flex_attention(block_mask=mask.to_block_mask(...)) == sa.attention(mask=mask): the same
    bottom-right alignment by default."""
    mask = ALIGN[name]
    q, k, v = make_qkv(2, 3, Sq, D, Sk=Sk, seed=Sq + Sk)
    bm = mask.to_block_mask(2, 3, Sq, Sk, block_size=32)
    out = _flex_eager(q, k, v, block_mask=bm)
    dense = mask.to_dense(Sq, Sk, B=2, H=3)
    _check(out, q, k, v, mask=dense)
    assert bm.BLOCK_SIZE == (32, 32) and bm.seq_lengths == (Sq, Sk)


def test_to_block_mask_q_offset_zero_is_flex_attentions_top_left():
    """FlexAttention's causal mask_mod is top-left aligned when Sq != Sk; q_offset=0 is the one
    keyword that gives selfattn (and its BlockMask) that alignment."""
    Sq, Sk = 30, 77
    q, k, v = make_qkv(1, 2, Sq, D, Sk=Sk, seed=4)

    def flex_causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    theirs = _flex_eager(
        q, k, v, block_mask=fa.create_block_mask(flex_causal, 1, 1, Sq, Sk, device="cpu")
    )
    ours_bm = _flex_eager(
        q, k, v, block_mask=masks.causal().to_block_mask(1, 1, Sq, Sk, q_offset=0)
    )
    ours = sa.attention(q, k, v, mask=masks.causal(), q_offset=0)
    torch.testing.assert_close(ours_bm, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    bottom_right = sa.attention(q, k, v, mask=masks.causal())
    assert (bottom_right - theirs).abs().max() > 0.1  # the defaults really differ


def test_to_block_mask_checks_its_arguments():
    with pytest.raises(ValueError, match="block_size"):
        masks.causal().to_block_mask(1, 1, 8, 8, block_size=(16, 0))
    with pytest.raises(ValueError, match="padding lengths"):
        masks.padding([5, 9]).to_block_mask(2, 1, 8, 8)  # 9 > Sk
    bm = fa.create_block_mask(_per_head_mod, B, H, SQ, SK, device="cpu", BLOCK_SIZE=BLOCK)
    assert sa.masks.as_mask(bm).to_block_mask(B, H, SQ, SK) is bm  # a BlockMask is itself
    with pytest.raises(ValueError, match="not re-blocked"):
        sa.masks.as_mask(bm).to_block_mask(B, H, SQ, SK, block_size=64)


# ================================================================================================
# K/V of batch 1 against a larger query batch
# ================================================================================================


@pytest.mark.parametrize("backend,dtype", _cases(torch.float16, "fp16"))
def test_kv_batch_one_broadcasts_over_the_query_batch(backend, dtype):
    grad = backend != "flex"
    _skip_unless_runs(backend, grad)
    Bq, Hq, Hkv, Sq, Sk = 3, 4, 2, 19, 45
    q, _, _ = make_qkv(Bq, Hq, Sq, D, Sk=Sk, dtype=dtype, seed=21)
    _, k, v = make_qkv(1, Hq, Sq, D, Hkv=Hkv, Sk=Sk, Dv=24, dtype=dtype, seed=22)
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    mask = masks.causal() & masks.padding([45, 30, 12])  # per-batch: batches really differ
    with torch.set_grad_enabled(grad):
        out = sa.attention(q, k, v, mask=mask, backend=backend)
    assert out.shape == (Bq, Hq, Sq, 24)
    # the oracle on K/V really repeated over the batch; their gradients summed back
    kf, vf = (t.detach().expand(Bq, -1, -1, -1).contiguous().requires_grad_(grad) for t in (k, v))
    o64, _, (q64, k64, v64) = reference_attention(q, kf, vf, mask=mask)
    naive, _, (qn, kn, vn) = naive_attention(q, kf, vf, mask=mask)
    assert_close_to_reference(out, o64, naive)
    if not grad:
        return
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    want = torch.autograd.grad(o64, (q64, k64, v64), dout)
    base = torch.autograd.grad(naive, (qn, kn, vn), dout.to(dtype))
    assert got[1].shape == k.shape and got[2].shape == v.shape
    for name, a, o, n in zip(("dq", "dk", "dv"), got, want, base):
        if name != "dq":  # K/V of batch 1: the batch's gradients add up
            o, n = o.sum(0, keepdim=True), n.float().sum(0, keepdim=True)
        assert_close_to_reference(a, o, n, factor=3.0, dtype=dtype, what=name)


def test_kv_batch_one_is_a_view_not_a_copy():
    q, _, _ = make_qkv(5, 2, 7, D, seed=1)
    _, k, v = make_qkv(1, 2, 7, D, seed=2)
    _, kk, vv, _ = prepare(q, k, v)
    assert kk.shape[0] == vv.shape[0] == 5
    assert kk.stride(0) == vv.stride(0) == 0
    assert kk.data_ptr() == k.data_ptr() and vv.data_ptr() == v.data_ptr()
    with pytest.raises(ValueError, match="k has 1, v has 5"):  # only both broadcast
        sa.attention(q, k, v.expand(5, -1, -1, -1))


# ================================================================================================
# the global override
# ================================================================================================


@pytest.fixture
def qkv_call():
    q, k, v = make_qkv(1, 2, 33, D, seed=8)
    return prepare(q, k, v, mask=masks.causal())


def _picked(qkv_call) -> str:
    return backends.select(*qkv_call)[0].name


def test_use_forces_nests_and_restores(qkv_call, monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    auto = _picked(qkv_call)
    assert auto != "chunked"
    with backends.use("chunked"):
        assert _picked(qkv_call) == "chunked"
        with backends.use("reference"):
            assert _picked(qkv_call) == "reference"
            with backends.use("auto"):
                assert _picked(qkv_call) == auto
            assert _picked(qkv_call) == "reference"
        assert _picked(qkv_call) == "chunked"
        assert backends.select(*qkv_call, backend="sdpa")[0].name == "sdpa"  # explicit wins
        with pytest.raises(RuntimeError, match="boom"), backends.use("reference"):
            raise RuntimeError("boom")
        assert _picked(qkv_call) == "chunked"  # restored on the way out of an exception
    assert _picked(qkv_call) == auto


def test_use_names_a_registered_backend():
    names = sorted(backends.names("dense"))
    assert {"chunked", "flex", "reference", "sdpa"} <= set(names)
    listed = "'nope'.*" + re.escape(str(names))
    with pytest.raises(ValueError, match=listed), backends.use("nope"):
        pass
    with pytest.raises(TypeError, match="backend name"), backends.use(None):
        pass


def test_use_is_per_thread(qkv_call, monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    seen = []
    with backends.use("reference"):
        worker = threading.Thread(target=lambda: seen.append(_picked(qkv_call)))
        worker.start()
        worker.join()
        assert _picked(qkv_call) == "reference"
    assert seen == [_picked(qkv_call)] and seen != ["reference"]


def test_override_really_runs_the_forced_backend(monkeypatch):
    """The forced backend is the one that runs: flex cannot run a CPU call needing gradients,
    so forcing it raises, naming where the override came from."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    q, k, v = make_qkv(1, 2, 9, D, seed=3, requires_grad=True)
    sa.attention(q, k, v)  # auto runs it
    with backends.use("flex"), pytest.raises(ValueError, match=r"use\('flex'\)"):
        sa.attention(q, k, v)
    monkeypatch.setenv(backends.ENV_VAR, "flex")
    with pytest.raises(ValueError, match="SELFATTN_BACKEND=flex"):
        sa.attention(q, k, v)
    sa.attention(q, k, v, backend="chunked")  # explicit wins over the variable


def test_environment_variable(qkv_call, monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "chunked")
    assert _picked(qkv_call) == "chunked"
    with backends.use("reference"):  # the context manager wins over the variable
        assert _picked(qkv_call) == "reference"
    with backends.use("auto"):
        assert _picked(qkv_call) != "chunked"
    for off in ("", "auto", " auto "):
        monkeypatch.setenv(backends.ENV_VAR, off)
        assert backends.override() is None
    monkeypatch.setenv(backends.ENV_VAR, "sdpaa")
    q, k, v = make_qkv(1, 2, 5, D, seed=1)
    with pytest.raises(ValueError, match=r"SELFATTN_BACKEND='sdpaa'.*'chunked'"):
        sa.attention(q, k, v)


def test_explain_reports_the_override(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    q, k, v = make_qkv(1, 2, 33, D, seed=8)
    with backends.use("chunked"):
        e = backends.explain(q, k, v, mask=masks.causal(), print_table=False)
    assert e.chosen == "chunked" and "sa.backends.use('chunked')" in str(e)
    assert set(e.reasons) == set(backends.names())  # every verdict is still there
    with backends.use("flex"):
        e = backends.explain(q.requires_grad_(), k, v, print_table=False)
    assert e.chosen == "flex" and "cannot run this call" in e.why
    monkeypatch.setenv(backends.ENV_VAR, "reference")
    assert "SELFATTN_BACKEND=reference" in str(backends.explain(q, k, v, print_table=False))
