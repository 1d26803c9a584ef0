"""StreamingLLM sink tokens (``make_cache("streaming")``) past the trained length, on CPU.

    python -m selfattn.benchmarks.streaming           # train 400 steps at 64 tokens, 16x past it
    python -m selfattn.benchmarks.streaming --quick   # 100 steps, 4x: a smoke run
    python -m selfattn.benchmarks.streaming --json

The model is a tiny random Llama (2 layers, d_model 64, GQA 4/2, RoPE) trained here for a few
hundred steps on a synthetic text, always from a BOS token at position 0 and never longer than
``--train-len`` tokens: a random sequence of a dozen fixed "phrases" (so the next token is
predictable from the last few, except at phrase starts). No model hub, no data set.

Rows:

- perplexity on a text ``--factor`` times the trained length, decoded one token a step:
  streaming (``n_sink`` sinks + window, RoPE positions by cache slot, the paper's), the same at
  text positions, plain windowing (no sinks, slot positions) and full attention (one causal
  forward; its positions run past the trained length). Each row's ratio is streaming's
  perplexity over the row's. The paged streaming cache's perplexities (text positions, and
  kernel-index positions: the paged form of the paper's) are in the setup.
- memory: the streaming cache's K/V bytes after the whole text over its bytes after one
  trained length (target <= 1.0: flat), the same for the paged streaming cache's pages in use
  (passed window pages go back to the pool), and a static cache of the whole text for contrast.
- time per token: the median decode step over the last stretch of the text over the median
  over the first stretch after the window filled (target <= 1.25: flat), streaming and static.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from selfattn.benchmarks import _util
from selfattn.models.decoder import DecoderConfig, Llama

BOS, N_PHRASES, PHRASE_LEN = 0, 12, (3, 7)  # the synthetic text's shape
PAGE_SIZE = 8  # the paged streaming cache's page
FLAT_TIME = 1.25  # "bounded per-token time": late steps at most this much slower than early ones


def phrases(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(*PHRASE_LEN, (N_PHRASES,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def text(book: list[list[int]], length: int, g: torch.Generator) -> torch.Tensor:
    """``(length,)`` tokens: BOS, then random phrases of ``book``."""
    out = [BOS]
    while len(out) < length:
        out += book[int(torch.randint(len(book), (1,), generator=g))]
    return torch.tensor(out[:length])


def train(args) -> Llama:
    torch.manual_seed(args.seed)
    cfg = DecoderConfig(vocab_size=args.vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=128)  # fmt: skip
    model = Llama(cfg)
    book, g = phrases(args.vocab, args.seed), torch.Generator().manual_seed(args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(args.steps):
        batch = torch.stack([text(book, args.train_len, g) for _ in range(args.batch)])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.final_loss = float(loss.detach())
    return model.eval()


@torch.inference_mode()
def decode(model, ids: torch.Tensor, cache) -> tuple[float, list[float], list[int]]:
    """Perplexity of ``ids (N,)`` decoded one token a step, the steps' seconds, and the cache's
    bytes after each step (``memory_bytes``, or the static caches' storage)."""
    nll, times, sizes = 0.0, [], []
    for t in range(len(ids) - 1):
        t0 = time.perf_counter()
        logits = model(ids[None, t : t + 1], cache=cache)
        times.append(time.perf_counter() - t0)
        nll -= float(F.log_softmax(logits[0, -1].double(), -1)[ids[t + 1]])
        sizes.append(cache_bytes(cache))
    return math.exp(nll / (len(ids) - 1)), times, sizes


def cache_bytes(cache) -> int:
    """K/V bytes a cache holds: its storage, or a paged cache's pages in use (all layers)."""
    if hasattr(cache, "memory_bytes"):
        return cache.memory_bytes
    if hasattr(cache, "cache"):  # a paged view: the pages its sequences hold now
        kv = cache.cache
        page = kv.k_store[:, 0].numel() * kv.k_store.element_size()
        page += kv.v_store[:, 0].numel() * kv.v_store.element_size()
        return kv.pool.num_used * page
    return sum(t.numel() * t.element_size() for c in cache.layers for t in (c.k, c.v))


@torch.inference_mode()
def full_attention_ppl(model, ids: torch.Tensor) -> float:
    logits = model(ids[None, :-1])[0].double()
    return math.exp(float(F.cross_entropy(logits, ids[1:])))


def run(args) -> dict:
    model = train(args)
    n = args.train_len * args.factor
    ids = text(phrases(args.vocab, args.seed), n, torch.Generator().manual_seed(args.seed + 2))
    stream = dict(n_sink=args.n_sink, window=args.window)
    caches = {
        "streaming": model.make_cache("streaming", 1, **stream),
        "streaming, text positions": model.make_cache(
            "streaming", 1, **stream, positions="absolute"
        ),
        "streaming, paged (text positions)": model.make_cache(
            "streaming", 1, **stream, positions="absolute", paged=True, page_size=PAGE_SIZE
        ),
        "streaming, paged (kernel-index positions)": model.make_cache(
            "streaming", 1, **stream, paged=True, page_size=PAGE_SIZE
        ),
        "plain window": model.make_cache("streaming", 1, n_sink=0, window=args.window),
        "static (full attention)": model.make_cache("static", 1, n),
    }
    runs = {name: decode(model, ids, c) for name, c in caches.items()}
    ppl = {name: r[0] for name, r in runs.items()}
    ppl["full attention"] = full_attention_ppl(model, ids)
    rows = []
    ours = ppl["streaming"]
    for name in ("streaming, text positions", "plain window", "full attention"):
        rows.append({
            "case": f"perplexity over {n} tokens ({args.factor}x trained), streaming vs {name}",
            "ours": ours, "peer": name, "peer_value": ppl[name], "ratio": ours / ppl[name],
            "target": "<= 1.0", "met": ours / ppl[name] <= 1.0,
        })  # fmt: skip
    _, times, sizes = runs["streaming"]
    first, last = sizes[args.train_len - 1], sizes[-1]
    rows.append({
        "case": f"streaming K/V bytes after {n} tokens vs after {args.train_len}",
        "ours_bytes": last, "peer": f"after {args.train_len}", "peer_bytes": first,
        "ratio": last / first, "target": "<= 1.0", "met": last <= first,
    })  # fmt: skip
    paged = runs["streaming, paged (text positions)"][2]
    rows.append({
        "case": f"paged streaming: bytes of pages held after {n} tokens vs after "
        f"{args.train_len} ({PAGE_SIZE}-token pages, passed ones freed)",
        "ours_bytes": paged[-1], "peer": f"after {args.train_len}",
        "peer_bytes": paged[args.train_len - 1], "ratio": paged[-1] / paged[args.train_len - 1],
        "target": "<= 1.0", "met": paged[-1] <= paged[args.train_len - 1],
    })  # fmt: skip
    static_bytes = cache_bytes(caches["static (full attention)"])
    rows.append({
        "case": f"streaming K/V bytes vs a static cache of {n} tokens",
        "ours_bytes": last, "peer": "static cache", "peer_bytes": static_bytes,
        "ratio": last / static_bytes, "target": "report",
    })  # fmt: skip
    stretch = args.train_len  # steps per timed stretch
    start = args.n_sink + args.window  # the window is full from here on
    for name in ("streaming", "static (full attention)"):
        times = runs[name][1]
        early = statistics.median(times[start : start + stretch])
        late = statistics.median(times[-stretch:])
        rows.append({
            "case": f"{name}: ms/token over the last {stretch} of {n} tokens vs the first",
            "ours_ms": late * 1e3, "peer": "early steps", "peer_ms": early * 1e3,
            "ratio": late / early, "target": f"<= {FLAT_TIME}", "met": late / early <= FLAT_TIME,
        })  # fmt: skip
    setup = {
        "model": "random Llama, 2 layers, d_model 64, GQA 4/2, RoPE, trained here",
        "train_steps": args.steps, "train_len": args.train_len, "final_train_loss":
        model.final_loss, "text_tokens": n, "n_sink": args.n_sink, "window": args.window,
        "perplexity": ppl,
    }  # fmt: skip
    return {"machine": _util.machine(), "setup": setup, "rows": rows}


_COLUMNS = ["case", "ours", "peer", "peer value", "ours/peer", "target", "met?"]


def _table(report: dict) -> list[list[str]]:
    table = []
    for r in report["rows"]:
        ours = r.get("ours", r.get("ours_bytes", r.get("ours_ms")))
        peer = r.get("peer_value", r.get("peer_bytes", r.get("peer_ms")))
        table.append([r["case"], f"{ours:.4g}", r["peer"], f"{peer:.4g}", f"{r['ratio']:.3f}",
                      r["target"], _util.verdict(r)])  # fmt: skip
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="100 training steps, 4x: a smoke run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=None, help="training steps (400; quick 100)")
    p.add_argument("--factor", type=int, default=None, help="text / trained length (16; quick 4)")
    p.add_argument("--train-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=48)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=28)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: tiny steps, steadier on a shared machine)")  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.steps = args.steps or (100 if args.quick else 400)
    args.factor = args.factor or (4 if args.quick else 16)
    _util.print_report(run(args), args.json, _COLUMNS, _table, "StreamingLLM sink tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
