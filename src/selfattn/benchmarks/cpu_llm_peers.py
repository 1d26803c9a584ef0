"""The peers' side of :mod:`selfattn.benchmarks.cpu_llm`, run as a script by the peer's own
interpreter (llama-cpp-python and vLLM live in environments of their own): it imports neither
selfattn nor torch itself, reads one job as JSON on stdin and prints its result as one JSON line.

    PEER_PYTHON cpu_llm_peers.py < job.json

A job: ``{"peer": "llama.cpp" | "vllm", "mode": "single" | "batch" | "spec" | "structured"
(vLLM's guided decoding: :mod:`selfattn.benchmarks.structured`), "model": PATH,
"threads": N, "prompts": [[ids], ...], "warm": [ids], "new": N, ...}``. Every mode is greedy and
runs ``new`` tokens per prompt past any end-of-sequence token, after one untimed warm-up
request on ``warm`` (ids that share no prefix with the prompts). The result holds the peak RSS
of this process (``VmHWM``: a fresh process per job) and the generated ids.
"""

from __future__ import annotations

import json
import os
import sys
import time


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


# -- llama.cpp (llama-cpp-python) -----------------------------------------------------------------


def llama_model(job: dict, draft=None):
    import llama_cpp

    n_ctx = max(len(p) for p in job["prompts"]) + job["new"] + 64
    return llama_cpp.Llama(
        model_path=job["model"],
        n_ctx=max(n_ctx, 512),
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        logits_all=False,
        draft_model=draft,
        seed=0,
        verbose=False,
    )


def llama_stream(llm, ids: list[int], new: int) -> tuple[float, list[float], list[int]]:
    """(start, a timestamp per token, the tokens) of ``new`` greedy tokens after ``ids``; the
    context is reset first so that no earlier request's prefix is reused."""
    llm.reset()
    stamps, tokens = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(tok))
        if len(tokens) == new:
            break
    return t0, stamps, tokens


def run_llama(job: dict) -> dict:
    import llama_cpp

    draft = None
    if job["mode"] == "spec":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=job["k"])
    llm = llama_model(job, draft)
    llama_stream(llm, job["warm"], 4)
    out = {"version": llama_cpp.__version__}
    if job["mode"] == "single":
        [ids] = job["prompts"]
        t0, stamps, tokens = llama_stream(llm, ids, job["new"])
        out.update(stamps=[s - t0 for s in stamps], tokens=[tokens])
    else:  # batch and spec: one request after another (its Python API has no batching)
        all_tokens = []
        t0 = last = time.perf_counter()
        for ids in job["prompts"]:
            _, stamps, tokens = llama_stream(llm, ids, job["new"])
            all_tokens.append(tokens)
            last = stamps[-1]
        out.update(wall_s=last - t0, tokens=all_tokens)
    return out


# -- vLLM (its CPU build) -------------------------------------------------------------------------


def run_vllm(job: dict) -> dict:
    # A plain script runs the engine in this process (its worker processes need a __main__ guard
    # and would hide the engine's memory from this process's peak RSS).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job["max_model_len"],  # one for every job: its compile cache is reused
        enable_prefix_caching=job["mode"] != "single",
        seed=0,
    )

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def prompts(ps):
        return [{"prompt_token_ids": p} for p in ps]

    llm.generate(prompts([job["warm"]]), params(4), use_tqdm=False)
    out = {"version": vllm.__version__}
    if job["mode"] == "structured":
        out.update(vllm_structured(llm, job, prompts, params))
        return out
    if job["mode"] == "single":
        # its offline API returns whole outputs: the first token's time is a one-token
        # request's, and decode is the rest of a full request's time
        t0 = time.perf_counter()
        llm.generate(prompts(job["prompts"]), params(1), use_tqdm=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = llm.generate(prompts(job["prompts"]), params(job["new"]), use_tqdm=False)
        full = time.perf_counter() - t0
        out.update(ttft_s=ttft, full_s=full)
    else:
        t0 = time.perf_counter()
        res = llm.generate(prompts(job["prompts"]), params(job["new"]), use_tqdm=False)
        out.update(wall_s=time.perf_counter() - t0)
    out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
    return out


def vllm_structured(llm, job: dict, prompts, params) -> dict:
    """Guided against free generation (``job["schema"]``, greedy, ``new`` tokens) at batch 1
    and 16: output tokens per second; the time of a one-token request, free, guided by a new
    schema each time (``job["cold"]``: its compile included) and by one schema again."""
    from vllm.sampling_params import StructuredOutputsParams

    def guided(n, schema):
        p = params(n)
        p.ignore_eos = False
        p.structured_outputs = StructuredOutputsParams(json=schema)
        return p

    out = {}
    for batch in (1, 16):
        ps, n = prompts(job["prompts"] * batch), job["new"]
        for name, p in (("free", params(n)), ("guided", guided(n, job["schema"]))):
            llm.generate(ps, p, use_tqdm=False)  # warm
            t0 = time.perf_counter()
            res = llm.generate(ps, p, use_tqdm=False)
            made = sum(len(r.outputs[0].token_ids) for r in res)
            out[f"{name}_{batch}"] = made / (time.perf_counter() - t0)
    ttft = {"free": [], "cold": [], "cached": []}
    for i, cold in enumerate(job["cold"]):
        for name, p in (("free", params(1)), ("cold", guided(1, cold)),
                        ("cached", guided(1, job["cold"][0]))):  # fmt: skip
            if name == "cached" and i == 0:
                continue
            t0 = time.perf_counter()
            llm.generate(prompts(job["prompts"]), p, use_tqdm=False)
            ttft[name].append(time.perf_counter() - t0)
    out["ttft_ms"] = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in ttft.items()}
    return out


def main() -> int:
    job = json.load(sys.stdin)
    run = {"llama.cpp": run_llama, "vllm": run_vllm}[job["peer"]]
    out = run(job)
    out["peak_mib"] = peak_rss_mib()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
