"""``selfattn lens [MODEL] PROMPT``: the logit lens (:func:`selfattn.inspect.circuits.
logit_lens`): the residual stream after every block read through the final norm and
unembedding, as the next-token distribution it would give."""

from __future__ import annotations

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
        "lens",
        help="the logit lens: what each layer would predict next, for a prompt",
        description=(
            "Run PROMPT through MODEL and read the residual stream entering the first block "
            "and after every block through the final norm and the unembedding: the top tokens "
            "each layer would predict at each position (the last by default), and with "
            "--answer the rank and probability of that token per layer."
        ),
    )
    p.add_argument("args", metavar="[MODEL] PROMPT", nargs="+",
                   help="MODEL (" + _common.CHAT_MODEL_HELP + ") then the prompt")  # fmt: skip
    p.add_argument("--top", type=_common.positive_int, default=5, metavar="K",
                   help="top tokens per layer and position (default 5)")  # fmt: skip
    p.add_argument("--answer", metavar="TEXT",
                   help="track this token (its first, with the space it starts with)")  # fmt: skip
    p.add_argument("--all-positions", action="store_true",
                   help="a table per position (default: the last position only)")  # fmt: skip
    p.add_argument("--dtype", default="float32", metavar="DTYPE",
                   help="float32 (default), bfloat16, float64 or auto")  # fmt: skip
    p.add_argument(
        "--json",
        action="store_true",
        help="print per layer the top tokens with probabilities at every position",
    )
    _common.add_threads(p)
    p.set_defaults(run=run, subparser=p)
    return p


def run(args) -> int:
    import torch

    from selfattn.inspect.circuits import logit_lens

    if len(args.args) > 2:
        args.subparser.error(
            f"expected [MODEL] PROMPT, got {len(args.args)} arguments: quote the prompt"
        )
    model_name, prompt = (None, *args.args) if len(args.args) == 1 else args.args
    _common.apply_threads(args)
    model, tok, name = _common.load_analysis_model(model_name, args.dtype)
    ids = list(tok.encode(prompt))
    if not ids:
        args.subparser.error("PROMPT is empty after tokenising")
    answer = None
    if args.answer is not None:
        got = list(tok.encode(args.answer))
        if not got:
            args.subparser.error(f"--answer {args.answer!r} is empty after tokenising")
        answer = got[0]
    x = torch.tensor([ids], device=next(model.parameters()).device)
    lens = logit_lens(model, x, top=args.top, answer=answer)
    if args.json:
        _common.print_json({"model": name, "tokens": [tok.decode([t]) for t in ids],
                            "answer": args.answer, "layers": lens.as_json(tok)})  # fmt: skip
        return _common.EXIT_OK
    out = _common.Printer()
    positions = range(len(ids)) if args.all_positions else [len(ids) - 1]
    for s in positions:
        after = tok.decode(ids[: s + 1])
        out.heading(f"{name}: next token after {after[-60:]!r} (position {s})")
        cols = ["layer", "top tokens"] + (["answer rank", "answer p"] if answer is not None else [])
        rows = []
        for i, layer in enumerate(lens.layers):
            tops = ", ".join(
                f"{tok.decode([int(t)])!r} {float(p):.2f}"
                for t, p in zip(lens.top_ids[i, 0, s], lens.top_probs[i, 0, s])
            )
            row = [layer, tops]
            if answer is not None:
                row += [
                    str(int(lens.answer_rank[i, 0, s])),
                    f"{float(lens.answer_prob[i, 0, s]):.3f}",
                ]
            rows.append(row)
        out.table(cols, rows)
    return _common.EXIT_OK
