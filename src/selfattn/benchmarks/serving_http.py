"""Serving through HTTP: concurrent streaming ``openai`` clients against ``selfattn serve``, and
the same requests through the offline engine (``Engine.generate``) in this process.

    python -m selfattn.benchmarks.serving_http            # the issue's workload (a minute or two)
    python -m selfattn.benchmarks.serving_http --quick    # a tiny model: seconds
    python -m selfattn.benchmarks.serving_http --json

Model: a Llama-shaped random fp32 model (4 layers, d=512, 8 heads of 64, d_ff 1376, vocabulary
32,000; ``--quick``: 2 layers, d=64) built in transformers and saved with ``save_pretrained``,
with a WordLevel tokenizer over its ids (``t0 t1 ...``), so that both sides tokenise and
detokenise as a real server does. Workload: 16 requests of one shared
256-token system prompt plus 32 own tokens, 32 new tokens each, greedy, all at once. Both sides
get the prompts as text (one word a token), as clients send them. ``--prompt ids`` sends
token-id lists, which the ``openai`` client converts element by element in Python: ~3 ms of its
CPU per 288-id prompt, ~50 ms before the last of 16 requests leaves it (0.4 ms as text).

Rows: the offline engine (all requests added, then stepped to the end, same engine settings)
and ``selfattn serve`` with one streaming ``AsyncOpenAI`` client per request, all concurrent;
each side in a fresh process of its own, same environment and torch threads. The clients are
made once and have their connections open before the clock starts (a ``GET /v1/models`` each,
as clients with keep-alive have them). Tokens/s is generated tokens over the wall time from the
first submission to the last token (HTTP: to the last ``[DONE]``), median of ``--repeat``
interleaved rounds after one warm-up round each.
Time to first token and inter-token latency p50/p99 as the client sees them. Tokens per CPU
second (Linux): each side's process CPU time (the server's: engine and HTTP, all threads),
the same work measured without the machine's other load (on a shared machine, wall time is
mostly that load). "agree": requests whose HTTP text equals the offline engine's. Target: HTTP
>= 0.85x the offline engine's tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from selfattn.benchmarks import _util

FULL = dict(
    model=dict(vocab_size=32000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=8, intermediate_size=1376, max_position_embeddings=2048),
    requests=16, shared=256, own=32, new=32,
    kv_cache_bytes=256 * 2**20, max_batch_tokens=1024, max_num_seqs=64,
)  # fmt: skip
QUICK = dict(
    model=dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512),
    requests=8, shared=32, own=8, new=8,
    kv_cache_bytes=2**24, max_batch_tokens=128, max_num_seqs=16,
)  # fmt: skip
TARGET = 0.85  # HTTP tokens/s / offline engine tokens/s, at least
START_TIMEOUT_S = 180  # the server process imports torch and loads the model
NAME = "bench"


def save_checkpoint(spec: dict, folder: Path) -> None:
    """A random Llama (transformers, save_pretrained) and a WordLevel tokenizer.json over its
    vocabulary (``t0 .. t{V-1}``, whitespace-split: one word per token, both ways)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        cfg = transformers.LlamaConfig(**spec["model"], bos_token_id=None, eos_token_id=None,
                                       pad_token_id=0)  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    V = spec["model"]["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.save(str(folder / "tokenizer.json"))


def prompts_for(spec: dict, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    V = spec["model"]["vocab_size"]
    system = [g.randrange(1, V) for _ in range(spec["shared"])]
    return [system + [g.randrange(1, V) for _ in range(spec["own"])]
            for _ in range(spec["requests"])]  # fmt: skip


def prompt_text(ids: list[int]) -> str:
    """The text that :func:`save_checkpoint`'s tokenizer encodes as ``ids``."""
    return " ".join(f"t{i}" for i in ids)


def engine_kwargs(spec: dict) -> dict:
    return {k: spec[k] for k in ("kv_cache_bytes", "max_batch_tokens", "max_num_seqs")}


# -- one round of each side -----------------------------------------------------------------------


def run_offline(engine, prompts, new: int) -> dict:
    from selfattn.serving import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {}
    rid_of: dict[str, int] = {}
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        rid_of[engine.add_request(p, params)] = i
    texts: dict[int, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            stamp = time.perf_counter() - t0
            times.setdefault(out.request_id, []).extend(
                [stamp] * len(out.outputs[0].delta_token_ids)
            )
            if out.finished:
                texts[rid_of[out.request_id]] = out.outputs[0].text
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    result = _result([texts[i] for i in range(len(prompts))], list(times.values()), wall,
                     tokens=len(prompts) * new)  # fmt: skip
    return {**result, "server_cpu_s": cpu}


async def _one_client(client, prompt, new: int, t0: float):
    stream = await client.completions.create(
        model=NAME, prompt=prompt, max_tokens=new, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, stamps, tokens = "", [], 0
    async for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.text
            stamps.append(now)
    return text, stamps, tokens


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run_http(base_url: str, prompts, new: int, server_pid: int) -> dict:
    from openai import AsyncOpenAI

    async def main():
        # One client per request, made before the clock starts (each loads TLS certificates:
        # tens of ms of set-up that is not serving), its connection open (a connection's
        # set-up is not serving either; clients with keep-alive reuse theirs).
        clients = [AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
                   for _ in prompts]  # fmt: skip
        try:
            await asyncio.gather(*(c.models.list() for c in clients))
            t0, cpu0 = time.perf_counter(), time.process_time()
            server0 = process_cpu_s(server_pid)
            outs = await asyncio.gather(
                *(_one_client(c, p, new, t0) for c, p in zip(clients, prompts))
            )
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            server = process_cpu_s(server_pid)
        finally:
            for c in clients:
                await c.close()
        return outs, wall, cpu, None if server is None else server - server0

    outs, wall, cpu, server_cpu = asyncio.run(main())
    result = _result([o[0] for o in outs], [o[1] for o in outs], wall,
                     tokens=sum(o[2] for o in outs))  # fmt: skip
    # CPU the server process (engine and HTTP) and the clients used while serving
    return {**result, "server_cpu_s": server_cpu, "client_cpu_s": cpu}


def _result(texts, stamps, wall: float, tokens: int) -> dict:
    from selfattn.serving.metrics import percentile

    first = [s[0] for s in stamps if s]
    gaps = [b - a for s in stamps for a, b in itertools.pairwise(s)]
    return dict(
        texts=texts, tokens=tokens, wall_s=wall, tok_s=tokens / wall,
        ttft_p50=percentile(first, 50), ttft_p99=percentile(first, 99),
        itl_p50=percentile(gaps, 50), itl_p99=percentile(gaps, 99),
    )  # fmt: skip


# -- the server process ---------------------------------------------------------------------------


def start_server(folder: Path, spec: dict, threads: int):
    """``selfattn serve`` of ``folder`` in its own process with ``threads`` torch threads;
    returns (process, base URL of its API)."""
    args = ["--dtype", "float32"]
    for k, v in engine_kwargs(spec).items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    proc, url = _util.start_server(folder, NAME, threads, args, timeout_s=START_TIMEOUT_S)
    return proc, f"{url}/v1"


# -- the report -----------------------------------------------------------------------------------


def offline_worker(folder: str, quick: bool, prompt: str) -> int:
    """The offline side in a process of its own, started like the server (same environment,
    nothing else loaded): one :func:`run_offline` round per line read, its result printed as
    one JSON line."""
    from selfattn.models import from_pretrained, load_tokenizer
    from selfattn.serving import Engine

    spec = QUICK if quick else FULL
    prompts = side_prompts(spec, prompt)
    engine = Engine(from_pretrained(folder, dtype="float32").eval(), load_tokenizer(folder),
                    **engine_kwargs(spec))  # fmt: skip
    for _ in sys.stdin:
        print(json.dumps(run_offline(engine, prompts, spec["new"])), flush=True)
    return 0


def side_prompts(spec: dict, kind: str) -> list:
    """Both sides' prompts: :func:`prompts_for` as text (``kind`` "text") or as ids ("ids")."""
    prompts = prompts_for(spec)
    return [prompt_text(p) for p in prompts] if kind == "text" else prompts


def run(args) -> dict:
    from selfattn.models import load_tokenizer

    spec = QUICK if args.quick else FULL
    prompts = side_prompts(spec, args.prompt)
    with tempfile.TemporaryDirectory(prefix="selfattn-serving-http-") as tmp:
        folder = Path(tmp)
        save_checkpoint(spec, folder)
        tokenizer = load_tokenizer(folder)
        if args.prompt == "text" and [tokenizer.encode(p) for p in prompts] != prompts_for(spec):
            raise RuntimeError("the tokenizer does not encode the prompts' text as their ids")
        argv = [sys.executable, "-m", "selfattn.benchmarks.serving_http", "--offline-worker",
                str(folder), "--prompt", args.prompt, *["--quick"] * args.quick]  # fmt: skip
        offline = subprocess.Popen(argv, env=_util.child_env(args.threads), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)  # fmt: skip
        proc, url = start_server(folder, spec, args.threads)

        def offline_round() -> dict:
            offline.stdin.write("run\n")
            offline.stdin.flush()
            line = offline.stdout.readline()
            if not line:
                raise RuntimeError("the offline engine's process ended early")
            return json.loads(line)

        try:
            offline_round()  # warm-ups: kernels, caches, connections
            run_http(url, prompts, spec["new"], proc.pid)
            rounds: dict[str, list[dict]] = {"offline": [], "http": []}
            for _ in range(args.repeat):
                rounds["offline"].append(offline_round())
                rounds["http"].append(run_http(url, prompts, spec["new"], proc.pid))
        finally:
            for p in (proc, offline):
                p.terminate()
                p.wait(timeout=60)
    med = {k: _median_round(v) for k, v in rounds.items()}
    agree = sum(a == b for a, b in zip(med["http"]["texts"], med["offline"]["texts"]))
    ratio = med["http"]["tok_s"] / med["offline"]["tok_s"]
    detail = {k: {f: v[f] for f in v if f != "texts"} for k, v in med.items()}
    rows = [{
        "case": f"{len(prompts)} concurrent streaming openai clients through selfattn serve, "
                "tokens/s",
        "ours": med["http"]["tok_s"], "peer": "offline engine (Engine.generate)",
        "peer_value": med["offline"]["tok_s"], "ratio": ratio, "target": f">= {TARGET}",
        "met": ratio >= TARGET, "agree": agree, "requests": len(prompts),
    }]  # fmt: skip
    cpu = {k: v["server_cpu_s"] for k, v in med.items()}
    if cpu["http"]:  # wall time on a loaded machine is others' load; CPU time is ours
        per_cpu = {k: med[k]["tokens"] / cpu[k] for k in cpu}
        rows.append({
            "case": "generated tokens per CPU second: selfattn serve's process (engine and HTTP)",
            "ours": per_cpu["http"], "peer": "offline engine's process",
            "peer_value": per_cpu["offline"], "ratio": per_cpu["http"] / per_cpu["offline"],
            "target": "report",
        })  # fmt: skip
    setup = {
        "model": "random Llama fp32, " + ", ".join(f"{k}={v}" for k, v in spec["model"].items()),
        "requests": len(prompts), "shared": spec["shared"], "own": spec["own"],
        "new": spec["new"], "engine": engine_kwargs(spec), "threads": args.threads,
        "repeat": args.repeat, "prompt": args.prompt,
    }  # fmt: skip
    return {"machine": _util.machine(), "setup": setup, "rows": rows, "detail": detail}


def _median_round(rounds: list[dict]) -> dict:
    mid = statistics.median_low([r["tok_s"] for r in rounds])
    return next(r for r in rounds if r["tok_s"] == mid)


def _table(report: dict) -> list[list[str]]:
    table = []
    for side, d in report["detail"].items():
        cpu = d["server_cpu_s"] or float("nan")
        table.append([side, f"{d['tok_s']:.1f}", f"{cpu:.2f}", f"{d['ttft_p50'] * 1e3:.0f}",
                      f"{d['ttft_p99'] * 1e3:.0f}", f"{d['itl_p50'] * 1e3:.1f}",
                      f"{d['itl_p99'] * 1e3:.1f}"])  # fmt: skip
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and workload: seconds")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds per side (3; quick 1)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of both sides (default: this process's; quick 1)",
    )
    p.add_argument(
        "--prompt",
        choices=("text", "ids"),
        default="text",
        help="send the prompts as text (default) or as token-id lists",
    )
    p.add_argument("--offline-worker", metavar="FOLDER", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.offline_worker:
        return offline_worker(args.offline_worker, args.quick, args.prompt)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.threads = args.threads or (1 if args.quick else torch.get_num_threads())
    torch.set_num_threads(args.threads)
    report = run(args)
    cols = ["side", "tokens/s", "CPU s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    _util.print_report(report, args.json, cols, _table, "Serving through HTTP")
    if args.json:
        return 0
    r = report["rows"][0]
    verdict = "met" if r["met"] else "missed"
    print(f"\nHTTP / offline tokens/s: {r['ratio']:.3f} (target {r['target']}: {verdict}); "
          f"agree {r['agree']}/{r['requests']}")  # fmt: skip
    for r in report["rows"][1:]:
        print(f"{r['case']}: {r['ours']:.1f} vs {r['peer']} {r['peer_value']:.1f} "
              f"({r['ratio']:.3f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
