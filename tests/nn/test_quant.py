"""selfattn.nn.quant: GGML Q8_0 / Q4_0 / Q4_1 layers against llama.cpp's numpy reference
(``gguf.quants``), the float64 product of the dequantised weight, and a model built of them."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from selfattn.kernels import quant_matmul as qmm
from selfattn.models import DecoderConfig, Llama
from selfattn.models.generate import generate
from selfattn.nn import QuantizedEmbedding, QuantizedLinear, quant
from selfattn.nn.quant import FORMATS, block_bytes, cat_rows
from selfattn.testing import assert_close_to_reference

gguf = pytest.importorskip("gguf")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
QTYPE = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_blocks(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random GGML blocks ``(rows, cols / 32 · bytes)``: every integer byte random (all nibble
    values), fp16 scales (and minimums) random normals of either sign with some subnormal."""
    g = _gen(seed)
    B, size = cols // 32, block_bytes(fmt)
    blocks = torch.randint(0, 256, (rows, B, size), generator=g, dtype=torch.uint8)
    heads = 2 if fmt == "q4_1" else 1
    scales = torch.randn(rows, B, heads, generator=g, dtype=torch.float64) * 0.05
    tiny = torch.rand(rows, B, heads, generator=g) < 0.1
    subnormal = torch.randn(rows, B, heads, generator=g, dtype=torch.float64) * 2.0**-20
    scales = torch.where(tiny, subnormal, scales).half()
    blocks[..., : 2 * heads] = scales.view(torch.uint8).view(rows, B, 2 * heads)
    return blocks.view(rows, B * size)


def gguf_dequantize(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), QTYPE[fmt]).copy())


def gguf_quantize(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(weight.numpy(), QTYPE[fmt]).copy())


def check_product(layer: QuantizedLinear, x: torch.Tensor) -> None:
    """``layer(x)`` against the fp64 product of its dequantised weight, by the ratio rule. Where
    the C kernel runs (few rows, fp32/bf16) it rounds the activations to int8 per 32-block:
    then against the fp64 product of those rounded activations (its exact value; naive: that
    product in x's dtype), and against the unrounded product with the same naive baseline (the
    rule's naive error is then the activations' rounding). Elsewhere the naive baseline is
    ``x @ Wᵀ`` with the weight in x's dtype."""
    w = layer.dequantize(torch.float64)
    bias = None if layer.bias is None else layer.bias.double()
    oracle = nn.functional.linear(x.double(), w, bias)
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == x.dtype and got.shape == oracle.shape
    x2 = x.reshape(-1, layer.in_features)
    if x2.shape[0] <= quant.KERNEL_ROWS and x.dtype in KERNEL_DTYPES and qmm.library():
        parts = (x2, *layer.stored(), layer.kind, layer.group)
        b = None if layer.bias is None else layer.bias.detach().to(x.dtype)
        exact = qmm.twin(*parts, b).view(oracle.shape)
        naive = qmm.twin(*parts, b, dtype=x.dtype).view(oracle.shape)
        assert_close_to_reference(got, exact, naive, dtype=x.dtype, what="vs rounded activations")
        assert_close_to_reference(got, oracle, naive, dtype=x.dtype)
        return
    naive_bias = None if bias is None else layer.bias.to(x.dtype)
    naive = nn.functional.linear(x, w.to(x.dtype), naive_bias)
    assert_close_to_reference(got, oracle, naive, dtype=x.dtype)


# -- the blocks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("rows", "cols"), [(1, 32), (7, 96), (97, 160), (130, 64)])
def test_dequantize_is_ggufs_bit_for_bit(fmt, rows, cols):
    blocks = random_blocks(fmt, rows, cols, seed=rows * cols)
    want = gguf_dequantize(fmt, blocks)
    layer = QuantizedLinear.from_ggml(fmt, blocks)
    assert (layer.in_features, layer.out_features, layer.fmt) == (cols, rows, fmt)
    got = layer.dequantize()
    assert got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(layer.to_ggml(), blocks)
    table = QuantizedEmbedding.from_ggml(fmt, blocks)
    assert torch.equal(table.dequantize().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_bytes_and_format_names(fmt):
    assert block_bytes(fmt) == {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]
    assert block_bytes(fmt.upper()) == block_bytes(fmt)  # GGUF's type names are upper case


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_from_float_matches_ggufs_quantiser(fmt, scale):
    g = _gen(int(scale * 1000) + len(fmt))
    w = torch.randn(45, 128, generator=g) * scale + torch.rand(45, 1, generator=g) * scale
    w[3, :32] = 0  # an all-zero block: scale 0
    w[4, 32:64] = scale  # a constant block
    layer = QuantizedLinear.from_float(w, fmt)
    want = gguf_quantize(fmt, w)
    assert torch.equal(layer.to_ggml(), want)
    assert torch.equal(layer.dequantize(), gguf_dequantize(fmt, want))


# -- forward ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (7,), (97,), (3, 5), (2, 150)])
def test_forward_matches_fp64_product(fmt, dtype, lead):
    g = _gen(sum(lead) * 31 + len(fmt))
    rows, cols = 97, 192  # rows in no power of two
    layer = QuantizedLinear.from_ggml(fmt, random_blocks(fmt, rows, cols, seed=sum(lead)))
    x = torch.randn(*lead, cols, generator=g).to(dtype)
    check_product(layer, x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_rows_give_no_rows(fmt, dtype):
    """A step whose prompt chunks keep no logits runs the LM head over zero rows."""
    layer = QuantizedLinear.from_ggml(fmt, random_blocks(fmt, 40, 64, seed=3))
    y = layer(torch.zeros(1, 0, 64, dtype=dtype))
    assert y.shape == (1, 0, 40) and y.dtype == dtype


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunked_rows_and_bias(fmt, monkeypatch):
    """More rows than one chunk holds: the parts line up, each with its slice of the bias."""
    monkeypatch.setattr(quant, "CHUNK_BYTES", 64 * 96 * 4)  # 64 rows a chunk
    g = _gen(len(fmt))
    layer = QuantizedLinear.from_float(
        torch.randn(200, 96, generator=g), fmt, bias=torch.randn(200, generator=g)
    )
    for dtype in (torch.float32, torch.bfloat16):
        for M in (1, 20, 130):
            check_product(layer, torch.randn(M, 96, generator=g).to(dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_the_kernel(fmt, monkeypatch):
    """No C kernel (no compiler, or switched off): the dequantising path gives the product."""
    monkeypatch.setenv("SELFATTN_QUANT_KERNEL", "0")
    g = _gen(len(fmt) + 2)
    layer = QuantizedLinear.from_float(torch.randn(97, 128, generator=g), fmt)
    for M in (1, 20):
        for dtype in KERNEL_DTYPES:
            check_product(layer, torch.randn(M, 128, generator=g).to(dtype))


def test_autograd_flows_to_the_input():
    g = _gen(5)
    layer = QuantizedLinear.from_float(torch.randn(40, 64, generator=g), "q4_1")
    x = torch.randn(3, 64, generator=g, dtype=torch.float64, requires_grad=True)
    (layer(x) ** 2).sum().backward()
    w = layer.dequantize(torch.float64)
    assert torch.allclose(x.grad, 2 * (x.detach() @ w.T) @ w)


# -- fusing, embedding, tying ----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_cat_rows_is_the_parts_rows(fmt):
    g = _gen(len(fmt) + 1)
    parts = [
        QuantizedLinear.from_float(torch.randn(n, 96, generator=g), fmt, bias=torch.randn(n))
        for n in (64, 31, 31)
    ]
    fused = cat_rows(parts)
    assert fused.out_features == 126 and fused.fmt == fmt
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(5, 96, generator=g)
    with torch.no_grad():
        want = torch.cat([p(x) for p in parts], -1)
        assert torch.allclose(fused(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_rows_and_tied_head(fmt):
    rows, dim = 150, 64
    blocks = random_blocks(fmt, rows, dim, seed=len(fmt) + 7)
    table = QuantizedEmbedding.from_ggml(fmt, blocks)
    want = gguf_dequantize(fmt, blocks)
    ids = torch.randint(0, rows, (3, 11), generator=_gen(1))
    ids[0, :4] = torch.tensor([0, 63, 64, rows - 1])  # tile edges and the padded last tile
    assert torch.equal(table(ids), want[ids])
    head = table.as_linear()
    assert head.in_features == dim and head.out_features == rows
    assert head._store().qs.data_ptr() == table.qs.data_ptr()  # no copy
    assert not head.state_dict()  # the table's buffers are read, not held
    assert torch.equal(head.dequantize(), table.dequantize())
    check_product(head, torch.randn(4, dim, generator=_gen(2)))


# -- state, devices, dtypes ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trip_and_meta_construction(fmt):
    g = _gen(len(fmt) + 3)
    layer = QuantizedLinear.from_float(torch.randn(70, 96, generator=g), fmt, bias=torch.randn(70))
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    fresh = QuantizedLinear(96, 70, fmt, bias=True)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.dequantize(), layer.dequantize())
    with torch.device("meta"):
        meta = QuantizedLinear(96, 70, fmt, bias=True)
    assert meta.qs.is_meta
    meta.load_state_dict(state, assign=True)
    x = torch.randn(3, 96, generator=g)
    with torch.no_grad():
        assert torch.equal(meta(x), layer(x))
    table = QuantizedEmbedding.from_ggml(fmt, layer.to_ggml())
    empty = QuantizedEmbedding(70, 96, fmt, device="meta")
    empty.load_state_dict(table.state_dict(), assign=True)
    assert torch.equal(empty(torch.arange(70)), layer.dequantize())


def test_to_dtype_changes_the_compute_dtype_not_the_blocks():
    layer = QuantizedLinear.from_float(torch.randn(64, 64, generator=_gen(9)), "q8_0", bias=None)
    before = layer.dequantize()
    layer.to(torch.bfloat16)
    assert layer.dtype == torch.bfloat16 and layer.d.dtype == torch.int16
    assert torch.equal(layer.dequantize(), before)
    table = QuantizedEmbedding.from_ggml("q4_0", random_blocks("q4_0", 10, 32, seed=3))
    assert table.bfloat16()(torch.tensor([1])).dtype == torch.bfloat16


def test_memory_is_about_the_files_bytes():
    for fmt in FORMATS:
        layer = QuantizedLinear.from_ggml(fmt, random_blocks(fmt, 128, 256, seed=1))
        held = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
        assert held == 128 * 256 // 32 * block_bytes(fmt), fmt


# -- bad input -------------------------------------------------------------------------------------
def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match=r"in_features \(48\) must be a positive multiple of 32"):
        QuantizedLinear(48, 8, "q8_0")
    with pytest.raises(ValueError, match=r"in_features \(40\)"):
        QuantizedLinear.from_float(torch.randn(4, 40), "q4_0")
    with pytest.raises(ValueError, match=r"rows of 35 bytes are not whole 34-byte blocks"):
        QuantizedLinear.from_ggml("q8_0", torch.zeros(2, 35, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"2-D uint8 .* got \(torch.int8, \(2, 34\)\)"):
        QuantizedLinear.from_ggml("q8_0", torch.zeros(2, 34, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"unknown quantised format 'q5_k'"):
        QuantizedLinear.from_ggml("q5_k", torch.zeros(2, 34, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"unknown quantised format 'q2'"):
        block_bytes("q2")
    a = QuantizedLinear.from_float(torch.randn(8, 64), "q8_0")
    b = QuantizedLinear.from_float(torch.randn(8, 64), "q4_0")
    c = QuantizedLinear.from_float(torch.randn(8, 96), "q8_0")
    with pytest.raises(ValueError, match=r"layer 1 is q4_0 .* layer 0 is q8_0"):
        cat_rows([a, b])
    with pytest.raises(ValueError, match=r"in_features=96 .* in_features=64"):
        cat_rows([a, c])
    with pytest.raises(ValueError, match=r"input of width 63 does not match in_features \(64\)"):
        a(torch.randn(2, 63))
    with pytest.raises(ValueError, match=r"bias of shape \(7,\) must be \(8,\)"):
        QuantizedLinear.from_float(torch.randn(8, 64), "q8_0", bias=torch.randn(7))
    table = QuantizedEmbedding.from_ggml("q8_0", a.to_ggml())
    with pytest.raises(IndexError, match=r"token id 8 is out of range for 8 embeddings"):
        table(torch.tensor([0, 8]))


@pytest.mark.parametrize(("fmt", "group"), [("int8", 64), ("int4", 32), ("int4_sym", 128)])
def test_from_codes_is_the_layer_of_those_codes(fmt, group):
    """from_codes of a layer's own codes and scale bits rebuilds it, buffer for buffer; its
    format follows the codes (int8 / uint8 with or without minimums)."""
    layer = QuantizedLinear.from_float(torch.randn(8, 128, generator=_gen(5)), fmt, group=group)
    qs, d, m = layer.stored()
    again = QuantizedLinear.from_codes(qmm.codes(qs, layer.kind), d, m, group=group)
    assert (again.fmt, again.group, again.dtype) == (fmt, group, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again.stored()[:2], (qs, d)))
    assert torch.equal(again.dequantize(), layer.dequantize())


def test_from_codes_bad_input_names_the_value():
    d = torch.zeros(4, 2, dtype=torch.int16)
    with pytest.raises(ValueError, match=r"uint8 codes are 4-bit \(0..15\), got 16"):
        QuantizedLinear.from_codes(torch.full((4, 64), 16, dtype=torch.uint8), d, group=32)
    with pytest.raises(ValueError, match=r"int8 codes have no minimums"):
        QuantizedLinear.from_codes(torch.zeros(4, 64, dtype=torch.int8), d, d, group=32)
    with pytest.raises(ValueError, match=r"codes must be a 2-D int8 or uint8 tensor, got "):
        QuantizedLinear.from_codes(torch.zeros(4, 64, dtype=torch.int32), d, group=32)
    with pytest.raises(ValueError, match=r"d must be the fp16 bits as int16 \(4, 1\), one per "):
        QuantizedLinear.from_codes(torch.zeros(4, 64, dtype=torch.int8), d, group=64)
    with pytest.raises(ValueError, match=r"group=16: a group must be a positive multiple of 32"):
        QuantizedLinear.from_codes(torch.zeros(4, 64, dtype=torch.int8), d, group=16)


# -- a model of quantised layers -------------------------------------------------------------------
def _quantise_model(model: Llama, fmt: str) -> tuple[Llama, Llama]:
    """``model`` with every nn.Linear and the embedding kept as ``fmt`` blocks, and its float
    twin holding the same (dequantised) weights."""
    quantised, twin = copy.deepcopy(model), copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and name != "lm_head":
            q = QuantizedLinear.from_float(m.weight, fmt, bias=m.bias)
            quantised.set_submodule(name, q)
            twin.get_submodule(name).weight.data = q.dequantize()
    blocks = QuantizedLinear.from_float(model.embed.weight, fmt).to_ggml()
    quantised.embed = QuantizedEmbedding.from_ggml(fmt, blocks)
    quantised.lm_head = quantised.embed.as_linear()  # tied
    twin.embed.weight.data = quantised.embed.dequantize()
    twin.lm_head.weight = twin.embed.weight
    return quantised.eval(), twin.eval()


@pytest.mark.parametrize("fmt", FORMATS)
def test_llama_of_quantised_layers(fmt):
    torch.manual_seed(len(fmt) + 11)
    cfg = DecoderConfig(
        vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
        tie_embeddings=True, attention_bias=True,
    )  # fmt: skip
    model = Llama(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    quantised, twin = _quantise_model(model, fmt)
    assert not any(type(m) is nn.Linear for m in quantised.modules())
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        got = quantised(ids)
        oracle = copy.deepcopy(twin).double()(ids)
        naive = twin(ids)
    assert_close_to_reference(got, oracle, naive, what="logits")
    want = generate(twin, ids, 6, cache=None)
    for cache in ("static", "paged"):
        out = generate(quantised, ids, 6, cache=cache, page_size=4)
        assert torch.equal(out, want), cache


def test_cross_attention_with_a_quantised_fused_projection(monkeypatch):
    """The fused projection's rows split into q, k and v as the float layer's (the dequantising
    path: its products are the float layer's to fp32 rounding)."""
    from selfattn.nn import MultiHeadAttention

    monkeypatch.setenv("SELFATTN_QUANT_KERNEL", "0")
    torch.manual_seed(3)
    att = MultiHeadAttention(64, 4, n_kv_heads=2, bias=True).eval()
    quantised = copy.deepcopy(att)
    quantised.qkv_proj = QuantizedLinear.from_float(
        att.qkv_proj.weight, "q8_0", bias=att.qkv_proj.bias
    )
    att.qkv_proj.weight.data = quantised.qkv_proj.dequantize()
    x, ctx, value = torch.randn(2, 5, 64), torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    with torch.no_grad():
        for kw in ({}, {"value": value}):
            want = att(x, ctx, **kw)
            assert torch.allclose(quantised(x, ctx, **kw), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("fmt", "group"), [*((f, None) for f in FORMATS), ("int8", None),
                                            ("int4", 64), ("int4_sym", 128)])  # fmt: skip
def test_part_holds_the_same_blocks(fmt, group):
    """A part of the rows and columns dequantises to that part of the weight, exactly (its
    blocks copied, never re-quantised); the bias follows the rows, and a part of the columns
    has none (a partial sum's)."""
    g = torch.Generator().manual_seed(len(fmt) + (group or 0))
    N, K = 37, 256
    layer = QuantizedLinear.from_float(torch.randn(N, K, generator=g), fmt, group=group,
                                       bias=torch.randn(N, generator=g))  # fmt: skip
    W = layer.dequantize()
    rows = torch.randperm(N, generator=g)[:11]
    edge = layer.group if layer.group < K else 32  # int8 per channel: parts of its one group
    for r, c in [
        (rows, None),
        (slice(3, 30), slice(K - 2 * edge, K)),
        (None, slice(edge, 2 * edge)),
    ]:
        part = layer.part(r, c)
        r_, c_ = (slice(None) if r is None else r), (slice(None) if c is None else c)
        assert torch.equal(part.dequantize(), W[r_][:, c_])
        assert (part.bias is None) == (c is not None)
        if part.bias is not None:
            assert torch.equal(part.bias, layer.bias[r_])
    with pytest.raises(ValueError, match="multiples of 32"):
        layer.part(cols=slice(0, 48))
    if layer.group == 64:
        with pytest.raises(ValueError, match="cut a group of 64"):
            layer.part(cols=slice(32, 96))


def test_tensor_parallel_splits_quantised_projections_on_block_edges_only():
    from selfattn.serving.parallel import _check_split

    cfg = DecoderConfig(vocab_size=40, d_model=64, n_layers=1, n_heads=4, d_ff=96)
    quantised, _ = _quantise_model(Llama(cfg), "q4_0")
    _check_split(quantised, 1)
    # out: 64 inputs, 32 a share; down: 96 inputs, 48 a share, across a 32-wide block
    with pytest.raises(ValueError, match=r"layer 0: mlp.down's 96 inputs do not split into 2"):
        _check_split(quantised, 2)
    cfg = DecoderConfig(vocab_size=40, d_model=64, n_layers=1, n_heads=4, d_ff=128)
    quantised, _ = _quantise_model(Llama(cfg), "q4_0")
    _check_split(quantised, 2)


def test_engine_serves_a_quantised_model(monkeypatch):
    """The engine's paged prefill and decode steps run a quantised model: its greedy tokens are
    the float twin's (with the dequantising path, exact to fp32 rounding: the kernel rounds
    activations too, which may flip a near tie; test_quantize_keeps_logits_close covers it)."""
    from selfattn.serving import Engine, SamplingParams

    monkeypatch.setenv("SELFATTN_QUANT_KERNEL", "0")
    torch.manual_seed(21)
    cfg = DecoderConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96)
    model = Llama(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    quantised, twin = _quantise_model(model, "q8_0")
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (5, 11, 3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = Engine(quantised, kv_cache_bytes=1 << 20, page_size=4).generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        want = generate(twin, torch.tensor([prompt]), 6, cache=None, ignore_eos=True)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    monkeypatch.delenv("SELFATTN_QUANT_KERNEL")  # the kernel, on a prompt of several steps
    long = [torch.randint(0, 97, (23,)).tolist()]
    engine = Engine(quantised, kv_cache_bytes=1 << 20, page_size=4, max_batch_tokens=8)
    assert len(engine.generate(long, params)[0].outputs[0].token_ids) == 6


# -- weight-only quantisation of any model (quantize_) --------------------------------------------
@pytest.mark.parametrize(
    ("fmt", "ggml"), [("int8", "q8_0"), ("int4", "q4_1"), ("int4_sym", "q4_0")]
)
def test_quantize_formats_with_groups_of_32_are_ggmls(fmt, ggml):
    g = _gen(len(fmt))
    w = torch.randn(37, 96, generator=g) + torch.rand(37, 1, generator=g)
    layer = QuantizedLinear.from_float(w, fmt, group=32)
    assert torch.equal(layer.to_ggml(), QuantizedLinear.from_float(w, ggml).to_ggml())


@pytest.mark.parametrize("fmt", quant.QUANTIZE_FORMATS)
@pytest.mark.parametrize("group", [None, 64, 128])
def test_quantize_formats_round_to_nearest(fmt, group):
    """Each weight within half a step of its group's grid (plus the fp16 rounding of the scale
    and minimum; int4_sym, Q4_0's grid -8..7 steps of the signed max / -8, a whole step at the
    end it clamps); the product by the rule; state_dict round trip with the group."""
    g = _gen(hash((fmt, group)) % 2**31)
    w = torch.randn(50, 256, generator=g) * 0.1 + torch.rand(50, 1, generator=g) * 0.1
    layer = QuantizedLinear.from_float(w, fmt, group=group, bias=torch.randn(50, generator=g))
    G = layer.group
    assert G == (group or (256 if fmt == "int8" else 32))
    assert layer.d.shape == (50, 256 // G)
    step = layer.d.view(torch.float16).float().abs().repeat_interleave(G, 1)
    slack = 2.0**-10 * w.abs().amax(1, keepdim=True)
    half = 1.0 if fmt == "int4_sym" else 0.5
    assert ((layer.dequantize() - w).abs() <= step * half + slack).all()
    for M in (1, 5, 40):
        check_product(layer, torch.randn(M, 256, generator=g))
    again = QuantizedLinear(256, 50, fmt, group=group, bias=True, device="meta")
    again.load_state_dict(layer.state_dict(), assign=True)
    assert torch.equal(again.dequantize(), layer.dequantize())
    if G != 32:
        with pytest.raises(ValueError, match=rf"{fmt} with groups of {G} has no GGML format"):
            layer.to_ggml()


def test_quantize_group_must_divide_the_width():
    with pytest.raises(ValueError, match=r"group=48: a group must be a positive multiple of 32"):
        QuantizedLinear.from_float(torch.randn(4, 96), "int4", group=48)
    with pytest.raises(ValueError, match=r"group=64: .* dividing in_features \(96\)"):
        QuantizedLinear.from_float(torch.randn(4, 96), "int4", group=64)
    with pytest.raises(ValueError, match=r"q4_0 has groups of 32 by definition"):
        QuantizedLinear.from_float(torch.randn(4, 128), "q4_0", group=64)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tied", [True, False])
def test_quantize_keeps_logits_close(fmt, tied):
    """quantize_ replaces every linear layer (the tied head by a quantised copy, the embedding
    kept); the logits stay close to the dense model's (within the weights' rounding: int8
    steps of max|w| / 127 a channel, int4 of the group's range / 15), and it generates."""
    torch.manual_seed(len(fmt) + tied)
    cfg = DecoderConfig(
        vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
        tie_embeddings=tied,
    )  # fmt: skip
    model = Llama(cfg).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    q = quant.quantize_(copy.deepcopy(model), fmt)
    assert not any(type(m) is nn.Linear for m in q.modules())
    assert isinstance(q.lm_head, QuantizedLinear) and type(q.embed) is nn.Embedding
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        want, got = model(ids), q(ids)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < {"int8": 0.03, "int4": 0.3}[fmt], rel
    out = generate(q, ids, 4, cache="paged", page_size=4)
    assert out.shape == (1, 13)


def test_from_pretrained_quantize(tmp_path):
    transformers = pytest.importorskip("transformers")
    from selfattn.models import from_pretrained

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    dense = from_pretrained(tmp_path, dtype="float32")
    q = from_pretrained(tmp_path, dtype="float32", quantize="int4", quantize_group=64)
    layers = [m for m in q.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.fmt == "int4" and m.group == 64 for m in layers)
    assert not any(type(m) is nn.Linear for m in q.modules())
    ids = torch.randint(0, 61, (1, 7))
    with torch.no_grad():
        assert (q(ids) - dense(ids)).abs().max() < 0.3 * dense(ids).abs().max()
    with pytest.raises(ValueError, match=r"quantize='int3': expected one of"):
        from_pretrained(tmp_path, quantize="int3")


def test_kernel_arguments_follow_the_buffers():
    """A layer keeps its kernel arguments between calls; a copy, a load that replaces the
    buffers, or a new bias gets arguments of its own (never the original's pointers)."""
    g = _gen(9)
    a = QuantizedLinear.from_float(torch.randn(33, 64, generator=g), "q4_1")
    b = QuantizedLinear.from_float(torch.randn(33, 64, generator=g), "q4_1")
    x = torch.randn(2, 64, generator=g)
    with torch.no_grad():
        want_a, want_b = a(x), b(x)
        twin = copy.deepcopy(a)
        del a
        assert torch.equal(twin(x), want_a)
        twin.load_state_dict(b.state_dict(), assign=True)
        assert torch.equal(twin(x), want_b)
        twin.load_state_dict(a_state := b.state_dict())  # in place: same buffers, new values
        assert torch.equal(twin(x), want_b) and a_state
        twin.bias = nn.Parameter(torch.ones(33))
        assert torch.equal(twin(x), want_b + 1)
