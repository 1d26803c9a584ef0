"""Speculative decoding in the engine: drafts for the decoding sequences of a step, and the
verdict on them once the step's one forward has run (:mod:`selfattn.models.speculative` has the
rule and the drafters; this module applies them to a batch).

A step with speculation (``EngineConfig(speculative="ngram" | "draft")``)::

    scheduler      a decoding sequence's chunk: 1 + draft_room(k) tokens, pages budgeted for all
    propose        drafts of up to that many tokens (prompt lookup in the sequence's tokens, or
                   the draft model greedily over its own paged cache); the chunk shrinks to
                   1 + len(draft)
    forward        the last token and the drafts as one chunk of the packed step, every row's
                   logits kept
    verify         greedy: the target's argmax accepts; sampling: the rejection rule on the
                   sequence's processed distribution (temperature, top-k, top-p, min-p)
    settle         the cache keeps the last token and the accepted drafts (the rest trimmed),
                   the draft model's cache too; the accepted tokens and the next one are
                   appended one by one (a stop ends the run there)

Penalised requests and those asking for logprobs decode without drafts
(:meth:`~selfattn.serving.request.Sequence.draft_room`).
"""

from __future__ import annotations

import logging

import torch

from selfattn._log import log_once
from selfattn.models import speculative as spec
from selfattn.serving.sampling import probabilities

__all__ = ["Speculator"]


class Speculator:
    """Drafts and verdicts for one engine (module docstring): ``kind`` "ngram" or "draft"
    (``draft_model`` a loaded causal LM, run over its own pool of ``num_pages`` pages)."""

    def __init__(self, config, target, *, num_pages: int, max_len: int):
        self.kind = config.speculative
        self.k = config.num_speculative_tokens
        self.ngram = (config.prompt_lookup_max, config.prompt_lookup_min)
        self.runner = None
        if self.kind == "draft":
            draft = _draft_model(config.speculative_model, target)
            spec.check_draft_model(target, draft)
            self.runner = spec.PagedRunner(
                draft, max_seqs=config.max_num_seqs, max_len=max_len + self.k + 1,
                num_pages=num_pages, page_size=config.page_size,
            )  # fmt: skip

    def propose(self, seqs: list, rooms: list[int], running) -> tuple[list[list[int]], list]:
        """Drafts of at most ``rooms[i]`` tokens for each decoding sequence ``seqs[i]``, and
        per sequence the draft model's ``q (k, V)`` (None for greedy or prompt lookup).
        ``running``: the engine's running sequences (:meth:`forget` the others first)."""
        if self.runner is None:
            hi, lo = self.ngram
            drafts = [spec.propose_ngram(s.tokens, n, hi, lo) if n else [] for s, n in
                      zip(seqs, rooms)]  # fmt: skip
            return drafts, [None] * len(seqs)
        runner = self.runner
        self.forget(running)

        def pick(logits, rows):
            group = [seqs[r] for r in rows]
            tokens = logits.argmax(-1)
            sampled = [i for i, s in enumerate(group) if not s.params.greedy]
            if not sampled:
                return tokens.tolist(), None
            q = probabilities(logits, group)
            for i in sampled:
                tokens[i] = torch.multinomial(q[i], 1, generator=group[i].generator)[0]
            return tokens.tolist(), q

        try:
            return runner.draft([s.key for s in seqs], [s.tokens for s in seqs], rooms, pick)
        except RuntimeError:  # the draft pool is short: no drafts this step, caches rebuilt
            log_once("speculative-draft-pool", logging.WARNING,
                     "selfattn.serving: the draft model's pool is full; a step runs without "
                     "drafts and the draft caches are rebuilt")  # fmt: skip
            for key in list(runner.ids):
                runner.free(key)
            return [[] for _ in seqs], [None] * len(seqs)

    def forget(self, running) -> None:
        """Free the draft model's cache of every sequence not in ``running`` (finished,
        aborted or preempted: a preempted one catches up when it decodes again)."""
        if self.runner is not None:
            live = {s.key for s in running}
            for key in [key for key in self.runner.ids if key not in live]:
                self.runner.free(key)

    def check(self, running) -> None:
        """AssertionError unless the draft cache holds running sequences only and its own
        bookkeeping holds."""
        if self.runner is not None:
            self.runner.kv.check()
            stale = set(self.runner.ids) - {s.key for s in running}
            if stale:
                raise AssertionError(f"the draft cache holds ended sequences {sorted(stale)}")

    def verify(self, seq, logits: torch.Tensor, draft: list[int], q) -> list[int]:
        """The accepted drafts and the next token of ``seq`` from the target's ``logits (1 +
        len(draft), V)`` at its last token and drafts."""
        if seq.params.greedy:
            return spec.accept_greedy(logits.argmax(-1).tolist(), draft)
        p = probabilities(logits, [seq] * logits.shape[0])
        return spec.accept(p, draft, q, seq.generator)

    def rollback(self, seq, kept: int) -> None:
        """The draft model keeps at most the first ``kept`` tokens of ``seq``."""
        if self.runner is not None:
            self.runner.trim(seq.key, kept)


def _draft_model(model_or_path, target):
    """``speculative_model`` as a model: a path loads in the target's dtype and device."""
    if isinstance(model_or_path, torch.nn.Module):
        return model_or_path
    from selfattn.models import from_pretrained

    w = target.norm.weight
    return from_pretrained(model_or_path, dtype=w.dtype, device=w.device).eval()
