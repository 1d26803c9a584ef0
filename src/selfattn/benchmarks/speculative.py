"""Speculative decoding by prompt lookup against plain greedy decoding, on prompts that copy.

    python -m selfattn.benchmarks.speculative            # SmolLM2-135M-Instruct, bf16
    python -m selfattn.benchmarks.speculative --dtype float32
    python -m selfattn.benchmarks.speculative --quick    # a tiny random Llama: a smoke run
    python -m selfattn.benchmarks.speculative --json

Prompts where the reply copies from the prompt (a paragraph repeated word for word, a function
edited), rendered with the chat template of the bundled SmolLM2-135M-Instruct (loaded in
bfloat16). Each prompt runs greedily for ``--new`` tokens through ``generate`` (static cache,
the decode fast path) and ``generate(..., prompt_lookup_num_tokens=k)``, then through the Engine
with and without ``EngineConfig(speculative="ngram", num_speculative_tokens=k)``, interleaved,
``--repeat`` times: the table shows median tokens per second (decode and prefill together, one
stream), the ratio, whether the tokens are identical to the same path's plain greedy decoding
(else the first token that differs) and the share of draft tokens accepted (the Engine's
counters). Target: 1.5x faster with speculation than without.

Identity is exact in float32. In bfloat16 the verify forward's ``1 + k`` rows round differently
from a one-token step, so a near-tie between two tokens can flip, as it flips between plain
decoding's own paths (``plain_paths_differ_at``: where the Engine's plain greedy tokens leave
``generate``'s).

:func:`measure` is the keyword entry point other benchmarks call (``benchmarks/cpu_llm.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from selfattn.benchmarks import _util

TARGET = ">= 1.5"
PARAGRAPH = (
    "Paged attention keeps the keys and values of every sequence in pages of a fixed size, so "
    "that memory is taken as a sequence grows and returned when it ends. A block table maps each "
    "sequence's pages to places in one pool, and the kernel reads them where they lie. Prefix "
    "caching lets a new request reuse the pages of a prompt that an earlier one computed."
)
CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)"""
TASKS = {
    "repeat": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    "edit": f"Rename the function mean to average everywhere in this code and print the whole "
    f"code:\n\n{CODE}",
}


def measure(model, prompts: dict, *, new: int, k: int, repeat: int, engine_kw=None) -> list:
    """Rows of plain vs prompt-lookup greedy decoding of each ``prompts`` entry (name ->
    token ids) by ``generate`` and by the Engine, timed interleaved ``repeat`` times."""
    from selfattn.serving import Engine, SamplingParams

    plain_engine = Engine(model, **(engine_kw or {}))
    spec_engine = Engine(model, speculative="ngram", num_speculative_tokens=k,
                         **(engine_kw or {}))  # fmt: skip
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    rows = []
    for name, ids in prompts.items():
        runs = _runs(model, ids, new, k, plain_engine, spec_engine, params)
        times = {n: [] for n in runs}
        outs = {n: f() for n, f in runs.items()}  # warm-up, and the tokens
        before = (spec_engine.metrics.spec_draft_tokens, spec_engine.metrics.spec_accepted_tokens)
        for _ in range(repeat):
            for n, f in runs.items():
                t = time.perf_counter()
                f()
                times[n].append(time.perf_counter() - t)
        drafted = spec_engine.metrics.spec_draft_tokens - before[0]
        accepted = spec_engine.metrics.spec_accepted_tokens - before[1]
        for path in ("generate", "engine"):
            plain_s = statistics.median(times[path])
            spec_s = statistics.median(times[f"{path}, lookup"])
            ratio = plain_s / spec_s
            rows.append({
                "case": f"{name}: {path}, prompt lookup k={k}",
                "peer": f"{path}, plain greedy",
                "prompt_tokens": len(ids),
                "new_tokens": new,
                "ours": new / spec_s,
                "peer_value": new / plain_s,
                "ratio": ratio,
                "identical": outs[f"{path}, lookup"] == outs[path],
                # the first token where speculation and the same path's plain decoding differ
                "first_diff": _first_diff(outs[f"{path}, lookup"], outs[path]),
                "plain_paths_differ_at": _first_diff(outs["engine"], outs["generate"]),
                "acceptance": accepted / drafted if drafted else None,
                "target": TARGET,
                "met": ratio >= float(TARGET.split()[1]),
            })  # fmt: skip
    return rows


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _runs(model, ids, new, k, plain_engine, spec_engine, params) -> dict:
    """The four ways to decode ``ids`` greedily: name -> a call returning the new tokens."""
    from selfattn.models.generate import generate

    x = torch.tensor([ids])

    def by_generate(**kw):
        return generate(model, x, new, ignore_eos=True, **kw)[0, len(ids) :].tolist()

    def by_engine(engine):
        return list(engine.generate([ids], params)[0].outputs[0].token_ids)

    return {
        "generate": by_generate,
        "generate, lookup": lambda: by_generate(prompt_lookup_num_tokens=k),
        "engine": lambda: by_engine(plain_engine),
        "engine, lookup": lambda: by_engine(spec_engine),
    }


def _smollm2(dtype):
    from selfattn.models import from_pretrained, load_tokenizer
    from selfattn.models.bundled import chat_model_path

    path = chat_model_path()
    model = from_pretrained(path, dtype=dtype).eval()
    tok = load_tokenizer(path)
    prompts = {}
    for name, text in TASKS.items():
        chat = [{"role": "user", "content": text}]
        prompts[name] = list(tok.apply_chat_template(chat, add_generation_prompt=True))
    return model, prompts, f"SmolLM2-135M-Instruct (bundled GGUF), {dtype}"


def _tiny():
    from selfattn.models.decoder import Llama

    torch.manual_seed(0)
    model = Llama.from_config({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }).eval()  # fmt: skip
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 256, (40,), generator=g).tolist()
    return model, {"repeat": text + text[:20]}, "a tiny random Llama (2 layers, d=64)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny random model: a smoke run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--new", type=int, default=None, help="new tokens (default 128; quick 24)")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per step (default 5)")
    ap.add_argument("--repeat", type=int, default=None, help="timed rounds (default 5; quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="SmolLM2's weights (default bfloat16)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, prompts, what = _tiny() if args.quick else _smollm2(getattr(torch, args.dtype))
    new = args.new or (24 if args.quick else 128)
    repeat = args.repeat or (1 if args.quick else 5)
    rows = measure(model, prompts, new=new, k=args.k, repeat=repeat,
                   engine_kw={"kv_cache_bytes": 64 * 2**20, "admit_quiet_s": 0.0})  # fmt: skip
    setup = {"model": what, "new_tokens": new, "k": args.k, "repeat": repeat}
    report = {"machine": _util.machine(), "setup": setup, "rows": rows}

    def table(rep):
        return [
            [r["case"], f"{r['ours']:.1f}", f"{r['peer_value']:.1f}", f"{r['ratio']:.2f}",
             "yes" if r["identical"] else f"from token {r['first_diff']}",
             "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}",
             f"{r['target']} {_util.verdict(r)}"]
            for r in rep["rows"]
        ]  # fmt: skip

    _util.print_report(report, args.json,
                       ["case", "tok/s", "plain tok/s", "ratio", "identical", "accepted", "target"],
                       table, "speculative decoding (prompt lookup) vs plain greedy")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
