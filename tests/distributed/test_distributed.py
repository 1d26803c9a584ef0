"""Ring attention == single-process attention, on 1-4 local gloo ranks (CPU).

Each world size starts one process group that runs all of its cases (tests/_dist_helpers.py);
every test below reads one case's result from every rank. The oracle is the float64 reference on
the whole sequence, the tolerance the ratio rule of docs/testing.md, applied to each rank's shard.
"""

from __future__ import annotations

import os

import pytest
import torch
from filelock import FileLock

from selfattn import masks
from selfattn.distributed import (
    position_ids,
    ring_attention,
    segments,
    shard_sequence,
    unshard_sequence,
)
from selfattn.distributed.blocks import pairs
from selfattn.testing import make_qkv
from tests import _dist_helpers as helpers

_RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    """``get(W, suite)``: the results of a suite of cases (helpers.suite) on W ranks, run once per
    session, also under pytest-xdist (workers share one run per (suite, W) through a lock in the
    session's temporary root)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(W: int, suite: str = "ring") -> dict:
        key = f"{suite}-w{W}"
        if key not in _RESULTS:
            with FileLock(str(root / f"{key}.lock")):
                done = root / f"{key}.pt"
                if done.exists():
                    _RESULTS[key] = torch.load(done)
                else:
                    work = root / key
                    work.mkdir(exist_ok=True)
                    cases, timeouts = helpers.suite(suite, W)
                    _RESULTS[key] = helpers.run_group(W, cases, work, **timeouts)
                    torch.save(_RESULTS[key], done)
        return _RESULTS[key]

    return get


def _ok(results: list) -> list:
    errors = [value for status, value, _ in results if status != "ok"]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    return [value for _, value, _ in results]


@pytest.mark.parametrize(
    "W, case", [(W, name) for W, cases in helpers.WORLDS.items() for name in cases]
)
def test_ring_case(group_results, W, case):
    _ok(group_results(W)[case])


@pytest.mark.parametrize(
    "W, case", [(W, name) for W in helpers.BAD_ARGS_WORLDS for name in helpers.BAD_ARGS]
)
def test_bad_argument_on_one_rank_raises_on_every_rank(group_results, W, case):
    """One rank's bad argument (or ranks that disagree): every rank raises
    DistributedArgumentError naming that rank and its message, before any transfer; a group
    whose collectives wait on the failed rank instead fails by its short timeout."""
    _ok(group_results(W, "bad-args")[case])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_error_does_not_grow_with_ranks(group_results, dtype):
    """The same problem on 2 and on 4 ranks: the fp32 LSE merge keeps the error flat, so 4 ranks
    are no worse than 2 beyond rounding (1.5x, plus a couple of ulps)."""
    per_w = {W: _ok(group_results(W)[f"growth-{dtype}"]) for W in (2, 4)}
    eps = torch.finfo(getattr(torch, dtype)).eps
    for key in ("out", "dq", "dk", "dv"):
        e2 = max(r[key] for r in per_w[2])
        e4 = max(r[key] for r in per_w[4])
        assert e4 <= 1.5 * e2 + 2 * eps, f"{key}: error {e4:.3e} on 4 ranks vs {e2:.3e} on 2"


# -- no process group needed ---------------------------------------------------------------------


def test_zigzag_balances_causal_blocks_contiguous_does_not():
    """Causal work per rank, counted in allowed (query, key) pairs of the computed blocks."""
    S, W = 64, 4
    dense = masks.causal().to_dense(S, S)[0, 0]

    def work(layout):
        out = []
        for r in range(W):
            mine, total = segments(S, layout, r, W), 0
            for o in range(W):
                for p in pairs(mine, segments(S, layout, o, W), masks.causal(), 1, 1, "cpu"):
                    total += int(dense[p.gq : p.gq + p.n_q, p.gk : p.gk + p.n_k].sum())
            out.append(total)
        return out

    zig, con = work("zigzag"), work("contiguous")
    assert sum(zig) == sum(con) == int(dense.sum())  # skipped blocks held no allowed pair
    assert max(zig) == min(zig)
    assert max(con) > 3 * min(con)


def test_sliding_window_skips_ranks_out_of_reach():
    S, W, size = 64, 4, 5
    mine = segments(S, "contiguous", 3, W)
    live = [o for o in range(W) if pairs(mine, segments(S, "contiguous", o, W),
                                         masks.sliding_window(size), 1, 1, "cpu")]  # fmt: skip
    assert live == [2, 3]


def test_layout_positions():
    assert position_ids(8, "zigzag").tolist() == list(range(8))  # one rank: the whole sequence
    assert segments(8, "zigzag", 0, 2) == [(0, 2), (6, 2)]
    assert segments(8, "zigzag", 1, 2) == [(2, 2), (4, 2)]
    assert segments(9, "contiguous", 2, 3) == [(6, 3)]


def test_without_process_group_is_attention():
    q, k, v = make_qkv(1, 2, 9, 8, seed=3)
    out = ring_attention(q, k, v, mask=masks.causal())
    import selfattn as sa

    assert torch.equal(out, sa.attention(q, k, v, mask=masks.causal()))
    assert torch.equal(shard_sequence(q, "zigzag", dim=2), q)


def test_shard_sequence_needs_the_sequence_dim_of_a_4d_tensor():
    """(B, H, S, D) and (B, S, H, D) look alike: no default for 4-D, so the heads are never
    split silently (the README passed (B, H, S, D) with the old default dim=1)."""
    x = torch.randn(2, 4, 6, 8)
    for fn in (shard_sequence, unshard_sequence):
        with pytest.raises(ValueError, match=r"dimension of x \(2, 4, 6, 8\).*dim=2 for heads"):
            fn(x, "zigzag")
        assert torch.equal(fn(x, "zigzag", dim=2), x)  # one rank: the whole sequence
    assert torch.equal(shard_sequence(x, "zigzag", dim=-2), x)
    h = torch.randn(2, 6, 8)
    assert torch.equal(shard_sequence(h), h)  # (B, S, d): the default dim=1 stays
    assert torch.equal(shard_sequence(torch.arange(6)), torch.arange(6))
    with pytest.raises(ValueError, match=r"dim=3 is out of range for x \(2, 6, 8\)"):
        shard_sequence(h, dim=3)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"layout": "striped"}, "layout must be one of"),
        ({"method": "ulysses"}, "method must be one of"),
    ],
)
def test_bad_options(kwargs, needle):
    q, k, v = make_qkv(1, 2, 8, 8)
    with pytest.raises(ValueError, match=needle):
        ring_attention(q, k, v, **kwargs)


def test_bad_length_names_the_fix():
    with pytest.raises(ValueError, match=r"S=10 is not divisible by 4.*pad the sequence by 2"):
        segments(10, "zigzag", 0, 2)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_benchmark_work_counts_causal_pairs(layout):
    """The benchmark's per-rank causal work adds up to the whole causal triangle."""
    from selfattn.benchmarks import ring as bench

    S, W = 48, 4
    work = [bench._theory_work(layout, S, W, r) for r in range(W)]
    assert sum(work) == S * (S + 1) // 2
    assert (bench._spread(work) == 0) == (layout == "zigzag")
