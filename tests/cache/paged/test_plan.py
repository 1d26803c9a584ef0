"""StepPlan: one frozen plan per step, the tensors every layer shares."""

import dataclasses
import inspect

import pytest
import torch

from selfattn.cache import PagedKV
from selfattn.cache.paged import PagedPlan, StepPlan


def kv() -> PagedKV:
    return PagedKV(2, 16, 4, 1, 3, max_seqs=3, max_pages_per_seq=8, dtype=torch.float64)


def test_the_plan_is_frozen():
    cache = kv()
    plan = cache.plan(cache.add_sequences(2), 2)
    assert PagedPlan is StepPlan and not plan.packed
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.positions = plan.positions + 1


def test_every_field_is_documented():
    lines = inspect.getsource(StepPlan).splitlines()
    for field in dataclasses.fields(StepPlan):
        at = next(i for i, s in enumerate(lines) if s.startswith(f"    {field.name}:"))
        assert lines[at - 1].strip().startswith("#"), f"{field.name} has no comment above it"


def test_a_packed_plan_names_its_counts_and_copies():
    cache = kv()
    a = cache.add_sequence()
    cache.plan([a], 2)
    b = cache.fork(a)
    step = cache.plan_packed([a, b], [1, 20])
    plan = step.layers[0].plan
    assert plan.packed and plan.counts == (1, 20)
    assert plan.copies == ((0, 1),)  # a copies the shared half-full page before writing
    assert [start for start, *_ in plan.blocks] == [1]  # b's chunk of 20 is a query block
    assert len(plan.seq_ids) == 21 and plan.rows.tolist() == [0]


def test_apply_plan_mirrors_the_step():
    """A tensor-parallel peer applies rank 0's step through the public method: the same block
    table, lengths and slots."""
    rank0, peer = kv(), kv()
    a = rank0.add_sequence()
    rank0.plan([a], 3)
    b = rank0.fork(a)
    step = rank0.plan_packed([a, b], [2, 1])
    plan = step.layers[0].plan
    ids = [s for s, _, _ in plan.before]
    lens = [n for _, _, n in plan.before]
    mirror = peer.apply_plan(ids, plan.counts, lens, [rank0.pages(s) for s in ids], plan.copies)
    got = mirror.layers[0].plan
    for name in ("block_table", "seq_lens", "slots", "lengths"):
        assert torch.equal(getattr(got, name), getattr(plan, name)), name
    assert torch.equal(mirror.positions, step.positions)
