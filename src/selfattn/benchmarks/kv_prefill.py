"""What the Engine holds per request while it prefills a prompt it will compress, and the time.

    python -m selfattn.benchmarks.kv_prefill                 # SmolLM2, 2,048 tokens, 512 a chunk
    python -m selfattn.benchmarks.kv_prefill --policies observed_attention:0.5 --tokens 4096
    python -m selfattn.benchmarks.kv_prefill --quick --json  # tiny model: a smoke run

One request of ``--tokens`` random prompt tokens on the bundled SmolLM2 (as ``selfattn serve``
loads it), compressed by each policy after its prefill in ``--chunk``-token chunks, one thread,
each policy in a process of its own (so that its peak RSS is its own). Per policy: the bytes of
the sequence's prefill record when the compression runs (what the policy observed of the prompt:
a window's layer inputs, or a statistic streamed per chunk; ``Sequence.observed``), the prefill
+ compression wall and CPU time (best of ``--repeat``; one thread, so CPU time is the work's,
steadier than wall time on a shared machine), and the peak RSS growth over the runs. ``none``
(no compression) is the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from selfattn.benchmarks import _util

POLICIES = ("none", "knorm:0.5", "snapkv:0.5", "observed_attention:0.5", "expected_attention:0.5")


def held_bytes(record) -> int:
    """Bytes of the tensors in a per-layer prefill record (tensors, or statistic objects)."""
    total = 0
    for item in record or ():
        tensors = [item] if isinstance(item, torch.Tensor) else vars(item).values()
        total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    return total


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(policy: str, args) -> dict:
    """One policy's row, in this process."""
    from selfattn.benchmarks.kv_compression import tiny_model
    from selfattn.models import bundled, from_pretrained, load_tokenizer
    from selfattn.serving import Engine, SamplingParams
    from selfattn.serving.kv_compression import PromptCompression

    torch.set_num_threads(1)
    path = bundled.chat_model_path()
    if args.quick:
        model = tiny_model(load_tokenizer(str(path)).vocab_size)
    else:
        model = from_pretrained(path, progress=False)
    engine = Engine(model, max_batch_tokens=args.chunk, prefix_caching=False)
    seen = []
    real = PromptCompression.compress

    def observing(self, seq):  # the record as the compression finds it
        seen.append(held_bytes(seq.observed))
        return real(self, seq)

    PromptCompression.compress = observing
    g = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, kv_compression=policy)
    engine.generate([torch.randint(0, vocab, (64,), generator=g).tolist()], params)  # warm-up
    base, before = rss_mib(), engine.metrics.kv_compressed_prompts
    walls, cpus = [], []
    for _ in range(args.repeat):
        prompt = torch.randint(0, vocab, (args.tokens,), generator=g).tolist()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.generate([prompt], params)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    compressed = engine.metrics.kv_compressed_prompts - before
    if policy != "none" and compressed != args.repeat:
        raise RuntimeError(f"{policy}: {compressed} of {args.repeat} prompts compressed")
    c, dtype = model.config, model.norm.weight.dtype  # the dtype of the layers' inputs
    return {"policy": policy, "held_bytes": seen[-1] if seen else 0,
            "prompt_x_d_model_bytes": args.tokens * c.d_model * c.n_layers * dtype.itemsize,
            "wall_s": min(walls), "cpu_s": min(cpus), "rss_growth_mib": max(0.0, peak - base),
            "dtype": str(dtype)}  # fmt: skip


def run(args) -> dict:
    rows = []
    for policy in args.policies:
        argv = [sys.executable, "-m", "selfattn.benchmarks.kv_prefill", "--one", policy,
                "--tokens", str(args.tokens), "--chunk", str(args.chunk), "--repeat",
                str(args.repeat), "--seed", str(args.seed)] + ["--quick"] * args.quick  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
        if done.returncode:
            raise SystemExit(f"{policy}: {done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout))
        print(f"{policy}: {rows[-1]['cpu_s']:.2f} s CPU", file=sys.stderr)
    return {"machine": _util.machine(), "setup": {"tokens": args.tokens, "chunk": args.chunk,
            "repeat": args.repeat, "threads": 1, "quick": args.quick}, "rows": rows}  # fmt: skip


def table(report: dict) -> list[list[str]]:
    base = next((r for r in report["rows"] if r["policy"] == "none"), None)
    return [[r["policy"], f"{r['held_bytes'] / 2**20:.2f} MiB",
             f"{r['prompt_x_d_model_bytes'] / 2**20:.1f} MiB", f"{r['wall_s']:.2f} s",
             f"{r['cpu_s']:.2f} s", f"{r['cpu_s'] / base['cpu_s']:.2f}x" if base else "-",
             f"{r['rss_growth_mib']:+.0f} MiB"] for r in report["rows"]]  # fmt: skip


COLUMNS = ["policy", "held at compression", "every prompt row's layer inputs", "wall", "CPU",
           "CPU vs none", "peak RSS growth"]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"POLICY:RATIO,... or none (default {','.join(POLICIES)})")  # fmt: skip
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens (2048)")
    p.add_argument("--chunk", type=int, default=512, help="the engine's token budget (512)")
    p.add_argument("--repeat", type=int, default=2, help="runs per policy, best kept (2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model, 256 tokens, the streamed policies: a smoke run",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--one", metavar="POLICY", help=argparse.SUPPRESS)  # a worker: one row
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    if args.quick:
        args.tokens, args.chunk, args.repeat = 256, 64, 1
        args.policies = ["none", "observed_attention:0.5", "expected_attention:0.5"]
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return 0
    report = run(args)
    m = report["machine"]
    title = f"Prefill record per compressing request ({m['cpu']}, {m['date']})"
    _util.print_report(report, args.json, COLUMNS, table, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
