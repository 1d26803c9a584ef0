"""``StepPlan``: one step of a paged KV cache, frozen, as tensors on the pages' device.

A step is planned once (:meth:`~selfattn.cache.PagedKV.plan` or ``plan_packed``) and the plan
is all that the model's layers, the attention views (:mod:`selfattn.cache.paged.layer`) and a
tensor-parallel peer see of the cache's bookkeeping. Its tensors come from one host list copied
to the device once per step.

Two kinds of step:

- uniform (:func:`build`): ``S`` new tokens in each of ``B`` sequences; row ``b`` of the model's
  batch is sequence ``seq_ids[b]``.
- packed (:func:`build_packed`): ``counts[i]`` new tokens of sequence ``i`` as one row of
  ``T = sum(counts)`` tokens (a continuous-batching step of prefill chunks and decode tokens)::

      sequences = [4, 9, 2]   counts = [3, 1, 1]   T = 5 tokens, the model's input (1, T)
      token rows              4 4 4 9 2            each token a row of the plan: its own
      seq_lens                6 7 8 3 12           length (position + 1), its sequence's pages

  Chunks of at most :data:`PACKED_ROWS_MAX` tokens are query rows of one ``paged_attention``
  call (causal order inside the chunk needs no mask); a longer chunk is a ``block``, attended
  as one query block over its sequence's gathered K/V. In deterministic mode
  (:mod:`selfattn.kernels.determinism`) every chunk's tokens are rows, whatever its length.

Positions and slots: a sequence's tokens sit in slots ``0 .. length-1`` and its new token's
RoPE position is its slot, unless a KV-compression policy compacted it
(:meth:`~selfattn.cache.PagedKV.compact`): then ``offsets[b]`` tokens were removed and the new
tokens' ``positions`` are their slots plus that, while ``lengths``, ``seq_lens`` and the
attention read slots (the kept keys carry their rotation; causal order over slots holds).

Slots: token ``t`` of a sequence sits at flat slot ``page · P + t % P`` of a layer's ``(N·P,
Hkv, ·)`` rows; with one K/V pool per layer (``kv_store (N, 2, P, Hkv, D)``) its key row is
``page · 2P + t % P`` and its value row ``P`` later (:func:`pair_slots`).
"""

from __future__ import annotations

import dataclasses

import torch

from selfattn.backends.paged.plan import PagedAttentionPlan
from selfattn.cache.base import next_positions
from selfattn.cache.paged.holes import step_holes
from selfattn.kernels.determinism import is_deterministic

__all__ = ["PACKED_ROWS_MAX", "StepPlan", "build", "build_packed", "pair_slots"]

# Packed steps: chunks of at most this many tokens attend as rows of one call (module
# docstring), longer ones as a query block over their gathered K/V. The C kernel serves up to
# 16 query rows of a sequence per page read (backends/paged/cpu.py KERNEL_MAX_SQ); as separate
# rows a long prompt re-reads its keys once per 16 rows, and the paged PyTorch path over a long
# block runs far below a gathered block's matmul rate.
PACKED_ROWS_MAX = 16


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """The bookkeeping of one step as tensors on the pages' device (module docstring).

    ``B`` rows (uniform: the sequences; packed: the ``T`` tokens, ``n_tokens`` 1).
    """

    # the sequence of each row: uniform, one per sequence; packed, one per token (repeats)
    seq_ids: list[int]
    # new tokens per row: S (uniform), 1 (packed: every token its own row)
    n_tokens: int
    # (B,) int64 tokens of each row's sequence before its new token(s) (packed: its position)
    lengths: torch.Tensor
    # (B,) int32 tokens after the step as paged_attention reads them (packed: position + 1)
    seq_lens: torch.Tensor
    # (B, max_pages_per_seq) int32 page ids of each row's sequence, -1 past its pages
    block_table: torch.Tensor
    # (B·S,) int64 flat slot page · P + t % P of each new token, row-major over (b, s)
    slots: torch.Tensor
    # the new tokens' RoPE positions: (S,) when every row has length `past`, else (B, S);
    # packed (T, 1); a compacted sequence's are its slots plus its evicted tokens
    positions: torch.Tensor
    # the common length of the rows before the step, None when they differ (packed: None)
    past: int | None
    # the longest sequence after the step
    max_len: int
    # (seq id, pages before, length before) of each sequence: what undo restores
    before: tuple[tuple[int, int, int], ...]
    # the table's step counter when planned: only the latest plan can be undone
    epoch: int
    # the paged_attention plan of block_table and seq_lens that every layer shares
    attention: PagedAttentionPlan
    # with a kv_store: (2, B·S) rows of each new token's key and value (pair_slots), else None
    pair_slots: torch.Tensor | None = None
    # (old, new) pages copied on write before this step: a tensor-parallel peer copies them too
    copies: tuple[tuple[int, int], ...] = ()
    # packed: new tokens of each sequence of `before`, in order; uniform: None
    counts: tuple[int, ...] | None = None
    # packed: (R,) int64 indices among the T tokens of the row tokens (short chunks)
    rows: torch.Tensor | None = None
    # packed: each long chunk as (start among the T tokens, n tokens, int64 page ids of its
    # sequence, its length after the step); its tokens are the sequence's last n
    blocks: tuple[tuple[int, int, torch.Tensor, int], ...] = ()
    # (L, rows, Hkv, 2) int64: each layer's per-row KV-head holes (selfattn.cache.paged.holes),
    # None where no sequence of the step has any; rows as block_table's
    holes: torch.Tensor | None = None
    # packed: each long chunk's (L, Hkv, 2) holes or None, as `blocks`
    block_holes: tuple = ()
    # a per-step memo of PagedLayer.attend_rows: (mask, score mod, scale, sinks, shapes) -> its
    # checked call, filled by the first layer of each kind, read by the others
    fast: dict = dataclasses.field(default_factory=dict)
    # key scores asked of the layers (selfattn.cache.paged.scores): "rows" -> the rows, then
    # layer -> (scores, lse) as each layer runs
    scores: dict = dataclasses.field(default_factory=dict)

    @property
    def packed(self) -> bool:
        """Whether this is a packed step (rows of several sequences' tokens)."""
        return self.counts is not None


def pair_slots(slots: list[int], page_size: int) -> list[int]:
    """``slots`` (flat ``page · P + t % P``) as rows of a layer's ``kv_store`` viewed as
    ``(N·2·P, Hkv, D)``: the keys' rows, then the values' (``P`` rows later)."""
    P = page_size
    keys = [s + s // P * P for s in slots]
    return keys + [r + P for r in keys]


def build(
    before, pages, n_tokens: int, *, page_size: int, max_pages: int, num_pages: int,
    paired: bool, device, epoch: int, copies, offsets=None, holes=None,
) -> StepPlan:  # fmt: skip
    """The plan of ``n_tokens`` new tokens in each sequence of ``before`` (``(id, pages
    before, length before)``), whose pages after the reservation are ``pages``. ``paired``:
    the layers keep one K/V pool (``pair_slots``); ``offsets``: each sequence's evicted
    tokens, or None (module docstring); ``holes``: each sequence's ``(L, Hkv, 2)`` holes or
    None, or None for none (:mod:`selfattn.cache.paged.holes`)."""
    S, P, M, B = n_tokens, page_size, max_pages, len(before)
    # One host list, one copy to the device: lengths (B), slots (B·S), table (B·M), pair slots.
    flat = [n for _, _, n in before]
    for (_, _, n), mine in zip(before, pages):
        flat += [mine[t // P] * P + t % P for t in range(n, n + S)]
    for mine in pages:
        flat += mine
        flat += [-1] * (M - len(mine))
    if paired:
        flat += pair_slots(flat[B : B * (S + 1)], P)
    t = torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
    lengths, slots = t[:B], t[B : B * (S + 1)]
    end = B * (S + 1) + B * M
    table = t[B * (S + 1) : end].view(B, M).to(torch.int32)
    lens = {n for _, _, n in before}
    past = lens.pop() if len(lens) == 1 else None
    seq_lens = (lengths + S).to(torch.int32)
    if offsets is None:
        positions = next_positions(lengths if past is None else past, S, t.device)  # (S,)|(B, S)
    else:
        positions = next_positions(lengths + torch.tensor(offsets, device=t.device), S)
    return StepPlan(
        seq_ids=[s for s, _, _ in before],
        n_tokens=S,
        lengths=lengths,
        seq_lens=seq_lens,
        block_table=table,
        slots=slots,
        positions=positions,
        past=past if B else 0,
        max_len=max((n for _, _, n in before), default=0) + S,
        before=tuple(before),
        epoch=epoch,
        # ours: valid for our pool and this step (the table checked the lengths)
        attention=PagedAttentionPlan(table, seq_lens, valid_for=(num_pages, P, S)),
        pair_slots=t[end:].view(2, B * S) if paired else None,
        copies=tuple(copies),
        holes=None if holes is None else step_holes(holes, device=t.device),
    )


def build_packed(
    before, pages, counts, *, page_size: int, max_pages: int, num_pages: int, paired: bool,
    device, epoch: int, copies, offsets=None, holes=None,
) -> StepPlan:  # fmt: skip
    """The packed plan of ``counts[i]`` new tokens of sequence ``before[i]`` (module
    docstring); ``pages``, ``offsets`` and ``holes`` as :func:`build`'s."""
    P, M = page_size, max_pages
    # deterministic mode: every token a row (each rounded as alone, whatever its chunk)
    rows_max = max(counts, default=0) if is_deterministic() else PACKED_ROWS_MAX
    # One host list, one copy: slots (T), positions (T), table (B·M), for the row tokens their
    # index in T and their sequence's row of the table, then the pair slots.
    slots, pos, table, rows, row_of, spans = [], [], [], [], [], []
    for b, ((_, _, n), mine, c) in enumerate(zip(before, pages, counts)):
        start = len(slots)
        slots += [mine[t // P] * P + t % P for t in range(n, n + c)]
        pos += range(n, n + c)
        table += mine + [-1] * (M - len(mine))
        if c <= rows_max:
            rows += range(start, start + c)
            row_of += [b] * c
        else:
            spans.append((start, c, len(table) - M, len(mine), n + c))
    T, B, R = len(slots), len(before), len(rows)
    pairs = pair_slots(slots, P) if paired else []
    rope = []  # the RoPE positions where they are not the slots: each token's plus its offset
    if offsets is not None:
        rope = [p + off for (_, _, n), c, off in zip(before, counts, offsets)
                for p in range(n, n + c)]  # fmt: skip
    t = torch.tensor(slots + pos + table + rows + row_of + pairs + rope)
    t = t.to(device, non_blocking=True)
    positions = t[T : 2 * T]
    at_rows = 2 * T + B * M  # where the row indices start
    tables = t[2 * T : at_rows].view(B, M).to(torch.int32)
    rows_t = t[at_rows : at_rows + R]
    row_table = tables[t[at_rows + R : at_rows + 2 * R]]  # (R, M)
    row_lens = (positions[rows_t] + 1).to(torch.int32)
    pages_of = t[2 * T : at_rows]
    return StepPlan(
        seq_ids=[s for (s, _, _), c in zip(before, counts) for _ in range(c)],
        n_tokens=1,
        lengths=positions,
        seq_lens=row_lens,
        block_table=row_table,
        slots=t[:T],
        positions=(t[len(t) - T :] if rope else positions).view(T, 1),
        past=None,
        max_len=max((n + c for (_, _, n), c in zip(before, counts)), default=0),
        before=tuple(before),
        epoch=epoch,
        # ours: every row one query over its sequence's own pages and length
        attention=PagedAttentionPlan(row_table, row_lens, valid_for=(num_pages, P, 1)),
        pair_slots=t[at_rows + 2 * R : at_rows + 2 * R + len(pairs)].view(2, T) if paired else None,
        copies=tuple(copies),
        counts=tuple(counts),
        rows=rows_t,
        blocks=tuple(
            (start, c, pages_of[at : at + used], length) for start, c, at, used, length in spans
        ),
        holes=None if holes is None or not R else step_holes(holes, row_of, t.device),
        block_holes=()
        if holes is None
        else tuple(
            None if (h := holes[at // M]) is None else h.to(t.device) for _, _, at, _, _ in spans
        ),
    )
