"""Decode over a paged KV cache on CPU: ``selfattn.cache.paged_attention`` vs SDPA and vs memory.

    python -m selfattn.benchmarks.decode           # B=32, 4,096-token contexts
    python -m selfattn.benchmarks.decode --quick   # B=4, 512-token contexts: a smoke run
    python -m selfattn.benchmarks.decode --json

Decode: one new query per sequence (Sq = 1), 32 query / 8 kv heads, D = 128, page size 16. Every
sequence holds exactly ``S`` tokens (no ragged lengths); the block table is a random permutation
of the pool's ``B · S / 16`` pages, so consecutive logical pages sit anywhere in memory. Pages in
fp32, bf16, int8 (per token and head scales) and fp8 e4m3 (per head scales); the query in the
page dtype (bf16 for int8 and fp8 pages). Peers: ``F.scaled_dot_product_attention(enable_gqa=
True)`` on the same K/V already made contiguous ``(B, Hkv, S, D)`` (the gather is not timed),
the same SDPA with the gather timed (fp32), and our own bf16 pages for the 1-byte pages. Ours and
each peer are timed interleaved after one warm-up call each; the table shows medians (the
1-byte pages' rows also the two fastest rounds, no target: on a busy host int8's compute slows
with the host's CPU and bf16's memory-bound time does not, so the medians move). GB/s
counts the bytes a call must read (K/V pages and their scales). The memory rates each bandwidth
row compares with, each timed interleaved with the paged decode call in the same run (this VM's
rates move 38-63 GB/s between runs): the copy rate, a large tensor copy's bytes read plus written
per second (``dst.copy_(src)`` of 512 MiB, preallocated), which the issue's target uses; and the
read rate, a large tensor sum's bytes read per second (``src.sum()``, the same 512 MiB), the
ceiling of a kernel that only reads (a copy also writes, and its rate counts both); and the
page-copy rate, the same pages copied in table order (``index_select``, bytes read plus written):
what memory gives the decode's own pattern, whole pages of a few KiB at random places, where the
hardware prefetchers that make a large copy fast stop at every page.

These calls take ``paged_attention``'s C kernel (its ``cpu`` backend), each as one layer's call of
a decode step: with the step's ``PagedAttentionPlan``, made once outside the timing as a model
makes it once for all its layers (a row times one call without a plan against it); the line
under the table names its instruction-set path and the CPU features it found, with the kernel's
one-time build (or cache load) cost, which no timed call includes.
``SELFATTN_DECODE_ISA=generic`` (or avx2, avx512, avx512_bf16) measures a lower path;
``SELFATTN_DECODE_KERNEL=0`` the PyTorch path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from selfattn.benchmarks import _util
from selfattn.cache import PagedAttentionPlan, memory, paged_attention
from selfattn.cache.quant import quantize_fp8, quantize_int8
from selfattn.cache.size import kv_cache_bytes
from selfattn.kernels import paged_decode

HQ, HKV, D, PAGE = 32, 8, 128, 16
# Page storage -> (page dtype for make_cache, quantiser or None). The 1-byte pages quantise bf16.
STORAGES = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.bfloat16, quantize_int8),
    "fp8": (torch.bfloat16, quantize_fp8),
}
# CPU features the kernel's paths use, as /proc/cpuinfo names them.
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512vbmi", "amx_bf16")


def make_cache(B: int, S: int, dtype, seed: int = 0):
    """Random pages, a permuted block table and the same K/V made contiguous for SDPA.

    Returns ``q (B, Hq, 1, D)``, ``k_pages, v_pages (N, P, Hkv, D)``, ``table (B, S/P)`` int32,
    ``lens (B,)`` int32 and ``k, v (B, Hkv, S, D)`` contiguous.
    """
    g = torch.Generator().manual_seed(seed)
    n_pages = B * S // PAGE
    # the pool as PagedKV allocates it (on huge pages where the OS has them)
    k_pages = torch.randn(n_pages, PAGE, HKV, D, generator=g).to(dtype)
    k_pages, v_pages = _pooled(k_pages, torch.randn(n_pages, PAGE, HKV, D, generator=g).to(dtype))
    table = torch.randperm(n_pages, generator=g).view(B, S // PAGE).to(torch.int32)
    lens = torch.full((B,), S, dtype=torch.int32)
    q = torch.randn(B, HQ, 1, D, generator=g).to(dtype)
    k, v = gather(k_pages, v_pages, table)
    return q, k_pages, v_pages, table, lens, k, v


def gather(k_pages, v_pages, table):
    """Pages in table order as contiguous ``(B, Hkv, S, D)`` K and V (what a dense peer needs)."""
    B, n = table.shape
    ids = table.reshape(-1).long()
    out = []
    for pages in (k_pages, v_pages):
        x = pages.index_select(0, ids).view(B, n * PAGE, HKV, D)  # (B·n, P, Hkv, D) -> (B, S, ·)
        out.append(x.transpose(1, 2).contiguous())  # (B, S, Hkv, D) -> (B, Hkv, S, D)
    return out


def _pooled(k_pages: torch.Tensor, v_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k_pages``, ``v_pages`` ``(N, P, Hkv, D)`` copied into one pool ``(N, 2, P, Hkv, D)``
    allocated as PagedKV allocates its ``kv_store`` (a page's keys, then its values): the two
    views."""
    pool = memory.zeros(k_pages.shape[0], 2, *k_pages.shape[1:], dtype=k_pages.dtype)
    pool[:, 0], pool[:, 1] = k_pages, v_pages
    return pool[:, 0], pool[:, 1]


def paged_case(B: int, S: int, storage: str, one_page: bool = False):
    """``(decode call, bytes it reads)`` over pages of ``storage`` (see :data:`STORAGES`). The
    call's ``pages`` attribute: ``(k_pages, v_pages, table)``. ``one_page``: every table entry
    is page 0, so the call does all its arithmetic on K/V the caches hold (its compute alone).

    The call is one layer's call of a decode step: ``paged_attention`` with the step's
    :class:`~selfattn.cache.PagedAttentionPlan` (made here, once, as a model makes it once for
    all its layers), so the table and length checks and the key intervals it keeps are not
    timed; what is timed is the kernel and the per-layer Python around it (:func:`unplanned_rows`
    times the same call without a plan)."""
    dtype, quantise = STORAGES[storage]
    if one_page:  # B pages made (one per sequence, for q's shape), page 0 at every entry
        q, kp, vp, _, _, _, _ = make_cache(B, PAGE, dtype)
        table = torch.zeros(B, S // PAGE, dtype=torch.int32)
        lens = torch.full((B,), S, dtype=torch.int32)
    else:
        q, kp, vp, table, lens, _, _ = make_cache(B, S, dtype)
    ks = vs = None
    if quantise is not None:
        (kp, ks), (vp, vs) = quantise(kp), quantise(vp)
        kp, vp = _pooled(kp, vp)
    n_bytes = sum(t.numel() * t.element_size() for t in (kp, vp, ks, vs) if t is not None)

    plan = PagedAttentionPlan(table, lens)

    def call():
        return paged_attention(q, kp, vp, table, lens, k_scales=ks, v_scales=vs, plan=plan)

    call.pages = (kp, vp, table)
    return call, n_bytes


def page_copy(k_pages, v_pages, table):
    """``(copy, bytes moved)``: every page of ``table`` copied, K then V, in table order into a
    preallocated buffer (``index_select``): the decode's own access pattern (whole pages at
    random places in the pool) as PyTorch copies it, bytes read plus written."""
    ids = table.reshape(-1).long()
    bufs = [torch.empty((ids.numel(), *p.shape[1:]), dtype=p.dtype) for p in (k_pages, v_pages)]

    def copy():
        for pages, buf in zip((k_pages, v_pages), bufs):
            torch.index_select(pages, 0, ids, out=buf)

    return copy, 2 * sum(b.numel() * b.element_size() for b in bufs)


def bandwidth_rates(B: int, S: int, storage: str, repeat: int) -> dict[str, tuple[float, float]]:
    """``{"copy" | "read" | "pages": (paged decode's bytes read per second over storage pages,
    the memory rate)}``: the copy rate (``dst.copy_(src)``, 512 MiB float32, preallocated; bytes
    read plus written), the read rate (``src.sum()``; bytes read) and the page-copy rate (the
    decode's own pages copied in table order, :func:`page_copy`; bytes read plus written), each
    timed interleaved with the decode call so that a drifting machine load hits both alike."""
    call, n_bytes = paged_case(B, S, storage)
    src = torch.ones(1 << 27)  # 512 MiB
    dst = torch.empty_like(src)
    size = src.numel() * src.element_size()
    pages_fn, pages_moved = page_copy(*call.pages)
    rates = {}
    with torch.inference_mode():
        for name, fn, moved in (
            ("copy", lambda: dst.copy_(src), 2 * size),
            ("read", src.sum, size),
            ("pages", pages_fn, pages_moved),
        ):
            mine, peer = _util.time_pair(call, fn, repeat)
            rates[name] = (n_bytes / mine.median_s / 1e9, moved / peer.median_s / 1e9)
    return rates


def _row(case, ours_s, peer, peer_s, limit, diff=None, kv_bytes=None):
    """A timed row; ``limit`` None: no target."""
    ratio = ours_s / peer_s
    return {
        "case": case,
        "ours_ms": ours_s * 1e3,
        "peer": peer,
        "peer_ms": peer_s * 1e3,
        "ratio": ratio,
        "target": "-" if limit is None else f"<= {limit}",
        "met": None if limit is None else ratio <= limit,
        "kv_gbs": None if kv_bytes is None else kv_bytes / ours_s / 1e9,
        "max_abs_diff": diff,
    }


def speed_rows(B: int, S: int, dtype, limit: float, repeat: int) -> list[dict]:
    """Ours vs SDPA on contiguous K/V; for fp32 also vs gather + SDPA (the gather timed)."""
    name = "fp32" if dtype == torch.float32 else "bf16"
    shape = f"B={B} S={S} Hq={HQ} Hkv={HKV} D={D} P={PAGE}"
    q, kp, vp, table, lens, k, v = make_cache(B, S, dtype)
    kv_bytes = 2 * kp.numel() * kp.element_size()

    def ours():
        return paged_attention(q, kp, vp, table, lens)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def gather_sdpa():
        kk, vv = gather(kp, vp, table)
        return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    peers = [("SDPA enable_gqa, contiguous K/V (gather not timed)", sdpa, limit)]
    if dtype == torch.float32:
        peers.append(("gather pages + SDPA (gather timed)", gather_sdpa, 0.25))
    return paired_rows(f"{name} decode, paged, {shape}", ours, peers, kv_bytes, repeat)


def paired_rows(
    case: str, ours, peers, n_bytes: int | None, repeat: int, min_s: float = 0.0, best: bool = False
) -> list[dict]:
    """One row per ``(peer name, call, limit)``: ours and the peer timed interleaved (each for
    at least ``min_s`` seconds in all: :func:`~selfattn.benchmarks._util.time_interleaved`).
    ``limit`` None: no target. ``best``: a second row of the two fastest rounds, no target (the
    quiet machine's ratio, where a busy host's phases move the medians)."""
    rows = []
    with torch.inference_mode():
        for peer, fn, lim in peers:
            mine, theirs = _util.time_pair(ours, fn, repeat, min_s=min_s)
            diff = float((mine.result.float() - theirs.result.float()).abs().max())
            rows.append(_row(case, mine.median_s, peer, theirs.median_s, lim, diff, n_bytes))
            if best:
                case_b, peer_b = f"{case}, fastest round each", f"{peer}, fastest round"
                rows.append(_row(case_b, mine.best_s, peer_b, theirs.best_s, None, diff, n_bytes))
    return rows


def unplanned_rows(B: int, S: int, repeat: int) -> list[dict]:
    """bf16 pages, one call without a plan (the table and length checks, the backend choice and
    the key intervals per call) against the planned call the other rows time; no target."""
    planned, n_bytes = paged_case(B, S, "bf16")
    kp, vp, table = planned.pages
    q = torch.randn(B, HQ, 1, D).to(torch.bfloat16)
    lens = torch.full((B,), S, dtype=torch.int32)

    def plain():
        return paged_attention(q, kp, vp, table, lens)

    plan = PagedAttentionPlan(table, lens)

    def with_plan():
        return paged_attention(q, kp, vp, table, lens, plan=plan)

    case = f"bf16 decode without a plan, B={B} S={S}"
    peers = [("the same call with a plan", with_plan, None)]
    return paired_rows(case, plain, peers, n_bytes, repeat)


# Seconds each side of a narrow row runs at least (the --quick smoke run: none).
NARROW_S = 1.0


def narrow_rows(B: int, S: int, limit: float, repeat: int, min_s: float = NARROW_S) -> list[dict]:
    """int8 and fp8 pages (1 byte a value, plus scales) vs bf16 pages, both ours; then the
    arithmetic alone of int8 and bf16 (no target)."""
    bf16, _ = paged_case(B, S, "bf16")
    rows = []
    for storage in ("int8", "fp8"):
        call, n_bytes = paged_case(B, S, storage)
        case = f"{storage} decode, paged, B={B} S={S} Hq={HQ} Hkv={HKV} D={D} P={PAGE}"
        # both sides take 10-25 ms: a median over ~1 s each, not over five calls that a
        # burst of the VM's memory or CPU contention can shift
        rows += paired_rows(
            case, call, [("bf16 pages, paged (ours)", bf16, limit)], n_bytes, repeat, min_s, True
        )
    # What the ratio above can reach on this machine: the arithmetic alone (every table entry
    # one page, its K/V in cache), int8's against bf16's, and bf16's against bf16's whole time.
    # int8 and bf16 take the same count of 16-bit multiply instructions (their query and weights
    # keep 16 bits), so int8 under 0.6x bf16 needs bf16 memory-bound: its compute well under its
    # time (BENCHMARKS.md has the runs).
    hot = {s: paged_case(B, S, s, one_page=True)[0] for s in ("int8", "bf16")}
    shape = f"B={B} S={S} Hq={HQ} Hkv={HKV} D={D} P={PAGE}"
    rows += paired_rows(
        f"int8 decode, compute alone (one page), {shape}", hot["int8"],
        [("bf16 pages, compute alone (one page)", hot["bf16"], None)], None, repeat, min_s,
    )  # fmt: skip
    rows += paired_rows(
        f"bf16 decode, compute alone (one page), {shape}", hot["bf16"],
        [("bf16 pages, paged (ours)", bf16, None)], None, repeat, min_s,
    )  # fmt: skip
    rows[-1]["max_abs_diff"] = None  # other pages: other outputs
    return rows


# The memory rates of the bandwidth rows: (rate, peer as the table names it, target). The issue's
# target is against the copy rate; the read rate (what a read-only kernel could reach) and the
# page-copy rate (what the decode's random-page pattern gets) are shown beside it, with no target.
RATES = (
    ("copy", "large-tensor copy, bytes read + written per second", True),
    ("read", "large-tensor sum, bytes read per second", False),
    ("pages", "the same pages copied in table order, bytes read + written per second", False),
)


def copy_rows(B: int, S: int, limit: float, repeat: int) -> list[dict]:
    """Bytes read per second of pages in every storage (scales counted) vs a large copy's rate
    (the target), a large sum's read rate and the pages' own copy rate, in one run."""
    rows = []
    for storage in STORAGES:
        rates = bandwidth_rates(B, S, storage, repeat)
        for name, peer, targeted in RATES:
            gbs, rate = rates[name]
            rows.append(
                {
                    "case": f"{storage} paged decode, B={B} S={S}: K/V bytes read per second",
                    "ours_ms": None,
                    "peer": peer,
                    "peer_ms": None,
                    "ours_gbs": gbs,
                    "peer_gbs": rate,
                    "ratio": gbs / rate,
                    "target": f">= {limit:.2f}" if targeted else "-",
                    "met": gbs / rate >= limit if targeted else None,
                    "kv_gbs": gbs,
                    "max_abs_diff": None,
                }
            )
    return rows


def rows_for(B: int, S: int, repeat: int, narrow_s: float = NARROW_S) -> list[dict]:
    rows = speed_rows(B, S, torch.float32, 0.7, repeat)
    rows += speed_rows(B, S, torch.bfloat16, 0.35, repeat)
    rows += narrow_rows(B, S, 0.6, repeat, narrow_s)
    rows += copy_rows(B, S, 0.7, repeat)
    rows += copy_rows(1, S, 0.7, repeat)  # one sequence: its 8 kv heads share the threads
    rows += unplanned_rows(1, S, repeat)

    # Cache size: the formula and the tensors quantize_int8 actually returns must agree.
    int8_formula = kv_cache_bytes(1, HKV, D, S, "int8", batch=B)
    bf16_formula = kv_cache_bytes(1, HKV, D, S, "bf16", batch=B)
    x = torch.randn(B * S // PAGE, PAGE, HKV, D, dtype=torch.bfloat16)
    data, scales = quantize_int8(x)
    int8_tensors = 2 * (data.numel() * data.element_size() + scales.numel() * scales.element_size())
    bf16_tensors = 2 * x.numel() * x.element_size()
    if (int8_formula, bf16_formula) != (int8_tensors, bf16_tensors):
        raise RuntimeError(
            f"kv_cache_bytes ({int8_formula}, {bf16_formula}) disagrees with the tensors "
            f"({int8_tensors}, {bf16_tensors})"
        )
    ratio = int8_tensors / bf16_tensors
    rows.append(
        {
            "case": f"int8 cache bytes (scales included), B={B} S={S}",
            "ours_ms": None,
            "peer": "bf16 cache bytes",
            "peer_ms": None,
            "ours_bytes": int8_tensors,
            "peer_bytes": bf16_tensors,
            "ratio": ratio,
            "target": "<= 0.53",
            "met": ratio <= 0.53,
            "kv_gbs": None,
            "max_abs_diff": None,
        }
    )
    return rows


def cpu_features() -> list[str]:
    """Which of :data:`FEATURES` this CPU reports (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return [name for name in FEATURES if name in flags]


def _value(r: dict, side: str) -> str:
    if r.get(f"{side}_ms") is not None:
        return f"{r[f'{side}_ms']:.1f} ms"
    if r.get(f"{side}_gbs") is not None:
        return f"{r[f'{side}_gbs']:.1f} GB/s"
    return f"{r[f'{side}_bytes'] / 2**20:.1f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="B=4, 512-token contexts: a smoke run")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per side (5)")
    args = p.parse_args(argv)
    B, S = (4, 512) if args.quick else (32, 4096)
    t0 = time.perf_counter()
    built = paged_decode.library() is not None  # compiled on first use, then cached on disk
    kernel = f"C kernel, {paged_decode.isa()} path" if built else "PyTorch"
    path = (
        f"{kernel} (build or cache load: {time.perf_counter() - t0:.1f} s, not timed); "
        f"CPU features: {' '.join(cpu_features()) or 'none of ' + ' '.join(FEATURES)}"
        if built
        else "PyTorch (the C kernel is off or could not be built)"
    )
    rows = rows_for(B, S, args.repeat, 0.0 if args.quick else NARROW_S)
    for r in rows:  # which kernel each timed row ran
        r["kernel"] = kernel if r["ours_ms"] is not None or r.get("ours_gbs") else None
    if args.json:
        out = {"machine": _util.machine(), "path": path, "features": cpu_features(), "rows": rows}
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    table = [
        [
            r["case"],
            _value(r, "ours"),
            r["peer"],
            _value(r, "peer"),
            f"{r['ratio']:.2f}",
            r["target"],
            "-" if r["met"] is None else "met" if r["met"] else "missed",
            "-" if r["kv_gbs"] is None else f"{r['kv_gbs']:.1f}",
            "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}",
        ]
        for r in rows
    ]
    cols = ["case", "ours", "peer", "peer value", "ratio", "target", "met?", "K/V GB/s", "max |Δ|"]
    m = _util.machine()
    title = f"paged decode ({m['cpu']}, {m['torch_threads']} threads, torch {m['torch']})"
    _util.print_table(cols, table, title=title)
    print(f"paged_attention path: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
