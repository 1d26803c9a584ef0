"""KV-compression presses against each paper's rule, written here as loops in float64.

For every policy: random K/V/Q (several seeds, odd sizes, GQA 2:1 and 3:1), the press's scores
match the reference within the ratio rule (2x the reference's own error in the test dtype, plus
a few ulps), its kept set is exactly the reference's top-budget by the documented tie rule
applied to its own scores, and against the float64 reference no dropped token beats a kept one
by more than that tolerance (exactly equal sets for float64 input).
"""

from __future__ import annotations

import math

import pytest
import torch

from selfattn.cache.compress import (
    AdaKV,
    DecodeScores,
    Press,
    SnapKV,
    compress_kv,
    names,
    press,
)
from selfattn.positions import RoPE

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def make(seed, *, b=2, hkv=2, group=2, s=37, d=8, dtype=torch.float32, rows=None):
    """Random keys/values ``(b, hkv, s, d)`` and the last ``rows`` queries ``(b, hkv*group,
    rows, d)``, with a few large-norm keys so scores spread."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    k *= 1 + 2 * torch.rand(b, hkv, s, 1, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    q = torch.randn(
        b, hkv * group, s if rows is None else rows, d, generator=g, dtype=torch.float64
    )
    return k.to(dtype), v.to(dtype), q.to(dtype)


# -- references: the papers' rules as loops, in the dtype they are given


def ref_attention(q, k, scale=None):
    """Softmax rows of the last R queries (positions S-R .. S-1) over the keys they see."""
    b, hq, r, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, hq, r, s, dtype=q.dtype)
    for bi in range(b):
        for h in range(hq):
            keys = k[bi, h // (hq // hkv)]
            for i in range(r):
                seen = s - r + i + 1
                out[bi, h, i, :seen] = torch.softmax(keys[:seen] @ q[bi, h, i] * scale, 0)
    return out


def group_average(x, hkv):
    """(B, Hq, S) -> (B, Hkv, S): the mean over each KV head's query heads, by loop."""
    g = x.shape[1] // hkv
    return torch.stack([sum(x[:, h * g + j] for j in range(g)) / g for h in range(hkv)], 1)


def ref_snapkv(q, k, window, kernel):
    """SnapKV: each key's mean attention from the window's queries, a zero-padded average pool
    of width ``kernel``, the group's mean; the window kept (+inf)."""
    s = k.shape[2]
    attn = ref_attention(q[:, :, -window:], k)
    votes = attn[..., : s - window].mean(2)
    n, half = s - window, kernel // 2
    pooled = torch.zeros_like(votes)
    for j in range(n):
        for t in range(j - half, j + half + 1):
            if 0 <= t < n:
                pooled[..., j] += votes[..., t] / kernel
    out = group_average(pooled, k.shape[1])
    return torch.cat([out, torch.full((*out.shape[:2], window), math.inf, dtype=out.dtype)], -1)


def ref_tova(q, k):
    """TOVA: the last query's weights averaged over every head, the last token kept."""
    attn = ref_attention(q[:, :, -1:], k)[:, :, 0]
    mean = attn.mean(1, keepdim=True).expand(-1, k.shape[1], -1).clone()
    mean[..., -1] = math.inf
    return mean


def ref_h2o(q, k):
    """Observed attention: key j's attention summed over the R rows seeing it, divided by
    their number, averaged over the group."""
    s, r = k.shape[2], q.shape[2]
    attn = ref_attention(q, k)
    out = torch.zeros(attn.shape[0], attn.shape[1], s, dtype=attn.dtype)
    for j in range(s):
        rows = [i for i in range(r) if s - r + i >= j]
        out[..., j] = sum(attn[:, :, i, j] for i in rows) / len(rows)
    return group_average(out, k.shape[1])


def ref_knorm(k):
    out = torch.zeros(k.shape[:3], dtype=k.dtype)
    for j in range(k.shape[2]):
        out[..., j] = -(k[..., j, :] ** 2).sum(-1).sqrt()
    return out


def rope_matrix(p, d, base=10000.0):
    """RoPE's rotation at position p as a (d, d) matrix, half-split layout (Su et al.)."""
    m = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        theta = p * base ** (-2 * i / d)
        c, s_ = math.cos(theta), math.sin(theta)
        m[i, i], m[i, i + d // 2] = c, -s_
        m[i + d // 2, i], m[i + d // 2, i + d // 2] = s_, c
    return m


def ref_expected(q_pre, k, v, n_future, n_sink):
    """Expected attention: queries ~ N(mu, Sigma) rotated by the mean future RoPE matrix;
    E[exp(q.k/sqrt d)] = exp(mu.k/sqrt d + k'Sigma k/(2d)), softmaxed over the non-sink keys,
    averaged over the group, times ||v||; the sinks kept."""
    b, hq, n, d = q_pre.shape
    hkv, s = k.shape[1], k.shape[2]
    rbar = sum(rope_matrix(p, d) for p in range(s, s + n_future)) / n_future
    rbar = rbar.to(q_pre.dtype)
    out = torch.zeros(b, hq, s - n_sink, dtype=q_pre.dtype)
    for bi in range(b):
        for h in range(hq):
            x = q_pre[bi, h]
            mu = x.mean(0)
            cov = sum(torch.outer(x[t] - mu, x[t] - mu) for t in range(n)) / n
            mu, cov = rbar @ mu, rbar @ cov @ rbar.T
            keys = k[bi, h // (hq // hkv), n_sink:]
            logits = torch.stack([mu @ kj / math.sqrt(d) + kj @ cov @ kj / (2 * d) for kj in keys])
            out[bi, h] = torch.softmax(logits, 0)
    out = group_average(out, hkv) * v[:, :, n_sink:].norm(dim=-1)
    sinks = torch.full((b, hkv, n_sink), math.inf, dtype=out.dtype)
    return torch.cat([sinks, out], -1)


def ref_select(scores, budget):
    """Per head the ``budget`` highest scores, ties to the lowest index, as ascending lists."""
    b, h, s = scores.shape
    return [
        [sorted(sorted(range(s), key=lambda j: (-float(scores[bi, hi, j]), j))[:budget])]
        for bi in range(b)
        for hi in range(h)
    ]


def tolerance(ref64, naive):
    """The ratio rule: 2x the reference's own error in the test dtype, plus a few ulps."""
    finite = torch.isfinite(ref64)
    err = (naive.double() - ref64)[finite].abs().max().item()
    floor = 8 * torch.finfo(naive.dtype).eps * ref64[finite].abs().max().item()
    return 2 * err + floor


def check_choice(p: Press, scores, ref64, naive, budget, exact):
    """Scores within the ratio rule; the kept set the tie rule's on our scores; against the
    float64 reference no dropped token beats a kept one by over twice the tolerance."""
    tol = tolerance(ref64, naive)
    assert torch.equal(torch.isinf(scores), torch.isinf(ref64))
    fin = torch.isfinite(ref64)
    diff = (scores.double() - ref64)[fin].abs()
    assert diff.max() <= tol, f"max {diff.max():.3g} mean {diff.mean():.3g} tol {tol:.3g}"
    idx = p.keep(scores, budget)
    assert idx.shape == (*scores.shape[:2], budget)
    assert [[r] for r in idx.reshape(-1, budget).tolist()] == ref_select(scores, budget)
    if exact:
        assert [[r] for r in idx.reshape(-1, budget).tolist()] == ref_select(ref64, budget)
    for row, ref in zip(idx.reshape(-1, budget), ref64.reshape(-1, ref64.shape[-1])):
        kept = torch.zeros_like(ref, dtype=torch.bool)
        kept[row] = True
        assert kept[torch.isinf(ref)].all(), "a protected token was dropped"
        if (~kept).any():
            assert ref[kept].min() >= ref[~kept].max() - 2 * tol
    return idx


CASES = [(seed, group, dtype) for seed in (0, 1) for group in (2, 3) for dtype in DTYPES]


@pytest.mark.parametrize(("seed", "group", "dtype"), CASES)
def test_snapkv_and_pyramidkv_keep_the_windows_votes(seed, group, dtype):
    s, w = 41, 5
    k, v, q = make(seed, group=group, s=s, dtype=dtype, rows=9)
    ref64 = ref_snapkv(q.double(), k.double(), w, 3)
    naive = ref_snapkv(q, k, w, 3)
    for name, layer in (("snapkv", 0), ("pyramidkv", 2)):
        p = press(name, 0.5, window=w, kernel_size=3)
        scores = p.score(k, v, q, layer=layer, n_layers=4)
        n = p.budget(s, layer, 4)
        check_choice(p, scores, ref64, naive, n, exact=dtype == torch.float64)
    # the same votes from precomputed attention rows
    attn = ref_attention(q.double(), k.double())
    from_attn = press("snapkv", 0.5, window=w, kernel_size=3).score(
        k.double(), v.double(), attention=attn
    )
    assert torch.allclose(from_attn, ref64, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("seed", "group", "dtype"), CASES)
def test_tova_keeps_the_last_querys_choice(seed, group, dtype):
    k, v, q = make(seed, group=group, s=29, dtype=dtype, rows=3)
    p = press("tova", 0.6)
    check_choice(
        p,
        p.score(k, v, q),
        ref_tova(q.double(), k.double()),
        ref_tova(q, k),
        p.budget(29),
        exact=dtype == torch.float64,
    )


@pytest.mark.parametrize(("seed", "group", "dtype"), CASES)
@pytest.mark.parametrize("rows", [23, 7])
def test_observed_attention_averages_over_the_rows_that_see_a_key(seed, group, dtype, rows):
    k, v, q = make(seed, group=group, s=23, dtype=dtype, rows=rows)
    p = press("observed_attention", 0.5)
    check_choice(
        p,
        p.score(k, v, q),
        ref_h2o(q.double(), k.double()),
        ref_h2o(q, k),
        p.budget(23),
        exact=dtype == torch.float64,
    )


@pytest.mark.parametrize(("seed", "group", "dtype"), CASES)
def test_knorm_keeps_the_smallest_keys(seed, group, dtype):
    k, v, _ = make(seed, group=group, s=31, dtype=dtype)
    p = press("knorm", 0.75)
    check_choice(
        p,
        p.score(k, v),
        ref_knorm(k.double()),
        ref_knorm(k),
        p.budget(31),
        exact=dtype == torch.float64,
    )


@pytest.mark.parametrize(("seed", "group", "dtype"), CASES)
def test_expected_attention_from_the_query_distribution(seed, group, dtype):
    s, sink, fut = 27, 3, 16
    k, v, q = make(seed, group=group, s=s, d=8, dtype=dtype)
    p = press("expected_attention", 0.5, n_sink=sink, n_future_positions=fut)
    q_pre = q[:, :, sink:]
    assert q_pre.shape[2] == p.query_rows(s)
    ref64 = ref_expected(q_pre.double(), k.double(), v.double(), fut, sink)
    naive = ref_expected(q_pre, k, v, fut, sink)
    scores = p.score(k, v, q, rope=RoPE(8))  # all S rows given: it reads the last S - n_sink
    check_choice(p, scores, ref64, naive, p.budget(s), exact=dtype == torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("s", [13, 40])
def test_streaming_llm_keeps_sinks_and_the_most_recent(seed, s):
    k, v, _ = make(seed, s=s)
    for ratio in (0.3, 0.5, 0.8):
        p = press("streaming_llm", ratio, n_sink=2)
        n = int(s * (1 - ratio))
        out = p.apply(k, v)
        want = list(range(2)) + list(range(s - (n - 2), s))
        assert all(row == want for row in out.indices.reshape(-1, n).tolist())
        assert torch.equal(out.keys, k[:, :, want])


def pyramid_budgets(s, ratio, window, beta, n_layers):
    """PyramidKV's layer budgets (KVCache-Factory's formula with kvpress's total): window plus
    shares running linearly from the bottom layer's ``high`` to the top's ``low``, ``low +
    high = 2 s (1 - ratio)``, uniform where that pyramid does not fit."""
    kept = s * (1 - ratio)
    low, high = kept / beta, 2 * kept - kept / beta
    if high >= s - window:
        high, low = s - window, 2 * kept - (s - window)
    if not s >= high >= low >= window:
        return [round(kept)] * n_layers
    return [round(high - i * (high - low) / (n_layers - 1)) for i in range(n_layers)]


@pytest.mark.parametrize("s", [97, 1000, 4093])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.875])
@pytest.mark.parametrize("n_layers", [2, 30])
def test_pyramidkv_budgets_form_a_pyramid_with_the_uniform_total(s, ratio, n_layers):
    p = press("pyramidkv", ratio, window=8)
    got = [p.budget(s, i, n_layers) for i in range(n_layers)]
    assert got == pyramid_budgets(s, ratio, 8, 20, n_layers)
    assert got == sorted(got, reverse=True)
    assert abs(sum(got) - n_layers * s * (1 - ratio)) <= n_layers / 2 + 1e-9


def ref_adakv(scores, budget, alpha):
    """AdaKV: each head's int(alpha * budget) best forced in, then the Hkv * budget best of
    the layer (ties: lower head, then lower index); per head ascending lists."""
    b, h, s = scores.shape
    out = []
    for bi in range(b):
        ranked = {}
        for hi in range(h):
            order = sorted(range(s), key=lambda j: (-float(scores[bi, hi, j]), j))
            for j in range(s):
                ranked[hi, j] = float(scores[bi, hi, j])
            for j in order[: int(budget * alpha)]:
                ranked[hi, j] = math.inf
        best = sorted(ranked, key=lambda hj: (-ranked[hj], hj))[: h * budget]
        out += [sorted(j for hh, j in best if hh == hi) for hi in range(h)]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.9])
@pytest.mark.parametrize("group", [2, 3])
def test_adakv_budgets_per_head(seed, alpha, group):
    s = 33
    k, v, q = make(seed, hkv=3, group=group, s=s, dtype=torch.float64, rows=6)
    p = press("adakv_snapkv", 0.6, window=4, kernel_size=3, alpha_safeguard=alpha)
    n = p.budget(s)
    scores = p.score(k, v, q)
    assert torch.allclose(scores, ref_snapkv(q, k, 4, 3), rtol=0, atol=1e-12)
    idx, counts = p.keep(scores, n)
    want = ref_adakv(ref_snapkv(q, k, 4, 3), n, alpha)
    got = [row[:c] for row, c in zip(idx.reshape(-1, idx.shape[-1]).tolist(), counts.flatten())]
    assert got == want
    assert (counts.sum(-1) == 3 * n).all() and (counts >= max(4, int(alpha * n))).all()
    out = p.apply(k, v, q)
    assert torch.equal(out.counts, counts)
    for bi in range(2):
        for h in range(3):
            c = int(counts[bi, h])
            assert torch.equal(out.keys[bi, h, :c], k[bi, h, idx[bi, h, :c]])
            assert not out.keys[bi, h, c:].any()  # padding rows are zeros


@pytest.mark.parametrize("name", [n for n in names() if not n.startswith("kivi")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ratio_zero_returns_every_token_bit_identical(name, dtype):
    k, v, q = make(3, s=19, dtype=dtype)
    out = press(name, 0.0).apply(k, v, q, rope=RoPE(8))
    assert out.keys is k and out.values is v and out.counts is None
    assert out.indices.tolist() == [[list(range(19))] * 2] * 2
    kk, vv = compress_kv(k, v, out.indices)  # gathering every index is bit-identical too
    assert torch.equal(kk, k) and torch.equal(vv, v)


def test_ties_keep_the_lowest_index_and_nan_ranks_last():
    scores = torch.tensor([[[1.0, 2.0, 2.0, float("nan"), 2.0, 0.0]]])
    assert press("knorm", 0.5).keep(scores, 3).tolist() == [[[1, 2, 4]]]
    k = torch.ones(1, 1, 10, 4)  # equal norms everywhere: the oldest tokens win
    assert press("knorm", 0.5).apply(k, k).indices.tolist() == [[[0, 1, 2, 3, 4]]]


# -- decoding


def run_decode(name, steps, budget, window, seed):
    """Our DecodeScores against a list-per-head simulation of the paper's eviction rule."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, grp, start = 2, 2, 3, budget
    p = press(name, 0.5, window=window)
    ds = DecodeScores(p, budget, hkv)
    alive = [[list(range(start)) for _ in range(hkv)] for _ in range(b)]  # token ids per head
    stat = [[[0.0] * start for _ in range(hkv)] for _ in range(b)]
    for t in range(steps):
        n = len(alive[0][0]) + 1  # the new token's key joins
        w = torch.rand(b, hkv * grp, n, generator=g, dtype=torch.float64).softmax(-1)
        ds.update(w)
        drop, keep = ds.evict()
        for bi in range(b):
            mean_all = w[bi].mean(0)
            for h in range(hkv):
                alive[bi][h].append(start + t)
                own = w[bi, h * grp : (h + 1) * grp].mean(0)
                if name == "observed_attention":
                    stat[bi][h] = [a + float(x) for a, x in zip([*stat[bi][h], 0.0], own)]
                else:
                    stat[bi][h] = [float(x) for x in mean_all]
                ids, sc = alive[bi][h], stat[bi][h]
                while len(ids) > budget:  # evict the lowest outside the window, newest on ties
                    cand = range(len(ids) - window)
                    j = min(cand, key=lambda j: (sc[j], -j))
                    del ids[j], sc[j]
        assert keep.shape == (b, hkv, budget)
        yield alive, drop, keep


@pytest.mark.parametrize("name", ["observed_attention", "tova"])
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_eviction_follows_the_rule(name, seed):
    budget, window = 6, 2
    ids_ours = [[list(range(budget)) for _ in range(2)] for _ in range(2)]
    for t, (alive, drop, keep) in enumerate(run_decode(name, 9, budget, window, seed)):
        for bi in range(2):
            for h in range(2):
                ids = ids_ours[bi][h] + [budget + t]
                assert sorted(drop[bi, h].tolist() + keep[bi, h].tolist()) == list(range(len(ids)))
                ids_ours[bi][h] = [ids[j] for j in keep[bi, h].tolist()]
                assert ids_ours[bi][h] == alive[bi][h]


def test_decode_streaming_llm_and_errors():
    p = press("streaming_llm", 0.5, n_sink=2)
    ds = DecodeScores(p, 5, 1)
    ids = []
    for t in range(8):
        ids.append(t)
        ds.update(torch.rand(1, 2, len(ids)).softmax(-1))
        ids = [ids[j] for j in ds.evict().keep[0, 0].tolist()]
    assert ids == [0, 1, 5, 6, 7]
    with pytest.raises(ValueError, match="snapkv"):
        DecodeScores(press("snapkv", 0.5), 80, 1)
    with pytest.raises(ValueError, match="budget must be an int >= 3"):
        DecodeScores(press("observed_attention", 0.5, window=3), 2, 1)


# -- errors


def test_errors_name_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"'snapkvv'.*adakv_snapkv.*kivi4"):
        press("snapkvv", 0.5)
    for bad in (1.0, -0.1, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"compression_ratio must be a number in \[0, 1\)"):
            press("knorm", bad)
    with pytest.raises(
        ValueError, match=r"snapkv has no knob 'n_sink'; its knobs: \['kernel_size', 'window'\]"
    ):
        press("snapkv", 0.5, n_sink=4)
    with pytest.raises(ValueError, match=r"kernel_size must be odd.*got 4"):
        press("snapkv", 0.5, kernel_size=4)
    with pytest.raises(ValueError, match=r"budget 50 tokens \(seq_len 100.*keeps \(window 64\)"):
        press("snapkv", 0.5).budget(100)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, n_layers=4\), got 4"):
        press("pyramidkv", 0.5).budget(1000, 4, 4)
    with pytest.raises(ValueError, match=r"alpha_safeguard must be in .*got 1\.5"):
        press("adakv_knorm", 0.5, alpha_safeguard=1.5)
    with pytest.raises(ValueError, match=r"kivi2 quantises pages.*ratio must be 0, got 0\.5"):
        press("kivi2", 0.5)
    assert press("kivi4").bits == 4 and press("kivi2", window=64).window == 64
    with pytest.raises(ValueError, match="adakv needs a scorer"):
        AdaKV(0.5)
    k, v, q = make(0, s=20)
    with pytest.raises(ValueError, match=r"snapkv needs the last 8 query rows, got 3"):
        SnapKV(0.5, window=8).score(k, v, q[:, :, -3:])
    with pytest.raises(ValueError, match="pass queries= or attention="):
        press("tova", 0.5).score(k, v)
    with pytest.raises(ValueError, match="rope="):
        press("expected_attention", 0.5).score(k, v, q)
