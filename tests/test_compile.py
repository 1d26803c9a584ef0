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
