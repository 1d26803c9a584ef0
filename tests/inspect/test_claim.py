"""The attention-vs-causal-effect measurement: Spearman by hand, and on the planted induction
circuit both the attention scores and the effects single out the induction head."""

from __future__ import annotations

import pytest
import torch

from selfattn.inspect.claim import Task, attention_vs_effect, spearman
from tests.inspect.test_circuits import V, planted


def test_spearman():
    a = torch.tensor([3.0, 1.0, 2.0, 5.0])
    assert spearman(a, a.exp()) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    # ties take their mean rank: ranks (1.5, 1.5, 3) and (1, 2, 3) -> 0.866...
    assert spearman(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(
        (3 / 4) ** 0.5
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, generator=g), torch.randn(50, generator=g)
    rx, ry = x.argsort().argsort().double(), y.argsort().argsort().double()
    pearson = torch.corrcoef(torch.stack((rx, ry)))[0, 1].item()
    assert spearman(x, y) == pytest.approx(pearson)


def _planted_task(p1: int, seed: int = 0) -> Task:
    g = torch.Generator().manual_seed(seed)
    T, B = 10, 4
    half = torch.stack([torch.randperm(V - 1, generator=g)[:T] + 1 for _ in range(B)])
    x = torch.cat((torch.zeros(B, 1, dtype=torch.long), half, half), dim=1)
    q = torch.arange(T + 1, 2 * T)
    rel = torch.zeros(B, len(q), x.shape[1], dtype=torch.bool)
    rel[:, torch.arange(len(q)), q - T + 1] = True

    def metric(logits):
        logp = torch.log_softmax(logits.double(), -1)
        return logp.gather(-1, x[:, q + 1].unsqueeze(-1)).squeeze(-1).mean(-1)

    corrupted = x.clone()
    corrupted[:, T + 1 :] = torch.roll(x[:, T + 1 :], 1, dims=0)  # another row's repeat
    return Task("planted", x, q, rel, metric, corrupted=corrupted)


def test_the_planted_circuit_in_scores_and_effects():
    p0, p1 = 0, 1
    m = planted(p0, p1)
    r = attention_vs_effect(m, [_planted_task(p1)])
    t = r.tasks["planted"]
    index = r.heads.index((1, p1))
    for name, score in t["scores"].items():
        assert int(score.argmax()) == index, name
    # both heads of the circuit matter causally (the previous-token head feeds the induction
    # head's keys), the other two not at all: attention to the answer's token sees only one
    effect = t["effects"]["ablation"]
    circuit = [r.heads.index((0, p0)), index]
    others = [i for i in range(4) if i not in circuit]
    assert bool((effect[circuit] > 1.0).all()) and bool((effect[others].abs() < 1e-9).all())
    assert set(t["spearman"]) == {
        (s, e) for s in ("attention", "rollout", "attention_x_gradient")
        for e in ("ablation", "patching")
    }  # fmt: skip
    rows = r.table()
    assert len(rows) == 6 and all(-1 <= row["spearman"] <= 1 for row in rows)
