"""``selfattn generate``: a text prompt continued by a checkpoint folder's model and tokenizer,
streamed to stdout; equal to selfattn.models.generate on the same folder."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from selfattn.cli import main  # noqa: E402
from selfattn.models import from_pretrained, generate, load_tokenizer  # noqa: E402
from tests._serving_helpers import save_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama and a WordLevel tokenizer over its ids, saved by transformers."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


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
