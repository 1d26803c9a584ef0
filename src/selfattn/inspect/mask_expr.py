"""Mask expressions: ``"causal & sliding_window(3)"`` -> a :class:`selfattn.masks.Mask`.

A small recursive-descent parser over the mask vocabulary, never ``eval``::

    expr    := and ('|' and)*
    and     := unary ('&' unary)*
    unary   := '~' unary | atom
    atom    := NAME ['(' [INT (',' INT)*] ')'] | '(' expr ')'

Names: ``causal``, ``sliding_window(n)``, ``chunked(n)``, ``prefix_lm(n)``, ``padding(n)`` (``n``
valid keys), ``documents(a, b, ...)`` (packed documents of lengths ``a, b, ...``: positions
``0..a-1`` are document 0, the next ``b`` document 1, ...). ``~`` binds tightest, then ``&``,
then ``|``, as in Python. Errors are :class:`MaskSyntaxError` (a ``ValueError``) naming the bad
token and its position.
"""

from __future__ import annotations

import re

import torch

from selfattn import masks

__all__ = ["MASK_NAMES", "MaskSyntaxError", "parse_mask"]

# name -> (argument count: 0, 1 or None for "one or more", constructor from the int arguments)
_NAMES = {
    "causal": (0, lambda: masks.causal()),
    "sliding_window": (1, masks.sliding_window),
    "chunked": (1, masks.chunked),
    "prefix_lm": (1, masks.prefix_lm),
    "padding": (1, lambda n: masks.padding([n])),
    "documents": (None, lambda *lengths: masks.documents(_document_ids(lengths))),
}
MASK_NAMES = tuple(_NAMES)

_TOKEN = re.compile(r"\s*(?:(?P<int>-?\d+)|(?P<name>[A-Za-z_]\w*)|(?P<op>[&|~(),]))")


class MaskSyntaxError(ValueError):
    """A mask expression that does not parse; ``position`` is the 0-based character offset."""

    def __init__(self, text: str, position: int, message: str):
        self.text, self.position = text, position
        pointer = " " * position + "^"
        where = f"at position {position} in mask expression"
        super().__init__(f"{message} {where}\n  {text}\n  {pointer}")


def _document_ids(lengths) -> torch.Tensor:
    """``(3, 2)`` -> ``[0, 0, 0, 1, 1]``: the document id of every position."""
    counts = torch.tensor(lengths)
    return torch.repeat_interleave(torch.arange(len(lengths)), counts)


def _tokens(text: str) -> list[tuple[str, str, int]]:
    """``(kind, value, position)`` triples; kind is ``int``, ``name``, ``op`` or ``end``."""
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            at = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise MaskSyntaxError(text, at, f"unexpected character {text[at]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    out.append(("end", "", len(text)))
    return out


class _Parser:
    def __init__(self, text: str):
        self.text, self.tokens, self.i = text, _tokens(text), 0

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.i]

    def take(self) -> tuple[str, str, int]:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def error(self, tok, expected: str) -> MaskSyntaxError:
        kind, value, pos = tok
        found = "the end of the expression" if kind == "end" else f"{value!r}"
        return MaskSyntaxError(self.text, pos, f"expected {expected}, found {found}")

    def expect(self, op: str, expected: str) -> None:
        tok = self.take()
        if tok[:2] != ("op", op):
            raise self.error(tok, expected)

    def parse(self) -> masks.Mask:
        if self.peek()[0] == "end":
            raise MaskSyntaxError(self.text, 0, f"empty mask expression; use one of {MASK_NAMES}")
        mask = self.parse_or()
        if self.peek()[0] != "end":
            raise self.error(self.peek(), "'&', '|' or the end of the expression")
        return mask

    def parse_or(self) -> masks.Mask:
        mask = self.parse_and()
        while self.peek()[:2] == ("op", "|"):
            self.take()
            mask = mask | self.parse_and()
        return mask

    def parse_and(self) -> masks.Mask:
        mask = self.parse_unary()
        while self.peek()[:2] == ("op", "&"):
            self.take()
            mask = mask & self.parse_unary()
        return mask

    def parse_unary(self) -> masks.Mask:
        if self.peek()[:2] == ("op", "~"):
            self.take()
            return ~self.parse_unary()
        return self.parse_atom()

    def parse_atom(self) -> masks.Mask:
        tok = self.take()
        kind, value, pos = tok
        if (kind, value) == ("op", "("):
            mask = self.parse_or()
            self.expect(")", "')' closing the '(' at position " + str(pos))
            return mask
        if kind != "name":
            raise self.error(tok, f"a mask name ({', '.join(MASK_NAMES)}), '~' or '('")
        if value not in _NAMES:
            raise MaskSyntaxError(
                self.text, pos, f"unknown mask {value!r}; known: {', '.join(MASK_NAMES)}"
            )
        arity, build = _NAMES[value]
        parsed = self.parse_args(value) if self.peek()[:2] == ("op", "(") else []
        args = [a for a, _ in parsed]
        if arity is not None and len(args) != arity:
            want = "no argument" if arity == 0 else f"{arity} integer argument, e.g. {value}(4)"
            raise MaskSyntaxError(self.text, pos, f"{value} takes {want}, got {len(args)} ({args})")
        if arity is None and not args:
            raise MaskSyntaxError(
                self.text, pos, f"{value} takes one or more lengths, e.g. {value}(3, 5)"
            )
        for arg, arg_pos in parsed:
            if arg < 1:
                raise MaskSyntaxError(
                    self.text, arg_pos, f"{value} arguments must be >= 1, got {arg}"
                )
        return build(*args)

    def parse_args(self, name: str) -> list[tuple[int, int]]:
        """``(value, position)`` of each integer between the parentheses."""
        self.take()  # '('
        args = []
        if self.peek()[:2] == ("op", ")"):
            self.take()
            return args
        while True:
            tok = self.take()
            if tok[0] != "int":
                raise self.error(tok, f"an integer argument of {name}")
            args.append((int(tok[1]), tok[2]))
            tok = self.take()
            if tok[:2] == ("op", ")"):
                return args
            if tok[:2] != ("op", ","):
                raise self.error(tok, f"',' or ')' in the arguments of {name}")


def parse_mask(text: str) -> masks.Mask:
    """Parse a mask expression (grammar in the module docstring) into a ``Mask``.

    >>> parse_mask("causal & sliding_window(3)")
    (causal() & sliding_window(3))
    """
    if not isinstance(text, str):
        raise TypeError(f"a mask expression must be a str, got {type(text).__name__}")
    return _Parser(text).parse()
