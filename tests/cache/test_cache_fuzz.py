"""A stateful fuzz of the whole paged cache: ``PagedCache`` with prefix caching and
fp32 pages, driven by hypothesis through at least ``MIN_STEPS`` random operations.

Operations (the rules of ``PagedCacheMachine`` in tests/_cache_helpers.py plus those below):
new sequences from salted prefix hits, ragged batched appends (copy-on-write of shared pages,
eviction of cached pages under a full pool, refusals past the pool or ``max_len``), forks,
truncation, caching live or finished sequences, frees, explicit eviction, lookups of one
salt's prefixes under another salt, and decode steps through ``PagedCacheView.attend``.

After every step: ``cache.check()``; no page leaks (a page is in use exactly when a live
sequence or the index holds it); every live sequence and cached page reads back bitwise what
was written; a refused append changed nothing at all; and ``paged_attention`` over all live
sequences (ragged, Sq 1-3, no mask / causal / sliding window, alternately on the C kernel and
on the PyTorch path) equals the fp64 reference on each sequence's own K/V by the ratio rule.
At the end of each run every sequence is freed, the index evicted, and every page is free.

The run is seeded (``SEED``); set ``SELFATTN_FUZZ_SEED`` to hunt with other seeds.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

import torch
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from selfattn import masks, scores
from selfattn.kernels import paged_decode as _decode_kernels
from tests._cache_helpers import HQ, D, PagedCacheMachine, assert_attention

SEED = int(os.environ.get("SELFATTN_FUZZ_SEED", "11"))
MIN_STEPS = 6_000  # rule executions over the whole run
# Hypothesis runs x steps per run: ~7,000 operations (a run ends early when its choice buffer
# fills), 10-20 s on one core of a busy 2-core machine. Longer runs fill the buffer sooner.
EXAMPLES, STEPS = 200, 40
WINDOW = 4  # sliding-window size of the attention checks: spans pages of P = 3
SOFTCAP = 5.0  # a score mod keeps the call off the C kernel; a cap near the scores' size bites


class CacheFuzz(PagedCacheMachine):
    """``PagedCacheMachine`` at fuzz sizes: 6 sequences of up to 5 pages of 3 tokens compete for
    16 pages (the pool is full in ~6 % of states), fp32 pages, three tenants."""

    N, P, MAX_SEQS, MAX_PAGES = 16, 3, 6, 5
    DTYPE = torch.float32
    SALTS = (None, "a", "b")
    PROMPTS = ([], [0, 1, 2], [0, 1, 2, 2, 1, 0], [0, 1, 2, 0, 1, 2, 1], [2, 2, 2, 2, 2, 1, 0])

    def __init__(self, seen: Counter):
        super().__init__()
        self.seen = seen  # shared by every run of the test: counts only, never steers a run
        self.seen["runs"] += 1
        # A run's queries and check shapes follow from its own steps alone, so that hypothesis
        # replays (shrinks) a failing run exactly.
        self.g = torch.Generator().manual_seed(SEED)
        self.checks = 0

    # -- rules beyond the base machine's -----------------------------------------------------
    @rule(data=st.data())
    def truncate(self, data):
        if not self.seqs:
            return
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.cache.truncate(sid)
        self.seqs[sid] = []

    @rule(data=st.data())
    def cache_live(self, data):
        """Cache a sequence's full pages while it keeps decoding (its pages are pinned)."""
        if not self.seqs:
            return
        self.cache_it(data.draw(st.sampled_from(sorted(self.seqs))))

    @rule(data=st.data())
    def lookup_under_another_salt(self, data):
        """One salt's cached prefix looked up under another salt reuses only that salt's own
        pages (a miss unless it cached the same tokens itself)."""
        if not self.cached:
            return
        salt, prefix = data.draw(st.sampled_from(sorted(self.cached, key=repr)))
        other = data.draw(st.sampled_from([s for s in self.SALTS if s != salt]))
        tokens = [*prefix, 0]
        pages, n = self.cache.index.match(tokens, other)
        assert n == self.model_match(tokens, other)
        page, _ = self.pages_now()
        assert pages == [page[other, tuple(tokens[: (i + 1) * self.P])] for i in range(len(pages))]
        self.mark("other salt: miss" if n == 0 else "other salt: its own pages")

    @rule(data=st.data(), S=st.integers(1, 2))
    def decode(self, data, S):
        """A decode (or speculative) step of a batch through the layer's path: append and
        attend in one ``PagedCacheView.attend`` call, causal."""
        if not self.seqs:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, unique=True))
        new = [data.draw(st.lists(st.integers(0, 2), min_size=S, max_size=S)) for _ in ids]
        q = torch.randn(len(ids), HQ, S, D, generator=self.g).to(self.DTYPE)
        view, mask = self.cache.view(ids), masks.causal()
        ok, out = self.do_append(ids, new, lambda k, v: view.attend(q, k, v, mask=mask))
        if ok:
            self.mark("decode through PagedCacheView.attend")
            live = {s: self.seqs[s] for s in ids}
            assert_attention(self.cache, self.tabs, live, self.salt, q, mask=mask, out=out)

    # -- after every step --------------------------------------------------------------------
    @invariant()
    def paged_attention_equals_dense(self):
        """All live sequences in one ragged call; the shape cycles with the step count (moduli
        2, 3 and 5 are coprime, so every combination comes round every 30 steps)."""
        n = self.checks
        self.checks += 1
        self.seen["checks"] += 1
        if self.cache.pool.num_free == 0:
            self.mark("pool full")
        live = {s: t for s, t in self.seqs.items() if t}
        if not live:
            return
        Sq = min(1 + n % 5 % 3, *(len(t) for t in live.values()))
        mask = (None, masks.causal(), masks.sliding_window(WINDOW))[n % 3]
        score_mod = None if n % 2 else scores.softcap(SOFTCAP)  # C kernel / PyTorch path
        q = torch.randn(len(live), HQ, Sq, D, generator=self.g).to(self.DTYPE)
        assert_attention(self.cache, self.tabs, live, self.salt, q, mask=mask, score_mod=score_mod)

    def teardown(self):
        if sys.exc_info()[0] is not None:
            return  # a step failed: report that, not what it left behind
        for sid in list(self.seqs):
            self.cache.free(sid)
        index = self.cache.index
        assert index.num_evictable_pages == index.num_cached_pages
        index.evict(self.N)
        assert index.num_cached_pages == 0
        assert self.cache.pool.num_free == self.N, f"{self.N - self.cache.pool.num_free} leaked"
        self.cache.check()


def test_fuzz_paged_cache(monkeypatch, single_thread):
    seen: Counter = Counter()
    kernel = _decode_kernels.decode

    def counted(*args, **kw):
        seen["C kernel calls"] += 1
        return kernel(*args, **kw)

    monkeypatch.setattr(_decode_kernels, "decode", counted)

    @seed(SEED)
    def machine():
        return CacheFuzz(seen)

    t0 = time.perf_counter()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
    elapsed = time.perf_counter() - t0
    # Each run checks the invariants once before its first step and once after every step.
    steps = seen["checks"] - seen["runs"]
    print(f"fuzz seed {SEED}: {steps} operations in {seen['runs']} runs, {elapsed:.1f} s")
    print(dict(seen))
    assert steps >= MIN_STEPS, f"only {steps} operations ran; raise EXAMPLES or STEPS"
    # The fuzz did what it claims: full pools, evictions, copy-on-write, refusals, prefix hits.
    for what in (
        "pool full",
        "prefix hit",
        "write into a shared page (copy-on-write)",
        "append evicted cached pages",
        "append refused: pool full of live pages",
        "append refused: past max_len",
        "evict: several pages",
        "other salt: miss",
        "decode through PagedCacheView.attend",
    ):
        assert seen[what] > 0, (what, dict(seen))
    if _decode_kernels.library() is not None:
        assert seen["C kernel calls"] > 0
