"""GAT layer: parity with torch_geometric's GATConv, ragged == dense selfattn, errors."""

from __future__ import annotations

import pytest
import torch

from selfattn.models.graph import GATLayer, gat_qk, neighbour_attention, segment_softmax
from selfattn.testing import reference_attention

GATConv = pytest.importorskip("torch_geometric.nn").GATConv


def random_graph(N: int, E: int, seed: int, isolated: int = 2, loops: bool = True):
    """Duplicate-free random edges (2, E) over N nodes; the last ``isolated`` nodes have no edge,
    and some self loops are present when ``loops``."""
    g = torch.Generator().manual_seed(seed)
    M = N - isolated
    pairs = torch.randperm(M * M, generator=g)[:E]
    src, dst = pairs // M, pairs % M
    if not loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    else:  # make sure a few loops are there
        src[:3], dst[:3] = dst[:3], dst[:3]
        e = torch.unique(torch.stack([src, dst]), dim=1)
        src, dst = e[0], e[1]
    perm = torch.randperm(src.numel(), generator=g)  # edges in no particular order
    return torch.stack([src[perm], dst[perm]])


def make_pair(in_dim, out_dim, heads, concat, loops, bias, seed, dtype=torch.float64):
    torch.manual_seed(seed)
    conv = GATConv(in_dim, out_dim, heads=heads, concat=concat, add_self_loops=loops, bias=bias)
    ours = GATLayer(in_dim, out_dim, heads, concat=concat, add_self_loops=loops, bias=bias)
    with torch.no_grad():
        ours.lin.weight.copy_(conv.lin.weight)
        ours.att_src.copy_(conv.att_src[0])
        ours.att_dst.copy_(conv.att_dst[0])
        if bias:
            conv.bias.normal_()  # GATConv initialises its bias to zeros: make it matter
            ours.bias.copy_(conv.bias)
    return conv.to(dtype).eval(), ours.to(dtype).eval()


def grads(module, x):
    return [x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("concat", [True, False])
@pytest.mark.parametrize("loops", [True, False])
def test_matches_gatconv_fp64_with_gradients(heads, concat, loops):
    seed = 100 * heads + 10 * concat + loops
    N, in_dim, out_dim = 29, 7, 5
    conv, ours = make_pair(in_dim, out_dim, heads, concat, loops, True, seed)
    e = random_graph(N, 90, seed)
    x = torch.randn(N, in_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = conv(xa, e), ours(xb, e)
    torch.testing.assert_close(yb, ya, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    # GATConv's parameters: bias, att_src, att_dst, lin.weight; ours: att_src, att_dst, bias, lin
    ga = {"x": xa.grad, "lin": conv.lin.weight.grad, "bias": conv.bias.grad}
    ga |= {"src": conv.att_src.grad[0], "dst": conv.att_dst.grad[0]}
    gb = {"x": xb.grad, "lin": ours.lin.weight.grad, "bias": ours.bias.grad}
    gb |= {"src": ours.att_src.grad, "dst": ours.att_dst.grad}
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("concat", [True, False])
def test_matches_gatconv_fp32(concat):
    N, in_dim, out_dim, heads = 41, 9, 6, 4
    conv, ours = make_pair(in_dim, out_dim, heads, concat, True, False, 7, torch.float32)
    e = random_graph(N, 150, 7)
    x = torch.randn(N, in_dim, generator=torch.Generator().manual_seed(7))
    exact = conv.double()(x.double(), e)
    err_theirs = (conv.float()(x, e).double() - exact).abs().max()
    err_ours = (ours(x, e).double() - exact).abs().max()
    # the ratio rule: no worse than 2x the fp32 error of torch_geometric itself, plus ulps
    assert err_ours <= 2 * err_theirs + 8 * torch.finfo(torch.float32).eps * exact.abs().max()


def test_isolated_nodes_get_the_bias_only():
    conv, ours = make_pair(4, 3, 2, True, False, True, 3)
    e = random_graph(12, 30, 3, isolated=3)
    x = torch.randn(12, 4, dtype=torch.float64)
    y = ours(x, e)
    torch.testing.assert_close(y[-3:], ours.bias.detach().expand(3, -1))
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, conv(x, e))


@pytest.mark.parametrize("loops", [True, False])
def test_no_edges(loops):
    conv, ours = make_pair(4, 3, 2, False, loops, True, 8)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    e = torch.zeros(2, 0, dtype=torch.long)
    y = ours(x, e)
    torch.testing.assert_close(y, conv(x, e))
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert torch.isfinite(gx).all()


@pytest.mark.parametrize("loops", [True, False])
def test_ragged_equals_dense_selfattn(loops):
    """The ragged path equals selfattn.attention over the adjacency mask (and the fp64 oracle)."""
    _, ours = make_pair(6, 4, 3, True, loops, True, 11)
    e = random_graph(23, 70, 11)
    x = torch.randn(23, 6, dtype=torch.float64, requires_grad=True)
    y_ragged = ours(x, e)
    y_dense = ours(x, e, dense=True)
    torch.testing.assert_close(y_ragged, y_dense, rtol=1e-12, atol=1e-12)
    g1 = torch.autograd.grad(y_ragged.square().sum(), x)[0]
    g2 = torch.autograd.grad(y_dense.square().sum(), x)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_neighbour_attention_equals_masked_reference():
    """Generic q·k scores (D = 8, default scale) restricted to edges == masked fp64 oracle."""
    g = torch.Generator().manual_seed(5)
    N, H, D = 19, 2, 8
    q, k, v = (torch.randn(N, H, D, dtype=torch.float64, generator=g) for _ in range(3))
    e = random_graph(N, 60, 5, isolated=1)
    adj = torch.zeros(N, N, dtype=torch.bool)
    adj[e[1], e[0]] = True
    out = neighbour_attention(q, k, v, e)
    ref = reference_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), mask=adj)
    torch.testing.assert_close(out, ref[0][0].transpose(0, 1), rtol=1e-12, atol=1e-12)


def test_gat_qk_two_dim_trick():
    a_dst, a_src = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    q, k = gat_qk(a_dst, a_src)
    s = torch.einsum("ihd,jhd->hij", q, k)
    torch.testing.assert_close(s, (a_dst.T[:, :, None] + a_src.T[:, None, :]))


def test_segment_softmax_is_stable_and_normalised():
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 6, (40,), generator=g)
    s = torch.randn(40, 3, generator=g) * 1e4  # exp would overflow without the segment max
    w = segment_softmax(s, idx, 8)
    assert torch.isfinite(w).all()
    sums = torch.zeros(8, 3).index_add_(0, idx, w)
    present = torch.bincount(idx, minlength=8) > 0
    torch.testing.assert_close(sums[present], torch.ones(int(present.sum()), 3))


def test_large_sparse_graph_stays_linear():
    """200k nodes: a dense (N, N) mask or score matrix (4·10¹⁰ entries) could not be allocated."""
    N, E = 200_000, 400_000
    g = torch.Generator().manual_seed(0)
    e = torch.randint(0, N, (2, E), generator=g)
    layer = GATLayer(4, 2, heads=2).eval()
    with torch.no_grad():
        y = layer(torch.randn(N, 4, generator=g), e)
    assert y.shape == (N, 4) and torch.isfinite(y).all()


def test_attention_dropout_only_in_training():
    layer = GATLayer(5, 4, heads=2, dropout=0.5)
    e = random_graph(15, 40, 1)
    x = torch.randn(15, 5)
    layer.eval()
    torch.testing.assert_close(layer(x, e), layer(x, e))
    layer.train()
    torch.manual_seed(0)
    _, (_, w) = layer(x, e, return_weights=True)
    assert torch.isfinite(layer(x, e)).all()
    assert not torch.equal(layer(x, e), layer.eval()(x, e))
    assert w.shape[1] == 2


def test_return_weights_are_per_edge_softmax():
    layer = GATLayer(3, 2, heads=2).eval()
    e = random_graph(10, 25, 4)
    out, (used, w) = layer(torch.randn(10, 3), e, return_weights=True)
    sums = torch.zeros(10, 2).index_add_(0, used[1], w)
    torch.testing.assert_close(sums, torch.ones(10, 2))  # every node has its self loop
    assert used.shape[1] == w.shape[0] and out.shape == (10, 4)


@pytest.mark.parametrize(
    "edges, err, match",
    [
        (torch.zeros(3, 4, dtype=torch.long), ValueError, r"\(2, E\).*\(3, 4\)"),
        (torch.zeros(2, 4), TypeError, "integer node ids"),
        (torch.tensor([[0, 1], [1, 9]]), ValueError, r"0\.\.9.*N=6"),
        (torch.tensor([[0, -1], [1, 2]]), ValueError, r"-1\.\.2"),
        ([[0, 1], [1, 2]], TypeError, "int tensor"),
    ],
)
def test_bad_edge_index(edges, err, match):
    with pytest.raises(err, match=match):
        GATLayer(3, 2)(torch.randn(6, 3), edges)


def test_bad_inputs():
    layer = GATLayer(3, 2)
    with pytest.raises(ValueError, match=r"in_dim=3.*\(6, 4\)"):
        layer(torch.randn(6, 4), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="ragged"):
        layer(
            torch.randn(6, 3), torch.zeros(2, 1, dtype=torch.long), dense=True, return_weights=True
        )
    dup = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"duplicate-free.*3 edges give only 2"):
        GATLayer(3, 2, add_self_loops=False)(
            torch.randn(2, 3), torch.cat([dup, dup[:, :1]], 1), dense=True
        )
    with pytest.raises(ValueError, match="heads must be a positive int, got 0"):
        GATLayer(3, 2, heads=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        GATLayer(3, 2, dropout=1.5)
