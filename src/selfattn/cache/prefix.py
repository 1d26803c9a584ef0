"""``PrefixIndex``: prefix sharing over a :class:`BlockPool`, as a page-granular radix tree.

Layout: one tree per salt (``None`` is the shared tenant). Every edge is one *full* page of token
ids, a tuple of ``page_size`` ids, and the node below it owns the pool page holding that block's
K/V. A path from a root spells a cached prefix, page by page::

    salt None ─┬─ (5, 1, 7) p3 ── (2, 2, 9) p8          prompt 5 1 7 2 2 9 4 -> reuse p3, p8
               └─ (5, 1, 0) p4                           prompt 5 1 0 6     -> reuse p4
    salt "a" ──── (5, 1, 7) p11                          another tenant never sees p3

A partial last page is never cached: its K/V is still being written, so sharing it would let two
sequences write into one page.

References: the index holds exactly one pool reference per cached page; each live request holds
its own (:meth:`PrefixIndex.acquire` / :meth:`PrefixIndex.release`). So a page whose count is 1
is referenced by the index alone and may be evicted; a page in use has count >= 2 and never is.
Eviction takes least-recently-used leaves first (a node is used when a match returns it or an
insert walks through it); evicting a leaf may turn its parent into an evictable leaf.

Fully cached prompts: a prompt needs at least one token of forward pass to produce logits, so
:meth:`PrefixIndex.match` reuses at most ``(len(tokens) - 1) // page_size`` pages (vLLM's rule):
a prompt that is exactly ``k`` cached pages reuses ``k - 1`` and computes the last page.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from selfattn.cache.pool import BlockPool

__all__ = ["PrefixHit", "PrefixIndex"]


@dataclass(frozen=True)
class PrefixHit:
    """One request's share of the cache: the reused ``pages`` (its references already taken),
    ``cached_tokens = len(pages) * page_size`` and ``computed_tokens = len(tokens) - cached``."""

    pages: list[int]
    cached_tokens: int
    computed_tokens: int


class _Node:
    __slots__ = ("block", "children", "depth", "last_used", "page", "parent")

    def __init__(self, block: tuple[int, ...] | None, page: int, parent: _Node | None, depth: int):
        self.block = block
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0
        self.depth = depth


class PrefixIndex:
    """Radix tree of token-id pages over ``pool``; see the module docstring for the layout.

    ``tokens`` anywhere below is a 1-D sequence of ints (a list, tuple or 1-D integer tensor).
    """

    def __init__(self, pool: BlockPool, page_size: int):
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if isinstance(page_size, bool) or not isinstance(page_size, int):
            raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool = pool
        self.page_size = page_size
        self._roots: dict[Hashable, _Node] = {}
        self._node_of_page: dict[int, _Node] = {}
        self._clock = 0  # bumped once per match/insert: ties only along one root-to-leaf path

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_cached_pages(self) -> int:
        return len(self._node_of_page)

    @property
    def num_evictable_pages(self) -> int:
        """Pages that repeated :meth:`evict` could free now: nodes whose whole subtree is
        referenced by the index alone."""
        count = 0
        for root in self._roots.values():
            stack: list[tuple[_Node, bool]] = [(root, False)]
            ok: dict[int, bool] = {}
            while stack:  # post-order without recursion: deep prompts make deep trees
                node, seen = stack.pop()
                if not seen:
                    stack.append((node, True))
                    stack.extend((c, False) for c in node.children.values())
                    continue
                good = all(ok[id(c)] for c in node.children.values())
                if node.block is not None:
                    good = good and self.pool.refcount(node.page) == 1
                    count += good
                ok[id(node)] = good
        return count

    def match(self, tokens: Sequence[int], salt: Hashable = None) -> tuple[list[int], int]:
        """Longest cached page-aligned prefix of ``tokens``: ``(pages, n_cached_tokens)``.

        Takes no references (see :meth:`acquire`) but counts as a use for LRU. At most
        ``(len(tokens) - 1) // page_size`` pages are returned, so one token is always left to
        compute.
        """
        ids = self._ids(tokens)
        limit = max(len(ids) - 1, 0) // self.page_size
        node = self._roots.get(self._salt_key(salt))
        path: list[_Node] = []
        P = self.page_size
        while node is not None and len(path) < limit:
            node = node.children.get(tuple(ids[len(path) * P : (len(path) + 1) * P]))
            if node is not None:
                path.append(node)
        self._touch(path)
        return [n.page for n in path], len(path) * P

    def acquire(self, tokens: Sequence[int], salt: Hashable = None) -> PrefixHit:
        """:meth:`match`, then one reference per reused page for the caller (drop with
        :meth:`release`), so those pages cannot be evicted while the request runs."""
        pages, cached = self.match(tokens, salt)
        self.pool.incref(pages)
        return PrefixHit(pages, cached, len(self._ids(tokens)) - cached)

    def release(self, pages: Iterable[int]) -> list[int]:
        """Drop a request's references (reused and fresh pages alike); returns the pages freed.
        Pages the index caches stay cached (count 1, evictable) rather than freed."""
        return self.pool.decref(pages)

    # -- changes -----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: Hashable = None) -> int:
        """Cache the full pages of a prefilled sequence; returns how many pages became cached.

        ``pages[i]`` holds tokens ``i*page_size .. (i+1)*page_size - 1``; a trailing partial page
        is ignored. A block already cached keeps its existing page (the caller's duplicate is
        freed when the caller releases it). The index takes its own reference to each new page,
        so the caller still releases all of its pages as usual.
        """
        ids = self._ids(tokens)
        pages = list(pages)
        P = self.page_size
        n_full = len(ids) // P
        if len(pages) < n_full:
            raise ValueError(
                f"{len(ids)} tokens fill {n_full} pages of {P} but only {len(pages)} pages were "
                "given; pass the sequence's whole block table"
            )
        key = self._salt_key(salt)
        # Dry walk first: validate everything so a failing insert changes nothing.
        node = self._roots.get(key)
        new: list[tuple[int, tuple[int, ...]]] = []
        for i in range(n_full):
            block = tuple(ids[i * P : (i + 1) * P])
            child = node.children.get(block) if node is not None and not new else None
            if child is not None:
                node = child
                continue
            page = pages[i]
            if self.pool.refcount(page) == 0:
                raise ValueError(f"page {page} (block {i}) is free; insert only pages in use")
            if page in self._node_of_page or any(page == q for _, q in new):
                raise ValueError(
                    f"page {page} (block {i}) already caches a different block; each page "
                    "holds one block"
                )
            new.append((i, page))
        # Apply.
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = _Node(None, -1, None, 0)
        node, path = root, []
        for i in range(n_full):
            block = tuple(ids[i * P : (i + 1) * P])
            child = node.children.get(block)
            if child is None:
                child = _Node(block, pages[i], node, node.depth + 1)
                node.children[block] = child
                self._node_of_page[child.page] = child
                self.pool.incref([child.page])
            path.append(child)
            node = child
        self._touch(path)
        return len(new)

    def evict(self, n_pages: int) -> list[int]:
        """Free up to ``n_pages`` pages referenced by the index alone, least recently used leaf
        first; returns the freed pages (fewer when fewer are evictable)."""
        if isinstance(n_pages, bool) or not isinstance(n_pages, int):
            raise TypeError(f"n_pages must be an int, got {type(n_pages).__name__}")
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        heap = [self._heap_key(n) for n in self._node_of_page.values() if self._evictable(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n_pages:
            *_, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.block]
            del self._node_of_page[node.page]
            freed += self.pool.decref([node.page])
            if parent.block is None:
                if not parent.children:  # drop an empty salt root
                    self._roots = {k: r for k, r in self._roots.items() if r is not parent}
            elif self._evictable(parent):
                heapq.heappush(heap, self._heap_key(parent))
        return freed

    def allocate_with_eviction(self, n: int) -> list[int]:
        """``n`` fresh pages from the pool, evicting LRU cached pages if too few are free.

        Atomic: if even evicting every evictable page cannot make room, raises RuntimeError and
        neither the pool nor the index changes.
        """
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"cannot allocate n={n} pages; n must be >= 0")
        short = n - self.pool.num_free
        if short > 0:
            evictable = self.num_evictable_pages
            if short > evictable:
                raise RuntimeError(
                    f"cannot allocate {n} pages: {self.pool.num_free} free and {evictable} "
                    "evictable; release requests or build a larger pool"
                )
            self.evict(short)
        return self.pool.allocate(n)

    # -- helpers -----------------------------------------------------------------------------
    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.pool.refcount(node.page) == 1

    @staticmethod
    def _heap_key(node: _Node) -> tuple[int, int, int, _Node]:
        # Oldest first; on a tie (one path) the deeper node first; page id makes keys unique.
        return (node.last_used, -node.depth, node.page, node)

    def _touch(self, path: list[_Node]) -> None:
        self._clock += 1
        for node in path:
            node.last_used = self._clock

    @staticmethod
    def _salt_key(salt: Hashable) -> Hashable:
        try:
            hash(salt)
        except TypeError:
            raise TypeError(
                f"salt must be hashable (str, bytes, int or None), got {type(salt).__name__}"
            ) from None
        return salt

    @staticmethod
    def _ids(tokens: Sequence[int]) -> list[int]:
        if hasattr(tokens, "tolist"):
            if getattr(tokens, "ndim", 1) != 1:
                raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
            tokens = tokens.tolist()
        ids = list(tokens)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"token ids must be ints, got {type(t).__name__} {t!r}")
        return ids

    def __repr__(self) -> str:
        return (
            f"PrefixIndex(page_size={self.page_size}, cached_pages={self.num_cached_pages}, "
            f"salts={len(self._roots)})"
        )
