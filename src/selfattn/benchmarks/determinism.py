"""Batch invariance on this machine: does a row round the same alone and in a batch, and what
deterministic mode (:mod:`selfattn.kernels.determinism`) costs a decode step.

    python -m selfattn.benchmarks.determinism            # SmolLM2 shapes, 1 and 2 threads
    python -m selfattn.benchmarks.determinism --quick --json

Invariance rows (``kind`` "invariance"), each at 1 and 2 threads: for ``M`` in 1, 2, 7, 16, 33,
128 rows, whether row 0 of the ``M``-row result equals row 0 computed alone (``row0``), and
whether every row equals that row alone (``all_rows``), for

- torch's ``x @ W.T`` in fp32 and bf16 at SmolLM2-135M's shapes (d=576, d_ff=1536, vocab
  49,152: q/o, gate/up, down, LM head), and ``invariant_linear`` (deterministic mode's linear);
- the quantised matmul (``QuantizedLinear`` q8_0 of the d_ff x d weight; past ``KERNEL_ROWS``
  rows it dequantises and calls torch's matmul) by default and in deterministic mode;
- the C paged-decode kernel: sequence 0 (1,000 keys) alone and beside ``M - 1`` others of
  random lengths, by default and in deterministic mode.

Cost rows (``kind`` "cost"): decode steps of a SmolLM2-shaped random model (30 layers, 9 heads,
3 KV heads; ``--quick``: 4 layers and a 4,096 vocabulary) in the Engine, ``B`` requests of 64
prompt tokens each decoding, CPU time per step on one thread (median of the decode-only steps,
the two modes' runs interleaved), deterministic over default. Target: <= 1.3x.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from selfattn.benchmarks import _util

ROWS = (1, 2, 7, 16, 33, 128)
# SmolLM2-135M: (out, in) of each distinct projection shape
SHAPES = {"q/o": (576, 576), "gate/up": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}
TARGET_RATIO = 1.3


def _invariant(fn, x: torch.Tensor) -> tuple[bool, bool]:
    """``(row 0 of fn(x[:M]) == fn(x[:1])[0], every row == that row alone)`` for the ``M``
    rows of ``x``."""
    batch = fn(x)
    alone = [fn(x[i : i + 1])[0] for i in range(x.shape[0])]
    return torch.equal(batch[0], alone[0]), all(torch.equal(batch[i], a) for i, a in
                                                enumerate(alone))  # fmt: skip


def matmul_rows(threads: int, quick: bool) -> list[dict]:
    from selfattn.kernels.determinism import invariant_linear

    rows, g = [], torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for name, (n, k) in SHAPES.items():
            if quick and name == "lm_head":
                n = 4096
            w = torch.randn(n, k, generator=g).to(dtype)
            for M in ROWS[:4] if quick else ROWS:
                x = torch.randn(M, k, generator=g).to(dtype)
                for op, fn in (("torch x @ W.T", lambda x, w=w: x @ w.T),
                               ("invariant_linear",
                                lambda x, w=w: invariant_linear(x, w))):  # fmt: skip
                    row0, every = _invariant(fn, x)
                    rows.append({"kind": "invariance", "op": op, "shape": f"{name} {n}x{k}",
                                 "dtype": str(dtype).removeprefix("torch."), "threads": threads,
                                 "M": M, "row0": row0, "all_rows": every})  # fmt: skip
    return rows


def quant_rows(threads: int, quick: bool) -> list[dict]:
    from selfattn.kernels.determinism import deterministic
    from selfattn.nn.quant import QuantizedLinear

    g = torch.Generator().manual_seed(1)
    layer = QuantizedLinear.from_float(torch.randn(1536, 576, generator=g), "q8_0")
    rows = []
    for M in ROWS[:4] if quick else ROWS:
        x = torch.randn(M, 576, generator=g)
        for mode in (False, True):
            with torch.inference_mode(), deterministic(mode):
                row0, every = _invariant(layer, x)
            rows.append({"kind": "invariance", "op": "QuantizedLinear q8_0",
                         "shape": "gate/up 1536x576", "dtype": "float32", "threads": threads,
                         "M": M, "deterministic": mode, "row0": row0,
                         "all_rows": every})  # fmt: skip
    return rows


def decode_rows(threads: int, quick: bool) -> list[dict]:
    from selfattn.kernels import paged_decode
    from selfattn.kernels.determinism import deterministic

    if paged_decode.library() is None:
        return []
    P, Hq, Hkv, D = 16, 9, 3, 64
    g = torch.Generator().manual_seed(2)
    rng = random.Random(2)
    rows = []
    for M in ROWS[:4] if quick else ROWS:
        lens = [1000] + [rng.randint(1, 2000) for _ in range(M - 1)]
        pages = [-(-n // P) for n in lens]
        N = sum(pages)
        kp, vp = torch.randn(N, P, Hkv, D, generator=g), torch.randn(N, P, Hkv, D, generator=g)
        table = torch.full((M, max(pages)), 0, dtype=torch.int32)
        ids = torch.randperm(N, generator=g).int()
        at = 0
        for b, n in enumerate(pages):
            table[b, :n], at = ids[at : at + n], at + n
        hi = torch.tensor(lens, dtype=torch.int64)[:, None]  # (M, 1): decode rows
        lo = torch.zeros_like(hi)
        q = torch.randn(M, Hq, 1, D, generator=g)
        for mode in (False, True):
            with deterministic(mode):
                out, _ = paged_decode.decode(q, kp, vp, table, lo, hi, D**-0.5, None, None)
                alone, _ = paged_decode.decode(q[:1], kp, vp, table[:1], lo[:1], hi[:1],
                                               D**-0.5, None, None)  # fmt: skip
            rows.append({"kind": "invariance", "op": "paged decode kernel",
                         "shape": f"seq0 1000 keys, Hq {Hq}, Hkv {Hkv}, D {D}", "dtype": "float32",
                         "threads": threads, "M": M, "deterministic": mode,
                         "row0": torch.equal(out[0], alone[0]), "all_rows": None})  # fmt: skip
    return rows


def smollm2_like(quick: bool):
    from selfattn.models.decoder import DecoderConfig, Llama

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=4096 if quick else 49152, d_model=576,
                        n_layers=4 if quick else 30, n_heads=9, n_kv_heads=3, d_ff=1536,
                        max_positions=2048, tie_embeddings=True)  # fmt: skip
    return Llama(cfg).eval()


def step_times(model, batch: int, mode: bool, steps: int) -> list[float]:
    """CPU seconds of each decode-only step of ``batch`` requests in an Engine."""
    from selfattn.serving import Engine, SamplingParams

    engine = Engine(model, deterministic=mode, kv_cache_bytes=256 * 2**20)
    g = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([g.randrange(2, 4000) for _ in range(64)], params)
    times = []
    while engine.has_unfinished():
        decoding = all(s.num_computed >= len(s.tokens) - 1 for s in engine.scheduler.running)
        t0 = time.process_time()
        engine.step()
        if decoding and len(engine.scheduler.running) == batch:
            times.append(time.process_time() - t0)
    return times


def cost_rows(quick: bool) -> list[dict]:
    torch.set_num_threads(1)
    model = smollm2_like(quick)
    rows = []
    with torch.inference_mode():
        for batch in (1, 16):
            runs = {False: [], True: []}
            for _ in range(2):  # interleaved: a busy host slows both alike
                for mode in (False, True):
                    runs[mode] += step_times(model, batch, mode, 4 if quick else 12)
            base, det = (statistics.median(runs[m]) for m in (False, True))
            # ours: deterministic, peer: the default mode
            rows.append({"kind": "cost", "batch": batch, "ours_ms": det * 1e3,
                         "peer_ms": base * 1e3, "ratio": det / base,
                         "target": f"<= {TARGET_RATIO}",
                         "met": det / base <= TARGET_RATIO})  # fmt: skip
    return rows


def run(args) -> dict:
    before = torch.get_num_threads()
    rows = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rows += matmul_rows(threads, args.quick)
            rows += quant_rows(threads, args.quick)
            rows += decode_rows(threads, args.quick)
        if not args.no_cost:
            rows += cost_rows(args.quick)
    finally:
        torch.set_num_threads(before)
    setup = {"model": "SmolLM2-shaped random" + (" (--quick: 4 layers)" if args.quick else ""),
             "rows": list(ROWS), "torch": torch.__version__}  # fmt: skip
    return {"machine": _util.machine(), "setup": setup, "rows": rows}


def table(report: dict) -> list[list[str]]:
    out = []
    for r in report["rows"]:
        if r["kind"] == "cost":
            out.append([f"decode step, B={r['batch']}", "", "", "1", "",
                        f"{r['peer_ms']:.1f} -> {r['ours_ms']:.1f} ms",
                        f"{r['ratio']:.2f}x ({_util.verdict(r)})"])  # fmt: skip
            continue
        mode = {None: "", False: " (default)", True: " (deterministic)"}[r.get("deterministic")]
        every = "-" if r["all_rows"] is None else str(r["all_rows"])
        out.append([r["op"] + mode, r["shape"], r["dtype"], str(r["threads"]), str(r["M"]),
                    str(r["row0"]), every])  # fmt: skip
    return out


COLUMNS = ["op", "shape", "dtype", "threads", "M", "row 0 == alone", "all rows == alone"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true",
                   help="M up to 16, a 4-layer model: a smoke run")  # fmt: skip
    p.add_argument("--no-cost", action="store_true", help="the invariance rows only")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    report = run(args)
    m = report["machine"]
    _util.print_report(report, args.json, COLUMNS, table,
                       f"Batch invariance ({m['cpu']}, {m['date']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
