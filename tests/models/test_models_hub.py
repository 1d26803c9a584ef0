"""Loading transformers folders (selfattn.models.hub): every error path, shards, dtype.

The folders are tiny random transformers BertModels written by ``save_pretrained``; a tensor is
removed, added or reshaped with safetensors to make each broken checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

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


# -- malformed folders: every error names the file ----------------------------------
def test_truncated_shard_names_the_file(tiny):
    f = tiny / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        from_pretrained(tiny)


def test_truncated_shard_of_an_index_names_that_shard(tmp_path):
    save_tiny(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.write_bytes(victim.read_bytes()[:5])  # not even a whole header
    with pytest.raises(CheckpointError, match=re.escape(victim.name)):
        from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ('{"model_type": "bert",', "is not valid JSON"),
        ("\xff\xfe", "is not valid JSON"),
        ('[{"model_type": "bert"}]', "holds an array"),
        ('"bert"', "holds a string"),
        ("null", "holds null"),
    ],
    ids=["cut", "not-utf8", "list", "string", "null"],
)
def test_config_that_is_not_a_json_object_names_the_file(tiny, text, fragment):
    (tiny / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(CheckpointError, match=rf"config\.json.*{fragment}"):
        from_pretrained(tiny)


# The smallest config each registered model_type builds from; every key listed is required.
MINIMAL_CONFIGS = {
    "bert": dict(vocab_size=11),
    "gpt2": dict(vocab_size=11, n_embd=8, n_layer=1, n_head=2),
    "llama": dict(
        vocab_size=11, hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
        intermediate_size=12,
    ),
    "t5": dict(vocab_size=11, d_model=8, d_kv=4, d_ff=12, num_heads=2, num_layers=1),
    "deepseek_v3": dict(
        vocab_size=11, hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
        intermediate_size=12, kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2,
        v_head_dim=2, moe_intermediate_size=4, n_routed_experts=4, num_experts_per_tok=2,
    ),
    "bart": dict(
        vocab_size=11, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12,
        max_position_embeddings=16,
    ),
    "gpt_oss": dict(
        vocab_size=11, hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
        intermediate_size=12, num_local_experts=4,
    ),
    "mamba2": dict(
        vocab_size=11, hidden_size=8, num_heads=4, head_dim=4, state_size=2, num_hidden_layers=1,
    ),
    "bamba": dict(
        vocab_size=11, hidden_size=8, num_attention_heads=2, num_hidden_layers=2,
        intermediate_size=12, mamba_n_heads=4, mamba_d_state=2,
    ),
    "qwen3_next": dict(
        vocab_size=11, hidden_size=8, num_attention_heads=2, num_hidden_layers=4,
        intermediate_size=12, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=4, linear_value_head_dim=4, num_experts=0,
    ),
}  # fmt: skip
FAMILY_OF = {"mistral": "llama", "qwen2": "llama", "gemma2": "llama", "mt5": "t5"}
_LLAMA_LIKE = ["qwen3", "olmo2", "gemma3_text", "diffllama", "llama4_text", "phi3"]  # variants
FAMILY_OF.update(dict.fromkeys(_LLAMA_LIKE, "llama"))
REQUIRED = [
    (t, key)
    for t in sorted(hub.registered())
    for key in MINIMAL_CONFIGS.get(FAMILY_OF.get(t, t), {})
]


def test_every_model_type_with_required_keys_is_covered():
    # ViT defaults every key (as transformers does); a new family must join MINIMAL_CONFIGS
    assert {FAMILY_OF.get(t, t) for t in hub.registered()} - {"vit"} == set(MINIMAL_CONFIGS)
    for t in hub.registered():  # each minimal config really builds (tiny, random weights)
        config = dict(MINIMAL_CONFIGS.get(FAMILY_OF.get(t, t), {}), model_type=t)
        if t == "bert":
            config.update(hidden_size=8, num_attention_heads=2, intermediate_size=12)
        if t == "vit":
            config.update(hidden_size=8, num_attention_heads=2, image_size=8, patch_size=4)
        assert hub.registered()[t].from_config(config) is not None


@pytest.mark.parametrize("model_type,key", REQUIRED, ids=[f"{t}-{k}" for t, k in REQUIRED])
def test_missing_required_config_key_names_the_file_and_key(tmp_path, model_type, key):
    config = dict(MINIMAL_CONFIGS[FAMILY_OF.get(model_type, model_type)], model_type=model_type)
    del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hub.ConfigKeyError, match=rf"config\.json.*{key!r}.*{model_type}") as e:
        from_pretrained(tmp_path)
    assert e.value.key == key and e.value.file == tmp_path / "config.json"
    assert not isinstance(e.value, KeyError)


@pytest.mark.parametrize(
    "model_type,change,fragment",
    [
        ("bert", {"num_attention_heads": "3"}, "BertModel (bert): ValueError"),
        ("llama", {"rope_scaling": [1, 2]}, "Llama (llama): TypeError"),
        ("bart", {"activation_function": ["gelu"]}, "Bart (bart): TypeError"),
    ],
    ids=["bert-str", "llama-list", "bart-list"],
)
def test_config_value_of_the_wrong_kind_names_the_file(tmp_path, model_type, change, fragment):
    config = dict(MINIMAL_CONFIGS[model_type], model_type=model_type, **change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config\.json.*{re.escape(fragment)}"):
        from_pretrained(tmp_path)


def test_model_type_that_is_not_a_string(tiny):
    edit_config(tiny, model_type=["bert"])
    with pytest.raises(UnsupportedConfigError, match=r"model_type=\['bert'\].*config\.json"):
        from_pretrained(tiny)


def _sharded_with_one_shard_moved(tmp_path):
    """A sharded folder ``tmp_path/model`` whose second shard was moved to ``tmp_path/elsewhere``
    (a valid shard: only its location is wrong). Returns (folder, index dict, shard name)."""
    folder, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    save_tiny(folder, max_shard_size="20KB")
    elsewhere.mkdir()
    name = sorted(p.name for p in folder.glob("*.safetensors"))[1]
    (folder / name).rename(elsewhere / name)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder, index, name


def _rewrite_index(folder, index, name, new_name):
    index["weight_map"] = {k: new_name if v == name else v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_index_shard_names_must_stay_inside_the_folder(tmp_path, how):
    folder, index, name = _sharded_with_one_shard_moved(tmp_path)
    outside = tmp_path / "elsewhere" / name
    new_name = f"../elsewhere/{name}" if how == "dotdot" else str(outside)
    _rewrite_index(folder, index, name, new_name)
    with pytest.raises(CheckpointError, match=rf"index\.json.*{re.escape(new_name)}.*outside"):
        from_pretrained(folder)


def test_index_shard_that_links_out_of_the_folder_is_refused(tmp_path):
    folder, _, name = _sharded_with_one_shard_moved(tmp_path)
    (folder / name).symlink_to(tmp_path / "elsewhere" / name)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}.*link to.*outside"):
        from_pretrained(folder)


def test_hugging_face_cache_snapshot_links_are_followed(tmp_path):
    # <repo>/snapshots/<rev>/<file> -> ../../blobs/<hash>: huggingface_hub's cache layout
    source, repo = tmp_path / "source", tmp_path / "models--tiny"
    save_tiny(source, max_shard_size="20KB")
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(source.iterdir())):
        f.rename(blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert isinstance(from_pretrained(snapshot), BertModel)


@pytest.mark.parametrize(
    "index,fragment",
    [
        ("[1, 2]", "holds an array"),
        ('{"weight_map": {"a": 3}}', "maps tensor 'a' to 3"),
        ('{"weight_map":', "is not valid JSON"),
    ],
    ids=["list", "non-string-shard", "cut"],
)
def test_malformed_index_names_the_file(tmp_path, index, fragment):
    save_tiny(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=rf"index\.json.*{re.escape(fragment)}"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_integer_or_bool_tensor_into_a_float_parameter(tiny, dtype):
    name = "encoder.layer.0.output.dense.bias"

    def to_int(state):
        state[name] = (state[name] * 100).to(dtype)

    edit_tensors(tiny, to_int)
    want = rf"{re.escape(str(tiny))}.*mis-typed.*{re.escape(name)}.*{re.escape(str(dtype))} vs "
    want += r"model float torch\.float32"
    with pytest.raises(CheckpointError, match=want):
        from_pretrained(tiny)


def test_sentence_transformers_modules_json_of_the_wrong_kind(tiny):
    from selfattn.models import SentenceEncoder

    (tiny / "modules.json").write_text('{"type": "Pooling"}')
    with pytest.raises(CheckpointError, match=r"modules\.json.*holds an object.*expected an array"):
        SentenceEncoder.from_pretrained(tiny)
