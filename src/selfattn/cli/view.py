"""``selfattn view``: the interactive attention explorer for a text, as one HTML file.

The bundled all-MiniLM-L6-v2 (or any sentence-transformers folder) shows its self-attention; a
transformers checkpoint folder (config.json, safetensors, tokenizer.json) shows a causal LM's
self-attention, or an encoder-decoder's encoder, decoder and cross-attention (one section each).
Every page has raw weights, rollout and attention x gradient (see ``--help`` for the output
that the gradient explains). ``--circuits`` adds a causal LM's circuits tab: induction heads on
repeated random tokens with their ablation, activation patching from TEXT into ``--corrupt``'s
text, and the logit lens of TEXT (:mod:`selfattn.inspect.circuits`).
"""

from __future__ import annotations

from pathlib import Path

from selfattn.cli import _common

_GRADIENT_HELP = (
    "attention x gradient explains: for a sentence encoder, the length of the pooled embedding "
    "along its own direction (or, with --compare, the cosine similarity to that text); for a "
    "language model, the logit of the token it predicts after TEXT (after --target for an "
    "encoder-decoder); for a ViT, the class token's final state along its own direction"
)


INDUCTION_BATCH = 4  # sequences of repeated random tokens the head scores average over


def add_parser(subparsers):
    p = subparsers.add_parser(
        "view",
        help="an interactive attention explorer for a text: one self-contained HTML page",
        description=(
            "Run TEXT through a model, capture every layer's attention "
            "(selfattn.inspect.capture_attention) with its gradient, and write one HTML page "
            "(no network needed, opens from file://): head view, model view, matrix view with "
            "hover values and the call's mask, raw weights / rollout / attention x gradient. "
            + _GRADIENT_HELP
            + "."
        ),
    )
    p.add_argument("text", metavar="TEXT", nargs="?", help="the text to attend over")
    p.add_argument(
        "--image",
        metavar="FILE",
        help="a PNG/JPEG for a ViT checkpoint (--model): the page shows the patch grid over it",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a sentence-transformers folder (default: the bundled all-MiniLM-L6-v2) or a "
        "transformers checkpoint folder of a causal LM or an encoder-decoder",
    )
    p.add_argument("--out", default="attention.html", metavar="FILE", help="the page to write")
    p.add_argument("--compare", metavar="TEXT", help="sentence encoders: explain similarity")
    p.add_argument(
        "--target", metavar="TEXT", help="encoder-decoders: the decoder's text (default: none)"
    )
    p.add_argument("--title", help="the page's title (default: the model and the text)")
    p.add_argument(
        "--decimals",
        type=int,
        choices=range(1, 5),
        default=3,
        metavar="N",
        help="round the embedded values to N decimals, 1-4 (default 3; 4 for long texts whose "
        "heads spread thinly, at about twice the page size)",
    )
    c = p.add_argument_group(
        "circuits (a causal LM: --model a checkpoint folder or .gguf file, default the bundled "
        "SmolLM2-135M-Instruct)"
    )
    c.add_argument(
        "--circuits",
        action="store_true",
        help="add a circuits tab: induction / previous-token / copying scores of every head, "
        "their ablation, activation patching (with --corrupt) and the logit lens of TEXT",
    )
    c.add_argument(
        "--ablate", type=int, default=5, metavar="K",
        help="mean-ablate the top K induction heads against K random heads (default 5; 0: none)",
    )  # fmt: skip
    c.add_argument(
        "--repeat", type=_common.positive_int, default=20, metavar="N",
        help="induction heads are scored on N random tokens repeated twice (default 20)",
    )  # fmt: skip
    c.add_argument(
        "--corrupt", metavar="TEXT2",
        help="patch each head from TEXT's run into TEXT2's (as many tokens as TEXT; without it "
        "the tab has no patching heatmap)",
    )  # fmt: skip
    c.add_argument(
        "--answer", metavar="TOKEN",
        help="patching's metric is logit[ANSWER] - logit[WRONG] at the last position (default: "
        "the model's next token after TEXT)",
    )  # fmt: skip
    c.add_argument(
        "--wrong", metavar="TOKEN",
        help="(default: the model's next token after TEXT2, else its runner-up after TEXT)",
    )  # fmt: skip
    _common.add_max_bytes(p, "when the captured maps would exceed")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    _common.add_threads(p)
    p.set_defaults(run=run, subparser=p)
    return p


def _is_sentence_transformers(path: str | None) -> bool:
    return path is None or any(
        (Path(path) / name).is_file() for name in ("modules.json", "sentence_bert_config.json")
    )


def encoder_sections(encoder, text: str, *, compare=None, max_bytes: int, decimals: int = 3):
    """The page of a :class:`~selfattn.models.SentenceEncoder` on ``text`` (one section)."""
    import torch

    from selfattn.inspect import attention_gradients, view_section

    ids, mask = encoder.tokenize([text])
    tokens = [encoder.tokenizer.id_to_token(int(i)) for i in ids[0]]
    target = None
    if compare is not None:
        with torch.no_grad():
            target = encoder.encode(compare)

    def output():
        pooled = encoder.pool(encoder.model(ids, attention_mask=mask), mask)[0]
        if target is not None:
            return torch.nn.functional.cosine_similarity(pooled, target, dim=0)
        return pooled @ (pooled / pooled.norm()).detach()

    maps = attention_gradients(encoder.model, output, max_bytes=max_bytes)
    return [view_section(maps, tokens, name="self-attention", decimals=decimals)]


def load_checkpoint(path: str):
    """``(model, tokenizer)`` of a checkpoint folder or .gguf file, the model in eval mode."""
    from selfattn.models import from_pretrained, load_tokenizer

    return from_pretrained(path).eval(), load_tokenizer(path)


def checkpoint_sections(
    model, tok, text: str, *, target=None, max_bytes: int, decimals: int = 3
) -> list[dict]:
    """The page of a checkpoint (:func:`load_checkpoint`): a causal LM's self-attention, or an
    encoder-decoder's encoder, decoder and cross-attention sections."""
    import torch

    from selfattn.inspect import attention_gradients, attention_layers, view_section

    ids = torch.tensor([tok.encode(text)])
    names = [tok.decode([i]) for i in ids[0].tolist()]
    if not getattr(model, "is_encoder_decoder", False):
        maps = attention_gradients(
            model, lambda: model(ids)[0, -1].max(), max_bytes=max_bytes
        )  # the logit of the predicted next token
        return [view_section(maps, names, name="self-attention (causal)", decimals=decimals)]
    start = getattr(model, "decoder_start_token_id", None)
    start = 0 if start is None else start
    dec = [start, *(tok.encode(target, add_special_tokens=False) if target else [])]
    dec_ids = torch.tensor([dec])
    dec_names = [tok.decode([i]) for i in dec]
    maps = attention_gradients(
        model, lambda: model(ids, decoder_input_ids=dec_ids)[0, -1].max(), max_bytes=max_bytes
    )
    layers = attention_layers(model)
    groups: dict[str, list[int]] = {"encoder": [], "decoder": [], "cross-attention": []}
    for i, (name, _) in enumerate(layers):
        kind = "cross-attention" if "cross" in name else name.split(".")[0]
        groups.setdefault(kind, []).append(i)
    token_sides = {
        "encoder": (names, None),
        "decoder": (dec_names, None),
        "cross-attention": (dec_names, names),
    }
    return [
        view_section(
            maps,
            token_sides[g][0],
            key_tokens=token_sides[g][1],
            layers=ls,
            name=g,
            decimals=decimals,
        )
        for g, ls in groups.items()
        if ls and g in token_sides
    ]


def one_token(tok, text: str, flag: str) -> int:
    """The id of ``text``, which must be one token (``--answer`` / ``--wrong``)."""
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"{flag} {text!r} is {len(ids)} tokens {[tok.decode([i]) for i in ids]}; pass one "
            "token (mind a leading space: ' Paris')"
        )
    return ids[0]


def circuits_data(
    model, tok, text: str, *, corrupt=None, answer=None, wrong=None, ablate: int = 5,
    repeat: int = 20, decimals: int = 3,
) -> dict:  # fmt: skip
    """The circuits tab of a causal LM on ``text`` (:func:`selfattn.inspect.circuits_section`):
    induction heads on ``repeat`` random tokens repeated twice (``ablate`` top heads against as
    many random ones), the logit lens of ``text``, and, with ``corrupt``, each head patched from
    ``text``'s run into ``corrupt``'s, measured by the logit difference of ``answer`` over
    ``wrong`` (default: the model's next token after each text)."""
    import torch

    from selfattn.inspect import circuits_section
    from selfattn.inspect.circuits import (
        activation_patching,
        induction_heads,
        logit_difference,
        logit_lens,
    )

    ids = torch.tensor([tok.encode(text)])
    names = [tok.decode([i]) for i in ids[0].tolist()]
    bad = patching = metric = None
    if corrupt is not None:  # its errors come before the long steps
        bad, a, w = _patching_prompt(model, tok, ids, corrupt, answer, wrong)
        metric = f"logit[{tok.decode([a])!r}] - logit[{tok.decode([w])!r}] at the last position"
    with _common.spinner(f"induction heads on {repeat} random tokens repeated twice"):
        report = induction_heads(model, length=repeat, batch=INDUCTION_BATCH, ablate=ablate)
    with _common.spinner("the logit lens of TEXT"):
        lens = logit_lens(model, ids)
    if bad is not None:
        with _common.spinner(f"patching every head of {len(report.induction)} blocks"):
            patching = activation_patching(model, ids, bad, logit_difference(a, w))
    return circuits_section(
        report, patching, lens, tokens=names, tokenizer=tok, clean=text, corrupted=corrupt,
        metric=metric, decimals=decimals,
    )  # fmt: skip


def _patching_prompt(model, tok, ids, corrupt: str, answer, wrong):
    """``(corrupted ids, answer id, wrong id)``: ``answer`` defaults to the model's next token
    after TEXT, ``wrong`` to its next token after ``corrupt`` (its runner-up after TEXT where
    both agree)."""
    import torch

    bad = torch.tensor([tok.encode(corrupt)])
    if bad.shape != ids.shape:
        raise ValueError(
            f"--corrupt {corrupt!r} is {bad.shape[1]} tokens but TEXT is {ids.shape[1]}; "
            "patching pairs positions: change words for words of the same token count"
        )
    a = one_token(tok, answer, "--answer") if answer else None
    w = one_token(tok, wrong, "--wrong") if wrong else None
    with torch.no_grad():
        clean_next, bad_next = model(ids)[0, -1], model(bad)[0, -1]  # (V,) logits
    a = int(clean_next.argmax()) if a is None else a
    if w is None:
        w = int(bad_next.argmax())
        w = w if w != a else int(clean_next.topk(2).indices[1])
    return bad, a, w


def image_sections(path: str, image: str, *, max_bytes: int, decimals: int = 3) -> list[dict]:
    """The page of a ViT checkpoint folder on the picture ``image``: one section whose keys
    after the class token are the patch grid, drawn over the picture as the model saw it."""
    import io

    import torch

    from selfattn._optional import require
    from selfattn.inspect import attention_gradients, view_section
    from selfattn.models import ViT, from_pretrained
    from selfattn.models.hub import read_json

    Image = require("PIL.Image", purpose="selfattn view --image")
    model = from_pretrained(path).eval()
    if not isinstance(model, ViT):
        raise ValueError(
            f"--image needs a ViT checkpoint, but {path!r} holds a {type(model).__name__}; "
            "drop --image and pass TEXT"
        )
    c = model.config
    pre = Path(path) / "preprocessor_config.json"
    pre = read_json(pre, dict) if pre.is_file() else {}
    mean = torch.tensor(pre.get("image_mean", [0.5] * c.num_channels)).view(-1, 1, 1)
    std = torch.tensor(pre.get("image_std", [0.5] * c.num_channels)).view(-1, 1, 1)
    picture = Image.open(image).convert("RGB").resize(c.image_size[::-1], Image.BILINEAR)
    pixels = torch.frombuffer(bytearray(picture.tobytes()), dtype=torch.uint8)  # (H·W·3,)
    pixels = pixels.view(*c.image_size, 3).permute(2, 0, 1) / 255.0  # -> (3, H, W) in [0, 1]
    pixels = ((pixels - mean) / std).unsqueeze(0)  # -> (1, 3, H, W), the processor's scaling

    def output():  # the class token's final state along its own direction
        cls = model(pixels).last_hidden_state[0, 0]
        return cls @ (cls / cls.norm()).detach()

    maps = attention_gradients(model, output, max_bytes=max_bytes)
    rows, cols = c.grid
    tokens = ["[CLS]", *(f"patch ({r}, {q})" for r in range(rows) for q in range(cols))]
    png = io.BytesIO()
    picture.save(png, format="PNG")
    section = view_section(
        maps, tokens, grid=(rows, cols), prefix=1, image=png.getvalue(), name="ViT",
        decimals=decimals,
    )  # fmt: skip
    return [section]


def run(args) -> int:
    _common.apply_threads(args)
    _check_circuit_flags(args)
    if args.image is None and not (args.text or "").strip():
        args.subparser.error("TEXT is empty; pass a sentence, e.g. 'The cat sat on the mat.'")
    if args.image is not None and args.model is None:
        args.subparser.error("--image needs --model, the folder of a ViT checkpoint")
    if Path(args.out).suffix.lower() not in (".html", ".htm"):
        args.subparser.error(f"--out {args.out!r}: the page's name must end in .html")
    from selfattn.inspect import write_view

    with _common.spinner("capturing attention and its gradient"):
        if args.image is not None:
            sections = image_sections(
                args.model, args.image, max_bytes=args.max_bytes, decimals=args.decimals
            )
            model_name = Path(args.model).name
        elif not args.circuits and _is_sentence_transformers(args.model):
            encoder = _common.load_encoder(args.model)
            sections = encoder_sections(
                encoder, args.text, compare=args.compare, max_bytes=args.max_bytes,
                decimals=args.decimals,
            )  # fmt: skip
            model_name = args.model or "all-MiniLM-L6-v2"
        else:
            path = _common.model_path(args.model)
            model, tok = load_checkpoint(path)
            if args.circuits and getattr(model, "is_encoder_decoder", False):
                args.subparser.error(f"--circuits needs a causal LM; {path!r} is encoder-decoder")
            sections = checkpoint_sections(
                model, tok, args.text, target=args.target, max_bytes=args.max_bytes,
                decimals=args.decimals,
            )  # fmt: skip
            model_name = _common.CHAT_MODEL_NAME if args.model is None else Path(path).name
    circuits = None
    if args.circuits:
        circuits = circuits_data(
            model, tok, args.text, corrupt=args.corrupt, answer=args.answer, wrong=args.wrong,
            ablate=args.ablate, repeat=args.repeat, decimals=args.decimals,
        )  # fmt: skip
    title = args.title or f"{model_name}: {args.text or Path(args.image).name}"
    path = write_view(sections, None, args.out, title=title, circuits=circuits)
    summary = {
        "out": str(path),
        "bytes": path.stat().st_size,
        "sections": [
            {"name": s["name"], "layers": len(s["layers"]), "queries": s["queries"]}
            for s in sections
        ],
        "circuits": None if circuits is None else _circuits_summary(circuits),
    }
    if args.json:
        _common.print_json(summary)
        return _common.EXIT_OK
    from selfattn.cache.size import format_bytes

    out = _common.Printer()
    for s in summary["sections"]:
        out.line(f"{s['name']}: {s['layers']} layers, tokens: {' '.join(s['queries'])}")
    c = summary["circuits"]
    if c is not None:
        out.line(
            f"circuits: {c['heads']} heads, {len(c['induction_heads'])} induction head(s)"
            + ("" if c["patching"] else "; no patching (pass --corrupt TEXT2)")
        )
    out.line(f"wrote {path} ({format_bytes(summary['bytes'])}); open it in a browser")
    return _common.EXIT_OK


def _check_circuit_flags(args) -> None:
    """Usage errors of the circuits flags, before any model loads."""
    if not args.circuits:
        for flag in ("corrupt", "answer", "wrong"):
            if getattr(args, flag) is not None:
                args.subparser.error(f"--{flag} needs --circuits")
        return
    if args.image is not None:
        args.subparser.error("--circuits needs a causal LM; drop --image")
    if args.model is not None and _is_sentence_transformers(args.model):
        args.subparser.error(
            f"--circuits needs a causal LM, but {args.model!r} is a sentence encoder; pass a "
            "checkpoint folder or .gguf file (or no --model: the bundled SmolLM2-135M-Instruct)"
        )
    if args.ablate < 0:
        args.subparser.error(f"--ablate {args.ablate}: pass 0 (no ablation) or more heads")
    if (args.answer or args.wrong) and args.corrupt is None:
        args.subparser.error("--answer and --wrong name patching's metric: pass --corrupt TEXT2")


def _circuits_summary(circuits: dict) -> dict:
    """What ``--json`` reports of the circuits tab."""
    heads = circuits["heads"]
    patching = circuits["patching"]
    return {
        "heads": len(heads["rows"]),
        "induction_heads": [[r[0], r[1]] for r in heads["rows"] if r[5]],
        "ablation": circuits["ablation"],
        "patching": None
        if patching is None
        else {k: patching[k] for k in ("metric", "clean", "corrupted")},
        "lens_layers": len(circuits["lens"]["layers"]),
    }
