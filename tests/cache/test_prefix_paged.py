"""PagedCache + PrefixIndex: a request reusing a cached prefix matches an unshared run exactly."""

from __future__ import annotations

import pytest
import torch

from selfattn.cache import PrefixIndex
from selfattn.cache.paged import PagedCache

P, HKV, HQ, D, DV, N_PAGES = 16, 2, 4, 8, 5, 12


def kv_of(tokens, start, table_k, table_v, pos_k, pos_v):
    """Deterministic K/V of tokens[start:]: a function of (token id, position) only.

    Returns ``k (1, Hkv, S, D)``, ``v (1, Hkv, S, Dv)``.
    """
    ids = torch.tensor(tokens[start:], dtype=torch.long)
    pos = torch.arange(start, len(tokens))
    k = table_k[ids] + pos_k[pos]  # (S, Hkv, D)
    v = table_v[ids] * pos_v[pos]  # (S, Hkv, Dv)
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (S, Hkv, ·) -> (1, Hkv, S, ·)


def make_cache():
    return PagedCache(N_PAGES, P, HKV, D, DV, max_seqs=3, max_pages_per_seq=4)


@pytest.fixture
def world():
    g = torch.Generator().manual_seed(1234)
    vocab = 53
    tables = (
        torch.randn(vocab, HKV, D, generator=g),
        torch.randn(vocab, HKV, DV, generator=g),
        torch.randn(64, HKV, D, generator=g),
        torch.randn(64, HKV, DV, generator=g),
    )
    tok_a = torch.randint(0, vocab, (40,), generator=g).tolist()
    tail = [(t + 1) % vocab for t in torch.randint(0, vocab, (10,), generator=g).tolist()]
    tok_b = tok_a[:35] + tail  # 45 tokens, the same first 35 as A
    tok_b[35] = (tok_a[35] + 7) % vocab  # make sure B diverges at token 35
    return tables, tok_a, tok_b, g


def test_shared_prefix_matches_unshared_run_and_frees_everything(world):
    tables, tok_a, tok_b, g = world
    cache = make_cache()
    index = PrefixIndex(cache.pool, cache.page_size)

    # Request A: prefill 40 tokens, cache its 2 full pages, finish.
    a = cache.add_sequence()
    cache.append(a, *kv_of(tok_a, 0, *tables))
    assert cache.cache_prefix(a, tok_a, index) == 2
    a_cached = cache.pages(a)[:2]
    cache.free(a)
    assert [cache.pool.refcount(p) for p in a_cached] == [1, 1]  # the index's reference only
    assert cache.pool.num_free == N_PAGES - 2
    k_before = cache.k_pages[a_cached].clone()
    v_before = cache.v_pages[a_cached].clone()

    # Request B: reuse 32 tokens, compute the 13 others.
    b, cached = cache.add_sequence_from_prefix(tok_b, index)
    assert cached == 32 and cache.length(b) == 32
    assert cache.pages(b) == a_cached
    assert [cache.pool.refcount(p) for p in a_cached] == [2, 2]  # index + B, not double counted
    cache.append(b, *kv_of(tok_b, cached, *tables))
    assert cache.length(b) == 45
    assert cache.pages(b)[:2] == a_cached  # page-aligned prefix: no copy-on-write needed
    assert not set(cache.pages(b)[2:]) & set(a_cached)  # B's own tokens went to fresh pages
    assert torch.equal(cache.k_pages[a_cached], k_before)
    assert torch.equal(cache.v_pages[a_cached], v_before)

    # Unshared run of B in a fresh cache.
    ref = make_cache()
    r = ref.add_sequence()
    ref.append(r, *kv_of(tok_b, 0, *tables))
    torch.testing.assert_close(ref.gather(r), cache.gather(b), rtol=0, atol=0)
    q = torch.randn(1, HQ, 13, D, generator=g)  # queries of B's 13 computed tokens
    out_shared = cache.attention(q, [b])
    out_plain = ref.attention(q, [r])
    assert out_shared.shape == (1, HQ, 13, DV)
    assert torch.isfinite(out_shared).all()
    assert torch.equal(out_shared, out_plain)

    # Teardown: B's references go exactly once; the index then holds the only ones.
    cache.free(b)
    assert [cache.pool.refcount(p) for p in a_cached] == [1, 1]
    assert sorted(index.evict(N_PAGES)) == sorted(a_cached)
    assert index.num_cached_pages == 0
    assert cache.pool.num_free == N_PAGES
    cache.check()
    cache.pool.check()


def test_no_hit_starts_an_empty_sequence(world):
    tables, tok_a, _, _ = world
    cache = make_cache()
    index = PrefixIndex(cache.pool, cache.page_size)
    s, cached = cache.add_sequence_from_prefix(tok_a, index, salt="tenant")
    assert (cached, cache.length(s), cache.pages(s)) == (0, 0, [])
    cache.append(s, *kv_of(tok_a, 0, *tables))
    assert cache.cache_prefix(s, tok_a, index, salt="tenant") == 2
    # Another salt never sees the tenant's pages.
    t, cached = cache.add_sequence_from_prefix(tok_a, index)
    assert cached == 0
    cache.free(s)
    cache.free(t)
    index.evict(N_PAGES)
    assert cache.pool.num_free == N_PAGES
    cache.check()


def test_errors_leave_no_references_behind(world):
    tables, tok_a, _, _ = world
    cache = make_cache()
    index = PrefixIndex(cache.pool, cache.page_size)
    a = cache.add_sequence()
    cache.append(a, *kv_of(tok_a, 0, *tables))
    cache.cache_prefix(a, tok_a, index)
    with pytest.raises(ValueError, match="token ids"):
        cache.cache_prefix(a, tok_a[:20], index)
    other = make_cache()
    with pytest.raises(ValueError, match="share this cache's pool"):
        cache.add_sequence_from_prefix(tok_a, PrefixIndex(other.pool, P))
    with pytest.raises(ValueError, match="share this cache's pool"):
        cache.add_sequence_from_prefix(tok_a, PrefixIndex(cache.pool, 8))
    with pytest.raises(TypeError, match="PrefixIndex"):
        cache.add_sequence_from_prefix(tok_a, object())
    cache.add_sequence()
    cache.add_sequence()  # max_seqs = 3 now live
    counts = [cache.pool.refcount(p) for p in range(N_PAGES)]
    with pytest.raises(RuntimeError, match="max_seqs"):
        cache.add_sequence_from_prefix(tok_a, index)
    assert [cache.pool.refcount(p) for p in range(N_PAGES)] == counts
