"""selfattn.alternatives: the chunked scan against the token-by-token one (float64 oracle, ratio
rule in float32/bfloat16, gradients, gradcheck), each layer's prefill + steps against one full
pass, the state cache's fork against recomputing, and parity with transformers' torch paths
(Mamba2Mixer, Qwen3-Next's gated delta rule)."""

from __future__ import annotations

import pytest
import torch

from selfattn.alternatives import (
    GatedDeltaNet,
    LinearAttention,
    Mamba2Mixer,
    chunked_scan,
    recurrent_scan,
)
from selfattn.cache.state import LayerState, fork, state_bytes
from selfattn.testing import GRAD_FACTOR, assert_close_to_reference

KINDS = ("linear", "ssd", "delta")


def _inputs(kind, B=2, H=3, S=23, Dk=5, Dv=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = r(B, H, S, Dk), r(B, H, S, Dk), r(B, H, S, Dv)
    log_decay = beta = None
    if kind != "linear":
        log_decay = -torch.rand(B, H, S, generator=g, dtype=torch.float64)
    if kind == "delta":  # the delta rule is stable for unit keys and beta in (0, 1)
        k = k / k.norm(dim=-1, keepdim=True)
        beta = torch.rand(B, H, S, generator=g, dtype=torch.float64)
    else:  # plain scans grow with S: keep the magnitudes O(1)
        k = k / S
    state = r(B, H, Dk, Dv)
    return [None if t is None else t.to(dtype) for t in (q, k, v, log_decay, beta, state)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_chunked_equals_recurrent_fp64(kind, chunk):
    q, k, v, g, beta, s0 = _inputs(kind)
    out, state = chunked_scan(q, k, v, g, beta, chunk_size=chunk, initial_state=s0)
    ref, ref_state = recurrent_scan(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_gradients_equal_recurrent_fp64(kind):
    q, k, v, g, beta, s0 = _inputs(kind, S=13, seed=1)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, s0) if t is not None]

    def grads(fn, **kw):
        out, state = fn(q, k, v, g, beta, initial_state=s0, **kw)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
        return torch.autograd.grad((out * w).sum() + state.sum(), leaves)

    for a, b in zip(grads(chunked_scan, chunk_size=4), grads(recurrent_scan)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_gradcheck(kind):
    q, k, v, g, beta, s0 = _inputs(kind, B=1, H=2, S=6, Dk=3, Dv=2, seed=3)
    args = [t.requires_grad_() for t in (q, k, v, g, beta, s0) if t is not None]

    def fn(*xs):
        it = iter(xs)
        q_, k_, v_ = next(it), next(it), next(it)
        g_ = next(it) if g is not None else None
        b_ = next(it) if beta is not None else None
        return chunked_scan(q_, k_, v_, g_, b_, chunk_size=4, initial_state=next(it))

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_ratio_rule(kind, dtype):
    """Chunks in a low precision err no more than the token-by-token scan in that precision."""
    inputs = _inputs(kind, S=97, seed=4)
    oracle, oracle_state = recurrent_scan(*inputs[:5], initial_state=inputs[5])
    low = [None if t is None else t.to(dtype) for t in inputs]
    out, state = chunked_scan(*low[:5], chunk_size=16, initial_state=low[5])
    naive, naive_state = recurrent_scan(*low[:5], initial_state=low[5])
    assert out.dtype == dtype
    assert_close_to_reference(out, oracle, naive, dtype=dtype)
    assert_close_to_reference(state, oracle_state, naive_state, dtype=dtype, what="state")
    # and backward: the gradients of q against the float64 ones
    qs = [t.detach().clone().requires_grad_() for t in (inputs[0], low[0], low[0].clone())]
    w = torch.randn(oracle.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for qq, fn, src, kw in ((qs[0], recurrent_scan, inputs, {}),
                            (qs[1], chunked_scan, low, {"chunk_size": 16}),
                            (qs[2], recurrent_scan, low, {})):  # fmt: skip
        o, _ = fn(qq, *src[1:5], initial_state=src[5], **kw)
        (o.double() * w).sum().backward()
        grads.append(qq.grad)
    assert_close_to_reference(*grads, factor=GRAD_FACTOR, dtype=dtype, what="dq")


def test_scan_rejects_bad_input():
    q, k, v, g, beta, s0 = _inputs("delta")
    with pytest.raises(ValueError, match=r"log_decay must be <= 0.*maximum of 0\.5"):
        bad = g.clone()
        bad[0, 1, 2] = 0.5
        chunked_scan(q, k, v, bad, beta)
    with pytest.raises(ValueError, match=r"v \(B, H, S, Dv\).*v \(2, 3, 22, 7\)"):
        chunked_scan(q, k, v[:, :, :-1], g, beta)
    with pytest.raises(ValueError, match=r"initial_state must be .*7\), got \(2, 3, 7, 5\)"):
        recurrent_scan(q, k, v, g, beta, initial_state=s0.transpose(-1, -2))
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        chunked_scan(q, k, v, g, beta, chunk_size=0)


# -- layers --------------------------------------------------------------------------------------


def _layer(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "linear":
        m = LinearAttention(24, 3, chunk_size=8)
    elif kind == "mamba2":
        m = Mamba2Mixer(24, 4, 6, state_size=5, n_groups=2, conv_width=4, chunk_size=8)
    else:
        m = GatedDeltaNet(24, 4, 5, n_k_heads=2, v_head_dim=6, chunk_size=8)
    for p in m.parameters():  # away from the initialisation's special values (D = 1, ...)
        p.data += 0.1 * torch.randn_like(p)
    return m.double()


LAYERS = ("linear", "mamba2", "delta")


@pytest.mark.parametrize("kind", LAYERS)
def test_layer_prefill_then_steps_equals_one_pass(kind):
    m = _layer(kind)
    x = torch.randn(2, 19, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    full = m(x)
    cache = m.make_state(2, dtype=torch.float64)
    parts = [m(x[:, :11], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(11, 19)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.length == 19
    # a second prefill chunk from a cached state (chunked scan with an initial state)
    cache.reset()
    two = torch.cat([m(x[:, :5], cache=cache), m(x[:, 5:], cache=cache)], 1)
    torch.testing.assert_close(two, full, rtol=1e-10, atol=1e-10)


FAR = 32  # tokens back, well beyond the conv window of 4
MIN_TRACE = 1e-4  # its trace FAR tokens on, relative to its effect in place (fresh Mamba-2: 3e-4)


@pytest.mark.parametrize("kind", ("mamba2", "delta"))
def test_fresh_layer_remembers_a_token_far_back(kind):
    """A freshly built layer (what training starts from) carries a token in its state beyond
    its conv window: changing token 0 still changes the output FAR tokens later. Gated DeltaNet
    once took Qwen3-Next's placeholder dt_bias = 1, which kept at most 0.27 of the state per
    token: token 0's trace was ~1e-17 FAR tokens on, and it never learned MQAR."""
    torch.manual_seed(3)
    m = (
        Mamba2Mixer(24, 4, 6, state_size=8) if kind == "mamba2" else GatedDeltaNet(24, 4, 6)
    ).double()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, FAR + 1, 24, dtype=torch.float64, generator=g)
    other = x.clone()
    other[:, 0] = torch.randn(24, dtype=torch.float64, generator=g)
    with torch.no_grad():
        change = (m(other) - m(x)).norm(dim=-1)[0]  # (S,)
    assert change[FAR] >= MIN_TRACE * change[0], f"trace {change[FAR] / change[0]:.2e}"


@pytest.mark.parametrize("kind", LAYERS)
def test_layer_left_padding_equals_unpadded(kind):
    m = _layer(kind, seed=1)
    x = torch.randn(1, 9, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    junk = torch.randn(1, 4, 24, dtype=torch.float64)
    rows = torch.tensor([[0] * 4 + [1] * 9])
    padded = m(torch.cat([junk, x], 1), rows=rows)[:, 4:]
    torch.testing.assert_close(padded, m(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", LAYERS)
def test_state_fork_equals_recompute(kind):
    """A forked state (row 1 three times) decodes exactly as the prompt recomputed."""
    m = _layer(kind, seed=2)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randn(2, 7, 24, dtype=torch.float64, generator=g)
    nxt = torch.randn(3, 4, 24, dtype=torch.float64, generator=g)
    cache = m.make_state(2, dtype=torch.float64)
    m(prompt, cache=cache)
    forked = cache.fork([1, 1, 1])
    assert forked.length == 7 and forked.nbytes == 3 * cache.nbytes // 2
    steps = torch.cat([m(nxt[:, t : t + 1], cache=forked) for t in range(4)], 1)
    again = m(torch.cat([prompt[1:].expand(3, -1, -1), nxt], 1))[:, 7:]
    torch.testing.assert_close(steps, again, rtol=1e-10, atol=1e-10)
    assert cache.length == 7  # the fork copied: the parent is untouched


def test_state_is_fixed_size_and_sized_by_the_formula():
    m = _layer("mamba2")
    cache = m.make_state(3, dtype=torch.float64)
    before = cache.nbytes
    m(torch.randn(3, 40, 24, dtype=torch.float64), cache=cache)
    assert cache.nbytes == before
    one = state_bytes(m.conv_dim, m.conv_width, (4, 5, 6), torch.float64)
    assert before == 3 * one == 3 * (m.conv_dim * 3 * 8 + 4 * 5 * 6 * 8)
    # half models keep the conv window in their dtype and the state in float32
    assert state_bytes(10, 4, (2, 3, 4), torch.bfloat16) == 10 * 3 * 2 + 24 * 4


def test_state_errors_name_the_problem():
    m = _layer("delta")
    with pytest.raises(ValueError, match="cache holds 2 rows but the input has 3"):
        m(torch.randn(3, 2, 24, dtype=torch.float64), cache=m.make_state(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="takes a LayerState cache"):
        m(torch.randn(1, 2, 24, dtype=torch.float64), cache=object())
    with pytest.raises(ValueError, match=r"fork rows must be row indices in 0\.\.1, got \[2\]"):
        m.make_state(2).fork([2])
    with pytest.raises(TypeError, match="fork takes a LayerState or a LayerCaches"):
        fork(object(), [0])
    with pytest.raises(ValueError, match="state of shape"):
        LayerState(1, 3, 2, (1, 2, 3)).write(None, torch.zeros(1, 3, 2, 1), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", LAYERS)
def test_layer_low_precision_ratio_rule(kind, dtype):
    m = _layer(kind, seed=3)
    x = torch.randn(2, 33, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    oracle = m(x)
    low = m.to(dtype)
    out = low(x.to(dtype))
    # the naive: the same layer token by token in the low precision (its recurrent form)
    cache = low.make_state(2, dtype=dtype)
    naive = torch.cat([low(x[:, t : t + 1].to(dtype), cache=cache) for t in range(33)], 1)
    assert_close_to_reference(out, oracle, naive, dtype=dtype)


# -- transformers parity -------------------------------------------------------------------------


def test_mamba2_mixer_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer

    cfg = transformers.Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, state_size=5,
                                    n_groups=2, expand=2, conv_kernel=3, chunk_size=4,
                                    num_hidden_layers=1)  # fmt: skip
    torch.manual_seed(0)
    hf = HFMixer(cfg, 0).double().eval()
    for p in hf.parameters():
        p.data += 0.1 * torch.randn_like(p)
    ours = Mamba2Mixer(16, 4, 8, state_size=5, n_groups=2, conv_width=3, chunk_size=4).double()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    ref = hf(x)  # transformers runs its scan in float32 whatever the model's dtype
    assert (ours(x) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_delta_rule_matches_qwen3_next():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
    )

    q, k, v, g, beta, s0 = _inputs("delta", S=19, seed=10, dtype=torch.float32)
    Dk = q.shape[-1]

    def t(x):  # (B, H, S, ..) -> transformers' (B, S, H, ..)
        return x.transpose(1, 2)

    # transformers scales q by Dk^-1/2 inside: hand it q·sqrt(Dk)
    hf, hf_state = torch_chunk_gated_delta_rule(t(q) * Dk**0.5, t(k), t(v), t(g), t(beta),
                                                chunk_size=8, initial_state=s0,
                                                output_final_state=True)  # fmt: skip
    ref, ref_state = recurrent_scan(*(x.double() for x in (q, k, v, g, beta)),
                                    initial_state=s0.double())  # fmt: skip
    out, state = chunked_scan(q, k, v, g, beta, chunk_size=8, initial_state=s0)
    assert_close_to_reference(out, ref, t(hf))
    assert_close_to_reference(state, ref_state, hf_state, what="state")


def test_gated_deltanet_matches_qwen3_next():
    """Our layer on Qwen3-Next's weights, its fused projections regrouped from per-key-head
    blocks ``[q k v z]`` / ``[b a]`` into ours ``[q | k | v | z]`` / ``[b | a]``."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    Hk, Hv, Dk, Dv, d = 2, 4, 8, 6, 24
    cfg = transformers.Qwen3NextConfig(
        hidden_size=d, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
        linear_key_head_dim=Dk, linear_value_head_dim=Dv, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(cfg, 0).double().eval()
    for p in hf.parameters():
        p.data += 0.1 * torch.randn_like(p)
    ours = GatedDeltaNet(d, Hv, Dk, n_k_heads=Hk, v_head_dim=Dv, chunk_size=4).double()
    rep = Hv // Hk
    q, k, v, z = hf.in_proj_qkvz.weight.view(Hk, -1, d).split([Dk, Dk, rep * Dv, rep * Dv], 1)
    b, a = hf.in_proj_ba.weight.view(Hk, -1, d).split([rep, rep], 1)
    state = {n: t for n, t in hf.state_dict().items() if not n.startswith("in_proj")}
    state["in_proj_qkvz.weight"] = torch.cat([t.reshape(-1, d) for t in (q, k, v, z)])
    state["in_proj_ba.weight"] = torch.cat([b.reshape(-1, d), a.reshape(-1, d)])
    ours.load_state_dict(state)
    x = torch.randn(2, 11, d, dtype=torch.float64)
    ref = hf(x)  # transformers runs the delta rule in float32 whatever the model's dtype
    assert (ours(x) - ref).abs().max() <= 1e-5 * ref.abs().max()
