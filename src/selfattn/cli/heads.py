"""``selfattn heads [MODEL]``: the induction and previous-token heads of a causal LM, found on
repeated random tokens (:func:`selfattn.inspect.circuits.induction_heads`), and with
``--ablate K`` what mean-ablating the top K induction heads does to the repeated half's loss,
against K random heads of the same blocks."""

from __future__ import annotations

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "heads",
        help="find a model's induction and previous-token heads (and ablate them)",
        description=(
            "Run MODEL on random tokens repeated twice and score every attention head: "
            "induction (attention from a repeated token to the token after its earlier "
            "occurrence), previous-token (attention to the token before) and copying (the OV "
            "circuit's eigenvalue share, Olsson et al. 2022). With --ablate K, mean-ablate the "
            "top K induction heads and K random heads of the same blocks and report the loss "
            "on the repeated half."
        ),
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help=_common.CHAT_MODEL_HELP)  # fmt: skip
    p.add_argument("--length", type=_common.int_at_least(2), default=40, metavar="T",
                   help="random tokens per half (default 40)")  # fmt: skip
    p.add_argument("--batch", type=_common.positive_int, default=8, metavar="B",
                   help="sequences (default 8)")  # fmt: skip
    p.add_argument("--seed", type=_common.nonnegative_int, default=0, help="random tokens' seed")
    p.add_argument("--ablate", type=_common.positive_int, default=None, metavar="K",
                   help="ablate the top K induction heads against K random heads")  # fmt: skip
    p.add_argument("--random-seeds", type=_common.positive_int, default=5, metavar="N",
                   help="draws of the random heads (default 5)")  # fmt: skip
    p.add_argument("--top", type=_common.positive_int, default=15, metavar="N",
                   help="rows of the table (default 15; --json lists every head)")  # fmt: skip
    p.add_argument("--threshold", type=float, default=0.3, metavar="S",
                   help="induction score that marks an induction head (default 0.3)")  # fmt: skip
    p.add_argument("--dtype", default="float32", metavar="DTYPE",
                   help="float32 (default), bfloat16, float64 or auto")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="print one object per head (layer, head, induction, prev_token, "
                   "copying, is_induction; ablation fields with --ablate)")  # fmt: skip
    _common.add_threads(p)
    p.set_defaults(run=run, subparser=p)
    return p


def run(args) -> int:
    from selfattn.inspect.circuits import induction_heads

    _common.apply_threads(args)
    model, _, name = _common.load_analysis_model(args.model, args.dtype)
    with _common.spinner(f"scoring heads of {name}"):
        report = induction_heads(
            model, length=args.length, batch=args.batch, seed=args.seed,
            ablate=args.ablate or 0, random_seeds=args.random_seeds,
        )  # fmt: skip
    rows = report.table(threshold=args.threshold)
    ab = report.ablation
    if ab:
        top = {tuple(h) for h in ab["heads"]}
        for r in rows:
            r["ablated_in_top_k"] = (r["layer"], r["head"]) in top
            r["ablation"] = {k: v for k, v in ab.items() if k != "heads"}
    if args.json:
        _common.print_json(rows)
        return _common.EXIT_OK
    out = _common.Printer()
    out.heading(f"Heads of {name} on {args.batch} x 2 x {args.length} repeated random tokens")
    out.table(
        ["layer", "head", "induction", "prev-token", "copying", ""],
        [[str(r["layer"]), str(r["head"]), f"{r['induction']:.3f}", f"{r['prev_token']:.3f}",
          f"{r['copying']:+.2f}", "induction head" if r["is_induction"] else ""]
         for r in rows[: args.top]],
    )  # fmt: skip
    found = [r for r in rows if r["is_induction"]]
    layers = sorted({r["layer"] for r in found})
    out.line(
        f"{len(found)} heads score >= {args.threshold} (blocks {layers}); loss on the first "
        f"half {report.loss_first:.3f}, on the repeated half {report.loss_repeated:.3f}"
    )
    if ab:
        out.line(
            f"mean-ablating the top {ab['k']} induction heads {ab['heads']}: repeated-half loss "
            f"{ab['loss_repeated']:.3f} -> {ab['loss_top_ablated']:.3f}; {ab['k']} random heads "
            f"of the same blocks ({ab['random_seeds']} draws): "
            f"{ab['loss_random_ablated_mean']:.3f} +- {ab['loss_random_ablated_std']:.3f}"
        )
    return _common.EXIT_OK
