"""The causal analyses: the logit lens ends at the logits, attributions add up to the logit,
patching a run with itself restores everything, and a planted induction circuit is found."""

from __future__ import annotations

import pytest
import torch

from selfattn.inspect import hooks
from selfattn.inspect.circuits import (
    activation_patching,
    direct_logit_attribution,
    induction_heads,
    logit_difference,
    logit_lens,
    repeated_tokens,
)
from tests.inspect.test_hooks import ids, tiny

# -- a model whose weights make block 0's head P0 a previous-token head and block 1's head P1
# an induction head (Olsson et al. 2022's two-layer circuit), on learned positions -------------
V, P, D_HEAD, BETA = 16, 40, 40, 12.0
TOK, POS, PREV, OUT = 0, V, V + P, 2 * V + P  # the residual stream's four subspaces
D = 3 * V + P


def planted(p0: int, p1: int, dtype=torch.float64):
    from selfattn.models.decoder import DecoderConfig, Llama

    cfg = DecoderConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=8,
                        head_dim=D_HEAD, positions="learned", max_positions=P)  # fmt: skip
    m = Llama(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        for blk in m.layers:
            blk.self_res.norm.weight.fill_(1.0)
            blk.mlp_res.norm.weight.fill_(1.0)
        m.norm.weight.fill_(1.0)
        eye_v = torch.eye(V, dtype=dtype)
        m.embed.weight[:, TOK : TOK + V] = eye_v
        m.pos_embed.weight[:, POS : POS + P] = torch.eye(P, dtype=dtype)
        m.lm_head.weight[:, OUT : OUT + V] = eye_v
        # block 0, head p0: query position i meets key position i - 1; copies the key's token
        # into the PREV subspace
        q, k, v, o = (torch.zeros(2 * D_HEAD, D, dtype=dtype) for _ in range(4))
        rows = slice(p0 * D_HEAD, p0 * D_HEAD + P - 1)
        q[rows, POS + 1 : POS + P] = BETA * torch.eye(P - 1, dtype=dtype)  # e_i, i >= 1
        k[rows, POS : POS + P - 1] = torch.eye(P - 1, dtype=dtype)  # position j -> e_{j+1}
        v[p0 * D_HEAD : p0 * D_HEAD + V, TOK : TOK + V] = eye_v
        o = torch.zeros(D, 2 * D_HEAD, dtype=dtype)
        o[PREV : PREV + V, p0 * D_HEAD : p0 * D_HEAD + V] = eye_v
        att = m.layers[0].self_attention
        att.qkv_proj.weight.copy_(torch.cat((q, k, v)))
        att.out_proj.weight.copy_(o)
        # block 1, head p1: the current token meets keys whose PREV is that token; copies the
        # key's token to the OUT subspace the head reads as logits
        q, k, v = (torch.zeros(2 * D_HEAD, D, dtype=dtype) for _ in range(3))
        rows = slice(p1 * D_HEAD, p1 * D_HEAD + V)
        q[rows, TOK : TOK + V] = BETA * eye_v
        k[rows, PREV : PREV + V] = eye_v
        v[rows, TOK : TOK + V] = eye_v
        o = torch.zeros(D, 2 * D_HEAD, dtype=dtype)
        o[OUT : OUT + V, p1 * D_HEAD : p1 * D_HEAD + V] = eye_v
        att = m.layers[1].self_attention
        att.qkv_proj.weight.copy_(torch.cat((q, k, v)))
        att.out_proj.weight.copy_(o)
    return m


@pytest.mark.parametrize("seed", [0, 1])
def test_a_planted_induction_circuit_is_found(seed):
    g = torch.Generator().manual_seed(seed)
    p0, p1 = (int(h) for h in torch.randint(0, 2, (2,), generator=g))
    m = planted(p0, p1)
    # distinct tokens in each half: one earlier occurrence each
    half = torch.stack([torch.randperm(V - 1, generator=g)[:12] + 1 for _ in range(4)])
    x = torch.cat((torch.zeros(4, 1, dtype=torch.long), half, half), dim=1)
    r = induction_heads(m, input_ids=x, ablate=1, random_seeds=3)
    top = r.table()[0]
    assert (top["layer"], top["head"]) == (1, p1) and top["induction"] > 0.9
    assert r.induction[1, 1 - p1] < 0.5 and r.induction[0].max() < 0.5
    assert int(r.prev_token.argmax()) == p0 and r.prev_token[0, p0] > 0.9
    assert r.copying[1, p1] > 0.99  # its OV circuit is the identity on tokens
    assert r.loss_repeated < r.loss_first
    a = r.ablation
    assert a["heads"] == [(1, p1)]
    assert a["loss_top_ablated"] > a["loss_repeated"] + 1.0
    assert abs(a["loss_random_ablated_mean"] - a["loss_repeated"]) < 1e-6


def test_repeated_tokens_form():
    m = tiny()
    x = repeated_tokens(m, 9, 3, seed=4)
    assert x.shape == (3, 19) and torch.equal(x[:, 1:10], x[:, 10:])
    with pytest.raises(ValueError, match="repeated twice"):
        induction_heads(m, input_ids=x[:, :-1])


def test_logit_lens_ends_at_the_logits():
    m, x = tiny(dtype=torch.float32), ids()
    logits = m(x)
    lens = logit_lens(m, x, top=4, answer=x.roll(-1, 1))  # ranks of the next tokens
    assert lens.layers == ["embed", "0", "1", "2"]
    p, i = torch.log_softmax(logits.float(), -1).topk(4, -1)
    assert torch.equal(lens.top_ids[-1], i)
    torch.testing.assert_close(lens.top_probs[-1], p.exp(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="answer must be"):
        logit_lens(m, x, answer=x[:, 1:])


def test_logit_lens_answer_rank():
    m, x = tiny(), ids(B=1, S=6)
    logits = m(x)[0, -1]
    best = int(logits.argmax())
    worst = int(logits.argmin())
    lens = logit_lens(m, x, answer=torch.tensor([best]))
    assert int(lens.answer_rank[-1, 0, -1]) == 0
    lens = logit_lens(m, x, answer=worst)
    assert int(lens.answer_rank[-1, 0, -1]) == logits.numel() - 1
    js = lens.as_json()
    assert [e["layer"] for e in js] == lens.layers and len(js[0]["positions"]) == 6


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_direct_attributions_add_up_to_the_logit(family):
    """Heads, out-projection biases, MLPs and the embedding through the frozen final norm sum
    to the logit (a LayerNorm's bias apart), in fp64; one head's attribution is that head's
    z through its slice of the out projection."""
    m, x = tiny(family), ids()
    d = direct_logit_attribution(m, x, target=5, other=torch.tensor([7, 9]))
    torch.testing.assert_close(d.total + d.norm_bias, d.logit, rtol=1e-10, atol=1e-10)
    assert d.heads.shape == (3, 6)
    with hooks(m, capture="blocks.1.attn.hook_z") as c:
        m(x)
    att = m.layers[1].self_attention
    z = c["blocks.1.attn.hook_z"][:, :, -1]  # (B, H, Dv)
    only = torch.zeros_like(z)
    only[:, 2] = z[:, 2]
    write = att.out_proj(only.flatten(1)) - att.out_proj(torch.zeros_like(only.flatten(1)))
    with hooks(m, capture="blocks.2.hook_resid_post") as c2:
        m(x)
    whole = c2["blocks.2.hook_resid_post"][:, -1]
    rms = (whole.pow(2).mean(-1, keepdim=True) + m.norm.eps).sqrt() if family == "llama" else None
    if rms is not None:
        u = m.lm_head.weight[5] - m.lm_head.weight[torch.tensor([7, 9])]
        want = ((m.norm.weight * write / rms) * u).sum(-1).mean()
        torch.testing.assert_close(d.heads[1, 2].item(), want.item(), rtol=1e-10, atol=1e-12)


def test_patching_restores_itself_and_localises():
    """Clean into clean restores all (effect 1 where the metric moves); patching the residual
    stream at every position of block 0 restores the clean run exactly; a corruption of the
    last token only is restored by the stream at the last position alone."""
    m = tiny()
    clean, corrupt = ids(B=2, S=8, seed=3), ids(B=2, S=8, seed=3).clone()
    corrupt[:, -1] = (corrupt[:, -1] + 1) % 61
    metric = logit_difference(4, 11)
    r = activation_patching(m, clean, corrupt, metric, over="positions")
    assert r.effect.shape == (3, 8)
    torch.testing.assert_close(r.effect[:, -1], torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(r.effect[:, :-1], torch.zeros(3, 7, dtype=torch.float64))
    h = activation_patching(m, clean, corrupt, metric, over="heads")
    assert h.effect.shape == (3, 6) and h.clean == r.clean and h.corrupted == r.corrupted
    # one head's patch alone equals its own hooks run
    with hooks(m, capture="blocks.1.attn.hook_z") as c:
        m(clean)

    def head3(value, point, src=c["blocks.1.attn.hook_z"]):
        value = value.clone()
        value[:, 3] = src[:, 3]
        return value

    with hooks(m, edit={"blocks.1.attn.hook_z": head3}):
        one = metric(m(corrupt)).mean().item()
    torch.testing.assert_close(h.patched[1, 3].item(), one, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="same shape"):
        activation_patching(m, clean, corrupt[:, :-1], metric)


def test_patching_heatmap(tmp_path):
    pytest.importorskip("matplotlib")
    from selfattn.inspect import plot_patching

    m = tiny()
    clean, corrupt = ids(B=1, S=6, seed=5), ids(B=1, S=6, seed=6)
    r = activation_patching(m, clean, corrupt, logit_difference(1, 2), over="positions")
    fig = plot_patching(r, tokens=[f"t{i}" for i in range(6)], out=tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    (image,) = fig.axes[0].get_images()
    torch.testing.assert_close(torch.as_tensor(image.get_array()), r.effect, equal_nan=True)
    with pytest.raises(ValueError, match="5 position labels for 6"):
        plot_patching(r, tokens=["a"] * 5)
