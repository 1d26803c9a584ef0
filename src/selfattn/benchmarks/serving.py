"""Serving many requests on CPU: selfattn's Engine against transformers, same weights and threads.

    .venv/bin/python benchmarks/serving.py             # the issue's workloads (tens of minutes)
    .venv/bin/python benchmarks/serving.py --quick     # a tiny model and workload: seconds
    .venv/bin/python benchmarks/serving.py --json --only a --repeat 1
    python -m selfattn.benchmarks.serving --quick      # the same code, from an installed wheel

Model: a Llama-shaped random fp32 model (4 layers, d=512, 8 heads of 64, d_ff 1376, vocabulary
32,000) built in transformers, saved with ``save_pretrained`` and loaded by
``selfattn.models.from_pretrained``. Greedy decoding everywhere.

Workloads:
  (a) 64 requests: one shared 256-token system prompt + 32 own tokens, 64 new tokens each, all
      submitted at once;
  (b) the same requests arriving as a Poisson process (``--rate`` requests/s): static batching
      must wait for the last arrival, one-by-one serves them in arrival order;
  (c) 32 requests of 16-1,024 prompt tokens (log-uniform), no shared prefix, 64 new tokens.

Rows: ``engine`` (:class:`selfattn.serving.Engine`; on (a) also without prefix caching and with
an int8 pool), transformers ``generate`` request by request, transformers ``generate`` of all
prompts in one left-padded batch, transformers' continuous batching ``generate_batch``
(``paged|sdpa``; on (a) with its defaults, which size its cache and token budget from free
memory, as the issue's calibration ran it, and on (a) and (c) "sized" for the workload with our
token budget, 4x faster here), and ``selfattn.models.generate`` in one left-padded batch.
Methods of a workload run interleaved, ``--repeat`` rounds; the table shows the median round.
Columns: generated tokens/s over the wall time from the first submission to the last token,
time to first token and inter-token latency p50/p99 (from each request's arrival), prefill tokens
the model computed (engine: counted; peers: their padded or full prompts), KV bytes (engine: the
most pages in use × page bytes, and the pool; peers: their caches at full length by the
textbook formula), and "agree": requests whose tokens equal the transformers one-batch run
(random weights make near-ties, so a late divergence is rounding, not a bug).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import random
import sys
import tempfile
import time
import warnings

import torch

from selfattn.benchmarks import _util

FULL = dict(
    model=dict(vocab_size=32000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=8, intermediate_size=1376, max_position_embeddings=2048),
    shared=256, own=32, new=64, n_a=64, n_c=32, c_lengths=(16, 1024), rate=8.0,
    kv_cache_bytes=1 << 30, max_batch_tokens=1024, max_num_seqs=64,
)  # fmt: skip
QUICK = dict(
    model=dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512),
    shared=32, own=8, new=8, n_a=8, n_c=6, c_lengths=(16, 64), rate=200.0,
    kv_cache_bytes=1 << 24, max_batch_tokens=128, max_num_seqs=8,
)  # fmt: skip
TARGETS = {  # (workload, row) -> (least engine / row tokens/s, what the issue asks)
    ("a", "transformers one batch"): 1.3,
    ("a", "transformers one by one"): 4.0,
    ("a", "transformers generate_batch"): 5.0,
    ("c", "transformers one batch"): 1.0,
}
PREFIX_TARGET = 0.2  # prefill tokens with prefix caching / without, at most
INT8_TARGET = 0.53  # int8 pool bytes / bf16 pool bytes at equal requests, at most


# -- the model and the workloads ------------------------------------------------------------------
def build_models(spec: dict):
    """(transformers LlamaForCausalLM, our Llama) with the same random fp32 weights."""
    import transformers

    from selfattn.models import from_pretrained

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        cfg = transformers.LlamaConfig(**spec["model"], bos_token_id=None, eos_token_id=None,
                                       pad_token_id=0, attn_implementation="sdpa")  # fmt: skip
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        folder = tempfile.mkdtemp(prefix="selfattn-serving-")
        hf.save_pretrained(folder, safe_serialization=True)
    return hf, from_pretrained(folder).eval()


def workloads(spec: dict, seed: int = 0) -> dict:
    """name -> (prompts, arrival times in seconds from the start)."""
    g = random.Random(seed)
    V = spec["model"]["vocab_size"]
    system = [g.randrange(1, V) for _ in range(spec["shared"])]
    a = [system + [g.randrange(1, V) for _ in range(spec["own"])] for _ in range(spec["n_a"])]
    t, arrivals = 0.0, []
    for _ in a:
        arrivals.append(t)
        t += g.expovariate(spec["rate"])
    lo, hi = spec["c_lengths"]
    c = []
    for _ in range(spec["n_c"]):
        n = round(math.exp(g.uniform(math.log(lo), math.log(hi))))
        c.append([g.randrange(1, V) for _ in range(n)])
    return {"a": (a, [0.0] * len(a)), "b": (a, arrivals), "c": (c, [0.0] * len(c))}


# -- one run of each method -> a result dict -------------------------------------------------------
def _result(outputs, first, times, wall, prefill, kv_bytes, pool_bytes=None) -> dict:
    """``outputs`` token lists; ``first[i]`` TTFT; ``times[i]`` token times of request i."""
    itl = [b - a for ts in times for a, b in itertools.pairwise(ts)]
    n = sum(len(o) for o in outputs)
    return dict(
        outputs=outputs, tokens=n, wall_s=wall, tok_s=n / wall,
        ttft_p50=_util_pct(first, 50), ttft_p99=_util_pct(first, 99),
        itl_p50=_util_pct(itl, 50), itl_p99=_util_pct(itl, 99),
        prefill=prefill, kv_bytes=kv_bytes, pool_bytes=pool_bytes,
    )  # fmt: skip


def _util_pct(xs, q):
    from selfattn.serving.metrics import percentile

    return percentile(xs, q)


def _wait_until(t0: float, at: float) -> None:
    delay = t0 + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_engine(model, spec, prompts, arrivals, new, **engine_kw) -> dict:
    from selfattn.serving import Engine, SamplingParams

    kw = dict(kv_cache_bytes=spec["kv_cache_bytes"], max_batch_tokens=spec["max_batch_tokens"],
              max_num_seqs=spec["max_num_seqs"], max_waiting=len(prompts))  # fmt: skip
    engine = Engine(model, **{**kw, **engine_kw})
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    rid, times, finals = {}, {}, {}
    t0 = time.perf_counter()
    while order or engine.has_unfinished():
        now = time.perf_counter() - t0
        while order and arrivals[order[0]] <= now:
            i = order.pop(0)
            rid[engine.add_request(prompts[i], params)] = i
        if not engine.has_unfinished():
            _wait_until(t0, arrivals[order[0]])
            continue
        for out in engine.step():
            stamp = time.perf_counter() - t0
            i = rid[out.request_id]
            times.setdefault(i, []).extend([stamp] * len(out.outputs[0].delta_token_ids))
            if out.finished:
                finals[i] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    m = engine.metrics
    page = engine.kv.nbytes // engine.kv.num_pages
    first = [times[i][0] - arrivals[i] for i in range(len(prompts))]
    return _result([finals[i] for i in range(len(prompts))], first,
                   [times[i] for i in range(len(prompts))], wall, m.prefill_tokens,
                   m.peak_pages_used * page, engine.kv.nbytes)  # fmt: skip


class _Stamps:
    """A transformers streamer that records when each step's tokens came out."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:  # generate() streams the prompt first
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _left_padded(prompts):
    S = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), S, dtype=torch.long)
    mask = torch.zeros(len(prompts), S, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, S - len(p) :] = torch.tensor(p)
        mask[b, S - len(p) :] = 1
    return ids, mask


def _cache_bytes(model, tokens: int) -> int:
    from selfattn.cache import kv_cache_bytes

    c = model.config
    return kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, tokens, "fp32")


def run_hf_batch(hf, ours, prompts, arrivals, new) -> dict:
    """transformers generate(), all prompts in one left-padded batch, after the last arrival."""
    ids, mask = _left_padded(prompts)
    t0 = time.perf_counter()
    _wait_until(t0, max(arrivals))
    stamps = _Stamps()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, streamer=stamps)  # fmt: skip
    wall = time.perf_counter() - t0
    ts = [t - t0 for t in stamps.times]
    return _result([r.tolist() for r in out[:, ids.shape[1] :]], [ts[0] - a for a in arrivals],
                   [ts] * len(prompts), wall, ids.numel(),
                   _cache_bytes(ours, ids.numel() + len(prompts) * new))  # fmt: skip


def run_ours_batch(hf, ours, prompts, arrivals, new) -> dict:
    """selfattn.models.generate, all prompts in one left-padded batch, after the last arrival."""
    from selfattn.models import generate

    ids, mask = _left_padded(prompts)
    t0 = time.perf_counter()
    _wait_until(t0, max(arrivals))
    times = []
    out = generate(ours, ids, new, attention_mask=mask,
                   streamer=lambda tok: times.append(time.perf_counter() - t0))  # fmt: skip
    wall = time.perf_counter() - t0
    return _result([r.tolist() for r in out[:, ids.shape[1] :]], [times[0] - a for a in arrivals],
                   [times] * len(prompts), wall, ids.numel(),
                   _cache_bytes(ours, ids.numel() + len(prompts) * new))  # fmt: skip


def run_hf_one_by_one(hf, ours, prompts, arrivals, new) -> dict:
    """transformers generate() per request, in arrival order (each waits for the one before)."""
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    outs, first, times = {}, {}, {}
    t0 = time.perf_counter()
    for i in order:
        _wait_until(t0, arrivals[i])
        stamps = _Stamps()
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompts[i]]), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, streamer=stamps)  # fmt: skip
        outs[i] = out[0, len(prompts[i]) :].tolist()
        times[i] = [t - t0 for t in stamps.times]
        first[i] = times[i][0] - arrivals[i]
    wall = time.perf_counter() - t0
    n = range(len(prompts))
    biggest = max(len(p) for p in prompts) + new
    return _result([outs[i] for i in n], [first[i] for i in n], [times[i] for i in n], wall,
                   sum(len(p) for p in prompts), _cache_bytes(ours, biggest))  # fmt: skip


def run_hf_generate_batch(hf, ours, prompts, arrivals, new, max_batch_tokens=None) -> dict:
    """transformers' continuous batching (generate_batch, paged|sdpa), all submitted at once;
    with ``max_batch_tokens``, its cache sized for the workload and that token budget (ours)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    cb = None  # its defaults: the cache and token budget sized from free memory
    if max_batch_tokens is not None:  # 16 requests of (a), 32 tokens: 21-58 tok/s -> 205
        page = 256  # its default page_size
        blocks = sum(-(-(len(p) + new) // page) for p in prompts) + len(prompts)
        cb = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max_batch_tokens)
    hf.set_attn_implementation("paged|sdpa")
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            res = hf.generate_batch(prompts, generation_config=cfg, continuous_batching_config=cb,
                                    record_timestamps=True, progress_bar=False)  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        hf.set_attn_implementation("sdpa")
    outs = list(res.values())
    tokens = [o.generated_tokens for o in outs]
    times = [[t - t0 for t in (o.timestamps or [])] for o in outs]
    if len(outs) != len(prompts) or any(len(t) != new for t in tokens):
        raise RuntimeError(f"generate_batch returned {len(outs)} of {len(prompts)} requests")
    first = [ts[0] for ts in times]
    return _result(tokens, first, times, wall, None, None)


# -- the report ------------------------------------------------------------------------------------
def _fmt_ms(s):
    return "-" if s is None or s != s else f"{1e3 * s:.0f}"


def _fmt_bytes(n):
    from selfattn.cache import format_bytes

    return "-" if n is None else format_bytes(int(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and workloads (seconds)")
    ap.add_argument("--only", default="abc", help="workloads to run, e.g. 'a' or 'ac'")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds per workload")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip", default="", help="comma-separated rows to leave out")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)  # every compared run uses the same threads
    spec = QUICK if args.quick else FULL
    hf, ours = build_models(spec)
    loads = workloads(spec)
    new = spec["new"]
    methods = {
        "engine": lambda p, a: run_engine(ours, spec, p, a, new),
        "engine (no prefix caching)": lambda p, a: run_engine(ours, spec, p, a, new,
                                                             prefix_caching=False),
        "engine (int8 KV)": lambda p, a: run_engine(ours, spec, p, a, new, kv_dtype=torch.int8),
        "transformers one by one": lambda p, a: run_hf_one_by_one(hf, ours, p, a, new),
        "transformers one batch": lambda p, a: run_hf_batch(hf, ours, p, a, new),
        "transformers generate_batch": lambda p, a: run_hf_generate_batch(hf, ours, p, a, new),
        "transformers generate_batch (sized)": lambda p, a: run_hf_generate_batch(
            hf, ours, p, a, new, spec["max_batch_tokens"]),
        "selfattn generate one batch": lambda p, a: run_ours_batch(hf, ours, p, a, new),
    }  # fmt: skip
    per_load = {
        "a": list(methods),
        "b": ["engine", "transformers one by one", "transformers one batch"],
        "c": ["engine", "transformers one batch", "transformers generate_batch (sized)",
              "selfattn generate one batch", "transformers one by one"],
    }  # fmt: skip
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report = {"machine": _util.machine(), "spec": {k: v for k, v in spec.items()}, "rows": []}
    for name in args.only:
        prompts, arrivals = loads[name]
        rows = [m for m in per_load[name] if m not in skip]
        rounds: dict[str, list[dict]] = {m: [] for m in rows}
        for m in rows:  # untimed: builds the C kernel, warms the allocators and thread pools
            with contextlib.suppress(Exception):  # a failing method: the timed rounds report it
                methods[m](prompts[:2], [0.0, 0.0])
        for _ in range(args.repeat):
            for m in rows:  # interleaved: drifting load hits every method alike
                try:
                    rounds[m].append(methods[m](prompts, arrivals))
                except Exception as e:  # a peer that fails is reported, not fatal
                    rounds[m].append({"error": f"{type(e).__name__}: {e}"})
        ref = _median(rounds.get("transformers one batch", []))
        for m in rows:
            r = _median(rounds[m])
            row = {"workload": name, "method": m, **{k: v for k, v in r.items() if k != "outputs"}}
            if ref and "outputs" in r and "outputs" in ref:
                row["agree"] = sum(x == y for x, y in zip(r["outputs"], ref["outputs"]))
                row["requests"] = len(prompts)
            report["rows"].append(row)
    _verdicts(report)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        _print(report)
    return 0


def _median(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0] if results else {}
    ok.sort(key=lambda r: r["tok_s"])
    return ok[len(ok) // 2]


def _verdicts(report: dict) -> None:
    """Ratios of the engine to each row, and the issue's targets, met or missed."""
    rows = {(r["workload"], r["method"]): r for r in report["rows"]}
    checks = []
    for (load, method), least in TARGETS.items():
        eng, peer = rows.get((load, "engine")), rows.get((load, method))
        if eng and peer and "tok_s" in eng and "tok_s" in peer:
            ratio = eng["tok_s"] / peer["tok_s"]
            checks.append((f"({load}) engine / {method}, tokens/s", ratio, f">= {least}",
                           ratio >= least))  # fmt: skip
    on, off = rows.get(("a", "engine")), rows.get(("a", "engine (no prefix caching)"))
    if on and off and on.get("prefill") and off.get("prefill"):
        ratio = on["prefill"] / off["prefill"]
        checks.append(("(a) prefill tokens, prefix caching / none", ratio,
                       f"<= {PREFIX_TARGET}", ratio <= PREFIX_TARGET))  # fmt: skip
    q = rows.get(("a", "engine (int8 KV)"))
    if q and on and q.get("kv_bytes") and on.get("kv_bytes"):
        # bf16 holds 2 bytes a value where the fp32 run's pages hold 4
        ratio = q["kv_bytes"] / (on["kv_bytes"] / 2)
        checks.append(("(a) int8 KV bytes / bf16 KV bytes, equal requests", ratio,
                       f"<= {INT8_TARGET}", ratio <= INT8_TARGET))  # fmt: skip
    report["checks"] = [dict(check=c, value=v, target=t, met=m) for c, v, t, m in checks]
    for r in report["rows"]:
        eng = rows.get((r["workload"], "engine"))
        if eng and "tok_s" in r and "tok_s" in eng:
            r["engine_ratio"] = eng["tok_s"] / r["tok_s"]


def _print(report: dict) -> None:
    m = report["machine"]
    print(f"# {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch "
          f"{m['torch']}, {m['date']}")  # fmt: skip
    cols = ["load", "method", "tok/s", "engine ×", "TTFT p50/p99 ms", "ITL p50/p99 ms",
            "prefill tok", "KV bytes (pool)", "agree"]  # fmt: skip
    rows = []
    for r in report["rows"]:
        if "error" in r:
            rows.append([r["workload"], r["method"], "failed: " + r["error"][:60]] + [""] * 6)
            continue
        pool = f" ({_fmt_bytes(r['pool_bytes'])})" if r.get("pool_bytes") else ""
        rows.append([
            r["workload"], r["method"], f"{r['tok_s']:.0f}",
            f"{r['engine_ratio']:.2f}" if "engine_ratio" in r else "-",
            f"{_fmt_ms(r['ttft_p50'])}/{_fmt_ms(r['ttft_p99'])}",
            f"{_fmt_ms(r['itl_p50'])}/{_fmt_ms(r['itl_p99'])}",
            "-" if r["prefill"] is None else str(r["prefill"]),
            _fmt_bytes(r["kv_bytes"]) + pool,
            f"{r['agree']}/{r['requests']}" if "agree" in r else "-",
        ])  # fmt: skip
    _util.print_table(cols, rows, title="serving")
    for c in report["checks"]:
        print(f"{c['check']}: {c['value']:.2f} (target {c['target']}) "
              f"{'met' if c['met'] else 'MISSED'}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
