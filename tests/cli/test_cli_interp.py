"""``selfattn heads`` and ``selfattn lens`` on a tiny checkpoint folder: the same numbers as
the library's analyses, --json shapes, clear usage errors."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from selfattn.cli import main
from selfattn.inspect.circuits import induction_heads, logit_lens
from selfattn.models import from_pretrained, load_tokenizer
from tests._serving_helpers import save_tiny_llama


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_heads_json_is_one_object_per_head(folder, capsys):
    assert main(["heads", str(folder), "--length", "6", "--batch", "2", "--ablate", "2",
                 "--random-seeds", "2", "--json"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    model = from_pretrained(folder, dtype="float32", quantized=False).eval()
    want = induction_heads(model, length=6, batch=2, ablate=2, random_seeds=2)
    heads = sum(layer.self_attention.n_heads for layer in model.layers)
    assert len(rows) == heads
    by = {(r["layer"], r["head"]): r for r in rows}
    for layer in range(len(model.layers)):
        for h in range(model.layers[layer].self_attention.n_heads):
            r = by[(layer, h)]
            assert r["induction"] == pytest.approx(float(want.induction[layer, h]), abs=1e-6)
            assert r["prev_token"] == pytest.approx(float(want.prev_token[layer, h]), abs=1e-6)
            assert set(r) >= {"copying", "is_induction", "ablation", "ablated_in_top_k"}
    assert sum(r["ablated_in_top_k"] for r in rows) == 2


def test_heads_table(folder, capsys):
    assert main(["heads", str(folder), "--length", "5", "--batch", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "induction" in out and "repeated half" in out


def test_lens_json_matches_the_library(folder, capsys):
    assert main(["lens", str(folder), "w5 w9 w17 w3", "--top", "3", "--answer", "w9",
                 "--json"]) == 0  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    model = from_pretrained(folder, dtype="float32", quantized=False).eval()
    tok = load_tokenizer(folder)
    ids = torch.tensor([tok.encode("w5 w9 w17 w3")])
    lens = logit_lens(model, ids, top=3, answer=tok.encode("w9")[0])
    assert [e["layer"] for e in got["layers"]] == lens.layers
    last = got["layers"][-1]["positions"][-1]
    assert [t for t, _ in last["top"]] == [tok.decode([int(i)]) for i in lens.top_ids[-1, 0, -1]]
    assert last["answer_rank"] == int(lens.answer_rank[-1, 0, -1])
    assert len(got["layers"][0]["positions"]) == ids.shape[1]


def test_lens_table_and_usage_errors(folder, capsys):
    assert main(["lens", str(folder), "w5 w9", "--all-positions"]) == 0
    assert capsys.readouterr().out.count("next token after") == 2
    assert main(["lens", str(folder), "w5", "w9", "w3"]) == 2
    assert "quote the prompt" in capsys.readouterr().err
