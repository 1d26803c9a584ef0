"""``selfattn generate``: a text prompt continued by a checkpoint folder's model and tokenizer,
streamed to stdout; equal to selfattn.models.generate on the same folder."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from selfattn.cli import main  # noqa: E402
from selfattn.models import from_pretrained, generate, load_tokenizer  # noqa: E402

VOCAB = 64
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama and a WordLevel tokenizer over its ids ("w0" .. "w63", plus role
    words), saved by transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=1, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB - 3)}
    vocab["</s>"] = vocab.pop("w1")
    for i, word in enumerate(("<user>", "<assistant>", "<system>")):
        vocab[word] = VOCAB - 3 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(path)
    return path


def expected(folder, text: str, n: int) -> str:
    model, tok = from_pretrained(folder, dtype="float32"), load_tokenizer(folder)
    return generate(model, text, n, tokenizer=tok)


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_generate_streams_the_continuation(folder, cache, capsys):
    assert main(["generate", str(folder), "w5 w9 w17 w3", "--max-new-tokens", "6",
                 "--cache", cache, "--dtype", "float32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    want = expected(folder, "w5 w9 w17 w3", 6)
    assert want.strip() and out.strip() == want.strip()


def test_generate_chat_uses_the_template(folder, capsys):
    assert main(["generate", str(folder), "w7 w8", "--chat", "--max-new-tokens", "4",
                 "--no-stream", "--dtype", "float32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    chat = load_tokenizer(folder).apply_chat_template(
        [{"role": "user", "content": "w7 w8"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<user> w7 w8 <assistant>"
    assert out.strip() == expected(folder, chat, 4).strip()


def test_generate_bad_input_exits_2(folder, capsys):
    assert main(["generate", str(folder), "  "]) == 2
    assert "PROMPT must be non-empty" in capsys.readouterr().err
    assert main(["generate", str(folder), "w5", "--max-new-tokens", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
