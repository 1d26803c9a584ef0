"""Paged KV caches: :class:`PagedKV` (a whole model's layers) and :class:`PagedCache` (one layer).

Keys and values live in fixed-size pages, ``k_pages (N, P, Hkv, D)`` and ``v_pages
(N, P, Hkv, Dv)`` per layer, stored for all ``L`` layers at once as ``k_store (L, N, P, Hkv, D)``
and ``v_store (L, N, P, Hkv, Dv)``. Where ``Dv == D`` both are views of one pool, ``kv_store
(L, N, 2, P, Hkv, D)``: a page's keys and then its values, adjacent in memory (FlashInfer's
``(num_pages, 2, page_size, num_kv_heads, head_dim)`` layout per layer), so that a decode reads
one run per page where two pools make it two places far apart (a faster decode in every page
dtype: BENCHMARKS.md).
``kv_store`` is None where ``Dv != D`` (two pools).

One :class:`~selfattn.cache.pool.BlockPool` of page ids serves every layer: page ``p`` of
layer ``i`` holds the layer-``i`` K/V of the same tokens as page ``p`` of every other layer, so
a sequence has one ordered page list, one length, one reference per page, and one block table
for the whole model. Token ``t`` of a sequence sits in slot ``t % P``
of its page number ``t // P``::

    pages of seq 0 = [3, 0]      P = 4, length 6
    token position   0 1 2 3 | 4 5 · ·
    page             3       | 0          (· = free slot, written by the next append)

Plan once per step, run per layer (the split a serving engine needs)::

    kv = PagedKV(L, N, P, Hkv, D, max_seqs=B, max_pages_per_seq=M)
    batch = kv.view(kv.add_sequences(B))      # row b of the model's batch = sequence ids[b]
    step = batch.plan(S)    # once: pages allocated (copy-on-write), block table, lengths and
                            # write slots as tensors on the pages' device
    h = block_i(h, cache=step.layers[i])      # per layer: write K/V at the slots, attend

:meth:`PagedKV.fork` shares every page of a sequence with a new one (a reference more per page,
nothing copied). Copy-on-write happens at the first write into a shared page: only the last,
partly filled page is ever written, so a step whose sequence shares that page first copies it
(in every layer) to a fresh page, unless the sharers that copied it away in the same step left
it to this sequence alone (then it writes in place: one copy per sharer but the last). A shared
prefix that ends exactly on a page boundary is never copied: the next token opens a new page.

With a prefix index (``prefix_caching=True``, :mod:`selfattn.cache.prefix`), full pages of
finished or prefilled sequences stay cached for later requests (for every layer at once), and a
step short of free pages evicts the least recently used of those the index alone holds.

Quantised pages (``dtype=torch.int8`` or ``torch.float8_e4m3fn``, :mod:`selfattn.cache.quant`): each
token's K/V is quantised when written and read back through ``paged_attention``'s scales. int8 keeps
one bfloat16 scale per (layer, page slot, kv head), ``k_scales (L, N, P, Hkv)``, copied with its
page on copy-on-write; fp8 one float32 per (layer, kv head), ``k_scales (L, Hkv)``, fixed by the
first write into the layer (its absolute maximum × :data:`FP8_HEADROOM` / 448; larger values
saturate). Queries may then be any float dtype.

A packed step (:meth:`PagedKV.plan_packed`) runs sequences with different numbers of new tokens
in one forward: a continuous-batching step of prefill chunks and decode tokens::

    seq_ids = [4, 9, 2]   counts = [3, 1, 1]    T = 5 tokens, the model's input (1, T)
    token rows            4 4 4 9 2             each token is a row of the plan: its own
    seq_lens              6 7 8 3 12            length (position + 1) and its sequence's pages

A short chunk's tokens (decode tokens, chunks of at most :data:`PACKED_ROWS_MAX`) are query
rows of one ``paged_attention`` call together, each over its sequence's pages up to its own
position: causal order inside the chunk needs no mask, and the decode kernels serve them all at
once. A longer chunk attends as one query block: its sequence's K/V are gathered from the pages
once (a copy of ``length`` keys) and :func:`~selfattn.functional.attention` runs over them
(SDPA's fused kernel on CPU for causal and windowed layers), where ``Sq`` rows of one token
each would read the sequence's keys ``Sq`` times.

Every change is planned and validated before anything is touched: a step that would exceed a
sequence's ``max_pages_per_seq × P`` tokens or the free (plus evictable) pages raises and leaves
pages, block tables, lengths, reference counts and the index as they were. A layer that fails
during a planned step (bad input) undoes the step's bookkeeping before the error propagates.
"""

from __future__ import annotations

import dataclasses

import torch

from selfattn._validate import checked_int, int_at_least, positive_int
from selfattn.backends.paged.call import QUANT_DTYPES
from selfattn.backends.paged.plan import PagedAttentionPlan
from selfattn.cache import memory
from selfattn.cache.base import Step, next_positions
from selfattn.cache.pool import BlockPool
from selfattn.cache.prefix import PrefixIndex
from selfattn.cache.quant import (
    FP8_MAX,
    INT8_SCALE_DTYPE,
    dequantize,
    quantize_fp8,
    quantize_int8,
)
from selfattn.functional import attention, attention_weights, paged_attention
from selfattn.masks import as_mask, from_tensor
from selfattn.scores import as_score_mod

__all__ = ["FP8_HEADROOM", "PACKED_ROWS_MAX", "PackedLayer", "PagedCache", "PagedCacheView",
           "PagedKV", "PagedLayer", "PagedPlan"]  # fmt: skip

# fp8 pages: the per-head scale leaves room for values this many times the first write's
# largest before they saturate (e4m3 keeps 3 mantissa bits at any exponent, so the headroom
# costs no precision above 448 / FP8_HEADROOM / 2**6 of the scale's range).
FP8_HEADROOM = 8.0
# Packed steps: chunks of at most this many tokens attend as rows of one call (module
# docstring), longer ones as a query block over their gathered K/V. The C kernel serves up to
# 16 query rows of a sequence per page read (backends/paged/cpu.py KERNEL_MAX_SQ); as separate
# rows a long prompt re-reads its keys once per 16 rows, and the paged PyTorch path over a long
# block runs far below a gathered block's matmul rate.
PACKED_ROWS_MAX = 16


@dataclasses.dataclass(eq=False)
class PagedPlan:
    """The bookkeeping of one step over ``seq_ids`` as tensors on the pages' device.

    ``lengths (B,)`` int64 tokens before the step; ``seq_lens (B,)`` int32 after it (what
    :func:`paged_attention` reads); ``block_table (B, max_pages_per_seq)`` int32, -1 past each
    sequence's pages; ``slots (B·S,)`` int64 flat slot ``page · P + t % P`` of each new token,
    row-major over ``(b, s)``; ``positions`` the new tokens' positions, ``(S,)`` when every
    sequence has the same length ``past`` (else ``past`` is None and they are ``(B, S)``);
    ``max_len`` the longest sequence after the step; ``attention`` the
    :class:`~selfattn.backends.paged.plan.PagedAttentionPlan` of ``block_table`` and
    ``seq_lens`` that every layer's ``paged_attention`` shares (checks, backend choice and key
    intervals once per step).

    A packed plan (:meth:`PagedKV.plan_packed`) covers ``T`` tokens of several sequences:
    ``seq_ids`` names each token's sequence, ``n_tokens`` is 1, ``slots`` and ``lengths`` (each
    token's position) cover all ``T``; ``rows`` are the tokens of short chunks, whose
    ``seq_lens`` (position + 1), ``block_table`` (their sequence's pages) and ``attention``
    describe one call with a row per token; ``blocks`` the long chunks, attended one by one.
    """

    seq_ids: list[int]
    n_tokens: int
    lengths: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    past: int | None
    max_len: int
    # (seq id, pages before, length before) per sequence, and the planner's epoch: for undo().
    before: list[tuple[int, int, int]]
    epoch: int
    attention: PagedAttentionPlan
    rows: torch.Tensor | None = None  # packed plans: (T_rows,) indices of the row tokens
    # with a kv_store: (2, T) rows of each new token's key and value in a layer's kv_store seen
    # as (N·2·P, Hkv, D) rows: page · 2P + t % P, and P more
    pair_slots: torch.Tensor | None = None
    blocks: tuple[PackedBlock, ...] = ()
    # PagedLayer.attend_rows: (mask, score mod, scale, sinks, shapes) -> its checked call
    fast: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class PackedBlock:
    """A long chunk of a packed step: tokens ``start .. start + n - 1`` of the step, the last
    ``n`` of sequence ``seq_id`` (``ids``: its page ids, ``length``: its tokens after the
    step)."""

    start: int
    n: int
    seq_id: int
    ids: torch.Tensor
    length: int


class PagedKV:
    """Paged K/V of ``n_layers`` layers under one page allocator (module docstring).

    ``PagedKV(n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim=None, *, max_seqs,
    max_pages_per_seq, prefix_caching=False, dtype, device)``. ``num_pages`` (N) pages of
    ``page_size`` (P) tokens in each layer; at most ``max_seqs`` live sequences, each at most
    ``max_pages_per_seq`` pages long (the width of the block table). Sequence ids are ints handed
    out by :meth:`add_sequence` and :meth:`fork`; they are never reused. ``k_layers[i]`` /
    ``v_layers[i]`` are layer ``i``'s pages (views of ``k_store`` / ``v_store``, themselves views of
    one ``kv_store`` where ``Dv == D``: module docstring).

    ``dtype`` int8 or float8_e4m3fn stores quantised pages with ``k_scales`` / ``v_scales``
    (module docstring); ``nbytes`` is the storage the pages and scales take.

    ``prefix_caching=True`` builds ``kv.index``, a :class:`PrefixIndex` over the pool (one passed
    to :meth:`add_sequence_from_prefix` / :meth:`cache_prefix` is adopted the same way). With an
    index, planning evicts least-recently-used cached pages when the pool runs short, and
    :meth:`check` counts the index's references.
    """

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
        fk = {"dtype": dtype, "device": device}
        shape = (n_layers, num_pages, page_size, n_kv_heads)
        # (L, N, 2, P, Hkv, D) with its K and V views where Dv == D, else (L, N, P, Hkv, D) and
        # (L, N, P, Hkv, Dv); on huge pages where the OS has them (memory.py)
        self.kv_store: torch.Tensor | None = None
        if value_dim == head_dim:
            self.kv_store = memory.zeros(n_layers, num_pages, 2, *shape[2:], head_dim, **fk)
            self.k_store, self.v_store = self.kv_store[:, :, 0], self.kv_store[:, :, 1]
        else:
            self.k_store = memory.zeros(*shape, head_dim, **fk)
            self.v_store = memory.zeros(*shape, value_dim, **fk)
        # L × (N, P, Hkv, ·) views (one select each: unbind's views refuse in-place writes
        # under autograd)
        self.k_layers = [self.k_store[i] for i in range(n_layers)]
        self.v_layers = [self.v_store[i] for i in range(n_layers)]
        # L × the layer's (K, V) pages as rows, for writes without autograd (write_rows)
        self._rows = [self._layer_rows(i) for i in range(n_layers)]
        # Quantised pages: int8 bfloat16 scales (L, N, P, Hkv), fp8 float32 (L, Hkv); None for
        # float pages.
        self.k_scales = self.v_scales = None
        if dtype in QUANT_DTYPES:
            int8 = dtype == torch.int8
            per = shape if int8 else (n_layers, n_kv_heads)
            sk = {"dtype": INT8_SCALE_DTYPE if int8 else torch.float32, "device": device}
            self.k_scales, self.v_scales = torch.ones(*per, **sk), torch.ones(*per, **sk)
        self._scaled = [False] * n_layers  # fp8: the layer's scales are set (first write)
        self.pool = BlockPool(num_pages)
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0
        self._epoch = 0  # one more per plan: only the latest plan can be undone
        self.index: PrefixIndex | None = None
        if prefix_caching:
            self.index = PrefixIndex(self.pool, page_size)

    def _layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V pages as rows to write at a plan's slots: ``(N·P, Hkv,
        ·)`` views of the two pools (indexed by ``plan.slots``), or with a ``kv_store`` its
        ``(N·2·P, Hkv, D)`` view twice (indexed by ``plan.pair_slots``)."""
        if self.kv_store is not None:
            rows = self.kv_store[layer].view(-1, *self.kv_store.shape[-2:])
            return rows, rows
        k, v = self.k_store[layer], self.v_store[layer]
        return k.view(-1, *k.shape[-2:]), v.view(-1, *v.shape[-2:])

    def _pair_slots(self, slots: list[int]) -> list[int]:
        """``slots`` (flat ``page · P + t % P``) as rows of a layer's ``kv_store`` viewed as
        ``(N·2·P, Hkv, D)``: the keys' rows, then the values' (P rows later); [] without one."""
        if self.kv_store is None:
            return []
        P = self.page_size
        keys = [s + s // P * P for s in slots]
        return keys + [r + P for r in keys]

    # -- shape facts ------------------------------------------------------------------------------
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
    def nbytes(self) -> int:
        """Bytes of the K/V pages of every layer, with their quantisation scales."""
        scales = (self.k_scales, self.v_scales) if self.k_scales is not None else ()
        return sum(t.nbytes for t in (self.k_store, self.v_store, *scales))

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scales, v_scales)`` of ``layer`` for ``paged_attention`` (None for float pages)."""
        if self.k_scales is None:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

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
        checked_int(seq_id, "sequence id")
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
        by either sequence copies that page first (copy-on-write, in every layer).
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

        Returns ``(seq_id, cached_tokens)``: the sequence's pages are the reused ones (their K/V
        in every layer) and its length is ``cached_tokens`` (a multiple of ``page_size``), so
        the caller runs only ``tokens[cached_tokens:]`` through the model. ``index`` defaults to
        ``kv.index``; one given must be built on this cache's pool and page size
        (``PrefixIndex(kv.pool, kv.page_size)``) and becomes ``kv.index``. The references that
        :meth:`PrefixIndex.acquire` takes become the sequence's own: :meth:`free` drops each
        exactly once, and the index keeps its separate reference. The next step opens a fresh
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
        of them; the rest are ignored). The index (default ``kv.index``) takes its own
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
                "so that eviction and check() see every cached page"
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

    # -- one step: plan once, write per layer -----------------------------------------------------
    def plan(self, seq_ids, n_tokens: int) -> PagedPlan:
        """Reserve ``n_tokens`` slots after the cached tokens of each sequence in ``seq_ids``.

        Allocates the pages the new tokens need (copying a shared last page first, in every
        layer), advances the lengths, and returns the step's tensors (:class:`PagedPlan`); each
        layer then writes its K/V with :meth:`write` and attends. Raises ValueError past a
        sequence's ``max_len`` and RuntimeError when the pool has too few free pages, in both
        cases before changing anything.
        """
        ids = self._ids(seq_ids)
        int_at_least(n_tokens, "n_tokens", 0)
        S, P, M = n_tokens, self.page_size, self.max_pages_per_seq
        before = [(s, len(self._pages[s]), self._lens[s]) for s in ids]
        if S and ids:
            self._reserve(ids, S)
        self._epoch += 1
        # One host tensor, one copy to the device: lengths (B), slots (B·S), table (B·M).
        flat = [n for _, _, n in before]
        for s, _, n in before:
            pages = self._pages[s]
            flat += [pages[t // P] * P + t % P for t in range(n, n + S)]
        for s in ids:
            pages = self._pages[s]
            flat += pages
            flat += [-1] * (M - len(pages))
        B = len(ids)
        flat += self._pair_slots(flat[B : B * (S + 1)])
        t = torch.tensor(flat, dtype=torch.long).to(self.k_store.device, non_blocking=True)
        lengths, slots = t[:B], t[B : B * (S + 1)]
        end = B * (S + 1) + B * M
        table = t[B * (S + 1) : end].view(B, M).to(torch.int32)
        pair_slots = t[end:].view(2, B * S) if self.kv_store is not None else None
        lens = {n for _, _, n in before}
        past = lens.pop() if len(lens) == 1 else None
        seq_lens = (lengths + S).to(torch.int32)
        return PagedPlan(
            seq_ids=ids,
            n_tokens=S,
            lengths=lengths,
            seq_lens=seq_lens,
            block_table=table,
            slots=slots,
            positions=next_positions(lengths if past is None else past, S, t.device),  # (S,)|(B, S)
            past=past if B else 0,
            max_len=max((n for _, _, n in before), default=0) + S,
            before=before,
            epoch=self._epoch,
            # ours: valid for our pool and this step (_reserve checked the lengths)
            attention=PagedAttentionPlan(table, seq_lens, valid_for=(self.num_pages, P, S)),
            pair_slots=pair_slots,
        )

    def plan_packed(self, seq_ids, counts) -> Step:
        """Plan one step that appends ``counts[i]`` tokens to sequence ``seq_ids[i]`` (module
        docstring: a packed step), for every layer.

        The model's input is the ``T = sum(counts)`` tokens in that order as one row ``(1, T)``;
        the returned :class:`~selfattn.cache.base.Step` has ``positions (1, T)`` and
        ``layers[i]`` a :class:`PackedLayer`. Pages, copy-on-write and errors as :meth:`plan`
        (nothing changes when it raises).
        """
        ids = self._ids(seq_ids)
        counts = list(counts)
        if len(counts) != len(ids) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts
        ):
            raise ValueError(
                f"counts must hold one int >= 1 per sequence ({len(ids)}), got {counts!r}"
            )
        before = [(s, len(self._pages[s]), self._lens[s]) for s in ids]
        if ids:
            self._reserve(ids, counts)
        return self._packed_step(ids, counts, before)

    def _packed_step(self, ids: list[int], counts: list[int], before) -> Step:
        """The :class:`Step` of a packed step whose pages are reserved: ``before`` holds each
        sequence's ``(id, pages before, length before)``, ``self._pages`` its pages after.
        (A tensor-parallel worker's mirror, :mod:`selfattn.serving.parallel`, sets the pages
        rank 0 reserved and calls this.)"""
        P, M = self.page_size, self.max_pages_per_seq
        self._epoch += 1
        # One host tensor, one copy: slots (T), positions (T), table (B·M), for the row tokens
        # their index in T and their sequence's row of the table, then each block's length.
        slots, pos, table, rows, row_of, spans = [], [], [], [], [], []
        for b, ((s, _, n), c) in enumerate(zip(before, counts)):
            pages = self._pages[s]
            start = len(slots)
            slots += [pages[t // P] * P + t % P for t in range(n, n + c)]
            pos += range(n, n + c)
            table += pages + [-1] * (M - len(pages))
            if c <= PACKED_ROWS_MAX:
                rows += range(start, start + c)
                row_of += [b] * c
            else:
                spans.append((start, c, s, len(table) - M, len(pages), n + c))
        T, B, R = len(slots), len(ids), len(rows)
        t = torch.tensor(slots + pos + table + rows + row_of + self._pair_slots(slots))
        t = t.to(self.k_store.device, non_blocking=True)
        pair_slots = t[2 * T + B * M + 2 * R :].view(2, T) if self.kv_store is not None else None
        positions = t[T : 2 * T]
        tables = t[2 * T : 2 * T + B * M].view(B, M).to(torch.int32)
        rows_t = t[2 * T + B * M : 2 * T + B * M + R]
        row_table = tables[t[2 * T + B * M + R : 2 * T + B * M + 2 * R]]  # (R, M)
        row_lens = (positions[rows_t] + 1).to(torch.int32)
        pages_of = t[2 * T : 2 * T + B * M]
        blocks = tuple(
            PackedBlock(start, c, s, pages_of[at : at + used], length)
            for start, c, s, at, used, length in spans
        )
        plan = PagedPlan(
            seq_ids=[s for s, c in zip(ids, counts) for _ in range(c)],
            n_tokens=1,
            lengths=positions,
            seq_lens=row_lens,
            block_table=row_table,
            slots=t[:T],
            positions=positions.view(T, 1),
            past=None,
            max_len=max((n + c for (_, _, n), c in zip(before, counts)), default=0),
            before=before,
            epoch=self._epoch,
            attention=PagedAttentionPlan(row_table, row_lens),
            rows=rows_t,
            blocks=blocks,
            pair_slots=pair_slots,
        )
        layers = [PackedLayer(self, plan, i) for i in range(self.n_layers)]
        return Step(layers, positions.view(1, T), None)

    def _reserve(self, ids: list[int], S) -> None:
        """Pages for ``S`` more tokens of each sequence (an int, or one count per sequence;
        copy-on-write of a shared last page in every layer) and the new lengths; validated in
        full before anything changes."""
        P = self.page_size
        counts = [S] * len(ids) if isinstance(S, int) else list(S)
        # Plan: per sequence, does its last page need a copy, and how many new pages? Holders
        # of a shared page that copy it away leave fewer behind: when every sharer writes in
        # this step, the last one finds itself the sole holder and writes in place.
        n_new, cow = [], []
        holders: dict[int, int] = {}
        for s, S in zip(ids, counts):
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
                f"appending {counts} token(s) to sequences {ids} needs {need} free page(s) but the "
                f"pool has {self.pool.num_free} of {self.num_pages} (+{evictable} evictable "
                "cached); free sequences or build a larger pool"
            )
        fresh = self._allocate(need)  # cannot fail now: checked above
        for s, copy, m, S in zip(ids, cow, n_new, counts):
            mine, fresh = fresh[:m], fresh[m:]
            pages = self._pages[s]
            if copy:
                # Copy-on-write: the shared last page goes to a fresh page this sequence owns.
                old, new = pages[-1], mine.pop(0)
                self._copy_page(old, new)
                self.pool.decref([old])
                pages[-1] = new
            pages.extend(mine)
            self._lens[s] += S

    def _copy_page(self, old: int, new: int) -> None:
        """Page ``old``'s K/V (and int8 scales) into page ``new``, in every layer at once."""
        if self.kv_store is not None:
            self.kv_store[:, new].copy_(self.kv_store[:, old])
        else:
            self.k_store[:, new].copy_(self.k_store[:, old])
            self.v_store[:, new].copy_(self.v_store[:, old])
        if self.k_scales is not None and self.k_scales.dim() == 4:  # int8: per slot
            self.k_scales[:, new].copy_(self.k_scales[:, old])
            self.v_scales[:, new].copy_(self.v_scales[:, old])

    def _allocate(self, n: int) -> list[int]:
        """``n`` fresh pages, evicting least-recently-used cached pages when the pool is short."""
        if self.index is None:
            return self.pool.allocate(n)
        return self.index.allocate_with_eviction(n)

    def write(self, layer: int, plan: PagedPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer ``layer``'s ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` of the planned
        step at its slots (shapes as planned: :class:`PagedLayer` checks them)."""
        B, Hkv, S, D = k.shape
        # (B, Hkv, S, ·) -> (B·S, Hkv, ·): row b·S + s is slot slots[b·S + s]
        k_rows = k.transpose(1, 2).reshape(B * S, Hkv, D)
        v_rows = v.transpose(1, 2).reshape(B * S, Hkv, v.shape[3])
        self.write_rows(layer, plan, k_rows, v_rows)

    def write_rows(self, layer: int, plan: PagedPlan, k_rows: torch.Tensor, v_rows) -> None:
        """:meth:`write` of ``k_rows (B·S, Hkv, D)``, ``v_rows (B·S, Hkv, Dv)``: row ``b·S + s``
        is token ``s`` of sequence ``b``."""
        Hkv = k_rows.shape[1]
        # The layer's pages as rows (_layer_rows), a view made now under autograd: one made
        # before a write would be refused there as a stale leaf.
        kr, vr = self._layer_rows(layer) if torch.is_grad_enabled() else self._rows[layer]
        if self.kv_store is not None:
            ki, vi = plan.pair_slots
        else:
            ki = vi = plan.slots
        if self.k_scales is None:
            # the dtype tests skip no-op ``to`` calls: a write runs once per layer of each step
            kr.index_copy_(0, ki, k_rows if k_rows.dtype == kr.dtype else k_rows.to(kr.dtype))
            vr.index_copy_(0, vi, v_rows if v_rows.dtype == vr.dtype else v_rows.to(vr.dtype))
            return
        if kr.dtype != torch.int8 and not self._scaled[layer]:
            for rows, scales in ((k_rows, self.k_scales), (v_rows, self.v_scales)):
                amax = rows.detach().abs().float().amax(dim=(0, 2)) * (FP8_HEADROOM / FP8_MAX)
                scales[layer] = torch.where(amax > 0, amax, torch.ones_like(amax))  # (Hkv,)
            self._scaled[layer] = True
        for rows, flat, at, scales in (
            (k_rows, kr, ki, self.k_scales[layer]),
            (v_rows, vr, vi, self.v_scales[layer]),
        ):
            if flat.dtype == torch.int8:
                q, s = quantize_int8(rows)  # (T, Hkv, ·) int8, (T, Hkv) bfloat16
                flat.index_copy_(0, at, q)
                scales.view(-1, Hkv).index_copy_(0, plan.slots, s)
            else:  # fp8: the layer's per-head scales; index_copy_ moves the bytes
                q, _ = quantize_fp8(rows, scales)
                flat.view(torch.uint8).index_copy_(0, at, q.view(torch.uint8))

    def undo(self, plan: PagedPlan) -> None:
        """Return the sequences of ``plan`` (the latest plan) to their lengths and pages before
        it; pages it allocated are freed (a copied-on-write last page stays, holding the same
        tokens as the shared one it replaced)."""
        if plan.epoch != self._epoch:
            raise RuntimeError("only the latest plan can be undone; later steps depend on it")
        for s, n_pages, n in plan.before:
            extra = self._pages[s][n_pages:]
            del self._pages[s][n_pages:]
            self.pool.decref(extra)
            self._lens[s] = n
        self._epoch += 1

    # -- reads ------------------------------------------------------------------------------------
    def block_table(self, seq_ids) -> torch.Tensor:
        """``(B, max_pages_per_seq)`` int32 page ids of each sequence in order; -1 past them."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        table = torch.full((len(ids), self.max_pages_per_seq), -1, dtype=torch.int32)
        for b, s in enumerate(ids):
            pages = self._pages[self._check_id(s)]
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table.to(self.k_store.device)

    def seq_lens(self, seq_ids) -> torch.Tensor:
        """``(B,)`` int32 valid tokens per sequence."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        lens = [self._lens[self._check_id(s)] for s in ids]
        return torch.tensor(lens, dtype=torch.int32, device=self.k_store.device)

    def gather(self, seq_id: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies ``(Hkv, length, D)``, ``(Hkv, length, Dv)`` of one sequence's K/V
        in ``layer``."""
        self._check_id(seq_id)
        ids = torch.tensor(self._pages[seq_id], dtype=torch.long, device=self.k_store.device)
        return self.gather_pages(ids, self._lens[seq_id], layer)

    def gather_pages(self, ids: torch.Tensor, n: int, layer: int = 0):
        """:meth:`gather` of the first ``n`` tokens held by pages ``ids`` (int64, in order)."""
        k = self.k_layers[layer].index_select(0, ids).flatten(0, 1)[:n]  # (pages·P, Hkv, D)
        v = self.v_layers[layer].index_select(0, ids).flatten(0, 1)[:n]
        if self.k_scales is not None:  # quantised: values in float32
            ks, vs = self.layer_scales(layer)
            if ks.dim() == 3:  # int8: the slots' scales, gathered like the pages
                ks = ks.index_select(0, ids).flatten(0, 1)[:n]
                vs = vs.index_select(0, ids).flatten(0, 1)[:n]
            k, v = dequantize(k, ks), dequantize(v, vs)
        return k.transpose(0, 1), v.transpose(0, 1)  # (n, Hkv, ·) -> (Hkv, n, ·)

    def view(self, seq_ids) -> PagedCacheView:
        """The cache of a model batch whose row ``b`` is sequence ``seq_ids[b]``
        (:class:`PagedCacheView`)."""
        return PagedCacheView(self, self._ids(seq_ids))

    def check(self) -> None:
        """Raise AssertionError unless every page's pool count equals its holders.

        Holders are the sequences listing the page plus ``kv.index`` when it caches it. So
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
        L, N, P, Hkv, D = self.k_store.shape
        return (
            f"{type(self).__name__}(n_layers={L}, num_pages={N}, page_size={P}, n_kv_heads={Hkv}, "
            f"head_dim={D}, seqs={len(self._pages)}, free_pages={self.pool.num_free})"
        )


class PagedCache(PagedKV):
    """A :class:`PagedKV` of one layer, with per-layer conveniences: ``k_pages``/``v_pages``
    (its ``(N, P, Hkv, ·)`` pages), :meth:`append`, :meth:`attention`.

    ``PagedCache(num_pages, page_size, n_kv_heads, head_dim, value_dim=None, *, max_seqs,
    max_pages_per_seq, prefix_caching=False, dtype, device)``. A model of ``L`` layers uses
    one :class:`PagedKV` (one allocator and block table for all layers) rather than ``L`` of
    these.
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
        super().__init__(
            1, num_pages, page_size, n_kv_heads, head_dim, value_dim, max_seqs=max_seqs,
            max_pages_per_seq=max_pages_per_seq, prefix_caching=prefix_caching, dtype=dtype,
            device=device,
        )  # fmt: skip
        self.k_pages, self.v_pages = self.k_layers[0], self.v_layers[0]

    def append(self, seq_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``S`` new tokens after the cached ones of each sequence in ``seq_ids``.

        ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` with ``B = len(seq_ids)`` (an int id is a
        batch of one). Pages are allocated as needed; a shared last page is copied first. Raises
        ValueError past a sequence's ``max_len`` and RuntimeError when the pool has too few free
        pages, in both cases before changing anything.
        """
        ids = self._ids(seq_ids)
        S = _check_new_kv(self, len(ids), k, v)
        self.write(0, self.plan(ids, S), k, v)

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


def _check_new_kv(kv: PagedKV, B: int, k, v) -> int:
    """``S`` of new ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` for ``kv``'s pages."""
    Hkv, D = kv.k_store.shape[3:]
    Dv = kv.v_store.shape[4]
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError(f"k and v must be tensors, got {type(k).__name__}, {type(v).__name__}")
    if k.dim() != 4 or tuple(k.shape[:2]) != (B, Hkv) or k.shape[3] != D:
        raise ValueError(
            f"k must be (B={B}, Hkv={Hkv}, S, D={D}) for {B} sequence(s), got {tuple(k.shape)}"
        )
    S = k.shape[2]
    if tuple(v.shape) != (B, Hkv, S, Dv):
        raise ValueError(f"v must be (B={B}, Hkv={Hkv}, S={S}, Dv={Dv}), got {tuple(v.shape)}")
    return S


def _check_attend(kv: PagedKV, seq_ids: list[int], q, k, v) -> None:
    """TypeError / ValueError naming the offending shapes unless ``q (B, Hq, Sq, D)`` and this
    step's ``k``, ``v`` fit ``kv`` and the batch ``seq_ids``."""
    B = len(seq_ids)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != B:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be (B={B}, Hq, Sq, D) for seq_ids {seq_ids}, got {got}")
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or k.shape[2] != q.shape[2]:
        got = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
        raise ValueError(f"k must hold one new token per query: q {tuple(q.shape)}, k {got}")
    _check_new_kv(kv, B, k, v)
    if q.dtype != kv.k_store.dtype and kv.k_scales is None:
        raise TypeError(
            f"q is {q.dtype} but the cache stores {kv.k_store.dtype}; build the "
            f"{type(kv).__name__} with the model's dtype"
        )


class PagedLayer:
    """Layer ``layer``'s cache for one planned step (:class:`~selfattn.cache.base.InPlaceKVCache`):
    :meth:`attend` writes this step's K/V at the planned slots of the layer's pages and runs
    :func:`~selfattn.cache.decode.paged_attention` with the planned block table and lengths.
    ``lengths``: tokens cached per sequence before the step."""

    __slots__ = ("kv", "layer", "plan")

    def __init__(self, kv: PagedKV, plan: PagedPlan, layer: int):
        self.kv, self.plan, self.layer = kv, plan, layer

    @property
    def lengths(self) -> torch.Tensor:
        return self.plan.lengths

    @property
    def length(self) -> int:
        if self.plan.past is None:
            raise ValueError(_ragged(self.plan.seq_ids, self.plan.lengths.tolist()))
        return self.plan.past

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
        sinks: torch.Tensor | None = None,
    ):
        """Write ``k (B, Hkv, Sq, D)`` / ``v (B, Hkv, Sq, Dv)``, then attend ``q (B, Hq, Sq, D)``
        (query row ``i`` of sequence ``b`` at position ``lengths[b] + i``).

        Returns ``out (B, Hq, Sq, Dv)``, or ``(out, weights)`` with ``weights
        (B, Hq, Sq, max length)`` (zero past each sequence's end; gathered, for inspection).
        Bool tensor masks and bias tensors are read in query-row order, columns by key position.
        Any error undoes the step's bookkeeping (:meth:`PagedKV.undo`) before it propagates.
        """
        mask, score_mod = self._checked(q, k, v, mask, score_mod)
        return self._run(q, k, v, mask, score_mod, scale, return_weights, sinks)

    def _checked(self, q, k, v, mask, score_mod):
        """:meth:`attend`'s checks; ``(mask, score_mod)`` bound to each sequence's rows."""
        plan = self.plan
        try:
            _check_attend(self.kv, plan.seq_ids, q, k, v)
            if q.shape[2] != plan.n_tokens:
                raise ValueError(
                    f"this step was planned for {plan.n_tokens} new token(s) per sequence but q "
                    f"has Sq={q.shape[2]}"
                )
            shape = (len(plan.seq_ids), q.shape[1], q.shape[2], plan.max_len)
            mask = _per_sequence_rows(mask, plan.lengths, shape)
            score_mod = _per_sequence_rows(score_mod, plan.lengths, shape)
        except BaseException:
            self.kv.undo(plan)
            raise
        return mask, score_mod

    def attend_rows(self, q, k_rows, v_rows, *, mask=None, score_mod=None, scale=None, sinks=None):
        """:meth:`attend` (no weights) with this step's keys and values as rows ``k_rows (B·S,
        Hkv, D)``, ``v_rows (B·S, Hkv, Dv)``, row ``b·S + s`` token ``s`` of sequence ``b``: a
        fused projection's ``(B, S, H, ·)`` layout, written without transposing.

        The decoder's fast path (:mod:`selfattn.models.decode_fast`): the checks of
        :meth:`attend`, the backend choice and its call run at the first layer of each kind
        (shapes, dtypes, mask, score mod, scale and sinks objects) of the step; its other layers
        only write their rows and run the chosen backend (float pages; quantised pages take
        :meth:`attend`'s path at every layer, their scales being per layer).
        """
        plan, kv = self.plan, self.kv
        key = (id(mask), id(score_mod), scale, id(sinks), q.shape, q.dtype, k_rows.shape,
               k_rows.dtype, v_rows.shape, v_rows.dtype)  # fmt: skip
        hit = plan.fast.get(key)
        if hit is None or kv.k_scales is not None:
            B, S = len(plan.seq_ids), plan.n_tokens
            if k_rows.dim() != 3 or v_rows.dim() != 3 or k_rows.shape[0] != B * S:
                kv.undo(plan)
                raise ValueError(
                    f"k_rows and v_rows must be (B·S={B * S}, Hkv, ·) for this step of {B} "
                    f"sequence(s) × {S} token(s), got {tuple(k_rows.shape)}, "
                    f"{tuple(v_rows.shape)}"
                )
            k = k_rows.view(B, S, *k_rows.shape[1:]).transpose(1, 2)  # (B, Hkv, S, D)
            v = v_rows.view(B, S, *v_rows.shape[1:]).transpose(1, 2)
            if kv.k_scales is not None or type(kv).write is not PagedKV.write:
                return self.attend(q, k, v, mask=mask, score_mod=score_mod, scale=scale,
                                   sinks=sinks)  # fmt: skip
            mask_obj, mod_obj = self._checked(q, k, v, mask, score_mod)
            try:
                hit = plan.attention.prepare(
                    q, kv.k_layers[self.layer], kv.v_layers[self.layer], mask=mask_obj,
                    score_mod=mod_obj, scale=scale, sinks=sinks,
                )  # fmt: skip
            except BaseException:
                kv.undo(plan)
                raise
            # the entry holds the objects keyed by id, so that their ids stay unique
            plan.fast[key] = hit = (*hit, mask, score_mod, sinks)
        chosen, call = hit[0], hit[1]
        layer = self.layer
        try:
            kv.write_rows(layer, plan, k_rows, v_rows)
            out, _ = chosen.run(q, kv.k_layers[layer], kv.v_layers[layer], plan.block_table,
                                plan.seq_lens, call)  # fmt: skip
        except BaseException:
            kv.undo(plan)
            raise
        return out

    def _run(self, q, k, v, mask, score_mod, scale, return_weights, sinks=None):
        """:meth:`attend` once its inputs are checked (masks already per sequence)."""
        kv, plan = self.kv, self.plan
        try:
            kv.write(self.layer, plan, k, v)
            k_scales, v_scales = kv.layer_scales(self.layer)
            out = paged_attention(
                q,
                kv.k_layers[self.layer],
                kv.v_layers[self.layer],
                plan.block_table,
                plan.seq_lens,
                mask=mask,
                score_mod=score_mod,
                scale=scale,
                k_scales=k_scales,
                v_scales=v_scales,
                plan=plan.attention,
                sinks=sinks,
            )
        except BaseException:
            kv.undo(plan)
            raise
        if not return_weights:
            return out
        B, Hq, Sq, _ = q.shape
        w = q.new_zeros(B, Hq, Sq, plan.max_len)
        for b, s in enumerate(plan.seq_ids):
            ks, vs = kv.gather(s, self.layer)
            n = ks.shape[1]
            w[b : b + 1, :, :, :n] = attention_weights(
                q[b : b + 1],
                ks[None],
                vs[None],
                mask=None if mask is None else as_mask(mask).shifted(batch=b),
                score_mod=None if score_mod is None else as_score_mod(score_mod).shifted(batch=b),
                scale=scale,
                sinks=sinks,
            )  # default q_offset: bottom-right, n - Sq, as in paged_attention
        return out, w


class PackedLayer(PagedLayer):
    """Layer ``layer``'s cache for one packed step (:meth:`PagedKV.plan_packed`): the model's
    batch is one row of ``T`` tokens from several sequences; token ``t`` is row ``t`` of the
    plan (its sequence's pages, its own length)."""

    __slots__ = ()

    def attend(
        self, q, k, v, *, mask=None, score_mod=None, scale=None, return_weights: bool = False
    ):
        """Write ``k (1, Hkv, T, D)`` / ``v (1, Hkv, T, Dv)`` and attend ``q (1, Hq, T, D)``,
        each token over its own sequence up to its own position; returns ``(1, Hq, T, Dv)``.
        Masks and score mods see absolute positions (tensor masks in row order are refused:
        the rows are not one sequence's)."""
        T = len(self.plan.seq_ids)
        try:
            if return_weights:
                raise ValueError("a packed step does not return attention weights")
            for name, x in (("q", q), ("k", k), ("v", v)):
                if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[::2] != (1, T):
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise ValueError(
                        f"{name} must be (1, H, T={T}, ·) for this packed step of {T} tokens, "
                        f"got {got}"
                    )
            for name, obj in (("mask", mask), ("score_mod", score_mod)):
                if isinstance(obj, torch.Tensor) or getattr(obj, "row_ordered", False):
                    raise ValueError(
                        f"a packed step takes {name}s of positions only (causal, windows, "
                        "soft-caps): its rows are tokens of several sequences"
                    )
        except BaseException:
            self.kv.undo(self.plan)
            raise

        return self._run_packed(q, k, v, mask, score_mod, scale)

    def _run_packed(self, q, k, v, mask, score_mod, scale):
        kv, plan, layer = self.kv, self.plan, self.layer
        T, Hq, Dv = q.shape[2], q.shape[1], v.shape[3]
        k_scales, v_scales = kv.layer_scales(layer)
        pages = (kv.k_layers[layer], kv.v_layers[layer])
        kw = dict(mask=mask, score_mod=score_mod, scale=scale, k_scales=k_scales,
                  v_scales=v_scales)  # fmt: skip

        def as_rows(x):  # (1, H, T, ·) -> (T, H, 1, ·): every token a row of length 1
            return x[0].transpose(0, 1).unsqueeze(2)

        try:
            kv.write(layer, plan, as_rows(k), as_rows(v))
            R = plan.rows.numel()
            if R == T:  # no long chunk: the whole step is one call
                out = paged_attention(as_rows(q), *pages, plan.block_table, plan.seq_lens,
                                      plan=plan.attention, **kw)  # fmt: skip
                return out.squeeze(2).transpose(0, 1).unsqueeze(0)  # (T, Hq, 1, Dv) -> (1, ·)
            out = q.new_empty(Hq, T, Dv)
            if R:
                qr = q[0].index_select(1, plan.rows).transpose(0, 1).unsqueeze(2)  # (R, Hq, 1, D)
                o = paged_attention(qr, *pages, plan.block_table, plan.seq_lens,
                                    plan=plan.attention, **kw)  # fmt: skip
                out.index_copy_(1, plan.rows, o.squeeze(2).transpose(0, 1))  # (Hq, R, Dv)
            for blk in plan.blocks:  # one query block per long chunk: (1, Hq, n, D)
                ks, vs = kv.gather_pages(blk.ids, blk.length, layer)  # (Hkv, length, ·)
                qb = q[:, :, blk.start : blk.start + blk.n]
                # keys from position 0, queries the last n: attention's default bottom-right
                o = attention(qb, ks[None].to(qb.dtype), vs[None].to(qb.dtype), mask=mask,
                              score_mod=score_mod,
                              scale=scale)  # fmt: skip
                out[:, blk.start : blk.start + blk.n] = o[0]
            return out.unsqueeze(0)  # (Hq, T, Dv) -> (1, Hq, T, Dv)
        except BaseException:
            kv.undo(plan)
            raise


def _ragged(seq_ids, lengths) -> str:
    return (
        f"sequences {seq_ids} have different lengths {lengths}; use .lengths for ragged "
        "batches (MultiHeadAttention handles them through attend())"
    )


class PagedCacheView:
    """A model batch over a :class:`PagedKV`'s sequences: row ``b`` is sequence ``seq_ids[b]``.

    The model cache contract (:class:`~selfattn.cache.base.ModelKVCache`): ``plan(S)`` plans
    the step once (:meth:`PagedKV.plan`) and returns a :class:`~selfattn.cache.base.Step`
    whose ``layers[i]`` is a :class:`PagedLayer`. Each sequence's queries follow its OWN length,
    so the sequences may have different lengths (ragged)::

        seq_ids = [4, 9]   lengths before the step 5, 2;   S = 2 new tokens each
        seq 4   keys 0 1 2 3 4 [5 6]    queries at positions 5, 6
        seq 9   keys 0 1 [2 3]          queries at positions 2, 3   ([·] = appended now)

    Queries are bottom-right per sequence, masks and score mods see those absolute positions,
    and RoPE positions default to ``lengths[b] + arange(S)`` per sequence (``step.positions``).

    Over a one-layer cache (:class:`PagedCache`) the view is also a layer's cache itself:
    ``MultiHeadAttention(..., cache=cache.view(seq_ids))`` calls :meth:`attend`, which plans
    and runs the step in one go (one :class:`PagedCache` per layer: the older, per-layer way).
    :meth:`update` is the plain contract (append, then contiguous K/V) for callers that attend
    themselves; it needs equal lengths. ``reset()`` empties the sequences (their page references
    dropped), keeping their ids.

    A decoder stack over one model-level cache, prefill then decode::

        kv = PagedKV(L, N, P, Hkv, D, max_seqs=B, max_pages_per_seq=M)
        batch = kv.view(kv.add_sequences(B))
        step = batch.plan(x.shape[1])                       # x (B, S, d): S > 1 or 1
        for i, layer in enumerate(layers):
            x = layer(x, mask=masks.causal(), cache=step.layers[i], positions=step.positions)
    """

    def __init__(self, cache: PagedKV, seq_ids: list[int]):
        self.cache = cache
        self.seq_ids = list(seq_ids)

    @property
    def n_layers(self) -> int:
        return self.cache.n_layers

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` int64 cached tokens of each sequence, on the cache's device."""
        return self.cache.seq_lens(self.seq_ids).long()

    @property
    def length(self) -> int:
        """The common length of the sequences (raises ValueError when they differ)."""
        lens = {self.cache.length(s) for s in self.seq_ids}
        if len(lens) > 1:
            raise ValueError(_ragged(self.seq_ids, [self.cache.length(s) for s in self.seq_ids]))
        return lens.pop() if lens else 0

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        for s in self.seq_ids:
            self.cache.truncate(s)

    def plan(self, n_tokens: int) -> Step:
        """Plan ``n_tokens`` new tokens per sequence for every layer (:meth:`PagedKV.plan`)."""
        plan = self.cache.plan(self.seq_ids, n_tokens)
        layers = [PagedLayer(self.cache, plan, i) for i in range(self.cache.n_layers)]
        return Step(layers, plan.positions, plan.past)

    def _one_layer(self, what: str) -> None:
        if self.cache.n_layers != 1:
            raise TypeError(
                f"{what}() serves a one-layer cache; this {type(self.cache).__name__} has "
                f"{self.cache.n_layers} layers: plan each step once with view.plan(S) and give "
                "layer i step.layers[i]"
            )

    def update(self, k: torch.Tensor, v: torch.Tensor, positions=None):
        """Append ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``; returns the gathered
        ``(B, Hkv, length, D)`` and ``(B, Hkv, length, Dv)`` (equal lengths only)."""
        self._one_layer("update")
        n = self.length
        if positions is not None:
            pos = torch.as_tensor(positions).flatten().tolist()
            if pos != list(range(n, n + k.shape[2])):
                raise ValueError(
                    f"a paged cache appends only: positions must be {n}..{n + k.shape[2] - 1}, "
                    f"got {pos}"
                )
        S = _check_new_kv(self.cache, len(self.seq_ids), k, v)
        self.cache.write(0, self.cache.plan(self.seq_ids, S), k, v)
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
        sinks: torch.Tensor | None = None,
    ):
        """Plan one step of a one-layer cache and run it (:meth:`PagedLayer.attend`); bad input
        is refused before anything changes."""
        self._one_layer("attend")
        _check_attend(self.cache, self.seq_ids, q, k, v)
        B, Hq, Sq, _ = q.shape
        # Validate before planning, so that bad input leaves the cache as it was.
        lengths = self.lengths
        shape = (B, Hq, Sq, int(lengths.max()) + Sq if B else 0)  # (B, Hq, Sq, max length)
        mask = _per_sequence_rows(mask, lengths, shape)
        score_mod = _per_sequence_rows(score_mod, lengths, shape)
        layer = PagedLayer(self.cache, self.cache.plan(self.seq_ids, Sq), 0)
        return layer._run(q, k, v, mask, score_mod, scale, return_weights, sinks)


# -- tensors in query-row order ----------------------------------------------------------------
# Masks and score mods see absolute positions. A bool tensor mask or a bias tensor is read by
# query ROW, so it is bound to each sequence's own first query position (Mask.bind with one
# offset per sequence); built-ins are returned as they are, analytic page trimming intact.


def _per_sequence_rows(obj, offsets: torch.Tensor, shape: tuple[int, int, int, int]):
    """``obj`` (a mask or score mod, any accepted form) with row ``i`` of sequence ``b`` at
    position ``offsets[b] + i`` when it holds row-ordered tensors, which must broadcast to
    ``shape`` ``(B, Hq, Sq, max length)`` (checked here, before anything changes)."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        obj = from_tensor(obj) if obj.dtype == torch.bool else as_score_mod(obj)
    if not obj.row_ordered:
        return obj
    B, H, Sq, Sk = shape
    obj.validate(B, H, Sq, Sk, Sk - Sq)
    return obj.bind(offsets)
