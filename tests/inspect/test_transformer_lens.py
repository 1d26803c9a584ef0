"""Our hook points against TransformerLens's on the same tiny random checkpoints: every shared
point, the logits and the logit lens meet the ratio rule against our float64 run
(:mod:`selfattn.benchmarks.lens_parity` does the comparing; SmolLM2 is in the benchmark)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformer_lens", reason="TransformerLens is the peer here: pip install 'selfattn[interp]'"
)
pytest.importorskip("tokenizers", reason="the tiny checkpoints' tokenizer needs tokenizers")

from selfattn.benchmarks.lens_parity import (
    NOTES,
    SHARED_POINTS,
    TINY,
    WHOLE,
    compare,
    tiny_checkpoint,
)


@pytest.mark.parametrize("family, seed", [("gpt2", 11), ("llama", 12)])
def test_every_shared_point_matches_transformer_lens(family, seed, tmp_path):
    """TransformerLens's float32 error against our float64 run is within the ratio rule of our
    own float32 error at every point of every layer, on the logits, the logit lens and the
    induction scores (GQA 3:1 and RoPE in the Llama, biases and random norm gains in both)."""
    folder = tiny_checkpoint(family, tmp_path, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY[family]["vocab_size"], (2, 7), generator=g)
    rows = compare(folder, ids)
    assert [r["point"] for r in rows] == SHARED_POINTS + [point for _, point, _ in WHOLE]
    for r in rows:
        assert r["met"], r["why"]
        assert r["ours_fp32_err"] > 0 or r["point"] == "hook_embed", r  # a real baseline
    notes = {n for r in rows for n in r["notes"]}
    assert NOTES["layout"] in notes
    assert (NOTES["rope"] in notes) == (family == "llama")
    # TransformerLens 4.x hooks k/v with the kv heads, as we do: nothing repeated to compare
    assert not any(n.startswith("TL repeats") for n in notes)
    scores = next(r for r in rows if r["point"].endswith("hook_attn_scores"))
    assert any(n.startswith("masked scores: TL -3.4e+38") for n in scores["notes"]), scores


def test_a_different_point_is_caught(tmp_path):
    """The comparison can fail: our post-RoPE queries against TransformerLens's pre-RoPE
    hook_q (the name alone, unmapped) miss by far more than rounding."""
    from selfattn.benchmarks import lens_parity

    folder = tiny_checkpoint("llama", tmp_path, seed=13)
    ids = torch.randint(0, TINY["llama"]["vocab_size"], (1, 9))
    ours = lens_parity.load_transformer_lens(folder, torch.float32)
    with torch.no_grad():
        _, cache = ours.run_with_cache(ids)
    pre, post = cache["blocks.1.attn.hook_q"], cache["blocks.1.attn.hook_rot_q"]
    rows = {r["point"]: r for r in compare(folder, ids)}
    q = rows["blocks.{i}.attn.hook_q"]
    assert q["tl_point"] == "blocks.{i}.attn.hook_rot_q" and q["met"]
    assert (pre - post).abs().max() > 1e3 * q["tl_fp32_err"]
