"""Process groups for tests/test_distributed.py: start W local gloo ranks, run cases, collect.

Starting a process is the cost (importing torch takes seconds on a busy machine), so ranks are
forked from one forkserver that has imported torch and selfattn once (``set_forkserver_preload``:
it has run no torch op, so its children start clean), and each group runs a whole list of cases.
A case returns normally or raises; the worker records the message instead of dying, so one
failure does not hide the others. A case must finish all its collectives before it asserts, or
its peers wait on a collective it never reaches (the group timeout then ends the run, and the
parent kills a group that outlives its deadline: no run hangs).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Each collective waits at most this long for its peers (then raises on the waiting rank).
PG_TIMEOUT_S = 90
# The parent kills a group still running after this long (a rank stuck outside a collective, or a
# chain of timed-out collectives): every case of the group then reports the kill.
DEADLINE_S = 300
# What the forkserver imports once for all ranks. Modules only importable from the installed
# environment: the forkserver does not see the test's sys.path (so not this module). The last
# three are imported lazily on first use (the backends; torch.broadcast_shapes' symbolic shapes).
_PRELOAD = [
    "torch",
    "selfattn.distributed",
    "selfattn.testing",
    "selfattn.backends.chunked",
    "selfattn.backends.flex",
    "selfattn.backends.sdpa",
    "torch.fx.experimental.symbolic_shapes",
]
_preloaded = False


def _worker(rank: int, W: int, store: str, out_dir: str, cases, pg_timeout_s: float):
    torch.set_num_threads(1)  # W ranks share the machine's cores
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=W, timeout=timeout
    )
    results: dict[str, object] = {}
    try:
        for name, fn, kwargs in cases:
            t0 = time.perf_counter()
            try:
                status, value = "ok", fn(rank=rank, W=W, **kwargs)
            except Exception as e:  # recorded, reported by the parent
                tb = traceback.format_exc(limit=6)
                status, value = "error", f"rank {rank}: {type(e).__name__}: {e}\n{tb}"
            results[name] = (status, value, time.perf_counter() - t0)
            dist.barrier()
    finally:
        torch.save(results, _result_files(out_dir, W)[rank])
        dist.barrier()
        dist.destroy_process_group()


def run_group(
    W: int,
    cases: list[tuple[str, Callable, dict]],
    tmp_dir,
    pg_timeout_s: float = PG_TIMEOUT_S,
    deadline_s: float = DEADLINE_S,
) -> dict[str, list]:
    """Run ``cases`` (``(name, fn, kwargs)``; ``fn(rank=, W=, **kwargs)``) on ``W`` gloo ranks.

    Returns ``{name: [(status, value, seconds) per rank]}``; status is ``"ok"`` (value: what
    ``fn`` returned) or ``"error"`` (value: the message). A group still running after
    ``deadline_s`` is killed; the cases a rank did not finish (killed, or died) report that.
    """
    global _preloaded
    if not _preloaded:
        mp.set_forkserver_preload(_PRELOAD)
        _preloaded = True
    tmp_dir = str(tmp_dir)
    store = os.path.join(tmp_dir, "store")
    ctx = mp.start_processes(
        _worker,
        args=(W, store, tmp_dir, cases, pg_timeout_s),
        nprocs=W,
        join=False,
        start_method="forkserver",
    )
    end, failure = time.monotonic() + deadline_s, None
    try:
        while not ctx.join(timeout=max(0.0, end - time.monotonic())):
            if time.monotonic() >= end:
                for p in ctx.processes:  # the ranks this call started
                    p.kill()
                for p in ctx.processes:
                    p.join()
                failure = f"the group of {W} ranks was still running after {deadline_s} s: killed"
                break
    except mp.ProcessExitedException as e:  # a rank died (join has ended its peers)
        failure = f"a rank died: {e}"
    except mp.ProcessRaisedException as e:  # e.g. a barrier after a collective timed out
        failure = f"a rank died: {str(e).strip().splitlines()[-1]}"
    # a rank saves its results as it ends, also after an error: keep those, mark the rest
    per_rank = [torch.load(p) if os.path.exists(p) else {} for p in _result_files(tmp_dir, W)]
    missing = ("error", failure or "no result", 0.0)
    return {name: [res.get(name, missing) for res in per_rank] for name, _, _ in cases}


def _result_files(out_dir: str, W: int) -> list[str]:
    return [os.path.join(out_dir, f"rank{r}.pt") for r in range(W)]


# ----------------------------------------------------------------------------------------------
# Cases: each builds the full problem on every rank (same seed), runs its shard through the ring
# and checks the shard of the single-process float64 oracle by the ratio rule.
# ----------------------------------------------------------------------------------------------

import selfattn as sa  # noqa: E402
from selfattn import masks, scores  # noqa: E402
from selfattn.distributed import (  # noqa: E402
    position_ids,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from selfattn.testing import (  # noqa: E402
    GRAD_FACTOR,
    assert_close_to_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)

S_DEFAULT = 48  # divisible by 2W for W = 1, 2, 3, 4


def _doc_ids(S: int) -> torch.Tensor:
    """Documents of 13, 20, ... positions: boundaries fall inside rank shards, not on them."""
    lengths, out, i = [13, 20, 6, 17, 11], [], 0
    while len(out) < S:
        out += [i] * lengths[i % len(lengths)]
        i += 1
    return torch.tensor(out[:S])


def make_mask(kind: str, S: int, B: int):
    """Masks by name, built for the whole sequence (global positions)."""
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.sliding_window(5)
    if kind == "documents":
        return masks.documents(_doc_ids(S)) & masks.causal()
    if kind == "padding":
        return masks.padding(torch.tensor([S - 17, S - 6])[:B])
    if kind == "padding-empty":  # sequence 0 has no valid key: every row empty (out 0, lse -inf)
        return masks.padding(torch.tensor([0, S - 6])[:B])
    if kind == "callable":
        return lambda b, h, q, kv: (kv <= q) & ((q - kv) % 3 != 1)
    if kind == "tensor":
        g = torch.Generator().manual_seed(3)
        t = (torch.rand(S, S, generator=g) < 0.6) | torch.eye(S, dtype=torch.bool)
        return masks.from_tensor(t)
    raise ValueError(kind)


def make_mod(kind: str, Hq: int, S: int = S_DEFAULT):
    if kind == "bias":  # a global (1, Hq, S, S) bias table: rows and columns are positions
        g = torch.Generator().manual_seed(4)
        return scores.bias(torch.randn(1, Hq, S, S, generator=g))
    return {
        "none": None,
        "alibi": scores.alibi(Hq),
        "softcap": scores.softcap(4.0),
        "alibi+softcap": scores.alibi(Hq) >> scores.softcap(4.0),
    }[kind]


def compare(
    rank, W, *, layout="zigzag", mask="causal", mod="none", dtype="float32", method="ring",
    B=2, Hq=4, Hkv=2, S=S_DEFAULT, D=16, Dv=8, seed=0, lse_grad=False, group_ranks=None,
    sinks=False,
):  # fmt: skip
    """Ring vs the single-process oracle: out, lse, dq, dk, dv by the ratio rule.

    ``sinks``: with learned attention sinks, whose gradient (each rank's share, summed over the
    group as a data-parallel optimizer would) is checked too.

    ``group_ranks``: run on a new process group of these (global) ranks only; the others skip.
    Returns the max abs errors of ``out`` and of the gradients (for the error-growth check).
    """
    group = None
    if group_ranks is not None:
        group = dist.new_group(group_ranks)  # every rank takes part in creating it
        if rank not in group_ranks:
            return None
    dt = getattr(torch, dtype)
    q, k, v = make_qkv(B, Hq, S, D, Hkv=Hkv, Dv=Dv, dtype=dt, seed=seed)
    m, s = make_mask(mask, S, B), make_mod(mod, Hq, S)
    kw = {"mask": m, "score_mod": s, "q_offset": 0}
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(B, Hq, S, Dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, S, generator=g, dtype=torch.float64) if lse_grad else None
    sk = (2 * torch.randn(Hq, generator=g, dtype=torch.float64)).float() if sinks else None
    leaf = None if sk is None else sk.clone().requires_grad_(True)

    def shard(t):
        return shard_sequence(t, layout, group, dim=2)

    ql, kl, vl = (shard(t).detach().requires_grad_(True) for t in (q, k, v))
    out, lse = ring_attention(
        ql, kl, vl, group=group, mask=m, score_mod=s, layout=layout, method=method,
        return_lse=True, sinks=leaf,
    )  # fmt: skip
    loss = (out.double() * shard(dout)).sum()
    if dlse is not None:
        loss = loss + (lse.double() * shard(dlse)).sum()
    loss.backward()
    grads = [t.grad for t in (ql, kl, vl)]

    # the oracle (float64) and the naive baseline (same formula in the test dtype), full length
    s64 = sn = None
    if sk is not None:
        s64, sn = sk.double().requires_grad_(True), sk.to(dt).requires_grad_(True)
    o64, l64, leaves64 = reference_attention(
        *(t.requires_grad_(True) for t in (q, k, v)), **kw, sinks=s64
    )
    on, ln, leavesn = naive_attention(q, k, v, **kw, sinks=sn)
    for o, lse_ in ((o64, l64), (on, ln)):
        total = (o.double() * dout).sum()
        if dlse is not None:
            total = total + (lse_.double() * dlse).sum()
        total.backward()

    assert_close_to_reference(out, shard(o64), shard(on), dtype=dt, what="out")
    assert_close_to_reference(lse, shard(l64), shard(ln), dtype=torch.float32, what="lse")
    errors = {"out": (out.double() - shard(o64)).abs().max().item()}
    for name, a, o, n in zip(("dq", "dk", "dv"), grads, leaves64, leavesn):
        assert_close_to_reference(
            a, shard(o.grad), shard(n.grad), factor=GRAD_FACTOR, dtype=dt, what=name
        )
        errors[name] = (a.double() - shard(o.grad)).abs().max().item()
    if leaf is not None:
        dsinks = leaf.grad.clone()
        dist.all_reduce(dsinks, group=group)  # every rank's rows add to the shared logits
        assert_close_to_reference(
            dsinks, s64.grad, sn.grad, factor=GRAD_FACTOR, dtype=dt, what="dsinks"
        )
    return errors


def exact_single_rank(rank, W, *, dtype="float32"):
    """A group of size 1 is selfattn.attention, bit for bit (out, lse, gradients)."""
    assert W == 1
    dt = getattr(torch, dtype)
    q, k, v = make_qkv(2, 4, 23, 16, Hkv=2, Dv=8, dtype=dt, seed=5, requires_grad=True)
    mask, mod = masks.documents(_doc_ids(23)) & masks.causal(), scores.alibi(4)
    out, lse = ring_attention(q, k, v, mask=mask, score_mod=mod, return_lse=True)
    g1 = torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
    ref, ref_lse = sa.attention(q, k, v, mask=mask, score_mod=mod, return_lse=True)
    g2 = torch.autograd.grad(ref.float().sum() + ref_lse.sum(), (q, k, v))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def skips_masked_blocks(rank, W, *, layout="contiguous"):
    """Causal contiguous: rank r computes pairs with owners <= r only; the attention calls made
    are exactly the non-empty (query run, key run) pairs."""
    import selfattn.distributed.blocks as blocks
    from selfattn.distributed.shard import segments

    calls = []
    real = blocks.attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, **kw)

    blocks.attention = spy  # this worker process is thrown away after the group
    try:
        q, k, v = make_qkv(1, 2, S_DEFAULT, 8, seed=rank)
        with torch.no_grad():
            ring_attention(q, k, v, mask=masks.causal(), layout=layout)
    finally:
        blocks.attention = real
    S = S_DEFAULT
    mine = segments(S, layout, rank, W)
    expect = sum(
        len(blocks.pairs(mine, segments(S, layout, o, W), masks.causal(), 1, 2, "cpu"))
        for o in range(W)
    )
    assert len(calls) == expect, f"{len(calls)} attention calls, {expect} non-empty pairs"
    if layout == "contiguous":
        assert expect == rank + 1, f"rank {rank} computed {expect} blocks, causal needs {rank + 1}"
    return expect


def shard_roundtrip(rank, W, *, layout="zigzag"):
    x = torch.arange(2 * 24 * 3, dtype=torch.float32).view(2, 24, 3)
    local = shard_sequence(x, layout)
    assert local.shape == (2, 24 // W, 3)
    assert torch.equal(unshard_sequence(local, layout), x)
    pos = position_ids(24, layout)
    assert torch.equal(local[0, :, 0], x[0, pos, 0])


def _expect_error(fn, exc, *needles):
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        assert not missing, f"message lacks {missing}: {msg}"
        return
    raise AssertionError(f"no {exc.__name__} raised")


def bad_input(rank, W):
    """Clear errors, raised the same way on every rank (so none of them hangs)."""
    q, k, v = make_qkv(1, 4, 6, 8, Hkv=2, seed=rank)
    # zigzag on W ranks needs 2W chunks: S = 6W is fine, a local length of 5 is not
    q5, k5, v5 = make_qkv(1, 4, 5, 8, Hkv=2, seed=rank)
    _expect_error(lambda: ring_attention(q5, k5, v5), ValueError, f"S={5 * W}", "divisible")
    # the same call with different shapes on different ranks
    Hq = 4 if rank == 0 else 2
    qm, km, vm = make_qkv(1, Hq, 6, 8, Hkv=2, seed=rank)
    _expect_error(lambda: ring_attention(qm, km, vm), ValueError, "rank 1", "same arguments")
    # a mask built from the local shard instead of the whole sequence
    local_ids = masks.documents(torch.zeros(6, dtype=torch.long))
    _expect_error(
        lambda: ring_attention(q, k, v, mask=local_ids), ValueError, "global positions", "0..5"
    )
    _expect_error(lambda: ring_attention(q, k[:, :, :3], v[:, :, :3]), ValueError, "Sk=3")
    slopes = torch.ones(4, requires_grad=True)
    mod = scores.bias(slopes.view(1, 4, 1, 1))
    _expect_error(
        lambda: ring_attention(q, k, v, score_mod=mod), ValueError, "allgather", "require grad"
    )
    _expect_error(lambda: unshard_sequence(torch.zeros(1, 2 + rank)), ValueError, "every rank")


def exec_block(rank, W, *, source: str, name: str = "a docs example"):
    """Run a documentation example on this rank (tests/test_docs.py), in a fresh namespace."""
    exec(compile(source, f"{name} (on every rank)", "exec"), {})


# -- one rank's bad argument: every rank raises DistributedArgumentError, none hangs ------------
# Each case gives the last rank (the one the error must name) a bad argument and the others good
# ones, expects DistributedArgumentError on every rank naming that rank and its message, then makes
# a good call: the group's collectives still pair up after the error.


def _all_raise(rank, W, call, *needles, failed: bool = True):
    """``call()`` raises DistributedArgumentError on every rank, naming rank ``W - 1`` and
    ``needles``; ``failed``: as a failed check (``e.failures == {W - 1: ...}``), else as a
    disagreement between ranks (``e.failures == {}``)."""
    from selfattn.distributed import DistributedArgumentError

    bad = W - 1
    try:
        call()
    except DistributedArgumentError as e:
        msg = str(e)
        missing = [n for n in (f"rank {bad}: ", *needles) if n not in msg]
        assert not missing, f"rank {rank}: message lacks {missing}: {msg}"
        assert sorted(e.failures) == ([bad] if failed else []), e.failures
        if rank == bad and failed:  # the failing rank's own exception is the cause
            assert e.__cause__ is not None and str(e.__cause__) in e.failures[bad], e.__cause__
    else:
        raise AssertionError(f"rank {rank}: no DistributedArgumentError")
    _good_call(rank, W)


def _good_call(rank, W):
    q, k, v = make_qkv(1, 2, 4, 8, seed=rank)
    ring_attention(q, k, v, mask=masks.causal())


def bad_arg(rank, W, *, what, method="ring"):
    bad = rank == W - 1
    S = 6 * W
    q, k, v = make_qkv(1, 4, 6, 8, Hkv=2, seed=rank)

    def ring(*args, **kw):
        return lambda: ring_attention(*args, method=method, **kw)

    if what == "local-documents":  # documents() of the local ids on one rank
        ids = torch.arange(6) // 4 if bad else torch.arange(S) // 4
        m = masks.documents(ids)
        _all_raise(rank, W, ring(q, k, v, mask=m), "global positions 0..", "0..5", "ValueError")
    elif what == "3d":
        q3 = q[0] if bad else q
        _all_raise(rank, W, ring(q3, k, v), "q (B, Hq, Sq, D) must be 4-D, got shape (4, 6, 8)")
    elif what == "dtype":
        qd, kd, vd = (t.to(torch.bfloat16) if bad else t for t in (q, k, v))
        _all_raise(rank, W, ring(qd, kd, vd), "bfloat16", "float32", failed=False)
    elif what == "length":  # the same call with another local length: a global S per rank
        ql, kl, vl = make_qkv(1, 4, 8 if bad else 6, 8, Hkv=2, seed=rank)
        _all_raise(rank, W, ring(ql, kl, vl), "q (1, 4, 8, 8)", "q (1, 4, 6, 8)", failed=False)
    elif what == "grad":  # a differentiated call on some ranks only: the backward would hang
        qg, kg, vg = (t.requires_grad_(not bad) for t in (q, k, v))
        _all_raise(rank, W, ring(qg, kg, vg), "without gradients", "with gradients", failed=False)
    elif what == "grad-mod":  # a score_mod the ring cannot differentiate, on one rank
        slopes = torch.ones(4, requires_grad=bad)
        mod = scores.bias(slopes.view(1, 4, 1, 1))
        _all_raise(rank, W, ring(q, k, v, score_mod=mod), "require grad")
    elif what == "method":
        m = "allgather" if bad else "ring"
        call = lambda: ring_attention(q, k, v, method=m)  # noqa: E731
        _all_raise(rank, W, call, "method='allgather'", "method='ring'", failed=False)
    elif what == "unshard-4d":  # the sequence dim of a 4-D shard is not guessed
        x = torch.zeros(1, 2, 3, 4) if bad else torch.zeros(1, 3, 4)
        _all_raise(rank, W, lambda: unshard_sequence(x), "dim=2 for heads-first")
    elif what == "unshard-dtype":
        x = torch.zeros(2, 3, dtype=torch.int32 if bad else torch.int64)
        _all_raise(rank, W, lambda: unshard_sequence(x), "int32", "int64", failed=False)
    else:
        raise ValueError(what)


def bad_block_arg(rank, W, *, what):
    """ContextParallelAttention: one rank's bad input (caught before the ring's first transfer,
    the projections included)."""
    from selfattn.distributed import ContextParallelAttention
    from selfattn.nn import MultiHeadAttention
    from selfattn.positions import RoPE

    torch.manual_seed(0)
    bad = rank == W - 1
    cp = ContextParallelAttention(MultiHeadAttention(16, 4, 2, dropout=0.1)).eval()
    cp_rope = ContextParallelAttention(MultiHeadAttention(16, 4, 2, rope=RoPE(4)))
    x = torch.randn(2, 6, 16)
    if what == "d-model":
        xb = torch.randn(2, 6, 12) if bad else x
        _all_raise(rank, W, lambda: cp(xb), "x (B, S/W, d_model=16), got shape (2, 6, 12)")
    elif what == "rope-length":  # RoPE positions need S = W x 5 divisible by 2W: caught too
        xb = torch.randn(2, 5, 16) if bad else x
        _all_raise(rank, W, lambda: cp_rope(xb), "S=", "is not divisible")
    elif what == "dropout":  # training mode (dropout) on one rank only
        cp.train(bad)
        _all_raise(rank, W, lambda: cp(x), "has no dropout")
    elif what == "cache":
        kw = {"cache": object()} if bad else {}
        _all_raise(rank, W, lambda: cp(x, **kw), "it does not take ['cache']")
    else:
        raise ValueError(what)


BAD_ARGS = {
    **{
        f"bad-{what}": (bad_arg, {"what": what})
        for what in ("local-documents", "3d", "dtype", "length", "grad", "grad-mod", "method")
    },
    "bad-allgather-local-documents": (bad_arg, {"what": "local-documents", "method": "allgather"}),
    "bad-allgather-3d": (bad_arg, {"what": "3d", "method": "allgather"}),
    "bad-allgather-grad": (bad_arg, {"what": "grad", "method": "allgather"}),
    "bad-unshard-4d": (bad_arg, {"what": "unshard-4d"}),
    "bad-unshard-dtype": (bad_arg, {"what": "unshard-dtype"}),
    **{
        f"bad-block-{w}": (bad_block_arg, {"what": w})
        for w in ("d-model", "rope-length", "dropout", "cache")
    },
}
BAD_ARGS_WORLDS = (2, 3)
# A bad-argument group waits this long in a collective at most: on code that hangs, each case
# then fails in seconds, not at gloo's 30-minute default (the fixed code never waits).
BAD_ARGS_PG_TIMEOUT_S = 10
BAD_ARGS_DEADLINE_S = 120


def model_end_to_end(rank, W, *, layout="zigzag"):
    """A stack of selfattn.nn decoder blocks with RoPE (and GQA), run on W ranks through
    context_parallel, gives the single-rank output; parameter gradients summed over ranks give
    the single-rank ones."""
    import copy

    from torch import nn as tnn

    from selfattn.distributed import context_parallel
    from selfattn.nn import MLP, DecoderBlock, MultiHeadAttention, RMSNorm
    from selfattn.positions import RoPE

    torch.manual_seed(0)
    d, H, Hkv = 32, 4, 2
    blocks_ = [
        DecoderBlock(
            MultiHeadAttention(d, H, Hkv, rope=RoPE(d // H), bias=False),
            MLP(d, 2 * d),
            RMSNorm(d),
            RMSNorm(d),
        )
        for _ in range(2)
    ]
    model = tnn.ModuleList(blocks_)
    S = 12 * W
    x = torch.randn(2, S, d)
    ids = masks.documents(torch.arange(S) // 7)

    def run(m, h):
        for blk in m:
            h = blk(h, mask=ids)
        return h

    ref = run(model, x)
    ref.pow(2).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]

    cp = context_parallel(copy.deepcopy(model), layout=layout)
    cp.zero_grad()
    y_local = run(cp, shard_sequence(x, layout))
    y_local.pow(2).sum().backward()
    grads = [p.grad.clone() for p in cp.parameters()]
    for g in grads:
        dist.all_reduce(g)
    y = unshard_sequence(y_local.detach(), layout)
    _assert_close(y, ref.detach(), 1e-5, "output")
    for (name, _), a, b in zip(cp.named_parameters(), grads, ref_grads):
        _assert_close(a, b, 1e-4, f"grad of {name}")


def _assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str) -> None:
    """``|a - b| <= rtol · max|b|`` (torch.testing.assert_close would import torch.distributed
    .tensor on first use once a process group exists: seconds per rank)."""
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= rtol * max(scale, 1.0), f"{what}: max error {err:.3e}, max |ref| {scale:.3e}"


# Which cases run at which world size (names are the test ids).
_CORE = {
    "causal-gqa-zigzag": (compare, {"lse_grad": True}),
    "causal-contiguous": (compare, {"layout": "contiguous"}),
    "causal-bf16": (compare, {"dtype": "bfloat16"}),
    "full-alibi": (compare, {"mask": "none", "mod": "alibi"}),
    "window-softcap-contiguous": (
        compare,
        {"mask": "window", "mod": "softcap", "layout": "contiguous"},
    ),
    "documents-zigzag": (compare, {"mask": "documents", "Dv": 24}),
    "padding-alibi": (compare, {"mask": "padding", "mod": "alibi+softcap", "Hkv": 1}),
    "allgather-documents": (compare, {"mask": "documents", "method": "allgather"}),
    "allgather-contiguous-alibi": (
        compare,
        {"mod": "alibi", "method": "allgather", "layout": "contiguous"},
    ),
}
_EXTRA = {
    "padding-empty-rows": (compare, {"mask": "padding-empty"}),
    "sinks-causal-gqa": (compare, {"sinks": True, "Hkv": 1, "lse_grad": True}),
    "sinks-allgather-padding-empty": (
        compare,
        {"sinks": True, "method": "allgather", "mask": "padding-empty", "dtype": "bfloat16"},
    ),
    "callable-mask": (compare, {"mask": "callable"}),
    "tensor-bias-documents": (compare, {"mask": "documents", "mod": "bias"}),
    "tensor-mask-bf16": (compare, {"mask": "tensor", "dtype": "bfloat16", "layout": "contiguous"}),
    "skips-contiguous": (skips_masked_blocks, {"layout": "contiguous"}),
    "skips-zigzag": (skips_masked_blocks, {"layout": "zigzag"}),
    "shard-roundtrip": (shard_roundtrip, {}),
    "bad-input": (bad_input, {}),
    "model": (model_end_to_end, {}),
}
# Same problem at W = 2 and 4 (S divisible by 8): errors must not grow with the ring.
_GROWTH = {
    f"growth-{dt}": (compare, {"dtype": dt, "S": 64, "seed": 7, "layout": "contiguous"})
    for dt in ("float32", "bfloat16")
}

_W4 = (
    "causal-gqa-zigzag",
    "causal-contiguous",
    "causal-bf16",
    "documents-zigzag",
    "padding-alibi",
    "allgather-documents",
)
WORLDS = {
    1: {"exact-fp32": (exact_single_rank, {}),
        "exact-bf16": (exact_single_rank, {"dtype": "bfloat16"}),
        **{n: _CORE[n] for n in ("causal-gqa-zigzag", "documents-zigzag")}},
    2: {**_CORE, **_EXTRA, **_GROWTH},
    3: {**{n: _CORE[n] for n in ("causal-contiguous", "causal-gqa-zigzag", "documents-zigzag",
                                 "window-softcap-contiguous", "allgather-contiguous-alibi")},
        "skips-contiguous": _EXTRA["skips-contiguous"],
        # a group of global ranks 1 and 2: ring peers are translated to global ranks
        "subgroup-documents": (compare, {"mask": "documents", "group_ranks": [1, 2]}),
        "subgroup-allgather": (compare, {"method": "allgather", "group_ranks": [1, 2]})},
    4: {**{n: _CORE[n] for n in _W4},
        **{n: _EXTRA[n] for n in ("skips-contiguous", "skips-zigzag", "model")}, **_GROWTH},
}  # fmt: skip


def suite(name: str, W: int) -> tuple[list[tuple[str, Callable, dict]], dict]:
    """The cases of suite ``name`` ("ring" or "bad-args") on W ranks, and run_group's timeouts."""
    if name == "ring":
        return [(n, fn, kw) for n, (fn, kw) in WORLDS[W].items()], {}
    assert name == "bad-args" and W in BAD_ARGS_WORLDS, (name, W)
    timeouts = {"pg_timeout_s": BAD_ARGS_PG_TIMEOUT_S, "deadline_s": BAD_ARGS_DEADLINE_S}
    return [(n, fn, kw) for n, (fn, kw) in BAD_ARGS.items()], timeouts
