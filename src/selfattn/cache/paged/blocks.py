"""``BlockTable``: the bookkeeping of a paged KV cache, without a tensor.

It knows which pages each sequence holds and how many tokens; it decides what a step needs
(fresh pages, copy-on-write) and returns the page copies for the storage to make
(:mod:`selfattn.cache.paged.store`). Reference counts live in the shared
:class:`~selfattn.cache.pool.BlockPool` (the prefix index counts on the same pool), so the
table takes and drops references there and never counts them itself::

    pages  {4: [3, 0], 9: [3, 5]}      P = 4: sequence 9 forked from 4 after page 3
    lens   {4: 6, 9: 7}                token t of a sequence sits in slot t % P of pages[t // P]

Invariants (:meth:`BlockTable.check`): every sequence holds ``ceil(length / P)`` pages; each
page's pool count equals the sequences listing it plus the prefix index when it caches it; free
+ held by sequences + held by the index alone = all pages. Every change is validated in full
before anything changes, so a refused call leaves the table, the pool and the index as they
were. Sequence ids are handed out in order and never reused.

Copy-on-write: only a sequence's last, partly filled page is ever written. A step that writes
into a shared last page first moves the sequence to a fresh page (the storage copies the old
one into it), unless the sharers that moved away in the same step left it to this sequence
alone (then it writes in place: one copy per sharer but the last). A prefix ending exactly on a
page boundary is never copied: the next token opens a new page.
"""

from __future__ import annotations

from selfattn._validate import checked_int, positive_int
from selfattn.cache.pool import BlockPool
from selfattn.cache.prefix import PrefixIndex

__all__ = ["BlockTable"]


class BlockTable:
    """Sequences -> page lists and lengths over one :class:`BlockPool` (module docstring).

    ``BlockTable(num_pages, page_size, *, max_seqs, max_pages_per_seq, prefix_caching)``: at
    most ``max_seqs`` live sequences of at most ``max_pages_per_seq`` pages each; with
    ``prefix_caching`` an index over the pool (``table.index``) keeps finished pages for later
    requests and is evicted least recently used first when a step runs short of pages.
    ``epoch`` counts the steps reserved: only the latest one can be undone.
    """

    def __init__(
        self, num_pages: int, page_size: int, *, max_seqs: int, max_pages_per_seq: int,
        prefix_caching: bool = False,
    ):  # fmt: skip
        self.pool = BlockPool(num_pages)
        self.page_size = page_size
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.index: PrefixIndex | None = (
            PrefixIndex(self.pool, page_size) if prefix_caching else None
        )
        self.epoch = 0
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        # tokens evicted from a compacted sequence (compact): its next token's position is its
        # length plus these; absent for the others
        self._evicted: dict[int, int] = {}
        # a sequence compacted to ragged per-(layer, KV head) counts: (L, Hkv, 2) int64, each
        # layer's and head's hole [start, end) of slots it skips (PagedKV.compact: a tensor
        # kept as the cache made it; this module imports no torch)
        self._holes: dict[int, object] = {}
        self._next_id = 0

    # -- reads ----------------------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        """Tokens one sequence can hold: ``max_pages_per_seq × page_size``."""
        return self.max_pages_per_seq * self.page_size

    @property
    def seq_ids(self) -> list[int]:
        return list(self._pages)

    def pages(self, seq_id: int) -> list[int]:
        """The page ids of ``seq_id`` in token order (a copy)."""
        return list(self._pages[self.check_id(seq_id)])

    def length(self, seq_id: int) -> int:
        return self._lens[self.check_id(seq_id)]

    def evicted(self, seq_id: int) -> int:
        """Tokens :meth:`compact` removed from ``seq_id`` (0 for a sequence never compacted):
        its slots hold ``length`` tokens of the ``length + evicted`` it has seen."""
        return self._evicted.get(seq_id, 0)

    def offsets(self, ids: list[int]) -> list[int] | None:
        """Each checked sequence's :meth:`evicted`, or None when none of them was compacted
        (its positions are its slots)."""
        if not self._evicted:
            return None
        found = [self._evicted.get(s, 0) for s in ids]
        return found if any(found) else None

    def holes(self, seq_id: int):
        """``(L, Hkv, 2)`` int64: the slots ``[start, end)`` that layer ``l``, KV head ``h`` of
        ``seq_id`` skips (a ragged compaction's), or None where it has none."""
        return self._holes.get(self.check_id(seq_id))

    def hole_lists(self, ids: list[int]) -> list | None:
        """:meth:`holes` of each checked sequence, or None when none of them has any."""
        if not self._holes:
            return None
        found = [self._holes.get(s) for s in ids]
        return None if all(h is None for h in found) else found

    def set_holes(self, seq_id: int, holes) -> None:
        """Record ``seq_id``'s holes (:meth:`holes`; None: none)."""
        self.check_id(seq_id)
        if holes is None:
            self._holes.pop(seq_id, None)
        else:
            self._holes[seq_id] = holes

    def page_lists(self, ids: list[int]) -> list[list[int]]:
        """The live page lists of checked ``ids`` (read them, never change them): what a
        planner reads once per step without copying."""
        return [self._pages[s] for s in ids]

    def check_id(self, seq_id) -> int:
        checked_int(seq_id, "sequence id")
        if seq_id not in self._pages:
            raise ValueError(
                f"unknown sequence id {seq_id}; live ids are {sorted(self._pages)} (use "
                "add_sequence() or fork())"
            )
        return seq_id

    def checked_ids(self, seq_ids) -> list[int]:
        """``seq_ids`` (an int or an iterable) as a list of live, distinct ids."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        for s in ids:
            self.check_id(s)
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids {ids} repeat a sequence; list each sequence once")
        return ids

    # -- sequences ------------------------------------------------------------------------------
    def _new_id(self) -> int:
        if len(self._pages) >= self.max_seqs:
            raise RuntimeError(
                f"cannot add a sequence: all max_seqs={self.max_seqs} are live; free one first "
                "or build the cache with a larger max_seqs"
            )
        sid = self._next_id
        self._next_id += 1
        return sid

    def add(self) -> int:
        """A new empty sequence; returns its id."""
        sid = self._new_id()
        self._pages[sid], self._lens[sid] = [], 0
        return sid

    def add_many(self, n: int) -> list[int]:
        """``n`` new empty sequences (all or none); returns their ids."""
        positive_int(n, "add_sequences n")
        if len(self._pages) + n > self.max_seqs:
            raise RuntimeError(
                f"cannot add {n} sequences: {len(self._pages)} of max_seqs={self.max_seqs} are "
                "live; free some first or build the cache with a larger max_seqs"
            )
        return [self.add() for _ in range(n)]

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every page (a reference more each) and the length of
        ``seq_id``; returns its id."""
        self.check_id(seq_id)
        sid = self._new_id()
        self._pages[sid] = self.pool.fork(self._pages[seq_id])
        self._lens[sid] = self._lens[seq_id]
        if seq_id in self._evicted:
            self._evicted[sid] = self._evicted[seq_id]
        if seq_id in self._holes:  # never changed in place: shared
            self._holes[sid] = self._holes[seq_id]
        return sid

    def add_from_prefix(self, tokens, index: PrefixIndex | None = None, salt=None):
        """A new sequence over the index's longest cached prefix of ``tokens``; returns
        ``(seq_id, cached_tokens)`` (:meth:`~selfattn.cache.PagedKV.add_sequence_from_prefix`)."""
        index = self.use_index(index)
        sid = self._new_id()  # before acquire: a full table must not leak the references
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
        """Offer the full pages of ``seq_id`` to the index; returns how many became cached."""
        index = self.use_index(index)
        n = self._lens[self.check_id(seq_id)]
        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if len(ids) < n:
            raise ValueError(
                f"sequence {seq_id} holds {n} tokens but only {len(ids)} token ids were given; "
                "pass the ids of every cached token"
            )
        return index.insert(ids[:n], self._pages[seq_id][: n // self.page_size], salt)

    def use_index(self, index: PrefixIndex | None) -> PrefixIndex:
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
                "so that eviction and check() see every cached page"
            )
        self.index = index
        return index

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id`` and its references; pages no other holder shares become free."""
        self.pool.free(self._pages[self.check_id(seq_id)])
        del self._pages[seq_id], self._lens[seq_id]
        self._evicted.pop(seq_id, None)
        self._holes.pop(seq_id, None)

    def truncate(self, seq_id: int) -> None:
        """Empty ``seq_id`` (length 0, its references dropped) but keep it live."""
        self.pool.free(self._pages[self.check_id(seq_id)])
        self._pages[seq_id], self._lens[seq_id] = [], 0
        self._evicted.pop(seq_id, None)
        self._holes.pop(seq_id, None)

    def trim(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id``: its pages past them are dropped (a
        speculative step's rejected tokens). A kept page others share stays shared; the next
        write into it copies it first (copy-on-write), so no sharer sees the overwrite."""
        n = self._lens[self.check_id(seq_id)]
        checked_int(length, "trim length")
        if not 0 <= length <= n:
            raise ValueError(
                f"cannot trim sequence {seq_id} to {length} tokens: it holds {n}; give a length "
                f"in 0..{n}"
            )
        pages = self._pages[seq_id]
        keep = -(-length // self.page_size)
        extra = pages[keep:]
        del pages[keep:]
        self.pool.decref(extra)
        self._lens[seq_id] = length
        if seq_id in self._holes:  # holes past the new end shrink with it
            self._holes[seq_id] = self._holes[seq_id].clamp(max=length)
        self.epoch += 1  # the plan before it can no longer be undone

    def drop_page(self, seq_id: int, at: int) -> None:
        """Drop page number ``at`` of ``seq_id`` (its reference, and ``page_size`` tokens of its
        length): a window cache's passed page, whose later pages move down."""
        pages = self._pages[self.check_id(seq_id)]
        self.pool.decref([pages.pop(at)])
        self._lens[seq_id] -= self.page_size

    def compact(self, seq_id: int, n: int) -> tuple[list[int], list[int]]:
        """Shrink ``seq_id`` to ``n`` of its tokens (a KV-compression policy chose them; the
        storage moves them, :meth:`PagedKV.compact`). Returns ``(old, new)`` page lists: the
        kept tokens go to slots ``0 .. n-1`` of ``new``, ``ceil(n / P)`` pages taken from those
        of ``old`` the sequence alone holds (in order), fresh pages only where too few are its
        own; pages others share (a cached prefix, a fork) are never written (copy-on-write).
        The pages it no longer lists lose its reference. The removed tokens count in
        :meth:`evicted`. Advances :attr:`epoch` (no earlier plan can be undone)."""
        have = self._lens[self.check_id(seq_id)]
        checked_int(n, "compact n")
        if not 1 <= n <= have:
            raise ValueError(
                f"cannot compact sequence {seq_id} to {n} tokens: it holds {have}; keep 1..{have}"
            )
        old = self._pages[seq_id]
        keep = -(-n // self.page_size)
        new = [p for p in old if self.pool.refcount(p) == 1][:keep]
        if len(new) < keep:
            what = f"compacting sequence {seq_id} (it shares {len(old) - len(new)} of its pages)"
            new += self._allocate(keep - len(new), what)
        mine = set(new)
        self.pool.decref([p for p in old if p not in mine])
        self._pages[seq_id], self._lens[seq_id] = new, n
        self._evicted[seq_id] = self._evicted.get(seq_id, 0) + have - n
        self.epoch += 1
        return old, new

    # -- one step -------------------------------------------------------------------------------
    def reserve(self, ids: list[int], counts: list[int]):
        """Pages for ``counts[i]`` more tokens of sequence ``ids[i]``, and the new lengths.

        Returns ``(before, copies)``: ``before`` each sequence's ``(id, pages before, length
        before)`` (what :meth:`undo` restores) and ``copies`` the ``(old, new)`` pages the
        storage must copy (copy-on-write) before the step writes. Raises ValueError past a
        sequence's ``max_len`` and RuntimeError when the pool (plus the evictable cached pages)
        is short, in both cases before changing anything; advances :attr:`epoch`.
        """
        P = self.page_size
        before = [(s, len(self._pages[s]), self._lens[s]) for s in ids]
        # Per sequence: does its last page need a copy, and how many new pages? Holders of a
        # shared page that copy it away leave fewer behind: when every sharer writes in this
        # step, the last one finds itself the sole holder and writes in place.
        n_new, cow, holders = [], [], {}
        for (s, n_pages, n), S in zip(before, counts):
            if n + S > self.max_len:
                raise ValueError(
                    f"sequence {s} holds {n} tokens; {S} more exceed its capacity max_len = "
                    f"max_pages_per_seq × page_size = {self.max_pages_per_seq} × {P} = "
                    f"{self.max_len}; build the cache with a larger max_pages_per_seq"
                )
            copy = False
            if S and n % P:  # the last page is partly filled: the write goes into it
                last = self._pages[s][-1]
                left = holders.setdefault(last, self.pool.refcount(last))
                copy = left > 1
                holders[last] = left - copy
            cow.append(copy)
            n_new.append(-(-(n + S) // P) - n_pages + int(copy))
        fresh = self._allocate(sum(n_new), f"appending {counts} token(s) to sequences {ids}")
        copies = []
        for s, copy, m, S in zip(ids, cow, n_new, counts):
            mine, fresh = fresh[:m], fresh[m:]
            pages = self._pages[s]
            if copy:  # the shared last page goes to a fresh page this sequence owns
                old, new = pages[-1], mine.pop(0)
                copies.append((old, new))
                self.pool.decref([old])  # others still hold it: never freed here
                pages[-1] = new
            pages.extend(mine)
            self._lens[s] += S
        self.epoch += 1
        return before, copies

    def _allocate(self, need: int, what: str) -> list[int]:
        """``need`` fresh pages, evicting least-recently-used cached pages when the pool is
        short; RuntimeError naming the step before anything changes when even that is short."""
        evictable = 0 if self.index is None else self.index.num_evictable_pages
        if need > self.pool.num_free + evictable:
            raise RuntimeError(
                f"{what} needs {need} free page(s) but the pool has {self.pool.num_free} of "
                f"{self.pool.num_pages} (+{evictable} evictable cached); free sequences or build "
                "a larger pool"
            )
        if self.index is None:
            return self.pool.allocate(need)
        return self.index.allocate_with_eviction(need)

    def undo(self, before, epoch: int) -> None:
        """Return the sequences of the step reserved at ``epoch`` (the latest) to ``before``;
        the pages it took are dropped (a copied-on-write last page stays: it holds the same
        tokens as the shared one it replaced)."""
        if epoch != self.epoch:
            raise RuntimeError("only the latest plan can be undone; later steps depend on it")
        for s, n_pages, n in before:
            extra = self._pages[s][n_pages:]
            del self._pages[s][n_pages:]
            self.pool.decref(extra)
            self._lens[s] = n
        self.epoch += 1

    def adopt(self, ids, counts, lengths, page_lists):
        """Take another table's step as this table's whole state: sequence ``ids[i]`` holds
        ``page_lists[i]`` and ``lengths[i] + counts[i]`` tokens (a tensor-parallel peer mirrors
        rank 0's table this way; the pool is not consulted, rank 0 counted the references).
        Returns ``before`` as :meth:`reserve` does, with the pages before = after (an undo
        drops nothing); advances :attr:`epoch`."""
        self._pages = {s: list(p) for s, p in zip(ids, page_lists)}
        self._lens = {s: n + c for s, n, c in zip(ids, lengths, counts)}
        self._evicted, self._holes = {}, {}
        self.epoch += 1
        return [(s, len(p), n) for s, p, n in zip(ids, page_lists, lengths)]

    # -- invariants -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless every page's pool count equals its holders (module
        docstring), and the pool's and the index's own checks pass."""
        self.pool.check()
        if self.index is not None:
            self.index.check()
        num_pages = self.pool.num_pages
        refs = [0] * num_pages
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
        if self.pool.num_free + by_seqs + index_only != num_pages:
            raise AssertionError(
                f"free {self.pool.num_free} + used by sequences {by_seqs} + held by the index "
                f"alone {index_only} != total {num_pages}"
            )

    def __repr__(self) -> str:
        return (
            f"BlockTable(page_size={self.page_size}, seqs={len(self._pages)}, "
            f"free_pages={self.pool.num_free} of {self.pool.num_pages})"
        )
