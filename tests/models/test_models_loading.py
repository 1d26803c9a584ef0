"""from_pretrained as users have their checkpoints: dtype names and "auto", meta-device
construction without a float32 copy, tied weights, sharded bf16 folders, Hub ids through
huggingface_hub's cache (offline), the progress bar.

Folders are tiny random transformers models written by ``save_pretrained`` into tmp_path.
Peak memory is measured in benchmarks/models.py, not here.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from selfattn.models import CheckpointError, from_pretrained  # noqa: E402
from selfattn.models.decoder import GPT2, Llama  # noqa: E402

LLAMA = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=67,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def save_llama(folder, dtype=torch.float32, seed=0, **save_kw):
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(dtype).eval()
    hf.save_pretrained(folder, **save_kw)
    return hf


def edit_config(folder, drop=(), **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def ids(B=2, S=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, LLAMA["vocab_size"], (B, S), generator=g)


@pytest.mark.parametrize(
    "dtype,want",
    [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("float32", torch.float32),
        ("float64", torch.float64),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=["bf16", "fp16", "fp32", "fp64", "torch.bfloat16"],
)
def test_dtype_by_name_or_torch_dtype(tmp_path, dtype, want):
    hf = save_llama(tmp_path)
    model = from_pretrained(tmp_path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    # the values are the checkpoint's, rounded once to the target dtype
    torch.testing.assert_close(
        model.embed.weight, hf.model.embed_tokens.weight.to(want), rtol=0, atol=0
    )


def test_auto_takes_the_config_dtype(tmp_path):
    save_llama(tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    for dtype in ("auto", None):
        model = from_pretrained(tmp_path, dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    edit_config(tmp_path, drop=["dtype"], torch_dtype="float16")  # transformers 4's key
    assert from_pretrained(tmp_path).embed.weight.dtype == torch.float16


def test_auto_without_a_config_dtype_takes_the_weights_dtype(tmp_path):
    save_llama(tmp_path, dtype=torch.bfloat16)
    edit_config(tmp_path, drop=["dtype", "torch_dtype"])
    assert from_pretrained(tmp_path).embed.weight.dtype == torch.bfloat16


def test_bad_dtypes_are_named(tmp_path):
    save_llama(tmp_path)
    with pytest.raises(ValueError, match=r"dtype must be 'auto'.*'bfloat16'.*got 'bf17'"):
        from_pretrained(tmp_path, dtype="bf17")
    with pytest.raises(ValueError, match=r"floating dtype, got torch\.int64"):
        from_pretrained(tmp_path, dtype=torch.int64)
    edit_config(tmp_path, dtype="int8")
    with pytest.raises(CheckpointError, match=r"config\.json.*dtype 'int8' is not a floating"):
        from_pretrained(tmp_path)


class _RealFloat32(TorchDispatchMode):
    """Records every real (non-meta) float32 tensor an op makes, with its size."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t.is_meta:
                self.sizes.append((str(func), t.numel()))
        return out


def test_bf16_load_builds_on_meta_and_never_makes_a_float32_weight(tmp_path):
    save_llama(tmp_path, dtype=torch.bfloat16)
    smallest = min(p.numel() for p in Llama.from_config({**LLAMA, "model_type": "llama"})
                   .parameters() if p.dim() == 2)  # fmt: skip
    built_on = []
    original = Llama.from_config.__func__

    def spy(cls, config):
        model = original(cls, config)
        built_on.append({p.device.type for p in model.parameters()})
        return model

    Llama.from_config = classmethod(spy)
    try:
        with _RealFloat32() as seen:
            model = from_pretrained(tmp_path, dtype="bfloat16")
    finally:
        Llama.from_config = classmethod(original)
    assert built_on == [{"meta"}]
    big = [(op, n) for op, n in seen.sizes if n >= smallest]
    assert not big, f"float32 tensors as large as a weight were made while loading: {big}"
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert not any(t.is_meta for t in model.buffers())


def test_tied_embeddings_stay_one_parameter_and_match_transformers(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.lm_head.weight is model.embed.weight
    numel = sum(p.numel() for p in model.parameters())  # a tied tensor counts once
    assert numel == sum(p.numel() for p in hf.parameters())
    x = ids()
    torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-5, atol=1e-5)


def test_gpt2_ties_and_transposes(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=97, n_embd=24, n_layer=2, n_head=3, n_positions=32)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype="float64")
    assert isinstance(model, GPT2) and model.lm_head.weight is model.embed.weight
    x = ids()
    torch.testing.assert_close(model(x), hf.double()(x).logits, rtol=1e-10, atol=1e-10)


def test_sharded_bf16_folder_equals_the_single_file(tmp_path):
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    save_llama(one, dtype=torch.bfloat16)
    save_llama(sharded, dtype=torch.bfloat16, max_shard_size="8KB")
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())) > 0
    assert len(list(sharded.glob("*.safetensors"))) > 3  # q/k/v of a layer may sit apart
    a, b = from_pretrained(one), from_pretrained(sharded, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    x = ids()
    assert torch.equal(a(x), b(x))


def test_progress_bar_over_shards_can_be_turned_off(tmp_path, capsys):
    save_llama(tmp_path, max_shard_size="8KB")
    from_pretrained(tmp_path, progress=True)
    assert "Loading checkpoint shards" in capsys.readouterr().err
    from_pretrained(tmp_path, progress=False)
    assert "Loading checkpoint shards" not in capsys.readouterr().err


# -- Hub ids through huggingface_hub's cache (offline) ----------------------------------------
REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash: 40 hex digits


def fake_hub_cache(cache, repo_id, source):
    """huggingface_hub's cache layout for ``repo_id`` at ``refs/main``: files in ``blobs/``,
    linked from ``snapshots/<commit>/``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot, blobs = repo / "snapshots" / REVISION, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for i, f in enumerate(sorted(source.iterdir())):
        f.rename(blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")


@pytest.fixture
def offline(monkeypatch):
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return hub_constants


def test_hub_id_from_the_cache_offline(tmp_path, offline, monkeypatch):
    hf = save_llama(tmp_path / "src", max_shard_size="8KB")
    fake_hub_cache(tmp_path / "cache", "tiny-org/tiny-llama", tmp_path / "src")
    model = from_pretrained("tiny-org/tiny-llama", cache_dir=tmp_path / "cache")
    x = ids()
    torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    # the default cache is huggingface_hub's (HF_HUB_CACHE)
    monkeypatch.setattr(offline, "HF_HUB_CACHE", str(tmp_path / "cache"))
    assert isinstance(from_pretrained("tiny-org/tiny-llama"), Llama)


def test_hub_id_missing_from_the_cache_says_so(tmp_path, offline):
    (tmp_path / "cache").mkdir()
    with pytest.raises(FileNotFoundError, match=r"'nobody/nothing' is not a folder.*offline"):
        from_pretrained("nobody/nothing", cache_dir=tmp_path / "cache")
    # not a repo id (absolute, or more than one slash): a plain missing folder
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained("a/b/c")


def test_assign_gives_untied_parameters_their_own_tensor():
    """One checkpoint tensor for two untied parameters: each gets its own storage (assigning
    the same tensor twice would tie them behind the model's back)."""
    from selfattn.models.hub import load_state

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3))
    w = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    load_state(model, {"0.weight": w, "1.weight": w, "1.bias": torch.zeros(3)}, assign=True)
    assert torch.equal(model[0].weight, w) and torch.equal(model[1].weight, w)
    assert model[0].weight.data_ptr() != model[1].weight.data_ptr()
    assert isinstance(model[1].bias, torch.nn.Parameter)


def test_older_safetensors_without_pread_still_loads(tmp_path, monkeypatch, caplog):
    import safetensors

    save_llama(tmp_path)
    real = safetensors.safe_open

    def no_backend(path, framework, **kw):
        if "backend" in kw:
            raise TypeError("safe_open() got an unexpected keyword argument 'backend'")
        return real(path, framework, **kw)

    from selfattn.models import hub

    monkeypatch.setattr(safetensors, "safe_open", no_backend)
    hub._log_mmap_fallback.cache_clear()  # logged once per process: forget earlier tests
    with caplog.at_level("INFO", logger="selfattn"):
        model = from_pretrained(tmp_path, dtype="bfloat16")
    assert model.embed.weight.dtype == torch.bfloat16
    assert caplog.text.count("no pread backend") == 1
