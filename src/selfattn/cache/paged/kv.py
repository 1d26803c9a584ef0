"""``PagedKV`` (a whole model's layers) and ``PagedCache`` (one layer): the paged cache's facade.

A :class:`PagedKV` composes the three rooms of the package: its :class:`BlockTable`
(``kv.blocks``: which pages each sequence holds, copy-on-write decisions, the prefix index),
its :class:`PageStore` (``kv.store``: the pages of every layer, writes and gathers) and the
step planner (:mod:`selfattn.cache.paged.plan`: one frozen :class:`StepPlan` per step). It
checks arguments, runs the table's decision, makes the store's copies and builds the plan.

Plan once per step, run per layer (the split a serving engine needs)::

    kv = PagedKV(L, N, P, Hkv, D, max_seqs=B, max_pages_per_seq=M)
    batch = kv.view(kv.add_sequences(B))      # row b of the model's batch = sequence ids[b]
    step = batch.plan(S)    # once: pages allocated (copy-on-write), block table, lengths and
                            # write slots as tensors on the pages' device
    h = block_i(h, cache=step.layers[i])      # per layer: write K/V at the slots, attend

Every change is planned and validated before anything is touched: a step that would exceed a
sequence's ``max_pages_per_seq × P`` tokens or the free (plus evictable) pages raises and leaves
pages, block tables, lengths, reference counts and the index as they were.
"""

from __future__ import annotations

import torch

from selfattn._validate import int_at_least, positive_int
from selfattn.cache.base import Step, real_entries
from selfattn.cache.paged import plan as planner
from selfattn.cache.paged.blocks import BlockTable
from selfattn.cache.paged.layer import PagedCacheView, PagedLayer
from selfattn.cache.paged.plan import StepPlan
from selfattn.cache.paged.store import PageStore, check_new_kv
from selfattn.cache.prefix import PrefixIndex
from selfattn.functional import paged_attention

__all__ = ["PagedCache", "PagedKV"]


class PagedKV:
    """Paged K/V of ``n_layers`` layers under one page allocator (module docstring).

    ``PagedKV(n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim=None, *, max_seqs,
    max_pages_per_seq, prefix_caching=False, dtype, device)``. ``num_pages`` (N) pages of
    ``page_size`` (P) tokens in each layer; at most ``max_seqs`` live sequences, each at most
    ``max_pages_per_seq`` pages long (the width of the block table). Sequence ids are ints handed
    out by :meth:`add_sequence` and :meth:`fork`; they are never reused. ``k_layers[i]`` /
    ``v_layers[i]`` are layer ``i``'s pages (memory layout: :mod:`selfattn.cache.paged.store`).

    ``dtype`` int8 or float8_e4m3fn stores quantised pages with ``k_scales`` / ``v_scales``;
    ``nbytes`` is the storage the pages and scales take.

    ``prefix_caching=True`` builds ``kv.index``, a :class:`PrefixIndex` over the pool (one passed
    to :meth:`add_sequence_from_prefix` / :meth:`cache_prefix` is adopted the same way). With an
    index, planning evicts least-recently-used cached pages when the pool runs short, and
    :meth:`check` counts the index's references.
    """

    # A long step (a prefill chunk) of a plain layer attends each sequence's gathered keys with
    # the dense kernels (PagedLayer._run); subclasses whose pages are not the sequence's keys in
    # order say False.
    query_blocks = True

    def __init__(
        self,
        n_layers: int,
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
        owner = type(self).__name__
        for name, x in (
            ("n_layers", n_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
            ("max_seqs", max_seqs),
            ("max_pages_per_seq", max_pages_per_seq),
        ):
            positive_int(x, f"{owner} {name}")
        value_dim = head_dim if value_dim is None else positive_int(value_dim, f"{owner} value_dim")
        self.store = self._make_store(n_layers, num_pages, page_size, n_kv_heads, head_dim,
                                      value_dim, dtype=dtype, device=device,
                                      max_seqs=max_seqs)  # fmt: skip
        self.blocks = BlockTable(num_pages, page_size, max_seqs=max_seqs,
                                 max_pages_per_seq=max_pages_per_seq,
                                 prefix_caching=prefix_caching)  # fmt: skip
        # the plan builders' keywords that stay for the cache's life (its geometry)
        self._shape = {"page_size": page_size, "max_pages": max_pages_per_seq,
                       "paired": self.store.kv_store is not None,
                       "device": self.store.k_store.device}  # fmt: skip

    def _make_store(self, n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim, *,
                    dtype, device, max_seqs):  # fmt: skip
        """The pages' store (a subclass storing pages otherwise returns its own)."""
        return PageStore(n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim,
                         dtype=dtype, device=device)  # fmt: skip

    # -- the rooms' public state ------------------------------------------------------------------
    k_store = property(lambda self: self.store.k_store, doc="``(L, N, P, Hkv, D)`` keys")
    v_store = property(lambda self: self.store.v_store, doc="``(L, N, P, Hkv, Dv)`` values")
    kv_store = property(lambda self: self.store.kv_store, doc="``(L, N, 2, P, Hkv, D)`` or None")
    k_layers = property(lambda self: self.store.k_layers, doc="L × ``(N, P, Hkv, D)`` views")
    v_layers = property(lambda self: self.store.v_layers, doc="L × ``(N, P, Hkv, Dv)`` views")
    k_scales = property(lambda self: self.store.k_scales, doc="quantised pages' key scales")
    v_scales = property(lambda self: self.store.v_scales, doc="quantised pages' value scales")
    pool = property(lambda self: self.blocks.pool, doc="the page allocator (BlockPool)")
    index = property(lambda self: self.blocks.index, doc="the PrefixIndex, or None")
    max_seqs = property(lambda self: self.blocks.max_seqs, doc="live sequences at most")
    max_pages_per_seq = property(lambda self: self.blocks.max_pages_per_seq,
                                 doc="pages of one sequence at most")  # fmt: skip
    max_len = property(
        lambda self: self.blocks.max_len,
        doc="tokens one sequence can hold: ``max_pages_per_seq × page_size``",
    )
    seq_ids = property(lambda self: self.blocks.seq_ids, doc="the live sequence ids")
    nbytes = property(
        lambda self: self.store.nbytes,
        doc="bytes of the K/V pages of every layer, with their scales",
    )

    @property
    def n_layers(self) -> int:
        return self.k_store.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k_store.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_store.shape[2]

    @property
    def writes_rows(self) -> bool:
        """Whether a step's rows go straight to the pages (:meth:`write_rows`): float pages
        and this class's own :meth:`write` (a subclass storing otherwise overrides it)."""
        return self.store.k_scales is None and type(self).write is PagedKV.write

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scales, v_scales)`` of ``layer`` for ``paged_attention`` (None for float pages)."""
        return self.store.layer_scales(layer)

    def attention_pages(self, layer: int, plan: StepPlan):
        """What layer ``layer`` of ``plan``'s step attends over: ``(k_pages, v_pages,
        block_table, attention plan, k_scales, v_scales)`` for ``paged_attention`` (the
        stored pages; a pool storing them otherwise returns float copies)."""
        return (self.k_layers[layer], self.v_layers[layer], plan.block_table, plan.attention,
                *self.layer_scales(layer))  # fmt: skip

    def pages(self, seq_id: int) -> list[int]:
        """The page ids of ``seq_id`` in token order (a copy)."""
        return self.blocks.pages(seq_id)

    def length(self, seq_id: int) -> int:
        return self.blocks.length(seq_id)

    # -- sequences --------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        return self.blocks.add()

    def add_sequences(self, n: int) -> list[int]:
        """``n`` new empty sequences (all or none); returns their ids."""
        return self.blocks.add_many(n)

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every page (and the length) of ``seq_id``; returns its id.

        Nothing is copied: each page gains a reference, and the first write into a shared page
        by either sequence copies that page first (copy-on-write, in every layer).
        """
        return self.blocks.fork(seq_id)

    def add_sequence_from_prefix(
        self, tokens, index: PrefixIndex | None = None, salt=None
    ) -> tuple[int, int]:
        """A new sequence starting from ``index``'s longest cached prefix of ``tokens``.

        Returns ``(seq_id, cached_tokens)``: the sequence's pages are the reused ones (their K/V
        in every layer) and its length is ``cached_tokens`` (a multiple of ``page_size``), so
        the caller runs only ``tokens[cached_tokens:]`` through the model. ``index`` defaults to
        ``kv.index``; one given must be built on this cache's pool and page size
        (``PrefixIndex(kv.pool, kv.page_size)``) and becomes ``kv.index``. The references that
        :meth:`PrefixIndex.acquire` takes become the sequence's own: :meth:`free` drops each
        exactly once, and the index keeps its separate reference. The next step opens a fresh
        page (the prefix ends on a page boundary), so shared pages are never written.
        """
        return self.blocks.add_from_prefix(tokens, index, salt)

    def cache_prefix(self, seq_id: int, tokens, index: PrefixIndex | None = None, salt=None) -> int:
        """Offer the full pages of ``seq_id`` to ``index``; returns how many became cached.

        ``tokens`` are the token ids whose K/V the sequence holds (at least ``length(seq_id)``
        of them; the rest are ignored). The index (default ``kv.index``) takes its own
        reference per newly cached page, so :meth:`free` stays correct.
        """
        return self.blocks.cache_prefix(seq_id, tokens, index, salt)

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id`` and its references; pages no other sequence shares become free."""
        self.blocks.free(seq_id)

    def truncate(self, seq_id: int) -> None:
        """Empty ``seq_id`` (length 0, its page references dropped) but keep it live."""
        self.blocks.truncate(seq_id)

    def evicted(self, seq_id: int) -> int:
        """Tokens :meth:`compact` removed from ``seq_id`` (0 if never compacted)."""
        return self.blocks.evicted(seq_id)

    def compact(self, seq_id: int, kept: torch.Tensor, counts=None) -> tuple[int, int]:
        """Keep, in each layer and KV head, the tokens ``kept (L, Hkv, n)`` of ``seq_id``
        (indices into its ``length`` tokens, ascending per head, as a KV-compression press
        chooses them) and free the pages the rest held.

        The kept tokens of layer ``l``, head ``h`` move to slots ``0 .. n-1`` (each head its
        own tokens in the same slots; quantised pages move with their scales); the sequence's
        length becomes ``n`` and its next tokens' positions continue after every token it has
        seen (:meth:`evicted`), so RoPE and causal order hold. The kept tokens go to pages the
        sequence alone holds, fresh ones only where it holds too few: pages others share (a
        cached prefix, a fork) are never written (:meth:`BlockTable.compact`).

        ``counts (L, Hkv)``: ragged kept counts (PyramidKV's per-layer budgets, AdaKV's per-head
        ones): layer ``l``, head ``h`` keeps its first ``counts[l, h]`` entries of ``kept`` (the
        rest is padding), and slots ``[counts[l, h], n)`` become its hole, zeroed and skipped
        by its attention (:mod:`selfattn.cache.paged.holes`; the length is ``n``, so the pages
        saved are those past the largest count). Returns ``(tokens removed from the longest
        head, pages freed by the sequence)``.
        """
        if type(self) is not PagedKV:
            raise TypeError(
                f"{type(self).__name__} places tokens itself; compaction needs a plain PagedKV"
            )
        have = self.blocks.length(seq_id)
        L, Hkv = self.n_layers, self.k_store.shape[3]
        if not isinstance(kept, torch.Tensor) or kept.dim() != 3 or kept.shape[:2] != (L, Hkv):
            got = tuple(kept.shape) if isinstance(kept, torch.Tensor) else type(kept).__name__
            raise ValueError(f"kept must be (L={L}, Hkv={Hkv}, n) token indices, got {got}")
        if self.blocks.holes(seq_id) is not None:
            raise ValueError(
                f"sequence {seq_id} was compacted to ragged counts already; compact it once"
            )
        n = kept.shape[2]
        kept = kept.to(torch.long).cpu()
        real = None  # (L, Hkv, n): which entries of kept are real
        if counts is not None:
            real = real_entries(counts, {"L": L, "Hkv": Hkv}, n, "cpu")
        if real is not None:  # padding copies each head's first kept token, then is zeroed
            kept = torch.where(real, kept, kept[..., :1])
        step = kept.diff()
        if real is not None:
            step = step.masked_fill(~real[..., 1:], 1)
        if n and (int(kept.min()) < 0 or int(kept.max()) >= have or bool((step <= 0).any())):
            raise ValueError(
                f"kept must hold ascending, distinct token indices in 0..{have - 1} per head "
                f"(sequence {seq_id} holds {have} tokens)"
            )
        old, new = self.blocks.compact(seq_id, n)
        device = self.k_store.device
        P = self.page_size
        src_pages = torch.tensor(old, dtype=torch.long)[kept // P].to(device)  # (L, Hkv, n)
        dst = torch.arange(n, device=device)
        dst_pages = torch.tensor(new, dtype=torch.long, device=device)[dst // P]
        self.store.move_rows((src_pages, kept.to(device) % P), (dst_pages, dst % P))
        if real is not None and not bool(real.all()):
            layer, head, slot = (~real).nonzero(as_tuple=True)
            slot = slot.to(device)
            self.store.clear_rows(layer, dst_pages[slot], slot % P, head.to(device))
            ends = torch.full((L, Hkv), n, dtype=torch.long)
            self.blocks.set_holes(seq_id, torch.stack((real.sum(-1), ends), dim=-1))
        return have - n, len(old) - len(new)

    def trim(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id`` and free the pages past them: a
        speculative step rolls its rejected tokens back this way. ValueError when ``length``
        is not in ``0..length(seq_id)``."""
        self.blocks.trim(seq_id, length)

    # -- one step: plan once, write per layer -----------------------------------------------------
    def plan(self, seq_ids, n_tokens: int) -> StepPlan:
        """Reserve ``n_tokens`` slots after the cached tokens of each sequence in ``seq_ids``.

        Allocates the pages the new tokens need (copying a shared last page first, in every
        layer), advances the lengths, and returns the step's tensors (:class:`StepPlan`); each
        layer then writes its K/V with :meth:`write` and attends. Raises ValueError past a
        sequence's ``max_len`` and RuntimeError when the pool has too few free pages, in both
        cases before changing anything.
        """
        ids = self.blocks.checked_ids(seq_ids)
        int_at_least(n_tokens, "n_tokens", 0)
        before, copies = self._reserve(ids, [n_tokens] * len(ids))
        return planner.build(before, self.blocks.page_lists(ids), n_tokens,
                             num_pages=self.num_pages, epoch=self.blocks.epoch, copies=copies,
                             offsets=self.blocks.offsets(ids),
                             holes=self.blocks.hole_lists(ids), **self._shape)  # fmt: skip

    def plan_packed(self, seq_ids, counts) -> Step:
        """Plan one step that appends ``counts[i]`` tokens to sequence ``seq_ids[i]`` (a
        packed step: :mod:`selfattn.cache.paged.plan`), for every layer.

        The model's input is the ``T = sum(counts)`` tokens in that order as one row ``(1, T)``;
        the returned :class:`~selfattn.cache.base.Step` has ``positions (1, T)`` and
        ``layers[i]`` a :class:`PagedLayer` over the packed plan. Pages, copy-on-write and
        errors as :meth:`plan` (nothing changes when it raises).
        """
        ids = self.blocks.checked_ids(seq_ids)
        counts = list(counts)
        if len(counts) != len(ids) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts
        ):
            raise ValueError(
                f"counts must hold one int >= 1 per sequence ({len(ids)}), got {counts!r}"
            )
        before, copies = self._reserve(ids, counts)
        return self._packed_step(ids, counts, before, copies)

    def apply_plan(self, seq_ids, counts, lengths, page_lists, copies=()) -> Step:
        """Mirror a packed step planned by another :class:`PagedKV` of the same geometry (a
        tensor-parallel peer of rank 0): copy the pages it copied on write (``(old, new)``
        pairs, a plan's ``copies``), take its sequences ``seq_ids`` with ``lengths`` tokens
        before the step and ``page_lists`` after it as this cache's whole table, and plan the
        step of ``counts`` tokens each. Returns the :class:`~selfattn.cache.base.Step`, equal to
        the one rank 0 runs."""
        for old, new in copies:
            self.store.copy_page(old, new)
        before = self.blocks.adopt(seq_ids, counts, lengths, page_lists)
        return self._packed_step(list(seq_ids), list(counts), before, copies)

    def _reserve(self, ids: list[int], counts: list[int]):
        """The table's reservation, with the store's copy-on-write copies made."""
        before, copies = self.blocks.reserve(ids, counts)
        for old, new in copies:
            self.store.copy_page(old, new)
        return before, copies

    def _packed_step(self, ids, counts, before, copies) -> Step:
        """The :class:`Step` of a packed step whose pages are reserved."""
        plan = planner.build_packed(before, self.blocks.page_lists(ids), counts,
                                    num_pages=self.num_pages, epoch=self.blocks.epoch,
                                    copies=copies, offsets=self.blocks.offsets(ids),
                                    holes=self.blocks.hole_lists(ids),
                                    **self._shape)  # fmt: skip
        layers = [PagedLayer(self, plan, i) for i in range(self.n_layers)]
        return Step(layers, plan.positions.view(1, -1), None)

    def write(self, layer: int, plan: StepPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer ``layer``'s ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` of the planned
        step at its slots (shapes as planned: :class:`PagedLayer` checks them)."""
        B, Hkv, S, D = k.shape
        # (B, Hkv, S, ·) -> (B·S, Hkv, ·): row b·S + s is slot slots[b·S + s]
        k_rows = k.transpose(1, 2).reshape(B * S, Hkv, D)
        v_rows = v.transpose(1, 2).reshape(B * S, Hkv, v.shape[3])
        self.write_rows(layer, plan, k_rows, v_rows)

    def write_rows(self, layer: int, plan: StepPlan, k_rows: torch.Tensor, v_rows) -> None:
        """:meth:`write` of ``k_rows (B·S, Hkv, D)``, ``v_rows (B·S, Hkv, Dv)``: row ``b·S + s``
        is token ``s`` of sequence ``b``."""
        self.store.write_rows(layer, plan, k_rows, v_rows)

    def undo(self, plan: StepPlan) -> None:
        """Return the sequences of ``plan`` (the latest plan) to their lengths and pages before
        it; pages it allocated are freed (a copied-on-write last page stays, holding the same
        tokens as the shared one it replaced)."""
        self.blocks.undo(plan.before, plan.epoch)

    # -- reads ------------------------------------------------------------------------------------
    def block_table(self, seq_ids) -> torch.Tensor:
        """``(B, max_pages_per_seq)`` int32 page ids of each sequence in order; -1 past them."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        table = torch.full((len(ids), self.max_pages_per_seq), -1, dtype=torch.int32)
        for b, s in enumerate(ids):
            pages = self.blocks.pages(s)
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table.to(self.k_store.device)

    def seq_lens(self, seq_ids) -> torch.Tensor:
        """``(B,)`` int32 valid tokens per sequence."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        lens = [self.blocks.length(s) for s in ids]
        return torch.tensor(lens, dtype=torch.int32, device=self.k_store.device)

    def gather(self, seq_id: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies ``(Hkv, length, D)``, ``(Hkv, length, Dv)`` of one sequence's K/V
        in ``layer``."""
        ids = torch.tensor(self.blocks.pages(seq_id), dtype=torch.long, device=self.k_store.device)
        return self.gather_pages(ids, self.blocks.length(seq_id), layer)

    def gather_pages(self, ids: torch.Tensor, n: int, layer: int = 0):
        """:meth:`gather` of the first ``n`` tokens held by pages ``ids`` (int64, in order)."""
        return self.store.gather_pages(ids, n, layer)

    def view(self, seq_ids) -> PagedCacheView:
        """The cache of a model batch whose row ``b`` is sequence ``seq_ids[b]``
        (:class:`PagedCacheView`)."""
        return PagedCacheView(self, self.blocks.checked_ids(seq_ids))

    def check(self) -> None:
        """Raise AssertionError unless every page's pool count equals its holders.

        Holders are the sequences listing the page plus ``kv.index`` when it caches it. So
        ``free + used by sequences + held by the index alone == num_pages``, no count is
        negative, and no page is both free and referenced (the pool's own check).
        """
        self.blocks.check()

    def __repr__(self) -> str:
        L, N, P, Hkv, D = self.k_store.shape
        return (
            f"{type(self).__name__}(n_layers={L}, num_pages={N}, page_size={P}, n_kv_heads={Hkv}, "
            f"head_dim={D}, seqs={len(self.seq_ids)}, free_pages={self.pool.num_free})"
        )


class PagedCache(PagedKV):
    """A :class:`PagedKV` of one layer, with per-layer conveniences: ``k_pages``/``v_pages``
    (its ``(N, P, Hkv, ·)`` pages), :meth:`append`, :meth:`attention`.

    ``PagedCache(num_pages, page_size, n_kv_heads, head_dim, value_dim=None, *, max_seqs,
    max_pages_per_seq, prefix_caching=False, dtype, device)``. A model of ``L`` layers uses
    one :class:`PagedKV` (one allocator and block table for all layers) rather than ``L`` of
    these.
    """

    def __init__(self, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
                 value_dim: int | None = None, **kw):  # fmt: skip
        super().__init__(1, num_pages, page_size, n_kv_heads, head_dim, value_dim, **kw)
        self.k_pages, self.v_pages = self.k_layers[0], self.v_layers[0]

    def append(self, seq_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``S`` new tokens after the cached ones of each sequence in ``seq_ids``.

        ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` with ``B = len(seq_ids)`` (an int id is a
        batch of one). Pages are allocated as needed; a shared last page is copied first. Raises
        ValueError past a sequence's ``max_len`` and RuntimeError when the pool has too few free
        pages, in both cases before changing anything.
        """
        ids = self.blocks.checked_ids(seq_ids)
        S = check_new_kv(self.store, len(ids), k, v)
        self.write(0, self.plan(ids, S), k, v)

    def attention(self, q: torch.Tensor, seq_ids, *, mask=None, score_mod=None, scale=None):
        """:func:`~selfattn.functional.paged_attention` of ``q (B, Hq, Sq, D)`` over the pages.

        The ``Sq`` queries of sequence ``b`` are its last ``Sq`` cached tokens (append them
        first); returns ``(B, Hq, Sq, Dv)``.
        """
        ids = self.blocks.checked_ids(seq_ids)
        return paged_attention(q, self.k_pages, self.v_pages, self.block_table(ids),
                               self.seq_lens(ids), mask=mask, score_mod=score_mod,
                               scale=scale)  # fmt: skip
