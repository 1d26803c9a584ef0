"""``PagedCache``: a per-layer KV cache stored in fixed-size pages shared through a block pool.

Keys and values live in one pool of pages per layer, ``k_pages (N, P, Hkv, D)`` and
``v_pages (N, P, Hkv, Dv)``. Each sequence owns an ordered list of page ids; token ``t`` of a
sequence sits in slot ``t % P`` of its page number ``t // P``::

    pages of seq 0 = [3, 0]      P = 4, length 6
    token position   0 1 2 3 | 4 5 · ·
    page             3       | 0          (· = free slot, written by the next append)

:meth:`PagedCache.fork` shares every page of a sequence with a new one (a reference more per
page in the :class:`~selfattn.cache.pool.BlockPool`, nothing copied). Copy-on-write happens at
the first write into a shared page: only the last, partly filled page is ever written, so an
append whose sequence shares that page first copies it to a fresh page, unless the sharers
that copied it away in the same batch left it to this sequence alone (then it writes in place:
one copy per sharer but the last). A shared prefix that ends exactly on a page boundary is
never copied: the next token opens a new page.

With a prefix index (``prefix_caching=True``, :mod:`selfattn.cache.prefix`), full pages of
finished or prefilled sequences stay cached for later requests, and an append short of free
pages evicts the least recently used of those the index alone holds.

Every change is planned and validated before anything is touched: an append that would exceed
a sequence's ``max_pages_per_seq × P`` tokens or the free (plus evictable) pages raises and
leaves pages, block tables, lengths, reference counts and the index as they were.
"""

from __future__ import annotations

import torch

from selfattn._validate import positive_int
from selfattn.cache.decode import paged_attention
from selfattn.cache.pool import BlockPool
from selfattn.cache.prefix import PrefixIndex
from selfattn.functional import attention_weights
from selfattn.masks import And, Mask, Not, TensorMask, as_mask, from_tensor
from selfattn.scores import Bias, Compose, ScoreMod, as_score_mod

__all__ = ["PagedCache", "PagedCacheView"]


class PagedCache:
    """A page pool for one layer, with per-sequence page lists and lengths.

    ``PagedCache(num_pages, page_size, n_kv_heads, head_dim, value_dim=None, *, max_seqs,
    max_pages_per_seq, dtype, device)``. ``num_pages`` (N) pages of ``page_size`` (P) tokens;
    at most ``max_seqs`` live sequences, each at most ``max_pages_per_seq`` pages long (the
    width of :meth:`block_table`). Sequence ids are ints handed out by :meth:`add_sequence` and
    :meth:`fork`; they are never reused.

    ``prefix_caching=True`` builds ``cache.index``, a :class:`PrefixIndex` over the pool (one
    passed to :meth:`add_sequence_from_prefix` / :meth:`cache_prefix` is adopted the same way).
    With an index, :meth:`append` evicts least-recently-used cached pages when the pool runs
    short, and :meth:`check` counts the index's references.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        n_kv_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        max_seqs: int,
        max_pages_per_seq: int,
        prefix_caching: bool = False,
        dtype=torch.float32,
        device=None,
    ):
        positive_int(num_pages, "PagedCache num_pages")
        positive_int(page_size, "PagedCache page_size")
        positive_int(n_kv_heads, "PagedCache n_kv_heads")
        positive_int(head_dim, "PagedCache head_dim")
        value_dim = (
            head_dim if value_dim is None else positive_int(value_dim, "PagedCache value_dim")
        )
        positive_int(max_seqs, "PagedCache max_seqs")
        positive_int(max_pages_per_seq, "PagedCache max_pages_per_seq")
        fk = {"dtype": dtype, "device": device}
        self.k_pages = torch.zeros(num_pages, page_size, n_kv_heads, head_dim, **fk)
        self.v_pages = torch.zeros(num_pages, page_size, n_kv_heads, value_dim, **fk)
        self.pool = BlockPool(num_pages)
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0
        self.index: PrefixIndex | None = None
        if prefix_caching:
            self.index = PrefixIndex(self.pool, page_size)

    # -- shape facts ------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def max_len(self) -> int:
        """Tokens one sequence can hold: ``max_pages_per_seq × page_size``."""
        return self.max_pages_per_seq * self.page_size

    @property
    def seq_ids(self) -> list[int]:
        return list(self._pages)

    def pages(self, seq_id: int) -> list[int]:
        """The page ids of ``seq_id`` in token order (a copy)."""
        return list(self._pages[self._check_id(seq_id)])

    def length(self, seq_id: int) -> int:
        return self._lens[self._check_id(seq_id)]

    def _check_id(self, seq_id) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise TypeError(f"sequence ids are ints, got {type(seq_id).__name__} {seq_id!r}")
        if seq_id not in self._pages:
            raise ValueError(
                f"unknown sequence id {seq_id}; live ids are {sorted(self._pages)} (use "
                "add_sequence() or fork())"
            )
        return seq_id

    def _ids(self, seq_ids) -> list[int]:
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        for s in ids:
            self._check_id(s)
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids {ids} repeat a sequence; list each sequence once")
        return ids

    # -- sequences --------------------------------------------------------------------------------
    def _new_id(self) -> int:
        if len(self._pages) >= self.max_seqs:
            raise RuntimeError(
                f"cannot add a sequence: all max_seqs={self.max_seqs} are live; free one first "
                "or build the cache with a larger max_seqs"
            )
        sid = self._next_id
        self._next_id += 1
        return sid

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        sid = self._new_id()
        self._pages[sid], self._lens[sid] = [], 0
        return sid

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every page (and the length) of ``seq_id``; returns its id.

        Nothing is copied: each page gains a reference, and the first write into a shared page
        by either sequence copies that page first (copy-on-write).
        """
        self._check_id(seq_id)
        sid = self._new_id()
        self._pages[sid] = self.pool.fork(self._pages[seq_id])
        self._lens[sid] = self._lens[seq_id]
        return sid

    def add_sequences(self, n: int) -> list[int]:
        """``n`` new empty sequences (all or none); returns their ids."""
        positive_int(n, "add_sequences n")
        if len(self._pages) + n > self.max_seqs:
            raise RuntimeError(
                f"cannot add {n} sequences: {len(self._pages)} of max_seqs={self.max_seqs} are "
                "live; free some first or build the cache with a larger max_seqs"
            )
        return [self.add_sequence() for _ in range(n)]

    def add_sequence_from_prefix(
        self, tokens, index: PrefixIndex | None = None, salt=None
    ) -> tuple[int, int]:
        """A new sequence starting from ``index``'s longest cached prefix of ``tokens``.

        Returns ``(seq_id, cached_tokens)``: the sequence's pages are the reused ones and its
        length is ``cached_tokens`` (a multiple of ``page_size``), so the caller appends only
        the K/V of ``tokens[cached_tokens:]``. ``index`` defaults to ``cache.index``; one given
        must be built on this cache's pool and page size (``PrefixIndex(cache.pool,
        cache.page_size)``) and becomes ``cache.index``. The references that
        :meth:`PrefixIndex.acquire` takes become the sequence's own: :meth:`free` drops each
        exactly once, and the index keeps its separate reference. The next append opens a fresh
        page (the prefix ends on a page boundary), so shared pages are never written.
        """
        index = self._use_index(index)
        sid = self._new_id()  # before acquire: a full cache must not leak the references
        hit = index.acquire(tokens, salt)
        if len(hit.pages) > self.max_pages_per_seq:
            self.pool.decref(hit.pages)
            raise ValueError(
                f"the cached prefix spans {len(hit.pages)} pages but a sequence holds at most "
                f"max_pages_per_seq={self.max_pages_per_seq}; build a larger cache"
            )
        self._pages[sid], self._lens[sid] = list(hit.pages), hit.cached_tokens
        return sid, hit.cached_tokens

    def cache_prefix(self, seq_id: int, tokens, index: PrefixIndex | None = None, salt=None) -> int:
        """Offer the full pages of ``seq_id`` to ``index``; returns how many became cached.

        ``tokens`` are the token ids whose K/V the sequence holds (at least ``length(seq_id)``
        of them; the rest are ignored). The index (default ``cache.index``) takes its own
        reference per newly cached page, so :meth:`free` stays correct.
        """
        index = self._use_index(index)
        n = self._lens[self._check_id(seq_id)]
        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if len(ids) < n:
            raise ValueError(
                f"sequence {seq_id} holds {n} tokens but only {len(ids)} token ids were given; "
                "pass the ids of every cached token"
            )
        full = self._pages[seq_id][: n // self.page_size]
        return index.insert(ids[:n], full, salt)

    def _use_index(self, index) -> PrefixIndex:
        """``index`` checked and adopted as ``self.index``, or ``self.index`` when None."""
        if index is None:
            if self.index is None:
                raise ValueError(
                    "this cache has no prefix index: build it with prefix_caching=True or pass "
                    "index=PrefixIndex(cache.pool, cache.page_size)"
                )
            return self.index
        if not isinstance(index, PrefixIndex):
            raise TypeError(f"index must be a PrefixIndex, got {type(index).__name__}")
        if index.pool is not self.pool or index.page_size != self.page_size:
            raise ValueError(
                "index must share this cache's pool and page size; build it as "
                "PrefixIndex(cache.pool, cache.page_size)"
            )
        if self.index is not None and index is not self.index:
            raise ValueError(
                "this cache already uses another PrefixIndex (cache.index); one index per cache, "
                "so that append's eviction and check() see every cached page"
            )
        self.index = index
        return index

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id`` and its references; pages no other sequence shares become free."""
        self._check_id(seq_id)
        self.pool.free(self._pages[seq_id])
        del self._pages[seq_id], self._lens[seq_id]

    def truncate(self, seq_id: int) -> None:
        """Empty ``seq_id`` (length 0, its page references dropped) but keep it live."""
        self._check_id(seq_id)
        self.pool.free(self._pages[seq_id])
        self._pages[seq_id], self._lens[seq_id] = [], 0

    # -- writes -----------------------------------------------------------------------------------
    def append(self, seq_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``S`` new tokens after the cached ones of each sequence in ``seq_ids``.

        ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` with ``B = len(seq_ids)`` (an int id is a
        batch of one). Pages are allocated as needed; a shared last page is copied first. Raises
        ValueError past a sequence's ``max_len`` and RuntimeError when the pool has too few free
        pages, in both cases before changing anything.
        """
        ids = self._ids(seq_ids)
        B = len(ids)
        _, P, Hkv, D = self.k_pages.shape
        Dv = self.v_pages.shape[3]
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError(f"k and v must be tensors, got {type(k).__name__}, {type(v).__name__}")
        if k.dim() != 4 or tuple(k.shape[:2]) != (B, Hkv) or k.shape[3] != D:
            raise ValueError(
                f"k must be (B={B}, Hkv={Hkv}, S, D={D}) for {B} sequence(s), got {tuple(k.shape)}"
            )
        S = k.shape[2]
        if tuple(v.shape) != (B, Hkv, S, Dv):
            raise ValueError(f"v must be (B={B}, Hkv={Hkv}, S={S}, Dv={Dv}), got {tuple(v.shape)}")
        if S == 0 or B == 0:
            return
        # Plan: per sequence, does its last page need a copy, and how many new pages? Holders
        # of a shared page that copy it away leave fewer behind: when every sharer writes in
        # this batch, the last one finds itself the sole holder and writes in place.
        n_new, cow = [], []
        holders: dict[int, int] = {}
        for s in ids:
            n = self._lens[s]
            if n + S > self.max_len:
                raise ValueError(
                    f"sequence {s} holds {n} tokens; {S} more exceed its capacity max_len = "
                    f"max_pages_per_seq × page_size = {self.max_pages_per_seq} × {P} = "
                    f"{self.max_len}; build the cache with a larger max_pages_per_seq"
                )
            copy = False
            if n % P:  # the last page is partly filled: the write goes into it
                last = self._pages[s][-1]
                left = holders.setdefault(last, self.pool.refcount(last))
                copy = left > 1
                holders[last] = left - copy
            cow.append(copy)
            n_new.append(-(-(n + S) // P) - len(self._pages[s]) + int(copy))
        need = sum(n_new)
        evictable = 0 if self.index is None else self.index.num_evictable_pages
        if need > self.pool.num_free + evictable:
            raise RuntimeError(
                f"appending {S} token(s) to sequences {ids} needs {need} free page(s) but the "
                f"pool has {self.pool.num_free} of {self.num_pages} (+{evictable} evictable "
                "cached); free sequences or build a larger pool"
            )
        fresh = self._allocate(need)  # cannot fail now: checked above
        slots = []
        for s, copy, m in zip(ids, cow, n_new):
            mine, fresh = fresh[:m], fresh[m:]
            pages, n = self._pages[s], self._lens[s]
            if copy:
                # Copy-on-write: the shared last page goes to a fresh page this sequence owns.
                old, new = pages[-1], mine.pop(0)
                self.k_pages[new].copy_(self.k_pages[old])
                self.v_pages[new].copy_(self.v_pages[old])
                self.pool.decref([old])
                pages[-1] = new
            pages.extend(mine)
            pos = range(n, n + S)
            slots.extend(pages[t // P] * P + t % P for t in pos)
            self._lens[s] = n + S
        idx = torch.tensor(slots, dtype=torch.long, device=self.k_pages.device)  # (B·S,)
        kf = self.k_pages.view(-1, Hkv, D)  # (N, P, Hkv, D) -> (N·P, Hkv, D)
        vf = self.v_pages.view(-1, Hkv, Dv)
        kf.index_copy_(0, idx, k.transpose(1, 2).reshape(B * S, Hkv, D).to(kf))  # (B·S, Hkv, D)
        vf.index_copy_(0, idx, v.transpose(1, 2).reshape(B * S, Hkv, Dv).to(vf))

    def _allocate(self, n: int) -> list[int]:
        """``n`` fresh pages, evicting least-recently-used cached pages when the pool is short."""
        if self.index is None:
            return self.pool.allocate(n)
        return self.index.allocate_with_eviction(n)

    # -- reads ------------------------------------------------------------------------------------
    def block_table(self, seq_ids) -> torch.Tensor:
        """``(B, max_pages_per_seq)`` int32 page ids of each sequence in order; -1 past them."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        table = torch.full((len(ids), self.max_pages_per_seq), -1, dtype=torch.int32)
        for b, s in enumerate(ids):
            pages = self._pages[self._check_id(s)]
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table.to(self.k_pages.device)

    def seq_lens(self, seq_ids) -> torch.Tensor:
        """``(B,)`` int32 valid tokens per sequence."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        lens = [self._lens[self._check_id(s)] for s in ids]
        return torch.tensor(lens, dtype=torch.int32, device=self.k_pages.device)

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies ``(Hkv, length, D)``, ``(Hkv, length, Dv)`` of one sequence."""
        self._check_id(seq_id)
        n = self._lens[seq_id]
        ids = torch.tensor(self._pages[seq_id], dtype=torch.long, device=self.k_pages.device)
        k = self.k_pages.index_select(0, ids).flatten(0, 1)[:n]  # (pages·P, Hkv, D) -> (n, ·)
        v = self.v_pages.index_select(0, ids).flatten(0, 1)[:n]
        return k.transpose(0, 1), v.transpose(0, 1)  # (n, Hkv, ·) -> (Hkv, n, ·)

    def attention(self, q: torch.Tensor, seq_ids, *, mask=None, score_mod=None, scale=None):
        """:func:`~selfattn.cache.decode.paged_attention` of ``q (B, Hq, Sq, D)`` over the pages.

        The ``Sq`` queries of sequence ``b`` are its last ``Sq`` cached tokens (append them
        first); returns ``(B, Hq, Sq, Dv)``.
        """
        ids = self._ids(seq_ids)
        return paged_attention(
            q,
            self.k_pages,
            self.v_pages,
            self.block_table(ids),
            self.seq_lens(ids),
            mask=mask,
            score_mod=score_mod,
            scale=scale,
        )

    def view(self, seq_ids) -> PagedCacheView:
        """The layer cache contract over ``seq_ids`` (see :class:`PagedCacheView`)."""
        return PagedCacheView(self, self._ids(seq_ids))

    def check(self) -> None:
        """Raise AssertionError unless every page's pool count equals its holders.

        Holders are the sequences listing the page plus ``cache.index`` when it caches it. So
        ``free + used by sequences + held by the index alone == num_pages``, no count is
        negative, and no page is both free and referenced (the pool's own check).
        """
        self.pool.check()
        if self.index is not None:
            self.index.check()
        refs = [0] * self.num_pages
        for s, pages in self._pages.items():
            if len(pages) != -(-self._lens[s] // self.page_size):
                raise AssertionError(f"sequence {s}: {len(pages)} pages for {self._lens[s]} tokens")
            for p in pages:
                refs[p] += 1
        by_seqs = sum(r > 0 for r in refs)
        index_only = 0
        if self.index is not None:
            for p in self.index.cached_pages():
                index_only += refs[p] == 0
                refs[p] += 1
        for p, r in enumerate(refs):
            if self.pool.refcount(p) != r:
                raise AssertionError(f"page {p}: pool count {self.pool.refcount(p)}, held by {r}")
        if self.pool.num_free + by_seqs + index_only != self.num_pages:
            raise AssertionError(
                f"free {self.pool.num_free} + used by sequences {by_seqs} + held by the index "
                f"alone {index_only} != total {self.num_pages}"
            )

    def __repr__(self) -> str:
        N, P, Hkv, D = self.k_pages.shape
        return (
            f"PagedCache(num_pages={N}, page_size={P}, n_kv_heads={Hkv}, head_dim={D}, "
            f"seqs={len(self._pages)}, free_pages={self.pool.num_free})"
        )


class PagedCacheView:
    """DESIGN.md's cache contract over a fixed batch of a :class:`PagedCache`'s sequences.

    Pass it as ``MultiHeadAttention(..., cache=cache.view(seq_ids))`` (one :class:`PagedCache`
    per layer; row ``b`` of the layer's batch is sequence ``seq_ids[b]``). The layer then calls
    :meth:`attend`: this step's K/V are appended after each sequence's OWN length and
    :func:`~selfattn.cache.decode.paged_attention` reads the pages in place, so the sequences
    may have different lengths (ragged)::

        seq_ids = [4, 9]   lengths before the step 5, 2;   Sq = 2 new tokens each
        seq 4   keys 0 1 2 3 4 [5 6]    queries at positions 5, 6
        seq 9   keys 0 1 [2 3]          queries at positions 2, 3   ([·] = appended now)

    Queries are bottom-right per sequence, masks and score mods see those absolute positions,
    and the layer's RoPE positions default to ``lengths[b] + arange(Sq)`` per sequence. Bool
    tensor masks and bias tensors are read in query-row order (row ``i`` = new token ``i``),
    columns by key position. :meth:`update` is the plain contract (append, then contiguous
    K/V) for callers that attend themselves; it needs equal lengths. ``reset()`` empties the
    sequences (their page references dropped), keeping their ids.

    A decoder stack, one cache per layer, prefill then decode::

        caches = [PagedCache(N, P, Hkv, D, max_seqs=B, max_pages_per_seq=M) for _ in layers]
        views = [c.view(c.add_sequences(B)) for c in caches]
        h = layer(h, mask=masks.causal(), cache=views[i])   # x (B, Sq, d): Sq > 1 or 1
    """

    def __init__(self, cache: PagedCache, seq_ids: list[int]):
        self.cache = cache
        self.seq_ids = list(seq_ids)

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` int64 cached tokens of each sequence, on the cache's device."""
        return self.cache.seq_lens(self.seq_ids).long()

    @property
    def length(self) -> int:
        """The common length of the sequences (raises ValueError when they differ)."""
        lens = {self.cache.length(s) for s in self.seq_ids}
        if len(lens) > 1:
            raise ValueError(
                f"sequences {self.seq_ids} have different lengths "
                f"{[self.cache.length(s) for s in self.seq_ids]}; use .lengths for ragged "
                "batches (MultiHeadAttention handles them through attend())"
            )
        return lens.pop() if lens else 0

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        for s in self.seq_ids:
            self.cache.truncate(s)

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None):
        """Append ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``; returns the gathered
        ``(B, Hkv, length, D)`` and ``(B, Hkv, length, Dv)`` (equal lengths only)."""
        n = self.length
        if positions is not None:
            pos = torch.as_tensor(positions).flatten().tolist()
            if pos != list(range(n, n + k.shape[2])):
                raise ValueError(
                    f"a paged cache appends only: positions must be {n}..{n + k.shape[2] - 1}, "
                    f"got {pos}"
                )
        self.cache.append(self.seq_ids, k, v)
        ks, vs = zip(*(self.cache.gather(s) for s in self.seq_ids))
        return torch.stack(ks), torch.stack(vs)  # B × (Hkv, length, ·) -> (B, Hkv, length, ·)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask=None,
        score_mod=None,
        scale: float | None = None,
        return_weights: bool = False,
    ):
        """Append ``k (B, Hkv, Sq, D)`` / ``v (B, Hkv, Sq, Dv)``, then attend ``q (B, Hq, Sq, D)``.

        Returns ``out (B, Hq, Sq, Dv)``, or ``(out, weights)`` with ``weights
        (B, Hq, Sq, max length)`` (zero past each sequence's end; gathered, for inspection).
        """
        B = len(self.seq_ids)
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != B:
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be (B={B}, Hq, Sq, D) for seq_ids {self.seq_ids}, got {got}")
        if k.dim() != 4 or k.shape[2] != q.shape[2]:
            raise ValueError(
                f"k must hold one new token per query: q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if q.dtype != self.cache.k_pages.dtype:
            raise TypeError(
                f"q is {q.dtype} but the cache stores {self.cache.k_pages.dtype}; build the "
                "PagedCache with the model's dtype"
            )
        Sq = q.shape[2]
        # Validate before appending, so that bad input leaves the cache as it was.
        lens = self.cache.seq_lens(self.seq_ids) + Sq
        offsets = lens.long() - Sq  # absolute position of each sequence's query row 0
        shape = (B, q.shape[1], Sq, int(lens.max()) if B else 0)  # (B, Hq, Sq, max length)
        mask = _per_sequence_rows(mask, offsets, shape)
        score_mod = _per_sequence_rows(score_mod, offsets, shape)
        self.cache.append(self.seq_ids, k, v)
        out = paged_attention(
            q,
            self.cache.k_pages,
            self.cache.v_pages,
            self.cache.block_table(self.seq_ids),
            lens,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
        )
        if not return_weights:
            return out
        w = q.new_zeros(B, q.shape[1], Sq, int(lens.max()) if B else 0)
        for b, s in enumerate(self.seq_ids):
            ks, vs = self.cache.gather(s)
            n = ks.shape[1]
            w[b : b + 1, :, :, :n] = attention_weights(
                q[b : b + 1],
                ks[None],
                vs[None],
                mask=None if mask is None else _BatchRowMask(as_mask(mask), b),
                score_mod=None
                if score_mod is None
                else _BatchRowScoreMod(as_score_mod(score_mod), b),
                scale=scale,
            )  # default q_offset: bottom-right, n - Sq, as in paged_attention
        return out, w


# -- tensors in query-row order ----------------------------------------------------------------
# paged_attention evaluates masks and score mods at absolute positions with q_offset=0, which is
# right for every built-in; a bool tensor mask or a bias tensor is indexed by query ROW, so it
# needs each sequence's own offset. Only such trees are wrapped: a wrapper hides the analytic
# tile classification that lets a sliding window skip pages.


def _has_rows(obj) -> bool:
    if isinstance(obj, (TensorMask, Bias)):
        return True
    if isinstance(obj, And):  # Or subclasses And
        return _has_rows(obj.a) or _has_rows(obj.b)
    if isinstance(obj, Not):
        return _has_rows(obj.a)
    if isinstance(obj, Compose):
        return any(_has_rows(m) for m in obj.mods)
    return False


def _per_sequence_rows(obj, offsets: torch.Tensor, shape: tuple[int, int, int, int]):
    """``obj`` (a mask or score mod, any accepted form), evaluated with ``q_offset =
    offsets[b]`` when it holds row-ordered tensors, which must broadcast to ``shape``
    ``(B, Hq, Sq, max length)``; otherwise ``obj`` as given."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        obj = from_tensor(obj) if obj.dtype == torch.bool else as_score_mod(obj)
    if not _has_rows(obj):
        return obj
    B, H, Sq, Sk = shape
    obj.validate(B, H, Sq, Sk, Sk - Sq)
    wrap = _RowsMask if isinstance(obj, Mask) else _RowsScoreMod
    return wrap(obj, offsets, Sk)


class _RowsMask(Mask):
    def __init__(self, inner: Mask, offsets: torch.Tensor, Sk: int):
        self.inner, self.offsets, self.last = inner, offsets, max(Sk - 1, 0)

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        off = self.offsets.to(q_idx.device)[b]  # b broadcasts like the index grids
        # Slots past the longest sequence (the rest of its last page) are masked out by
        # paged_attention whatever this says; clamping keeps them inside the tensor.
        kv = kv_idx.clamp(max=self.last)
        return self.inner.mask_mod(b, h, q_idx, kv, q_offset=off)


class _RowsScoreMod(ScoreMod):
    def __init__(self, inner: ScoreMod, offsets: torch.Tensor, Sk: int):
        self.inner, self.offsets, self.last = inner, offsets, max(Sk - 1, 0)

    def score_mod(self, score, b, h, q_idx, kv_idx, q_offset: int = 0):
        off = self.offsets.to(q_idx.device)[b]
        return self.inner.score_mod(score, b, h, q_idx, kv_idx.clamp(max=self.last), q_offset=off)


# A mask or score mod of a batch restricted to its row ``b``, for a batch-1 call.
class _BatchRowMask(Mask):
    def __init__(self, inner: Mask, b: int):
        self.inner, self.b = inner, b

    def mask_mod(self, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.inner.mask_mod(b + self.b, h, q_idx, kv_idx, q_offset=q_offset)


class _BatchRowScoreMod(ScoreMod):
    def __init__(self, inner: ScoreMod, b: int):
        self.inner, self.b = inner, b

    def score_mod(self, score, b, h, q_idx, kv_idx, q_offset: int = 0):
        return self.inner.score_mod(score, b + self.b, h, q_idx, kv_idx, q_offset=q_offset)
