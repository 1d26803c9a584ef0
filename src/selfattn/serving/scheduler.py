"""Which tokens the next step computes: continuous batching with chunked prefill, prefix caching
and preemption by recompute, over one :class:`~selfattn.cache.PagedKV`.

Every step has a budget of ``max_batch_tokens`` tokens and at most ``max_num_seqs`` sequences
(vLLM's scheduler, Kwon et al. 2023; chunked prefill as in Sarathi-Serve, Agrawal et al. 2024)::

    running, oldest first:  decoding sequences take 1 token each (always budgeted first),
                            prefilling ones the next chunk of their prompt within what is left
    waiting, FIFO:          admitted while the budget, the sequence slots and the pool allow
                            (pages for its whole prompt, not only its first chunk); the
                            first that does not fit stops admission (no overtaking)

A sequence admitted with prefix caching starts from the longest cached page-aligned prefix of
its tokens (:meth:`PagedKV.add_sequence_from_prefix`) and computes only the rest; every page it
fills is offered to the cache at the end of the step, so the next request with that prefix
reuses it. A waiting request whose next uncached page is being computed right now by a running
prefill waits one step for it rather than computing it again (SGLang's cache-aware scheduling,
Zheng et al. 2024: 64 requests with one system prompt compute it once, not 64 times). A request
still scoring its prompt (``prompt_logprobs``) computes every prompt token: cached pages hold
K/V, not the logits it reports (the pages it fills are offered all the same).

When the pool (free pages plus cached pages nobody uses) cannot hold a step's tokens, the newest
running sequence is preempted: its pages are freed (full ones stay in the prefix cache, so its
recompute is mostly cache hits) and it goes back to the head of the waiting queue, to be
recomputed when readmitted. Oldest first keeps the oldest requests moving; the newest, having
the least work done, lose the least.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from selfattn.cache import PagedKV
from selfattn.serving.request import Request, Sequence

__all__ = ["Batch", "Scheduler"]


@dataclass
class Batch:
    """One step: ``chunks`` of ``(sequence, tokens to compute)`` in batch order, the sequences
    preempted while planning it, and the requests admitted for the first time."""

    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    first_admitted: list[Request] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class Scheduler:
    """The waiting queue and the running set over ``kv`` (module docstring)."""

    def __init__(self, kv: PagedKV, *, max_batch_tokens: int, max_num_seqs: int,
                 lookahead: int = 0):  # fmt: skip
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        # speculative decoding: draft tokens a decoding sequence may verify per step (its
        # chunk is then 1 + Sequence.draft_room(lookahead) tokens, pages budgeted for all)
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by Sequence.key: oldest first
        self.num_preemptions = 0
        self.computed_tokens = 0  # tokens run through the model (prefill and decode)
        self.prefill_tokens = 0  # of which prompt tokens, and output tokens recomputed

    # -- queue ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def slots_used(self) -> int:
        return sum(s.request.slots for s in self.running)

    def _insert_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=lambda s: s.key)

    # -- pages ------------------------------------------------------------------------------------
    def _available(self) -> int:
        """Pages a step may take: free ones and cached ones only the prefix index holds."""
        index = self.kv.index
        return self.kv.pool.num_free + (0 if index is None else index.num_evictable_pages)

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        """Pages ``n`` more tokens of ``seq`` take: new pages, plus one when its last page is
        shared and partly filled (copy-on-write; an upper bound when its sharers write too)."""
        P = self.kv.page_size
        have = self.kv.length(seq.kv_id)
        need = -(-(have + n) // P) - -(-have // P)
        if have % P and self.kv.pool.refcount(self.kv.pages(seq.kv_id)[-1]) > 1:
            need += 1
        return need

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s cache sequence (its full pages offered to the prefix cache first)."""
        if seq.kv_id is None:
            return
        self.offer_pages(seq)
        self.kv.free(seq.kv_id)
        seq.kv_id = None

    def offer_pages(self, seq: Sequence) -> None:
        """Give the prefix cache the full pages ``seq`` computed since it last did. None of a
        prompt to be compressed: its pages are about to be rewritten in place (a cached copy
        would hold them until evicted, the memory compression is there to free), nor after:
        they no longer hold its tokens in order; none of a request whose hooks edit activations
        (its K/V are no other prompt's)."""
        hooks = seq.request.hooks
        if self.kv.index is None or seq.kv_id is None or seq.compressing:
            return
        if (hooks is not None and hooks.edits) or self.kv.evicted(seq.kv_id):
            return
        full = seq.num_computed // self.kv.page_size
        if full > seq.cached_pages:
            self.kv.cache_prefix(seq.kv_id, seq.tokens)
            seq.cached_pages = full

    def fork(self, seq: Sequence, index: int) -> Sequence:
        """Sample ``index`` of ``seq``'s request, sharing every page of ``seq`` (copy-on-write)."""
        child = seq.fork(index)
        child.kv_id = self.kv.fork(seq.kv_id)
        child.cached_pages = seq.cached_pages
        self._insert_running(child)
        return child

    def preempt(self, seq: Sequence) -> None:
        """Back to the head of the waiting queue, its pages freed: recomputed when readmitted."""
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = seq.cached_pages = 0
        seq.compressed, seq.observed, seq.evicting = False, None, None
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
            self.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """Plan the next step (module docstring); takes no pages yet (``PagedKV.plan_packed``
        does, for the returned chunks, within what this counted)."""
        batch = Batch()
        budget = self.max_batch_tokens
        reserved = 0  # pages the chunks so far will take
        decodes = sum(self._decode_tokens(s) for s in self.running if s.remaining == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.remaining == 1:
                n = self._decode_tokens(seq)
                decodes -= n
                n = min(n, budget)
            else:  # a prefill chunk leaves room for the decodes after it
                n = min(seq.remaining, budget - decodes)
                if n <= 0:
                    i += 1
                    continue
            need = self._pages_needed(seq, n)
            while need > self._available() - reserved:
                victim = self.running[-1]
                if victim.remaining == 1 and victim is not seq:
                    decodes -= self._decode_tokens(victim)
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.kv_id is None:  # preempted itself: every sequence after it is gone too
                break
            batch.chunks.append((seq, n))
            budget -= n
            reserved += need
            i += 1
        self._admit(batch, budget, reserved)
        return batch

    def _decode_tokens(self, seq: Sequence) -> int:
        """Tokens a decoding sequence's chunk takes: its last token and room for drafts."""
        return 1 + (seq.draft_room(self.lookahead) if self.lookahead else 0)

    def _admit(self, batch: Batch, budget: int, reserved: int) -> None:
        """Admit waiting sequences FIFO into ``batch`` (module docstring)."""
        kv = self.kv
        slots = self.slots_used()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if slots + seq.request.slots > self.max_num_seqs:
                return
            if kv.index is not None and not seq.request.computes_prompt:
                kv_id, cached = kv.add_sequence_from_prefix(seq.tokens[: _reusable(seq)])
            else:
                kv_id, cached = kv.add_sequence(), 0
            seq.kv_id, seq.num_computed, seq.cached_pages = kv_id, cached, cached // kv.page_size
            if self._computing_now(seq, batch):
                self._unadmit(seq)
                return
            n = min(seq.remaining, budget)
            need = self._pages_needed(seq, n)
            # the whole prompt must fit, not its first chunk only: a prompt longer than the
            # budget admitted into too few pages would be preempted before its prefill ends,
            # and recomputed, again and again
            if self._pages_needed(seq, seq.remaining) > self._available() - reserved:
                self._unadmit(seq)
                return
            self.waiting.popleft()
            if seq.request.cached_tokens is None:
                seq.request.cached_tokens = cached
                batch.first_admitted.append(seq.request)
            self._insert_running(seq)
            batch.chunks.append((seq, n))
            budget -= n
            reserved += need
            slots += seq.request.slots

    def _unadmit(self, seq: Sequence) -> None:
        self.kv.free(seq.kv_id)
        seq.kv_id, seq.num_computed, seq.cached_pages = None, 0, 0

    def _computing_now(self, seq: Sequence, batch: Batch) -> bool:
        """Whether a prefill chunk of this step computes ``seq``'s next uncached page (the
        page would be cached at the end of the step; computing it twice would waste it)."""
        if self.kv.index is None:
            return False
        P = self.kv.page_size
        start = seq.num_computed
        end = start + P
        if end > (len(seq.tokens) - 1) // P * P:  # the page would not be reused: see match()
            return False
        block = seq.tokens[start:end]
        return any(
            other.num_computed < end and other.tokens[start:end] == block
            for other, _ in batch.chunks
            if other.request is not seq.request
        )

    def advance(self, batch: Batch) -> None:
        """After the step ran: count what was computed and offer full pages to the cache."""
        for seq, n in batch.chunks:
            if n > 1 or seq.num_computed < seq.num_prompt:  # not a decode token
                self.prefill_tokens += n
            seq.num_computed += n
            self.computed_tokens += n
            self.offer_pages(seq)

    def settle(self, seq: Sequence, computed: int, kept: int, accepted: list[int]) -> None:
        """After a speculative chunk of ``computed`` tokens of ``seq`` (its last token and the
        drafts) ran: keep the first ``kept`` in the cache (the last token and the ``accepted``
        drafts, which are not yet in ``seq.tokens``), roll the rest back, and offer the full
        pages to the prefix cache (with the accepted tokens, before they are appended)."""
        self.computed_tokens += computed
        seq.num_computed += kept
        self.kv.trim(seq.kv_id, seq.num_computed - self.kv.evicted(seq.kv_id))
        if accepted and self.kv.index is not None:
            seq.tokens += accepted
            try:
                self.offer_pages(seq)
            finally:
                del seq.tokens[-len(accepted) :]

    def check(self) -> None:
        """Raise AssertionError unless every running sequence's cache length matches its
        computed tokens and the cache's own bookkeeping holds (:meth:`PagedKV.check`)."""
        self.kv.check()
        live = set(self.kv.seq_ids)
        mine = {s.kv_id for s in self.running}
        if live != mine:
            raise AssertionError(f"cache sequences {sorted(live)} but running {sorted(mine)}")
        for s in self.running:
            held, evicted = self.kv.length(s.kv_id), self.kv.evicted(s.kv_id)
            if held + evicted != s.num_computed:
                raise AssertionError(
                    f"sequence {s.key}: cache length {held} + evicted {evicted}, computed "
                    f"{s.num_computed}"
                )
        if any(s.kv_id is not None for s in self.waiting):
            raise AssertionError("a waiting sequence holds cache pages")


def _reusable(seq: Sequence) -> int:
    """How many of ``seq``'s tokens a prefix-cache hit may cover: all, except that a prompt to
    be compressed computes the rows its policy reads (their attention inputs are recorded)."""
    if not seq.compressing:
        return len(seq.tokens)
    C = seq.num_prompt
    return C - min(C, seq.request.compression.press.query_rows(C)) + 1
