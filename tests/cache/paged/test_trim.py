"""PagedKV.trim: a speculative step's rejected tokens rolled back. Pages past the kept tokens
are freed, a shared page stays shared and is copied before the next write, the K/V of the kept
tokens (and of a sharer) are untouched, and the pool's counts stay exact."""

import pytest
import torch

from selfattn.cache import PagedKV

P = 4


def cache(num_pages=12, prefix_caching=False) -> PagedKV:
    return PagedKV(1, num_pages, P, 2, 8, max_seqs=4, max_pages_per_seq=6,
                   prefix_caching=prefix_caching)  # fmt: skip


def write(kv: PagedKV, seq_ids, n: int, seed: int):
    """Append ``n`` random tokens' K/V to each sequence; returns them ``(B, Hkv, n, D)``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(len(seq_ids), 2, n, 8, generator=g)
    v = torch.randn(len(seq_ids), 2, n, 8, generator=g)
    kv.write(0, kv.plan(seq_ids, n), k, v)
    return k, v


def test_trim_frees_the_pages_past_the_kept_tokens():
    kv = cache()
    a = kv.add_sequence()
    k, v = write(kv, [a], 11, seed=0)  # 3 pages
    kv.trim(a, 5)  # 2 pages hold 5 tokens
    assert kv.length(a) == 5 and len(kv.pages(a)) == 2 and kv.pool.num_free == 10
    kv.check()
    got_k, got_v = kv.gather(a)
    assert torch.equal(got_k, k[0, :, :5]) and torch.equal(got_v, v[0, :, :5])
    k2, _ = write(kv, [a], 7, seed=1)  # the next tokens go where the rejected ones were
    got_k, _ = kv.gather(a)
    assert torch.equal(got_k, torch.cat([k[0, :, :5], k2[0]], dim=1))
    kv.trim(a, 0)
    assert kv.pages(a) == [] and kv.pool.num_free == 12
    kv.check()


def test_trim_into_a_shared_page_copies_it_before_the_next_write():
    kv = cache()
    a = kv.add_sequence()
    k, _ = write(kv, [a], 7, seed=2)
    b = kv.fork(a)  # shares both pages
    kv.trim(b, 5)
    write(kv, [b], 3, seed=3)  # writes into the shared second page: copied first
    got_a, _ = kv.gather(a)
    assert torch.equal(got_a, k[0])  # the sharer's tokens untouched
    kv.check()
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free == 12
    kv.check()


def test_trim_refuses_bad_lengths_and_blocks_an_undo():
    kv = cache()
    a = kv.add_sequence()
    write(kv, [a], 6, seed=4)
    with pytest.raises(ValueError, match=r"cannot trim sequence 0 to 7 tokens: it holds 6"):
        kv.trim(a, 7)
    with pytest.raises(ValueError, match="-1 tokens"):
        kv.trim(a, -1)
    with pytest.raises(TypeError, match="trim length"):
        kv.trim(a, 2.0)
    plan = kv.plan([a], 2)
    kv.trim(a, 3)
    with pytest.raises(RuntimeError, match="only the latest plan"):
        kv.undo(plan)
    kv.check()
