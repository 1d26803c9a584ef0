"""``selfattn compare``: attention against its alternatives (Mamba-2, gated DeltaNet, a hybrid):
cost per token vs context length and MQAR recall (:mod:`selfattn.benchmarks.alternatives`),
as a table, a JSON report and one PNG per metric."""

from __future__ import annotations

from selfattn.cli import _common


def add_parser(subparsers):
    positive = _common.positive_int
    p = subparsers.add_parser(
        "compare",
        help="attention vs Mamba-2, gated DeltaNet and a hybrid: cost per token, MQAR recall",
        description=(
            "Measure the textbook's claim on this machine: time and memory per prefill and per "
            "generated token vs context length for attention (full and windowed KV cache), "
            "Mamba-2, gated DeltaNet and a hybrid of equal width and depth, with the crossover "
            "lengths; then tiny models trained on multi-query associative recall. Defaults "
            "take about 15 CPU-minutes, mostly the recall training (--only cost: seconds); "
            "--quick in seconds."
        ),
    )
    p.add_argument("--out", metavar="DIR", help="write report.json and one PNG per metric here")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--only", choices=("cost", "mqar"), help="one section")
    p.add_argument("--max-len", type=positive, metavar="T",
                   help="longest context of the cost section (default 8192)")  # fmt: skip
    p.add_argument("--steps", type=positive, metavar="N",
                   help="MQAR training steps per model (default 500)")  # fmt: skip
    p.add_argument("--repeat", type=positive, default=1, help="prefills per cost row")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run, subparser=p)
    return p


def run(args) -> int:
    import json
    from pathlib import Path

    from selfattn.benchmarks import alternatives

    report = alternatives.run(args)
    if args.out:
        paths = alternatives.plot(report, args.out)
        (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))
        report["plots"] = [str(p) for p in paths]
    if args.json:
        _common.print_json(report)
    else:
        alternatives.print_report(report)
        for path in report.get("plots", []):
            print(f"wrote {path}")
    return _common.EXIT_OK
