"""KV compression in the engine: a request's prompt KV compressed after its prefill, the freed
pages back in the pool.

A request names a policy (``SamplingParams.kv_compression``, or the engine's default
``EngineConfig.kv_compression``); :class:`PromptCompression` resolves and checks it when the
request is added, then runs it in three places of a step::

    rows = pc.window_rows(chunks)          # before the forward: the prompt rows its policy reads
    with pc.recording(rows): forward()     # their attention inputs, per layer (pre-hooks)
    pc.compress(seq)                       # the prompt computed: score, keep, compact pages

What a sequence keeps between its chunks (``Sequence.observed``, per layer) depends on what its
policy reads. A policy reading a few rows (SnapKV's and PyramidKV's window, TOVA's last row)
keeps those rows' attention inputs; their queries and softmax are computed at compression.
A policy reading every row (observed attention, expected attention, and AdaKV over either:
``press.statistic()`` is not None) keeps a statistic instead (:meth:`PromptCompression.observe`):
after each chunk's forward, the chunk's queries are projected from its recorded inputs and folded
in with the keys up to the chunk's end read from the pool (observed attention: each key's
attention summed over the rows that see it, ``(Hq, C)``; expected attention: the pre-RoPE
queries' mean and covariance, ``(Hq, D, D)``), and the inputs are dropped: no ``C x d_model``
rows per layer, no second ``(Hq, C, C)`` attention at compression. A preempted sequence's
``observed`` is reset with its pages, so its recompute starts the statistic afresh.

The scheduler stops the prompt's prefill at its end (``Sequence.remaining``) so that what comes
after it (on a preempted sequence's recompute, its earlier output) attends to the compressed
prompt, as it did the first time. Each layer and KV head keeps its own tokens
(:meth:`~selfattn.cache.PagedKV.compact`) in one page list per sequence that serves every layer:
policies with per-layer or per-head budgets (PyramidKV, AdaKV) keep ragged counts, the slots
past a layer's or head's count a hole its attention skips (:mod:`selfattn.cache.paged.holes`),
so their pages saved are those past the largest count.

A prompt too short for its policy (no more tokens than it always keeps, or a budget that cannot
hold them) stays whole and counts as skipped. Ratio 0 never reaches this module: no hooks, no
compaction, outputs bit-identical to no policy.
"""

from __future__ import annotations

import contextlib

import torch

from selfattn.cache import PagedKV
from selfattn.cache.compress import Kept, KVCompression, compression
from selfattn.models.kv_compression import (
    attention_layers,
    check_compressible,
    recorded_inputs,
)
from selfattn.serving.kv_eviction import after_prompt
from selfattn.serving.request import Sequence
from selfattn.serving.sampling import NO_COMPRESSION, SamplingParams

__all__ = ["PromptCompression"]


class PromptCompression:
    """The engine's KV compression over ``model`` and its pool ``kv`` (module docstring);
    ``default`` the engine's ``"POLICY[:RATIO]"`` or None; ``refused``: why this engine runs
    none (every policy is then refused with it), or None."""

    def __init__(self, model, kv: PagedKV, default: str | None, *, refused: str | None = None):
        self.model, self.kv, self.refused = model, kv, refused
        self.default = None if default is None else self._usable(compression(default))
        self._layers = None  # the model's attention modules, found at first use

    def resolve(self, params: SamplingParams) -> KVCompression | None:
        """The compression a request with ``params`` gets: its own, else the engine's default;
        None for none (``"none"``, ratio 0, or a scoring-only request). ValueError naming why
        where this engine cannot run it."""
        spec = params.kv_compression
        if spec is None:
            spec = self.default
        elif spec == NO_COMPRESSION:
            spec = None
        else:
            spec = self._usable(spec)
        return None if params.max_tokens == 0 else spec

    def _usable(self, spec: KVCompression | None) -> KVCompression | None:
        if spec is None:
            return None
        if self.refused is not None:
            raise ValueError(f"kv_compression {spec.name!r}: {self.refused}")
        check_compressible(self.model, "static")
        if type(self.kv) is not PagedKV:
            raise ValueError(f"kv_compression needs a plain PagedKV pool, not {type(self.kv)}")
        return spec

    @property
    def layers(self) -> list:
        if self._layers is None:
            self._layers = attention_layers(self.model)
        return self._layers

    # -- the observation ---------------------------------------------------------------------
    def window_rows(self, chunks) -> list[tuple[Sequence, list[int], int]]:
        """For each ``(sequence, n tokens, first row of the chunk in the step)`` of ``chunks``
        whose prompt is still to be compressed: the step's rows of the prompt tokens its
        policy reads (the last ``query_rows``), where the chunk computes any, and the first
        of those tokens' index in the prompt."""
        found = []
        for seq, n, at in chunks:
            if not seq.compressing:
                continue
            C, start = seq.num_prompt, seq.num_computed
            lo = max(start, C - min(C, seq.request.compression.press.query_rows(C)))
            hi = min(start + n, C)
            if lo < hi:
                found.append((seq, list(range(at + lo - start, at + hi - start)), lo))
        return found

    @contextlib.contextmanager
    def recording(self, rows: list[tuple[Sequence, list[int], int]]):
        """Within the block (the step's forward), each attention layer's input at ``rows``
        (:meth:`window_rows`) is recorded; when the block succeeds each sequence keeps them,
        or folds them into its policy's streamed statistic (:meth:`observe`)."""
        if not rows:
            yield
            return
        at = torch.tensor([r for _, mine, _ in rows for r in mine], dtype=torch.long)
        with recorded_inputs(self.layers, at) as seen:
            yield
        start = 0  # reached when the block succeeds: the rows go to their sequences
        for seq, mine, first in rows:
            part = [seen[i][0][0, start : start + len(mine)] for i in range(len(self.layers))]
            start += len(mine)
            if seq.request.compression.press.statistic() is not None:
                self.observe(seq, part, first)
            elif seq.observed is None:
                seq.observed = part
            else:
                seq.observed = [torch.cat((a, b)) for a, b in zip(seq.observed, part)]

    def observe(self, seq: Sequence, inputs: list[torch.Tensor], first: int) -> None:
        """Fold the prompt rows ``first ..`` of ``seq`` (each layer's attention ``inputs (n,
        d_model)``, their K/V already in the pool) into its policy's per-layer statistic:
        the rows' queries and (where it reads them) the keys up to the last row, chunk-sized
        transients; the rows are not kept."""
        press = seq.request.compression.press
        if seq.observed is None:
            seq.observed = [press.statistic() for _ in self.layers]
        end = first + inputs[0].shape[0]
        positions = torch.arange(first, end, device=self.kv.k_store.device)
        for i, att in enumerate(self.layers):
            stat = seq.observed[i]
            q = att.queries(inputs[i][None], positions, rotate=press.rotated_queries)
            keys = self.kv.gather(seq.kv_id, i)[0][None, :, :end] if stat.needs_keys else None
            stat.update(q, keys, first, att.scale)  # q: (1, Hq, n, D), keys: (1, Hkv, end, D)

    # -- compaction -----------------------------------------------------------------------------
    def due(self, seq: Sequence) -> bool:
        """Whether ``seq`` has just computed its whole prompt, still to be compressed."""
        return seq.compressing and seq.num_computed == seq.num_prompt

    def compress(self, seq: Sequence) -> tuple[int, int] | None:
        """Compress ``seq``'s prompt KV (it is :meth:`due`): score each layer's tokens with its
        policy, keep the best per KV head (each layer its budget, each head its count where the
        policy says), compact them into fewer pages. Returns ``(tokens evicted from the longest
        head, pages freed)``, or None where the prompt stays whole (too short)."""
        spec, C = seq.request.compression, seq.num_prompt
        seq.compressed = True
        observed, seq.observed = seq.observed, None
        n = spec.kept(C)
        if n is None:
            return None
        press, L = spec.press, len(self.layers)
        R = min(C, press.query_rows(C))
        streamed = press.statistic() is not None
        positions = torch.arange(C, device=self.kv.k_store.device)
        cap = C if spec.budget is None else spec.budget
        kept, counts = [], []
        for i, att in enumerate(self.layers):
            queries = statistic = None
            if streamed:
                statistic = observed[i]
            elif R:
                x = observed[i][None]  # (1, R, d_model)
                queries = att.queries(x, positions[C - R :], rotate=press.rotated_queries)
            k, v = self.kv.gather(seq.kv_id, i)  # (Hkv, C, ·)
            scores = press.score(k[None], v[None], queries, layer=i, n_layers=L, rope=att.rope,
                                 positions=positions, scale=att.scale,
                                 statistic=statistic)  # fmt: skip
            chosen = press.keep(scores, min(press.budget(C, i, L), cap))
            ragged = isinstance(chosen, Kept)
            kept.append((chosen.indices if ragged else chosen)[0])  # (Hkv, n_i)
            counts.append(
                chosen.counts[0] if ragged else torch.full_like(kept[-1][:, 0], kept[-1].shape[1])
            )
        n_max = max(k.shape[1] for k in kept)
        if all(int(c.min()) == n_max for c in counts):  # one count: no holes
            done = self.kv.compact(seq.kv_id, torch.stack(kept))
            if spec.decode_budget is not None:  # generation evicts on from these tokens
                seq.evicting = after_prompt(spec, torch.stack(kept), observed if streamed else None)
            return done
        padded = torch.stack([torch.nn.functional.pad(k, (0, n_max - k.shape[1])) for k in kept])
        return self.kv.compact(seq.kv_id, padded, torch.stack(counts))  # (L, Hkv, n_max)
