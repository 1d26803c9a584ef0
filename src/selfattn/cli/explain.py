"""``selfattn explain``: a worked numeric example, computed by the library
(:func:`selfattn.inspect.worked_example`), laid out step by step."""

from __future__ import annotations

import math

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "explain",
        help="the textbook worked example, step by step, computed by the library",
        description=(
            "Walk through scaled dot-product attention on a three-token example "
            "(q = [1, 0], d_k = 2): scores, scaling, softmax, output; then the causal mask and "
            "softmax saturation with autograd gradients."
        ),
    )
    p.add_argument(
        "--json", action="store_true", help="print every number as JSON (full precision)"
    )
    p.add_argument(
        "--precision",
        type=_common.nonnegative_int,
        default=3,
        metavar="N",
        help="digits after the point",
    )
    p.set_defaults(run=run)
    return p


def _fmt_vec(xs, p: int | None = None, style: str = "f") -> str:
    """``[0.707, 0.000]`` (``p`` digits of format type ``style``), or ``[1, 0]`` when p is None."""
    return "[" + ", ".join(f"{x:g}" if p is None else f"{x:.{p}{style}}" for x in xs) + "]"


def run(args) -> int:
    from selfattn.inspect.worked_example import worked_example

    ex = worked_example()
    if args.json:
        _common.print_json(ex)
        return _common.EXIT_OK
    p = args.precision
    out = _common.Printer()
    f = lambda x: f"{x:.{p}f}"  # noqa: E731
    inp = ex["inputs"]
    out.heading("Scaled dot-product attention by hand (three tokens, computed by selfattn)")
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
    return _common.EXIT_OK
