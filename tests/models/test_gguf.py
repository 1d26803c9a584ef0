"""GGUF files in (``from_pretrained("model.gguf")``) and transformers folders out
(``save_pretrained``).

Tiny random transformers models of each family are written as GGUF by the test
(``tests/_gguf_helpers.py``: llama.cpp's names, the Q/K permutation, the architecture's metadata)
and loaded back: logits match transformers on the same weights (F32, F16, BF16 files), and on
the dequantised weights for Q8_0/Q4_0/Q4_1 files (a kept-quantised model equals the dequantised
one to float rounding). K-quant blocks dequantise exactly as ``gguf.quants.dequantize``. The real
SmolLM2 GGUF (when installed) decodes as its dequantised self. Every malformed file raises
:class:`GGUFError` naming the field, before any large allocation.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests._gguf_helpers import (
    FAMILIES,
    Q,
    find_field,
    find_tensor_info,
    gguf,
    hf_model,
    patch,
    rewrite_gguf,
    smollm2_path,
    transformers,
    write_gguf,
)

from selfattn import _log  # isort: skip
from selfattn.models import CheckpointError, bundled, from_pretrained  # isort: skip
from selfattn.models import gguf as G  # isort: skip

IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))


def rel_err(got, ref) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def check_close(got, ref, tol, what=""):
    err = rel_err(got, ref)
    mean = float((got.double() - ref.double()).abs().mean())
    assert err <= tol, f"{what}: max relative error {err:.3g} (mean abs {mean:.3g}) > {tol}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``family -> (transformers model, F32 GGUF path)``, written once per module."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for family, (arch, *_) in FAMILIES.items():
        model = hf_model(family)
        out[family] = model, write_gguf(root / f"{family}.gguf", model, arch)
    return out


# -- F32 / F16 / BF16 files: parity with transformers ---------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_matches_transformers(files, family):
    hf, path = files[family]
    ours = from_pretrained(path, dtype=torch.float32)
    assert ours.config.d_model == hf.config.hidden_size
    with torch.no_grad():
        check_close(ours(IDS), hf(IDS).logits, 1e-4, family)
    assert ours.gguf_path == path and ours.hf_config["model_type"] == hf.config.model_type
    assert ours.name_or_path == "tiny test model"


def _llama3_divisors(c) -> np.ndarray:
    """llama.cpp's converter's ``rope_freqs`` for transformers' ``llama3`` scaling: each rotated
    pair's frequency divisor (1 at high frequencies, ``factor`` at low ones, smooth between)."""
    s = c.rope_parameters
    dim, base = c.head_dim, s["rope_theta"]
    old = s["original_max_position_embeddings"]
    low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def test_rope_freqs_are_llama3_scaling(tmp_path):
    """A Llama-3.1-style file (``rope_freqs``: per-pair divisors) equals transformers' model with
    ``llama3`` RoPE scaling; saved, transformers reads it back."""
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=1024)  # fmt: skip
    hf = hf_model("llama", rope_parameters=rope)
    plain = write_gguf(tmp_path / "plain.gguf", hf, "llama")
    divisors = _llama3_divisors(hf.config)
    assert divisors.min() == 1.0 and divisors.max() == 8.0  # every regime present
    path = rewrite_gguf(plain, tmp_path / "m.gguf", {"rope_freqs.weight": (divisors, Q.F32)})
    ours = from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(
        0, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        want = hf(ids).logits
        check_close(ours(ids), want, 1e-4, "rope_freqs")
        folder = G.save_pretrained(ours, tmp_path / "folder", tokenizer=False)
        again = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        check_close(again(ids).logits, want, 1e-4, "saved rope_freqs")
    bad = rewrite_gguf(plain, tmp_path / "bad.gguf", {"rope_freqs.weight": (divisors[:3], Q.F32)})
    _raises(bad, "rope_freqs", "F32 [8]")


def test_rope_factors_are_phi3_longrope(tmp_path):
    """Phi-3's LongRoPE (``rope_factors_short`` / ``_long`` and the original context in the
    metadata) equals transformers' model, below and past the original context."""
    g = torch.Generator().manual_seed(5)
    short = (1 + torch.rand(4, generator=g)).tolist()  # one per rotated pair: 16 x 0.5 / 2
    long = (1 + 4 * torch.rand(4, generator=g)).tolist()
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long,
                original_max_position_embeddings=16, partial_rotary_factor=0.5)  # fmt: skip
    hf = hf_model("phi3", rope_parameters=rope, original_max_position_embeddings=16)
    plain = write_gguf(tmp_path / "plain.gguf", hf, "phi3")
    meta = {"phi3.rope.scaling.original_context_length": 16}
    factors = {
        "rope_factors_short.weight": (np.array(short, dtype=np.float32), Q.F32),
        "rope_factors_long.weight": (np.array(long, dtype=np.float32), Q.F32),
    }
    base = write_gguf(tmp_path / "meta.gguf", hf, "phi3", meta=meta)
    path = rewrite_gguf(base, tmp_path / "m.gguf", factors)
    ours = from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for n in (9, 40):  # short factors within 16 positions, long past them
            ids = torch.randint(0, 128, (2, n), generator=g)
            check_close(ours(ids), hf(ids).logits, 1e-4, f"phi3 longrope, {n} tokens")
    one = rewrite_gguf(plain, tmp_path / "one.gguf", dict(list(factors.items())[:1]))
    _raises(one, "rope_factors_long")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("kind", [Q.F16, Q.BF16])
def test_half_files_match_transformers_on_rounded_weights(tmp_path, family, kind):
    arch = FAMILIES[family][0]
    hf = hf_model(family)
    path = write_gguf(tmp_path / "m.gguf", hf, arch, kind)
    # llama.cpp rounds 2-D weights only: round those of the reference the same way
    half = torch.float16 if kind == Q.F16 else torch.bfloat16
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.copy_(p.to(half).float())
    ours = from_pretrained(path, dtype=torch.float32)
    assert ours.lm_head.weight.dtype == torch.float32
    with torch.no_grad():
        check_close(ours(IDS), hf(IDS).logits, 1e-4, f"{family} {kind.name}")


def test_dtype_and_eos_metadata(tmp_path):
    hf = hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", eot=7)
    ours = from_pretrained(path, dtype="bfloat16")
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert ours.config.eos_token_id == (2, 7)  # end-of-turn joins eos: generation stops there
    assert ours.generation_config["eos_token_id"] == [2, 7]
    # "auto": an F32 file's weights as they are; quantised weights in the CPU's fastest dtype
    assert from_pretrained(path).lm_head.weight.dtype == torch.float32
    quantised = write_gguf(tmp_path / "q.gguf", hf, "llama", Q.Q8_0)
    assert from_pretrained(quantised).norm.weight.dtype == bundled.auto_dtype()


# -- quantised files ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,kind",
    [("llama", Q.Q8_0), ("llama", Q.Q4_0), ("qwen2", Q.Q4_1), ("gemma2", Q.Q8_0), ("phi3", Q.Q4_0)],
)
def test_quantised_equals_dequantised(tmp_path, family, kind):
    """Kept quantised == transformers on the dequantised weights (save_pretrained's folder),
    to float rounding; both within the quantisation's own error of the original."""
    arch = FAMILIES[family][0]
    hf = hf_model(family)
    path = write_gguf(tmp_path / "m.gguf", hf, arch, kind)
    ours = from_pretrained(path, dtype=torch.float32)
    swapped = [n for n, m in ours.named_modules() if type(m).__name__.startswith("Quantized")]
    assert any(n.endswith("qkv_proj") for n in swapped) and "embed" in swapped
    dense = from_pretrained(path, quantized=False, dtype=torch.float32)
    assert not any("Quantized" in type(m).__name__ for m in dense.modules())
    G.save_pretrained(ours, tmp_path / "folder", tokenizer=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folder").eval()
    with torch.no_grad():
        got, want, exact = ours(IDS), ref(IDS).logits, hf(IDS).logits
        check_close(got, want, 1e-4, f"{family} {kind.name} kept vs dequantised transformers")
        check_close(dense(IDS), want, 1e-4, f"{family} {kind.name} dequantised")
        assert rel_err(got, exact) <= 1.01 * rel_err(want, exact) + 1e-5


def test_mixed_qkv_formats_are_dequantised(tmp_path, caplog, monkeypatch):
    hf = hf_model("llama")
    types = {"blk.0.attn_k.weight": Q.Q4_0}
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.Q8_0, types=types)
    monkeypatch.setattr(_log, "_said", set())  # log_once: this process may have said it
    with caplog.at_level("INFO", logger="selfattn"):
        ours = from_pretrained(path, dtype=torch.float32)
    assert isinstance(ours.layers[0].self_attention.qkv_proj, nn.Linear)
    assert type(ours.layers[1].self_attention.qkv_proj).__name__ == "QuantizedLinear"
    assert "different formats" in caplog.text


def _k_blocks(kind, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random ``kind`` blocks: random bytes, the fp16 scale fields finite and small."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(-0.01, 0.01, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if kind == Q.Q4_K:  # d, dmin first
        data[..., :4] = scales.reshape(rows, cols // block, 4)
    else:  # Q6_K: d last
        data[..., -2:] = scales[..., :2]
    return data.reshape(rows, -1)


def test_k_quants_dequantise_exactly(tmp_path):
    hf = hf_model("llama", hidden_size=256, intermediate_size=256, head_dim=64)
    path = tmp_path / "k.gguf"
    write_gguf(path, hf, "llama")
    blocks = {"token_embd.weight": _k_blocks(Q.Q4_K, 128, 256),
              "blk.0.ffn_up.weight": _k_blocks(Q.Q6_K, 256, 256, 1)}  # fmt: skip
    replace = {name: (b, Q.Q4_K if name.startswith("token") else Q.Q6_K)
               for name, b in blocks.items()}  # fmt: skip
    rewrite_gguf(path, tmp_path / "k2.gguf", replace)
    ours = from_pretrained(tmp_path / "k2.gguf", dtype=torch.float32)
    want_embed = gguf.quants.dequantize(blocks["token_embd.weight"], Q.Q4_K)
    want_up = gguf.quants.dequantize(blocks["blk.0.ffn_up.weight"], Q.Q6_K)
    assert torch.equal(ours.embed.weight.detach(), torch.from_numpy(want_embed))
    assert torch.equal(ours.layers[0].mlp.up.weight.detach(), torch.from_numpy(want_up))
    assert ours(IDS).isfinite().all()


# -- save_pretrained ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "phi3"])
def test_save_pretrained_loads_in_transformers_and_here(files, tmp_path, family):
    hf, path = files[family]
    ours = from_pretrained(path, dtype=torch.float32)
    written = []
    folder = ours.save_pretrained(tmp_path / "out", tokenizer=lambda *a: written.append(a))
    assert written == [(path, folder)]  # the tokenizer hook
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    again = from_pretrained(folder)
    with torch.no_grad():
        logits = ours(IDS)
        check_close(back(IDS).logits, logits, 1e-4, f"{family} transformers(folder)")
        check_close(again(IDS), logits, 1e-5, f"{family} ours(folder)")
    # transformers' names, Q/K rows un-permuted: every saved matrix is the original's bit for bit
    # (Gemma's norms went through 1 + w and back: one rounding)
    original = hf.state_dict()
    for name, t in back.state_dict().items():
        if t.dim() == 2:
            assert torch.equal(t, original[name]), name


# -- routing --------------------------------------------------------------------------------------


def test_routing(files, tmp_path):
    _, path = files["llama"]
    assert G.is_gguf(path) and not G.is_gguf(tmp_path)
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "m.gguf").write_bytes(path.read_bytes())
    assert from_pretrained(folder).gguf_path == folder / "m.gguf"
    # magic without the suffix
    (tmp_path / "weights.bin").write_bytes(path.read_bytes())
    assert G.gguf_source(tmp_path / "weights.bin") == tmp_path / "weights.bin"
    (folder / "n.gguf").write_bytes(path.read_bytes())
    with pytest.raises(G.GGUFError, match=r"several GGUF files \['m.gguf', 'n.gguf'\]"):
        from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):  # never a Hub id
        from_pretrained("missing.gguf")


# -- the real SmolLM2 file ------------------------------------------------------------------------


def _smollm2() -> Path:
    return smollm2_path()


@pytest.mark.slow  # two 135M-parameter loads and forwards: seconds, more on a busy machine
def test_smollm2_quantised_decodes_as_dequantised(monkeypatch):
    """Kept quantised, the weights are the dequantised model's: with the dequantising matmul
    greedy decoding and perplexity are the dense model's. (The C kernel also rounds the
    activations to int8, as llama.cpp does: on this 13-token text that moves the perplexity by
    a few % either way, on 512 tokens by under 0.1 %: benchmarks/quant_matmul.py measures it.)"""
    monkeypatch.setenv("SELFATTN_QUANT_KERNEL", "0")
    path = _smollm2()
    quant = from_pretrained(path, dtype=torch.float32)
    dense = from_pretrained(path, quantized=False, dtype=torch.float32)
    assert quant.hf_config["vocab_size"] == 49152 and quant.config.n_layers == 30
    tokens = G.read_metadata(path)["tokenizer.ggml.tokens"]
    text = "The capital of France is Paris. The capital of Germany is Berlin."
    ids = [tokens.index(t) for t in ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]]
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = prompt
        for _ in range(8):
            out = torch.cat([out, dense(out)[:, -1:].argmax(-1)], 1)
        # greedy decoding of the quantised model equals the dense one's iff, fed the dense
        # continuation, it picks the same next token at every step: one forward checks all
        picks = quant(out[:, :-1])[0, prompt.shape[1] - 1 :].argmax(-1)
        assert picks.tolist() == out[0, prompt.shape[1] :].tolist()
        # perplexity on a fixed text, tokenised greedily by the vocabulary's whole words
        words = [w if i == 0 else "Ġ" + w for i, w in enumerate(text.replace(".", " .").split())]
        seq = torch.tensor([[tokens.index(w) for w in words]])

        def ppl(model):
            logits = model(seq)[0, :-1]
            return float(torch.nn.functional.cross_entropy(logits, seq[0, 1:]).exp())

        assert abs(ppl(quant) / ppl(dense) - 1) <= 0.01


# -- bad input ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(files):
    return files["llama"][1]


def _raises(path, *fragments, within: float = 2.0):
    start = time.perf_counter()
    with pytest.raises(G.GGUFError) as info:
        from_pretrained(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert time.perf_counter() - start < within
    assert isinstance(info.value, CheckpointError)
    return message


def test_truncated_at_each_part(good, tmp_path):
    data = good.read_bytes()
    f = G.open_gguf(good)
    cuts = {
        "header": 10,
        "metadata": find_field(data, "llama.block_count") + 2,
        "tokens": find_field(data, "tokenizer.ggml.tokens") + 100,
        "tensor infos": find_tensor_info(data, "token_embd.weight") + 3,
        "data": f.data_offset + 100,
        "last byte": len(data) - 1,
    }
    for where, cut in cuts.items():
        p = tmp_path / f"cut_{where.replace(' ', '_')}.gguf"
        p.write_bytes(data[:cut])
        message = _raises(p, "truncated")
        assert str(p) in message, (where, message)


def test_not_gguf_and_versions(good, tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    _raises(tmp_path / "x.gguf", "not a GGUF file", "b'PK\\x03\\x04'")
    for version in (1, 99):
        p = patch(good, tmp_path / f"v{version}.gguf", 4, "I", version)
        _raises(p, f"GGUF version {version}", "[2, 3]")


def test_impossible_counts_fail_fast(good, tmp_path):
    p = patch(good, tmp_path / "kv.gguf", 16, "Q", 1 << 60)
    _raises(p, "metadata count", str(1 << 60))
    p = patch(good, tmp_path / "tensors.gguf", 8, "Q", 1 << 59)
    _raises(p, "tensor count", str(1 << 59))
    data = good.read_bytes()
    at = find_field(data, "tokenizer.ggml.tokens") + 8  # type id, item type, then the length
    p = patch(good, tmp_path / "array.gguf", at, "Q", 1 << 58)
    _raises(p, "tokenizer.ggml.tokens", str(1 << 58))
    at = find_tensor_info(data, "token_embd.weight") + 4  # n_dims, then ne0
    p = patch(good, tmp_path / "dims.gguf", at, "Q", 1 << 40)
    _raises(p, "token_embd.weight", "runs past the end of the file")


def test_unknown_architecture(tmp_path):
    hf = hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", hf, "bloom")
    _raises(path, "general.architecture='bloom'", "'gemma2'", "'llama'")


def test_unsupported_tensor_types(good, tmp_path):
    hf = hf_model("llama")
    path = write_gguf(tmp_path / "iq.gguf", hf, "llama", Q.IQ4_NL)
    _raises(path, "token_embd.weight", "IQ4_NL", "Q4_K")
    data = good.read_bytes()
    at = find_tensor_info(data, "output_norm.weight") + 4 + 8  # n_dims (1), ne0, then the type
    p = patch(good, tmp_path / "type.gguf", at, "I", 77)
    _raises(p, "'output_norm.weight'", "GGML type 77")


@pytest.mark.parametrize(
    "meta,drop,fragments",
    [
        ({"{arch}.block_count": 3}, (), ["llama.block_count=3", "0..1"]),
        ({"{arch}.embedding_length": 96}, (), ["token_embd.weight", "embedding_length=96"]),
        ({"{arch}.attention.head_count_kv": 4}, (), ["blk.0.attn_k.weight", "head_count_kv"]),
        ({"{arch}.feed_forward_length": 128}, (), ["ffn_gate.weight", "feed_forward_length"]),
        ({}, ("blk.1.ffn_down.weight",), ["lacks", "blk.1.ffn_down.weight"]),
        ({"{arch}.rope.scaling.type": "su"}, (), ["rope.scaling.type='su'", "'yarn'"]),
        ({"{arch}.attention.head_count": 0}, (), ["llama.attention.head_count=0", "positive"]),
        ({"{arch}.attention.head_count": 3}, (), ["blk.0.attn_q.weight", "(48, 64)"]),
    ],
)
def test_metadata_that_disagrees_with_tensors(tmp_path, meta, drop, fragments):
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama"), "llama", meta=meta, drop=drop)
    _raises(path, *fragments)


def test_extra_tensor_named(good, tmp_path):
    extra = {"blk.0.mystery.weight": (np.zeros((4, 32), np.float32), Q.F32)}
    path = rewrite_gguf(good, tmp_path / "x.gguf", extra)
    _raises(path, "'blk.0.mystery.weight'", "no place in the model")


def test_reader_agrees_with_gguf_reader(good):
    """Our header parser against llama.cpp's own GGUFReader on the same file."""
    f = G.open_gguf(good)
    r = gguf.GGUFReader(good)
    assert [t.name for t in r.tensors] == list(f.tensors)
    for t in r.tensors:
        ours = f.tensors[t.name]
        assert ours.shape == tuple(reversed(t.shape.tolist())) and ours.nbytes == t.n_bytes
        assert ours.offset == t.data_offset and ours.type_name == t.tensor_type.name
        assert f.raw(t.name).numpy().tobytes() == t.data.tobytes()
    for key, field in r.fields.items():
        if not key.startswith("GGUF."):
            want = field.contents()
            got = f.metadata[key]
            assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
