""" "Attention is not Explanation", measured: how well attention-based head importance ranks
heads by their causal effect.

A :class:`Task` is prompts, the query rows that answer, the key tokens the answer depends on,
and a metric of the logits (higher = better). For each head, three attention-based scores:

- ``attention``: the attention those rows pay to the relevant keys;
- ``rollout``: the same rows' attention composed with the rollout of the blocks below
  (Abnar & Zuidema 2020: ``0.5·A + 0.5·I``, head-averaged), read at the relevant tokens;
- ``attention_x_gradient``: ``|Σ A ⊙ ∂metric/∂A|`` over those rows and keys;

and two causal effects: ``ablation`` (the metric's drop when the head's output is replaced by
its mean over the task's batch and positions) and, for tasks with corrupted prompts,
``patching`` (the share of the clean metric restored by the head's clean output). The report is
the Spearman rank correlation of each score with the size of each effect, per task, over heads.

The tasks are written by the code: :func:`induction_task` (repeated random tokens),
:func:`factual_task` (capitals; needs the model to know some) and :func:`ioi_task` (indirect
object identification with single-token names), the last two from a tokenizer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from selfattn.inspect.attribution import attention_rollout
from selfattn.inspect.circuits import (
    activation_patching,
    attention_heads,
    repeated_tokens,
)
from selfattn.inspect.hooks import hooks

__all__ = [
    "ClaimReport",
    "Task",
    "attention_vs_effect",
    "factual_task",
    "induction_task",
    "ioi_task",
    "spearman",
]

SCORES = ("attention", "rollout", "attention_x_gradient")


@dataclass
class Task:
    """``ids (B, S)``; ``queries (Q,)`` the answering rows; ``relevant (B, Q, S)`` bool, the
    keys each row's answer depends on; ``metric(logits) -> (B,)`` of the logits at the query
    rows ``(B, Q, vocab)`` (the model computes no others); ``corrupted`` prompts of the same
    shape for patching (optional)."""

    name: str
    ids: torch.Tensor
    queries: torch.Tensor
    relevant: torch.Tensor
    metric: Callable[[torch.Tensor], torch.Tensor]
    corrupted: torch.Tensor | None = None


def induction_task(model: nn.Module, *, length: int = 20, batch: int = 8, seed: int = 0) -> Task:
    """Repeated random tokens: rows of the repeated half, each depending on the token after its
    earlier occurrence; the metric is minus the mean next-token loss on that half."""
    x = repeated_tokens(model, length, batch, seed=seed)
    T = length
    q = torch.arange(T + 1, 2 * T)  # rows whose next token is predictable by induction
    rel = torch.zeros(batch, len(q), x.shape[1], dtype=torch.bool)
    rel[:, torch.arange(len(q)), q - T + 1] = True

    def metric(logits):  # (B, Q, V) at the rows q
        logp = torch.log_softmax(logits.double(), -1)
        return logp.gather(-1, x[:, q + 1].unsqueeze(-1)).squeeze(-1).mean(-1)

    return Task("induction", x, q, rel, metric)


def _single(tokenizer, words) -> dict[str, int]:
    """``word -> token id`` of the words that are one token (with their leading space)."""
    out = {}
    for w in words:
        ids = tokenizer.encode(" " + w)
        if len(ids) == 1:
            out[w] = ids[0]
    return out


_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "Russia": "Moscow", "Egypt": "Cairo", "China": "Beijing",
    "England": "London", "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna",
    "Poland": "Warsaw", "Ireland": "Dublin", "Norway": "Oslo", "Kenya": "Nairobi",
}  # fmt: skip

_NAMES = (
    "Mary", "John", "Tom", "James", "Anna", "Paul", "Sarah", "David", "Lisa", "Mark",
    "Kate", "Peter", "Emma", "Jack", "Alice", "Bob", "Laura", "Mike", "Rose", "Sam",
)  # fmt: skip


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def factual_task(tokenizer, *, template: str = "The capital of {} is") -> Task:
    """Capitals: ``template`` filled with a country, answered by its capital's first token at
    the last row; the relevant key is the country's token. Countries and capitals that are one
    token each (with a leading space) are kept."""
    countries = _single(tokenizer, _CAPITALS)
    capitals = _single(tokenizer, _CAPITALS.values())
    pairs = [(c, _CAPITALS[c]) for c in countries if _CAPITALS[c] in capitals]
    if len(pairs) < 2:
        raise ValueError("the tokenizer has fewer than 2 one-token country/capital pairs")
    prompts = [_encode(tokenizer, template.format(c)) for c, _ in pairs]
    S = len(prompts[0])
    keep = [(p, pair) for p, pair in zip(prompts, pairs) if len(p) == S]
    x = torch.tensor([p for p, _ in keep])
    where = [p.index(countries[c]) for p, (c, _) in keep]
    rel = torch.zeros(len(keep), 1, S, dtype=torch.bool)
    rel[torch.arange(len(keep)), 0, torch.tensor(where)] = True
    answers = torch.tensor([capitals[a] for _, (_, a) in keep])

    def metric(logits):
        return torch.log_softmax(logits[:, -1].double(), -1).gather(-1, answers.view(-1, 1))[:, 0]

    return Task("factual", x, torch.tensor([S - 1]), rel, metric)


_IOI = "When{} and{} went to the store,{} gave a drink to"


def ioi_task(tokenizer, *, n: int = 16, seed: int = 0) -> Task:
    """Indirect object identification: "When A and B went to the store, B gave a drink to" ->
    " A"; the metric is ``logit(A) - logit(B)`` at the last row, the relevant key is A's first
    mention; corrupted prompts put two other names in place (for patching)."""
    names = _single(tokenizer, _NAMES)
    if len(names) < 4:
        raise ValueError("the tokenizer has fewer than 4 one-token names for the IOI prompts")
    rng = random.Random(seed)
    pool = sorted(names)
    rows, bad, io, s = [], [], [], []
    for _ in range(n):
        a, b, c, d = rng.sample(pool, 4)
        rows.append(_encode(tokenizer, _IOI.format(" " + a, " " + b, " " + b)))
        bad.append(_encode(tokenizer, _IOI.format(" " + c, " " + d, " " + d)))
        io.append(names[a])
        s.append(names[b])
    if len({len(r) for r in rows + bad}) != 1:
        raise ValueError("the IOI prompts tokenise to different lengths with this tokenizer")
    x = torch.tensor(rows)
    S = x.shape[1]
    rel = torch.zeros(n, 1, S, dtype=torch.bool)
    for i, (r, a) in enumerate(zip(rows, io)):
        rel[i, 0, r.index(a)] = True
    io_t, s_t = torch.tensor(io), torch.tensor(s)

    def metric(logits):
        last = logits[:, -1].double()
        return last.gather(-1, io_t.view(-1, 1))[:, 0] - last.gather(-1, s_t.view(-1, 1))[:, 0]

    return Task("ioi", x, torch.tensor([S - 1]), rel, metric, corrupted=torch.tensor(bad))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D samples (ties get their mean rank)."""

    def ranks(x):
        x = x.double()
        order = x.argsort()
        r = torch.empty_like(x)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in x.unique():  # ties: the mean of their ranks
            tie = x == v
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.pow(2).sum() * rb.pow(2).sum()).sqrt()
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


@dataclass
class ClaimReport:
    """Per task: each head's attention-based ``scores`` and causal ``effects`` (flat over the
    model's heads in ``heads`` order, ``(block, head)``), the clean metric, and ``spearman``:
    ``{(score, effect): ρ}`` of the score against the effect's size."""

    heads: list[tuple[int, int]]
    tasks: dict[str, dict] = field(default_factory=dict)

    def table(self) -> list[dict]:
        """One row per (task, score, effect): ``task``, ``score``, ``effect``, ``spearman``."""
        return [
            {"task": t, "score": s, "effect": e, "spearman": rho}
            for t, r in self.tasks.items()
            for (s, e), rho in r["spearman"].items()
        ]


def _scores(model, task: Task, heads, layers) -> dict[str, torch.Tensor]:
    """The three attention-based scores of every head on ``task``."""
    grads, kept = {}, {}

    def grab(value, point):  # the pattern as a leaf: the output recomputed from it
        leaf = value.detach().requires_grad_()
        kept[point.name] = leaf
        return leaf

    names = {f"blocks.{i}.attn.hook_pattern": i for i in layers}
    with torch.enable_grad(), hooks(model, edit=dict.fromkeys(names, grab)):
        m = task.metric(model(task.ids, logits_to_keep=task.queries)).mean()
        got = torch.autograd.grad(m, [kept[n] for n in names])
    grads = dict(zip(names, got))
    q, rel = task.queries, task.relevant.double()  # (Q,), (B, Q, S)
    pats = [kept[n].detach().double() for n in names]  # each (B, H, S, S)
    roll = attention_rollout(torch.stack(pats))  # (L, B, S, S): through block l
    out = {s: [] for s in SCORES}
    for li, name in enumerate(names):
        p = pats[li][:, :, q]  # (B, H, Q, S)
        below = roll[li - 1] if li else torch.eye(p.shape[-1], dtype=p.dtype).expand_as(roll[0])
        relv = rel.unsqueeze(1)  # (B, 1, Q, S)
        out["attention"].append((p * relv).sum(-1).mean((0, 2)))
        through = p @ below.unsqueeze(1)  # (B, H, Q, S): the rows' reach into the inputs
        out["rollout"].append((through * relv).sum(-1).mean((0, 2)))
        g = grads[name].double()[:, :, q]
        out["attention_x_gradient"].append((p * g * relv).sum(-1).mean(0).sum(-1).abs())
    return {s: torch.cat(v) for s, v in out.items()}


@torch.no_grad()
def _ablation_effect(model, task: Task, heads_of: dict[int, int]) -> torch.Tensor:
    """Each head's effect: the clean metric minus the metric with the head's ``z`` at its mean
    (over the batch and positions), one forward per block (the batch once per head)."""
    keep = task.queries
    with hooks(model, capture="blocks.*.attn.hook_z") as c:
        clean = task.metric(model(task.ids, logits_to_keep=keep)).mean().item()
    B, out = task.ids.shape[0], []
    for i, H in heads_of.items():
        mean = c[f"blocks.{i}.attn.hook_z"].mean((0, 2))  # (H, Dv)

        def edit(value, point, mean=mean, H=H):
            value = value.clone().view(H, B, *value.shape[1:])
            for h in range(H):
                value[h, :, h] = mean[h].to(value.dtype)
            return value.view(H * B, *value.shape[2:])

        with hooks(model, edit={f"blocks.{i}.attn.hook_z": edit}):
            logits = model(task.ids.repeat(H, 1), logits_to_keep=keep)
            logits = logits.view(H, B, *logits.shape[1:])
            m = torch.stack([task.metric(part).mean() for part in logits])
        out.append(clean - m)
    return torch.cat(out).double()


def attention_vs_effect(model: nn.Module, tasks: list[Task]) -> ClaimReport:
    """Score every head by attention and by causal effect on each task (module docstring)."""
    heads_of = dict(attention_heads(model))
    heads = [(i, h) for i, H in heads_of.items() for h in range(H)]
    report = ClaimReport(heads)
    for task in tasks:
        scores = _scores(model, task, heads, list(heads_of))
        effects = {"ablation": _ablation_effect(model, task, heads_of)}
        if task.corrupted is not None:
            r = activation_patching(model, task.ids, task.corrupted, task.metric,
                                    logits_to_keep=task.queries)  # fmt: skip
            effects["patching"] = torch.cat([r.effect[i, :H] for i, H in heads_of.items()])
        with torch.no_grad():
            clean = task.metric(model(task.ids, logits_to_keep=task.queries)).mean().item()
        rho = {(s, e): spearman(scores[s], effects[e].abs()) for s in scores for e in effects}
        report.tasks[task.name] = {"scores": scores, "effects": effects, "metric": clean,
                                   "spearman": rho, "examples": task.ids.shape[0]}  # fmt: skip
    return report
