"""Soak: thousands of mixed requests against ``selfattn serve``, then the books checked.

    python -m selfattn.benchmarks.soak                       # 2,000 requests, 64 at once
    python -m selfattn.benchmarks.soak --requests 5000 --concurrency 128
    python -m selfattn.benchmarks.soak --quick --json        # 80 requests, 16 at once

Server: ``selfattn serve`` in its own process over a random Llama (2 layers, d=64, a WordLevel
tokenizer over ``t0 .. t999`` and a chat template; :mod:`selfattn.benchmarks.serving_http`'s
checkpoint) or ``--model``, in float32, with a KV pool small enough that the running requests
outgrow it (``--kv-cache-bytes``, default 48 pages of the default model: preemption and
recompute happen throughout). Extra server flags go through ``--server-arg``.

Requests, drawn from ``--seed``: completions and chat, streaming or not, greedy or sampled
(temperature, top-p, top-k, a seed), ``n`` of 1-3, stop strings, logprobs, prompts of 1-112
tokens (half of them after one of four shared prefixes), 1-24 new tokens; 5 % of the streaming
ones hang up after their first chunk (a client that disconnects: the request is aborted and its
pages freed). ``--concurrency`` requests are in flight at once.

Checks (each a count in the report; the targets are zero or within bounds):

- lost / duplicated: every request not hung up on ends exactly once (one JSON body, or one
  ``[DONE]`` with one finish reason per choice); errors by kind (status code, exception).
- greedy: every completed greedy request is sent again alone after the soak (one at a time,
  non-streaming) and its text must equal what it got under load.
- leaked pages: after the drain ``/metrics`` must show no request running or waiting and every
  used page held by the prefix cache alone.
- memory: the server's RSS sampled every 100 completed requests; its growth from request 500
  to the last must stay within 5 %.
- latency: p50/p99 time to first token and inter-token latency of the streaming requests.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import random
import tempfile
import time
from pathlib import Path

from selfattn.benchmarks import _util

FULL = dict(requests=2000, concurrency=64)
QUICK = dict(requests=80, concurrency=16)
MODEL = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512)  # fmt: skip
# the default model's pages: 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes x 16 tokens;
# 48 of them hold ~10 requests of the mix: 16 at once preempt, 64 at once preempt throughout
DEFAULT_POOL = 48 * 2 * 2 * 2 * 16 * 4 * 16
TEMPLATE = "{% for m in messages %}t1 {{ m['content'] }} {% endfor %}t2"
NAME = "soak"
RSS_FROM = 500  # the growth is measured from this completed request to the last
TARGET_RSS_GROWTH = 0.05
REQUEST_TIMEOUT_S = 300


def save_model(folder: Path) -> None:
    """The default model: serving_http's random Llama and WordLevel tokenizer, a chat template."""
    from selfattn.benchmarks.serving_http import save_checkpoint

    save_checkpoint({"model": MODEL}, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)


def make_requests(n: int, vocab: int, seed: int) -> list[dict]:
    """``n`` request plans: ``{"endpoint", "body", "stream", "hang_up", "greedy"}``."""
    g = random.Random(seed)
    shared = [[g.randrange(3, vocab) for _ in range(g.randint(16, 48))] for _ in range(4)]
    out = []
    for _ in range(n):
        ids = (g.choice(shared) if g.random() < 0.5 else []) + [
            g.randrange(3, vocab) for _ in range(g.randint(1, 64))
        ]
        text = " ".join(f"t{i}" for i in ids)
        chat = g.random() < 0.4
        greedy = g.random() < 0.5
        body: dict = {"model": NAME, "max_tokens": g.randint(1, 24)}
        if greedy:
            body["temperature"] = 0.0
        else:
            body |= {"temperature": round(g.uniform(0.3, 1.5), 2), "seed": g.randrange(2**31),
                     "top_p": round(g.uniform(0.5, 1.0), 2)}  # fmt: skip
            if g.random() < 0.3:
                body["top_k"] = g.randint(1, 50)
        if g.random() < 0.3:
            body["n"] = g.choice([2, 3])
        if g.random() < 0.2:
            body["stop"] = [f"t{g.randrange(3, vocab)}"]
        if g.random() < 0.2:
            body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        stream = g.random() < 0.5
        out.append({"endpoint": "chat/completions" if chat else "completions", "body": body,
                    "stream": stream, "hang_up": stream and g.random() < 0.05,
                    "greedy": greedy})  # fmt: skip
    return out


def _choice_text(choice: dict, chat: bool, delta: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("delta" if delta else "message") or {}
    return part.get("content") or ""


async def one_request(client, plan: dict) -> dict:
    """Send one planned request; what came back: kind (ok, hung_up, error), the texts per
    choice, how each choice ended, and the streaming chunk times."""
    chat = plan["endpoint"].startswith("chat")
    body = {**plan["body"], "stream": plan["stream"]}
    url = f"/v1/{plan['endpoint']}"
    t0 = time.perf_counter()
    n = body.get("n", 1)
    texts, finishes = [""] * n, [[] for _ in range(n)]
    if not plan["stream"]:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            return {"kind": "error", "error": f"HTTP {r.status_code}", "t0": t0}
        for c in r.json()["choices"]:
            texts[c["index"]] = _choice_text(c, chat, False)
            finishes[c["index"]].append(c.get("finish_reason"))
        return {"kind": "ok", "texts": texts, "finishes": finishes, "t0": t0, "stamps": []}
    stamps, done = [], 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"kind": "error", "error": f"HTTP {r.status_code}", "t0": t0}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done += 1
                continue
            event = json.loads(data)
            if "error" in event:
                return {"kind": "error", "error": f"stream error: {event['error'].get('type')}",
                        "t0": t0}  # fmt: skip
            for c in event.get("choices", []):
                piece = _choice_text(c, chat, True)
                if piece:
                    texts[c["index"]] += piece
                    stamps.append(time.perf_counter())
                if c.get("finish_reason"):
                    finishes[c["index"]].append(c["finish_reason"])
            if plan["hang_up"] and stamps:
                return {"kind": "hung_up", "t0": t0}
    return {"kind": "ok", "texts": texts, "finishes": finishes, "t0": t0, "stamps": stamps,
            "done_events": done}  # fmt: skip


def server_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def soak(base_url: str, plans: list[dict], concurrency: int, pid: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[dict | None] = [None] * len(plans)
    rss: list[tuple[int, float]] = []
    gate = asyncio.Semaphore(concurrency)
    finished = itertools.count(1)

    async def run(i: int, client) -> None:
        async with gate:
            try:
                results[i] = await one_request(client, plans[i])
            except Exception as e:  # a transport failure is counted, never raised
                results[i] = {"kind": "error", "error": type(e).__name__}
        k = next(finished)
        if k % 100 == 0 or k == len(plans):
            mib = server_rss_mib(pid)
            if mib is not None:
                rss.append((k, mib))

    async with httpx.AsyncClient(base_url=base_url, limits=limits,
                                 timeout=REQUEST_TIMEOUT_S) as client:  # fmt: skip
        t0 = time.perf_counter()
        await asyncio.gather(*(run(i, client) for i in range(len(plans))))
        wall = time.perf_counter() - t0
    return {"results": results, "rss": rss, "wall_s": wall}


async def alone(base_url: str, plans: list[dict]) -> list[list[str]]:
    """Each plan's texts when it is the only request in the server."""
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        for plan in plans:
            r = await one_request(client, {**plan, "stream": False, "hang_up": False})
            out.append(r.get("texts"))
    return out


def metrics_after(base_url: str) -> dict[str, float]:
    """The server's unlabelled-by-policy gauges and counters, by short name."""
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("selfattn_") and "policy=" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("selfattn_")] = float(value)
    return out


def check(plans: list[dict], run: dict, again: dict[int, list[str]], after: dict) -> dict:
    """The books: counts by kind, lost / duplicated, greedy mismatches, leaks, memory, latency."""
    from selfattn.serving.metrics import percentile

    results = run["results"]
    kinds = collections.Counter(r["kind"] for r in results)
    errors = collections.Counter(r["error"] for r in results if r["kind"] == "error")
    lost = duplicated = 0
    for plan, r in zip(plans, results):
        if r["kind"] != "ok":
            continue
        n = plan["body"].get("n", 1)
        ends = [len(f) for f in r["finishes"]]
        lost += sum(e == 0 for e in ends) + (plan["stream"] and r.get("done_events", 0) == 0)
        duplicated += sum(e > 1 for e in ends) + (plan["stream"] and r.get("done_events", 0) > 1)
        lost += len(ends) != n
    mismatched = [i for i, texts in again.items() if texts != results[i]["texts"]]
    streams = [r for r in results if r["kind"] == "ok" and r.get("stamps")]
    first = [r["stamps"][0] - r["t0"] for r in streams]
    gaps = [b - a for r in streams for a, b in itertools.pairwise(r["stamps"])]
    rss = run["rss"]
    start = next((m for k, m in rss if k >= RSS_FROM), None)
    growth = rss[-1][1] / start - 1 if start and rss else None
    leaked = int(after.get("kv_pages_used", 0) - after.get("kv_pages_cached", 0))
    return {
        "requests": len(plans), "kinds": dict(kinds), "errors": dict(errors), "lost": lost,
        "duplicated": duplicated, "greedy_checked": len(again), "greedy_mismatched": mismatched,
        "running_after": after.get("num_requests_running"),
        "waiting_after": after.get("num_requests_waiting"), "leaked_pages": leaked,
        "preemptions": int(after.get("preemptions_total", 0)),
        "aborted": int(after.get("requests_aborted_total", 0)), "rss_mib": rss,
        "rss_growth": growth,
        "wall_s": run["wall_s"], "requests_per_s": len(plans) / run["wall_s"],
        "ttft_p50": percentile(first, 50), "ttft_p99": percentile(first, 99),
        "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99),
    }  # fmt: skip


def targets(result: dict) -> list[dict]:
    rows = [(k, result[k] if not isinstance(result[k], list) else len(result[k]), "== 0")
            for k in ("lost", "duplicated", "greedy_mismatched", "leaked_pages")]  # fmt: skip
    rows.append(("5xx", sum(v for k, v in result["errors"].items() if k.startswith("HTTP 5")),
                 "== 0"))  # fmt: skip
    out = [{"check": k, "value": v, "target": t, "met": v == 0} for k, v, t in rows]
    growth = result["rss_growth"]
    if growth is not None and result["requests"] >= 2 * RSS_FROM:
        out.append({"check": f"RSS growth from request {RSS_FROM}", "value": growth,
                    "target": f"<= {TARGET_RSS_GROWTH:.0%}",
                    "met": growth <= TARGET_RSS_GROWTH})  # fmt: skip
    return out


def start(folder: Path, args):
    """``selfattn serve`` of ``folder`` with the soak's pool and ``--server-arg`` flags;
    returns (process, base URL)."""
    flags = ["--dtype", "float32", "--kv-cache-bytes", str(args.kv_cache_bytes), *args.server_arg]
    return _util.start_server(folder, NAME, args.threads, flags)


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else Path(tmp) / "model"
        if not args.model:
            save_model(folder)
        from selfattn.models import load_tokenizer

        vocab = load_tokenizer(folder).vocab_size if args.model else MODEL["vocab_size"]
        plans = make_requests(args.requests, vocab, args.seed)
        proc, url = start(folder, args)
        try:
            loaded = asyncio.run(soak(url, plans, args.concurrency, proc.pid))
            greedy = [i for i, (p, r) in enumerate(zip(plans, loaded["results"]))
                      if p["greedy"] and r["kind"] == "ok"]  # fmt: skip
            texts = asyncio.run(alone(url, [plans[i] for i in greedy]))
            after = metrics_after(url)
        finally:
            _util.stop_process(proc)
    result = check(plans, loaded, dict(zip(greedy, texts)), after)
    setup = {"model": args.model or "random Llama (2 layers, d=64)", "requests": args.requests,
             "concurrency": args.concurrency, "kv_cache_bytes": args.kv_cache_bytes,
             "seed": args.seed, "threads": args.threads,
             "server_args": args.server_arg}  # fmt: skip
    return {"machine": _util.machine(), "setup": setup, "result": result,
            "targets": targets(result)}  # fmt: skip


def table(report: dict) -> list[list[str]]:
    r = report["result"]
    rows = [["requests", f"{r['requests']} ({r['requests_per_s']:.1f}/s)"],
            ["by kind", json.dumps(r["kinds"])], ["errors", json.dumps(r["errors"])],
            ["preemptions", str(r["preemptions"])], ["aborted (server)", str(r["aborted"])],
            ["greedy checked alone", str(r["greedy_checked"])],
            ["TTFT p50 / p99 ms", f"{r['ttft_p50'] * 1e3:.1f} / {r['ttft_p99'] * 1e3:.1f}"],
            ["ITL p50 / p99 ms", f"{r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.1f}"],
            ["RSS MiB (every 100)", " ".join(f"{m:.0f}" for _, m in r["rss_mib"])]]  # fmt: skip
    for t in report["targets"]:
        v = t["value"]
        shown = f"{v:.1%}" if isinstance(v, float) else str(v)
        rows.append([t["check"], f"{shown} ({t['target']}: {_util.verdict(t)})"])
    return rows


def main(argv=None) -> int:
    from selfattn.models.bundled import default_threads

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", metavar="PATH", help="a model folder or GGUF (default: random)")
    p.add_argument("--requests", type=int, default=FULL["requests"])
    p.add_argument("--concurrency", type=int, default=FULL["concurrency"])
    p.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_POOL,
                   help=f"the server's KV pool (default {DEFAULT_POOL}: 48 pages of the "
                        "default model)")  # fmt: skip
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for selfattn serve (repeat it)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=default_threads())
    quick = f"{QUICK['requests']} requests, {QUICK['concurrency']} at once"
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency = QUICK["requests"], QUICK["concurrency"]
    report = run(args)
    m = report["machine"]
    _util.print_report(report, args.json, ["check", "value"], table,
                       f"soak ({m['cpu']}, {m['date']})")  # fmt: skip
    met = all(t["met"] for t in report["targets"])
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
