"""``BlockPool``: the page allocator of a paged KV cache, with reference counts.

A page is either free (count 0, in the free list) or used (count >= 1). Sequences that share a
prefix share its pages: :meth:`BlockPool.fork` adds one reference per page instead of copying, and
a page returns to the free list only when its last reference is dropped. Copy-on-write is the
caller's job: before writing into a page whose :meth:`BlockPool.refcount` is above 1, allocate a
fresh page, copy, and drop the shared reference.

Listeners (:meth:`BlockPool.add_listener`) hear of every reference-count change of pages in use,
so a structure built over the pool (the prefix index's evictable set) stays current without
scanning the pool.
"""

from __future__ import annotations

import heapq
import inspect
import weakref
from collections.abc import Callable, Iterable

from selfattn._validate import checked_int

__all__ = ["BlockPool"]


class BlockPool:
    """Reference-counted allocator over page ids ``0 .. num_pages - 1``.

    Allocation hands out the lowest free ids first (deterministic, so tests and traces repeat).
    Every method that takes a list of pages validates all of them before changing anything: a
    failing call leaves the pool as it was.
    """

    def __init__(self, num_pages: int):
        self.num_pages = checked_int(num_pages, "num_pages", 0)
        self._refs = [0] * num_pages
        # A min-heap: the lowest free id comes out first, O(log N) per page either way.
        self._free = list(range(num_pages))
        self._listeners: list[Callable[[], Callable[[list[int]], None] | None]] = []

    def add_listener(self, fn: Callable[[list[int]], None]) -> None:
        """Call ``fn(pages)`` after every :meth:`incref` / :meth:`decref` with the pages whose
        count changed (not after :meth:`allocate`: a fresh page was free, so nobody tracked it)."""
        if not callable(fn):
            raise TypeError(f"a listener must be callable as fn(pages), got {type(fn).__name__}")
        # A bound method is held weakly: a dropped PrefixIndex must not live on in its pool.
        ref = weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)
        self._listeners.append(ref)

    def _notify(self, pages: list[int]) -> None:
        live = [fn for fn in (ref() for ref in self._listeners) if fn is not None]
        if len(live) != len(self._listeners):
            self._listeners = [r for r in self._listeners if r() is not None]
        for fn in live:
            fn(pages)

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        self._check_ids([page])
        return self._refs[page]

    # -- changes -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages with count 1; raises, changing nothing, if fewer are free."""
        checked_int(n, "allocate n", 0, "the number of pages to allocate")
        if n > len(self._free):
            raise RuntimeError(
                f"cannot allocate {n} pages: only {len(self._free)} of {self.num_pages} are free; "
                "free or evict pages first, or build a larger pool"
            )
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more reference to each of ``pages`` (all must be in use)."""
        pages = list(pages)
        self._check_ids(pages)
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} is free; only pages in use can gain a reference")
        for p in pages:
            self._refs[p] += 1
        self._notify(pages)

    def fork(self, pages: Iterable[int]) -> list[int]:
        """Share ``pages`` with a new owner: one more reference each; returns the same ids."""
        pages = list(pages)
        self.incref(pages)
        return pages

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference to each page; returns the pages that became free.

        A page listed ``k`` times loses ``k`` references; dropping more than it holds raises.
        """
        pages = list(pages)
        self._check_ids(pages)
        need: dict[int, int] = {}
        for p in pages:
            need[p] = need.get(p, 0) + 1
        for p, k in need.items():
            if self._refs[p] < k:
                raise ValueError(
                    f"page {p} has {self._refs[p]} reference(s) but {k} would be dropped; "
                    "a page is freed at most once per reference"
                )
        freed = []
        for p, k in need.items():
            self._refs[p] -= k
            if self._refs[p] == 0:
                freed.append(p)
        for p in freed:
            heapq.heappush(self._free, p)
        self._notify(list(need))
        return freed

    def free(self, pages: Iterable[int]) -> list[int]:
        """Release one owner's references to ``pages`` (alias of :meth:`decref`)."""
        return self.decref(pages)

    # -- invariants --------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is in the free list twice")
        if any(r < 0 for r in self._refs):
            raise AssertionError(f"negative reference counts: {self._refs}")
        used = {p for p, r in enumerate(self._refs) if r > 0}
        if free & used:
            raise AssertionError(f"pages both free and referenced: {sorted(free & used)}")
        if len(free) + len(used) != self.num_pages:
            raise AssertionError(f"free {len(free)} + used {len(used)} != total {self.num_pages}")

    def _check_ids(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= checked_int(p, "page id") < self.num_pages:
                raise ValueError(
                    f"page id {p} is out of range for a pool of {self.num_pages} pages "
                    f"(valid ids are 0..{self.num_pages - 1})"
                )

    def __repr__(self) -> str:
        return f"BlockPool(num_pages={self.num_pages}, free={self.num_free}, used={self.num_used})"
