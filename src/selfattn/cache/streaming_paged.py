"""``StreamingPagedKV``: StreamingLLM's sinks plus a rolling window over paged K/V.

A :class:`~selfattn.cache.PagedKV` whose sequences keep their first ``sink_pages =
ceil(n_sink / P)`` pages pinned (they hold the sinks) and free each later page back to the
pool as soon as the window has passed it, so a sequence holds at most ``sink_pages +
ceil((window + S) / P) + 1`` pages at any length (``S`` the step's new tokens)::

    P = 4, n_sink = 2, window = 6, 17 tokens: pages [sink | ~~dropped~~ | w0 | w1]
    text positions   0 1 2 3 | 4 .. 11 | 12 13 14 15 | 16 · · ·
    kernel index     0 1 2 3 |         |  4  5  6  7 |  8

The kernels read a sequence's pages in block-table order, so a key's index there (the "kernel
index") runs over the pinned pages, then the window pages; a sequence's ``length`` here is that
index range (what :func:`paged_attention` reads) and ``dropped(seq)`` the tokens freed before
it. RoPE positions (``positions=``):

- ``"cache"`` (the paper's, the default of ``make_cache``): the kernel index. Keys are stored
  rotated at their index; when pages before them are freed the window pages' keys move down
  and are re-rotated in place, in every layer (``R(-shift)``, at most ``window / P + 1`` times
  per page before it is freed itself, so rounding does not pile up). Unlike the dense
  :class:`~selfattn.cache.StreamingCache`, whose slots hold only visible tokens, the masked
  non-sink tokens of the pinned pages and the passed tokens of the first window page keep their
  indices here, so the distances are up to ``sink_pages · P - n_sink + P - 1`` larger. Forks
  are refused (a shared page would be re-rotated once per holder).
- ``"absolute"``: the text positions (kernel index plus the dropped tokens); keys are never
  re-rotated, and the result equals the dense cache's ``"absolute"`` mode.

The mask, in kernel indices, is ``causal() & (padding(n_sink) | (~padding(gap) &
sliding_window(window)))``: the sinks, and the window among the window pages, whose
kernel-index differences are text-position differences; ``gap[b]`` masks the non-sink tokens
of the pinned pages once pages have been dropped (they are out of every later window by then).
Score mods see kernel indices.

Pages are dropped when a step is planned (once for every layer), before the new tokens'
pages are reserved; a dropped page is freed even if the step then fails (no later query could
see it). Forked sequences share pages by reference count as in :class:`PagedKV`: a dropped
shared page is only freed when its last holder drops it.
"""

from __future__ import annotations

import dataclasses

import torch

from selfattn import masks as _masks
from selfattn._validate import int_at_least, one_of, positive_int
from selfattn.cache.base import Step
from selfattn.cache.paged import PagedCacheView, PagedKV, PagedLayer, StepPlan
from selfattn.cache.streaming import POSITION_MODES, check_rerotatable, rotate_back

__all__ = ["StreamingPagedKV"]


class StreamingPagedKV(PagedKV):
    """Paged K/V keeping ``n_sink`` sinks and a ``window`` per sequence (module docstring).

    ``StreamingPagedKV(n_layers, num_pages, page_size, n_kv_heads, head_dim, value_dim=None, *,
    n_sink, window, max_seqs, max_pages_per_seq, positions="absolute", dtype, device)``; the
    rest is :class:`PagedKV`'s (no prefix caching: a streaming sequence's pages do not stay a
    prefix of anything). :meth:`pages_needed` sizes ``max_pages_per_seq``.
    """

    query_blocks = False  # its long steps attend through paged_attention

    def __init__(
        self, *args, n_sink: int, window: int, positions: str = "absolute", rope=None, **kwargs
    ):
        if kwargs.get("prefix_caching"):
            raise ValueError("StreamingPagedKV has no prefix caching (its pages are not a prefix)")
        super().__init__(*args, **kwargs)
        self.n_sink = int_at_least(n_sink, "StreamingPagedKV n_sink", 0)
        self.window = positive_int(window, "StreamingPagedKV window")
        self.mode = one_of(positions, "StreamingPagedKV positions", POSITION_MODES)
        check_rerotatable(type(self).__name__, rope)
        self.rope = rope
        self.sink_pages = -(-n_sink // self.page_size)
        self._dropped: dict[int, int] = {}

    def add_sequence_from_prefix(self, *args, **kwargs):
        raise TypeError("StreamingPagedKV has no prefix caching: use add_sequence()")

    def cache_prefix(self, *args, **kwargs):
        raise TypeError("StreamingPagedKV has no prefix caching: its passed pages are freed")

    @staticmethod
    def pages_needed(n_sink: int, window: int, page_size: int, max_step: int) -> int:
        """Pages one sequence may hold: the pinned ones, the window's and a step of ``max_step``
        new tokens (plus one: the window's first page is partly stale)."""
        return -(-n_sink // page_size) + -(-(window + max_step) // page_size) + 1

    def dropped(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` freed so far (a multiple of ``page_size``)."""
        return self._dropped.get(self.blocks.check_id(seq_id), 0)

    def _forget(self, seq_id: int) -> None:
        self._dropped.pop(seq_id, None)

    def fork(self, seq_id: int) -> int:
        if self.mode == "cache":
            # Each holder re-rotates its window pages in place as it drops pages: shared pages
            # would be rotated once per holder.
            raise TypeError("a StreamingPagedKV with positions='cache' cannot fork sequences")
        sid = super().fork(seq_id)
        self._dropped[sid] = self._dropped.get(seq_id, 0)
        return sid

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self._forget(seq_id)

    def truncate(self, seq_id: int) -> None:
        super().truncate(seq_id)
        self._forget(seq_id)

    def _drop_passed_pages(self, seq_id: int) -> None:
        """Free the window pages no query from now on can see: those whose last token sits at
        or before ``text length - window`` (the next query's window starts one past it)."""
        P, sp = self.page_size, self.sink_pages
        n_pages = len(self.blocks.pages(seq_id))
        dropped = self._dropped.get(seq_id, 0)
        text_len = self.blocks.length(seq_id) + dropped
        # page sp holds kernel indices sp·P .. sp·P + P - 1, i.e. those + dropped in the text
        n_before = dropped
        while n_pages > sp and sp * P + P - 1 + dropped <= text_len - self.window:
            self.blocks.drop_page(seq_id, sp)
            n_pages -= 1
            dropped += P
        self._dropped[seq_id] = dropped
        shift = dropped - n_before
        if shift and self.mode == "cache" and self.rope is not None and n_pages > sp:
            pages = self.blocks.pages(seq_id)
            # The window pages moved `shift` kernel slots down: re-rotate their keys in every
            # layer (a page is re-rotated at most window / P + 1 times before it is dropped).
            ids = torch.tensor(pages[sp:], device=self.k_store.device)
            keys = self.k_store[:, ids]  # (L, n, P, Hkv, D)
            flat = keys.reshape(1, -1, 1, keys.shape[-1])  # every key a "head" at one position
            at = torch.tensor([shift], device=keys.device)
            self.k_store[:, ids] = rotate_back(self.rope, flat, at, undo_factor=False).view_as(keys)

    def plan(self, seq_ids, n_tokens: int) -> StepPlan:
        """:meth:`PagedKV.plan` after dropping the pages the window has passed; the plan's
        ``positions`` (and ``past``) are text positions (kernel index + dropped tokens)."""
        ids = self.blocks.checked_ids(seq_ids)
        for s in ids:
            self._drop_passed_pages(s)
        plan = super().plan(ids, n_tokens)
        if self.mode == "cache":  # RoPE at the kernel indices; past stays the kernel length
            return plan
        offsets = [self._dropped[s] for s in ids]
        if plan.past is not None and len(set(offsets)) <= 1:
            shift = offsets[0] if offsets else 0
            return dataclasses.replace(
                plan, positions=plan.positions + shift, past=plan.past + shift
            )
        # rows differ: (B, S) positions per sequence
        off = torch.tensor(offsets, device=plan.lengths.device)
        pos = plan.positions if plan.positions.dim() == 2 else plan.positions.expand(len(ids), -1)
        return dataclasses.replace(plan, positions=pos + off[:, None], past=None)

    def text_length(self, seq_id: int) -> int:
        """Tokens ever appended to ``seq_id`` (its kernel length plus the dropped ones)."""
        return self.length(seq_id) + self.dropped(seq_id)

    def view(self, seq_ids) -> StreamingPagedView:
        return StreamingPagedView(self, self.blocks.checked_ids(seq_ids))

    def check(self) -> None:
        """:meth:`PagedKV.check`, and every sequence within its pinned + window pages."""
        super().check()
        for s in self.seq_ids:
            pages = self.blocks.pages(s)
            if self._dropped.get(s, 0) % self.page_size:
                raise AssertionError(f"sequence {s}: {self._dropped[s]} dropped tokens")
            if self._dropped.get(s, 0) and len(pages) < self.sink_pages:
                raise AssertionError(f"sequence {s}: lost a pinned page ({pages})")

    def gap(self, seq_ids: list[int]) -> torch.Tensor:
        """``(B,)`` end of each sequence's masked pinned-page tokens: ``sink_pages · P`` once it
        has dropped pages, else 0."""
        end = self.sink_pages * self.page_size
        gaps = [end if self._dropped.get(s, 0) else 0 for s in seq_ids]
        return torch.tensor(gaps, device=self.k_store.device)


class StreamingPagedLayer(PagedLayer):
    """A :class:`PagedLayer` that attends with the streaming mask (module docstring)."""

    __slots__ = ("gap",)

    def __init__(self, kv, plan, layer, gap):
        super().__init__(kv, plan, layer)
        self.gap = gap

    def next_positions(self, n_tokens: int, device=None) -> torch.Tensor:
        """The planned RoPE positions (a layer's default: text positions in ``"absolute"``
        mode are not the kernel lengths)."""
        return self.plan.positions.to(device)

    def attend(self, q, k, v, *, mask=None, score_mod=None, scale=None, return_weights=False):
        kv = self.kv
        if mask is not None and not _masks.as_mask(mask).is_causal:
            kv.undo(self.plan)
            raise ValueError(
                f"StreamingPagedKV applies its own mask (causal, {kv.n_sink} sinks, window "
                f"{kv.window}) and takes no other, got {mask!r}; run without an attention_mask"
            )
        visible = ~_masks.padding(self.gap) & _masks.sliding_window(kv.window)
        if kv.n_sink:
            visible = _masks.padding(kv.n_sink) | visible
        mask = _masks.causal() & visible
        return super().attend(
            q, k, v, mask=mask, score_mod=score_mod, scale=scale, return_weights=return_weights
        )


class StreamingPagedView(PagedCacheView):
    """A model batch over a :class:`StreamingPagedKV` (``make_cache("streaming",
    paged=True)``): each step's layers attend with the streaming mask; ``length`` and
    ``lengths`` are text lengths."""

    @property
    def length(self) -> int:
        lens = {self.cache.text_length(s) for s in self.seq_ids}
        if len(lens) > 1:
            raise ValueError(f"sequences {self.seq_ids} have different lengths")
        return lens.pop() if lens else 0

    def plan(self, n_tokens: int) -> Step:
        plan = self.cache.plan(self.seq_ids, n_tokens)
        gap = self.cache.gap(self.seq_ids)
        layers = [StreamingPagedLayer(self.cache, plan, i, gap) for i in range(self.cache.n_layers)]
        return Step(layers, plan.positions, plan.past)

    def update(self, k, v, positions=None):
        raise TypeError("a streaming paged cache attends itself (attend through a planned step)")

    def attend(self, *args, **kwargs):
        raise TypeError(
            "plan a streaming paged cache's step with view.plan(S) and give layer i step.layers[i]"
        )
