"""The ``selfattn`` command: assembles one parser per subcommand and runs the one asked for.

Each subcommand is a module of this package with ``add_parser(subparsers)`` (its flags; the
parser's ``run`` default is the module's ``run(args) -> exit code``). Building the parser imports
neither torch nor rich: ``selfattn --help`` and ``selfattn SUB --help`` answer at once, and torch
loads inside ``run``.

Exit codes: 0 success, 1 runtime failure, 2 bad usage (argparse's convention); messages go to
stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from selfattn.cli import (
    _common,
    backends,
    bench,
    chat,
    compare,
    demo,
    embed,
    explain,
    generate,
    heads,
    info,
    kv_size,
    lens,
    mask,
    serve,
    view,
)
from selfattn.cli import map as map_  # the subcommand module; `map` stays the builtin

__all__ = ["build_parser", "main"]

# In the order `selfattn --help` lists them.
SUBCOMMANDS = (
    explain, backends, kv_size, info, map_, view, heads, lens, embed, generate, chat, serve,
    mask, bench, compare, demo,
)  # fmt: skip


class _Version(argparse.Action):
    """``--version``: selfattn's and torch's versions; torch is imported only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        kwargs.setdefault("help", "show program's version number and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import torch

        import selfattn

        # on stdout, as argparse's own version action prints
        print(f"selfattn {selfattn.__version__} (torch {torch.__version__})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfattn",
        description="Self-attention, explained and inspected with the selfattn library.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    # demo runs other subcommands through a parser of its own: it gets this builder from the
    # parsed arguments (args.build_parser), as it cannot import the module that assembles it
    parser.set_defaults(build_parser=build_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``selfattn`` with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except SystemExit as e:  # argparse: --help / --version (0) and usage errors (2)
        if e.code is None:
            return _common.EXIT_OK
        return e.code if isinstance(e.code, int) else _common.EXIT_USAGE
    except KeyboardInterrupt:
        print("selfattn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `selfattn ... | head`: the reader left; exit quietly
        # keep the interpreter's final flush of stdout from raising again
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _common.EXIT_FAILURE
    except Exception as e:
        _common.print_error(f"{type(e).__name__}: {e}")
        return _common.EXIT_FAILURE
