"""transformers' vocabulary -> selfattn's: ``config.json`` keys to our config fields, checkpoint
tensor names to our ``state_dict`` names, for the decoder families (GPT-2; Llama, Mistral, Qwen2,
Gemma-2) and BERT.

The model modules stay free of transformers' names: ``DecoderConfig.from_hf(config)`` is
``DecoderConfig(**decoder_fields(config))`` and a family's ``convert_hf_state_dict(state)`` calls
:func:`gpt2_state` / :func:`llama_state` / :func:`bert_state`. The state functions take the
tensors out of ``state`` as they go (it is left empty): the loader hands over a dict it no longer
needs, so a fused q/k/v tensor never lives beside all its parts and the peak memory of a load stays
one copy of the weights. Names no rule matches pass through unchanged, so ``load_state`` reports
them as unexpected. (T5/BART and ViT keep their tables in ``seq2seq.py`` / ``vision.py``.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from selfattn.cache.state import qwen3_next_layer_types
from selfattn.models.hub import unsupported
from selfattn.nn.mlp import ACTIVATIONS
from selfattn.positions import DynamicNTK, Linear, Llama3, LongRoPE, YaRN

__all__ = [
    "bert_fields",
    "bert_state",
    "decoder_fields",
    "deepseek_fields",
    "deepseek_state",
    "gpt2_state",
    "llama_state",
]

LLAMA_FAMILY = (
    "llama", "mistral", "qwen2", "gemma2", "qwen3", "olmo2", "gemma3_text", "diffllama", "phi3",
)  # fmt: skip
_GEMMA = ("gemma2", "gemma3_text")  # (1 + weight) norms, sandwich norms, scaled embeddings


# -- decoders: config.json -> DecoderConfig fields -------------------------------------------------
def decoder_fields(config: Mapping) -> dict:
    """``DecoderConfig`` keyword arguments from a transformers ``config.json`` dict (``model_type``
    gpt2, llama, mistral, qwen2, gemma2, qwen3, olmo2, gemma3_text, diffllama, phi3; llama4_text
    has :func:`llama4_fields`); options we do not implement raise ``UnsupportedConfigError``."""
    if config.get("model_type") == "gpt2":
        return _gpt2_fields(config)
    if config.get("model_type") in LLAMA_FAMILY:
        return _llama_fields(config)
    if config.get("model_type") == "gpt_oss":
        return _gpt_oss_fields(config)
    raise unsupported(config, "model_type", "not a decoder family")


def _rope(config: Mapping, head_dim: int) -> tuple[float, object, int]:
    """``(base, scaling, rotary_dim)`` from transformers 5's ``rope_parameters`` (or the older
    top-level ``rope_theta`` + ``rope_scaling``)."""
    params = config.get("rope_parameters")
    if not params:
        params = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta")}
    if isinstance(params.get("full_attention"), Mapping):  # per layer type (Gemma-3)
        params = params["full_attention"]  # the sliding layers' base: _local_rope_base
    base = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    max_pos = config.get("max_position_embeddings")
    original = params.get("original_max_position_embeddings", max_pos)
    factor = params.get("factor")
    if kind == "default":
        return base, None, rotary_dim
    if kind == "linear":
        return base, Linear(factor), rotary_dim
    if kind == "dynamic":  # transformers scales from max_position_embeddings
        return base, DynamicNTK(factor, max_pos), rotary_dim
    if kind == "yarn":
        scaling = YaRN(
            factor if factor is not None else max_pos / original,
            original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=params.get("truncate", True) is not False,
        )
        return base, scaling, rotary_dim
    if kind == "llama3":
        scaling = Llama3(
            factor,
            original,
            low_freq_factor=params.get("low_freq_factor", 1.0),
            high_freq_factor=params.get("high_freq_factor", 4.0),
        )
        return base, scaling, rotary_dim
    if kind == "longrope":
        attention_factor = params.get("attention_factor")
        if factor is not None and attention_factor is None and factor != max_pos / original:
            raise unsupported(
                config, "rope_parameters", "LongRoPE with a factor other than max/original length"
            )
        scaling = LongRoPE(
            params["short_factor"], params["long_factor"], original, attention_factor, max_pos
        )
        return base, scaling, rotary_dim
    raise unsupported(config, "rope_parameters", f"rope_type {kind!r} is not implemented")


def _local_rope_base(config: Mapping) -> float | None:
    """Gemma-3's RoPE base of the sliding layers (``rope_parameters["sliding_attention"]``, or
    the older ``rope_local_base_freq``); None where every layer shares one RoPE."""
    params = config.get("rope_parameters") or {}
    local = params.get("sliding_attention")
    if not isinstance(local, Mapping):
        base = config.get("rope_local_base_freq")
        return None if base is None else float(base)
    if local.get("rope_type", "default") != "default":
        raise unsupported(config, "rope_parameters", "a scaled RoPE on the sliding layers")
    return float(local["rope_theta"])


def _eos(config: Mapping):
    eos = config.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else eos


def _gpt2_fields(config: Mapping) -> dict:
    if config.get("add_cross_attention"):
        raise unsupported(config, "add_cross_attention", "GPT-2 here is decoder-only")
    d = config["n_embd"]
    return dict(
        vocab_size=config["vocab_size"],
        d_model=d,
        n_layers=config["n_layer"],
        n_heads=config["n_head"],
        d_ff=config.get("n_inner") or 4 * d,
        positions="learned",
        max_positions=config.get("n_positions", 1024),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        activation=config.get("activation_function", "gelu_new"),
        attention_bias=True,
        out_bias=True,
        mlp_bias=True,
        attn_scale=None if config.get("scale_attn_weights", True) else 1.0,
        scale_by_layer=bool(config.get("scale_attn_by_inverse_layer_idx", False)),
        tie_embeddings=config.get("tie_word_embeddings", True),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=_eos(config),
        pad_token_id=config.get("pad_token_id"),
    )


def _llama_fields(config: Mapping) -> dict:
    model_type = config.get("model_type")
    d, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or d // n_heads
    base, scaling, rotary_dim = _rope(config, head_dim)
    n_layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        window, layer_types = None, None
    if layer_types is None and window is not None:
        layer_types = ["sliding_attention"] * n_layers  # Mistral: every layer is windowed
    gemma = model_type in _GEMMA
    if gemma and config.get("use_bidirectional_attention"):
        raise unsupported(config, "use_bidirectional_attention", "decoders here are causal")
    qkv_bias = config.get("attention_bias", model_type == "qwen2")
    pre_attn = config.get("query_pre_attn_scalar")
    return dict(
        vocab_size=config["vocab_size"],
        d_model=d,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=config["intermediate_size"],
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        positions="rope",
        max_positions=config.get("max_position_embeddings", 2048),
        rope_base=base,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        activation=config.get("hidden_activation") or config.get("hidden_act", "silu"),
        attention_bias=qkv_bias,
        out_bias=qkv_bias and model_type != "qwen2",  # Qwen2: bias on q/k/v only
        mlp_bias=config.get("mlp_bias", False),
        sliding_window=window if layer_types and "sliding_attention" in layer_types else None,
        layer_types=None if layer_types is None else tuple(layer_types),
        attn_scale=None if not (gemma and pre_attn) else pre_attn**-0.5,
        qk_norm="rms" if model_type in ("qwen3", "olmo2", "gemma3_text") else None,
        qk_norm_scope="all" if model_type == "olmo2" else "head",  # OLMo-2: before the split
        post_norm=model_type == "olmo2",
        rope_local_base=_local_rope_base(config) if model_type == "gemma3_text" else None,
        diff_attention=model_type == "diffllama",
        attn_softcap=config.get("attn_logit_softcapping") if gemma else None,
        final_softcap=config.get("final_logit_softcapping") if gemma else None,
        embed_scale=math.sqrt(d) if gemma else 1.0,
        sandwich_norm=gemma,
        tie_embeddings=config.get("tie_word_embeddings", gemma),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=_eos(config),
        pad_token_id=config.get("pad_token_id"),
    )


def _gpt_oss_fields(config: Mapping) -> dict:
    """gpt-oss: the Llama fields (q/k/v/o biases from ``attention_bias``, ``layer_types``
    alternating window/global) plus its sinks and experts."""
    return dict(
        _llama_fields(config),
        attn_sinks=True,
        n_experts=config["num_local_experts"],
        experts_per_token=config.get("num_experts_per_tok", 4),
        swiglu_alpha=config.get("swiglu_alpha", 1.702),
        swiglu_limit=config.get("swiglu_limit", 7.0),
    )


def _drain(state: dict):
    """``(name, tensor)`` pairs taken out of ``state`` one by one (see the module docstring)."""
    while state:
        name = next(iter(state))
        yield name, state.pop(name)


# -- decoders: checkpoint names -> ours ------------------------------------------------------------
_GPT2_TOP = {
    "wte.weight": "embed.weight",
    "wpe.weight": "pos_embed.weight",
    "ln_f.weight": "norm.weight",
    "ln_f.bias": "norm.bias",
}
_GPT2_LAYER = {
    "ln_1.weight": "self_res.norm.weight",
    "ln_1.bias": "self_res.norm.bias",
    "attn.c_attn.weight": "self_attention.qkv_proj.weight",
    "attn.c_attn.bias": "self_attention.qkv_proj.bias",
    "attn.c_proj.weight": "self_attention.out_proj.weight",
    "attn.c_proj.bias": "self_attention.out_proj.bias",
    "ln_2.weight": "mlp_res.norm.weight",
    "ln_2.bias": "mlp_res.norm.bias",
    "mlp.c_fc.weight": "mlp.fc1.weight",
    "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight",
    "mlp.c_proj.bias": "mlp.fc2.bias",
}


def gpt2_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' GPT-2 tensors -> :class:`~selfattn.models.GPT2`'s (``state`` is emptied)."""
    out = {}
    for name, t in _drain(state):
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old checkpoints store the causal mask as a buffer
        parts = name.split(".")
        if parts[0] == "h":
            rest = ".".join(parts[2:])
            ours = _GPT2_LAYER.get(rest)
            if ours is None:
                out[name] = t  # load_state names it as unexpected
                continue
            # Conv1D stores (in, out): a Linear wants (out, in).
            if rest.endswith("weight") and not rest.startswith("ln_"):
                t = t.t()
            out[f"layers.{parts[1]}.{ours}"] = t
        else:
            out[_GPT2_TOP.get(name, name)] = t
    return out


def llama_state(
    state: dict[str, torch.Tensor], *, sandwich_norm: bool, post_norm: bool = False
) -> dict[str, torch.Tensor]:
    """transformers' Llama-family tensors -> :class:`~selfattn.models.Llama`'s (``state`` is
    emptied). ``sandwich_norm``: Gemma-2/3's layout, whose RMSNorm weight ``w`` means ``1 + w``
    (the q/k norms' too); ``post_norm``: OLMo-2's, norms on the sublayer outputs only."""
    names = _llama_layer_names(sandwich_norm, post_norm)
    out = {}
    for name, t in _drain(state):
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 3:
            module, leaf = ".".join(parts[2:-1]), parts[-1]
            ours = names.get(module)
            if ours is None:
                out[name] = t  # load_state names it as unexpected
                continue
            if module == "mlp.gate_up_proj":  # Phi-3: gate rows, then up rows (whole rows)
                gate, up = t.chunk(2, dim=0)
                out[f"layers.{parts[1]}.{ours}.gate.{leaf}"] = gate
                out[f"layers.{parts[1]}.{ours}.up.{leaf}"] = up
                continue
            if sandwich_norm and module.endswith(("layernorm", "q_norm", "k_norm")):
                t = t + 1
            out[f"layers.{parts[1]}.{ours}.{leaf}"] = t
        elif name == "embed_tokens.weight":
            out["embed.weight"] = t
        elif name == "norm.weight":
            out["norm.weight"] = t + 1 if sandwich_norm else t
        else:
            out[name] = t  # lm_head.weight keeps its name
    wrapped = sandwich_norm or post_norm
    return _stack_qkv(out, "self_attention.inner" if wrapped else "self_attention")


def _stack_qkv(state: dict, attn: str) -> dict:
    """Each layer's ``q_proj``, ``k_proj``, ``v_proj`` tensors stacked into ``qkv_proj`` (rows
    q, then k, then v: MultiHeadAttention's fused layout), leaf by leaf: ``weight`` and ``bias``,
    or a quantised layer's row-major buffers (``qs``, ``d``, ``m``: what ``cat_rows`` joins).
    Incomplete triples stay as they are, so loading names them."""
    for key in [k for k in state if ".q_proj." in k]:
        head, leaf = key.rsplit(".q_proj.", 1)
        parts = [f"{head}.{p}_proj.{leaf}" for p in "qkv"]
        if head.endswith(attn) and all(p in state for p in parts):
            state[f"{head}.qkv_proj.{leaf}"] = torch.cat([state.pop(p) for p in parts], 0)
    return state


def _llama_layer_names(sandwich: bool, post_norm: bool = False) -> dict[str, str]:
    """Llama-family module names inside a layer -> ours. With Gemma-2's sandwich norms (or
    OLMo-2's output norms) the attention and MLP sit inside ``PostNormed`` (``.inner``), their
    output norms beside."""
    wrapped = sandwich or post_norm
    attn, mlp = ("self_attention.inner", "mlp.inner") if wrapped else ("self_attention", "mlp")
    names = {
        # parameters of the attention itself: DiffLlama's lambda_q1 ..., gpt-oss's sinks
        "self_attn": attn,
        "self_attn.q_norm": f"{attn}.q_norm",  # Qwen-3, OLMo-2, Gemma-3
        "self_attn.k_norm": f"{attn}.k_norm",
        "input_layernorm": "self_res.norm",
        "self_attn.q_proj": f"{attn}.q_proj",
        "self_attn.k_proj": f"{attn}.k_proj",
        "self_attn.v_proj": f"{attn}.v_proj",
        "self_attn.o_proj": f"{attn}.out_proj",
        "self_attn.qkv_proj": f"{attn}.qkv_proj",  # Phi-3: q, k, v rows stacked already
        "mlp.gate_up_proj": mlp,  # Phi-3: split into gate and up by llama_state
        "mlp.gate_proj": f"{mlp}.gate",
        "mlp.up_proj": f"{mlp}.up",
        "mlp.down_proj": f"{mlp}.down",
        # gpt-oss: its experts keep their names
        "mlp.router": f"{mlp}.router",
        "mlp.experts": f"{mlp}.experts",
    }
    if post_norm:  # OLMo-2: no input norms
        del names["input_layernorm"]
        names.update(
            post_attention_layernorm="self_attention.norm",
            post_feedforward_layernorm="mlp.norm",
        )
    elif sandwich:
        names.update(
            post_attention_layernorm="self_attention.norm",
            pre_feedforward_layernorm="mlp_res.norm",
            post_feedforward_layernorm="mlp.norm",
        )
    else:
        names["post_attention_layernorm"] = "mlp_res.norm"
    return names


# -- BERT ------------------------------------------------------------------------------------------
def bert_fields(config: Mapping) -> dict:
    """``BertConfig`` keyword arguments from a transformers ``config.json`` dict; options we do
    not implement raise ``UnsupportedConfigError``."""
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise unsupported(
            config, "position_embedding_type", "only 'absolute' learned positions exist here"
        )
    if config.get("is_decoder") or config.get("add_cross_attention"):
        key = "is_decoder" if config.get("is_decoder") else "add_cross_attention"
        raise unsupported(config, key, "BertModel here is the bidirectional encoder only")
    if config.get("hidden_act", "gelu") not in ACTIVATIONS:
        raise unsupported(config, "hidden_act", f"supported: {sorted(ACTIVATIONS)}")
    return dict(
        vocab_size=config["vocab_size"],
        d_model=config.get("hidden_size", 768),
        n_layers=config.get("num_hidden_layers", 12),
        n_heads=config.get("num_attention_heads", 12),
        d_ff=config.get("intermediate_size", 3072),
        max_positions=config.get("max_position_embeddings", 512),
        type_vocab_size=config.get("type_vocab_size", 2),
        layer_norm_eps=config.get("layer_norm_eps", 1e-12),
        activation=config.get("hidden_act", "gelu"),
        dropout=config.get("hidden_dropout_prob", 0.1),
        attention_dropout=config.get("attention_probs_dropout_prob", 0.1),
    )


# transformers' per-layer names -> ours under ``layers.{i}.`` (the block's own parts).
_BERT_LAYER = {
    "attention.self.query": "attention.q_proj",
    "attention.self.key": "attention.k_proj",
    "attention.self.value": "attention.v_proj",
    "attention.output.dense": "attention.out_proj",
    "attention.output.LayerNorm": "attn_res.norm",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "output.LayerNorm": "mlp_res.norm",
}
_BERT_TOP = {
    "embeddings.word_embeddings": "tokens",
    "embeddings.position_embeddings": "positions",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "embed_norm",
    "pooler.dense": "pooler",
}


def bert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' BERT tensors -> :class:`~selfattn.models.BertModel`'s (``state`` is
    emptied). Drops ``position_ids`` (a buffer, not a weight); with a ``bert.`` prefix (task
    models) the prefix is stripped and the task heads beside it are dropped."""
    prefixed = any(k.startswith("bert.") for k in state)
    out = {}
    for name, t in _drain(state):
        if prefixed:
            if not name.startswith("bert."):
                continue
            name = name[len("bert.") :]
        if name == "embeddings.position_ids":
            continue
        stem, _, leaf = name.rpartition(".")
        if stem in _BERT_TOP:
            name = f"{_BERT_TOP[stem]}.{leaf}"
        elif stem.startswith("encoder.layer."):
            i, _, part = stem[len("encoder.layer.") :].partition(".")
            if part in _BERT_LAYER:
                name = f"layers.{i}.{_BERT_LAYER[part]}.{leaf}"
        out[name] = t
    return out


# -- Llama-4 (text) --------------------------------------------------------------------------------
def llama4_fields(config: Mapping) -> dict:
    """``Llama4Config`` keyword arguments from a transformers ``llama4_text`` config.json."""
    if config.get("model_type") != "llama4_text":
        raise unsupported(config, "model_type", "not llama4_text")
    n_layers = config["num_hidden_layers"]
    no_rope = config.get("no_rope_layers") or [
        int((i + 1) % config.get("no_rope_layer_interval", 4) != 0) for i in range(n_layers)
    ]
    chunk = config.get("attention_chunk_size")
    types = config.get("layer_types") or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in no_rope
    ]
    fields = _llama_fields(config)  # the config itself: a missing key names its file
    qkv_bias = bool(config.get("attention_bias", False))
    step = config.get("interleave_moe_layer_step", 1)
    moe = config.get("moe_layers")
    tuning = config.get("attn_temperature_tuning", True)
    return dict(
        fields,
        out_bias=qkv_bias,
        sliding_window=None,
        layer_types=tuple(types),
        attention_chunk_size=chunk if "chunked_attention" in types else None,
        rope_interleaved=True,  # transformers' complex RoPE pairs x[2i] with x[2i+1]
        nope_layers=tuple(not r for r in no_rope),
        l2_qk_norm=bool(config.get("use_qk_norm", True)),
        temperature=(config.get("floor_scale", 8192), config.get("attn_scale", 0.1))
        if tuning
        else None,
        moe_layers=tuple(moe if moe is not None else range(step - 1, n_layers, step)),
        n_experts=config.get("num_local_experts", 16),
        experts_per_token=config.get("num_experts_per_tok", 1),
        d_ff_dense=config.get("intermediate_size_mlp") or config["intermediate_size"],
    )


_LLAMA4_FF = {  # feed_forward.<theirs> -> mlp.<ours>
    "router.weight": "router.weight",
    "experts.gate_up_proj": "gate_up",
    "experts.down_proj": "down",
    "shared_expert.gate_proj.weight": "shared.gate.weight",
    "shared_expert.up_proj.weight": "shared.up.weight",
    "shared_expert.down_proj.weight": "shared.down.weight",
    "gate_proj.weight": "gate.weight",
    "up_proj.weight": "up.weight",
    "down_proj.weight": "down.weight",
}


def llama4_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' Llama-4 text tensors -> :class:`~selfattn.models.llama4.Llama4`'s
    (``state`` is emptied): the Llama names, and ``feed_forward`` (MoE or dense) as ``mlp``."""
    moved = {}
    for name, t in _drain(state):
        head, sep, rest = name.partition(".feed_forward.")
        if sep and rest in _LLAMA4_FF:
            name = f"{head.removeprefix('model.')}.mlp.{_LLAMA4_FF[rest]}"
        moved[name] = t
    return llama_state(moved, sandwich_norm=False)


# -- DeepSeek-V3 (multi-head latent attention + MoE) -----------------------------------------------
def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature ``0.1 · mscale · ln(factor) + 1`` (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_fields(config: Mapping) -> dict:
    """``DeepseekConfig`` keyword arguments from a transformers DeepSeek-V3 ``config.json``.

    The RoPE covers the ``qk_rope_head_dim`` dims only (``head_dim`` here, as transformers sets
    it). With a YaRN scaling that has ``mscale_all_dim``, transformers multiplies the softmax
    scale ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` by ``mscale(factor,
    mscale_all_dim)²`` (``yarn_apply_mscale``): so does ``attn_scale``.
    """
    if config.get("model_type") != "deepseek_v3":
        raise unsupported(config, "model_type", "DeepSeek-V3 mapping")
    rope_dim = config["qk_rope_head_dim"]
    base, scaling, _ = _rope(config, rope_dim)
    qk_dim = config["qk_nope_head_dim"] + rope_dim
    scale = qk_dim**-0.5
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scaled = params.get("rope_type", params.get("type", "default")) != "default"
    if scaled and params.get("mscale_all_dim"):
        scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    n_heads = config["num_attention_heads"]
    if (config.get("num_key_value_heads") or n_heads) != n_heads:
        raise unsupported(config, "num_key_value_heads", "MLA decompresses every query head")
    experts, groups = config["n_routed_experts"], config.get("n_group") or 1
    if experts % groups or experts // groups < 2:
        raise unsupported(config, "n_group", f"{experts} experts in {groups} groups of >= 2")
    return dict(
        vocab_size=config["vocab_size"],
        d_model=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        d_ff=config["intermediate_size"],
        head_dim=rope_dim,
        positions="rope",
        max_positions=config.get("max_position_embeddings", 4096),
        rope_base=base,
        rope_scaling=scaling,
        rope_interleaved=bool(config.get("rope_interleave", True)),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        activation=config.get("hidden_act", "silu"),
        attention_bias=bool(config.get("attention_bias", False)),
        attn_scale=scale,
        tie_embeddings=config.get("tie_word_embeddings", False),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=_eos(config),
        pad_token_id=config.get("pad_token_id"),
        kv_lora_rank=config["kv_lora_rank"],
        q_lora_rank=config.get("q_lora_rank"),
        qk_nope_head_dim=config["qk_nope_head_dim"],
        v_head_dim=config["v_head_dim"],
        moe_d_ff=config["moe_intermediate_size"],
        n_experts=experts,
        n_shared_experts=config.get("n_shared_experts") or 0,
        experts_per_token=config["num_experts_per_tok"],
        n_groups=groups,
        groups_per_token=config.get("topk_group") or groups,
        norm_topk=bool(config.get("norm_topk_prob", True)),
        routed_scale=float(config.get("routed_scaling_factor", 1.0)),
        first_dense=config.get("first_k_dense_replace") or 0,
    )


# transformers' DeepSeek-V3 module names inside a layer -> ours (leaf names kept).
_DEEPSEEK_LAYER = {
    "input_layernorm": "self_res.norm",
    "post_attention_layernorm": "mlp_res.norm",
    "self_attn.q_proj": "self_attention.q_proj",
    "self_attn.q_a_proj": "self_attention.q_a_proj",
    "self_attn.q_a_layernorm": "self_attention.q_a_norm",
    "self_attn.q_b_proj": "self_attention.q_b_proj",
    "self_attn.kv_a_proj_with_mqa": "self_attention.kv_a_proj",
    "self_attn.kv_a_layernorm": "self_attention.kv_a_norm",
    "self_attn.kv_b_proj": "self_attention.kv_b_proj",
    "self_attn.o_proj": "self_attention.out_proj",
    "mlp.gate_proj": "mlp.gate",  # a dense layer's gated MLP
    "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
    "mlp.gate": "mlp.router",  # an MoE layer's router (weight, e_score_correction_bias)
    "mlp.experts": "mlp.experts",  # gate_up_proj (E, 2I, d), down_proj (E, d, I)
    "mlp.shared_experts.gate_proj": "mlp.shared.gate",
    "mlp.shared_experts.up_proj": "mlp.shared.up",
    "mlp.shared_experts.down_proj": "mlp.shared.down",
}


def deepseek_state(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """transformers' DeepSeek-V3 tensors -> :class:`~selfattn.models.deepseek.DeepseekV3`'s
    (``state`` is emptied). Layers from ``n_layers`` on are the multi-token-prediction
    modules of the released checkpoints, which a causal LM does not run: dropped, as
    transformers drops them."""
    out, experts = {}, {}
    for name, t in _drain(state):
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 3:
            if int(parts[1]) >= n_layers:
                continue
            if parts[2:4] == ["mlp", "experts"] and parts[4].isdigit():  # one tensor per expert
                experts.setdefault(parts[1], {})[name] = t
                continue
            ours = _DEEPSEEK_LAYER.get(".".join(parts[2:-1]))
            out[name if ours is None else f"layers.{parts[1]}.{ours}.{parts[-1]}"] = t
        elif name == "embed_tokens.weight":
            out["embed.weight"] = t
        else:
            out[name] = t  # norm.weight, lm_head.weight keep their names
    for layer, tensors in experts.items():
        out |= _stack_experts(layer, tensors)
    return out


def _stack_experts(layer: str, tensors: dict) -> dict:
    """A layer's per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (the released
    checkpoints' layout) -> our ``mlp.experts.gate_up_proj (E, 2·I, d)`` and ``down_proj
    (E, d, I)``. An incomplete set keeps its names, so loading names what is missing."""
    head = f"layers.{layer}.mlp.experts"
    n = 1 + max(int(k.split(".")[4]) for k in tensors)
    names = [[f"{head}.{e}.{p}_proj.weight" for p in ("gate", "up", "down")] for e in range(n)]
    if any(k not in tensors for row in names for k in row):
        return tensors
    gate_up = [torch.cat([tensors[g], tensors[u]], 0) for g, u, _ in names]  # (2·I, d) each
    return {
        f"{head}.gate_up_proj": torch.stack(gate_up),  # E × (2·I, d) -> (E, 2·I, d)
        f"{head}.down_proj": torch.stack([tensors[d] for _, _, d in names]),
    }


# -- recurrent and hybrid decoders (Mamba-2, Bamba): config.json -> HybridConfig fields ----------
def _dt_limit(config: Mapping) -> tuple[float, float]:
    """``time_step_limit``; transformers writes infinity as ``{"__float__": "Infinity"}``."""
    value = config.get("time_step_limit") or (0.0, math.inf)
    return tuple(float(v["__float__"] if isinstance(v, Mapping) else v) for v in value)


def hybrid_fields(config: Mapping) -> dict:
    """``HybridConfig`` keyword arguments from a ``mamba2`` or ``bamba`` ``config.json`` dict
    (the keys read with ``config[...]`` are required: a missing one raises ``ConfigKeyError``)."""
    get = config.get
    if get("model_type") == "mamba2":
        H, P = config["num_heads"], config["head_dim"]
        if H * P != int(get("expand", 2) * config["hidden_size"]):
            raise unsupported(config, "num_heads", "num_heads · head_dim != expand · hidden_size")
        mamba = dict(ssm_heads=H, ssm_head_dim=P, state_size=config["state_size"],
                     n_groups=get("n_groups", 1), conv_width=get("conv_kernel", 4),
                     chunk_size=get("chunk_size", 256), conv_bias=get("use_conv_bias", True),
                     proj_bias=get("use_bias", False))  # fmt: skip
        return dict(
            vocab_size=config["vocab_size"], d_model=config["hidden_size"],
            layer_types=("mamba",) * config["num_hidden_layers"],
            dt_limit=_dt_limit(config),
            norm_eps=get("layer_norm_epsilon", 1e-5),
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=get("bos_token_id"), eos_token_id=_eos(config),
            pad_token_id=get("pad_token_id"), **mamba,
        )  # fmt: skip
    if get("model_type") != "bamba":
        raise unsupported(config, "model_type", "not a recurrent or hybrid family")
    d, H = config["hidden_size"], config["mamba_n_heads"]
    P = get("mamba_d_head")
    P = get("mamba_expand", 2) * d // H if P in (None, "auto") else P
    heads = config["num_attention_heads"]
    head_dim = get("head_dim") or d // heads
    base, scaling, rotary_dim = _rope(config, head_dim)
    if scaling is not None:
        raise unsupported(config, "rope_parameters", "Bamba with a scaled RoPE")
    attn = set(get("attn_layer_indices") or ())
    return dict(
        vocab_size=config["vocab_size"], d_model=d,
        layer_types=tuple("attention" if i in attn else "mamba"
                          for i in range(config["num_hidden_layers"])),
        ssm_heads=H, ssm_head_dim=P, state_size=config["mamba_d_state"],
        n_groups=get("mamba_n_groups", 1), conv_width=get("mamba_d_conv", 4),
        chunk_size=get("mamba_chunk_size", 256), conv_bias=get("mamba_conv_bias", True),
        proj_bias=get("mamba_proj_bias", False),
        dt_limit=_dt_limit(config),
        d_ff=config["intermediate_size"], n_heads=heads,
        n_kv_heads=get("num_key_value_heads") or heads, head_dim=head_dim, rope_base=base,
        rotary_dim=rotary_dim, attention_bias=get("attention_bias", False),
        mlp_bias=get("mlp_bias", False), norm_eps=get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        bos_token_id=get("bos_token_id"), eos_token_id=_eos(config),
        pad_token_id=get("pad_token_id"),
    )  # fmt: skip


def mamba2_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' Mamba-2 tensors -> :class:`~selfattn.models.hybrid.Mamba2`'s (``state`` is
    emptied): the mixers keep their names."""
    top = {"embeddings.weight": "embed.weight", "embedding.weight": "embed.weight",
           "norm_f.weight": "norm.weight"}  # fmt: skip
    out = {}
    for name, t in _drain(state):
        name = name.removeprefix("backbone.")
        name = top.get(name, name)
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] == "norm":  # the block's input norm
            name = f"layers.{parts[1]}.self_res.norm.{parts[-1]}"
        out[name] = t
    return out


def bamba_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' Bamba tensors -> :class:`~selfattn.models.hybrid.Bamba`'s (``state`` is
    emptied): its names spelt as Llama's (``feed_forward`` = ``mlp``, ``pre_ff_layernorm`` =
    ``post_attention_layernorm``), then :func:`llama_state`; ``mamba`` becomes ``mixer``."""
    renamed = {}
    for name, t in _drain(state):
        name = name.replace(".feed_forward.", ".mlp.")
        name = name.replace(".pre_ff_layernorm.", ".post_attention_layernorm.")
        renamed[name.replace("model.final_layernorm.", "model.norm.")] = t
    out = llama_state(renamed, sandwich_norm=False)
    return {re.sub(r"^(layers\.\d+)\.mamba\.", r"\1.mixer.", k): t for k, t in out.items()}


# -- Qwen3-Next (gated DeltaNet + gated attention, experts with a shared expert) -----------------
_QWEN3_NEXT_KINDS = {"linear_attention": "deltanet", "full_attention": "attention"}
# transformers' defaults where a config.json leaves a key out (d_model // n_heads would be wrong)
_QWEN3_NEXT_HEAD_DIM = 256
_QWEN3_NEXT_ROTARY = 0.25  # partial_rotary_factor


def qwen3next_fields(config: Mapping) -> dict:
    """``Qwen3NextConfig`` keyword arguments from a ``qwen3_next`` ``config.json`` dict.

    ``layer_types`` (:func:`~selfattn.cache.state.qwen3_next_layer_types`): a
    ``linear_attention`` layer is a gated DeltaNet of ``linear_num_value_heads`` value heads,
    each ``linear_num_key_heads`` key head serving a group of them. Layer ``i`` has experts
    unless it is in ``mlp_only_layers``, ``num_experts`` is 0 or ``(i + 1)`` is not a multiple of
    ``decoder_sparse_step``; the others the dense MLP of ``intermediate_size``. ``num_experts``
    is required (transformers' default, 512, is no size to guess), the experts' sizes with it."""
    get = config.get
    if get("model_type") != "qwen3_next":
        raise unsupported(config, "model_type", "Qwen3-Next mapping")
    if get("hidden_act", "silu") != "silu":
        raise unsupported(config, "hidden_act", "Qwen3-Next's gated MLPs and DeltaNet use silu")
    d, heads, L = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = get("head_dim") or _QWEN3_NEXT_HEAD_DIM
    base, scaling, rotary_dim = _rope({"partial_rotary_factor": _QWEN3_NEXT_ROTARY, **config},
                                      head_dim)  # fmt: skip
    if scaling is not None:
        raise unsupported(config, "rope_parameters", "Qwen3-Next with a scaled RoPE")
    types = qwen3_next_layer_types(config)
    if len(types) != L or any(t not in _QWEN3_NEXT_KINDS for t in types):
        raise unsupported(
            config, "layer_types", f"{L} entries of {sorted(_QWEN3_NEXT_KINDS)}, got {types}"
        )
    experts, step = config["num_experts"], get("decoder_sparse_step") or 1
    dense = set(get("mlp_only_layers") or ())
    moe = dict(n_experts=experts)
    if experts:
        moe |= dict(experts_per_token=config["num_experts_per_tok"],
                    moe_d_ff=config["moe_intermediate_size"],
                    shared_d_ff=config["shared_expert_intermediate_size"],
                    norm_topk=bool(get("norm_topk_prob", True)))  # fmt: skip
    return dict(
        vocab_size=config["vocab_size"], d_model=d,
        layer_types=tuple(_QWEN3_NEXT_KINDS[t] for t in types),
        ssm_heads=config["linear_num_value_heads"], ssm_head_dim=config["linear_key_head_dim"],
        ssm_k_heads=config["linear_num_key_heads"],
        ssm_v_head_dim=config["linear_value_head_dim"],
        conv_width=get("linear_conv_kernel_dim", 4),
        d_ff=config["intermediate_size"], n_heads=heads,
        n_kv_heads=get("num_key_value_heads") or heads, head_dim=head_dim, rope_base=base,
        rotary_dim=rotary_dim, attention_bias=bool(get("attention_bias", False)),
        norm_eps=get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        bos_token_id=get("bos_token_id"), eos_token_id=_eos(config),
        pad_token_id=get("pad_token_id"),
        moe_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                         for i in range(L)),
        **moe,
    )  # fmt: skip


def _ungroup_deltanet(name: str, t: torch.Tensor, k_heads: int, k_dim: int) -> dict:
    """transformers' DeltaNet projections are grouped by key head (``in_proj_qkvz``: per key
    head ``[q, k, v·r, z·r]``, ``in_proj_ba``: ``[b·r, a·r]``, ``r`` value heads per key head);
    ours are plain blocks ``[q | k | v | z]`` and ``[b | a]`` (value head ``g·r + i`` in both)."""
    d = t.shape[-1]
    if name.endswith("in_proj_qkvz.weight"):
        groups = t.view(k_heads, -1, d)  # (Hk·(2Dk + 2r·Dv), d) -> (Hk, 2Dk + 2r·Dv, d)
        rv = (groups.shape[1] - 2 * k_dim) // 2
        parts = groups.split([k_dim, k_dim, rv, rv], dim=1)
    elif name.endswith("in_proj_ba.weight"):
        groups = t.view(k_heads, -1, d)  # (2Hv, d) -> (Hk, 2r, d)
        parts = groups.chunk(2, dim=1)
    else:
        return {name: t}
    return {name: torch.cat([p.reshape(-1, d) for p in parts])}  # (Hk, n, d) -> (Hk·n, d) each


def qwen3next_state(
    state: dict[str, torch.Tensor], *, k_heads: int, k_dim: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """transformers' Qwen3-Next tensors -> :class:`~selfattn.models.qwen3next.Qwen3Next`'s
    (``state`` is emptied). Its RMSNorm weights ``w`` mean ``1 + w`` (the gated norm's do not);
    ``q_proj`` holds each head's query and output gate side by side (``head_dim`` each);
    ``linear_attn`` becomes ``mixer`` (:func:`_ungroup_deltanet`); the router ``mlp.gate`` is
    ``mlp.router``, ``shared_expert`` ``shared``, per-expert tensors stacked
    (:func:`_stack_experts`). The multi-token-prediction ``mtp.*`` tensors
    of the released checkpoints are dropped, as transformers drops them."""
    shared = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    out, experts = {}, {}
    for name, t in _drain(state):
        if name.startswith("mtp."):
            continue
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[2:4] == ["mlp", "experts"] and parts[4].isdigit():  # one tensor per expert
            experts.setdefault(parts[1], {})[name] = t
            continue
        if name == "norm.weight" or name.endswith(("layernorm.weight", "_norm.weight")):
            t = t + 1  # input/post_attention_layernorm, q_norm, k_norm, the final norm
        head, sep, rest = name.partition(".self_attn.q_proj.")
        if sep:  # (H·2D, d) -> query rows (H·D, d) and gate rows (H·D, d)
            q, gate = t.unflatten(0, (-1, 2 * head_dim)).chunk(2, dim=1)
            out[name] = q.flatten(0, 1)
            out[f"{head}.self_attention.gate_proj.{rest}"] = gate.flatten(0, 1)
            continue
        name = name.replace(".linear_attn.", ".mixer.").replace(".mlp.gate.", ".mlp.router.")
        name = name.replace(".mlp.shared_expert_gate.", ".mlp.shared_gate.")
        head, sep, rest = name.partition(".mlp.shared_expert.")
        if sep:
            module, _, leaf = rest.partition(".")
            name = f"{head}.mlp.shared.{shared.get(module, module)}.{leaf}"
        out |= _ungroup_deltanet(name, t, k_heads, k_dim)
    for layer, tensors in experts.items():
        out |= _stack_experts(layer, tensors)
    return llama_state(out, sandwich_norm=False)
