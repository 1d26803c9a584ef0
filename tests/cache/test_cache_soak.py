"""The whole paged cache (pool + prefix index + copy-on-write forks + eviction) against
unshared runs: a seeded soak, and a hypothesis state machine against a plain-Python model."""

from __future__ import annotations

import random

import torch
from hypothesis import settings

from selfattn import masks
from selfattn.cache import PagedCache
from tests._cache_helpers import (
    DV,
    F64,
    HKV,
    HQ,
    VOCAB,
    D,
    PagedCacheMachine,
    assert_attention,
    assert_contents,
    kv,
    tables,
)


def assert_attention_unshared(cache, tabs, seqs, salts, g) -> None:
    """Paged attention of each live sequence (ragged batch, chunked-prefill queries, causal or
    not) equals attention over the same tokens' K/V held contiguously and unshared."""
    live = {s: t for s, t in seqs.items() if t}
    if not live:
        return
    Sq = min(3, *(len(t) for t in live.values()))
    q = torch.randn(len(live), HQ, Sq, D, generator=g, dtype=F64)
    for mask in (None, masks.causal()):
        assert_attention(cache, tabs, live, salts, q, mask=mask)


def test_soak_pool_prefix_forks_eviction_against_unshared_runs():
    rng = random.Random(7)
    g = torch.Generator().manual_seed(7)
    tabs = tables(7)
    P, N = 4, 36
    cache = PagedCache(
        N, P, HKV, D, DV, max_seqs=6, max_pages_per_seq=12, prefix_caching=True, dtype=F64
    )
    system = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 9, 13)]
    seqs: dict[int, list[int]] = {}
    salts: dict[int, object] = {}
    seen = dict(full=0, hits=0, evicted=0, cow=0, refused=0)

    def finish(sid):
        if rng.random() < 0.7:
            cache.cache_prefix(sid, seqs[sid], salt=salts[sid])
        cache.free(sid)
        del seqs[sid], salts[sid]

    def append(ids, S, new=None):
        new = new or [[rng.randrange(VOCAB) for _ in range(S)] for _ in ids]
        k, v = zip(*(kv(tabs, seqs[s] + t, len(seqs[s]), salts[s]) for s, t in zip(ids, new)))
        shared = sum(
            cache.length(s) % P != 0 and cache.pool.refcount(cache.pages(s)[-1]) > 1 for s in ids
        )
        cached = cache.index.num_cached_pages
        try:
            cache.append(ids, torch.cat(k), torch.cat(v))
        except RuntimeError as e:  # pool full of live pages: nothing changed
            assert "free page" in str(e)
            seen["refused"] += 1
            return False
        seen["cow"] += shared
        seen["evicted"] += cached - cache.index.num_cached_pages
        for s, t in zip(ids, new):
            seqs[s] += t
        return True

    for step in range(200):
        live = list(seqs)
        op = rng.random()
        if op < 0.3 or not live:  # a request: reuse the longest cached prefix, prefill the rest
            if len(seqs) == cache.max_seqs:
                finish(rng.choice(live))
            tokens = rng.choice(system) + [rng.randrange(VOCAB) for _ in range(rng.randrange(8))]
            salt = rng.choice([None, None, "tenant"])
            sid, cached = cache.add_sequence_from_prefix(tokens, salt=salt)
            seqs[sid], salts[sid] = tokens[:cached], salt
            seen["hits"] += cached > 0
            if not append([sid], len(tokens) - cached, [tokens[cached:]]):
                cache.free(sid)
                del seqs[sid], salts[sid]
                if seqs:
                    finish(rng.choice(list(seqs)))
            elif rng.random() < 0.8:  # cache the prompt right after prefill, as engines do
                cache.cache_prefix(sid, seqs[sid], salt=salt)
        elif op < 0.45 and len(seqs) < cache.max_seqs:  # fork: pages shared, diverge later
            parent = rng.choice(live)
            child = cache.fork(parent)
            seqs[child], salts[child] = list(seqs[parent]), salts[parent]
        elif op < 0.85:  # decode or chunked prefill for a batch (forks of one parent together)
            ids = rng.sample(live, rng.randint(1, min(3, len(live))))
            if not append(ids, rng.choice([1, 1, 2, 3])):
                finish(rng.choice(live))
        else:
            finish(rng.choice(live))
        seen["full"] += cache.pool.num_free == 0
        cache.check()  # free + used by sequences + held by the index alone == total
        assert_contents(cache, tabs, seqs, salts)
        if step % 20 == 0:
            assert_attention_unshared(cache, tabs, seqs, salts, g)
    assert_attention_unshared(cache, tabs, seqs, salts, g)
    # The soak did what it claims: 100% full, prefix hits, evictions, copy-on-write, refusals.
    assert all(seen[k] > 0 for k in ("full", "hits", "evicted", "cow")), seen
    for sid in list(seqs):
        finish(sid)
    assert cache.index.num_evictable_pages == cache.index.num_cached_pages
    cache.index.evict(N)
    assert cache.pool.num_free == N and cache.index.num_cached_pages == 0
    cache.check()


# -- stateful model check ----------------------------------------------------------------------
TestPagedCacheStateful = PagedCacheMachine.TestCase
TestPagedCacheStateful.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
