"""Attention and its alternatives, measured on CPU: what a token costs as the context grows, and
what a fixed-size state forgets.

    python -m selfattn.benchmarks.alternatives                 # both sections (<= 10 min, 2 cores)
    python -m selfattn.benchmarks.alternatives --quick --json  # a smoke run
    selfattn compare --out DIR                                 # the same, with one PNG per metric

Both take the flags of ``selfattn compare --help``; progress lines go to stderr, and the report
records its own wall and CPU time (``run_s``, ``cpu_s``: the process's, every thread).

``cost``: models of equal width and depth (``Sizes``: 4 layers, each a mixer and a SwiGLU) whose
mixers are attention with a full KV cache, attention over a window (its cache a ring of
``window`` tokens), Mamba-2, gated DeltaNet, and a hybrid with one attention layer in four. For
each context length ``T``: a prefill of ``T`` tokens (ms per token), then decode steps at context
``T`` (ms per generated token, median), and the bytes the model's cache holds. ``crossovers``:
the shortest measured ``T`` from which each alternative is cheaper than full attention, per
metric (None: not within the lengths measured).

``mqar``: multi-query associative recall (Arora et al. 2023, "Zoology"): a sequence of
``n`` key-value pairs, then the keys again in a new order, each followed by its value; the loss
and the accuracy count the value predicted at each queried key. Tiny models of about equal
parameter counts (attention, Mamba-2, gated DeltaNet, hybrid), each trained once on CPU with a
fixed seed on a mix of ``n`` (as Zoology trains), evaluated on fresh sequences: accuracy vs ``n``
(the number of pairs) and, for Mamba-2, vs its state size. Attention keeps every pair (its
cache grows with ``n``); a fixed state must compress them and stops recalling exactly once ``n``
outgrows it; one attention layer restores recall.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from selfattn.benchmarks import _util
from selfattn.benchmarks.alternatives_args import DESCRIPTION, EPILOG, add_arguments
from selfattn.cache.state import LayerState
from selfattn.models.hybrid import HybridConfig, HybridLM

__all__ = ["MQAR", "Sizes", "build", "cost", "crossovers", "main", "mqar", "mqar_batch"]

# model name -> its layers (depth 4); the hybrid has one attention layer in four, second: placed
# last it did not learn MQAR in 500 steps (0.17 accuracy at 16 pairs), second it did (1.00)
KINDS = {
    "attention": ("attention",) * 4,
    "attention-window": ("attention",) * 4,
    "mamba2": ("mamba",) * 4,
    "deltanet": ("deltanet",) * 4,
    "hybrid": ("mamba", "attention", "mamba", "mamba"),
}
MQAR_KINDS = ("attention", "mamba2", "deltanet", "hybrid")
IGNORE = -100  # cross_entropy's ignore_index: positions whose prediction is not scored


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model and run sizes of the cost section. Mixers of about equal width: attention ``heads``
    of ``d_model / heads``; Mamba-2 ``2 · d_model`` wide (its expand of 2) in heads of
    ``d_model / heads`` with a state of ``state_size``; gated DeltaNet ``heads`` of
    ``d_model / heads``."""

    d_model: int = 256
    heads: int = 4
    state_size: int = 64
    d_ff: int = 512
    window: int = 512
    vocab: int = 256
    # 1k .. 16k: the whole section took 111 CPU-s (one thread, 3 prefills per length); full
    # attention's prefill grows with T^2, so 32k adds about a CPU-minute and 64k about four more
    # (estimated from 16k, not timed): --max-len 65536 for the full range
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    decode_steps: int = 16

    def quick(self) -> Sizes:
        return dataclasses.replace(self, d_model=32, d_ff=64, window=16, state_size=8,
                                   lengths=(32, 64), decode_steps=2)  # fmt: skip


def build(kind: str, d_model: int, heads: int, state_size: int, d_ff: int, window: int, vocab: int,
          seed: int = 0) -> HybridLM:  # fmt: skip
    """A :class:`~selfattn.models.hybrid.HybridLM` of ``KINDS[kind]`` (random weights, seeded)."""
    head_dim = d_model // heads
    mamba = kind in ("mamba2", "hybrid")
    config = HybridConfig(
        vocab_size=vocab, d_model=d_model, layer_types=KINDS[kind],
        ssm_heads=2 * heads if mamba else heads, ssm_head_dim=head_dim, state_size=state_size,
        chunk_size=64, d_ff=d_ff, n_heads=heads, head_dim=head_dim,
        window=window if kind == "attention-window" else None,
    )  # fmt: skip
    torch.manual_seed(seed)
    return HybridLM(config).eval()


def _cache_bytes(cache) -> int:
    """Bytes of every tensor a model cache's layers hold."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, LayerState):
            total += layer.nbytes
        else:
            total += sum(t.nbytes for t in vars(layer).values() if isinstance(t, torch.Tensor))
    return total


def _quiet(message: str) -> None:
    """The default progress sink of :func:`cost` and :func:`mqar`: none."""


def cost(sizes: Sizes, repeat: int = 1, seed: int = 0, log: Callable[[str], None] = _quiet,
         clock: str = "wall") -> list[dict]:  # fmt: skip
    """One row per (model, T): prefill ms per token, decode ms per token at context T (median
    of ``decode_steps``), cache bytes. ``repeat`` prefills per row (the fastest counts);
    ``log`` gets a line per row. ``clock``: ``"wall"`` (elapsed) or ``"cpu"`` (the process's
    CPU time, every thread: steady on a shared machine with one torch thread)."""
    timer = time.process_time if clock == "cpu" else time.perf_counter
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for kind in KINDS:
        model = build(kind, sizes.d_model, sizes.heads, sizes.state_size, sizes.d_ff,
                      sizes.window, sizes.vocab, seed)  # fmt: skip
        params = sum(p.numel() for p in model.parameters())
        with torch.inference_mode():  # warm-up: first calls pay for lazy set-up
            warm = model.make_cache("static", 1, 2 * sizes.window)
            model(torch.zeros(1, sizes.window, dtype=torch.long), cache=warm)
            model(torch.zeros(1, 1, dtype=torch.long), cache=warm)
        for T in sizes.lengths:
            ids = torch.randint(sizes.vocab, (1, T), generator=gen)
            steps = torch.randint(sizes.vocab, (1, sizes.decode_steps), generator=gen)
            cache_kind = "window" if kind == "attention-window" else "static"
            prefill = math.inf
            with torch.inference_mode():
                for _ in range(repeat):
                    cache = model.make_cache(cache_kind, 1, T + sizes.decode_steps)
                    t0 = timer()
                    model(ids, cache=cache, logits_to_keep=1)
                    prefill = min(prefill, timer() - t0)
                times = []
                for i in range(sizes.decode_steps):
                    t0 = timer()
                    model(steps[:, i : i + 1], cache=cache)
                    times.append(timer() - t0)
            times.sort()
            rows.append(dict(
                section="cost", model=kind, T=T, params=params,
                prefill_ms_per_token=prefill * 1e3 / T,
                decode_ms_per_token=times[len(times) // 2] * 1e3,
                cache_bytes=_cache_bytes(cache),
            ))  # fmt: skip
            r = rows[-1]
            log(f"cost: {kind} T={T:,}: prefill {r['prefill_ms_per_token']:.3f} ms/token, "
                f"decode {r['decode_ms_per_token']:.1f} ms/token")  # fmt: skip
    return rows


METRICS = ("prefill_ms_per_token", "decode_ms_per_token", "cache_bytes")


def crossovers(rows: list[dict]) -> list[dict]:
    """Per alternative and metric, the shortest measured T from which the alternative costs less
    than full attention at every longer measured T (None: not within the lengths measured)."""
    by = {(r["model"], r["T"]): r for r in rows if r.get("section") == "cost"}
    lengths = sorted({T for _, T in by})
    out = []
    for kind in KINDS:
        if kind == "attention":
            continue
        for metric in METRICS:
            cheaper = [by[kind, T][metric] < by["attention", T][metric] for T in lengths]
            at = None
            for i in range(len(lengths)):
                if all(cheaper[i:]):
                    at = lengths[i]
                    break
            out.append(dict(section="crossover", model=kind, metric=metric, T=at))
    return out


# -- MQAR ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MQAR:
    """MQAR run sizes: models of ``d_model`` and 4 layers (``heads`` heads; Mamba-2's state
    ``state_size``), trained ``steps`` steps of ``batch`` sequences at learning rate ``lr``, the
    steps taking each number of key-value pairs in ``pairs`` in turn (as Zoology trains on a
    mix); keys and values each drawn from ``kv_vocab`` tokens; accuracy at each number of pairs
    on ``eval_batch`` fresh sequences. ``state_sizes``: Mamba-2's state sizes swept."""

    d_model: int = 64
    heads: int = 4
    # Mamba-2's (and the hybrid's) state: 1 recalls 2 pairs but not 4 or 8, so the default run
    # shows the fixed state failing where the hybrid's attention layer recovers recall
    state_size: int = 1
    d_ff: int = 128
    kv_vocab: int = 16
    # trained on 8 pairs alone, attention reached 0.38 in 500 steps (1.00 in 1000); on the mix of
    # 2, 4 and 8 pairs it recalls all three in 500, but Mamba-2 with state 16 needs 800 to
    # recall 8 pairs exactly (0.92 in 500, 0.999 in 800)
    steps: int = 800
    batch: int = 64
    lr: float = 5e-3
    eval_batch: int = 256
    # CPU ms per training step (one thread, batch 64) at 2 / 4 / 8 pairs: attention ~15 / 31 / 61,
    # Mamba-2 ~32 / 63 / 128, gated DeltaNet ~37 / 73 / 135, hybrid ~30 / 60 / 96 (16 pairs
    # cost 2.2-2.5x 8 pairs): 6 trainings of 800 steps on the mix are ~5.5 CPU-minutes
    pairs: tuple[int, ...] = (2, 4, 8)
    state_sizes: tuple[int, ...] = (1, 4, 16)
    seed: int = 0

    def quick(self) -> MQAR:
        """A trivially small instance (one pair: the value is the token before the query) that
        every model learns in seconds."""
        return dataclasses.replace(self, d_model=32, d_ff=64, kv_vocab=8, steps=50, lr=1e-2,
                                   batch=16, pairs=(1,), state_sizes=(),
                                   eval_batch=64)  # fmt: skip


def mqar_batch(batch: int, n_pairs: int, kv_vocab: int, gen: torch.Generator):
    """``(ids (B, 4n), labels (B, 4n))``: ``k1 v1 .. kn vn`` then the keys in a new order, each
    followed by its value; keys are tokens ``0 .. kv_vocab-1`` (distinct in a row), values
    ``kv_vocab .. 2·kv_vocab-1``; the label at each queried key is its value, else ignored."""
    if n_pairs > kv_vocab:
        raise ValueError(f"MQAR needs n_pairs ({n_pairs}) <= kv_vocab ({kv_vocab}): distinct keys")
    keys = torch.rand(batch, kv_vocab, generator=gen).argsort(-1)[:, :n_pairs]  # (B, n)
    values = kv_vocab + torch.randint(kv_vocab, (batch, n_pairs), generator=gen)
    order = torch.rand(batch, n_pairs, generator=gen).argsort(-1)
    qk, qv = keys.gather(1, order), values.gather(1, order)
    context = torch.stack([keys, values], -1).flatten(1)  # (B, n, 2) -> (B, 2n)
    queries = torch.stack([qk, qv], -1).flatten(1)
    ids = torch.cat([context, queries], 1)  # (B, 4n)
    labels = torch.full_like(ids, IGNORE)
    labels[:, 2 * n_pairs :: 2] = qv  # at each queried key: its value
    return ids, labels


def _mqar_model(kind: str, run: MQAR, state_size: int) -> HybridLM:
    return build(kind, run.d_model, run.heads, state_size, run.d_ff, window=1,
                 vocab=2 * run.kv_vocab, seed=run.seed)  # fmt: skip


def train_mqar(kind: str, run: MQAR, state_size: int | None = None) -> list[dict]:
    """Train one model on MQAR, its steps taking ``run.pairs`` key-value pairs in turn (as Zoology
    trains on a mix); one row per number of pairs: its accuracy on fresh sequences."""
    state_size = run.state_size if state_size is None else state_size
    model = _mqar_model(kind, run, state_size).train()
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, run.lr, total_steps=run.steps)
    gen = torch.Generator().manual_seed(run.seed)
    last_loss = {}
    t0 = time.perf_counter()
    for step in range(run.steps):
        n = run.pairs[step % len(run.pairs)]
        ids, labels = mqar_batch(run.batch, n, run.kv_vocab, gen)
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        last_loss[n] = float(loss.detach())
    train_s = time.perf_counter() - t0
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for n in run.pairs:
        ids, labels = mqar_batch(run.eval_batch, n, run.kv_vocab,
                                 torch.Generator().manual_seed(run.seed + 1))  # fmt: skip
        with torch.inference_mode():
            pred = model(ids).argmax(-1)
            cache = model.make_cache("static", 1, ids.shape[1])
            model(ids[:1], cache=cache)
        scored = labels != IGNORE
        rows.append(dict(
            section="mqar", model=kind, pairs=n, state_size=state_size,
            accuracy=float((pred[scored] == labels[scored]).float().mean()),
            final_loss=last_loss.get(n, math.nan), train_s=train_s, params=params,
            state_bytes=_cache_bytes(cache),  # what it carries after the sequence, one sequence
        ))  # fmt: skip
    return rows


def _train_one(kind: str, run: MQAR, state_size: int) -> list[dict]:
    """:func:`train_mqar` on one torch thread (the process pool's job): a model this small gains
    less from a second thread than the thread costs, and one thread makes every run of a seed
    give the same numbers, however many run at once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_mqar(kind, run, state_size)
    finally:
        torch.set_num_threads(threads)


def mqar(run: MQAR, kinds=MQAR_KINDS, log: Callable[[str], None] = _quiet,
         jobs: int = 1) -> list[dict]:  # fmt: skip
    """Accuracy vs the number of pairs for each model, then Mamba-2's at its other state sizes
    (``sweep: "state_size"``); ``log`` gets a line per trained model. Each model trains on one
    thread; ``jobs > 1`` trains that many at once, each in a process of its own."""
    todo = [(kind, run.state_size, {}) for kind in kinds]
    todo += [("mamba2", N, {"sweep": "state_size"}) for N in run.state_sizes if N != run.state_size]
    results: list = [None] * len(todo)

    def done(i: int, trained: list[dict]) -> None:
        kind, N, extra = todo[i]
        results[i] = [dict(r, **extra) for r in trained]
        accuracy = ", ".join(f"{r['accuracy']:.3f}" for r in trained)
        log(f"mqar {sum(r is not None for r in results)}/{len(todo)}: {kind}, state {N}: "
            f"accuracy {accuracy} at {','.join(map(str, run.pairs))} pairs "
            f"({trained[0]['train_s']:.0f} s)")  # fmt: skip

    if jobs <= 1:
        for i, (kind, N, _) in enumerate(todo):
            done(i, _train_one(kind, run, N))
    else:  # spawn: a forked child of a process that ran OpenMP threads may hang
        import concurrent.futures
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {pool.submit(_train_one, kind, run, N): i
                       for i, (kind, N, _) in enumerate(todo)}  # fmt: skip
            for future in concurrent.futures.as_completed(futures):
                done(futures[future], future.result())
    return [row for trained in results for row in trained]


# -- report ----------------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    from selfattn.cache import format_bytes

    return format_bytes(n)


def print_report(report: dict) -> None:
    rows = report["rows"]
    cost_rows = [r for r in rows if r["section"] == "cost"]
    if cost_rows:
        _util.print_table(
            ["model", "T", "prefill ms/token", "decode ms/token", "cache"],
            [
                [
                    r["model"],
                    f"{r['T']:,}",
                    f"{r['prefill_ms_per_token']:.4f}",
                    f"{r['decode_ms_per_token']:.3f}",
                    _fmt_bytes(r["cache_bytes"]),
                ]
                for r in cost_rows
            ],
            title="cost per token vs context length (batch 1, fp32, CPU)",
        )
        _util.print_table(
            ["model", "metric", "cheaper than attention from T"],
            [
                [r["model"], r["metric"], "-" if r["T"] is None else f"{r['T']:,}"]
                for r in rows
                if r["section"] == "crossover"
            ],
            title="crossovers (shortest measured T from which it stays cheaper)",
        )
    recall = [r for r in rows if r["section"] == "mqar"]
    if recall:
        _util.print_table(
            [
                "model",
                "pairs",
                "state size",
                "accuracy",
                "loss",
                "params",
                "state / cache",
                "train s",
            ],
            [
                [
                    r["model"],
                    str(r["pairs"]),
                    str(r["state_size"]),
                    f"{r['accuracy']:.3f}",
                    f"{r['final_loss']:.3f}",
                    f"{r['params']:,}",
                    _fmt_bytes(r["state_bytes"]),
                    f"{r['train_s']:.1f}",
                ]
                for r in recall
            ],
            title="MQAR recall (accuracy at the queried keys, fresh sequences)",
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return p


def _cpu_s() -> float:
    """User + system CPU seconds so far of this process (every thread) and of its children
    that ended (the MQAR worker processes)."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usages)


def default_jobs() -> int:
    """MQAR trainings at once by default: 2 (one per core of a 2-core machine), 1 on one core."""
    return min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def configure(args) -> tuple[Sizes, MQAR]:
    """The run sizes of ``selfattn compare``'s arguments (the defaults, ``--quick``'s, then each
    flag given)."""
    sizes, recall = Sizes(), MQAR()
    if args.quick:
        sizes, recall = sizes.quick(), recall.quick()
    if args.max_len:  # the default lengths up to --max-len, then doublings up to it
        lengths = [T for T in sizes.lengths if T <= args.max_len] or [args.max_len]
        while 2 * lengths[-1] <= args.max_len:
            lengths.append(2 * lengths[-1])
        sizes = dataclasses.replace(sizes, lengths=tuple(lengths))
    if args.decode_steps:
        sizes = dataclasses.replace(sizes, decode_steps=args.decode_steps)
    flags = dict(steps=args.steps, batch=args.batch, pairs=args.pairs, state_size=args.state_size,
                 state_sizes=args.state_sizes)  # fmt: skip
    recall = dataclasses.replace(recall, seed=args.seed, **{k: v for k, v in flags.items() if v})
    if max(recall.pairs) > recall.kv_vocab:
        raise ValueError(
            f"--pairs {','.join(map(str, recall.pairs))}: at most kv_vocab ({recall.kv_vocab}) "
            "pairs (the keys of a sequence are distinct); use fewer pairs"
        )
    return sizes, recall


def run(args) -> dict:
    """The report of :func:`main`'s arguments: ``{"machine", "sizes", "mqar", "rows", "run_s",
    "cpu_s"}``; a progress line per row on stderr."""
    sizes, recall = configure(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    start, cpu0 = time.perf_counter(), _cpu_s()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr, flush=True)

    rows = []
    if args.only in (None, "cost"):
        rows += cost(sizes, args.repeat, args.seed, log, args.clock)
        rows += crossovers(rows)
    if args.only in (None, "mqar"):
        rows += mqar(recall, log=log, jobs=args.jobs or default_jobs())
    return {
        "machine": _util.machine(),
        "sizes": dataclasses.asdict(sizes),
        "mqar": dataclasses.asdict(recall),
        "rows": rows,
        "clock": args.clock,
        "run_s": time.perf_counter() - start,
        "cpu_s": _cpu_s() - cpu0,
    }


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        configure(args)  # a bad combination of flags is a usage error, before any work
    except ValueError as e:
        p.error(str(e))
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- plots -----------------------------------------------------------------------------------------

_LABELS = {
    "prefill_ms_per_token": "prefill, ms per token",
    "decode_ms_per_token": "decode, ms per generated token",
    "cache_bytes": "cache bytes (KV cache or state), one sequence",
}
# Okabe & Ito's colour-blind-safe colours, each model also its own marker and line style, so the
# curves stay apart in grey too
_STYLE = {
    "attention": dict(color="#0072B2", marker="o", linestyle="-"),
    "attention-window": dict(color="#56B4E9", marker="s", linestyle="--"),
    "mamba2": dict(color="#E69F00", marker="^", linestyle="-."),
    "deltanet": dict(color="#009E73", marker="D", linestyle=":"),
    "hybrid": dict(color="#CC79A7", marker="v", linestyle="-"),
}


_DODGE = 1.025  # x factor between neighbouring MQAR curves (log axis)


def plot(report: dict, out_dir) -> list:
    """One PNG per metric into ``out_dir``: each cost metric vs context length (log-log), MQAR
    accuracy vs the number of pairs, and vs the state each model carries. Returns the paths."""
    from pathlib import Path

    from selfattn._optional import require

    Figure = require("matplotlib.figure", purpose="selfattn compare").Figure
    ticker = require("matplotlib.ticker", purpose="selfattn compare")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, paths = report["rows"], []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        paths.append(out / name)

    def axes(**labels):
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        ax.set(**labels)
        ax.grid(True, which="major", alpha=0.3)
        return fig, ax

    cost_rows = [r for r in rows if r["section"] == "cost"]
    clocked = " (CPU time)" if report.get("clock") == "cpu" else ""
    for metric in METRICS if cost_rows else ():
        fig, ax = axes(xscale="log", yscale="log", xlabel="context length T (tokens)",
                       ylabel=_LABELS[metric], title=_LABELS[metric])  # fmt: skip
        if metric != "cache_bytes":
            ax.set_title(_LABELS[metric] + clocked)
        for kind in KINDS:
            pts = [(r["T"], r[metric]) for r in cost_rows if r["model"] == kind]
            ax.plot(*zip(*pts), label=kind, **_STYLE[kind])
        lengths = sorted({r["T"] for r in cost_rows})
        ax.set_xticks(lengths, [f"{T // 1024}k" if T >= 1024 else str(T) for T in lengths])
        ax.minorticks_off()
        # ticks at 1, 2, 5 per decade, labelled plainly: a curve spanning less than a decade
        # would otherwise have one labelled tick
        if metric == "cache_bytes":  # powers of 4: 256 KiB, 1 MiB, 4 MiB, ...
            ax.yaxis.set_major_locator(ticker.LogLocator(base=4))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _fmt_bytes(int(v))))
        else:
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.legend(fontsize=8)
        save(fig, f"{metric}.png")
    recall = [r for r in rows if r["section"] == "mqar"]
    if recall:
        chance = 1 / report["mqar"]["kv_vocab"]
        state = report["mqar"]["state_size"]
        pairs = sorted({r["pairs"] for r in recall if "sweep" not in r})
        fig, ax = axes(xscale="log", ylim=(0, 1.05), xlabel="key-value pairs",
                       ylabel="MQAR accuracy", title="recall vs number of pairs")  # fmt: skip
        series = [(kind, f"{kind} (state {state})" if kind in ("mamba2", "hybrid") else kind,
                   [r for r in recall if r["model"] == kind and "sweep" not in r], _STYLE[kind])
                  for kind in MQAR_KINDS]  # fmt: skip
        swept = sorted({r["state_size"] for r in recall if "sweep" in r})  # Mamba-2's others
        for N, marker in zip(swept, itertools.cycle("<>ph")):
            style = dict(_STYLE["mamba2"], marker=marker, linewidth=0.9, markerfacecolor="white")
            pts = [r for r in recall if "sweep" in r and r["state_size"] == N]
            series.append(("mamba2", f"mamba2 (state {N})", pts, style))
        for i, (_, label, pts, style) in enumerate(series):
            # curves at equal accuracy would hide each other: each is shifted a little along x
            dodge = _DODGE ** (i - (len(series) - 1) / 2)
            ax.plot([r["pairs"] * dodge for r in pts], [r["accuracy"] for r in pts], label=label,
                    **style)  # fmt: skip
        ax.axhline(chance, color="grey", linewidth=0.8, linestyle="--", label="chance")
        ax.set_xticks(pairs, [str(n) for n in pairs])
        ax.minorticks_off()
        ax.legend(fontsize=8)
        save(fig, "mqar_pairs.png")
        n = max(pairs)
        fig, ax = axes(xscale="log", ylim=(0, 1.05), ylabel="MQAR accuracy",
                       xlabel="state / cache bytes after the sequence",
                       title=f"recall vs state size ({n} pairs)")  # fmt: skip
        for kind in MQAR_KINDS:
            at_n = sorted((r["state_bytes"], r["accuracy"], r["state_size"]) for r in recall
                          if r["model"] == kind and r["pairs"] == n)  # fmt: skip
            ax.plot([b for b, _, _ in at_n], [a for _, a, _ in at_n], label=kind, **_STYLE[kind])
            if kind == "mamba2":  # its points are its state sizes: name them
                for b, a, N in at_n:
                    ax.annotate(f"state {N}", (b, a), textcoords="offset points", xytext=(4, -10),
                                fontsize=7)  # fmt: skip
        ax.axhline(chance, color="grey", linewidth=0.8, linestyle="--", label="chance")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=2))  # 8 KiB, 16 KiB, ...
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _fmt_bytes(int(v))))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.legend(fontsize=8)
        save(fig, "mqar_state.png")
    return paths
