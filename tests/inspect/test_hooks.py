"""Named hook points: capture is what the forward computes, edits do what they say, nothing is
left behind."""

from __future__ import annotations

import pytest
import torch

from selfattn import functional
from selfattn.inspect import (
    hook_points,
    hooks,
    mean_ablation,
    patch,
    resample_ablation,
    steer,
    zero_ablation,
)
from selfattn.models import generate
from selfattn.models.decoder import GPT2, DecoderConfig, Llama
from selfattn.models.encoder import BertConfig, BertModel
from selfattn.models.hybrid import Bamba, HybridConfig
from selfattn.nn.blocks import hook_dicts
from selfattn.testing import assert_close_to_reference

V = 61


def tiny(family="llama", seed=0, dtype=torch.float64, **over):
    torch.manual_seed(seed)
    kw = dict(vocab_size=V, d_model=36, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=44)
    kw.update(over)
    if family == "gpt2":
        kw.update(n_kv_heads=None, positions="learned", activation="gelu_new", max_positions=64)
        return GPT2(DecoderConfig(**kw)).to(dtype).eval()
    return Llama(DecoderConfig(**kw)).to(dtype).eval()


def ids(B=2, S=11, seed=1):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_capture_is_the_forward(family):
    """Capturing every point leaves the logits bit for bit; the stream's points chain (resid_pre
    of block i+1 is resid_post of block i; pre-norm: resid_pre + attn_out = resid_mid, and
    resid_mid + mlp_out = resid_post); the last stream through the final norm and head is the
    logits."""
    m, x = tiny(family, dtype=torch.float32), ids()
    base = m(x)
    with hooks(m, capture="*") as c:
        out = m(x)
    assert torch.equal(out, base)
    assert len(c) == len(hook_points(m))
    for i in range(3):
        b = f"blocks.{i}"
        mid = c[f"{b}.hook_resid_pre"] + c[f"{b}.hook_attn_out"]
        assert torch.equal(c[f"{b}.hook_resid_mid"], mid)
        assert torch.equal(c[f"{b}.hook_resid_post"], mid + c[f"{b}.hook_mlp_out"])
        if i:
            assert torch.equal(c[f"{b}.hook_resid_pre"], c[f"blocks.{i - 1}.hook_resid_post"])
    assert torch.equal(m.lm_head(c["ln_final.hook_out"]), base)
    assert torch.equal(m.lm_head(m.norm(c["blocks.2.hook_resid_post"])), base)
    z = c["blocks.1.attn.hook_z"]  # (B, Hq, S, Dv) -> the out projection's input
    attn_out = m.layers[1].self_attention.out_proj(z.transpose(1, 2).flatten(2))
    assert torch.equal(attn_out, c["blocks.1.hook_attn_out"])


def test_pattern_and_scores_against_fp64_weights():
    """The pattern of an fp32 model against fp64 attention weights of the captured q/k by the
    ratio rule (naive: the fp32 weights); the scores are -inf exactly where causality hides a
    key; q/k/v are the layer's heads (GQA: 2 kv heads)."""
    m, x = tiny(dtype=torch.float32), ids(S=13)
    with hooks(m, capture="blocks.1.attn.*") as c:
        m(x)
    q, k, v = (c[f"blocks.1.attn.hook_{n}"] for n in "qkv")
    assert q.shape == (2, 6, 13, 6) and k.shape == v.shape == (2, 2, 13, 6)
    from selfattn import masks

    w64 = functional.attention_weights(q.double(), k.double(), v.double(), mask=masks.causal())
    naive = functional.attention_weights(q, k, v, mask=masks.causal())
    assert_close_to_reference(c["blocks.1.attn.hook_pattern"], w64, naive, dtype=torch.float32)
    hidden = torch.ones(13, 13, dtype=torch.bool).triu(1)
    assert bool(c["blocks.1.attn.hook_attn_scores"].isneginf()[..., hidden].all())
    assert not bool(c["blocks.1.attn.hook_attn_scores"].isneginf()[..., ~hidden].any())


def test_self_patch_is_a_no_op_and_ablations_do_what_they_say():
    m, x = tiny(), ids()
    base = m(x)
    with hooks(m, capture="*") as clean:
        m(x)
    with hooks(m, edit={"*": patch(clean)}):
        assert torch.equal(m(x), base)
    # zero z of every head of a layer (no out bias) == zero attention output of that layer
    with hooks(m, edit={"blocks.1.attn.hook_z": zero_ablation()}):
        a = m(x)
    with hooks(m, edit={"blocks.1.hook_attn_out": zero_ablation()}):
        b = m(x)
    assert torch.equal(a, b) and not torch.equal(a, base)
    # one head zeroed: that head's slice of the out projection's input, only at the positions
    with hooks(m, capture="blocks.1.attn.hook_z", edit={
        "blocks.1.attn.hook_z": zero_ablation(heads=[4], positions=[2, 5])
    }) as c:  # fmt: skip
        m(x)
    z, z0 = c["blocks.1.attn.hook_z"], clean["blocks.1.attn.hook_z"]
    assert bool((z[:, 4, [2, 5]] == 0).all())
    keep = torch.ones_like(z, dtype=torch.bool)
    keep[:, 4, [2, 5]] = False
    assert torch.equal(z[keep], z0[keep])


def test_mean_resample_and_steer():
    m, x = tiny(), ids(B=4)
    with hooks(m, capture="blocks.0.hook_resid_post") as ref:
        m(x)
    r = ref["blocks.0.hook_resid_post"]
    with hooks(m, capture="blocks.0.hook_resid_post",
               edit={"blocks.0.hook_resid_post": mean_ablation(ref)}) as c:  # fmt: skip
        m(x)
    assert torch.allclose(c["blocks.0.hook_resid_post"], r.mean(0, keepdim=True).expand_as(r))
    with hooks(m, capture="blocks.0.hook_resid_post",
               edit={"blocks.0.hook_resid_post": resample_ablation(ref, seed=3)}) as c:  # fmt: skip
        m(x)
    got = c["blocks.0.hook_resid_post"]
    assert all(any(torch.equal(got[b], r[j]) for j in range(4)) for b in range(4))
    vec = torch.randn(36, dtype=torch.float64)
    with hooks(m, capture="blocks.0.hook_resid_post",
               edit={"blocks.0.hook_resid_post": steer(vec, 2.0, positions=[3])}) as c:  # fmt: skip
        m(x)
    d = c["blocks.0.hook_resid_post"] - r
    assert torch.equal(d[:, 3], (2.0 * vec).expand(4, 36).to(d.dtype) + r[:, 3] - r[:, 3])
    assert bool((d[:, [0, 1, 2, 4]] == 0).all())


def test_editing_the_pattern_recomputes_the_output():
    """A pattern edit gives the output of attention with those weights: the pattern of another
    input patched into head 2 equals patching ``z`` of that head with (edited pattern) @ V,
    checked by the ratio rule against an fp64 model (naive: fp32)."""
    outs = {}
    for dt in (torch.float64, torch.float32):
        m, x, y = tiny(dtype=dt), ids(seed=1), ids(seed=2)
        with hooks(m, capture="blocks.1.attn.hook_pattern") as other:
            m(y)

        def head2(value, point, src=other["blocks.1.attn.hook_pattern"]):
            value = value.clone()
            value[:, 2] = src[:, 2].to(value.dtype)
            return value

        with hooks(m, edit={"blocks.1.attn.hook_pattern": head2}, capture="*") as c:
            outs[dt] = m(x)
        if dt == torch.float64:
            p, v = c["blocks.1.attn.hook_pattern"], c["blocks.1.attn.hook_v"]
            z = c["blocks.1.attn.hook_z"]
            assert torch.allclose(z[:, 2], p[:, 2] @ v[:, 2 // 3], rtol=0, atol=1e-12)
            assert torch.equal(p[:, 2], other["blocks.1.attn.hook_pattern"][:, 2])
    base64 = outs[torch.float64]
    assert_close_to_reference(outs[torch.float32], base64, outs[torch.float32], factor=1.0)


def test_nothing_is_left_behind():
    m, x = tiny(), ids()
    before = [dict(d) for d in hook_dicts(m.modules())]
    outer = hooks(m, capture="*", edit={"blocks.0.attn.hook_z": zero_ablation()})
    with outer, hooks(m, capture="blocks.0.attn.hook_z") as inner:
        m(x)  # nested: the inner block sees the outer's edit first
    assert bool((inner["blocks.0.attn.hook_z"] == 0).all())
    assert [dict(d) for d in hook_dicts(m.modules())] == before
    assert all(layer.self_attention.hooks is None for layer in m.layers)


def test_generate_captures_every_step_and_paged_patterns():
    """Under generate (its paged cache: the fast path steps aside while hooks are set) the
    stream stacked over the steps equals one forward over the prompt and output; the pattern
    of the last step is the last row of that forward's pattern."""
    m, x = tiny(), ids(B=1, S=7)
    with hooks(m, capture=["blocks.2.hook_resid_post", "blocks.2.attn.hook_pattern"]) as c:
        out = generate(m, x, 5, cache="paged")
    with hooks(m, capture=["blocks.2.hook_resid_post", "blocks.2.attn.hook_pattern"]) as full:
        m(out[:, :-1])
    r64 = full["blocks.2.hook_resid_post"]
    got = c.stacked("blocks.2.hook_resid_post")
    assert got.shape == r64.shape
    torch.testing.assert_close(got, r64, rtol=0, atol=1e-12)
    p = c.calls["blocks.2.attn.hook_pattern"][-1]
    torch.testing.assert_close(p, full["blocks.2.attn.hook_pattern"][:, :, -1:], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="own key length"):
        c.stacked("blocks.2.attn.hook_pattern")


def test_hybrid_and_encoder_points():
    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=V, d_model=32, layer_types=("mamba", "attention", "mamba"),
                       ssm_heads=4, ssm_head_dim=8, state_size=8, chunk_size=8, d_ff=40,
                       n_heads=4, n_kv_heads=2, head_dim=8)  # fmt: skip
    hy = Bamba(cfg).double().eval()
    names = hook_points(hy)
    assert "blocks.0.hook_mixer_out" in names and "blocks.1.attn.hook_pattern" in names
    x = ids()
    base = hy(x)
    with hooks(hy, capture="*") as c:
        assert torch.equal(hy(x), base)
    mid = c["blocks.0.hook_resid_pre"] + c["blocks.0.hook_mixer_out"]
    assert torch.equal(c["blocks.0.hook_resid_mid"], mid)
    bert = BertModel(BertConfig(vocab_size=V, d_model=24, n_layers=2, n_heads=3, d_ff=30,
                                max_positions=32)).double().eval()  # fmt: skip
    with hooks(bert, capture=["blocks.*.attn.hook_pattern", "blocks.1.hook_resid_post"]) as c:
        h = bert(x)
    assert torch.equal(c["blocks.1.hook_resid_post"], h)
    assert c["blocks.0.attn.hook_pattern"].shape == (2, 3, 11, 11)  # bidirectional: full rows


def test_positions_and_budget():
    m, x = tiny(), ids()
    with hooks(m, capture="blocks.0.hook_resid_pre", positions=slice(-3, None)) as c:
        m(x)
    assert c["blocks.0.hook_resid_pre"].shape == (2, 3, 36)
    with pytest.raises(ValueError, match="max_bytes"), hooks(m, capture="*", max_bytes=1000):
        m(x)


@pytest.mark.parametrize(
    "capture, edit, message",
    [
        ("blocks.9.hook_z", None, r"no hook point matches 'blocks\.9\.hook_z'"),
        (None, {"blocks.0.hook_resid_post": zero_ablation(heads=[1])}, "no head axis"),
        (None, {"blocks.0.hook_mlp_out": lambda v, p: v[:, :1]}, "of the input's shape"),
        (None, {"blocks.0.attn.hook_z": zero_ablation(heads=[7])}, r"heads \[7\] out of range"),
    ],
)
def test_bad_requests_are_named(capture, edit, message):
    m, x = tiny(), ids()
    with pytest.raises(ValueError, match=message), hooks(m, capture=capture, edit=edit):
        m(x)


def test_patch_needs_the_same_shapes():
    m, x = tiny(), ids()
    with pytest.raises(ValueError, match="patching needs prompts of the same length"):
        with hooks(m, capture="blocks.0.hook_mlp_out") as c:
            m(x[:, :5])
        with hooks(m, edit={"blocks.0.hook_mlp_out": patch(c)}):
            m(x)
