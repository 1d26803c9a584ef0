"""The whole paged cache (pool + prefix index + copy-on-write forks + eviction) against
unshared runs: a seeded soak, and a hypothesis state machine against a plain-Python model."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from selfattn import attention, masks
from selfattn.cache import PagedCache

F64 = torch.float64
HQ, HKV, D, DV = 4, 2, 8, 6
VOCAB, MAX_POS = 23, 64


def tables(seed: int):
    """K/V as a function of (token id, position) only: a shared prefix page holds exactly what
    an unshared run of the same tokens computes."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(VOCAB, HKV, D, generator=g, dtype=F64),
        torch.randn(VOCAB, HKV, DV, generator=g, dtype=F64),
        torch.randn(MAX_POS, HKV, D, generator=g, dtype=F64),
        torch.randn(MAX_POS, HKV, DV, generator=g, dtype=F64),
    )


def kv(tabs, tokens, start: int = 0):
    """``k (1, Hkv, S, D)``, ``v (1, Hkv, S, Dv)`` of ``tokens[start:]`` at their positions."""
    tk, tv, pk, pv = tabs
    ids = torch.tensor(tokens[start:], dtype=torch.long)
    pos = torch.arange(start, len(tokens))
    k, v = tk[ids] + pk[pos], tv[ids] * pv[pos]  # (S, Hkv, ·)
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (S, Hkv, ·) -> (1, Hkv, S, ·)


def assert_contents(cache, tabs, seqs: dict[int, list[int]]) -> None:
    """Every live sequence holds its tokens' K/V; every cached page its prefix block's."""
    for sid, tokens in seqs.items():
        k, v = cache.gather(sid)
        want_k, want_v = kv(tabs, tokens)
        assert torch.equal(k, want_k[0]) and torch.equal(v, want_v[0]), f"sequence {sid}"
    P = cache.page_size
    for salt, prefix, page in cache.index.items():
        want_k, want_v = kv(tabs, list(prefix), len(prefix) - P)  # (1, Hkv, P, ·)
        assert torch.equal(cache.k_pages[page], want_k[0].transpose(0, 1)), (salt, prefix)
        assert torch.equal(cache.v_pages[page], want_v[0].transpose(0, 1)), (salt, prefix)


def assert_attention_unshared(cache, tabs, seqs: dict[int, list[int]], g) -> None:
    """Paged attention of each live sequence (ragged batch, chunked-prefill queries, causal)
    equals attention over the same tokens' K/V held contiguously and unshared."""
    ids = [s for s, t in seqs.items() if t]
    if not ids:
        return
    Sq = min(3, *(len(seqs[s]) for s in ids))
    q = torch.randn(len(ids), HQ, Sq, D, generator=g, dtype=F64)
    for mask in (None, masks.causal()):
        out = cache.attention(q, ids, mask=mask)
        for b, s in enumerate(ids):
            k, v = kv(tabs, seqs[s])
            want = attention(q[b : b + 1], k, v, mask=mask, backend="reference")
            torch.testing.assert_close(out[b : b + 1], want, rtol=1e-12, atol=1e-12)


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
        k, v = zip(*(kv(tabs, seqs[s] + t, len(seqs[s])) for s, t in zip(ids, new)))
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
        assert_contents(cache, tabs, seqs)
        if step % 20 == 0:
            assert_attention_unshared(cache, tabs, seqs, g)
    assert_attention_unshared(cache, tabs, seqs, g)
    # The soak did what it claims: 100% full, prefix hits, evictions, copy-on-write, refusals.
    assert all(seen[k] > 0 for k in ("full", "hits", "evicted", "cow")), seen
    for sid in list(seqs):
        finish(sid)
    assert cache.index.num_evictable_pages == cache.index.num_cached_pages
    cache.index.evict(N)
    assert cache.pool.num_free == N and cache.index.num_cached_pages == 0
    cache.check()


# -- stateful model check ----------------------------------------------------------------------
class PagedCacheMachine(RuleBasedStateMachine):
    """PagedCache + its PrefixIndex against a model: token lists per sequence, the set of cached
    (salt, prefix) keys with their last use. Page ids come from the cache; everything else
    (cached prefixes, LRU eviction order, contents, reference counts) is checked."""

    N, P, MAX_SEQS = 12, 2, 4

    def __init__(self):
        super().__init__()
        self.tabs = tables(3)
        self.cache = PagedCache(
            self.N, self.P, HKV, D, DV, max_seqs=self.MAX_SEQS, max_pages_per_seq=6,
            prefix_caching=True, dtype=F64,
        )  # fmt: skip
        self.seqs: dict[int, list[int]] = {}
        self.salt: dict[int, object] = {}
        self.cached: dict[tuple, int] = {}  # (salt, prefix tuple) -> tick of last use
        self.tick = 0

    # -- the model ---------------------------------------------------------------------------
    def touch(self, salt, tokens, n_pages):
        self.tick += 1
        for i in range(1, n_pages + 1):
            self.cached[salt, tuple(tokens[: i * self.P])] = self.tick

    def model_match(self, tokens, salt) -> int:
        n, limit = 0, max(len(tokens) - 1, 0) // self.P
        while n < limit and (salt, tuple(tokens[: (n + 1) * self.P])) in self.cached:
            n += 1
        self.touch(salt, tokens, n)
        return n * self.P

    def pages_now(self):
        page = {(s, p): pg for s, p, pg in self.cache.index.items()}
        return page, {p for s in self.seqs for p in self.cache.pages(s)}

    def model_evict(self, n, page=None, held=None):
        """The ``n`` keys LRU eviction takes: leaves held by no sequence, oldest (then
        deepest) first, a parent becoming a leaf once its children are gone."""
        if page is None:
            page, held = self.pages_now()
        keys, gone = [], set()
        for _ in range(n):
            leaves = [
                k
                for k in self.cached
                if k not in gone
                and page[k] not in held
                and not any(
                    o not in gone and o[0] == k[0] and o[1][: len(k[1])] == k[1] and o != k
                    for o in self.cached
                )
            ]
            if not leaves:
                break
            k = min(leaves, key=lambda k: (self.cached[k], -len(k[1])))
            keys.append(k)
            gone.add(k)
        return keys, [page[k] for k in keys]

    def do_append(self, ids, new):
        """Append, predicting which cached pages eviction takes from how many it took."""
        before, held = self.pages_now()
        lens = [len(self.seqs[s]) for s in ids]
        k, v = zip(*(kv(self.tabs, self.seqs[s] + t, len(self.seqs[s])) for s, t in zip(ids, new)))
        evictable = self.cache.index.num_evictable_pages
        for s in ids:
            n = len(self.seqs[s])
            if n % self.P and self.cache.pool.refcount(self.cache.pages(s)[-1]) > 1:
                event("write into a shared page (copy-on-write)")
        try:
            self.cache.append(ids, torch.cat(k), torch.cat(v))
        except RuntimeError:
            event("append refused: pool full of live pages")
            assert [len(self.seqs[s]) for s in ids] == lens
            assert self.cache.seq_lens(ids).tolist() == lens
            assert {(s, p): pg for s, p, pg in self.cache.index.items()} == before
            return
        except ValueError as e:  # max_len: nothing changed either
            assert "max_len" in str(e)
            assert self.cache.seq_lens(ids).tolist() == lens
            return
        after = {(s, p) for s, p, _ in self.cache.index.items()}
        lost = [key for key in before if key not in after]
        assert len(lost) <= evictable
        want, _ = self.model_evict(len(lost), before, held)
        assert set(lost) == set(want), (lost, want)
        if lost:
            event("append evicted cached pages")
        for key in lost:
            del self.cached[key]
        for s, t in zip(ids, new):
            self.seqs[s] += t

    # -- rules -------------------------------------------------------------------------------
    @rule(
        tokens=st.builds(
            lambda head, tail: head + tail,
            st.sampled_from([[], [0, 1], [0, 1, 2, 2], [0, 1, 2, 0, 1], [2, 2, 2, 2, 1]]),
            st.lists(st.integers(0, 2), max_size=4),
        ),
        salt=st.sampled_from([None, "s"]),
        cache_now=st.booleans(),
    )
    def start(self, tokens, salt, cache_now):
        if len(self.seqs) == self.MAX_SEQS:
            with pytest.raises(RuntimeError, match="max_seqs"):
                self.cache.add_sequence_from_prefix(tokens, salt=salt)
            return
        sid, cached = self.cache.add_sequence_from_prefix(tokens, salt=salt)
        assert cached == self.model_match(tokens, salt)
        if cached:
            event("prefix hit")
        self.seqs[sid], self.salt[sid] = list(tokens[:cached]), salt
        if len(tokens) > cached:
            self.do_append([sid], [tokens[cached:]])
        if cache_now:  # as an engine does right after prefill
            self.cache_it(sid)

    def cache_it(self, sid):
        tokens, salt = self.seqs[sid], self.salt[sid]
        self.cache.cache_prefix(sid, tokens, salt=salt)
        self.touch(salt, tokens, len(tokens) // self.P)

    # Rules without a sequence to act on return at once (rather than preconditions, which
    # make hypothesis give up whole runs when most rules are disabled).
    @rule(data=st.data())
    def fork(self, data):
        if not self.seqs or len(self.seqs) == self.MAX_SEQS:
            return
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child = self.cache.fork(parent)
        self.seqs[child], self.salt[child] = list(self.seqs[parent]), self.salt[parent]

    @rule(data=st.data(), S=st.integers(1, 3))
    def append(self, data, S):
        if not self.seqs:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, unique=True))
        new = [data.draw(st.lists(st.integers(0, 2), min_size=S, max_size=S)) for _ in ids]
        self.do_append(ids, new)

    @rule(data=st.data(), cache_it=st.booleans())
    def free(self, data, cache_it):
        if not self.seqs:
            return
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        if cache_it:
            self.cache_it(sid)
        del self.seqs[sid], self.salt[sid]
        self.cache.free(sid)

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        keys, pages = self.model_evict(n)
        assert self.cache.index.evict(n) == pages  # the same pages, in LRU order
        if len(pages) > 1:
            event("evict: several pages")
        for key in keys:
            del self.cached[key]

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def bookkeeping_matches_the_model(self):
        self.cache.check()  # refcount == holders, free + by sequences + index alone == total
        refs = [self.cache.pool.refcount(p) for p in range(self.N)]
        assert min(refs) >= 0
        assert self.cache.pool.num_free == refs.count(0)
        assert {(s, p) for s, p, _ in self.cache.index.items()} == set(self.cached)
        assert sorted(self.cache.seq_ids) == sorted(self.seqs)
        assert_contents(self.cache, self.tabs, self.seqs)


TestPagedCacheStateful = PagedCacheMachine.TestCase
TestPagedCacheStateful.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
