"""PagedCache: attention equals contiguous K/V, fork copy-on-write, capacity, exhaustion, free."""

from __future__ import annotations

import gc

import pytest
import torch

from selfattn import attention, masks
from selfattn.cache import BlockPool, PagedCache, PrefixIndex, StaticCache, paged_attention
from selfattn.nn import MultiHeadAttention
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention
from tests._cache_helpers import assert_same, snapshot

F64 = torch.float64


def make_cache(num_pages=16, P=4, Hkv=2, D=8, Dv=None, *, max_seqs=4, max_pages=6):
    return PagedCache(
        num_pages, P, Hkv, D, Dv, max_seqs=max_seqs, max_pages_per_seq=max_pages, dtype=F64
    )


def rnd(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


@pytest.mark.parametrize("P", [1, 16, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_attention_equals_contiguous_for_random_append_orders(P, seed):
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv, D, Dv, B = 6, 3, 7, 5, 3
    total = [int(x) for x in torch.randint(5, 41, (B,), generator=g)]
    cache = PagedCache(200, P, Hkv, D, Dv, max_seqs=B, max_pages_per_seq=-(-41 // P), dtype=F64)
    ids = [cache.add_sequence() for _ in range(B)]
    full_k = [rnd(g, Hkv, n, D) for n in total]
    full_v = [rnd(g, Hkv, n, Dv) for n in total]
    done = [0] * B
    # Interleave chunks of random sizes across sequences so their pages end up shuffled.
    while any(d < n for d, n in zip(done, total)):
        b = int(torch.randint(B, (1,), generator=g))
        if done[b] == total[b]:
            continue
        s = min(int(torch.randint(1, 9, (1,), generator=g)), total[b] - done[b])
        sl = slice(done[b], done[b] + s)
        cache.append(ids[b], full_k[b][None, :, sl], full_v[b][None, :, sl])
        done[b] += s
    cache.check()
    assert cache.seq_lens(ids).tolist() == total
    Sq = 3
    q = rnd(g, B, Hq, Sq, D)
    for mask in (None, masks.causal()):
        out = cache.attention(q, ids, mask=mask)
        for b in range(B):
            k, v = cache.gather(ids[b])
            torch.testing.assert_close(k, full_k[b], rtol=0, atol=0)
            torch.testing.assert_close(v, full_v[b], rtol=0, atol=0)
            want = attention(q[b : b + 1], full_k[b][None], full_v[b][None], mask=mask)
            torch.testing.assert_close(out[b : b + 1], want)


def test_attention_equals_static_cache_decode():
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, steps = 2, 4, 2, 8, 21
    static = StaticCache(B, steps, Hkv, D, dtype=F64)
    cache = make_cache(num_pages=12, P=4, Hkv=Hkv, D=D, max_pages=6)
    ids = [cache.add_sequence() for _ in range(B)]
    for _ in range(steps):
        q, k, v = rnd(g, B, Hq, 1, D), rnd(g, B, Hkv, 1, D), rnd(g, B, Hkv, 1, D)
        ks, vs = static.update(k, v)
        cache.append(ids, k, v)
        torch.testing.assert_close(cache.attention(q, ids), attention(q, ks, vs))


@pytest.mark.parametrize("prefix", [4, 6, 1, 8])  # P = 4: == page size, mid page, 2 pages
def test_fork_copy_on_write(prefix):
    g = torch.Generator().manual_seed(prefix)
    P, Hkv, D = 4, 2, 8
    cache = make_cache(num_pages=16, P=P, Hkv=Hkv, D=D)
    parent = cache.add_sequence()
    cache.append(parent, rnd(g, 1, Hkv, prefix, D), rnd(g, 1, Hkv, prefix, D))
    a = cache.fork(parent)
    b = cache.fork(parent)
    used_before = cache.pool.num_used
    assert cache.pages(a) == cache.pages(b) == cache.pages(parent)  # shared, not copied
    assert all(cache.pool.refcount(p) == 3 for p in cache.pages(parent))
    pk, pv = (t.clone() for t in cache.gather(parent))

    ka, va = rnd(g, 1, Hkv, 3, D), rnd(g, 1, Hkv, 3, D)
    cache.append(a, ka, va)
    if prefix % P == 0:  # the shared pages are full: the new tokens open a page, no copy
        assert cache.pages(a)[: prefix // P] == cache.pages(parent)
    else:  # the last, partly filled page was copied before the write
        assert cache.pages(a)[-2 if 3 > P - prefix % P else -1] not in cache.pages(parent)
        assert cache.pages(a)[: prefix // P] == cache.pages(parent)[: prefix // P]
    bk_before = [t.clone() for t in cache.gather(b)]
    kb, vb = rnd(g, 1, Hkv, 2, D), rnd(g, 1, Hkv, 2, D)
    cache.append(b, kb, vb)
    cache.check()
    assert cache.pool.num_used > used_before

    # The parent is unchanged; each child sees the prefix plus only its own tokens.
    k, v = cache.gather(parent)
    assert torch.equal(k, pk) and torch.equal(v, pv)
    k, v = cache.gather(a)
    assert torch.equal(k, torch.cat([pk, ka[0]], 1)) and torch.equal(v, torch.cat([pv, va[0]], 1))
    k, v = cache.gather(b)
    assert torch.equal(k, torch.cat([bk_before[0], kb[0]], 1))
    assert torch.equal(v, torch.cat([bk_before[1], vb[0]], 1))

    # Freeing the parent keeps the children's shared pages; freeing all empties the pool.
    cache.free(parent)
    cache.check()
    k, _ = cache.gather(a)
    assert torch.equal(k[:, :prefix], pk)
    cache.free(a)
    cache.free(b)
    cache.pool.check()
    assert cache.pool.num_free == cache.num_pages


def test_exactly_at_capacity_passes_one_more_raises():
    g = torch.Generator().manual_seed(5)
    P, Hkv, D, max_pages = 3, 1, 4, 3  # capacity 9 tokens per sequence
    cache = make_cache(num_pages=10, P=P, Hkv=Hkv, D=D, max_pages=max_pages)
    s = cache.add_sequence()
    cache.append(s, rnd(g, 1, Hkv, 7, D), rnd(g, 1, Hkv, 7, D))
    cache.append(s, rnd(g, 1, Hkv, 2, D), rnd(g, 1, Hkv, 2, D))  # exactly 9
    assert cache.length(s) == 9 == cache.max_len
    before = snapshot(cache, [s])
    with pytest.raises(ValueError, match=r"max_len = .*3 × 3 = 9"):
        cache.append(s, rnd(g, 1, Hkv, 1, D), rnd(g, 1, Hkv, 1, D))
    assert_same(snapshot(cache, [s]), before)
    cache.check()
    # The same holds for the pool: exactly all pages allocate, one more page raises.
    pool_cache = make_cache(num_pages=2, P=P, Hkv=Hkv, D=D, max_pages=max_pages)
    t = pool_cache.add_sequence()
    pool_cache.append(t, rnd(g, 1, Hkv, 6, D), rnd(g, 1, Hkv, 6, D))
    assert pool_cache.pool.num_free == 0
    with pytest.raises(RuntimeError, match="needs 1 free page"):
        pool_cache.append(t, rnd(g, 1, Hkv, 1, D), rnd(g, 1, Hkv, 1, D))


def test_pool_exhaustion_changes_nothing():
    g = torch.Generator().manual_seed(7)
    P, Hkv, D = 4, 2, 8
    cache = make_cache(num_pages=5, P=P, Hkv=Hkv, D=D)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a, b], rnd(g, 2, Hkv, 6, D), rnd(g, 2, Hkv, 6, D))  # 4 pages used
    c = cache.fork(a)  # shares a's partly filled page: a write into it needs a copy
    ids = [a, b, c]
    before = snapshot(cache, ids)
    # 3 more tokens each: a needs a CoW copy and a new page, b a new page: 3 > 1 free.
    with pytest.raises(RuntimeError, match=r"needs 3 free page\(s\) but the pool has 1"):
        cache.append([a, b], rnd(g, 2, Hkv, 3, D), rnd(g, 2, Hkv, 3, D))
    assert_same(snapshot(cache, ids), before)
    cache.check()
    cache.append(c, rnd(g, 1, Hkv, 1, D), rnd(g, 1, Hkv, 1, D))  # the one free page: CoW
    assert cache.pool.num_free == 0
    assert cache.pool.refcount(cache.pages(a)[-1]) == 1
    for s in ids:
        cache.free(s)
    cache.pool.check()
    assert cache.pool.num_free == cache.num_pages


def test_block_table_and_errors():
    g = torch.Generator().manual_seed(9)
    cache = make_cache(num_pages=8, P=2, Hkv=1, D=4, max_seqs=2, max_pages=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, rnd(g, 1, 1, 3, 4), rnd(g, 1, 1, 3, 4))
    table = cache.block_table([a, b])
    assert table.dtype == torch.int32 and table.shape == (2, 4)
    assert table[0, :2].tolist() == cache.pages(a) and (table[0, 2:] == -1).all()
    assert (table[1] == -1).all()
    assert cache.seq_lens([a, b]).tolist() == [3, 0]
    with pytest.raises(RuntimeError, match="max_seqs=2"):
        cache.add_sequence()
    with pytest.raises(RuntimeError, match="max_seqs=2"):
        cache.fork(a)
    with pytest.raises(ValueError, match="unknown sequence id 7"):
        cache.append(7, rnd(g, 1, 1, 1, 4), rnd(g, 1, 1, 1, 4))
    with pytest.raises(ValueError, match="repeat"):
        cache.append([a, a], rnd(g, 2, 1, 1, 4), rnd(g, 2, 1, 1, 4))
    with pytest.raises(ValueError, match=r"k must be \(B=1, Hkv=1, S, D=4\)"):
        cache.append(a, rnd(g, 1, 2, 1, 4), rnd(g, 1, 2, 1, 4))
    with pytest.raises(ValueError, match="page id 8 is out of range"):
        cache.pool.refcount(8)
    bad = cache.block_table([a])
    bad[0, 1] = 8  # a block id out of range in a used column
    q = rnd(g, 1, 1, 1, 4)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]=8 is out of range"):
        paged_attention(q, cache.k_pages, cache.v_pages, bad, cache.seq_lens([a]))
    cache.free(a)
    with pytest.raises(ValueError, match="unknown sequence id"):
        cache.free(a)
    cache.free(b)
    assert cache.pool.num_free == 8
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        PagedCache(4, 0, 1, 4, max_seqs=1, max_pages_per_seq=1)


def test_view_decode_through_layer_equals_full_forward():
    torch.manual_seed(11)
    B, S, d, H, Hkv, prefill = 2, 11, 24, 4, 2, 5
    layer = MultiHeadAttention(d, H, Hkv, dtype=F64).eval()
    x = torch.randn(B, S, d, dtype=F64)
    full = layer(x, mask=masks.causal())
    cache = make_cache(num_pages=12, P=3, Hkv=Hkv, D=d // H, max_pages=4)
    ids = [cache.add_sequence() for _ in range(B)]
    view = cache.view(ids)
    outs = [layer(x[:, :prefill], mask=masks.causal(), cache=view)]
    for t in range(prefill, S):
        outs.append(layer(x[:, t : t + 1], cache=view))
    assert view.length == S
    torch.testing.assert_close(torch.cat(outs, 1), full)
    with pytest.raises(ValueError, match="appends only"):
        view.update(*(torch.zeros(B, Hkv, 1, d // H, dtype=F64),) * 2, positions=[0])
    view.reset()
    assert view.length == 0 and cache.pool.num_free == cache.num_pages
    cache.append(ids[0], *(torch.zeros(1, Hkv, 1, d // H, dtype=F64),) * 2)
    with pytest.raises(ValueError, match="different lengths"):
        _ = view.length


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_fork_append_free_matches_shadow_model(seed):
    """Random add/fork/append/free against plain per-sequence tensors; check() after each op."""
    g = torch.Generator().manual_seed(seed)
    P, Hkv, D = 3, 1, 2
    cache = make_cache(num_pages=12, P=P, Hkv=Hkv, D=D, max_seqs=5, max_pages=5)
    shadow: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(60):
        op = int(torch.randint(4, (1,), generator=g))
        live = sorted(shadow)
        pick = live[int(torch.randint(len(live), (1,), generator=g))] if live else None
        try:
            if op == 0 or pick is None:
                shadow[cache.add_sequence()] = (rnd(g, Hkv, 0, D), rnd(g, Hkv, 0, D))
            elif op == 1:
                shadow[cache.fork(pick)] = shadow[pick]
            elif op == 2:
                s = int(torch.randint(1, 5, (1,), generator=g))
                k, v = rnd(g, 1, Hkv, s, D), rnd(g, 1, Hkv, s, D)
                cache.append(pick, k, v)
                sk, sv = shadow[pick]
                shadow[pick] = (torch.cat([sk, k[0]], 1), torch.cat([sv, v[0]], 1))
            else:
                cache.free(pick)
                del shadow[pick]
        except (RuntimeError, ValueError) as e:  # full pool / max_seqs / max_len: no change
            assert "max_seqs" in str(e) or "free page" in str(e) or "max_len" in str(e)
        cache.check()
        for sid, (sk, sv) in shadow.items():
            k, v = cache.gather(sid)
            assert torch.equal(k, sk) and torch.equal(v, sv)
    for sid in list(shadow):
        cache.free(sid)
    assert cache.pool.num_free == cache.num_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, F64])
@pytest.mark.parametrize("P", [1, 16, 128])
def test_paged_equals_contiguous_every_dtype_and_page_size(P, dtype):
    """Ragged lengths (none a multiple of P), pages in shuffled order, each dtype: paged
    attention is as close to the fp64 oracle on the contiguous K/V as the naive formula is."""
    g = torch.Generator().manual_seed(P * 7 + dtype.itemsize)
    Hq, Hkv, D, Dv, Sq = 4, 2, 8, 5, 3
    total = {1: [5, 23, 9], 16: [17, 45, 3], 128: [130, 37, 201]}[P]
    max_pages = -(-max(total) // P)
    cache = PagedCache(
        3 * max_pages + 4, P, Hkv, D, Dv, max_seqs=4, max_pages_per_seq=max_pages, dtype=dtype
    )
    ids = cache.add_sequences(3)
    full = [(rnd(g, Hkv, n, D).to(dtype), rnd(g, Hkv, n, Dv).to(dtype)) for n in total]
    done = [0, 0, 0]
    filler = cache.add_sequence()  # takes pages between the others, then frees them: holes
    while done != total:
        b = int(torch.randint(3, (1,), generator=g))
        s = min(int(torch.randint(1, P + 3, (1,), generator=g)), total[b] - done[b])
        k, v = full[b]
        cache.append(ids[b], k[None, :, done[b] : done[b] + s], v[None, :, done[b] : done[b] + s])
        done[b] += s
        if cache.length(filler) < P * 2 and s:
            cache.append(filler, *(torch.zeros(1, Hkv, 1, d, dtype=dtype) for d in (D, Dv)))
    cache.free(filler)
    cache.check()
    pages = [p for i in ids for p in cache.pages(i)]
    assert pages != sorted(pages) or P == 128  # the layout really is shuffled
    q = rnd(g, 3, Hq, Sq, D).to(dtype)
    for mask in (None, masks.causal()):
        out = cache.attention(q, ids, mask=mask)
        for b, (k, v) in enumerate(full):
            args = (q[b : b + 1], k[None], v[None])
            oracle = reference_attention(*args, mask=mask)[0]
            naive = naive_attention(*args, mask=mask)[0]
            assert_close_to_reference(out[b : b + 1], oracle, naive, what=f"seq {b} {mask}")


def test_cow_last_writer_reuses_the_page():
    """Every sharer of a partly filled page writes in one batch: all but the last copy it, the
    last finds itself its only holder and writes in place (no extra copy, nothing leaks)."""
    g = torch.Generator().manual_seed(21)
    P, Hkv, D = 4, 2, 8
    cache = make_cache(num_pages=10, P=P, Hkv=Hkv, D=D, max_seqs=5)
    parent = cache.add_sequence()
    cache.append(parent, rnd(g, 1, Hkv, 6, D), rnd(g, 1, Hkv, 6, D))  # pages [full, partial]
    a, b = cache.fork(parent), cache.fork(parent)
    shared = cache.pages(parent)[1]
    prefix = cache.gather(parent)
    k, v = rnd(g, 3, Hkv, 1, D), rnd(g, 3, Hkv, 1, D)
    cache.append([parent, a, b], k, v)
    assert cache.pool.num_used == 4  # 2 before, + 2 copies, not 3
    assert cache.pages(b)[1] == shared and cache.pool.refcount(shared) == 1
    assert len({cache.pages(s)[1] for s in (parent, a, b)}) == 3
    for i, s in enumerate((parent, a, b)):
        ks, vs = cache.gather(s)
        assert torch.equal(ks, torch.cat([prefix[0], k[i]], 1))
        assert torch.equal(vs, torch.cat([prefix[1], v[i]], 1))
    cache.check()
    # A holder outside the batch keeps the page: both writers in the batch copy.
    c, d = cache.fork(a), cache.fork(a)
    cache.append([c, d], rnd(g, 2, Hkv, 1, D), rnd(g, 2, Hkv, 1, D))
    assert cache.pages(a)[1] not in (cache.pages(c)[1], cache.pages(d)[1])
    assert cache.pool.refcount(cache.pages(a)[1]) == 1
    cache.check()
    for s in (parent, a, b, c, d):
        cache.free(s)
    assert cache.pool.num_free == cache.num_pages


def test_append_evicts_cached_pages_under_pressure():
    g = torch.Generator().manual_seed(22)
    P, Hkv, D = 2, 1, 4
    cache = PagedCache(
        6, P, Hkv, D, max_seqs=3, max_pages_per_seq=8, prefix_caching=True, dtype=F64
    )
    old = cache.add_sequence()
    cache.append(old, rnd(g, 1, Hkv, 6, D), rnd(g, 1, Hkv, 6, D))
    assert cache.cache_prefix(old, list(range(6)), salt=None) == 3
    cached = cache.pages(old)
    cache.free(old)  # its 3 pages stay cached: index-only, evictable
    cache.check()
    assert cache.pool.num_free == 3 and cache.index.num_evictable_pages == 3
    s = cache.add_sequence()
    before = snapshot(cache, [s])
    with pytest.raises(RuntimeError, match=r"needs 7 free page.*has 3 of 6 \(\+3 evictable"):
        cache.append(s, rnd(g, 1, Hkv, 13, D), rnd(g, 1, Hkv, 13, D))
    assert_same(snapshot(cache, [s]), before)
    assert cache.index.num_cached_pages == 3
    cache.append(s, rnd(g, 1, Hkv, 9, D), rnd(g, 1, Hkv, 9, D))  # 5 pages: evicts 2, deepest
    assert cache.pool.num_free == 0 and cache.index.num_cached_pages == 1
    assert cache.index.match([*range(6), 0]) == (cached[:1], P)
    cache.check()
    cache.free(s)
    cache.index.evict(6)
    assert cache.pool.num_free == 6
    cache.check()


def test_check_counts_the_index_references():
    g = torch.Generator().manual_seed(23)
    cache = PagedCache(8, 2, 1, 4, max_seqs=2, max_pages_per_seq=4, prefix_caching=True)
    s = cache.add_sequence()
    cache.append(s, torch.randn(1, 1, 5, 4, generator=g), torch.randn(1, 1, 5, 4, generator=g))
    cache.cache_prefix(s, [1, 2, 3, 4, 5])
    cache.check()  # pages of s: counts 2, 2 (s + index) and 1 (s alone)
    page = cache.pages(s)[0]
    cache.pool.decref([page])  # a reference lost behind the cache's back
    with pytest.raises(AssertionError, match=f"page {page}: pool count 1, held by 2"):
        cache.check()
    cache.pool.incref([page, page])
    with pytest.raises(AssertionError, match=f"page {page}: pool count 3, held by 2"):
        cache.check()


def test_prefix_and_sequence_errors():
    cache = make_cache(num_pages=8, P=2, Hkv=1, D=4, max_seqs=3)
    with pytest.raises(ValueError, match="no prefix index: build it with prefix_caching=True"):
        cache.add_sequence_from_prefix([1, 2, 3])
    index = PrefixIndex(cache.pool, 2)
    cache.add_sequence_from_prefix([1, 2, 3], index)  # adopted as cache.index
    assert cache.index is index
    with pytest.raises(ValueError, match="already uses another PrefixIndex"):
        cache.cache_prefix(0, [], PrefixIndex(cache.pool, 2))
    with pytest.raises(RuntimeError, match="cannot add 3 sequences: 1 of max_seqs=3 are live"):
        cache.add_sequences(3)
    assert cache.seq_ids == [0]
    with pytest.raises(ValueError, match="add_sequences n must be a positive int, got 0"):
        cache.add_sequences(0)


def test_pool_listeners_and_view_errors():
    pool = BlockPool(4)
    with pytest.raises(TypeError, match="listener must be callable as fn\\(pages\\), got int"):
        pool.add_listener(3)
    heard = []
    pool.add_listener(heard.append)
    pages = pool.allocate(2)
    pool.incref(pages[:1])
    pool.decref([pages[0], pages[0], pages[1]])
    assert heard == [[pages[0]], [pages[0], pages[1]]]
    index = PrefixIndex(pool, 2)  # listens through a weak reference: dropping it is enough
    del index
    gc.collect()
    pool.incref(pool.allocate(1))
    assert len(pool._listeners) == 1
    cache = make_cache(num_pages=4, P=2, Hkv=1, D=4)
    view = cache.view(cache.add_sequences(2))
    q, k = torch.zeros(2, 2, 3, 4, dtype=F64), torch.zeros(2, 1, 2, 4, dtype=F64)
    with pytest.raises(
        ValueError, match=r"one new token per query: q \(2, 2, 3, 4\), k \(2, 1, 2, 4\)"
    ):
        view.attend(q, k, k)
    assert view.lengths.tolist() == [0, 0]
