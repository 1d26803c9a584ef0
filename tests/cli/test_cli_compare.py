"""``selfattn compare``: the cost section end to end (tiny sizes), its report and its plots."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import run

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: threads cost more


def test_compare_writes_a_report_and_one_png_per_metric(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from selfattn.benchmarks.alternatives import print_report

    out = tmp_path / "cmp"
    rc, stdout, err = run(capsys, "compare", "--quick", "--only", "cost", "--out", str(out),
                          "--json")  # fmt: skip
    assert rc == 0, err
    report = json.loads(stdout)
    assert json.loads((out / "report.json").read_text())["rows"] == report["rows"]
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["cache_bytes.png", "decode_ms_per_token.png", "prefill_ms_per_token.png"]
    assert all((out / n).read_bytes().startswith(b"\x89PNG") for n in names)
    kinds = {r["model"] for r in report["rows"] if r["section"] == "cost"}
    assert kinds == {"attention", "attention-window", "mamba2", "deltanet", "hybrid"}
    print_report(report)  # the text form of the same report
    text = capsys.readouterr().out
    assert "crossovers" in text and "attention-window" in text


def test_compare_refuses_a_bad_length(capsys):
    rc, _, err = run(capsys, "compare", "--max-len", "0")
    assert rc == 2 and "--max-len" in err
