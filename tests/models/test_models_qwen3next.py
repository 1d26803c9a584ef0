"""Qwen3-Next beyond the shared hybrid parity suite (tests/models/test_models_hybrid.py runs
logits, padding, greedy generation, static and paged caches and forks on it): which layers get
experts and which attention, as transformers decides from the config; un-normalised router
weights; config errors."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.models import UnsupportedConfigError  # noqa: E402
from selfattn.models.qwen3next import Qwen3Next, Qwen3NextConfig, SharedExpertMoE  # noqa: E402
from selfattn.nn import DecoderBlock  # noqa: E402
from tests.models.test_models_decoder import RTOL, VOCAB, rel_err, tiny_pair  # noqa: E402
from tests.models.test_models_hybrid import FAMILIES  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def test_layer_kinds_follow_transformers(tmp_path):
    """Experts on every second layer (``decoder_sparse_step=2``) but the dense
    ``mlp_only_layers``; router weights not renormalised (``norm_topk_prob=False``); full
    attention on every second layer: each of our layers is the kind transformers builds, and
    the logits agree."""
    cls, options = FAMILIES["qwen3_next"]
    families = {"q": (cls, dict(options, num_hidden_layers=6, layer_types=None,
                                full_attention_interval=2, decoder_sparse_step=2,
                                mlp_only_layers=[3], norm_topk_prob=False, num_experts=4,
                                num_experts_per_tok=3))}  # fmt: skip
    hf, ours = tiny_pair("q", tmp_path, seed=7, families=families)
    theirs = [(layer.block_type, type(layer.mlp).__name__) for layer in hf.model.layers]
    assert theirs == [
        ("linear_attention", "Qwen3NextMLP"),
        ("full_attention", "Qwen3NextSparseMoeBlock"),
        ("linear_attention", "Qwen3NextMLP"),
        ("full_attention", "Qwen3NextMLP"),  # layer 3: mlp_only_layers
        ("linear_attention", "Qwen3NextMLP"),
        ("full_attention", "Qwen3NextSparseMoeBlock"),
    ]
    for (kind, mlp), block in zip(theirs, ours.layers):
        assert isinstance(block, DecoderBlock) == (kind == "full_attention")
        assert isinstance(block.mlp, SharedExpertMoE) == (mlp == "Qwen3NextSparseMoeBlock")
    assert not ours.layers[1].mlp.norm_topk
    ids = torch.randint(2, VOCAB, (2, 11), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits, torch.ones_like(ids, dtype=torch.bool)) <= RTOL


def test_config_json_defaults_are_transformers():
    """A config.json without ``layer_types``, ``head_dim`` or a RoPE entry: full attention
    where ``(i + 1) % full_attention_interval == 0`` (default 4), heads of 256 with RoPE on a
    quarter of each, as transformers' Qwen3NextConfig fills them in."""
    _, options = FAMILIES["qwen3_next"]
    config = {k: v for k, v in options.items() if k not in ("layer_types", "head_dim")}
    config |= dict(model_type="qwen3_next", num_hidden_layers=8)
    lm = Qwen3Next.from_config(config)
    theirs = transformers.Qwen3NextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    kinds = {"linear_attention": "deltanet", "full_attention": "attention"}
    assert lm.config.layer_types == tuple(kinds[t] for t in theirs.layer_types)
    assert lm.config.layer_types.count("attention") == 2
    assert lm.config.head_dim == theirs.head_dim == 256
    assert lm.rope.rotary_dim == 256 * theirs.rope_parameters["partial_rotary_factor"] == 64


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention"]},
         "layer_types="),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
         "scaled RoPE"),
    ],
)  # fmt: skip
def test_unsupported_configs_name_the_option(change, needle):
    _, options = FAMILIES["qwen3_next"]
    with pytest.raises(UnsupportedConfigError, match=needle):
        Qwen3Next.from_config(dict(options, model_type="qwen3_next", **change))


def test_config_errors_name_the_values():
    base = dict(vocab_size=VOCAB, d_model=16, layer_types=("deltanet", "attention"), ssm_heads=2,
                ssm_head_dim=8, n_heads=2, d_ff=24)  # fmt: skip
    with pytest.raises(ValueError, match=r"moe_layers has 1 entries for 2 layers"):
        Qwen3NextConfig(**base, moe_layers=(True,))
    with pytest.raises(ValueError, match=r"experts_per_token \(3\) exceeds n_experts \(2\)"):
        Qwen3NextConfig(**base, moe_layers=(True, False), n_experts=2, experts_per_token=3,
                        moe_d_ff=8, shared_d_ff=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"n_experts \(with moe_layers\)"):
        Qwen3NextConfig(**base, moe_layers=(True, False))
    with pytest.raises(ValueError, match=r"'deltanet' and 'attention', got \['mamba'\]"):
        Qwen3NextConfig(**{**base, "layer_types": ("mamba", "attention")})
    with pytest.raises(ValueError, match="needs d_ff"):
        Qwen3NextConfig(**{**base, "d_ff": None})


def test_kv_size_of_a_released_config_without_layer_types(tmp_path, capsys):
    """Qwen3-Next-80B-A3B's shape (its config.json gives ``full_attention_interval``, not
    ``layer_types``): 36 gated DeltaNet layers keep a fixed state, 12 attention layers a KV
    cache of 2 heads of 256."""
    import json

    from selfattn.cli.main import main

    config = dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                  num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=256, intermediate_size=5120, full_attention_interval=4,
                  linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                  num_experts_per_tok=10, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["kv-size", "--config", str(tmp_path), "--tokens", "1000", "--dtype", "bf16",
                 "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["layers"] == 12
    assert result["bytes"] == 12 * 2 * 2 * 256 * 1000 * 2  # layers, K+V, heads, dim, tokens, bf16
    state = result["state"]
    assert (state["layers"], state["attention_layers"]) == (36, 12)
    conv = 2 * 16 * 128 + 32 * 128  # q, k (16 key heads) and v (32 value heads) channels
    per_layer = conv * 3 * 2 + 32 * 128 * 128 * 4  # conv window in bf16, fp32 state
    assert state["bytes_per_sequence"] == 36 * per_layer
