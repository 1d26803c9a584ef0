"""The ``selfattn`` command line: ``explain``, ``backends``, ``kv-size``, ``info``, ``map``,
``embed``, ``mask``, ``bench`` and ``demo``, one module each; :mod:`selfattn.cli.main` assembles
them.

Thin by design: every number it prints comes from a library call (``selfattn.attention``,
``selfattn.backends.explain``, ``selfattn.inspect``, ``selfattn.cache``); the command only builds
inputs and lays out results. Tables use ``rich`` when stdout is a terminal and plain text
otherwise; ``--json`` prints the same results as one JSON object. Progress (spinners, bars) goes
to stderr, and only when stderr is a terminal.
"""

from selfattn.cli.main import main

__all__ = ["main"]
