"""kvpress's side of :mod:`selfattn.benchmarks.kv_compression`, run as a script by the
interpreter of kvpress's own environment (kvpress pins an older transformers): it imports
neither selfattn nor anything of the benchmark, reads one job as JSON on stdin and prints one
JSON line per (policy, ratio) as it finishes, then a last line with ``"done": true``.

    KVPRESS_PYTHON kv_compression_peer.py < job.json

A job: ``{"model": FOLDER (a transformers folder), "threads": N, "new": N, "samples":
[{"context": [ids], "question": [ids]}, ...], "configs": [[policy, ratio], ...]}``. Each sample
runs kvpress's pipeline path itself (``KVPressTextGenerationPipeline._forward``): the context is
prefilled under the press and compressed, then the question is run after it at its original
positions and up to ``new`` tokens are decoded greedily (stopping at end-of-sequence), float32
on the CPU. A line holds the decoded answers in sample order, the K/V bytes per context token
the compressed cache stores, and its seconds; or the error of a press that fails.
"""

from __future__ import annotations

import json
import sys
import time

# The benchmark's policy names (kvpress's class names without "Press", lower-case) and the
# kvpress classes; adakv_snapkv is AdaKV's per-head budgets over SnapKV's scores.
CLASSES = {
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "pyramidkv": "PyramidKVPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "observed_attention": "ObservedAttentionPress",
    "expected_attention": "ExpectedAttentionPress",
    "adakv_snapkv": "SnapKVPress",
}
EAGER = ("observed_attention",)  # presses that read the attention weights


def make_press(name: str, ratio: float):
    """kvpress's press for ``name`` at ``ratio`` (None at ratio 0: no press at all)."""
    import kvpress

    if ratio == 0:
        return None
    press = getattr(kvpress, CLASSES[name])(compression_ratio=ratio)
    return kvpress.AdaKVPress(press) if name == "adakv_snapkv" else press


def pipeline(folder: str, eager: bool):
    import torch
    import transformers
    from kvpress.pipeline import KVPressTextGenerationPipeline  # noqa: F401 (registers it)

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager" if eager else "sdpa"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.pipeline(
        "kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu"
    )


def run(pipe, samples: list[dict], press, new: int) -> dict:
    import torch
    from transformers import DynamicCache

    answers, stored = [], []
    t0 = time.perf_counter()
    for s in samples:
        cache = DynamicCache()
        inputs = {
            "context_ids": torch.tensor([s["context"]]),
            "questions_ids": [torch.tensor([s["question"]])],
        }
        with torch.inference_mode():
            [answer] = pipe._forward(inputs, max_new_tokens=new, press=press, cache=cache)
        answers.append(answer)
        layers = cache.layers
        kv = sum(x.keys.numel() * x.keys.element_size() * 2 for x in layers)
        stored.append(kv / len(s["context"]))
    return {
        "answers": answers,
        "stored_bytes_per_token": sum(stored) / len(stored),
        "seconds": time.perf_counter() - t0,
    }


def main() -> int:
    from importlib.metadata import version

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    job = json.load(sys.stdin)
    torch.set_num_threads(job["threads"])
    pipes: dict[bool, object] = {}
    for name, ratio in job["configs"]:
        eager = name in EAGER
        if eager not in pipes:
            pipes[eager] = pipeline(job["model"], eager)
        try:
            out = run(pipes[eager], job["samples"], make_press(name, ratio), job["new"])
        except Exception as e:  # a press that fails on this model: reported, the others run
            out = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        out.update(policy=name, ratio=ratio)
        print(json.dumps(out), flush=True)
        print(f"kvpress {name} {ratio}: {out.get('seconds', out.get('error'))}", file=sys.stderr,
              flush=True)  # fmt: skip
    print(json.dumps({"done": True, "version": version("kvpress"),
                      "transformers": transformers.__version__}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
