"""PrefixIndex: page-granular prefix reuse, salts, LRU eviction, and a stateful model check."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from selfattn.cache import BlockPool, PrefixIndex


def run_request(index, tokens, salt=None):
    """Acquire the cached prefix, allocate the rest, 'prefill', insert; returns (hit, pages)."""
    hit = index.acquire(tokens, salt)
    P = index.page_size
    need = -(-len(tokens) // P) - len(hit.pages)
    pages = hit.pages + index.allocate_with_eviction(need)
    index.insert(tokens, pages, salt)
    return hit, pages


# -- prefix reuse ------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 3, 4])
def test_longest_prefix_reuse_is_page_granular(P):
    rng = random.Random(P)
    pool = BlockPool(64)
    index = PrefixIndex(pool, P)
    base = [rng.randrange(50) for _ in range(6 * P - 1)]  # 5 full pages + a partial one
    hit, pages = run_request(index, base)
    assert (hit.cached_tokens, hit.computed_tokens) == (0, len(base))
    assert index.num_cached_pages == 5  # the partial last page is never cached
    index.release(pages)

    for keep in range(len(base) + 1):  # share the first `keep` tokens, then diverge
        tokens = base[:keep] + [99] * (2 * P)
        got, n = index.match(tokens)
        assert n == (keep // P) * P, keep
        assert got == pages[: keep // P]

    # Sharing a partial page is impossible: one differing token in page 2 stops reuse there.
    tokens = list(base)
    tokens[2 * P + P - 1] += 1
    assert index.match(tokens) == (pages[:2], 2 * P)


def test_fully_cached_prompt_leaves_one_token_to_compute():
    P = 4
    pool = BlockPool(16)
    index = PrefixIndex(pool, P)
    tokens = list(range(3 * P))  # exactly 3 full pages
    _, pages = run_request(index, tokens)
    index.release(pages)
    hit = index.acquire(tokens)
    assert hit.pages == pages[:2]
    assert (hit.cached_tokens, hit.computed_tokens) == (2 * P, P)
    index.release(hit.pages)
    # One token more: all three pages reused, one token computed.
    hit = index.acquire([*tokens, 7])
    assert (hit.pages, hit.cached_tokens, hit.computed_tokens) == (pages, 3 * P, 1)
    assert index.match([]) == ([], 0)
    assert index.match(tokens[:1]) == ([], 0)


def test_insert_keeps_existing_page_for_duplicate_blocks():
    pool = BlockPool(16)
    index = PrefixIndex(pool, 2)
    tokens = [1, 2, 3, 4, 5]
    a = pool.allocate(3)
    b = pool.allocate(3)  # a second request computed the same prefix concurrently
    assert index.insert(tokens, a) == 2
    assert index.insert(tokens, b) == 0
    assert index.match([*tokens, 6]) == (a[:2], 4)
    freed = index.release(b)
    assert sorted(freed) == sorted(b)  # the duplicates are not cached, so they free at once
    index.release(a)
    assert pool.num_used == 2 and index.num_cached_pages == 2
    pool.check()


def test_tensor_tokens_and_salt_isolation():
    P = 2
    pool = BlockPool(32)
    index = PrefixIndex(pool, P)
    tokens = torch.randint(0, 9, (7,), generator=torch.Generator().manual_seed(1))
    _, pages = run_request(index, tokens, salt="tenant-a")
    index.release(pages)
    assert index.match(tokens, salt="tenant-a") == (pages[:3], 6)
    assert index.match(tokens.tolist()) == ([], 0)  # salt None is another tree
    assert index.match(tokens, salt="tenant-b") == ([], 0)
    _, other = run_request(index, tokens, salt="tenant-b")
    assert set(other).isdisjoint(pages[:3])  # the partial page 3 was freed and reused
    assert index.num_cached_pages == 6


# -- eviction ----------------------------------------------------------------------------------
def test_eviction_is_lru_over_leaves_and_cascades_to_parents():
    P = 2
    pool = BlockPool(12)
    index = PrefixIndex(pool, P)
    seqs = {name: [i] * P + [10 + i] * P for i, name in enumerate("abc")}  # 2 pages each
    pages = {}
    for name in "abc":
        _, pages[name] = run_request(index, seqs[name])
        index.release(pages[name])
    index.match(seqs["a"] + [0])  # use a again: b is now the least recently used
    assert index.evict(1) == [pages["b"][1]]  # the leaf first, never its parent
    assert index.evict(1) == [pages["b"][0]]  # now the parent is a leaf, and still oldest
    assert index.evict(2) == [pages["c"][1], pages["c"][0]]
    assert index.match(seqs["a"] + [0]) == (pages["a"], 2 * P)
    assert index.num_evictable_pages == 2


def test_pages_in_use_are_never_evicted():
    P = 3
    pool = BlockPool(8)
    index = PrefixIndex(pool, P)
    _, pages = run_request(index, list(range(2 * P)))  # still holds its 2 pages
    _, other = run_request(index, [7] * (2 * P))
    index.release(other)
    assert index.num_evictable_pages == 2
    assert sorted(index.evict(10)) == sorted(other)
    assert index.evict(10) == [] and index.num_cached_pages == 2
    assert all(pool.refcount(p) == 2 for p in pages)
    # 6 free pages; 7 cannot be made even with eviction: nothing changes.
    with pytest.raises(RuntimeError, match="cannot allocate 7 pages: 6 free and 0 evictable"):
        index.allocate_with_eviction(7)
    assert pool.num_free == 6 and index.num_cached_pages == 2
    index.release(pages)
    assert len(index.allocate_with_eviction(7)) == 7  # evicts exactly one (the leaf)
    assert index.num_cached_pages == 1
    pool.check()


def test_eviction_heap_stays_bounded_and_tracks_pool_changes():
    """Evictable leaves are tracked incrementally: uses re-queue a leaf (stale entries are
    compacted away), and a page released by its last request becomes evictable at once."""
    P = 2
    pool = BlockPool(40)
    index = PrefixIndex(pool, P)
    prompts = [[i, i, 7, 7] for i in range(10)]  # 10 two-page paths under 10 roots' children
    held = []
    for tokens in prompts:
        _, pages = run_request(index, tokens)
        held.append(pages)
    assert index.num_evictable_pages == 0 and index.evict(5) == []  # all in use
    for pages in held[::2]:
        index.release(pages)  # the listener hears each page drop to the index's reference
    assert index.num_evictable_pages == 10
    rng = random.Random(3)
    for _ in range(500):  # many uses: each pushes a fresh heap entry for a leaf
        index.match([*rng.choice(prompts), 0])
    assert len(index._heap) <= 2 * index.num_cached_pages + 64
    index.check()
    last = {i: rng.random() for i in range(0, 10, 2)}
    for i in sorted(last, key=last.get):  # a known order of last use
        index.match(prompts[i] + [0])
    order = sorted(last, key=last.get)
    assert index.evict(4) == [
        held[order[0]][1],
        held[order[0]][0],
        held[order[1]][1],
        held[order[1]][0],
    ]
    index.check()


def test_allocate_with_eviction_is_atomic_when_short():
    pool = BlockPool(5)
    index = PrefixIndex(pool, 1)
    _, pages = run_request(index, [1, 2, 3])
    index.release(pages)  # all 3 pages stay cached (page_size 1: all full), 2 free
    before = (pool.num_free, index.num_cached_pages, [pool.refcount(p) for p in range(5)])
    with pytest.raises(RuntimeError, match="cannot allocate 6 pages: 2 free and 3 evictable"):
        index.allocate_with_eviction(6)
    assert before == (pool.num_free, index.num_cached_pages, [pool.refcount(p) for p in range(5)])


# -- bad input ---------------------------------------------------------------------------------
def test_errors_name_the_offending_values():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        PrefixIndex(pool, 0)
    with pytest.raises(TypeError, match="page_size must be an int, got float"):
        PrefixIndex(pool, 2.0)
    with pytest.raises(TypeError, match="pool must be a BlockPool, got list"):
        PrefixIndex([], 2)
    index = PrefixIndex(pool, 2)
    with pytest.raises(TypeError, match=r"salt must be hashable .* got list"):
        index.match([1, 2, 3], salt=["a"])
    with pytest.raises(TypeError, match=r"token id must be an int, got float 1\.5"):
        index.match([1, 1.5])
    with pytest.raises(ValueError, match=r"tokens must be 1-D, got shape \(2, 2\)"):
        index.match(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="5 tokens fill 2 pages of 2 but only 1 pages"):
        index.insert([1, 2, 3, 4, 5], pool.allocate(1))
    with pytest.raises(ValueError, match=r"page 3 .* is free"):
        index.insert([1, 2], [3])
    with pytest.raises(ValueError, match="n_pages must be >= 0, got -1"):
        index.evict(-1)
    with pytest.raises(ValueError, match="allocate n must be >= 0, got -2"):
        index.allocate_with_eviction(-2)
    a = pool.allocate(1)
    index.insert([1, 2], a)
    with pytest.raises(ValueError, match=f"page {a[0]} .* already caches a different block"):
        index.insert([5, 6], a)
    assert index.num_cached_pages == 1
    pool.check()


# -- soak --------------------------------------------------------------------------------------
def test_soak_fills_pool_with_shared_prefixes_then_returns_every_page():
    rng = random.Random(5)
    P, N = 3, 41
    pool = BlockPool(N)
    index = PrefixIndex(pool, P)
    system = [[rng.randrange(100) for _ in range(rng.choice([3, 6, 7]))] for _ in range(4)]
    live: list[list[int]] = []
    full_seen = cached_seen = 0
    for _ in range(400):
        tokens = rng.choice(system) + [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        hit = index.acquire(tokens, salt=rng.choice([None, None, "x"]))
        need = -(-len(tokens) // P) - len(hit.pages)
        try:
            pages = hit.pages + index.allocate_with_eviction(need)
        except RuntimeError:  # full with live requests: finish the oldest and go on
            index.release(hit.pages)
            index.release(live.pop(0))
            continue
        cached_seen += hit.cached_tokens > 0
        index.insert(tokens, pages, salt=None)
        live.append(pages)
        full_seen += pool.num_free == 0
        if len(live) > 6 or rng.random() < 0.3:
            index.release(live.pop(rng.randrange(len(live))))
        pool.check()
        assert pool.num_free + pool.num_used == N
    assert full_seen > 0 and cached_seen > 0  # the soak reached 100% and really shared
    for pages in live:
        index.release(pages)
    assert index.num_evictable_pages == index.num_cached_pages
    index.evict(N)
    assert pool.num_free == N and index.num_cached_pages == 0
    pool.check()


# -- stateful model check ----------------------------------------------------------------------
class PrefixMachine(RuleBasedStateMachine):
    """Pool + index against a flat model: cached prefixes as a dict keyed by (salt, blocks)."""

    N, P = 10, 2

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(self.N)
        self.index = PrefixIndex(self.pool, self.P)
        self.cache: dict[tuple, int] = {}  # (salt, (block, ...)) -> page
        self.used: dict[tuple, int] = {}  # same key -> tick of last use
        self.tick = 0
        self.requests: list[tuple[list[int], object, list[int]]] = []  # tokens, salt, pages

    # -- the model ---------------------------------------------------------------------------
    def blocks(self, tokens, n):
        return tuple(tuple(tokens[i * self.P : (i + 1) * self.P]) for i in range(n))

    def held(self):
        return {p for _, _, pages in self.requests for p in pages}

    def model_match(self, tokens, salt):
        limit = max(len(tokens) - 1, 0) // self.P
        n = 0
        while n < limit and (salt, self.blocks(tokens, n + 1)) in self.cache:
            n += 1
        keys = [(salt, self.blocks(tokens, i + 1)) for i in range(n)]
        self.tick += 1
        for k in keys:
            self.used[k] = self.tick
        return [self.cache[k] for k in keys]

    def model_evictable(self):
        held = self.held()
        bad = {k for k, p in self.cache.items() if p in held}
        # A key is evictable (eventually) unless it or a descendant is held.
        return [
            k
            for k in self.cache
            if not any(b[0] == k[0] and b[1][: len(k[1])] == k[1] for b in bad)
        ]

    def model_evict(self, n):
        held, freed = self.held(), []
        while len(freed) < n:
            leaves = [
                k
                for k, p in self.cache.items()
                if p not in held
                and not any(
                    o[0] == k[0] and len(o[1]) == len(k[1]) + 1 and o[1][:-1] == k[1]
                    for o in self.cache
                )
            ]
            if not leaves:
                break
            k = min(leaves, key=lambda k: (self.used[k], -len(k[1])))
            freed.append(self.cache.pop(k))
            del self.used[k]
        return freed

    # -- rules -------------------------------------------------------------------------------
    @rule(
        tokens=st.builds(
            lambda head, tail: head + tail,
            st.sampled_from([[], [0, 1], [0, 1, 2, 2], [0, 1, 2, 0, 1, 1], [2, 2, 2, 2]]),
            st.lists(st.integers(0, 2), max_size=5),
        ),
        salt=st.sampled_from([None, "s"]),
    )
    def start_request(self, tokens, salt):
        hit = self.index.acquire(tokens, salt)
        expect = self.model_match(tokens, salt)
        assert hit.pages == expect
        assert hit.cached_tokens == len(expect) * self.P
        assert hit.computed_tokens == len(tokens) - hit.cached_tokens
        need = -(-len(tokens) // self.P) - len(expect)
        self.requests.append((tokens, salt, list(expect)))  # held from here on
        room = self.pool.num_free + len(self.model_evictable())
        if need > room:
            with pytest.raises(RuntimeError):
                self.index.allocate_with_eviction(need)
            return
        short = max(need - self.pool.num_free, 0)
        self.model_evict(short)  # the invariant then checks the index evicted the same pages
        fresh = self.index.allocate_with_eviction(need)
        assert len(fresh) == need
        self.requests[-1][2].extend(fresh)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), cache_it=st.booleans())
    def finish_request(self, data, cache_it):
        i = data.draw(st.integers(0, len(self.requests) - 1))
        tokens, salt, pages = self.requests[i]
        n_full = len(tokens) // self.P
        if cache_it and len(pages) >= n_full:
            self.index.insert(tokens, pages, salt)
            self.tick += 1
            for j in range(n_full):
                k = (salt, self.blocks(tokens, j + 1))
                self.cache.setdefault(k, pages[j])
                self.used[k] = self.tick
        self.requests.pop(i)
        self.index.release(pages)

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        expect = self.model_evict(n)
        assert self.index.evict(n) == expect

    @rule(n=st.integers(0, 4))
    def allocate_and_drop(self, n):
        room = self.pool.num_free + len(self.model_evictable())
        if n > room:
            with pytest.raises(RuntimeError):
                self.index.allocate_with_eviction(n)
            return
        self.model_evict(max(n - self.pool.num_free, 0))
        self.pool.free(self.index.allocate_with_eviction(n))

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def bookkeeping_matches_the_model(self):
        self.pool.check()
        assert self.pool.num_free + self.pool.num_used == self.N
        cached = set(self.cache.values())
        assert len(cached) == len(self.cache)  # one block per page
        holds: dict[int, int] = {}
        for _, _, pages in self.requests:
            for p in pages:
                holds[p] = holds.get(p, 0) + 1
        for p in range(self.N):
            want = (p in cached) + holds.get(p, 0)
            assert self.pool.refcount(p) == want, (p, want)
        assert self.pool.num_used == len(cached | set(holds))
        assert self.index.num_cached_pages == len(self.cache)
        assert self.index.num_evictable_pages == len(self.model_evictable())
        self.index.check()  # pin counters and the eviction heap agree with a full walk


TestPrefixStateful = PrefixMachine.TestCase
TestPrefixStateful.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
