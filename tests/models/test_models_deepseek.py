"""DeepSeek-V3 (selfattn.models.deepseek): logits and greedy generation equal transformers'
DeepseekV3ForCausalLM on tiny random configs (MLA with and without q_lora_rank, YaRN with
mscale, interleaved RoPE, a dense first layer then MoE layers)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.models import from_pretrained, generate  # noqa: E402

VOCAB = 97
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.707,
    "beta_fast": 32, "beta_slow": 1,
}  # fmt: skip
CONFIGS = {
    "yarn-qlora-interleave": dict(q_lora_rank=10, rope_parameters=YARN, rope_interleave=True),
    "default-rope-no-qlora": dict(q_lora_rank=None, rope_interleave=False),
}


def _pair(tmp_path, kwargs, seed=0):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=6,
        v_head_dim=5, max_position_embeddings=64, **kwargs,
    )  # fmt: skip
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # the default init leaves the router flat: make the routing matter
        for layer in hf.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.3)
            layer.mlp.experts.down_proj.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    return hf, from_pretrained(tmp_path).eval()


@pytest.mark.parametrize("kwargs", CONFIGS.values(), ids=CONFIGS.keys())
def test_logits_equal_transformers(tmp_path, kwargs):
    hf, ours = _pair(tmp_path, kwargs)
    assert type(ours.layers[1].mlp).__name__ == "MoE"
    assert type(ours.layers[0].mlp).__name__ == "SwiGLU"
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel <= 1e-4, rel


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_greedy_generation_equals_transformers(tmp_path, cache):
    hf, ours = _pair(tmp_path, CONFIGS["yarn-qlora-interleave"], seed=1)
    ids = torch.randint(1, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # row 0 left-padded
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False,
                       pad_token_id=0)  # fmt: skip
    eos = hf.generation_config.eos_token_id  # transformers stops a row there, then pads
    got = generate(ours, ids, attention_mask=mask, max_new_tokens=7, cache=cache, page_size=4,
                   eos_token_id=eos, pad_token_id=0)  # fmt: skip
    assert torch.equal(got, want)


def test_cache_holds_latents_only(tmp_path):
    _, ours = _pair(tmp_path, CONFIGS["default-rope-no-qlora"])
    static = ours.make_cache("static", 2, 9)
    assert static.layers[0].k.shape == (2, 1, 9, 12 + 8)
    paged = ours.make_cache("paged", 2, 9, page_size=4)
    assert paged.cache.k_store.shape[-2:] == (1, 12 + 8)
    assert paged.cache.v_store.data_ptr() == paged.cache.k_store.data_ptr()
