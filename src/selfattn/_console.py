"""What the command line and the benchmarks both print and parse, below both of them.

:class:`Printer` writes headings, lines and tables (rich on a terminal where the ``[cli]`` extra
is installed, aligned plain text otherwise); :func:`int_at_least` and its two instances are
argparse types whose errors name the bad value. ``selfattn.cli`` and ``selfattn.benchmarks``
import them from here; neither imports the other's helpers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from selfattn import _optional

__all__ = ["Printer", "int_at_least", "nonnegative_int", "positive_int", "rich_module"]


def rich_module(module: str):
    """``rich.<module>`` where the ``[cli]`` extra is installed, else None: rich only dresses
    output up, so every subcommand also runs without it (plain text, no progress bars)."""
    return _optional.require(f"rich.{module}") if _optional.available("rich") else None


class Printer:
    """Writes headings, lines and tables to stdout; uses rich only when stdout is a terminal (and
    rich is installed: ``pip install 'selfattn[cli]'``)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.console = None
        if self.stream.isatty():
            console = rich_module("console")
            self.console = (
                None if console is None else console.Console(file=self.stream, highlight=False)
            )

    def heading(self, text: str) -> None:
        if self.console is not None:
            escape = rich_module("markup").escape
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
            table = rich_module("table").Table(title=title or None, title_justify="left")
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


def int_at_least(low: int):
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


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
