"""The server against its own OpenAPI document: Schemathesis draws requests for every route
from ``/openapi.json`` and checks each answer (no 5xx; status, media type and body as
documented), then an ordinary request must still be served.

    python -m selfattn.benchmarks.schema_fuzz                  # 500 examples a route
    python -m selfattn.benchmarks.schema_fuzz --examples 50 --api-key sk-x --json

Server: ``selfattn serve`` in its own process over :mod:`selfattn.benchmarks.soak`'s random
Llama (or ``--model``); with ``--api-key`` the examples carry the key (a run without it is a
run of 401s). Reported: requests, statuses, failures (each with the check, the status and a
``curl`` to replay it), seconds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import tempfile
import time
from pathlib import Path

from selfattn.benchmarks import _util

EXAMPLES = 500


def fuzz(base_url: str, examples: int, *, headers: dict | None = None, seed: int = 0,
         model: str | None = None) -> dict:  # fmt: skip
    """Run Schemathesis against the server at ``base_url``: ``examples`` drawn requests per
    operation and mode (bodies valid by the schema, then invalid ones), every default check; a
    drawn body's ``model`` is ``model`` (the served name) in three cases of four, so that most
    requests get past the name into the route. Returns ``{"requests", "statuses", "failures",
    "seconds"}`` (a failure: ``{"operation", "check", "status", "replay"}``)."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    statuses: collections.Counter = collections.Counter()
    failures: list[dict] = []
    t0 = time.perf_counter()
    for result in schema.get_all_operations():
        for mode in schemathesis.GenerationMode:
            _fuzz_one(result.ok(), mode, base_url, examples, headers, seed, model, statuses,
                      failures)  # fmt: skip
    return {"requests": sum(statuses.values()), "statuses": dict(statuses),
            "failures": failures, "seconds": time.perf_counter() - t0}  # fmt: skip


def _fuzz_one(op, mode, base_url, examples, headers, seed, model, statuses, failures) -> None:
    """:func:`fuzz` of one operation ``op`` in generation ``mode``: its answers counted in
    ``statuses``, the failed checks appended to ``failures``."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as with_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    drawn = itertools.count()
    # Every check but one: a body the schema allows may still be refused (400) for what a JSON
    # schema cannot say (a prompt longer than the context, token ids outside the vocabulary,
    # a tool call whose arguments are not JSON).
    excluded = [positive_data_acceptance]

    @with_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=op.as_strategy(mode))
    def run(case) -> None:
        body = case.body
        if model is not None and isinstance(body, dict) and "model" in body and next(drawn) % 4:
            body["model"] = model
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        statuses[str(response.status_code)] += 1
        try:
            case.validate_response(response, headers=headers, excluded_checks=excluded)
        except BaseException as e:  # a check's failure (or a group of them): recorded
            found = getattr(e, "exceptions", None) or [e]
            failures.append({"operation": op.label,
                             "check": ", ".join(type(x).__name__ for x in found),
                             "status": response.status_code, "detail": str(e)[:2000],
                             "replay": case.as_curl_command(headers=headers)})  # fmt: skip

    with contextlib.suppress(Unsatisfiable):  # nothing to make invalid (no parameters, no body)
        run()


def run(args) -> dict:
    import httpx

    from selfattn.benchmarks import soak

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp) / "model"
        if not args.model:
            soak.save_model(folder)
        flags = ["--dtype", "float32", "--kv-cache-bytes", str(soak.DEFAULT_POOL * 4)]
        proc, url = _util.start_server(folder, soak.NAME, args.threads, flags,
                                       api_key=args.api_key)  # fmt: skip
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            report = fuzz(url, args.examples, headers=headers, seed=args.seed, model=soak.NAME)
            body = {"model": soak.NAME, "prompt": "t5 t6", "max_tokens": 2}
            after = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
            report["served_after"] = after.status_code == 200
        finally:
            _util.stop_process(proc)
    report["targets"] = [
        {"check": "failures", "value": len(report["failures"]), "met": not report["failures"]},
        {"check": "served after", "value": report["served_after"],
         "met": report["served_after"]},
    ]  # fmt: skip
    setup = {"model": args.model or "random Llama", "examples": args.examples,
             "api_key": bool(args.api_key), "seed": args.seed}  # fmt: skip
    return {"machine": _util.machine(), "setup": setup, **report}


def table(report: dict) -> list[list[str]]:
    codes = " ".join(f"{k}:{v}" for k, v in sorted(report["statuses"].items()))
    rows = [["requests", f"{report['requests']} in {report['seconds']:.0f} s"], ["statuses", codes]]
    rows += [[f"{f['operation']} {f['check']} ({f['status']})", f["replay"][:300]]
             for f in report["failures"][:20]]  # fmt: skip
    rows += [[t["check"], f"{t['value']} ({_util.verdict(t)})"] for t in report["targets"]]
    return rows


def main(argv=None) -> int:
    from selfattn.models.bundled import default_threads

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", metavar="PATH", help="a model folder or GGUF (default: random)")
    p.add_argument("--examples", type=int, default=EXAMPLES, help="per route (500)")
    p.add_argument("--api-key", help="serve with this key and send it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--quick", action="store_true", help="10 examples a route")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.examples = 10
    report = run(args)
    m = report["machine"]
    _util.print_report(report, args.json, ["what", "value"], table,
                       f"schema fuzz ({m['cpu']}, {m['date']})")  # fmt: skip
    return 0 if all(t["met"] for t in report["targets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
