"""benchmarks/serving.py runs end to end (``--smoke --json``) and its bookkeeping is right.

Speed is never asserted: only that the rows are there and measured, that ratios and verdicts
follow from the measured values, and that the engine's tokens equal the peers'.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


def test_smoke_json_rows_ratios_and_agreement():
    skip = "transformers generate_batch,transformers generate_batch (sized),transformers one by one"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--json", "--repeat", "1", "--only", "ab",
         "--threads", "1", "--skip", skip],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = {(r["workload"], r["method"]): r for r in report["rows"]}
    want = {
        ("a", "engine"), ("a", "engine (no prefix caching)"), ("a", "engine (int8 KV)"),
        ("a", "transformers one batch"), ("a", "selfattn generate one batch"),
        ("b", "engine"), ("b", "transformers one batch"),
    }  # fmt: skip
    assert set(rows) == want
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
