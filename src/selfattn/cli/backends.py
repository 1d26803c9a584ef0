"""``selfattn backends``: what ``auto`` picks for a case and why every other backend was not
picked (:func:`selfattn.backends.explain`); ``--matrix``: every backend's verdict on probe cases
(:func:`selfattn.inspect.capability_matrix`)."""

from __future__ import annotations

import argparse
import math

from selfattn.cli import _common

# Beyond this size `backends` leaves its inputs uninitialised rather than filling them with random
# numbers: backend selection looks at shapes, dtypes and strides, never at values.
_MAX_INPUT_BYTES = 256 * 2**20

# --dtype spellings -> torch attribute names (torch itself is imported only to parse a value).
_DTYPES = {
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp64": "float64",
    "float64": "float64",
}


def _dtype(text: str):
    if text.lower() not in _DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose one of fp16, bf16, fp32, fp64"
        )
    import torch

    return getattr(torch, _DTYPES[text.lower()])


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _mask_arg(text: str):
    """``--mask``: ``none`` (no mask) or a mask expression, as ``selfattn mask`` reads it."""
    return None if text.strip() == "none" else _common.mask_expression(text)


def _score_mod_spec(text: str) -> tuple[str, float | None]:
    name, _, arg = text.partition(":")
    if name in ("none", "alibi") and not arg:
        return name, None
    if name == "softcap" and arg:
        try:
            cap = float(arg)
        except ValueError:
            cap = float("nan")
        if not (math.isfinite(cap) and cap > 0):
            raise argparse.ArgumentTypeError(f"softcap needs a positive number, got {arg!r}")
        return name, cap
    raise argparse.ArgumentTypeError(
        f"unknown score mod {text!r}; use none, alibi or softcap:CAP (e.g. softcap:30)"
    )


def add_parser(subparsers):
    positive = _common.positive_int
    p = subparsers.add_parser(
        "backends",
        help="which backend `auto` picks for a case, and why each other one was not picked",
        description=(
            "Build random inputs of the given shape and print selfattn.backends.explain(...): the "
            "backend `auto` picks and each backend's reason. Shapes use the alphabet "
            "q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D/Dv)."
        ),
    )
    p.add_argument("--batch", type=positive, default=1, metavar="B", help="default 1")
    p.add_argument(
        "--heads", type=positive, default=8, metavar="Hq", help="query heads (default 8)"
    )
    p.add_argument("--kv-heads", type=positive, metavar="Hkv", help="key/value heads (default Hq)")
    p.add_argument(
        "--seq", type=positive, default=1024, metavar="Sq", help="query length (default 1024)"
    )
    p.add_argument("--kv-seq", type=positive, metavar="Sk", help="key length (default Sq)")
    p.add_argument("--head-dim", type=positive, default=64, metavar="D", help="default 64")
    p.add_argument("--v-head-dim", type=positive, metavar="Dv", help="default D")
    p.add_argument(
        "--dtype", type=_dtype, default="fp32", help="fp16, bf16, fp32 (default) or fp64"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    p.add_argument(
        "--mask",
        type=_mask_arg,
        default=None,
        metavar="EXPR",
        help=(
            "none (default) or a mask expression as `selfattn mask` reads it: causal, "
            "sliding_window(N), chunked(N), prefix_lm(N), padding(N) (N valid keys), "
            "documents(L, L, ...) (packed documents of these lengths, adding up to Sk); "
            "operators & | ~ and parentheses, e.g. 'causal & documents(512, 512)'"
        ),
    )
    p.add_argument(
        "--score-mod",
        type=_score_mod_spec,
        default=("none", None),
        metavar="SPEC",
        help="none (default), alibi or softcap:CAP",
    )
    p.add_argument(
        "--dropout", type=_probability, default=0.0, metavar="P", help="dropout_p (default 0)"
    )
    p.add_argument(
        "--q-offset", type=int, metavar="N", help="position of query row 0 (default Sk-Sq)"
    )
    p.add_argument("--grad", action="store_true", help="inputs require gradients (training)")
    p.add_argument("--lse", action="store_true", help="ask for return_lse=True")
    p.add_argument(
        "--matrix",
        action="store_true",
        help="instead of one case, print every backend's verdict on small probe cases that each "
        "ask for one feature (masks, score mods, GQA, dropout, grad, lse, dtypes, device)",
    )
    p.add_argument(
        "--variants",
        action="store_true",
        help="instead of one case, print which backend (dense and paged) runs each attention "
        "variant (sinks, softcap, MLA, differential attention, QK-norm, Llama-4's chunks, the "
        "StreamingLLM cache), forward and backward",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="with --matrix or --variants: print a Markdown table (as the docs show it)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run, subparser=p)
    return p


def _case_tensors(shape, dtype, device, grad: bool, generator):
    """Random inputs of ``shape``; past ``_MAX_INPUT_BYTES``, uninitialised ones (and a note).

    Backend selection reads shapes, dtypes and strides, never values, and ``torch.empty`` pages
    that are never written cost no memory. Should even that allocation fail, a stride-0 view of one
    row stands in.
    """
    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    note = ""
    if nbytes <= _MAX_INPUT_BYTES:
        t = torch.randn(shape, generator=generator, dtype=dtype).to(device)
    else:
        try:
            t = torch.empty(shape, dtype=dtype, device=device)
            note = "large inputs: uninitialised tensors (selection never reads values)"
        except RuntimeError:
            t = torch.empty(shape[-1], dtype=dtype, device=device).expand(shape)
            note = "inputs too large to allocate: stride-0 views stand in (strides differ)"
    return t.requires_grad_(grad) if t.is_leaf else t, note


def _run_variants(args) -> int:
    from selfattn.inspect.backend_matrix import variants_markdown, variants_matrix

    matrix = variants_matrix()
    if args.json:
        _common.print_json(matrix)
        return _common.EXIT_OK
    print(variants_markdown(matrix))
    if not args.markdown:
        print(
            "\nfwd+bwd: forward and backward; fwd: inference only; bold: auto's pick; paged: "
            "selfattn.cache.paged_attention (decode); probed on this machine (CPU, fp32); "
            "`selfattn backends --matrix` and `explain` give each backend's reasons"
        )
    return _common.EXIT_OK


def _run_matrix(args) -> int:
    from selfattn.inspect.backend_matrix import capability_matrix, matrix_markdown

    matrix = capability_matrix()
    if args.json:
        _common.print_json(matrix)
        return _common.EXIT_OK
    if args.markdown:
        print(matrix_markdown(matrix))
        return _common.EXIT_OK
    names = matrix["backends"]
    out = _common.Printer()
    p = matrix["probe"]
    out.line(
        f"Each backend's verdict on a probe case (B={p['B']}, Hq={p['Hq']}, Sq=Sk={p['S']}, "
        f"D={p['D']}, fp32, CPU, causal, no grad) changed in one feature; auto's pick marked *."
    )
    rows = []
    for f in matrix["features"]:
        if "skipped" in f:
            rows.append([f["feature"], *(["n/a"] * len(names))])
            continue
        cells = [
            ("yes" if f["reasons"].get(n) is None else "no") + ("*" if f.get("auto") == n else "")
            for n in names
        ]
        rows.append([f["feature"], *cells])
    out.table(["feature", *names], rows)
    out.line()
    out.line("why not:")
    probed = [f for f in matrix["features"] if "skipped" not in f]
    for f in matrix["features"]:
        if "skipped" in f:
            out.line(f"  {f['feature']}: not probed, {f['skipped']}")
    for n in names:
        by_reason: dict[str, list[str]] = {}
        for f in probed:
            if f["reasons"].get(n) is not None:
                by_reason.setdefault(f["reasons"][n], []).append(f["feature"])
        for reason, features in by_reason.items():
            which = "every feature" if len(features) == len(probed) else ", ".join(features)
            out.line(f"  {n} [{which}]: {reason}")
    return _common.EXIT_OK


def run(args) -> int:
    if args.matrix:
        return _run_matrix(args)
    if args.variants:
        return _run_variants(args)
    import torch

    import selfattn as sa

    parser = args.subparser
    B, Hq, Sq = args.batch, args.heads, args.seq
    Hkv = args.kv_heads if args.kv_heads is not None else Hq
    Sk = args.kv_seq if args.kv_seq is not None else Sq
    D = args.head_dim
    Dv = args.v_head_dim if args.v_head_dim is not None else D
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: no CUDA device is available (torch.cuda.is_available() is False)"
        )
    g = torch.Generator().manual_seed(0)
    (q, n1), (k, n2), (v, n3) = (
        _case_tensors(shape, args.dtype, args.device, args.grad, g)
        for shape in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv))
    )
    note = n1 or n2 or n3
    mod_name, cap = args.score_mod
    score_mod = None
    if mod_name == "alibi":
        score_mod = sa.scores.alibi(Hq)
    elif mod_name == "softcap":
        score_mod = sa.scores.softcap(cap)
    kwargs = dict(
        mask=args.mask,
        score_mod=score_mod,
        dropout_p=args.dropout,
        q_offset=args.q_offset,
        return_lse=args.lse,
    )
    try:
        explanation = sa.backends.explain(q, k, v, print_table=False, **kwargs)
    except (ValueError, TypeError) as e:  # the library's input validation: a bad combination
        parser.error(str(e))

    case = {
        "q": [B, Hq, Sq, D],
        "k": [B, Hkv, Sk, D],
        "v": [B, Hkv, Sk, Dv],
        "dtype": str(args.dtype).removeprefix("torch."),
        "device": args.device,
        "mask": repr(kwargs["mask"]),
        "score_mod": repr(score_mod),
        "dropout_p": args.dropout,
        "q_offset": args.q_offset if args.q_offset is not None else Sk - Sq,
        "grad": args.grad,
        "return_lse": args.lse,
        "note": note,
    }
    rows = []
    for name, reason in explanation.reasons.items():
        verdict = "chosen" if name == explanation.chosen else "can run" if reason is None else "no"
        why = (
            explanation.why
            if name == explanation.chosen
            else reason or explanation.notes.get(name, "ranked lower")
        )
        rows.append({"backend": name, "verdict": verdict, "can_run": reason is None, "reason": why})
    if args.json:
        _common.print_json(
            {"case": case, "chosen": explanation.chosen, "why": explanation.why, "backends": rows}
        )
        return _common.EXIT_OK
    out = _common.Printer()
    shapes = f"q {tuple(case['q'])}, k {tuple(case['k'])}, v {tuple(case['v'])}"
    out.line(f"case: {shapes} {case['dtype']} on {case['device']}")
    extras = f"mask={case['mask']}, score_mod={case['score_mod']}, q_offset={case['q_offset']}"
    extras += f", dropout_p={args.dropout:g}, grad={args.grad}, return_lse={args.lse}"
    out.line(f"      {extras}")
    if note:
        out.line(f"      note: {note}")
    out.line(f"auto -> {explanation.chosen}: {explanation.why}")
    out.table(
        ["backend", "verdict", "reason"], [[r["backend"], r["verdict"], r["reason"]] for r in rows]
    )
    return _common.EXIT_OK
