"""benchmarks/attention.py runs end to end (``--quick``) and its bookkeeping is right.

Speed is never asserted: only that every row is measured or says why not, that ratios and verdicts
follow from the measured values, and that ours and each peer compute the same outputs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import selfattn as sa

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load_bench():
    """benchmarks/attention.py as a module (it imports its sibling ``_util``)."""
    name = "bench_attention"
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / "attention.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize(
    "mask, S",
    [
        (None, 13),
        (sa.masks.causal(), 37),
        (sa.masks.sliding_window(5), 29),
        (sa.masks.causal() & sa.masks.documents(torch.arange(23) // 7), 23),
    ],
)
def test_allowed_pairs_counts_the_dense_mask(mask, S):
    bench = _load_bench()
    want = S * S if mask is None else int(mask.to_dense(S, S).sum())
    assert bench.allowed_pairs(mask, S, block=4) == want


def test_sizes_quick_divides_lengths_by_eight():
    bench = _load_bench()
    full, quick = bench.Sizes(), bench.Sizes().quick()
    assert (quick.S, quick.S_long, quick.window, quick.doc_len) == (
        full.S // 8,
        full.S_long // 8,
        full.window // 8,
        full.doc_len // 8,
    )
    assert (quick.H, quick.D) == (full.H, full.D)


@pytest.mark.slow
def test_quick_run_produces_every_row():
    cmd = [sys.executable, str(BENCH / "attention.py"), "--quick", "--json", "--no-compile"]
    cmd += ["--repeat", "1", "--matmul-repeat", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    bench = _load_bench()
    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == list(bench.CASES)
    assert result["matmul_gflops"] > 0
    for key, r in rows.items():
        # each side either measured or names its error
        assert (r["ours"] is not None) or r["ours_error"], key
        assert (r["peer_value"] is not None) or r["peer_error"], key
        if r["ours"] is not None and r["peer_value"]:
            assert r["ratio"] == pytest.approx(r["ours"] / r["peer_value"])
            want = r["ratio"] <= r["target"] if r["op"] == "<=" else r["ratio"] >= r["target"]
            assert r["met"] == want
        else:
            assert r["ratio"] is None and r["met"] is None
        if r["max_abs_diff"] is not None:  # ours and the peer computed the same attention
            assert r["max_abs_diff"] < 1e-4, (key, r["max_abs_diff"])
    assert rows["ceiling"]["peer_value"] == pytest.approx(result["matmul_gflops"])
    assert rows["ceiling"]["ours"] == rows["window"]["gflops"]
