"""GPU checks and speed of selfattn on one CUDA device: correctness per backend, then speed.

Three parts, each best run in its own process (FlexAttention's compile cache and Dynamo's
recompile limit are per process):

- ``--part correct``: every backend that accepts the case (auto, sdpa, flex, chunked) against the
  float64 reference on the GPU, output, lse and dq/dk/dv by the ratio rule of
  ``selfattn.testing`` — masks (causal with ``Sq != Sk``, sliding window, documents, padding
  with fully masked rows), score mods (ALiBi, softcap), GQA, ``Dv != D``, bf16 / fp16 / fp32.
  Prints one line per case: pass, FAIL with the message, or the backend's reason to decline.
- ``--part speed``: bf16 forward and forward+backward at B=2, Hq=16, S=8192, D=128 for causal,
  sliding window 1024, packed documents and causal+ALiBi: ours (``auto``, and what it chose)
  against SDPA (``is_causal`` or a dense bool mask) and FlexAttention compiled by hand with
  ``create_block_mask``; TFLOP/s over the attended pairs against a measured bf16 matmul ceiling.
- ``--part decode``: bf16 paged decode (B=32, S=4096, Hq=32, Hkv=8, D=128, P=16, random page
  table) of ``selfattn.cache.paged_attention`` against SDPA ``enable_gqa`` on contiguous K/V and
  against gathering the pages + SDPA; GB/s of K/V read against a measured copy ceiling.

- ``--part triton`` (one prepared run of <= 5 minutes on an H200): our Triton
  kernels (``backend="triton"``). bf16 B=2, H=16, S=8192, D=128 causal forward against the best
  SDPA backend (flash, efficient, cuDNN) in TFLOP/s, with a sweep of the forward's tile sizes;
  sliding window 1024 and 4 causal documents, fwd and fwd+bwd, against FlexAttention compiled by
  hand with static shapes; compiles across 10 new window sizes / document layouts / sequence
  lengths (ours: Triton's JIT cache entries; Flex: Dynamo's unique graphs); paged decode
  B=32 x 4096, 32q/8kv, D=128 against the copy rate, SDPA on contiguous K/V and gather + SDPA,
  with a sweep of the key splits. Its ``calibrate`` entries are what to paste into
  ``backends/triton.COSTS``, ``kernels/triton/attention.BLOCKS`` and the paged split table. With
  ``--device cpu`` (and ``TRITON_INTERPRET=1``) it runs our rows at toy sizes in the
  interpreter (a smoke test of the script; Flex is not compiled there).

Run: ``python -m selfattn.benchmarks.gpu [--part correct|speed|decode|triton] [--quick]
[--json [FILE]]``; without ``--part`` the parts run in turn, each in its own process; ``--json``
without a file prints the results on stdout (the progress lines then go to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
import traceback

import torch

import selfattn
from selfattn import masks, scores
from selfattn.testing import check_against_reference

DEV = "cuda"  # --device cpu runs the same code on CPU (a smoke test of this script)
REPS = (3, 10)  # bench's warm-up and timed calls per round; --device cpu: (1, 1), a smoke run


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench(fn, warmup: int | None = None, rep: int | None = None) -> float:
    """Milliseconds per ``fn()`` over ``rep`` back-to-back calls (one sync at the end), the
    median of three such rounds: launch overhead hides behind queued GPU work, as in training."""
    warmup = REPS[0] if warmup is None else warmup
    rep = REPS[1] if rep is None else rep
    for _ in range(warmup):
        fn()
    _sync()
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(rep):
            fn()
        _sync()
        rounds.append(1e3 * (time.perf_counter() - t0) / rep)
    rounds.sort()
    return rounds[1]


def ceilings() -> dict:
    n = 8192 if DEV == "cuda" else 512
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    x = torch.empty(1 << (30 if DEV == "cuda" else 24), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms_copy = bench(lambda: y.copy_(x))
    return {
        "matmul_bf16_tflops": 2 * n**3 / ms / 1e9,
        "copy_gbs": 2 * x.numel() / ms_copy / 1e6,
    }


# -- correctness ------------------------------------------------------------------------------


def _cases(quick: bool):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D = 2, 8, 2, 64
    docs = torch.sort(torch.randint(0, 5, (B, 300), generator=g), dim=-1).values.to(DEV)
    cases = [
        ("dense", dict(Sq=97, Sk=300), {}),
        ("causal Sq<Sk", dict(Sq=97, Sk=300), {"mask": masks.causal()}),
        ("causal Sq=Sk", dict(Sq=300, Sk=300), {"mask": masks.causal()}),
        ("window 64", dict(Sq=300, Sk=300), {"mask": masks.causal() & masks.sliding_window(64)}),
        ("documents", dict(Sq=300, Sk=300), {"mask": masks.documents(docs)}),
        (
            "padding (rows fully masked)",
            dict(Sq=300, Sk=300),
            {"mask": masks.padding(torch.tensor([0, 211]))},
        ),
        ("causal+alibi", dict(Sq=300, Sk=300), {"mask": masks.causal(), "score_mod": None}),
        ("softcap", dict(Sq=300, Sk=300), {"score_mod": scores.softcap(5.0)}),
        ("Dv != D", dict(Sq=97, Sk=300, Dv=32), {"mask": masks.causal()}),
    ]
    out = []
    for name, dims, kw in cases:
        if name == "causal+alibi":
            kw = {"mask": masks.causal(), "score_mod": scores.alibi(Hq)}
        out.append((name, dict(B=B, Hq=Hq, Hkv=Hkv, D=D, **dims), kw))
    return out[:4] if quick else out


def _make(dims, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    B, Hq, Hkv, D = dims["B"], dims["Hq"], dims["Hkv"], dims["D"]
    Dv = dims.get("Dv", D)
    q = torch.randn(B, Hq, dims["Sq"], D, device=DEV, generator=g).to(dtype)
    k = torch.randn(B, Hkv, dims["Sk"], D, device=DEV, generator=g).to(dtype)
    v = torch.randn(B, Hkv, dims["Sk"], Dv, device=DEV, generator=g).to(dtype)
    return q, k, v


def part_correct(args) -> dict:
    rows = []
    failed_cases: set[str] = set()
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    t_end = time.time() + args.budget
    for name, dims, kw in _cases(args.quick):
        for dtype in dtypes:
            q, k, v = _make(dims, dtype, seed=len(rows) + 1)
            for backend in ("auto", "sdpa", "flex", "chunked", "triton"):
                if time.time() > t_end:
                    rows.append((name, str(dtype), backend, "not run: time budget"))
                    continue
                if backend == "flex" and dtype != torch.bfloat16 and name not in ("causal Sq=Sk",):
                    continue  # each flex case compiles: bf16 everywhere, other dtypes on one case
                ex = selfattn.backends.explain(q, k, v, print_table=False, **kw)
                chosen = ex.chosen
                if backend != "auto" and ex.reasons.get(backend):
                    reason = ex.reasons[backend][:120]
                    rows.append((name, str(dtype), backend, f"declined: {reason}"))
                    continue
                try:
                    fn = functools.partial(selfattn.attention, backend=backend)
                    lse = backend != "sdpa"  # SDPA on CUDA gives no lse: out and grads only
                    check_against_reference(fn, q, k, v, grad=True, lse=lse, **kw)
                    status = "pass" if backend != "auto" else f"pass (chose {chosen})"
                except Exception as e:
                    if name not in failed_cases:  # the whole chain once per case, for diagnosis
                        failed_cases.add(name)
                        print(f"--- {name} {dtype} {backend}:", file=sys.stderr)
                        traceback.print_exception(e, limit=-3, file=sys.stderr)
                    msg = str(e).splitlines()[0][:200]
                    if "not supported" in msg or "cannot" in msg or "decline" in msg:
                        status = f"declined: {msg}"
                    else:
                        status = f"FAIL: {type(e).__name__}: {msg}"
                rows.append((name, str(dtype), backend, status))
                print(" | ".join(rows[-1]), flush=True)
    fails = [r for r in rows if r[3].startswith("FAIL")]
    return {"rows": rows, "fails": len(fails)}


# -- speed ------------------------------------------------------------------------------------


def _pairs(mask_dense: torch.Tensor) -> int:
    return int(mask_dense.sum())


def part_speed(args) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    # the same kernel compiled with symbolic sizes, as the flex backend's automatic dynamic
    # shapes do after a second shape: tells a dynamic-shape slowdown from our own overhead
    flex_dyn = torch.compile(flex_attention, dynamic=True)
    torch._dynamo.config.recompile_limit = 64
    B, H, S, D = (2, 16, 8192, 128) if not args.quick else (1, 4, 1024, 64)
    window = S // 8
    dtype = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=DEV, dtype=dtype, generator=g) for _ in range(3))
    lengths = torch.tensor([S // 2, S // 4, S // 8, S // 8])
    doc_ids = torch.repeat_interleave(torch.arange(4), lengths).to(DEV)
    doc_ids = doc_ids.expand(B, S).contiguous()
    slopes = scores.alibi_slopes(H).to(DEV)

    def causal_mod(b, h, qi, ki):
        return qi >= ki

    def window_mod(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < window)

    def doc_mod(b, h, qi, ki):
        return (doc_ids[b, qi] == doc_ids[b, ki]) & (qi >= ki)

    def alibi_mod(score, b, h, qi, ki):
        return score - slopes[h] * (qi - ki)

    cases = [
        ("causal", masks.causal(), None, causal_mod, None, {"is_causal": True}),
        (
            f"window {window}",
            masks.causal() & masks.sliding_window(window),
            None,
            window_mod,
            None,
            "dense",
        ),
        (
            "4 causal documents",
            masks.causal() & masks.documents(doc_ids),
            None,
            doc_mod,
            None,
            "dense",
        ),
        ("causal + ALiBi", masks.causal(), scores.alibi(H), causal_mod, alibi_mod, None),
    ]
    ceil = ceilings()
    rows = []
    for name, mask, mod, mask_mod, score_mod, sdpa_kw in cases:
        dense = mask.to_dense(S, S, B=B, device=DEV)
        pairs = int(dense.sum()) * H
        flops_f = 4 * pairs * D  # QK^T and PV: 2 FLOPs per multiply-add each
        block = create_block_mask(mask_mod, B, None, S, S, device=DEV)
        ex = selfattn.backends.explain(q, k, v, mask=mask, score_mod=mod, print_table=False)
        chosen = ex.chosen
        t0 = time.perf_counter()
        for _ in range(20):
            selfattn.backends.explain(q, k, v, mask=mask, score_mod=mod, print_table=False)
        _sync()
        select_ms = 1e3 * (time.perf_counter() - t0) / 20
        impls = ["ours", "flex", "flex dynamic"] + (["sdpa"] if sdpa_kw is not None else [])

        dm = dense  # (B, 1, S, S) bool for SDPA

        def call(
            impl, qq, kk, vv, mask=mask, mod=mod, block=block, sm=score_mod, how=sdpa_kw, dm=dm
        ):
            if impl == "ours":
                return selfattn.attention(qq, kk, vv, mask=mask, score_mod=mod)
            if impl == "flex":
                return flex(qq, kk, vv, score_mod=sm, block_mask=block)
            if impl == "flex dynamic":
                return flex_dyn(qq, kk, vv, score_mod=sm, block_mask=block)
            if how == "dense":
                return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=dm)
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

        for mode in ("fwd", "fwd+bwd"):
            res = {}
            for impl in impls:
                try:
                    if mode == "fwd":
                        with torch.no_grad():
                            ms = bench(lambda impl=impl: call(impl, q, k, v))
                    else:
                        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                        ms = bench(
                            lambda impl=impl, qg=qg, kg=kg, vg=vg: (
                                call(impl, qg, kg, vg).sum().backward()
                            )
                        )
                    res[impl] = ms
                except Exception as e:
                    res[impl] = f"error: {type(e).__name__}: {str(e)[:100]}"
            flops = flops_f * (1 if mode == "fwd" else 3.5)  # bwd ≈ 2.5× fwd (5 matmuls vs 2)
            row = {"case": name, "mode": mode, "auto chose": chosen, "select ms": select_ms, **res}
            if isinstance(res.get("ours"), float):
                row["ours TFLOP/s"] = flops / res["ours"] / 1e9
                row["% of matmul"] = 100 * row["ours TFLOP/s"] / ceil["matmul_bf16_tflops"]
                for peer in ("sdpa", "flex"):
                    if isinstance(res.get(peer), float):
                        row[f"ours/{peer}"] = res["ours"] / res[peer]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"ceilings": ceil, "shape": dict(B=B, H=H, S=S, D=D), "rows": rows}


# -- paged decode -----------------------------------------------------------------------------


def part_decode(args) -> dict:
    from selfattn.cache import paged_attention

    B, S, Hq, Hkv, D, P = (32, 4096, 32, 8, 128, 16) if not args.quick else (4, 512, 8, 2, 64, 16)
    dtype = torch.bfloat16
    n_pages = B * S // P
    g = torch.Generator(device=DEV).manual_seed(0)
    kp = torch.randn(n_pages, P, Hkv, D, device=DEV, dtype=dtype, generator=g)
    vp = torch.randn(n_pages, P, Hkv, D, device=DEV, dtype=dtype, generator=g)
    table = torch.randperm(n_pages, device=DEV, generator=g).view(B, S // P).int()
    lens = torch.full((B,), S, device=DEV, dtype=torch.int32)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=dtype, generator=g)
    kc = kp[table.long()].reshape(B, S, Hkv, D).transpose(1, 2).contiguous()
    vc = vp[table.long()].reshape(B, S, Hkv, D).transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gather_sdpa():
        k = kp[table.long()].reshape(B, S, Hkv, D).transpose(1, 2)
        v = vp[table.long()].reshape(B, S, Hkv, D).transpose(1, 2)
        return sdpa(q, k, v, enable_gqa=True)

    ceil = ceilings()
    kv_bytes = 2 * kp.numel() * kp.element_size()
    row = {"shape": dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, P=P, dtype=str(dtype))}
    with torch.no_grad():
        ref = sdpa(q.double(), kc.double(), vc.double(), enable_gqa=True)
        t_sdpa = bench(lambda: sdpa(q, kc, vc, enable_gqa=True))
        t_gather = bench(gather_sdpa)
        row.update({"sdpa_contiguous_ms": t_sdpa, "gather_sdpa_ms": t_gather})
        impls = {"paged_attention": lambda: paged_attention(q, kp, vp, table, lens)}
        try:
            from selfattn.kernels.triton.paged import paged_attention_triton

            lo = torch.zeros(B, 1, dtype=torch.int32, device=DEV)
            hi = lens.view(B, 1)
            impls["triton kernel"] = lambda: paged_attention_triton(
                q, kp, vp, table, lo, hi, D**-0.5
            )[0]
        except Exception as e:
            row["triton kernel"] = f"error: {type(e).__name__}: {e}"
        for name, fn in impls.items():
            try:
                err = (fn().double() - ref).abs().max().item()
                ms = bench(fn)
                row[name] = {
                    "ms": ms,
                    "vs sdpa contiguous": ms / t_sdpa,
                    "vs gather+sdpa": ms / t_gather,
                    "K/V GB/s": kv_bytes / ms / 1e6,
                    "% of copy": 100 * kv_bytes / ms / 1e6 / ceil["copy_gbs"],
                    "max |err| vs fp64": err,
                }
            except Exception as e:
                row[name] = f"error: {type(e).__name__}: {str(e)[:300]}"
        # fp32 and int8 pages through the kernel (correctness on the GPU, not only timing)
        if "triton kernel" in impls:
            from selfattn.cache import quant

            for label, (kk, vv, ks, vs, qq) in {
                "triton fp32": (kp.float(), vp.float(), None, None, q.float()),
                "triton int8": (*_int8(quant, kp, vp), q),
            }.items():
                try:
                    k_ref = kk.float() if ks is None else quant.dequantize(kk, ks, torch.float32)
                    v_ref = vv.float() if vs is None else quant.dequantize(vv, vs, torch.float32)
                    kr = k_ref[table.long()].reshape(B, S, Hkv, D).transpose(1, 2).double()
                    vr = v_ref[table.long()].reshape(B, S, Hkv, D).transpose(1, 2).double()
                    r64 = sdpa(qq.double(), kr, vr, enable_gqa=True)
                    fn = functools.partial(
                        paged_attention_triton, qq, kk, vv, table, lo, hi, D**-0.5, ks, vs
                    )
                    err = (fn()[0].double() - r64).abs().max().item()
                    row[label] = {"ms": bench(fn), "max |err| vs fp64 of stored": err}
                except Exception as e:
                    row[label] = f"error: {type(e).__name__}: {str(e)[:300]}"
        row["copy GB/s"] = ceil["copy_gbs"]
    print(json.dumps(row), flush=True)
    return row


def _int8(quant, kp, vp):
    kq, ks = quant.quantize_int8(kp.float())
    vq, vs = quant.quantize_int8(vp.float())
    return kq, vq, ks, vs


# -- our Triton kernels ----------------------------------------------------------------------


class _Clock:
    """The part's time budget: rows past it are reported as not run (the part must fit in
    5 minutes on an H200 with the compiles included)."""

    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> bool:
        return time.time() < self.end


def _jit_entries(kernels) -> int | None:
    """Compiled variants in Triton's JIT caches of ``kernels`` (None: no JIT, the interpreter)."""
    total = 0
    for fn in kernels:
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total


def _sdpa_best(q, k, v) -> dict:
    """ms of causal SDPA per backend that runs the case; the best one's name and ms."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    found = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with sdpa_kernel(backend), torch.no_grad():
                found[name] = bench(lambda: sdpa(q, k, v, is_causal=True))
        except Exception as e:
            found[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
    timed = {n: ms for n, ms in found.items() if isinstance(ms, float)}
    best = min(timed, key=timed.get) if timed else None
    return {"per backend ms": found, "best": best, "best ms": timed.get(best)}


def _fwd_sweep(q, k, v, mask, clock) -> dict:
    """The forward's (block_m, block_n, warps, stages) candidates on the causal case: ms each
    (each a compile); the fastest goes into ``kernels/triton/attention.BLOCKS``."""
    from selfattn.kernels.triton import attention as tk

    D = q.shape[3]
    key = min(d for d in tk.BLOCKS["fwd"] if d >= D)
    saved = tk.BLOCKS["fwd"][key]
    candidates = [saved, tk.Blocks(128, 128, 8, 2), tk.Blocks(64, 64, 4, 3),
                  tk.Blocks(128, 64, 4, 3), tk.Blocks(128, 32, 4, 4)]  # fmt: skip
    if DEV != "cuda":  # the interpreter has its own tiles: nothing to sweep
        candidates = candidates[:1]
    out = {}
    try:
        for blk in dict.fromkeys(candidates):
            if not clock.left():
                out[str(blk)] = "not run: time budget"
                continue
            tk.BLOCKS["fwd"][key] = blk
            with torch.no_grad():
                out[str(blk)] = bench(
                    lambda: selfattn.attention(q, k, v, mask=mask, backend="triton")
                )
    finally:
        tk.BLOCKS["fwd"][key] = saved
    timed = {b: ms for b, ms in out.items() if isinstance(ms, float)}
    return {"ms": out, "best": min(timed, key=timed.get) if timed else None}


def _kernel_ms(q, k, v, mask) -> float:
    """ms of the forward kernel alone (the tile lists and intervals built once): what the
    per-call preparation and the finite check of ``backend="triton"`` add is the difference."""
    from selfattn.backends import triton as triton_backend
    from selfattn.call import prepare
    from selfattn.kernels import ops

    qq, kk, vv, call = prepare(q, k, v, mask=mask)
    with torch.no_grad():
        args = triton_backend.plan(qq, kk, vv, call)
        return bench(lambda: ops.attention_triton_fwd(*args))


def _timed(fn, mode: str, q, k, v) -> float:
    if mode == "fwd":
        with torch.no_grad():
            return bench(lambda: fn(q, k, v))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    return bench(lambda: fn(qg, kg, vg).sum().backward())


def _doc_ids(S: int, n: int, seed: int) -> torch.Tensor:
    """``n`` documents of random lengths covering ``S`` positions: ids ``(S,)``."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(S - 1, generator=g)[: n - 1] + 1).values
    ids = torch.zeros(S, dtype=torch.long)
    for c in cuts.tolist():
        ids[c:] += 1
    return ids


def part_triton(args) -> dict:
    from selfattn.kernels.triton import attention as tk

    on_gpu = DEV == "cuda"
    clock = _Clock(280.0 if on_gpu else 120.0)
    B, H, S, D = (2, 16, 8192, 128) if not args.quick else (1, 2, 48, 16)
    window = 1024 if not args.quick else 12
    n_var = 10 if not args.quick else 3
    dtype = torch.bfloat16 if on_gpu else torch.float32
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=DEV, dtype=dtype, generator=g) for _ in range(3))
    result: dict = {"shape": dict(B=B, H=H, S=S, D=D, dtype=str(dtype)), "rows": []}
    ours = functools.partial(selfattn.attention, backend="triton")

    # -- 0. correctness first (compiled, tensor-core bf16 dots): the fp64 oracle's ratio rule
    result["correct"] = {}
    n = 333 if on_gpu else 21
    for name, hkv, kw in (
        ("causal", H, {"mask": masks.causal()}),
        ("window & documents, alibi >> softcap, GQA",
         max(1, H // 2), {"mask": masks.sliding_window(n // 3) & masks.documents(_doc_ids(n, 3, 2)),
                          "score_mod": scores.alibi(H) >> scores.softcap(20.0)}),
    ):  # fmt: skip
        qc = torch.randn(1, H, n, D, device=DEV, generator=g).to(dtype)
        kc, vc = (torch.randn(1, hkv, n, D, device=DEV, generator=g).to(dtype) for _ in range(2))
        try:
            check_against_reference(ours, qc, kc, vc, **kw)
            result["correct"][name] = "pass"
        except Exception as e:
            result["correct"][name] = f"FAIL: {type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(result["correct"]), flush=True)

    # -- 1. causal forward against the best SDPA backend (target: >= 0.9x its TFLOP/s)
    causal = masks.causal()
    flops = 4 * B * H * D * S * (S + 1) / 2  # QKᵀ and PV over the attended pairs
    with torch.no_grad():
        t_ours = bench(lambda: ours(q, k, v, mask=causal))
    row = {"case": "causal fwd", "ours ms": t_ours, "ours TFLOP/s": flops / t_ours / 1e9}
    row["kernel alone ms"] = _kernel_ms(q, k, v, causal)
    row["kernel alone TFLOP/s"] = flops / row["kernel alone ms"] / 1e9
    best = _sdpa_best(q, k, v)
    row["sdpa"] = best
    if best["best ms"]:
        row["sdpa TFLOP/s"] = flops / best["best ms"] / 1e9
        row["ours / best sdpa TFLOP/s"] = best["best ms"] / t_ours
    row["tile sweep"] = _fwd_sweep(q, k, v, causal, clock)
    result["rows"].append(row)
    print(json.dumps(row, default=str), flush=True)

    # -- 2. window and documents, fwd and fwd+bwd, against hand-compiled static-shape Flex
    flex = None
    if on_gpu:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.recompile_limit = 64
        flex = torch.compile(flex_attention, dynamic=False)
    docs = _doc_ids(S, 4, seed=1).to(DEV)

    def window_mod(b, h, qi, ki, w=window):
        return (qi >= ki) & (qi - ki < w)

    def doc_mod(b, h, qi, ki, ids=docs):
        return (ids[qi] == ids[ki]) & (qi >= ki)

    cases = [
        (f"window {window}", masks.sliding_window(window), window_mod),
        ("4 causal documents", masks.causal() & masks.documents(docs), doc_mod),
    ]
    for name, mask, mask_mod in cases:
        block = create_block_mask(mask_mod, None, None, S, S, device=DEV) if flex else None
        for mode in ("fwd", "fwd+bwd"):
            if not clock.left():
                result["rows"].append({"case": name, "mode": mode, "status": "not run: budget"})
                continue
            row = {"case": name, "mode": mode}
            row["ours ms"] = _timed(lambda a, b_, c, m=mask: ours(a, b_, c, mask=m), mode, q, k, v)
            if mode == "fwd":
                row["kernel alone ms"] = _kernel_ms(q, k, v, mask)
            if flex is not None:
                row["flex static ms"] = _timed(
                    lambda a, b_, c, bm=block: flex(a, b_, c, block_mask=bm), mode, q, k, v
                )
                row["ours / flex"] = row["ours ms"] / row["flex static ms"]
            result["rows"].append(row)
            print(json.dumps(row), flush=True)

    # -- 3. compiles across new window sizes, document layouts and lengths (target: ours 0)
    kernels = (tk._attn_fwd,)
    variants = []
    for i in range(n_var):
        if i % 3 == 0:
            w = window // 2 + 37 * (i + 1)
            variants.append(
                (f"window {w}", S, masks.sliding_window(w), functools.partial(window_mod, w=w))
            )
        elif i % 3 == 1:
            ids = _doc_ids(S, 3 + i, seed=i).to(DEV)
            variants.append(
                (
                    f"{3 + i} documents",
                    S,
                    masks.causal() & masks.documents(ids),
                    functools.partial(doc_mod, ids=ids),
                )
            )
        else:
            n = S - S // 16 * i - 3  # a length no tile size divides
            variants.append((f"causal S={n}", n, masks.causal(), None))
    row = {"case": f"compiles over {n_var} new masks/lengths (forward)", "variants": []}
    before_jit = _jit_entries(kernels)
    before_keys = len(tk.launches)
    dyn = torch._dynamo.utils.counters
    flex_graphs = 0
    for label, n, mask, mask_mod in variants:
        if not clock.left():
            row["variants"].append(f"{label}: not run (time budget)")
            continue
        qq, kk, vv = q[:, :, :n], k[:, :, :n], v[:, :, :n]
        t0 = time.perf_counter()
        with torch.no_grad():
            ours(qq, kk, vv, mask=mask)
        _sync()
        entry = {"variant": label, "ours first call s": time.perf_counter() - t0}
        if flex is not None:
            mm = mask_mod or (lambda b, h, qi, ki: qi >= ki)
            graphs = dyn["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            bm = create_block_mask(mm, None, None, n, n, device=DEV)
            with torch.no_grad():
                flex(qq, kk, vv, block_mask=bm)
            _sync()
            entry["flex first call s"] = time.perf_counter() - t0
            flex_graphs += dyn["stats"]["unique_graphs"] - graphs
        row["variants"].append(entry)
    after_jit = _jit_entries(kernels)
    row["ours new JIT compiles"] = (
        None if before_jit is None else after_jit - before_jit
    )  # None under the interpreter: no JIT cache; the specialisation keys below stand for it
    row["ours new specialisation keys"] = len(tk.launches) - before_keys
    if flex is not None:
        row["flex new graphs (Dynamo unique_graphs)"] = flex_graphs
    result["rows"].append(row)
    print(json.dumps(row, default=str), flush=True)

    # -- 4. paged decode against the copy rate, SDPA on contiguous K/V, gather + SDPA
    if not on_gpu:
        result["decode"] = "not run on CPU: --part decode is its smoke run"
    else:
        result["decode"] = _decode_triton(args, clock) if clock.left() else "not run: budget"
    result["calibrate"] = _calibration(result)
    result["targets"] = _targets(result)
    return result


def _decode_triton(args, clock) -> dict:
    """Paged decode rows with a sweep of the key splits (the split table's entries)."""
    from selfattn.kernels.triton.paged import paged_attention_triton

    row = part_decode(args)
    B, S, Hq, Hkv, D, P = (32, 4096, 32, 8, 128, 16) if not args.quick else (4, 512, 8, 2, 64, 16)
    g = torch.Generator(device=DEV).manual_seed(0)
    n_pages = B * S // P
    kp = torch.randn(n_pages, P, Hkv, D, device=DEV, dtype=torch.bfloat16, generator=g)
    vp = torch.randn_like(kp)
    table = torch.randperm(n_pages, device=DEV, generator=g).view(B, S // P).int()
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
    lo = torch.zeros(B, 1, dtype=torch.int32, device=DEV)
    hi = torch.full((B, 1), S, dtype=torch.int32, device=DEV)
    sweep = {}
    for n in (1, 2, 4, 8, 16, 32):
        if clock.left():
            sweep[n] = bench(lambda n=n: paged_attention_triton(q, kp, vp, table, lo, hi, 0.1,
                                                                num_splits=n))  # fmt: skip
    row["splits sweep ms"] = sweep
    return row


def _targets(result: dict) -> dict:
    """Issue 17's targets, each ``[measured, target, met]`` (None where not measured)."""
    out = {}

    def put(name, value, target, met):
        out[name] = [value, target, None if value is None else bool(met(value))]

    for row in result["rows"]:
        case, mode = row.get("case", ""), row.get("mode")
        if case == "causal fwd":
            put("causal fwd vs best SDPA TFLOP/s", row.get("ours / best sdpa TFLOP/s"),
                ">= 0.9", lambda x: x >= 0.9)  # fmt: skip
            if row["sdpa"]["best ms"]:
                put("causal fwd kernel alone vs best SDPA TFLOP/s",
                    row["sdpa"]["best ms"] / row["kernel alone ms"], ">= 0.9",
                    lambda x: x >= 0.9)  # fmt: skip
        elif "ours / flex" in row:
            put(f"{case} {mode} vs static Flex time", row["ours / flex"], "<= 1.0",
                lambda x: x <= 1.0)  # fmt: skip
        elif case.startswith("compiles over"):
            n = row.get("ours new JIT compiles")
            put("ours new JIT compiles", n, "0", lambda x: x == 0)
    decode = result.get("decode")
    if isinstance(decode, dict) and isinstance(decode.get("triton kernel"), dict):
        kern = decode["triton kernel"]
        put("paged decode % of copy rate", kern["% of copy"], ">= 70", lambda x: x >= 70)
        put("paged decode vs SDPA contiguous", kern["vs sdpa contiguous"], "<= 1.3",
            lambda x: x <= 1.3)  # fmt: skip
        put("paged decode vs gather + SDPA", kern["vs gather+sdpa"], "<= 0.5", lambda x: x <= 0.5)
    return out


def _calibration(result: dict) -> dict:
    """What to paste where after a GPU run (ratios against SDPA's fused kernel)."""
    out = {}
    for row in result["rows"]:
        if row.get("case") == "causal fwd" and "ours / best sdpa TFLOP/s" in row:
            out["COSTS['plain'] (per pair vs sdpa)"] = 1 / row["ours / best sdpa TFLOP/s"]
            out["BLOCKS['fwd'] best"] = row["tile sweep"]["best"]
    return out


PARTS = ("correct", "speed", "decode", "triton")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, help="one part (default: all, one process each)")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--budget", type=float, default=240.0, help="seconds for --part correct")
    p.add_argument(
        "--json", nargs="?", const="-", metavar="FILE", help="write the results as JSON to FILE "
        "(stdout without FILE)"
    )  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the script")
    args = p.parse_args(argv)
    global DEV, REPS
    DEV = args.device
    REPS = REPS if DEV == "cuda" else (1, 1)
    if DEV == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --device cpu for a smoke run", file=sys.stderr)
        return 2
    to_stdout = args.json == "-"
    # JSON on stdout: the progress lines go to stderr
    with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
        code, result = _all_parts(args) if args.part is None else _one_part(args)
    if args.json:
        text = json.dumps(result, indent=1, default=str)
        if to_stdout:
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return code


def _one_part(args) -> tuple[int, dict]:
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    print(f"# {name} torch {torch.__version__}", flush=True)
    try:
        parts = {"correct": part_correct, "speed": part_speed, "decode": part_decode}
        result = {**parts, "triton": part_triton}[args.part](args)
    except Exception:
        traceback.print_exc()
        return 1, {}
    from selfattn.benchmarks import _util

    result["device"] = name
    result["machine"] = _util.machine()
    return 0, result


def _all_parts(args) -> tuple[int, dict]:
    """Each part in a fresh process (FlexAttention's compile cache and Dynamo's recompile limit
    are per process); ``{"machine": ..., part: its result}``."""
    import os
    import subprocess
    import tempfile

    from selfattn.benchmarks import _util

    code, results = 0, {"machine": _util.machine()}  # the parts' results follow
    with tempfile.TemporaryDirectory(prefix="selfattn-gpu-") as tmp:
        for part in PARTS:
            out = os.path.join(tmp, f"{part}.json")
            cmd = [sys.executable, "-m", __spec__.name, "--part", part, "--json", out]
            cmd += ["--device", args.device, "--budget", str(args.budget)]
            cmd += ["--quick"] if args.quick else []
            sys.stdout.flush()
            done = subprocess.run(cmd, stdout=sys.stdout, stderr=sys.stderr)
            code = code or done.returncode
            if os.path.exists(out):
                with open(out) as f:
                    results[part] = json.load(f)
    return code, results


if __name__ == "__main__":
    sys.exit(main())
