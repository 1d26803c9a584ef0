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

Eviction costs O(log n) per evicted page, whatever the tree holds: the index listens to the
pool (:meth:`BlockPool.add_listener`), so it learns the moment a page becomes referenced by the
index alone, and keeps every evictable leaf in a heap keyed by last use (stale entries are
skipped when popped and the heap is compacted when they pile up). How many pages eviction
could free at most (:attr:`PrefixIndex.num_evictable_pages`) is a counter too: each node counts
its pinned children (pinned = held by someone besides the index), and a change travels up only
while it flips a node between "has a pinned descendant" and "has none".

Fully cached prompts: a prompt needs at least one token of forward pass to produce logits, so
:meth:`PrefixIndex.match` reuses at most ``(len(tokens) - 1) // page_size`` pages (vLLM's rule):
a prompt that is exactly ``k`` cached pages reuses ``k - 1`` and computes the last page.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from selfattn._validate import checked_int
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
    __slots__ = (
        "block",
        "children",
        "depth",
        "last_used",
        "page",
        "parent",
        "pinned",
        "pins",
        "queued",
    )

    def __init__(self, block: tuple[int, ...] | None, page: int, parent: _Node | None, depth: int):
        self.block = block
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0
        self.depth = depth
        self.pinned = False  # the page has a reference besides the index's
        self.pins = 0  # int(pinned) + number of children whose subtree holds a pinned node
        self.queued: int | None = None  # last_used of this node's entry in the eviction heap


class PrefixIndex:
    """Radix tree of token-id pages over ``pool``; see the module docstring for the layout.

    ``tokens`` anywhere below is a 1-D sequence of ints (a list, tuple or 1-D integer tensor).
    """

    def __init__(self, pool: BlockPool, page_size: int):
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        self.pool = pool
        self.page_size = checked_int(page_size, "page_size", 1)
        self._roots: dict[Hashable, _Node] = {}
        self._node_of_page: dict[int, _Node] = {}
        self._clock = 0  # bumped once per match/insert: ties only along one root-to-leaf path
        self._heap: list[tuple[int, int, int, _Node]] = []  # (last_used, -depth, seq, node)
        self._seq = itertools.count()  # heap tie-breaker, never compares nodes
        self._hot = 0  # nodes whose subtree holds a pinned node: never evictable
        pool.add_listener(self._on_refcount)

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_cached_pages(self) -> int:
        return len(self._node_of_page)

    def cached_pages(self) -> list[int]:
        """The pool pages the index holds a reference to (one each)."""
        return list(self._node_of_page)

    def items(self) -> list[tuple[Hashable, tuple[int, ...], int]]:
        """Every cached page as ``(salt, prefix token ids up to its block's end, page)``,
        parents before children. Inspection only: not a use for LRU."""
        out = []
        for salt, root in self._roots.items():
            stack = [(root, ())]
            while stack:
                node, prefix = stack.pop()
                if node.block is not None:
                    out.append((salt, prefix, node.page))
                stack.extend((c, prefix + c.block) for c in node.children.values())
        return out

    @property
    def num_evictable_pages(self) -> int:
        """Pages that repeated :meth:`evict` could free now: nodes whose whole subtree is
        referenced by the index alone. O(1)."""
        return len(self._node_of_page) - self._hot

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
                self.pool.incref([child.page])  # the listener marks it pinned if it is
            path.append(child)
            node = child
        self._touch(path)
        return len(new)

    def evict(self, n_pages: int) -> list[int]:
        """Free up to ``n_pages`` pages referenced by the index alone, least recently used leaf
        first; returns the freed pages (fewer when fewer are evictable)."""
        checked_int(n_pages, "n_pages", 0)
        freed: list[int] = []
        while self._heap and len(freed) < n_pages:
            last_used, _, _, node = heapq.heappop(self._heap)
            if node.queued == last_used:
                node.queued = None
            if not self._evictable(node) or node.last_used != last_used:
                continue  # stale: used, pinned, given a child or evicted since it was queued
            parent = node.parent
            del parent.children[node.block]
            del self._node_of_page[node.page]
            freed += self.pool.decref([node.page])
            if parent.block is None:
                if not parent.children:  # drop an empty salt root
                    self._roots = {k: r for k, r in self._roots.items() if r is not parent}
            else:
                self._queue(parent)
        return freed

    def allocate_with_eviction(self, n: int) -> list[int]:
        """``n`` fresh pages from the pool, evicting LRU cached pages if too few are free.

        Atomic: if even evicting every evictable page cannot make room, raises RuntimeError and
        neither the pool nor the index changes.
        """
        checked_int(n, "allocate n", 0, "the number of pages to allocate")
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
        """A leaf referenced by the index alone (and still in the tree)."""
        return not node.children and not node.pinned and self._node_of_page.get(node.page) is node

    def _queue(self, node: _Node) -> None:
        """Put an evictable leaf in the heap unless its current entry is already there."""
        if node.queued == node.last_used or not self._evictable(node):
            return
        if len(self._heap) > 2 * len(self._node_of_page) + 64:
            self._compact()  # queues every evictable leaf, this one included
            return
        node.queued = node.last_used
        heapq.heappush(self._heap, (node.last_used, -node.depth, next(self._seq), node))

    def _compact(self) -> None:
        """Rebuild the heap from the live evictable leaves (drops stale entries)."""
        for _, _, _, node in self._heap:
            node.queued = None
        self._heap = []
        for node in self._node_of_page.values():
            if self._evictable(node):
                node.queued = node.last_used
                self._heap.append((node.last_used, -node.depth, next(self._seq), node))
        heapq.heapify(self._heap)

    def _on_refcount(self, pages: list[int]) -> None:
        """Pool listener: update pin counts and the heap for cached pages whose count changed."""
        for p in pages:
            node = self._node_of_page.get(p)
            if node is None:
                continue
            pinned = self.pool._refs[p] > 1  # listener runs per change: skip the id checks
            if pinned != node.pinned:
                node.pinned = pinned
                self._add_pins(node, 1 if pinned else -1)
            self._queue(node)

    def _add_pins(self, node: _Node, delta: int) -> None:
        """Change ``node.pins`` by ``delta`` and carry the change up while it flips a node
        between "holds a pinned node" and "holds none" (O(depth) at worst, O(1) typically)."""
        while node.block is not None:
            before = node.pins > 0
            node.pins += delta
            after = node.pins > 0
            if before == after:
                return
            self._hot += 1 if after else -1
            node, delta = node.parent, 1 if after else -1

    def _touch(self, path: list[_Node]) -> None:
        self._clock += 1
        for node in path:
            node.last_used = self._clock
            self._queue(node)

    def check(self) -> None:
        """Raise AssertionError if the tree, its counters or its heap disagree with the pool
        (a full O(n) walk, for tests)."""
        seen: dict[int, _Node] = {}
        hot = 0
        for root in self._roots.values():
            stack = [root]
            order = []
            while stack:
                node = stack.pop()
                order.append(node)
                for block, child in node.children.items():
                    if child.parent is not node or child.block != block:
                        raise AssertionError(f"page {child.page}: broken parent/child link")
                    if child.depth != node.depth + 1 or len(block) != self.page_size:
                        raise AssertionError(f"page {child.page}: bad depth or block size")
                    if child.page in seen:
                        raise AssertionError(f"page {child.page} caches two blocks")
                    seen[child.page] = child
                    stack.append(child)
            for node in reversed(order):  # children before parents
                if node.block is None:
                    continue
                refs = self.pool.refcount(node.page)
                if refs < 1:
                    raise AssertionError(f"cached page {node.page} has {refs} references")
                if node.pinned != (refs > 1):
                    raise AssertionError(f"page {node.page}: pinned flag stale ({refs} refs)")
                want = node.pinned + sum(c.pins > 0 for c in node.children.values())
                if node.pins != want:
                    raise AssertionError(f"page {node.page}: pins {node.pins}, want {want}")
                hot += node.pins > 0
        if seen.keys() != self._node_of_page.keys():
            raise AssertionError("the page map disagrees with the tree")
        if hot != self._hot:
            raise AssertionError(f"hot-node counter {self._hot}, tree has {hot}")
        queued = {id(n) for lu, _, _, n in self._heap if n.last_used == lu}
        for node in seen.values():
            if self._evictable(node) and id(node) not in queued:
                raise AssertionError(f"evictable page {node.page} is missing from the heap")

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
        return [checked_int(t, "token id") for t in tokens]

    def __repr__(self) -> str:
        return (
            f"PrefixIndex(page_size={self.page_size}, cached_pages={self.num_cached_pages}, "
            f"salts={len(self._roots)})"
        )
