"""gpt-oss (selfattn.models.decoder.GptOss) against transformers' GptOssForCausalLM.

A tiny random config (4 experts, top-2; alternating window/global layers with a window shorter
than the sequences; YaRN with ``truncate=False``, the model's own RoPE) is perturbed (sinks,
biases and norms off their init), saved with save_pretrained and loaded with ``from_pretrained``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.models import generate  # noqa: E402
from selfattn.models.decoder import GptOss  # noqa: E402
from selfattn.models.hub import from_pretrained  # noqa: E402
from selfattn.testing import perturb_parameters  # noqa: E402
from tests.models.test_models_decoder import RTOL, VOCAB, hf_positions, left_padded, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=48,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=5,
    max_position_embeddings=64,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    },
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.GptOssConfig(**CONFIG)
        cfg.pad_token_id = None
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        hf = hf.eval()
        hf.generation_config.eos_token_id = None
        perturb_parameters(hf, 0)
        with torch.no_grad():  # sinks large enough to take real weight from the keys
            for layer in hf.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
        transformers.logging.set_verbosity_error()
        hf.save_pretrained(folder, safe_serialization=True)
    return hf, from_pretrained(folder)


def test_loads_as_gpt_oss(pair):
    _, ours = pair
    assert isinstance(ours, GptOss)
    c = ours.config
    assert c.attn_sinks and c.n_experts == 4 and c.experts_per_token == 2
    assert c.layer_types == ("sliding_attention", "full_attention")
    assert ours.layers[0].self_attention.sinks.shape == (4,)


def test_logits_match_transformers(pair):
    hf, ours = pair
    ids, mask = left_padded(2, 13, [0, 0], seed=1)
    with torch.no_grad():
        theirs = hf(ids).logits
        got = ours(ids)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


def test_logits_match_transformers_left_padded(pair):
    hf, ours = pair
    ids, mask = left_padded(2, 11, [3, 0], seed=2)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(ids, attention_mask=mask)
    assert rel_err(got, theirs, mask.bool()) <= RTOL


@pytest.mark.parametrize("cache", ["static", "window", "paged"])
def test_greedy_generation_matches_transformers(pair, cache):
    hf, ours = pair
    ids, _ = left_padded(2, 6, [0, 0], seed=3)
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=8, do_sample=False)
        got = generate(ours, ids, max_new_tokens=8, cache=cache, page_size=4)
    assert torch.equal(got, theirs)


def test_sink_gradients_match_transformers(pair):
    hf, ours = pair
    ids, _ = left_padded(2, 9, [0, 0], seed=4)
    hf.zero_grad()
    ours.zero_grad()
    hf(ids).logits.square().mean().backward()
    ours(ids).square().mean().backward()
    for i in range(2):
        a = hf.model.layers[i].self_attn.sinks.grad
        b = ours.layers[i].self_attention.sinks.grad
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())
    hf.zero_grad()
    ours.zero_grad()
