"""KV-cache compression on retrieval: accuracy against compression for each policy, ours beside
NVIDIA's kvpress on the same model, prompts, ratios and greedy decoding.

    python -m selfattn.benchmarks.kv_compression                    # 1k, 2k, 4k; every policy
    python -m selfattn.benchmarks.kv_compression --lengths 1024,2048 --samples 8 --plot kv.png
    python -m selfattn.benchmarks.kv_compression --kvpress-python /path/to/venv/bin/python
    python -m selfattn.benchmarks.kv_compression --quick --json     # tiny model, ours only

Model: the bundled SmolLM2-135M-Instruct (trained to 8,192 tokens), its GGUF weights
dequantised to float32 on the CPU; kvpress reads the same weights as a transformers folder that
transformers writes from the GGUF (``cpu_llm.hf_folder``).

Tasks, written here from a seed (no hub, no data set), each prompt exactly ``length`` tokens of
the model's chat template: the context (the template's head and the user's text) and then the
question (the question, the template's tail and the start of the answer, e.g. "The pass key
is"); the answer is right when it is a substring of the greedy output (``--new`` tokens).

- ``passkey``: a five-digit pass key hidden in repeated filler at depths spread over 10 %-90 %.
- ``multikey``: RULER's multi-key needle: several "special magic number" needles for different
  keys (two random words each) in filler, the question asks for one of them.
- ``document``: a gazetteer of invented towns (the year each was founded, its people, its
  river); the question asks one town's founding year.

Policies (kvpress's names without "Press", lower-case): streaming_llm, snapkv, pyramidkv, knorm,
tova, observed_attention (H2O; kvpress runs it with eager attention), expected_attention,
adakv_snapkv; at ratios 0.5, 0.75, 0.875 (2x, 4x, 8x: kvpress's ``compression_ratio``, the
fraction of the context's K/V removed) and 0 (uncompressed, once for all policies). kvpress
compresses the context at prefill and runs the question after it (its pipeline's
``question=``): in its own environment (``--kvpress-python`` / ``$SELFATTN_KVPRESS_PYTHON``;
``python3 -m venv ENV && ENV/bin/pip install kvpress``), one process per length
(:mod:`selfattn.benchmarks.kv_compression_peer`). Ours: ``generate(model, ids,
kv_compression=press(name, ratio), kv_compression_context=len(context))`` (the same press the
serving engine runs; its greedy tokens equal generate's, tests/serving/test_serving_compress.py),
and plain ``generate`` for the uncompressed column. The engine's capacity under compression is
:mod:`selfattn.benchmarks.kv_capacity`'s.

K/V bytes per token: what a policy keeps of an uncompressed cache's bytes per context token
(``(1 - ratio) x 2 x layers x KV heads x head dim x 4`` in float32); kvpress's own cache's
stored bytes are in each row too (its AdaKV masks evicted entries in a dense cache, so stores
them all). ``--plot FILE``: accuracy against those bytes per policy (matplotlib).

Sizes: ``--samples`` prompts per task and length (default 4), 25 (policy, ratio) runs of
kvpress per length. On 2 shared cores one kvpress prompt took about 2.5 s at 1k tokens and 15-25
s at 2k: ``--lengths 1024 --samples 4`` runs in about 15 minutes, the defaults for hours
(``--peer-timeout`` keeps what finished).
Target: ours >= kvpress - 2 points at each task, length, policy and ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from selfattn.benchmarks import _util
from selfattn.benchmarks.cpu_llm import chat_frame, hf_folder, peer_python

PEER_SCRIPT = Path(__file__).with_name("kv_compression_peer.py")
POLICIES = ("streaming_llm", "snapkv", "pyramidkv", "knorm", "tova", "observed_attention",
            "expected_attention", "adakv_snapkv")  # fmt: skip
RATIOS = (0.0, 0.5, 0.75, 0.875)
LENGTHS = (1024, 2048, 4096)
TARGET_POINTS = 2.0  # ours >= kvpress - 2 accuracy points
PEER_TIMEOUT_S = 3600  # one length's kvpress process

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
# random keys and entity names are drawn from these
_WORD_LIST = ("amber apple arrow badge basil beacon birch bison cable candle canyon cedar cobalt "
              "comet coral cotton crane delta ember falcon fern flint forest garnet glacier harbor "
              "hazel iris ivory jasper kettle lantern lemon lilac linen maple marble meadow nickel "
              "oasis olive onyx orchid otter pebble pepper pine plum quartz raven reef river "
              "saffron salmon silver slate spruce thistle topaz tulip velvet walnut "
              "willow")  # fmt: skip
_SYLLABLE_LIST = ("zor mel tav qui bra fen lor dru kas vel pry sor thal wen yor gal hib nox orr "
                  "ura vath dri mon dal wick ford holm gate mere ster brook crest")  # fmt: skip
WORDS = _WORD_LIST.split()
SYLLABLES = _SYLLABLE_LIST.split()


# -- the tasks -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt: the context ids (compressed), the question ids (after it), the answer."""

    context: list[int]
    question: list[int]
    answer: str


def _question(tokenizer, tail: list[int], question: str, prefix: str) -> list[int]:
    return tokenizer.encode("\n\n" + question) + tail + tokenizer.encode(prefix)


def _haystack(tokenizer, budget: int, needles: list[str], depths: list[float]) -> str:
    """Filler of about ``budget`` tokens with each needle at its depth (a fraction)."""
    free = budget - sum(len(tokenizer.encode(n)) for n in needles)
    n_filler = max(1, free // len(tokenizer.encode(FILLER)))
    at = sorted(zip((round(d * n_filler) for d in depths), needles))
    parts, done = [], 0
    for k, needle in at:
        parts += [FILLER * (k - done), needle]
        done = k
    return "".join(parts) + FILLER * (n_filler - done)


def _fit(tokenizer, head, text_of, question, length: int, intro: str = "") -> list[int]:
    """The context ids: ``head`` and ``text_of(budget)`` (which starts with ``intro``), to fill
    ``length`` tokens with ``question`` after them (the budget corrected once for the
    tokenizer's merges)."""
    budget = length - len(head) - len(question) - len(tokenizer.encode(intro))
    ids = head + tokenizer.encode(text_of(budget))
    over = len(ids) + len(question) - length
    if over > 0:
        ids = head + tokenizer.encode(text_of(budget - over - 8))
    return ids[: length - len(question)]


def passkey(rng: random.Random, tokenizer, length: int, depth: float) -> Sample:
    head, tail = chat_frame(tokenizer)
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    intro = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
             "memorize it. I will quiz you about the important information there.\n\n")  # fmt: skip
    q = _question(tokenizer, tail, "What is the pass key?", "The pass key is")
    ctx = _fit(tokenizer, head, lambda b: intro + _haystack(tokenizer, b, [needle], [depth]),
               q, length, intro)  # fmt: skip
    return Sample(ctx, q, key)


def multikey(rng: random.Random, tokenizer, length: int, depth: float, keys: int = 4) -> Sample:
    head, tail = chat_frame(tokenizer)
    names = rng.sample([f"{a}-{b}" for a in WORDS for b in WORDS if a != b], keys)
    values = [str(rng.randint(100000, 999999)) for _ in names]
    needles = [
        f" One of the special magic numbers for {k} is: {v}. " for k, v in zip(names, values)
    ]
    # the asked needle at ``depth``, the others spread over the rest of the context
    depths = [depth] + [rng.uniform(0.05, 0.95) for _ in names[1:]]
    intro = ("Some special magic numbers are hidden inside the following text. Make sure to "
             "memorize them. I will quiz you about the numbers afterwards.\n\n")  # fmt: skip
    q = _question(tokenizer, tail, f"What is the special magic number for {names[0]}?",
                  f"The special magic number for {names[0]} is:")  # fmt: skip
    ctx = _fit(tokenizer, head, lambda b: intro + _haystack(tokenizer, b, needles, depths),
               q, length, intro)  # fmt: skip
    return Sample(ctx, q, values[0])


def document(rng: random.Random, tokenizer, length: int, depth: float) -> Sample:
    head, tail = chat_frame(tokenizer)
    towns: dict[str, str] = {}
    while len(towns) < length // 20:
        name = "".join(rng.sample(SYLLABLES, 2)).title()
        towns.setdefault(name, str(rng.randint(1200, 1999)))
    rows = [f"{t} is an old town by the river {rng.choice(WORDS).title()}. {t} was founded in "
            f"the year {y}. Today {rng.randint(1000, 99000)} people live in {t}, and its market "
            f"sells {rng.choice(WORDS)} and {rng.choice(WORDS)}.\n"
            for t, y in towns.items()]  # fmt: skip
    sizes = [len(tokenizer.encode(r)) for r in rows]
    intro = "Read this gazetteer of towns.\n\n"
    q_len = len(_question(tokenizer, tail, "In what year was Zorvath founded?",
                          "Zorvath was founded in the year")) + 8  # fmt: skip
    budget, n = length - len(head) - q_len - len(tokenizer.encode(intro)), 0
    while n < len(rows) and sum(sizes[: n + 1]) <= budget:
        n += 1
    town = list(towns)[min(n - 1, int(depth * n))]
    q = _question(tokenizer, tail, f"In what year was {town} founded?",
                  f"{town} was founded in the year")  # fmt: skip
    ctx = _fit(tokenizer, head, lambda b: intro + "".join(rows[:n]), q, length)
    return Sample(ctx, q, towns[town])


TASKS = {"passkey": passkey, "multikey": multikey, "document": document}


def make_samples(tokenizer, task: str, length: int, n: int, seed: int) -> list[Sample]:
    """``n`` prompts of ``task`` at ``length`` tokens, depths spread evenly over 10 %-90 %."""
    make = TASKS[task]
    depths = [0.1 + 0.8 * i / max(1, n - 1) for i in range(n)]
    return [make(random.Random(f"{seed}:{task}:{length}:{i}"), tokenizer, length, d)
            for i, d in enumerate(depths)]  # fmt: skip


# -- our side --------------------------------------------------------------------------------------


def our_press_factory():
    """``selfattn.cache.compress.press`` where this selfattn has it, else (None, why not)."""
    try:
        from selfattn.cache.compress import press
    except ImportError as e:
        return None, f"our compressed column: selfattn.cache.compress.press is missing ({e})"
    return press, ""


def our_answers(model, tokenizer, samples: list[Sample], new: int, press=None) -> list[str]:
    """Greedy answers of ours: plain ``generate`` (``press`` None) or under ``press``, which
    compresses the context only and runs the question after it, as kvpress's pipeline does."""
    from selfattn.models import generate

    out = []
    with torch.inference_mode():
        for s in samples:
            ids = s.context + s.question
            extra = {} if press is None else {"kv_compression": press,
                                              "kv_compression_context": len(s.context)}  # fmt: skip
            tokens = generate(model, torch.tensor([ids]), new, **extra)[0, len(ids) :]
            out.append(tokenizer.decode(tokens.tolist(), skip_special_tokens=True))  # as kvpress
    return out


# -- kvpress's side --------------------------------------------------------------------------------


def start_peer(python: str, job: dict) -> subprocess.Popen:
    """kvpress's run of one job, started in its own process so that it runs beside ours (each
    on ``job["threads"]`` threads); :func:`finish_peer` collects it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "TQDM_DISABLE": "1"}
    env.pop("PYTHONPATH", None)  # kvpress's own environment, not ours
    with tempfile.TemporaryFile("w+") as f:  # the job as stdin: nothing left to write later
        json.dump(job, f)
        f.seek(0)
        return subprocess.Popen([python, str(PEER_SCRIPT)], stdin=f, stdout=subprocess.PIPE,
                                text=True, env=env)  # fmt: skip


def finish_peer(proc: subprocess.Popen, deadline: float) -> tuple[list[dict], str]:
    """kvpress's rows (one line per config, as many as finished by ``deadline``, a
    ``time.monotonic()`` value) and why not all finished ("" when they did)."""
    try:
        out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        why = f"exit {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        why = "stopped at --peer-timeout"
    lines = [json.loads(x) for x in (out or "").splitlines() if x.startswith("{")]
    end = lines.pop() if lines and lines[-1].get("done") else None
    return lines, why if end is None else ""


# -- the run ---------------------------------------------------------------------------------------


def score(answers: list[str], samples: list[Sample]) -> int:
    return sum(s.answer in a for a, s in zip(answers, samples))


def row(task, length, policy, ratio, side, answers, samples, full_bytes, **extra) -> dict:
    right = score(answers, samples)
    return {"task": task, "length": length, "policy": policy, "compression": ratio,
            "side": side, "correct": right, "total": len(samples),
            "accuracy": 100.0 * right / len(samples),
            "kv_bytes_per_token": (1 - ratio) * full_bytes, "answers": answers,
            **extra}  # fmt: skip


def tiny_model(vocab: int):
    """A small random Llama over the bundled tokenizer's vocabulary: --quick's model."""
    from selfattn.models.decoder import DecoderConfig, Llama

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=128, max_positions=4096)  # fmt: skip
    return Llama(cfg).eval()


def targets(rows: list[dict]) -> list[dict]:
    """Ours against kvpress at each task, length, policy and ratio both measured."""
    peer = {(r["task"], r["length"], r["policy"], r["compression"]): r
            for r in rows if r["side"] == "kvpress"}  # fmt: skip
    out = []
    for r in rows:
        key = (r["task"], r["length"], r["policy"], r["compression"])
        if r["side"] == "ours" and key in peer:
            p = peer[key]["accuracy"]
            out.append({"task": key[0], "length": key[1], "policy": key[2],
                        "compression": key[3], "ours": r["accuracy"], "kvpress": p,
                        "target": f">= kvpress - {TARGET_POINTS:g} points",
                        "met": r["accuracy"] >= p - TARGET_POINTS})  # fmt: skip
    return out


def run(args) -> dict:
    from selfattn.models import from_pretrained, load_tokenizer
    from selfattn.models.bundled import chat_model_path

    torch.set_num_threads(args.threads)
    path = args.model or str(chat_model_path())
    tokenizer = load_tokenizer(path)
    report: dict = {"machine": _util.machine(), "skipped": [], "rows": []}
    skipped = report["skipped"]
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"--policies: {', '.join(sorted(unknown))} not among {','.join(POLICIES)}")
    ratios = [float(x) for x in args.ratios.split(",")]
    bad = [r for r in ratios if not 0 <= r < 1]
    if bad:
        raise SystemExit(f"--ratios: {bad} outside [0, 1) (kvpress's compression_ratio)")
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.quick:
        model = tiny_model(tokenizer.vocab_size)
        skipped.append("--quick: a tiny random model, ours only (its accuracy means nothing)")
    else:
        model = from_pretrained(path, dtype=torch.float32, quantized=False, progress=False)
    c = model.config
    full_bytes = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4  # float32 K and V per token
    kvpress = None
    if not args.quick:
        kvpress, why = peer_python(args.kvpress_python, "SELFATTN_KVPRESS_PYTHON", "kvpress")
        if kvpress is None:
            skipped.append(f"kvpress: {why}; python3 -m venv ENV && ENV/bin/pip install kvpress")
    press, why = our_press_factory()
    if press is None:
        skipped.append(why + "; pending the engine's integration")
    folder = None
    if kvpress:
        folder = str(hf_folder(path, Path(args.work_dir).expanduser() / f"{Path(path).stem}.hf"))
    report["setup"] = {"model": path, "lengths": lengths, "samples": args.samples,
                       "policies": policies, "ratios": ratios, "new": args.new,
                       "seed": args.seed, "threads": args.threads, "kvpress_python": kvpress,
                       "hf_folder": folder, "full_kv_bytes_per_token": full_bytes}  # fmt: skip
    configs = [("none", 0.0)] * (0.0 in ratios)
    configs += [(p, r) for p in policies for r in ratios if r > 0]
    rows = report["rows"]
    for length in lengths:
        samples = {t: make_samples(tokenizer, t, length, args.samples, args.seed) for t in TASKS}
        flat = [s for t in TASKS for s in samples[t]]
        peer = None
        if kvpress:  # kvpress runs beside ours: a length takes the longer of the two
            job = {"model": folder, "threads": args.threads, "new": args.new,
                   "samples": [dataclasses.asdict(s) for s in flat],
                   "configs": configs}  # fmt: skip
            peer, deadline = start_peer(kvpress, job), time.monotonic() + args.peer_timeout
        t0 = time.perf_counter()
        answers = our_answers(model, tokenizer, flat, args.new)
        rows += split_rows(length, "none", 0.0, "ours", answers, samples, full_bytes)
        right = ", ".join(f"{r['task']} {r['correct']}/{r['total']}" for r in rows[-len(TASKS) :])
        print(f"{length}: ours uncompressed {right} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)  # fmt: skip
        for policy, ratio in configs if press is not None else []:
            if policy != "none":
                try:
                    answers = our_answers(model, tokenizer, flat, args.new, press(policy, ratio))
                except ValueError as e:  # refused here (a budget too small for the prompt)
                    print(f"{length}: ours {policy} at {ratio}: not run ({e})", file=sys.stderr)
                    continue
                rows += split_rows(length, policy, ratio, "ours", answers, samples, full_bytes)
        print(f"{length}: ours done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        if peer is not None:
            lines, why = finish_peer(peer, deadline)
            if why:
                skipped.append(f"kvpress at {length}: {len(lines)} of {len(configs)} done ({why})")
            for line in lines:
                if "error" in line:
                    skipped.append(f"kvpress {line['policy']} {line['ratio']} at {length}: "
                                   f"{line['error']}")  # fmt: skip
                    continue
                rows += split_rows(length, line["policy"], line["ratio"], "kvpress",
                                   line["answers"], samples, full_bytes,
                                   stored_bytes_per_token=line["stored_bytes_per_token"],
                                   seconds=line["seconds"])  # fmt: skip
    report["targets"] = targets(rows)
    return report


def split_rows(length, policy, ratio, side, answers, samples, full_bytes, **extra) -> list[dict]:
    """One row per task of ``answers`` (all tasks' samples in ``TASKS`` order)."""
    out, i = [], 0
    for task in TASKS:
        n = len(samples[task])
        out.append(row(task, length, policy, ratio, side, answers[i : i + n], samples[task],
                       full_bytes, **extra))  # fmt: skip
        i += n
    return out


# -- output ----------------------------------------------------------------------------------------


def accuracy_table(report: dict, task: str) -> tuple[list[str], list[list[str]]]:
    """One task: a row per (length, policy), a column per ratio, "ours / kvpress" in each."""
    ratios = report["setup"]["ratios"]
    cell = {(r["length"], r["policy"], r["compression"], r["side"]): r["accuracy"]
            for r in report["rows"] if r["task"] == task}  # fmt: skip

    def f(key):
        v = cell.get(key)
        return "-" if v is None else f"{v:.0f}"

    columns = ["length", "policy"] + [f"{1 / (1 - r):g}x ours / kvpress" for r in ratios]
    table = []
    for length in report["setup"]["lengths"]:
        base = f((length, "none", 0.0, "ours")) + " / " + f((length, "none", 0.0, "kvpress"))
        for policy in report["setup"]["policies"]:
            cells = [base if r == 0 else f((length, policy, r, "ours")) + " / "
                     + f((length, policy, r, "kvpress")) for r in ratios]  # fmt: skip
            table.append([str(length), policy, *cells])
    return columns, table


def plot(report: dict, file: str) -> None:
    """Accuracy (all tasks and lengths pooled) against K/V bytes per token, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = report["rows"]
    colors = plt.get_cmap("tab10")  # one color per policy, ours solid, kvpress dashed
    for side, style, marker in (("kvpress", "--", "x"), ("ours", "-", "o")):
        for i, policy in enumerate(report["setup"]["policies"]):
            pts = []
            for ratio in report["setup"]["ratios"]:
                name = "none" if ratio == 0 else policy
                got = [r for r in rows if (r["side"], r["policy"], r["compression"])
                       == (side, name, ratio)]  # fmt: skip
                if got:
                    acc = 100 * sum(r["correct"] for r in got) / sum(r["total"] for r in got)
                    pts.append((got[0]["kv_bytes_per_token"] / 1024, acc))
            if len(pts) > 1:
                ax.plot(*zip(*pts), style, marker=marker, color=colors(i % 10),
                        label=f"{policy} ({side})")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("K/V KiB per context token kept (float32)")
    ax.set_ylabel("accuracy, % (all tasks and lengths)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(file, dpi=120)


def main(argv=None) -> int:
    from selfattn.models.bundled import default_threads

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", metavar="FILE", help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                   help="prompt lengths in tokens (default 1024,2048,4096)")  # fmt: skip
    p.add_argument("--samples", type=int, default=4,
                   help="prompts per task and length (default 4; --lengths 1024 runs in about "
                        "15 minutes on 2 cores, see above)")  # fmt: skip
    p.add_argument("--policies", default=",".join(POLICIES), help="default: all")
    p.add_argument("--ratios", default=",".join(map(str, RATIOS)),
                   help="kvpress compression ratios (default 0,0.5,0.75,0.875)")  # fmt: skip
    p.add_argument("--new", type=int, default=10, help="greedy tokens per answer (10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--kvpress-python", metavar="PYTHON",
                   help="an interpreter with kvpress (default $SELFATTN_KVPRESS_PYTHON, else "
                        "this one if it has it, else skipped)")  # fmt: skip
    p.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S,
                   help="seconds for kvpress at each length; the configs it finished are kept "
                        f"({PEER_TIMEOUT_S})")  # fmt: skip
    p.add_argument("--work-dir", default="~/.cache/selfattn/cpu_llm",
                   help="where the transformers folder of the model is kept")  # fmt: skip
    p.add_argument("--plot", metavar="FILE", help="write accuracy against K/V bytes per token")
    p.add_argument("--quick", action="store_true",
                   help="a tiny random model, 256-token prompts, one per task, ours only: "
                        "a smoke run")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.samples, args.new, args.threads = "256", 1, 4, 1
    report = run(args)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    m = report["machine"]
    for task in TASKS:
        columns, table = accuracy_table(report, task)
        _util.print_table(columns, table, title=f"{task}: accuracy % ({m['cpu']}, {m['date']})")
    for why in report["skipped"]:
        print(f"skipped: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
