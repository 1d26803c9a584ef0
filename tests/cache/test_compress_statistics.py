"""Prefill statistics streamed per chunk (selfattn.cache.compress.statistics) against the papers'
rules written as float64 loops (tests/cache/test_compress.py's references).

The rows are split at random into chunks of odd sizes and fed in order, as the Engine's chunked
prefill feeds them; the press's scores from the statistic must match the float64 reference by
the ratio rule (2x the reference's own error in the test dtype, plus a few ulps), as its scores
from every row at once must, with the same kept-set checks. GQA 2:1 and 3:1, float64, float32
and bfloat16 inputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from selfattn.cache.compress import AttentionSums, QueryMoments, press
from selfattn.positions import RoPE
from tests.cache.test_compress import DTYPES, check_choice, make, ref_expected, ref_h2o

CASES = [(seed, group, dtype) for seed in (0, 1) for group in (2, 3) for dtype in DTYPES]


def splits(seed: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut at random into chunks of 1 to 9 rows, in order."""
    g, out, at = random.Random(seed), [], lo
    while at < hi:
        n = min(g.randint(1, 9), hi - at)
        out.append((at, at + n))
        at += n
    return out


@pytest.mark.parametrize(("seed", "group", "dtype"), CASES)
@pytest.mark.parametrize("rows", [29, 11])
def test_observed_attention_streamed_per_chunk_equals_the_rule(seed, group, dtype, rows):
    """The last ``rows`` of 29 rows streamed in random chunks; each chunk sees the keys up to
    its last row only."""
    s = 29
    k, v, q = make(seed, group=group, s=s, d=8, dtype=dtype)
    p = press("observed_attention", 0.5)
    assert isinstance(p.statistic(), AttentionSums)
    last = q[:, :, s - rows :]
    ref64, naive = ref_h2o(last.double(), k.double()), ref_h2o(last, k)
    exact = dtype == torch.float64
    for block in (128, 2):  # chunks softmaxed whole, and in blocks of 2 rows
        stat = AttentionSums(row_block=block)
        for a, b in splits(seed + rows, s - rows, s):
            stat.update(q[:, :, a:b], k[:, :, :b], a)
        assert stat.sums.shape == (2, 2 * group, s) and stat.rows == rows
        check_choice(p, p.score(k, v, statistic=stat), ref64, naive, p.budget(s), exact)
    check_choice(p, p.score(k, v, last), ref64, naive, p.budget(s), exact)  # all rows at once


@pytest.mark.parametrize(("seed", "group", "dtype"), CASES)
def test_expected_attention_streamed_moments_equal_the_rule(seed, group, dtype):
    """Every row of the prompt streamed (the sinks' rows dropped by the statistic), chunks in
    random order: the moments do not depend on it."""
    s, sink, fut = 31, 3, 16
    k, v, q = make(seed, group=group, s=s, d=8, dtype=dtype)
    p = press("expected_attention", 0.5, n_sink=sink, n_future_positions=fut)
    stat = p.statistic()
    assert isinstance(stat, QueryMoments)
    chunks = splits(seed, 0, s)
    random.Random(seed).shuffle(chunks)
    for a, b in chunks:
        stat.update(q[:, :, a:b], None, a)
    assert stat.count == s - sink
    assert stat.mean.shape == (2, 2 * group, 8) and stat.m2.shape == (2, 2 * group, 8, 8)
    q_pre = q[:, :, sink:]
    ref64 = ref_expected(q_pre.double(), k.double(), v.double(), fut, sink)
    naive = ref_expected(q_pre, k, v, fut, sink)
    exact = dtype == torch.float64
    scores = p.score(k, v, statistic=stat, rope=RoPE(8))
    check_choice(p, scores, ref64, naive, p.budget(s), exact)
    check_choice(p, p.score(k, v, q, rope=RoPE(8)), ref64, naive, p.budget(s), exact)


def test_adakv_streams_its_scorers_statistic():
    k, v, q = make(5, group=2, s=21, d=8)
    ada = press("adakv_observed_attention", 0.5)
    stat = ada.statistic()
    for a, b in splits(5, 0, 21):
        stat.update(q[:, :, a:b], k[:, :, :b], a)
    streamed = ada.keep(ada.score(k, v, statistic=stat), ada.budget(21))
    at_once = ada.keep(ada.score(k, v, q), ada.budget(21))
    assert torch.equal(streamed.counts, at_once.counts)  # scores within float32 rounding
    assert press("snapkv", 0.5).statistic() is None and press("tova", 0.5).statistic() is None


def test_statistic_errors_name_the_value_and_the_fix():
    k, v, q = make(2, group=2, s=12, d=8)
    obs = press("observed_attention", 0.5)
    stat = obs.statistic()
    stat.update(q[:, :, :5], k[:, :, :5], 0)
    with pytest.raises(ValueError, match="rows up to 5 are in, got a chunk from row 7"):
        stat.update(q[:, :, 7:9], k[:, :, :9], 7)
    with pytest.raises(ValueError, match=r"keys must be \(B, Hkv, 9, D\).*got \(2, 2, 12, 8\)"):
        stat.update(q[:, :, 5:9], k, 5)
    with pytest.raises(ValueError, match="holds rows up to 5, the keys are 12"):
        obs.score(k, v, statistic=stat)
    with pytest.raises(ValueError, match="not both"):
        obs.score(k, v, q, statistic=stat)
    with pytest.raises(
        ValueError, match="snapkv scores from queries=, got statistic=AttentionSums"
    ):
        press("snapkv", 0.5, window=2).score(k, v, statistic=stat)
    exp = press("expected_attention", 0.5, n_sink=4)
    with pytest.raises(ValueError, match="scores from QueryMoments, got statistic=AttentionSums"):
        exp.score(k, v, statistic=stat, rope=RoPE(8))
    empty = exp.statistic()
    empty.update(q[:, :, :4], None, 0)  # the sinks' rows only
    with pytest.raises(ValueError, match="holds no query past the 4 sinks"):
        exp.score(k, v, statistic=empty, rope=RoPE(8))
    with pytest.raises(ValueError, match="row_block must be an int >= 1, got 0"):
        AttentionSums(row_block=0)
    with pytest.raises(ValueError, match="first_row must be an int >= 0, got -1"):
        empty.update(q, None, -1)
