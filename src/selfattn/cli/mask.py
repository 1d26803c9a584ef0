"""``selfattn mask``: parse a mask expression (:func:`selfattn.inspect.parse_mask`, the grammar
every subcommand's masks use) and draw it as text, and optionally as a .png/.svg picture."""

from __future__ import annotations

from selfattn.cli import _common

# Peak memory of `selfattn mask` per (query, key) pair, measured at about 20 bytes for
# Sq = Sk = 3000-4000: the dense bool mask (twice: the count and the picture), the text picture
# (UCS-2 rows, joined, split again for --json) and the JSON text ("\u2588" per cell).
_MASK_BYTES_PER_PAIR = 24


def _mask_expr(text: str):
    return text, _common.mask_expression(text)


def add_parser(subparsers):
    p = subparsers.add_parser(
        "mask",
        help='render a mask expression such as "causal & sliding_window(3)"',
        description=(
            "Parse EXPR (names causal, sliding_window(n), chunked(n), prefix_lm(n), padding(n), "
            "documents(len, len, ...); operators & | ~ and parentheses) into a selfattn.masks "
            "mask and draw it: rows = queries, columns = keys, █ attend, · masked."
        ),
    )
    p.add_argument("expr", type=_mask_expr, metavar="EXPR", help="the mask expression")
    p.add_argument(
        "--size", type=_common.positive_int, required=True, metavar="N", help="queries Sq"
    )
    p.add_argument("--kv-size", type=_common.positive_int, metavar="Sk", help="keys (default N)")
    p.add_argument(
        "--out", type=_common.picture_path, metavar="FILE", help="also write a .png or .svg picture"
    )
    _common.add_max_bytes(p, "sizes whose dense mask and pictures would exceed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run, subparser=p)
    return p


def _mask_bytes(Sq: int, Sk: int, out: str | None) -> tuple[int, str]:
    """Bytes ``selfattn mask`` needs for an (Sq, Sk) picture, and what they are made of."""
    from selfattn.cache import format_bytes
    from selfattn.inspect.plot import mask_figure_bytes

    text = Sq * Sk * _MASK_BYTES_PER_PAIR
    parts = f"{Sq} x {Sk} pairs x {_MASK_BYTES_PER_PAIR} B for the dense mask and text"
    if out is None:
        return text, parts
    canvas = mask_figure_bytes(Sq, Sk)
    return text + canvas, f"{parts} + {format_bytes(canvas)} for the --out canvas"


def run(args) -> int:
    from selfattn.cache import format_bytes as fmt

    expr, mask = args.expr
    Sq, Sk = args.size, args.kv_size if args.kv_size is not None else args.size
    need, parts = _mask_bytes(Sq, Sk, args.out)
    if need > args.max_bytes:
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
        _common.print_json(result)
        return _common.EXIT_OK
    out = _common.Printer()
    out.line(f"{expr}  ->  {result['mask']}")
    out.line(f"rows = queries (Sq={Sq}), columns = keys (Sk={Sk}); █ attend, · masked")
    out.line(picture)
    out.line(f"{result['allowed']} of {Sq * Sk} pairs attend ({result['density']:.1%})")
    if args.out:
        out.line(f"wrote {args.out}")
    return _common.EXIT_OK
