"""Loading transformers folders (selfattn.models.hub): every error path, shards, dtype.

The folders are tiny random transformers BertModels written by ``save_pretrained``; a tensor is
removed, added or reshaped with safetensors to make each broken checkpoint.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from selfattn.models import hub  # noqa: E402
from selfattn.models.encoder import BertModel  # noqa: E402
from selfattn.models.hub import (  # noqa: E402
    CheckpointError,
    UnsupportedConfigError,
    from_pretrained,
    load_state,
    register,
)

TINY = dict(
    vocab_size=97,
    hidden_size=36,
    num_hidden_layers=2,
    num_attention_heads=3,
    intermediate_size=37,
    max_position_embeddings=40,
)


def save_tiny(folder, seed=0, **save_kw):
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(**TINY)).eval()
    model.save_pretrained(folder, **save_kw)
    return model


@pytest.fixture
def tiny(tmp_path):
    save_tiny(tmp_path)
    return tmp_path


def edit_tensors(folder, fn):
    f = folder / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def ids_and_mask(B=3, S=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 2:] = 0
    return ids, mask


def test_loads_a_folder_into_our_class_in_eval_mode(tiny):
    model = from_pretrained(tiny)
    assert isinstance(model, BertModel) and not model.training
    assert model.tokens.weight.dtype == torch.float32
    assert "bert" in hub.registered()


def test_sharded_index_loads_the_same_model(tmp_path):
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    save_tiny(one)
    save_tiny(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2  # really split
    a, b = from_pretrained(one), from_pretrained(sharded)
    ids, mask = ids_and_mask()
    assert torch.equal(a(ids, mask), b(ids, mask))


def test_shard_missing_from_folder(tmp_path):
    save_tiny(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=re.escape(victim.name)):
        from_pretrained(tmp_path)


def test_tensor_in_two_shards(tmp_path):
    save_tiny(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    first = load_file(str(shards[0]))
    name = next(iter(first))
    second = load_file(str(shards[1]))
    second[name] = first[name]
    save_file(second, str(shards[1]), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{name!r} appears in more than one")):
        from_pretrained(tmp_path)


def test_dtype_casts_weights_and_model(tiny):
    model = from_pretrained(tiny, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    ref = from_pretrained(tiny)
    ids, mask = ids_and_mask()
    torch.testing.assert_close(model(ids, mask).float(), ref(ids, mask), rtol=1e-4, atol=1e-5)


def test_unknown_model_type(tiny):
    edit_config(tiny, model_type="not-a-model")
    with pytest.raises(UnsupportedConfigError, match=r"model_type='not-a-model'.*'bert'"):
        from_pretrained(tiny)


def test_missing_tensor_is_named(tiny):
    edit_tensors(tiny, lambda s: s.pop("encoder.layer.1.attention.self.key.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers.1.attention.k_proj"):
        from_pretrained(tiny)


def test_unexpected_tensor_is_named(tiny):
    def add(state):
        state["encoder.layer.0.extra.weight"] = torch.zeros(3)

    edit_tensors(tiny, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\).*encoder.layer.0.extra"):
        from_pretrained(tiny)


def test_misshaped_tensor_names_both_names_and_shapes(tiny):
    def reshape(state):
        w = state["encoder.layer.0.attention.self.query.weight"]
        state["encoder.layer.0.attention.self.query.weight"] = w[:, :-1].contiguous()

    edit_tensors(tiny, reshape)
    with pytest.raises(CheckpointError) as err:
        from_pretrained(tiny)
    msg = str(err.value)
    assert "layers.0.attention.q_proj.weight" in msg
    assert "'encoder.layer.0.attention.self.query.weight'" in msg
    assert "checkpoint (36, 35) vs model (36, 36)" in msg


def test_nothing_is_copied_when_loading_fails():
    model = BertModel.from_config({"vocab_size": 11, "hidden_size": 8, "num_attention_heads": 2})
    before = {k: t.clone() for k, t in model.state_dict().items()}
    state = {k: torch.ones_like(t) for k, t in before.items()}
    state.pop("tokens.weight")
    with pytest.raises(CheckpointError, match=r"tokens\.weight"):
        load_state(model, state)
    assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())


@pytest.mark.parametrize(
    "key,value",
    [
        ("position_embedding_type", "relative_key"),
        ("hidden_act", "quick_gelu"),
        ("is_decoder", True),
        ("add_cross_attention", True),
    ],
)
def test_unsupported_config_option_is_named(tiny, key, value):
    edit_config(tiny, **{key: value})
    with pytest.raises(UnsupportedConfigError, match=rf"config option {key}={value!r}"):
        from_pretrained(tiny)


def test_invalid_config_values_name_the_fix(tiny):
    edit_config(tiny, num_attention_heads=5)
    with pytest.raises(ValueError, match=r"d_model \(36\) must be divisible by n_heads \(5\)"):
        from_pretrained(tiny)


def test_pickle_only_folder_is_refused(tmp_path):
    model = save_tiny(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pickle file\(s\) \['pytorch_model.bin'\]"):
        from_pretrained(tmp_path)


def test_folder_errors(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="is a file"):
        from_pretrained(tiny / "config.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        from_pretrained(tmp_path / "empty")


def test_register_needs_a_model_type():
    with pytest.raises(TypeError, match="at least one model_type"):
        register()
