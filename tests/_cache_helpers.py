"""Shared by the paged-cache checks (tests/test_cache_soak.py, test_cache_fuzz.py,
test_paged_cache.py): K/V as a function of what a token is, the contents and attention checks
against it, snapshots for "a failed call changes nothing", and a hypothesis state machine over
``PagedCache`` + its ``PrefixIndex`` against a plain-Python model."""

from __future__ import annotations

import functools
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from selfattn.cache import PagedCache
from selfattn.testing import assert_close_to_reference, naive_attention, reference_attention

F64 = torch.float64
HQ, HKV, D, DV = 4, 2, 8, 6
VOCAB, MAX_POS = 23, 64


def tables(seed: int):
    """K/V as a function of (token id, position, salt) only: a shared prefix page holds exactly
    what an unshared run of the same tokens under the same salt computes (see :func:`kv`)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(VOCAB, HKV, D, generator=g, dtype=F64),
        torch.randn(VOCAB, HKV, DV, generator=g, dtype=F64),
        torch.randn(MAX_POS, HKV, D, generator=g, dtype=F64),
        torch.randn(MAX_POS, HKV, DV, generator=g, dtype=F64),
    )


@functools.cache
def _salt_offsets(salt) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a salt adds to every K/V row (a tenant's adapter, say); None for the shared tenant.
    Seeded by the salt's repr, so a run repeats whatever PYTHONHASHSEED is."""
    if salt is None:
        return None
    g = torch.Generator().manual_seed(zlib.crc32(repr(salt).encode()))
    return torch.randn(HKV, D, generator=g, dtype=F64), torch.randn(HKV, DV, generator=g, dtype=F64)


def kv(tabs, tokens, start: int = 0, salt=None):
    """``k (1, Hkv, S, D)``, ``v (1, Hkv, S, Dv)`` of ``tokens[start:]`` at their positions.

    Another salt gives other K/V for the same tokens, so a page served across salts reads back
    wrong (the checks below see it), as it would in a real multi-tenant cache."""
    tk, tv, pk, pv = tabs
    ids = torch.tensor(tokens[start:], dtype=torch.long)
    pos = torch.arange(start, len(tokens))
    k, v = tk[ids] + pk[pos], tv[ids] * pv[pos]  # (S, Hkv, ·)
    off = _salt_offsets(salt)
    if off is not None:
        k, v = k + off[0], v + off[1]
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (S, Hkv, ·) -> (1, Hkv, S, ·)


def assert_contents(cache, tabs, seqs: dict[int, list[int]], salts: dict[int, object]) -> None:
    """Every live sequence reads back its tokens' K/V and every cached page its prefix block's,
    bitwise (the cache stores them in its dtype: compared after the same rounding)."""
    dt = cache.k_pages.dtype
    for sid, tokens in seqs.items():
        k, v = cache.gather(sid)
        want_k, want_v = kv(tabs, tokens, salt=salts[sid])
        assert torch.equal(k, want_k[0].to(dt)) and torch.equal(v, want_v[0].to(dt)), sid
    P = cache.page_size
    for salt, prefix, page in cache.index.items():
        want_k, want_v = kv(tabs, list(prefix), len(prefix) - P, salt)  # (1, Hkv, P, ·)
        assert torch.equal(cache.k_pages[page], want_k[0].transpose(0, 1).to(dt)), (salt, prefix)
        assert torch.equal(cache.v_pages[page], want_v[0].transpose(0, 1).to(dt)), (salt, prefix)


def assert_attention(cache, tabs, seqs, salts, q, *, mask=None, score_mod=None, out=None):
    """Paged attention of ``q (B, Hq, Sq, D)`` over the sequences ``seqs`` (ids in order,
    ragged) equals the fp64 reference on each sequence's own K/V held contiguously and
    unshared (as stored: rounded to the cache's dtype), by the ratio rule. ``out`` is a result
    computed already (e.g. by ``PagedCacheView.attend``); by default ``cache.attention``."""
    ids = list(seqs)
    if out is None:
        out = cache.attention(q, ids, mask=mask, score_mod=score_mod)
    dt = cache.k_pages.dtype
    for b, s in enumerate(ids):
        k, v = (t.to(dt) for t in kv(tabs, seqs[s], salt=salts[s]))
        args, kw = (q[b : b + 1], k, v), {"mask": mask, "score_mod": score_mod}
        oracle, naive = reference_attention(*args, **kw)[0], naive_attention(*args, **kw)[0]
        what = f"sequence {s} ({len(seqs[s])} tokens), Sq={q.shape[2]}, {mask}, {score_mod}"
        assert_close_to_reference(out[b : b + 1], oracle, naive, what=what)


def snapshot(cache, ids=None):
    """Everything a failed call must leave unchanged (of ``ids``; by default every sequence)."""
    ids = cache.seq_ids if ids is None else ids
    index = None if cache.index is None else sorted(cache.index.items(), key=repr)
    return (
        cache.block_table(ids).clone(),
        cache.seq_lens(ids).clone(),
        [cache.pool.refcount(p) for p in range(cache.num_pages)],
        cache.pool.num_free,
        cache.k_pages.clone(),
        cache.v_pages.clone(),
        index,
    )


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


# -- stateful model check ----------------------------------------------------------------------
class PagedCacheMachine(RuleBasedStateMachine):
    """PagedCache + its PrefixIndex against a model: token lists per sequence, the set of cached
    (salt, prefix) keys with their last use. Page ids come from the cache; everything else
    (cached prefixes, LRU eviction order, contents, reference counts) is checked. Subclasses
    change the sizes and dtype through the class attributes.

    ``self.seen`` counts what happened (as hypothesis ``event``s do), so a test can assert
    that a run really reached a full pool, evicted, copied on write, refused an append."""

    N, P, MAX_SEQS, MAX_PAGES = 12, 2, 4, 6
    DTYPE = F64
    SALTS = (None, "s")
    PROMPTS = ([], [0, 1], [0, 1, 2, 2], [0, 1, 2, 0, 1], [2, 2, 2, 2, 1])

    def __init__(self):
        super().__init__()
        self.tabs = tables(3)
        self.cache = PagedCache(
            self.N, self.P, HKV, D, DV, max_seqs=self.MAX_SEQS, max_pages_per_seq=self.MAX_PAGES,
            prefix_caching=True, dtype=self.DTYPE,
        )  # fmt: skip
        self.seqs: dict[int, list[int]] = {}
        self.salt: dict[int, object] = {}
        self.cached: dict[tuple, int] = {}  # (salt, prefix tuple) -> tick of last use
        self.tick = 0
        self.seen: Counter = Counter()

    def mark(self, what: str) -> None:
        event(what)
        self.seen[what] += 1

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

    def do_append(self, ids, new, call=None):
        """Append ``new[i]`` to sequence ``ids[i]`` with ``call(k, v)`` (default
        ``cache.append(ids, k, v)``), predicting which cached pages eviction takes from how
        many it took. Returns ``(True, call's result)``, or ``(False, None)`` when the append
        was refused, after checking that it changed nothing at all."""
        before, held = self.pages_now()
        state = snapshot(self.cache)
        rows = [
            kv(self.tabs, self.seqs[s] + t, len(self.seqs[s]), self.salt[s])
            for s, t in zip(ids, new)
        ]
        k = torch.cat([r[0] for r in rows]).to(self.DTYPE)  # B × (1, Hkv, S, D) -> (B, Hkv, S, D)
        v = torch.cat([r[1] for r in rows]).to(self.DTYPE)
        evictable = self.cache.index.num_evictable_pages
        for s in ids:
            n = len(self.seqs[s])
            if n % self.P and self.cache.pool.refcount(self.cache.pages(s)[-1]) > 1:
                self.mark("write into a shared page (copy-on-write)")
        try:
            result = (call or (lambda k, v: self.cache.append(ids, k, v)))(k, v)
        except RuntimeError as e:
            assert "free page" in str(e), e
            self.mark("append refused: pool full of live pages")
            assert_same(snapshot(self.cache), state)
            return False, None
        except ValueError as e:  # past max_len: nothing changed either
            assert "max_len" in str(e), e
            self.mark("append refused: past max_len")
            assert_same(snapshot(self.cache), state)
            return False, None
        after = {(s, p) for s, p, _ in self.cache.index.items()}
        lost = [key for key in before if key not in after]
        assert len(lost) <= evictable
        want, _ = self.model_evict(len(lost), before, held)
        assert set(lost) == set(want), (lost, want)
        if lost:
            self.mark("append evicted cached pages")
        for key in lost:
            del self.cached[key]
        for s, t in zip(ids, new):
            self.seqs[s] += t
        return True, result

    # -- rules -------------------------------------------------------------------------------
    @rule(data=st.data(), cache_now=st.booleans())
    def start(self, data, cache_now):
        """A request: a shared system prompt (or none) and a tail of its own."""
        tokens = data.draw(st.sampled_from(self.PROMPTS)) + data.draw(
            st.lists(st.integers(0, 2), max_size=4)
        )
        salt = data.draw(st.sampled_from(self.SALTS))
        if len(self.seqs) == self.MAX_SEQS:
            with pytest.raises(RuntimeError, match="max_seqs"):
                self.cache.add_sequence_from_prefix(tokens, salt=salt)
            return
        sid, cached = self.cache.add_sequence_from_prefix(tokens, salt=salt)
        assert cached == self.model_match(tokens, salt)
        if cached:
            self.mark("prefix hit")
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
        if not self.seqs:
            return
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        if len(self.seqs) == self.MAX_SEQS:
            with pytest.raises(RuntimeError, match="max_seqs"):
                self.cache.fork(parent)
            return
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
            self.mark("evict: several pages")
        for key in keys:
            del self.cached[key]

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def bookkeeping_matches_the_model(self):
        self.cache.check()  # refcount == holders, free + by sequences + index alone == total
        refs = [self.cache.pool.refcount(p) for p in range(self.N)]
        assert min(refs) >= 0
        assert self.cache.pool.num_free == refs.count(0)
        page, held = self.pages_now()
        # No leak: a page is in use exactly when a live sequence or the index holds it.
        assert {p for p, r in enumerate(refs) if r} == held | set(page.values())
        assert set(page) == set(self.cached)
        assert sorted(self.cache.seq_ids) == sorted(self.seqs)
        assert_contents(self.cache, self.tabs, self.seqs, self.salt)
