"""The CPU LLM benchmark (``selfattn.benchmarks.cpu_llm``): its prompts, its re-encoded GGUF
files, its ratios and verdicts, and the shape of its ``--quick --json`` report (run by the smoke
harness, tests/benchmarks/test_benchmarks_smoke.py, with :func:`check_cpu_llm`). Speed is never
asserted; the peers are never run here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from selfattn.benchmarks import cpu_llm

gguf = pytest.importorskip("gguf")


def check_cpu_llm(report: dict) -> None:
    """A ``--quick --json`` report: every part present, each row measured or saying why not,
    ratios and verdicts following from the measured values."""
    setup, sizes = report["setup"], report["setup"]["sizes"]
    assert setup["parts"] == ["a", "b", "c", "d"] and report["skipped"], setup
    assert setup["single_prompt_tokens"] == sizes["prompt"]
    lengths = setup["batch_prompt_tokens"]
    assert len(lengths) == sizes["requests"]
    assert all(sizes["shortest"] <= n <= sizes["longest"] for n in lengths), lengths
    assert all(v > 0 for v in setup["copy_gbs"].values()) and setup["weight_bytes"]
    for row in report["a"]:
        assert row["system"].startswith("ours") and "error" not in row, row
        assert row["ttft_ms"] > 0 and row["decode_tok_s"] > 0 and row["peak_mib"] > 0, row
        assert row["weight_gbs"] == pytest.approx(row["weight_bytes"] * row["decode_tok_s"] / 1e9)
        assert row["of_copy_rate"] == pytest.approx(row["weight_gbs"] / row["copy_gbs"])
        assert row["vs_llama"] is None and row["vs_vllm"] is None  # no peers under --quick
        assert row["agree"] == sizes["new"]  # its own reference
    (engine,) = report["b"]
    assert engine["system"] == "ours Engine" and engine["tok_s"] > 0, engine
    assert engine["output_tokens"] == sizes["requests"] * sizes["new"], engine
    (served,) = report["c"]
    assert served["system"] == "selfattn serve" and "error" not in served, served
    assert served["output_tokens"] == sizes["requests"] * sizes["new"], served
    assert 0 < served["ttft_p50_ms"] <= served["ttft_p99_ms"] and served["itl_p50_ms"] > 0
    for row in report["d"]:
        if "skipped" in row:  # speculation not in this selfattn yet: said so
            assert "speculative" in row["skipped"] or "prompt_lookup" in row["skipped"], row
            continue
        assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"]), row
        assert row["identical"] == row["compared"] == row["prompts"] * row["runs"], row  # greedy
    check_targets(report["targets"])


def check_targets(rows: list[dict]) -> None:
    for t in rows:
        assert t["ratio"] == pytest.approx(t["ours"] / t["peer_value"]), t
        want = t["ratio"] >= t["target"] if t["op"] == ">=" else t["ratio"] <= t["target"]
        assert t["met"] == want, t


# -- the prompts ---------------------------------------------------------------------------------


class Words:
    """A tokenizer over whitespace-separated words (ids by first appearance), with a chat
    template that wraps a user turn in marker words."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<start> {m['role']} {m['content']} <end> " for m in messages)
        text += "<start> assistant " if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def test_workload_prompts_have_their_lengths_and_the_chat_frame():
    tok, sizes = Words(), cpu_llm.Sizes(prompt=97, requests=7, shortest=13, longest=301)
    w = cpu_llm.make_workload(tok, sizes, seed=3)
    head, tail = cpu_llm.chat_frame(tok)
    assert tok.decode(head) == "<start> user" and tok.decode(tail) == "<end> <start> assistant"
    assert len(w["single"]) == 97
    assert cpu_llm.make_workload(Words(), sizes, seed=3) == w  # the seed fixes every id
    for p in [w["single"], *w["batch"]]:
        assert p[: len(head)] == head and p[-len(tail) :] == tail
    assert all(sizes.shortest <= len(p) <= sizes.longest for p in w["batch"])
    assert len({tuple(p) for p in w["batch"]}) == len(w["batch"])  # no two alike
    assert set(w["spec"]) == {"summarise", "edit", "extract"}
    ends = {tuple(p[-(sizes.passage + len(tail)) :]) for p in w["spec"].values()}
    assert len(ends) == 1  # each task ends with the same passage, which its answer draws from
    firsts = {p[0] for p in [w["single"], *w["batch"], *w["spec"].values()]}
    assert w["warm"][0] not in firsts  # the warm-up shares no first page with any prompt


# -- the re-encoded files ------------------------------------------------------------------------


def _tiny_gguf(path, rng) -> dict:
    """A GGUF file of two Q4_1 matrices, a Q8_0 embedding and a float32 norm; its arrays."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_name("tiny")
    writer.add_file_type(3)
    arrays = {
        "blk.0.attn_q.weight": rng.standard_normal((7, 96)).astype(np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((5, 64)).astype(np.float32) * 3,
        "token_embd.weight": rng.standard_normal((11, 32)).astype(np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(32).astype(np.float32),
    }
    Q = gguf.GGMLQuantizationType
    kinds = {"blk.0.attn_q.weight": Q.Q4_1, "blk.0.ffn_up.weight": Q.Q4_1,
             "token_embd.weight": Q.Q8_0, "blk.0.attn_norm.weight": Q.F32}  # fmt: skip
    for name, a in arrays.items():
        data = a if kinds[name] == Q.F32 else gguf.quants.quantize(a, kinds[name])
        writer.add_tensor(name, data, raw_dtype=kinds[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kinds


def _block_bound(values: np.ndarray, fmt: str) -> np.ndarray:
    """The largest error re-encoding as ``fmt`` allows each value, from its 32-value block's
    step ``d``: the rounding (half a step for Q8_0, ``d = amax / 127``; a whole one for Q4_0,
    ``d = |max| / 8``, whose top level is clipped), plus the step's own rounding to float16
    (2^-11 relative) times the largest level (127; 8)."""
    blocks = values.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    if fmt == "Q8_0":
        d, rounding, levels = amax / 127, 0.5, 127
    else:
        d, rounding, levels = amax / 8, 1.0, 8
    bound = d * (rounding + levels * 2**-11) + 1e-7
    return np.broadcast_to(bound, blocks.shape).reshape(values.shape)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_write_format_reencodes_the_main_block_type_within_its_rounding(tmp_path, fmt):
    rng = np.random.default_rng(41 + len(fmt))
    src = tmp_path / "tiny.Q4_1.gguf"
    kinds = _tiny_gguf(src, rng)
    dst = cpu_llm.write_format(str(src), fmt, tmp_path / f"tiny.{fmt}.gguf")
    before, after = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    assert cpu_llm.main_type(before).name == "Q4_1" and cpu_llm.main_type(after).name == fmt
    assert after.get_field("general.file_type").contents() == cpu_llm.FILE_TYPES[fmt]
    assert after.get_field("general.name").contents() == "tiny"
    old = {t.name: t for t in before.tensors}
    for t in after.tensors:
        o = old[t.name]
        if kinds[t.name].name != "Q4_1":  # the embedding and float tensors: as they were
            assert t.tensor_type == o.tensor_type and np.array_equal(t.data, o.data), t.name
            continue
        assert t.tensor_type.name == fmt, t.name
        x = gguf.quants.dequantize(o.data, o.tensor_type).astype(np.float64)
        y = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert x.shape == y.shape
        err = np.abs(y - x)
        assert (err <= _block_bound(x, fmt)).all(), (t.name, err.max())
        assert err.max() > 0  # re-encoded, not copied


def test_main_type_refuses_a_file_without_blocks(tmp_path):
    path = tmp_path / "f32.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("w", np.ones((3, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no block-quantised tensor"):
        cpu_llm.main_type(gguf.GGUFReader(str(path)))


# -- measures, ratios and verdicts ---------------------------------------------------------------


def test_single_measures_from_token_stamps_and_from_whole_requests():
    ttft, rate = cpu_llm.single_measures({"stamps": [0.5, 0.75, 1.0, 1.25, 1.5]})
    assert ttft == 0.5 and rate == pytest.approx(4 / 1.0)
    # vLLM's offline API: a one-token request, then a whole one of n tokens
    ttft, rate = cpu_llm.single_measures({"ttft_s": 0.3, "full_s": 2.3, "tokens": [[0] * 9]})
    assert ttft == 0.3 and rate == pytest.approx(8 / 2.0)


def _a_row(system, fmt, threads, tok_s, ttft, peak, kv=0.0):
    return {"system": system, "format": fmt, "dtype": "bf16" if system != "llama.cpp" else fmt,
            "threads": threads, "decode_tok_s": tok_s, "ttft_ms": ttft, "peak_mib": peak,
            "kv_mib": kv}  # fmt: skip


def test_ratios_pair_rows_by_format_and_threads_and_targets_follow():
    rng = np.random.default_rng(7)
    rates = rng.uniform(20, 200, size=6)
    a = [
        _a_row("ours generate", "Q4_1", 1, rates[0], 500.0, 400.0, kv=15.0),
        _a_row("ours generate", "Q8_0", 1, rates[1], 450.0, 420.0, kv=15.0),
        _a_row("llama.cpp", "Q4_1", 1, rates[2], 700.0, 300.0),
        _a_row("llama.cpp", "Q8_0", 1, rates[3], 300.0, 350.0),
        _a_row("vLLM", "bf16", 1, rates[4], 150.0, 2400.0),
        {**_a_row("llama.cpp", "Q4_1", 2, 0, 0, 0), "error": "crashed"},
    ]
    cpu_llm.add_ratios(a, "decode_tok_s")
    assert a[0]["vs_llama"] == pytest.approx(rates[0] / rates[2])
    assert a[1]["vs_llama"] == pytest.approx(rates[1] / rates[3])
    assert a[0]["vs_vllm"] == pytest.approx(rates[0] / rates[4])
    assert "vs_llama" not in a[5]  # a failed row gets no ratio
    b = [{"system": "ours Engine", "dtype": "bf16", "tok_s": 300.0},
         {"system": "llama.cpp", "dtype": "Q4_1", "tok_s": 80.0},
         {"system": "vLLM", "dtype": "bf16", "tok_s": 260.0}]  # fmt: skip
    c = [{"system": "selfattn serve", "tok_s": 250.0}]
    d = [{"system": "ours generate", "plain_tok_s": 50.0, "spec_tok_s": 90.0, "speedup": 1.8}]
    rows = cpu_llm.targets({"a": a, "b": b, "c": c, "d": d})
    check_targets(rows)
    cases = [r["case"] for r in rows]
    assert sum(c.startswith("(a)") for c in cases) == 6  # 2 formats x decode, TTFT, memory
    memory = next(r for r in rows if r["case"].startswith("(a) peak RSS") and "Q4_1" in r["case"])
    assert memory["ours"] == 400.0 - 15.0 and memory["peer_value"] == 300.0
    assert [r["met"] for r in rows if r["case"].startswith("(b)")] == [False, False]  # 3.75x, 1.15x
    served = next(r for r in rows if r["case"].startswith("(c)"))
    assert served["ratio"] == pytest.approx(250 / 300) and not served["met"]
    assert next(r for r in rows if r["case"].startswith("(d)"))["met"]


def test_agreement_counts_leading_tokens_shared_with_the_reference():
    rows = [{"system": "ref", "tokens": [[1, 2, 3, 4], [5, 6]]},
            {"system": "peer", "tokens": [[1, 2, 9, 4], [5, 6]]},
            {"system": "none"}]  # fmt: skip
    cpu_llm.add_agreement(rows, lambda r: rows[0] if r["system"] != "none" else None)
    assert rows[0]["agree"] == 3 and rows[1]["agree"] == 2  # (2 + 2) / 2
    assert "agree" not in rows[2] and not any("tokens" in r for r in rows)


def test_part_d_pairs_the_peer_without_and_with_drafting(monkeypatch):
    # no speculation in ours (skipped rows saying why); the peer's two modes as canned results
    monkeypatch.setattr(cpu_llm, "speculation_missing", lambda api: f"{api}: none here")

    def peer(python, **job):
        tokens = [[7, 8, 9] if job["mode"] == "batch" or i else [7, 8, 1]
                  for i in range(len(job["prompts"]))]  # fmt: skip
        wall = 3.0 if job["mode"] == "batch" else 1.5
        return lambda: {"wall_s": wall, "tokens": tokens, "peak_mib": 1.0}

    monkeypatch.setattr(cpu_llm, "_peer", peer)
    ctx = SimpleNamespace(workload={"spec": {"edit": [1, 2], "extract": [3]}, "warm": [4]},
                          sizes=cpu_llm.Sizes(new=3), threads=[1], shipped="Q4_1",
                          files={"Q4_1": "model.gguf"}, llama="python", repeat=2,
                          quick=False)  # fmt: skip
    ours_gen, ours_engine, llama = cpu_llm.part_d(ctx)
    assert ours_gen["skipped"] == "generate: none here" and "speedup" not in ours_gen
    assert ours_engine["skipped"] == "engine: none here"
    assert llama["runs"] == 2 and llama["speedup"] == pytest.approx(2.0)
    assert (llama["identical"], llama["compared"]) == (2, 4)  # one prompt differs, each round
