"""The flags of ``python -m selfattn.benchmarks.alternatives`` and of ``selfattn compare``.

Apart from the benchmark so that reading them imports no torch (the CLI builds its parser from
them for ``--help``).
"""

from __future__ import annotations

import argparse

from selfattn._console import positive_int

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments"]

DESCRIPTION = (
    "Measure the textbook's claim on this machine: time and memory per prefill and per generated "
    "token vs context length for attention (full and windowed KV cache), Mamba-2, gated DeltaNet "
    "and a hybrid of equal width and depth, with the crossover lengths; then tiny models trained "
    "on multi-query associative recall (MQAR), accuracy vs the number of key-value pairs and vs "
    "the state size. The defaults take about 8 CPU-minutes (so at most 8 minutes on an idle "
    "2-core machine), mostly the recall training; --only cost about 2; --quick seconds. "
    "Progress lines go to stderr."
)
EPILOG = (
    "Every other size (model widths, the window, the learning rate, the evaluation batch) is a "
    "field of selfattn.benchmarks.alternatives.Sizes (cost) or .MQAR (recall), for Python use."
)


def _sizes(text: str) -> tuple[int, ...]:
    """``"2,4,8"`` -> ``(2, 4, 8)``: positive integers, comma-separated."""
    return tuple(positive_int(t) for t in text.split(","))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``selfattn compare`` and ``python -m selfattn.benchmarks.alternatives``."""
    n = positive_int
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (seconds)")
    p.add_argument("--only", choices=("cost", "mqar"), help="one section")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--threads", type=n, metavar="N",
                   help="torch intra-op threads of the cost section (default torch's: one per "
                   "core; MQAR trains on one thread per model, see --jobs)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0,
                   help="seeds weights, MQAR data and cost inputs (default 0)")  # fmt: skip
    groups = {
        "cost (time and bytes per token vs context length)": [
            ("--max-len", n, "T", "longest context: the lengths double from 1,024 up to T "
             "(default 16,384; 65,536 adds several CPU-minutes and ~0.6 GiB)"),
            ("--decode-steps", n, "N", "decode steps timed per length, their median counts "
             "(default 16)"),
            ("--repeat", n, "N", "prefills per length, the fastest counts (default 1)"),
        ],
        "MQAR recall (tiny models trained on this CPU)": [
            ("--pairs", _sizes, "N,N,..", "numbers of key-value pairs: each model trains on "
             "their mix, scored at each (default 2,4,8; at most 16)"),
            ("--state-size", n, "N", "Mamba-2's (and the hybrid's) state size (default 1: too "
             "small to recall 4 or 8 pairs)"),
            ("--state-sizes", _sizes, "N,N,..", "Mamba-2's state sizes, one more training each "
             "(default 1,4,16)"),
            ("--steps", n, "N", "training steps per model (default 800)"),
            ("--batch", n, "N", "sequences per training step (default 64)"),
            ("--jobs", n, "N", "models trained at once, a process and a thread each (default "
             "2, 1 on a 1-core machine); the numbers do not depend on it"),
        ],
    }  # fmt: skip
    made = {title: p.add_argument_group(title) for title in groups}
    for title, flags in groups.items():
        for flag, kind, metavar, text in flags:
            made[title].add_argument(flag, type=kind, metavar=metavar, help=text)
    made[next(iter(groups))].add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="time the cost rows by the wall clock (default) or by this process's CPU time "
        "(steady on a shared machine with --threads 1)",
    )  # fmt: skip
    p.set_defaults(repeat=1)
