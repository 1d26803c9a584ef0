"""Speculative decoding's parts: drafts, the acceptance rule and a paged runner for the models.

A step proposes ``k`` draft tokens ``x1..xk`` after a sequence's last token ``t`` and verifies
them in ONE forward of ``k + 1`` tokens over the target's cache::

    input     t    x1   x2   x3            target logits at each position give p1..p4
    verify    p1?x1 p2?x2 p3?x3            accept left to right; the first rejection ends it
    emits     x1 x2 (rejected x3) -> y     y drawn from the residual at the first rejection,
                                           or from p4 (the bonus token) when all are accepted

So a step emits between 1 and ``k + 1`` tokens, and the cache keeps ``t`` and the accepted
drafts only: the rejected tokens' slots are rolled back (:meth:`PagedRunner.trim`,
:meth:`selfattn.cache.PagedKV.trim`).

Drafts come from the text itself (prompt lookup: :func:`propose_ngram`, Saxena 2023; the last
``n`` tokens matched earlier in the prompt and output, the tokens that followed copied) or from a
smaller draft model run greedily for ``k`` steps (:class:`PagedRunner` over its own cache).

The rule (:func:`accept`; Leviathan et al. 2023, Chen et al. 2023): draft token ``x`` drawn
from ``q`` is accepted with probability ``min(1, p(x) / q(x))``; on rejection the token comes
from ``norm(max(0, p - q))``. The emitted tokens are then distributed exactly as sampling from
``p`` one token at a time. A prompt-lookup draft is a point mass (``q = onehot(x)``): accepted
with probability ``p(x)``, else drawn from ``p`` with ``x`` removed. Greedy decoding
(:func:`accept_greedy`) accepts while the target's argmax equals the draft, so its output is
plain greedy decoding's (bit for bit where the verify forward's logits equal a one-token
step's, as in float32; in bfloat16 a near-tie can round the other way, as it can between the
static and the paged cache).

Used by :func:`selfattn.models.generate` (``prompt_lookup_num_tokens=``, ``assistant_model=``)
and the serving engine (``EngineConfig(speculative="ngram" | "draft")``).
"""

from __future__ import annotations

import torch

from selfattn._validate import int_at_least
from selfattn.cache import PagedKV

__all__ = [
    "DEFAULT_NGRAM_MAX",
    "DEFAULT_NGRAM_MIN",
    "DEFAULT_NUM_SPECULATIVE_TOKENS",
    "PagedRunner",
    "accept",
    "accept_greedy",
    "check_draft_model",
    "check_ngram_sizes",
    "propose_ngram",
]

# Prompt lookup tries the longest n-gram first, down to the shortest (vLLM's prompt_lookup_max
# and prompt_lookup_min; transformers matches up to max_matching_ngram_size=2 and down to 1). A
# 3-token match rarely continues wrongly; a 1-token match still finds copies in short texts.
DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 1
# Draft tokens per step (transformers' num_assistant_tokens default; vLLM's examples use 4-5).
DEFAULT_NUM_SPECULATIVE_TOKENS = 5


def check_ngram_sizes(ngram_min, ngram_max) -> None:
    """ValueError unless ``1 <= ngram_min <= ngram_max`` (ints)."""
    int_at_least(ngram_min, "ngram_min", 1)
    int_at_least(ngram_max, "ngram_max", 1)
    if ngram_min > ngram_max:
        raise ValueError(
            f"ngram_min ({ngram_min}) must be <= ngram_max ({ngram_max}); lower ngram_min"
        )


def check_draft_model(target, draft) -> None:
    """ValueError unless ``draft`` can draft for ``target``: a causal LM over the same
    vocabulary (its token ids must mean the same tokens)."""
    from selfattn.models.decoder import CausalLM

    if not isinstance(draft, CausalLM):
        raise TypeError(
            f"a draft model must be a selfattn causal LM (selfattn.models.from_pretrained), got "
            f"{type(draft).__name__}"
        )
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(
            f"the draft model's vocabulary ({vd} tokens) differs from the target's ({vt}); a "
            "draft must share the target's tokenizer (pick one of the same family)"
        )


def propose_ngram(
    tokens, k: int, ngram_max: int = DEFAULT_NGRAM_MAX, ngram_min: int = DEFAULT_NGRAM_MIN
) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens`` by prompt lookup (module docstring).

    For ``n`` from ``ngram_max`` down to ``ngram_min``: the last ``n`` tokens are searched for
    earlier in ``tokens``, most recent occurrence first; the tokens that followed it (at most
    ``k``) are the draft. ``[]`` when no n-gram recurs::

        tokens  a b c d a b    n = 2: "a b" occurs at 0, followed by "c d a b"
        draft   c d a          (k = 3)
    """
    L = len(tokens)
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        suffix = tokens[L - n :]
        last = suffix[-1]
        # an occurrence ending at i (< L - 1) with at least one token after it
        for i in range(L - 2, n - 2, -1):
            if tokens[i] == last and tokens[i - n + 1 : i + 1] == suffix:
                return list(tokens[i + 1 : i + 1 + k])
    return []


def accept_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """Greedy verification: the target's ``argmax`` at each of the ``k + 1`` positions of
    ``[t, x1..xk]`` against ``draft`` ``x1..xk``; returns the accepted drafts and the next
    token (the target's own at the first mismatch, else the bonus ``argmax[k]``)."""
    out = []
    for a, x in zip(argmax, draft):
        if a != x:
            break
        out.append(x)
    out.append(argmax[len(out)])
    return out


def accept(
    p: torch.Tensor,
    draft: list[int],
    q: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The rejection rule (module docstring) for one sequence: the accepted drafts and the next
    token.

    ``p (k + 1, V)``: the target's processed probabilities (temperature, top-k, top-p applied)
    at the positions of ``[t, x1..xk]``; ``draft`` the ``k`` tokens; ``q (k, V)`` the draft
    model's probabilities they were drawn from, None for a point mass (prompt lookup). Draws
    with ``generator`` (the global RNG when None).
    """
    k = len(draft)
    if p.dim() != 2 or p.shape[0] != k + 1:
        got = tuple(p.shape)
        raise ValueError(f"p must be (k + 1 = {k + 1}, V) for {k} draft tokens, got {got}")
    p = p.float()
    idx = torch.tensor(draft, dtype=torch.long, device=p.device)
    rows = torch.arange(k, device=p.device)
    px = p[rows, idx]  # (k,)
    qx = torch.ones_like(px) if q is None else q.float()[rows, idx]
    u = torch.rand(k, generator=generator, device="cpu").to(p.device)
    ok = (u * qx < px).tolist()  # u < p(x) / q(x), without dividing by a zero q(x)
    n = ok.index(False) if False in ok else k
    if n == k:
        return [*draft, _draw(p[k], generator)]
    if q is None:
        residual = p[n].clone()
        residual[draft[n]] = 0.0
    else:
        residual = (p[n] - q[n].float()).clamp_min(0.0)
    if not float(residual.sum()) > 0:  # p <= q everywhere only when rounding says so
        residual = p[n]
    return [*draft[:n], _draw(residual, generator)]


def _draw(weights: torch.Tensor, generator) -> int:
    """One token from the unnormalised ``weights (V,)``."""
    return int(torch.multinomial(weights, 1, generator=generator))


class PagedRunner:
    """A causal LM over its own paged cache, fed chunks of several sequences in one packed
    forward: the draft model of a speculative step, and :func:`generate`'s target.

    Sequences are keyed by any hashable; a key's cache holds the tokens fed so far
    (:meth:`length`), :meth:`trim` rolls them back, :meth:`free` drops them. ``num_pages`` pages
    of ``page_size`` tokens for at most ``max_seqs`` sequences of at most ``max_len`` tokens.
    """

    def __init__(self, model, *, max_seqs: int, max_len: int, num_pages: int | None = None,
                 page_size: int = 16):  # fmt: skip
        c = model.config
        per_seq = -(-max_len // page_size)
        w = model.norm.weight
        self.model = model
        self.kv = PagedKV(
            c.n_layers, per_seq * max_seqs if num_pages is None else num_pages, page_size,
            c.n_kv_heads, c.head_dim, max_seqs=max_seqs, max_pages_per_seq=per_seq,
            dtype=w.dtype, device=w.device,
        )  # fmt: skip
        self.ids: dict = {}  # key -> the cache's sequence id

    def length(self, key) -> int:
        """Tokens of ``key`` in the cache (0 for a key never fed)."""
        sid = self.ids.get(key)
        return 0 if sid is None else self.kv.length(sid)

    def trim(self, key, length: int) -> None:
        """Keep at most the first ``length`` cached tokens of ``key``."""
        if key in self.ids:
            sid = self.ids[key]
            self.kv.trim(sid, min(length, self.kv.length(sid)))

    def free(self, key) -> None:
        if key in self.ids:
            self.kv.free(self.ids.pop(key))

    def forward(self, keys, chunks, keep_all=None) -> list[torch.Tensor]:
        """Append ``chunks[i]`` (token ids, at least one) to ``keys[i]`` in one forward; returns
        for each key the logits ``(n, V)`` of its chunk's last token (n = 1), or of every token
        where ``keep_all[i]``."""
        ids = [self.ids.get(key) for key in keys]
        for i, sid in enumerate(ids):
            if sid is None:
                ids[i] = self.ids[keys[i]] = self.kv.add_sequence()
        counts = [len(c) for c in chunks]
        keep_all = [False] * len(keys) if keep_all is None else keep_all
        rows, spans, at = [], [], 0
        for n, every in zip(counts, keep_all):
            first = at if every else at + n - 1
            spans.append((len(rows), at + n - first))
            rows += range(first, at + n)
            at += n
        dev = self.kv.k_store.device
        x = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=dev)
        step = self.kv.plan_packed(ids, counts)
        try:
            with torch.no_grad():
                logits = self.model(x.view(1, -1), cache=step,
                                    logits_to_keep=torch.tensor(rows, device=dev))[0]  # fmt: skip
        except BaseException:
            self.kv.undo(step.layers[0].plan)
            raise
        return [logits[s : s + n] for s, n in spans]

    def draft(self, keys, contexts, ks, pick) -> tuple[list[list[int]], list]:
        """Up to ``ks[i]`` draft tokens continuing ``contexts[i]`` (every token of the
        sequence so far) for each key, ``ks[i]`` steps of packed single-token forwards after
        one that feeds what the cache lacks.

        ``pick(logits (R, V), rows) -> (tokens, probs or None)`` chooses each row's token
        (``rows``: indices into ``keys``); its probabilities (the draft's ``q``) are kept per
        key. Returns the drafts and, per key, ``q (ks[i], V)`` or None. The cache then holds
        every context token and all but the last draft token: after verification, trim it to
        the tokens accepted.
        """
        drafts = [[] for _ in keys]
        qs: list[list] = [[] for _ in keys]
        live = [i for i, k in enumerate(ks) if k > 0]
        chunks = [contexts[i][self.length(keys[i]) :] for i in live]
        for i, c in zip(live, chunks):
            if not c:  # never more cached than the context: re-feed its last token
                self.trim(keys[i], len(contexts[i]) - 1)
        chunks = [contexts[i][self.length(keys[i]) :] for i in live]
        while live:
            logits = torch.cat(self.forward([keys[i] for i in live], chunks))
            tokens, probs = pick(logits, live)
            for r, (i, t) in enumerate(zip(live, tokens)):
                drafts[i].append(t)
                qs[i].append(None if probs is None else probs[r])
            live = [i for i in live if len(drafts[i]) < ks[i]]
            chunks = [[drafts[i][-1]] for i in live]
        q = [torch.stack(x) if x and x[0] is not None else None for x in qs]
        return drafts, q
