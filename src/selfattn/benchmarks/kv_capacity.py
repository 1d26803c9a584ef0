"""KV compression's capacity: requests running at once and tokens/s of the Engine on a pool
sized for ``N`` uncompressed long requests, without compression and with it.

    python -m selfattn.benchmarks.kv_capacity                      # SmolLM2, 2k prompts, N = 8
    python -m selfattn.benchmarks.kv_capacity --policies snapkv:0.75,knorm:0.75 --n 4
    python -m selfattn.benchmarks.kv_capacity --quick --json       # tiny model: a smoke run
    python -m selfattn.benchmarks.kv_capacity --length 512 --max-tokens 1536 \
        --policies "tova:0.75,decode_budget=448;observed_attention:0.75,decode_budget=448"

Workload: ``4N`` pass-key prompts of ``--length`` tokens (:mod:`selfattn.benchmarks.
kv_compression`'s task: context and question in one prompt, which is what a server's policy
compresses), ``--max-tokens`` greedy tokens each (``ignore_eos``), all queued at once. Pool:
exactly ``N`` requests' pages, ``N × ceil((length + max_tokens) / page_size)`` pages; prefix
caching off (the prompts share a template head and filler, whose sharing would add capacity
that is not compression's). Long outputs (the third command) are decode-time eviction's case:
a 512-token prompt kept at a quarter, then cut back to 448 tokens each 64 generated, so a
request never holds more than a quarter of its 2,048 tokens' pages. Each configuration runs in
a fresh Engine over the same model: ``none`` first, then each ``POLICY:RATIO``.

Per configuration: the peak and the mean number of requests running at once (sampled each
step), the most pages one request held (against the uncompressed request's), the generated
tokens per second of wall time (prefill included: with 2k prompts on a CPU the 4N prompts'
prefill, the same work in both runs, is most of it), the same over the steps that ran decode
tokens only (where the larger batch pays), preemptions, pages saved, and the pass-key accuracy
(whether the compressed answers still find the key). Targets, at 4x compression (ratio 0.75):
peak running >= 3N and tokens/s (wall, prefill included) >= 2x the uncompressed run's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from selfattn.benchmarks import _util
from selfattn.benchmarks.kv_compression import make_samples, tiny_model

POLICIES = ("snapkv:0.75",)
TARGET_CONCURRENCY = 3  # peak running >= 3N at 4x
TARGET_SPEEDUP = 2.0  # tokens/s >= 2x the uncompressed run at 4x


def run_config(model, tokenizer, prompts, answers, spec, pool_bytes, args) -> dict:
    """One configuration (``spec`` "POLICY:RATIO" or None) in a fresh Engine: its row."""
    from selfattn.serving import Engine, SamplingParams

    engine = Engine(model, tokenizer, kv_cache_bytes=pool_bytes, prefix_caching=False,
                    page_size=args.page_size,
                    max_model_len=args.length + args.max_tokens)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            kv_compression=spec or "none")  # fmt: skip
    ids = [engine.add_request(p, params) for p in prompts]
    finals, running, held, t0 = {}, [], 0, time.perf_counter()
    m = engine.metrics
    decode_s = decode_tokens = 0.0  # steps that ran decode tokens only
    while engine.has_unfinished():
        before, made, s0 = m.prefill_tokens, m.generated_tokens, time.perf_counter()
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if m.prefill_tokens == before:
            decode_s += time.perf_counter() - s0
            decode_tokens += m.generated_tokens - made
        running.append(len(engine.scheduler.running))
        kv_ids = [q.kv_id for q in engine.scheduler.running if q.kv_id is not None]
        held = max([held, *(len(engine.kv.pages(i)) for i in kv_ids)])
    wall = time.perf_counter() - t0
    texts = [finals[r].outputs[0].text for r in ids]
    right = sum(a in t for a, t in zip(answers, texts))
    busy = [r for r in running if r]
    return {"policy": spec or "none", "requests": len(prompts),
            "pool_pages": engine.kv.num_pages, "peak_running": max(running, default=0),
            "mean_running": sum(busy) / max(1, len(busy)), "steps": len(running),
            "peak_pages_per_request": held,
            "seconds": wall, "generated_tokens": m.generated_tokens,
            "tokens_per_s": m.generated_tokens / wall, "preemptions": m.preemptions,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
            "pages_saved": m.kv_pages_saved + m.kv_decode_pages_freed,
            "evicted_tokens": m.kv_evicted_tokens + m.kv_decode_evicted_tokens,
            "passkey_correct": right}  # fmt: skip


def policies(text: str) -> list[str]:
    """``--policies``' specs: separated by ``;``, or by ``,`` where a piece is no ``key=value``
    knob of the spec before it (``"snapkv:0.75,knorm:0.75"``, ``"tova:0.75,decode_budget=448"``)."""
    out: list[str] = []
    for part in (p.strip() for chunk in text.split(";") for p in chunk.split(",")):
        if "=" in part and out:
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out


def targets(rows: list[dict], n: int) -> list[dict]:
    """Each 4x row against the uncompressed one: concurrency and tokens/s."""
    base = next((r for r in rows if r["policy"] == "none"), None)
    out = []
    for r in rows:
        ratio = r["policy"].partition(":")[2].partition(",")[0]  # "tova:0.75,decode_budget=N"
        if base is None or r is base or not ratio or float(ratio) != 0.75:
            continue
        speedup = r["tokens_per_s"] / base["tokens_per_s"]
        out.append({"policy": r["policy"], "peak_running": r["peak_running"],
                    "target_running": TARGET_CONCURRENCY * n, "speedup": speedup,
                    "target_speedup": TARGET_SPEEDUP,
                    "met": r["peak_running"] >= TARGET_CONCURRENCY * n
                    and speedup >= TARGET_SPEEDUP})  # fmt: skip
    return out


def run(args) -> dict:
    from selfattn.cache import kv_cache_bytes
    from selfattn.models import from_pretrained, load_tokenizer
    from selfattn.models.bundled import chat_model_path

    torch.set_num_threads(args.threads)
    path = args.model or str(chat_model_path())
    tokenizer = load_tokenizer(path)
    if args.quick:
        model = tiny_model(tokenizer.vocab_size)
    else:  # as selfattn serve loads it: kept quantised, or dequantised with --dense
        model = from_pretrained(path, progress=False, quantized=not args.dense)
    model.eval()
    samples = make_samples(tokenizer, "passkey", args.length, 4 * args.n, args.seed)
    prompts = [s.context + s.question for s in samples]
    c = model.config
    pages = -(-(args.length + args.max_tokens) // args.page_size)
    dtype = model.norm.weight.dtype
    page_bytes = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, args.page_size, dtype)
    pool = args.n * pages * page_bytes
    report = {"machine": _util.machine(), "setup": {
        "model": "tiny random (--quick)" if args.quick else path, "n": args.n,
        "weights": "dense" if args.dense else "kept quantised",
        "requests": len(prompts), "length": args.length, "max_tokens": args.max_tokens,
        "page_size": args.page_size, "kv_dtype": str(dtype), "pool_bytes": pool,
        "threads": args.threads}, "rows": []}  # fmt: skip
    with torch.inference_mode():
        for spec in [None, *args.policies]:
            row = run_config(model, tokenizer, prompts, [s.answer for s in samples], spec, pool,
                             args)  # fmt: skip
            report["rows"].append(row)
            print(f"{row['policy']}: peak {row['peak_running']} running, "
                  f"{row['tokens_per_s']:.1f} tok/s, {row['seconds']:.0f} s",
                  file=sys.stderr)  # fmt: skip
    report["targets"] = targets(report["rows"], args.n)
    return report


def table(report: dict) -> list[list[str]]:
    base = report["rows"][0]["tokens_per_s"] if report["rows"] else 0.0
    met = {t["policy"]: _util.verdict(t) for t in report["targets"]}
    return [[r["policy"], str(r["peak_running"]), f"{r['mean_running']:.1f}",
             f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base:.2f}x" if base else "-",
             f"{r['decode_tokens_per_s']:.1f}", str(r["peak_pages_per_request"]),
             str(r["preemptions"]), str(r["pages_saved"]),
             f"{r['passkey_correct']}/{r['requests']}", met.get(r["policy"], "-")]
            for r in report["rows"]]  # fmt: skip


COLUMNS = ["policy", "peak running", "mean running", "tok/s", "vs none", "decode-step tok/s",
           "pages a request held", "preemptions",
           "pages saved", "passkey", "target"]  # fmt: skip


def main(argv=None) -> int:
    from selfattn.models.bundled import default_threads

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", metavar="FILE", help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--n", type=int, default=8, help="uncompressed requests the pool holds (8)")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens (2048)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated each (256)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="POLICY:RATIO[,decode_budget=N],... run after the uncompressed "
                        "one, ';' between specs with knobs (default snapkv:0.75)")  # fmt: skip
    p.add_argument("--dense", action="store_true",
                   help="dequantise the GGUF's weights (default: kept quantised, "
                        "as served)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--quick", action="store_true",
                   help="a tiny random model, N = 2, 256-token prompts: a smoke run")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    args.policies = policies(args.policies)
    if args.quick:
        args.n, args.length, args.max_tokens, args.threads = 2, 256, 8, 1
        args.policies = ["knorm:0.75"]
    report = run(args)
    m = report["machine"]
    _util.print_report(report, args.json, COLUMNS, table,
                       f"KV compression capacity ({m['cpu']}, {m['date']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
