"""Attention on CPU: selfattn (``backend="auto"``) against its peers, measured in one run.

    python -m selfattn.benchmarks.attention           # the full table (several minutes)
    python -m selfattn.benchmarks.attention --quick   # every sequence size / 8: a smoke run
    python -m selfattn.benchmarks.attention --json    # the same results as JSON on stdout

Each speed row times ours and its peer side by side on the same fp32 inputs: one warm-up call (what
it costs beyond a steady call is reported as compile seconds), then the median of up to ``--repeat``
calls under ``torch.inference_mode``. Useful work counts only the allowed (query, key) pairs:
``4 · D · pairs · B · Hq`` FLOPs per forward (2 for ``QKᵀ``, 2 for ``PV``). The memory row runs each
side in a fresh process and reports its peak RSS minus the baseline after the inputs exist.

Peers are called natively (SDPA, compiled FlexAttention); their one-time set-up (block masks, the
dense bool mask) is built once outside the timed calls, as a model would cache it. The ``max |Δ|``
column is the largest difference between ours and the peer's output: the rows compare one thing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

import selfattn as sa
from selfattn.benchmarks import _util

# Working-set multiple of the (B, Hq, Sq, Sk) fp32 score matrix held at once by the reference
# backend's forward (scores, shifted scores, exponentials, weights): used to skip cases that would
# not fit in memory instead of being killed by the OOM killer mid-run.
_REFERENCE_SCORE_COPIES = 3.5


@dataclass(frozen=True)
class Sizes:
    """The full sizes; ``--quick`` divides every sequence length, window and matmul side by 8."""

    S: int = 4096  # dense, causal and GQA rows
    S_long: int = 16384  # window, documents and memory rows
    window: int = 256
    doc_len: int = 2048
    B: int = 1
    H: int = 8
    H_gqa: int = 32
    Hkv_gqa: int = 8
    H_mem: int = 1  # the reference's fwd+bwd at S=16384 holds several 1 GiB score matrices per head
    D: int = 64
    matmul: int = 4096

    def quick(self) -> Sizes:
        return Sizes(
            **{
                **asdict(self),
                **{
                    n: getattr(self, n) // 8 for n in ("S", "S_long", "window", "doc_len", "matmul")
                },
            }
        )


@dataclass
class Row:
    """One line of the table: ours against a peer, with its target for ``ours / peer``."""

    key: str
    case: str
    peer: str
    op: str  # "<=" or ">=": how ratio = ours / peer must compare with target
    target: float
    unit: str = "ms"
    ours_backend: str | None = None
    ours: float | None = None
    peer_value: float | None = None
    gflops: float | None = None
    compile_s_ours: float | None = None
    compile_s_peer: float | None = None
    peer_setup_s: float | None = None
    runs: tuple[int, int] | None = None
    max_abs_diff: float | None = None
    ours_error: str | None = None
    peer_error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.peer_value:
            return None
        return self.ours / self.peer_value

    @property
    def met(self) -> bool | None:
        r = self.ratio
        if r is None:
            return None
        return r <= self.target if self.op == "<=" else r >= self.target

    def as_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


def _error(e: BaseException) -> str:
    """The whole message (JSON keeps it); the table shows the start of its first line."""
    return f"{type(e).__name__}: {e}"


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def allowed_pairs(mask, S: int, block: int = 1024) -> int:
    """Number of (query, key) pairs ``mask`` allows on an ``S × S`` call, counted in row blocks."""
    if mask is None:
        return S * S
    return sum(
        int(mask.to_dense(min(block, S - r), S, q_offset=r).sum()) for r in range(0, S, block)
    )


def _check_fits(backend: str, B: int, Hq: int, Sq: int, Sk: int) -> None:
    """Raise instead of letting a quadratic backend take the run down with an out-of-memory kill."""
    if backend != "reference":
        return
    need = _REFERENCE_SCORE_COPIES * 4 * B * Hq * Sq * Sk
    avail = _util.memory_available_bytes()
    if avail is not None and need > 0.8 * avail:
        raise MemoryError(
            f"skipped: the reference backend would hold ~{need / 2**30:.0f} GiB of "
            f"(B, Hq, Sq, Sk) = ({B}, {Hq}, {Sq}, {Sk}) scores; {avail / 2**30:.0f} GiB available"
        )


@dataclass
class Ours:
    """One measurement of ``selfattn.attention``: shared by the rows that compare the same call."""

    backend: str | None = None
    timing: _util.Timing | None = None
    gflops: float | None = None
    error: str | None = None
    fn: Callable[[], torch.Tensor] | None = None  # the timed call, re-timed beside each peer
    flops: float | None = None


def measure_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask, args) -> Ours:
    """Time ``selfattn.attention(q, k, v, mask=mask, backend=args.backend)`` (forward only)."""
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    ours = Ours(backend=args.backend)
    with torch.inference_mode():
        try:
            if args.backend == "auto":
                ours.backend = sa.backends.explain(q, k, v, print_table=False, mask=mask).chosen
            _check_fits(ours.backend, B, Hq, Sq, Sk)
            ours.fn = lambda: sa.attention(q, k, v, mask=mask, backend=args.backend)
            ours.timing = _util.time_call(ours.fn, args.repeat, args.budget_s)
            ours.flops = 4 * D * allowed_pairs(mask, Sk) * B * Hq
            ours.gflops = ours.flops / ours.timing.median_s / 1e9
        except Exception as e:
            ours.error = _error(e)
    return ours


def speed_row(
    row: Row, ours: Ours, make_peer: Callable[[], Callable[[], torch.Tensor]], args
) -> Row:
    """Fill ``row`` with ``ours`` and a timing of the peer that ``make_peer()`` builds."""
    row.ours_backend, row.ours_error, row.gflops = ours.backend, ours.error, ours.gflops
    if ours.timing is not None:
        row.ours, row.compile_s_ours = ours.timing.median_s * 1e3, ours.timing.warmup_s
    peer_out = None
    with torch.inference_mode():
        try:
            t0 = time.perf_counter()
            peer = make_peer()
            row.peer_setup_s = time.perf_counter() - t0
            if ours.fn is not None:
                # interleaved with ours, so that load drifting during the run hits both sides
                mine, t = _util.time_pair(ours.fn, peer, args.repeat, args.budget_s)
                row.ours = mine.median_s * 1e3
                row.gflops = ours.flops / mine.median_s / 1e9
            else:
                t = _util.time_call(peer, args.repeat, args.budget_s)
            peer_out = t.result
            row.peer_value, row.compile_s_peer = t.median_s * 1e3, t.warmup_s
            row.runs = (ours.timing.runs if ours.timing else 0, t.runs)
        except Exception as e:
            row.peer_error = _error(e)
    if ours.timing is not None and peer_out is not None:
        diff = ours.timing.result.float() - peer_out.float()
        row.max_abs_diff = float(diff.abs().max())
    return row


# -- peers, called natively --------------------------------------------------------------------


def sdpa_peer(q, k, v, **kwargs) -> Callable[[], Callable[[], torch.Tensor]]:
    return lambda: lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa_dense_mask_peer(q, k, v, window: int):
    def make():
        i = torch.arange(q.shape[2])
        # (Sq, Sk) bool, True = attend: key j with i - window < j <= i
        allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    return make


def flex_peer(q, k, v, mask_mod, *, compiled: bool):
    def make():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if not compiled:  # eager FlexAttention materialises the scores: smoke runs only
            _check_fits("reference", q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cpu")
        if compiled:
            # static shapes: torch 2.13's CPU flex kernel can fail to build when a second mask
            # triggers a dynamic-shape recompile (CppCompileError), as flex.py notes too
            fn = torch.compile(flex_attention, dynamic=False)
        else:
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            fn = flex_attention
        return lambda: fn(q, k, v, block_mask=block_mask)

    return make


def _window_mod(window: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def _documents_mod(doc_ids: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


# -- the memory row: each side in a fresh process ----------------------------------------------


def fwd_bwd_peak_memory(backend: str, B: int, H: int, S: int, D: int) -> dict:
    """Peak RSS growth (MiB) of one causal forward + backward at ``(B, H, S, D)`` fp32 (in a child).

    The baseline is taken after the inputs, the output gradient and a small warm-up call exist, so
    the figure is what the attention call itself adds at its peak.
    """
    q, k, v = (_randn(B, H, S, D, seed=i).requires_grad_() for i in range(3))
    grad_out = _randn(B, H, S, D, seed=3)
    mask = sa.masks.causal()
    warm = [t[:, :, :64].detach().requires_grad_() for t in (q, k, v)]
    sa.attention(*warm, mask=mask, backend=backend).backward(grad_out[:, :, :64])
    _check_fits(backend, B, H, S, S)
    base = _util.reset_peak_rss()
    t0 = time.perf_counter()
    sa.attention(q, k, v, mask=mask, backend=backend).backward(grad_out)
    seconds = time.perf_counter() - t0
    return {"peak_mib": _util.peak_rss_mib() - base, "seconds": seconds}


def memory_row(row: Row, sizes: Sizes) -> Row:
    shape = (sizes.B, sizes.H_mem, sizes.S_long, sizes.D)
    row.notes.append(
        f"memory row uses B={sizes.B}, H={sizes.H_mem}, D={sizes.D}: the reference's "
        f"(B, H, S, S) fp32 scores are {sizes.H_mem * sizes.S_long**2 * 4 / 2**30:.2g} GiB per copy"
    )
    row.ours_backend = "chunked"
    for side, backend in (("ours", "chunked"), ("peer", "reference")):
        try:
            r = _util.run_in_fresh_process(fwd_bwd_peak_memory, backend, *shape)
            if side == "ours":
                row.ours = r["peak_mib"]
            else:
                row.peer_value = r["peak_mib"]
            row.notes.append(f"{backend} fwd+bwd took {r['seconds']:.2f} s")
        except Exception as e:
            setattr(row, f"{side}_error", _error(e))
    return row


# -- the run -----------------------------------------------------------------------------------

CASES = ("dense", "causal", "window", "window_dense", "documents", "gqa", "ceiling", "memory")
# The fused C kernel (backend "cpu_fused"), forced, against its peers: dense and causal
# against SDPA in fp32 and bf16, the sparse masks against chunked (the composed-ops path it
# replaces), against compiled FlexAttention (fp32 and bf16; its cold compile not counted) and as
# a share of the matmul ceiling of their dtype, and the window's fwd + bwd; fp16 (no target in
# the issue) against SDPA and chunked only: without avx512_fp16 a CPU has no fp16 matmul worth a
# ceiling, and the kernel computes fp16 in fp32 (converted as tiles are packed).
KERNEL_CASES = (
    "cpu_dense", "cpu_causal", "cpu_dense_bf16", "cpu_causal_bf16",
    "cpu_window", "cpu_documents", "cpu_window_flex", "cpu_documents_flex",
    "cpu_window_bf16", "cpu_documents_bf16", "cpu_window_bf16_flex", "cpu_documents_bf16_flex",
    "ceiling_cpu_window", "ceiling_cpu_documents", "ceiling_cpu_window_bf16",
    "ceiling_cpu_documents_bf16", "cpu_window_fwdbwd",
    "cpu_dense_fp16", "cpu_causal_fp16", "cpu_window_fp16", "cpu_documents_fp16",
)  # fmt: skip
CASES = CASES + KERNEL_CASES


def run(args) -> dict:
    sz = Sizes().quick() if args.quick else Sizes()
    only = set(args.only) if args.only else set(CASES)
    peer_flex = _flex_name(args)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    rows: dict[str, Row] = {}

    B, H, D, S, SL = sz.B, sz.H, sz.D, sz.S, sz.S_long
    q, k, v = (_randn(B, H, S, D, seed=i) for i in range(3))
    for key, mask, peer, kw in (
        ("dense", None, "SDPA", {}),
        ("causal", sa.masks.causal(), "SDPA is_causal", {"is_causal": True}),
    ):
        if key in only:
            log(f"{key} ...")
            label = f"dense fp32 B={B} H={H} S={S} D={D}" + (", causal" if mask else "")
            ours = measure_ours(q, k, v, mask=mask, args=args)
            rows[key] = speed_row(
                Row(key, label, peer, "<=", 1.05), ours, sdpa_peer(q, k, v, **kw), args
            )

    q, k, v = (_randn(B, H, SL, D, seed=i) for i in range(3))
    window_label = f"sliding window {sz.window}, S={SL}"
    if only & {"window", "window_dense", "ceiling"}:
        log("window: ours ...")
        ours_window = measure_ours(q, k, v, mask=sa.masks.sliding_window(sz.window), args=args)
    if only & {"window", "ceiling"}:
        log("window: peer ...")
        row = Row("window", window_label, peer_flex, "<=", 1.0)
        make = flex_peer(q, k, v, _window_mod(sz.window), compiled=not args.no_compile)
        rows["window"] = speed_row(row, ours_window, make, args)
    if "window_dense" in only:
        log("window_dense: peer ...")
        row = Row("window_dense", window_label, "SDPA dense bool mask", "<=", 0.1)
        make = sdpa_dense_mask_peer(q, k, v, sz.window)
        rows["window_dense"] = speed_row(row, ours_window, make, args)
    if "documents" in only:
        log("documents ...")
        n_docs = SL // sz.doc_len
        doc_ids = torch.arange(SL) // sz.doc_len  # (S,) document id per position
        mask = sa.masks.causal() & sa.masks.documents(doc_ids)
        label = f"{n_docs} packed documents of {sz.doc_len}, S={SL}, causal"
        row = Row("documents", label, peer_flex, "<=", 1.0)
        make = flex_peer(q, k, v, _documents_mod(doc_ids), compiled=not args.no_compile)
        rows["documents"] = speed_row(row, measure_ours(q, k, v, mask=mask, args=args), make, args)
    del q, k, v

    if "gqa" in only:
        log("gqa ...")
        q = _randn(B, sz.H_gqa, S, D, seed=0)
        k, v = (_randn(B, sz.Hkv_gqa, S, D, seed=i) for i in (1, 2))
        label = f"GQA {sz.H_gqa}/{sz.Hkv_gqa} heads, S={S}, causal"
        row = Row("gqa", label, "SDPA enable_gqa", "<=", 1.0)
        make = sdpa_peer(q, k, v, is_causal=True, enable_gqa=True)
        ours = measure_ours(q, k, v, mask=sa.masks.causal(), args=args)
        rows["gqa"] = speed_row(row, ours, make, args)
        del q, k, v

    log(f"ceiling: fp32 matmul {sz.matmul}² ...")
    ceiling = _util.matmul_gflops(sz.matmul, repeat=args.matmul_repeat)
    if only & set(KERNEL_CASES):
        kernel_rows(rows, only, sz, args, ceiling, log)
    if "ceiling" in only:
        win = rows.get("window")
        row = Row("ceiling", "window case useful GFLOP/s", "fp32 matmul", ">=", 0.70, "GFLOP/s")
        row.ours_backend = win.ours_backend if win else None
        row.ours = win.gflops if win else None
        row.ours_error = win.ours_error if win else None
        row.peer_value = ceiling
        rows["ceiling"] = row
        if "window" not in only:
            del rows["window"]

    if "memory" in only:
        log("memory: fwd+bwd in fresh processes ...")
        label = f"fwd+bwd peak memory, S={SL}, causal, chunked"
        rows["memory"] = memory_row(Row("memory", label, "reference", "<=", 0.1, "MiB"), sz)

    log("done")
    return {
        "machine": _util.machine(),
        "quick": args.quick,
        "backend": args.backend,
        "sizes": asdict(sz),
        "matmul_gflops": ceiling,
        "matmul_repeat": args.matmul_repeat,
        "cpu_kernel": _kernel_isa(),
        "rows": [rows[key].as_json() for key in CASES if key in rows],
    }


def _flex_name(args) -> str:
    return "compiled FlexAttention" if not args.no_compile else "eager FlexAttention"


def _kernel_isa() -> str:
    from selfattn.kernels import fused_attention

    return fused_attention.isa()


def _with_backend(args, backend: str):
    return argparse.Namespace(**{**vars(args), "backend": backend})


def chunked_peer(q, k, v, mask):
    return lambda: lambda: sa.attention(q, k, v, mask=mask, backend="chunked")


def fwd_bwd_row(row: Row, q, k, v, mask, window: int, args) -> Row:
    """Forward + backward of ours (the cpu_fused backend) against SDPA with the dense bool mask."""
    grad = _randn(*q.shape[:3], v.shape[3], seed=9)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    i = torch.arange(q.shape[2])
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)

    def ours():
        sa.attention(*leaves, mask=mask, backend="cpu_fused").backward(grad)

    def peer():
        F.scaled_dot_product_attention(*leaves, attn_mask=allowed).backward(grad)

    row.ours_backend = "cpu_fused"
    try:
        mine, t = _util.time_pair(ours, peer, args.repeat, args.budget_s)
        row.ours, row.peer_value = mine.median_s * 1e3, t.median_s * 1e3
        row.runs = (mine.runs, t.runs)
        row.gflops = (
            2.5
            * 4
            * q.shape[3]
            * allowed_pairs(mask, q.shape[2])
            * q.numel()
            / (q.shape[2] * q.shape[3] * mine.median_s * 1e9)
        )
        row.notes.append("useful GFLOP/s counts the backward as 1.5x the forward's FLOPs")
    except Exception as e:
        row.ours_error = _error(e)
    return row


def kernel_rows(rows: dict, only: set, sz: Sizes, args, ceiling: float, log) -> None:
    """The ``cpu_*`` rows (:data:`KERNEL_CASES`), each naming the kernel's ISA in a note."""
    cpu = _with_backend(args, "cpu_fused")
    B, H, D, S, SL = sz.B, sz.H, sz.D, sz.S, sz.S_long
    isa = f"kernel compiled for {_kernel_isa()}"
    for dtype, suffix, name in (
        (torch.float32, "", "fp32"),
        (torch.bfloat16, "_bf16", "bf16"),
        (torch.float16, "_fp16", "fp16"),
    ):
        q, k, v = (_randn(B, H, S, D, seed=i).to(dtype) for i in range(3))
        for key, mask, peer, kw in (
            ("cpu_dense", None, "SDPA", {}),
            ("cpu_causal", sa.masks.causal(), "SDPA is_causal", {"is_causal": True}),
        ):
            if key + suffix in only:
                log(f"{key}{suffix} ...")
                label = f"{name} B={B} H={H} S={S} D={D}" + (", causal" if mask else ", dense")
                row = Row(key + suffix, label, peer, "<=", 1.0)
                ours = measure_ours(q, k, v, mask=mask, args=cpu)
                rows[row.key] = speed_row(row, ours, sdpa_peer(q, k, v, **kw), args)
                rows[row.key].notes.append(isa)
        q, k, v = (_randn(B, H, SL, D, seed=i).to(dtype) for i in range(3))
        doc_ids = torch.arange(SL) // sz.doc_len
        matmul = ceiling
        wants_ceiling = only & {f"ceiling_cpu_window{suffix}", f"ceiling_cpu_documents{suffix}"}
        if wants_ceiling and dtype != torch.float32:
            log(f"ceiling: {name} matmul {sz.matmul}² ...")
            matmul = _util.matmul_gflops(sz.matmul, repeat=args.matmul_repeat, dtype=dtype)
        for case, mask, mask_mod, label, target in (
            ("window", sa.masks.sliding_window(sz.window), _window_mod(sz.window),
             f"sliding window {sz.window}", 0.7),
            ("documents", sa.masks.causal() & sa.masks.documents(doc_ids),
             _documents_mod(doc_ids), f"{SL // sz.doc_len} causal documents", 0.7),
        ):  # fmt: skip
            key, ceiling_key = f"cpu_{case}{suffix}", f"ceiling_cpu_{case}{suffix}"
            flex_key = f"cpu_{case}{suffix}_flex"
            if not only & {key, ceiling_key, flex_key}:
                continue
            log(f"{key} ...")
            ours = measure_ours(q, k, v, mask=mask, args=cpu)
            row = Row(key, f"{label}, S={SL}, {name}", "chunked", "<=", 1.0)
            row = speed_row(row, ours, chunked_peer(q, k, v, mask), args)
            row.notes.append(isa)
            if key in only:
                rows[key] = row
            if ceiling_key in only:
                goal = target if dtype == torch.float32 else 0.5
                c = Row(ceiling_key, f"{label} useful GFLOP/s, {name}", f"{name} matmul", ">=",
                        goal, "GFLOP/s")  # fmt: skip
                c.ours_backend, c.ours, c.ours_error = "cpu_fused", row.gflops, row.ours_error
                c.peer_value = matmul
                rows[ceiling_key] = c
            if flex_key in only:
                log(f"{flex_key} ...")
                f = Row(flex_key, f"{label}, S={SL}, {name}", _flex_name(args), "<=", 0.5)
                make = flex_peer(q, k, v, mask_mod, compiled=not args.no_compile)
                rows[flex_key] = speed_row(f, ours, make, args)
                rows[flex_key].notes.append(isa)
        del q, k, v
    if "cpu_window_fwdbwd" in only:
        log("cpu_window_fwdbwd ...")
        S2 = SL // 2
        q, k, v = (_randn(B, H, S2, D, seed=i) for i in range(3))
        row = Row("cpu_window_fwdbwd", f"sliding window {sz.window} fwd+bwd, S={S2}, fp32",
                  "SDPA dense bool mask fwd+bwd", "<=", 0.5)  # fmt: skip
        rows[row.key] = fwd_bwd_row(row, q, k, v, sa.masks.sliding_window(sz.window), sz.window,
                                    args)  # fmt: skip
        rows[row.key].notes.append(isa)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        digits = 0 if value >= 100 else 1 if value >= 10 else 2
        return f"{value:.{digits}f} ms"
    if unit == "MiB":
        return f"{value:.0f} MiB"
    return f"{value:.1f} {unit}"


def _cell_error(message: str, width: int = 60) -> str:
    return ("error: " + message.splitlines()[0])[:width]


def print_report(result: dict, markdown: bool = False) -> None:
    m = result["machine"]
    print(
        f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, "
        f"{m['cpu_capability']}, {m['memory_gib']} GiB; torch {m['torch']}; {m['date']}"
    )
    table = []
    for r in result["rows"]:
        ours = _cell_error(r["ours_error"]) if r["ours_error"] else _fmt(r["ours"], r["unit"])
        if r["ours_backend"] and not r["ours_error"]:
            ours += f" ({r['ours_backend']})"
        peer = _cell_error(r["peer_error"]) if r["peer_error"] else _fmt(r["peer_value"], r["unit"])
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        met = "-" if r["met"] is None else "met" if r["met"] else "missed"
        compile_s = "-"
        if r["compile_s_ours"] is not None or r["compile_s_peer"] is not None:
            c = [
                ("-" if x is None else f"{x:.1f}")
                for x in (r["compile_s_ours"], r["compile_s_peer"])
            ]
            compile_s = " / ".join(c)
        table.append(
            [
                r["case"],
                ours,
                r["peer"],
                peer,
                ratio,
                f"{'≤' if r['op'] == '<=' else '≥'} {r['target']:.2f}",
                met,
                "-" if r["gflops"] is None else f"{r['gflops']:.1f}",
                compile_s,
                "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}",
            ]
        )
    columns = [
        "case",
        "ours (backend)",
        "peer",
        "peer value",
        "ours/peer",
        "target",
        "met?",
        "useful GFLOP/s",
        "compile s ours/peer",
        "max |Δ|",
    ]
    title = "attention" + (" [--quick: sizes / 8]" if result["quick"] else "")
    if markdown:  # for pasting into BENCHMARKS.md
        print(f"\n{title}\n")
        for r in (columns, ["---"] * len(columns), *table):
            print("| " + " | ".join(str(x).replace("|", "\\|") for x in r) + " |")
        print()
    else:
        _util.print_table(columns, table, title=title)
    n = result["sizes"]["matmul"]
    print(
        f"ceiling: fp32 matmul {n}×{n} @ {n}×{n}, best of {result['matmul_repeat']}: "
        f"{result['matmul_gflops']:.1f} GFLOP/s"
    )
    print(f"cpu_fused backend kernel (fused_attention.c) compiled for: {result['cpu_kernel']}")
    for r in result["rows"]:
        for note in r["notes"]:
            print(f"note ({r['key']}): {note}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="every size / 8: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed calls per side (5; 3 quick)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=30.0, help="stop timing a side after this many seconds"
    )
    parser.add_argument("--matmul-repeat", type=int, default=3, help="matmul ceiling: best of N")
    parser.add_argument("--backend", default="auto", help="our backend for the speed rows")
    parser.add_argument(
        "--only", type=lambda s: s.split(","), help=f"comma-separated subset of {','.join(CASES)}"
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="eager FlexAttention peers (fast smoke runs)"
    )
    args = parser.parse_args(argv)
    if args.only and not set(args.only) <= set(CASES):
        parser.error(f"--only {','.join(args.only)}: unknown case; choose from {','.join(CASES)}")
    if args.repeat is None:
        args.repeat = 3 if args.quick else 5
    # A private inductor cache: compile seconds are then cold-start figures, and compiles cannot
    # collide with other processes compiling into the shared default cache at the same time.
    with tempfile.TemporaryDirectory(prefix="selfattn-bench-inductor-") as cache:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
        result = run(args)
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=True))
    else:
        print_report(result, markdown=args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
