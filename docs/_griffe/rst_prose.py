"""A griffe extension for the API reference: selfattn's docstrings are reStructuredText-flavoured
prose (``double backticks``, Sphinx roles such as :func:`attention`, doctest examples), and
Markdown renders them once two things are translated: a role becomes inline code, and a run of
doctest lines (``>>>``, ``...`` and the output under them) becomes a fenced ``pycon`` block
(Markdown would read ``>>>`` as a quotation and ``maps[0][0]`` as a link)."""

from __future__ import annotations

import re

import griffe

# :func:`x`, :class:`~a.b.C`, :meth:`x.y` ... -> `x` (the ~ of "last component only" dropped)
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")
PROMPT = re.compile(r"^(\s*)(>>>|\.\.\.)( |$)")


def _fence_doctests(text: str) -> str:
    """Each run of doctest lines, with the output lines that follow it up to a blank line, in a
    fenced block indented as the run."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        start = PROMPT.match(lines[i])
        if not start:
            out.append(lines[i])
            i += 1
            continue
        indent = start.group(1)
        out += [f"{indent}```pycon"]
        while i < len(lines) and lines[i].strip():  # prompts and their output, up to a blank
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class RstProse(griffe.Extension):
    """Rewrites every docstring once the object tree is built (before it is parsed)."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _fence_doctests(ROLE.sub(r"`\1`", obj.docstring.value))
