"""``selfattn compare``: attention against its alternatives (Mamba-2, gated DeltaNet, a hybrid):
cost per token vs context length and MQAR recall (:mod:`selfattn.benchmarks.alternatives`),
as a table, a JSON report and one PNG per metric."""

from __future__ import annotations

from selfattn.benchmarks.alternatives_args import DESCRIPTION, EPILOG, add_arguments
from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "compare",
        help="attention vs Mamba-2, gated DeltaNet and a hybrid: cost per token, MQAR recall",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    p.add_argument("--out", metavar="DIR", help="write report.json and one PNG per metric here")
    add_arguments(p)
    p.set_defaults(run=run, subparser=p)
    return p


def run(args) -> int:
    import json
    from pathlib import Path

    from selfattn.benchmarks import alternatives

    try:
        alternatives.configure(args)  # a bad combination of flags is a usage error
    except ValueError as e:
        args.subparser.error(str(e))
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
