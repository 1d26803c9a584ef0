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
                          "--json", "--clock", "cpu")  # fmt: skip
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["clock"] == "cpu"  # timed by CPU time: steady on a shared machine
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


def test_compare_mqar_flags_shape_the_run(capsys, tmp_path):
    """--pairs, --state-size(s), --steps, --batch and --seed reach the run; a progress line per
    trained model goes to stderr; the report times itself; both recall plots are written."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp"
    argv = ["compare", "--quick", "--only", "mqar", "--pairs", "1,2", "--state-size", "2",
            "--state-sizes", "2,3", "--steps", "3", "--batch", "4", "--seed", "5", "--json",
            "--jobs", "1", "--out", str(out)]  # fmt: skip
    rc, stdout, err = run(capsys, *argv)
    assert rc == 0, err
    report = json.loads(stdout)
    cfg = report["mqar"]
    assert (cfg["steps"], cfg["batch"], cfg["seed"], cfg["state_size"]) == (3, 4, 5, 2)
    rows = report["rows"]
    grid = [(r["model"], r["pairs"], r["state_size"]) for r in rows if "sweep" not in r]
    kinds = ("attention", "mamba2", "deltanet", "hybrid")
    # one model per kind, trained on the mix of pairs, evaluated at each
    assert grid == [(k, n, 2) for k in kinds for n in (1, 2)]
    # Mamba-2's other state sizes: state 2 is already in the grid
    assert [(r["model"], r["pairs"], r["state_size"]) for r in rows if "sweep" in r] == [
        ("mamba2", 1, 3),
        ("mamba2", 2, 3),
    ]
    assert [line.split("]", 1)[1].split(":")[0] for line in err.splitlines()] == [
        f" mqar {i}/5" for i in range(1, 6)
    ]
    assert report["run_s"] > 0 and report["cpu_s"] > 0
    assert sorted(p.name for p in out.glob("*.png")) == ["mqar_pairs.png", "mqar_state.png"]


def test_compare_help_states_the_defaults():
    """Each run-size flag's help names the default the run really uses."""
    from selfattn.benchmarks.alternatives import MQAR, Sizes, parser

    def fmt(value) -> str:
        return ",".join(map(str, value)) if isinstance(value, tuple) else f"{value:,}"

    sizes, recall = Sizes(), MQAR()
    defaults = {
        "max_len": max(sizes.lengths), "decode_steps": sizes.decode_steps,
        "pairs": recall.pairs, "state_size": recall.state_size,
        "state_sizes": recall.state_sizes, "steps": recall.steps, "batch": recall.batch,
        "seed": recall.seed,
    }  # fmt: skip
    helps = {a.dest: a.help for a in parser()._actions}
    for dest, value in defaults.items():
        assert f"default {fmt(value)}" in helps[dest], (dest, helps[dest])
    # the lengths double from the shortest default
    assert sizes.lengths == tuple(sizes.lengths[0] * 2**i for i in range(len(sizes.lengths)))
    assert f"double from {sizes.lengths[0]:,}" in helps["max_len"]


def test_compare_refuses_more_pairs_than_keys(capsys):
    rc, _, err = run(capsys, "compare", "--quick", "--pairs", "2,99")
    assert rc == 2 and "--pairs 2,99" in err and "kv_vocab" in err


def test_mqar_runs_are_reproducible():
    """The same seed trains the same model to the same loss; another seed does not."""
    import dataclasses

    from selfattn.benchmarks.alternatives import MQAR, train_mqar

    run_ = dataclasses.replace(MQAR().quick(), steps=20, pairs=(1, 2))
    keys = ("pairs", "accuracy", "final_loss", "params", "state_bytes")

    def trained(r):
        return [{k: row[k] for k in keys} for row in train_mqar("hybrid", r)]

    first = trained(run_)
    assert [r["pairs"] for r in first] == [1, 2]
    assert trained(run_) == first
    other = trained(dataclasses.replace(run_, seed=1))
    assert [r["final_loss"] for r in other] != [r["final_loss"] for r in first]
