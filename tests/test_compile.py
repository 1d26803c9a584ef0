"""torch.compile over ``sa.attention(backend="auto")``: one graph, no breaks, same answer.

Issue 12's done-when: ``torch.compile(fullgraph=True)`` traces ``attention`` whole for no mask,
causal, sliding window, documents and a callable mask (CPU, fp32, small shapes: compile time).
"""

from __future__ import annotations

import pytest
import torch

import selfattn as sa
from selfattn import masks
from selfattn.testing import (
    assert_close_to_reference,
    make_qkv,
    naive_attention,
    reference_attention,
)
from tests._no_extras import last_json, run_without

B, H, S, D = 1, 2, 64, 16
# three packed documents of odd lengths (20 + 30 + 14 = S)
_DOC_IDS = torch.tensor([0] * 20 + [1] * 30 + [2] * 14)

CASES = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.sliding_window(16),
    "documents": masks.documents(_DOC_IDS),
    "callable": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 3 != 1,
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_compiles_whole_under_auto(case):
    mask = CASES[case]
    q, k, v = make_qkv(B, H, S, D, seed=len(case))

    def step(q, k, v):
        return sa.attention(q, k, v, mask=mask)

    torch._dynamo.reset()  # each case traced from scratch, not through an earlier case's cache
    explained = torch._dynamo.explain(step)(q, k, v)
    reasons = [r.reason for r in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1
    got = torch.compile(step, fullgraph=True)(q, k, v)
    eager = step(q, k, v)
    oracle, *_ = reference_attention(q, k, v, mask=mask)
    naive, *_ = naive_attention(q, k, v, mask=mask)
    assert_close_to_reference(got, oracle, naive)
    assert_close_to_reference(eager, oracle, naive)


def test_compiled_masked_call_keeps_padding_garbage_out():
    """NaN in keys no query attends (padded cache slots) stays out of the compiled output too."""
    q, k, v = make_qkv(B, H, S, D, seed=7)
    valid = 40  # keys past it are unwritten slots
    k[:, :, valid:], v[:, :, valid:] = float("nan"), float("nan")
    mask = lambda b, h, q_idx, kv_idx: kv_idx < valid  # noqa: E731

    def step(q, k, v):
        return sa.attention(q, k, v, mask=mask)

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k, v)
    oracle, *_ = reference_attention(q, k, v, mask=mask)
    naive, *_ = naive_attention(q, k[:, :, :valid], v[:, :, :valid])
    assert_close_to_reference(got, oracle, naive)


@pytest.mark.parametrize("case", ["causal", "window"])
def test_flex_traces_without_breaks(case):
    """backend="flex" (what auto picks for masks on CUDA) traces whole: its block-mask cache
    (a lock and a dict) is left to eager calls. Dynamo only: inductor's CPU FlexAttention
    template is not exercised here."""
    mask = CASES[case]
    q, k, v = make_qkv(B, H, S, D, seed=11)

    def step(q, k, v):
        return sa.attention(q, k, v, mask=mask, backend="flex")

    if sa.backends.available(q, k, v, sa.backends.AttentionCall(mask=mask))["flex"] is not None:
        pytest.skip("flex cannot run here")
    torch._dynamo.reset()
    with torch.no_grad():  # CPU FlexAttention has no backward
        explained = torch._dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]


# -- decode steps: paged_attention, and one step of our Llama over each cache ------------------
# Dynamo (explain) must see one graph; the compiled function runs under the aot_eager backend,
# which traces the custom op through its fake and runs the real kernel (inductor's code
# generation is torch's to test, and costs seconds per graph here).

DECODERS = {
    "llama": dict(
        model_type="llama", vocab_size=53, hidden_size=32, intermediate_size=40,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ),
    "gpt2": dict(model_type="gpt2", vocab_size=53, n_embd=32, n_layer=2, n_head=4, n_positions=32),
}  # fmt: skip


def _no_breaks(fn, *args):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("mask", [masks.causal(), masks.sliding_window(6)], ids=str)
def test_paged_attention_decode_step_compiles_whole(mask):
    """A ragged, masked decode step over a shuffled page pool, with the step's plan, traces as
    one graph (the C kernel's custom op through its fake; the plan, an eager cache, is left
    out) and the compiled call gives the eager answer. tests/test_kernels.py compiles the
    unmasked step with inductor."""
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, P, N = 3, 4, 2, 16, 4, 13
    seq_lens = torch.tensor([9, 1, 14], dtype=torch.int32)
    table = torch.randperm(N, generator=g)[: B * 4].view(B, 4).to(torch.int32)  # (B, max_pages)
    q = torch.randn(B, Hq, 1, D, generator=g)
    k_pages, v_pages = torch.randn(2, N, P, Hkv, D, generator=g)

    plan = sa.cache.PagedAttentionPlan(table, seq_lens)

    def step(q, k_pages, v_pages):
        return sa.cache.paged_attention(q, k_pages, v_pages, table, seq_lens, mask=mask, plan=plan)

    args = (q, k_pages, v_pages)
    if sa.backends.explain_paged(*args, table, seq_lens, mask=mask, print_table=False).chosen != (
        "cpu"
    ):
        pytest.skip("the C kernel cannot run here")
    _no_breaks(step, *args)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    eager = step(*args)
    oracle = step(*(t.double() for t in args))  # the PyTorch path in float64
    naive = sa.cache.paged_attention(*args, table, seq_lens, mask=mask, backend="torch")
    assert_close_to_reference(got, oracle, naive)
    assert_close_to_reference(eager, oracle, naive)


def _prefilled(family: str, kind: str, dtype=torch.float32):
    """A tiny decoder and its cache after a 7-token prefill of 2 sequences, and the next tokens."""
    from selfattn.models.decoder import GPT2, Llama

    torch.manual_seed(3)
    config = DECODERS[family]
    model = (GPT2 if family == "gpt2" else Llama).from_config(config).to(dtype).eval()
    ids = torch.randint(0, config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    cache = model.make_cache(kind, 2, 16, page_size=4)
    model(ids[:, :7], cache=cache)
    return model, cache, ids[:, 7:8]


@pytest.mark.parametrize(
    "family,kind", [("llama", "static"), ("llama", "paged"), ("gpt2", "paged")]
)
@torch.no_grad()
def test_decoder_step_compiles_whole(family, kind):
    """One decode step of our Llama (RoPE) traces as one graph over a static cache and over the
    paged KV, and GPT-2's (learned positions) too, the cache planned eagerly before the compiled
    step (``cache.plan(1)``: the paged KV's page allocation is Python bookkeeping that stays
    outside the graph)."""

    def step(model, planned, token):
        return model(token, cache=planned)

    model, cache, token = _prefilled(family, kind)
    _no_breaks(step, model, cache.plan(1), token)
    model, cache, token = _prefilled(family, kind)  # explain ran the step: start again
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(model, cache.plan(1), token)
    model, cache, token = _prefilled(family, kind)
    eager = step(model, cache.plan(1), token)
    model, cache, token = _prefilled(family, kind, torch.float64)
    oracle = step(model, cache.plan(1), token)
    assert_close_to_reference(got, oracle, eager)


@torch.no_grad()
def test_paged_decode_steps_reuse_one_graph():
    """Over the paged KV the step's bookkeeping lives in tensors (table, lengths, slots), so
    later decode steps, new pages included, run the first step's graph: no recompilation. (A
    static cache's Python length is a guard: each step compiles again.)"""
    from torch._dynamo.utils import counters

    model, cache, token = _prefilled("llama", "paged")
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda token, planned: model(token, cache=planned), fullgraph=True,
                         backend="aot_eager")  # fmt: skip
    for _ in range(4):  # lengths 8..11 with P=4: a new page at the second step
        step(token, cache.plan(1))
    assert counters["stats"]["unique_graphs"] == 1


# -- a cold start: the first call of the process is the traced one ---------------------------------
COLD_START = """
import json
import torch
import selfattn as sa
from selfattn import masks

g = torch.Generator().manual_seed(9)
q, k, v = torch.randn(3, 1, 2, 19, 16, generator=g)
dense = lambda q, k, v: sa.attention(q, k, v, mask=masks.causal())
got = torch.compile(dense, fullgraph=True, backend="aot_eager")(q, k, v)
errors = {"dense": (got - dense(q, k, v)).abs().max().item()}

seq_lens = torch.tensor([9, 1, 14], dtype=torch.int32)
table = torch.randperm(13, generator=g)[:12].view(3, 4).to(torch.int32)
q1 = torch.randn(3, 4, 1, 16, generator=g)
k_pages, v_pages = torch.randn(2, 13, 4, 2, 16, generator=g)
paged = lambda q, kp, vp: sa.cache.paged_attention(q, kp, vp, table, seq_lens, mask=masks.causal())
got = torch.compile(paged, fullgraph=True, backend="aot_eager")(q1, k_pages, v_pages)
errors["paged"] = (got - paged(q1, k_pages, v_pages)).abs().max().item()
print(json.dumps(errors))
"""


def test_cold_process_compiles_whole():
    """``fullgraph=True`` on the very first call of a fresh interpreter, dense and paged. The
    tests above run eagerly first, which once hid a break: the backend registry read the call
    type's field defaults with ``dataclasses.fields`` on first use, which Dynamo cannot trace."""
    done = run_without(COLD_START, hidden=(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert last_json(done.stdout) == {"dense": 0.0, "paged": 0.0}
