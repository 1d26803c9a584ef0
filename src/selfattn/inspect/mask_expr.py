"""Mask expressions: ``"causal & sliding_window(3)"`` -> a :class:`selfattn.masks.Mask`.

A small recursive-descent parser over the mask vocabulary, never ``eval``::

    expr    := and ('|' and)*
    and     := unary ('&' unary)*
    unary   := '~' unary | atom
    atom    := NAME ['(' [INT (',' INT)*] ')'] | '(' expr ')'

Names: ``causal``, ``sliding_window(n)``, ``chunked(n)``, ``prefix_lm(n)``, ``padding(n)`` (``n``
valid keys in every sequence of the batch), ``documents(a, b, ...)`` (packed documents of lengths
``a, b, ...``: positions ``0..a-1`` are document 0, the next ``b`` document 1, ...). ``~`` binds
tightest, then ``&``, then ``|``, as in Python. Every ``selfattn`` subcommand reads masks with this
parser. Errors are :class:`MaskSyntaxError` (a ``ValueError``) naming the bad
token and its position.

Limits, checked while parsing and before anything is allocated: parentheses and the ``& | ~``
tree nest at most ``MAX_DEPTH`` (100) levels deep (a deeper expression would overflow Python's
recursion limit while parsing or evaluating); each integer is at most ``2**62`` (masks add and
subtract positions in int64); ``documents(...)`` lengths add up to at most
``MAX_DOCUMENT_POSITIONS`` (2**24: it builds one id per position).
"""

from __future__ import annotations

import re

import torch

from selfattn import masks

__all__ = ["MASK_NAMES", "MAX_DEPTH", "MAX_DOCUMENT_POSITIONS", "MaskSyntaxError", "parse_mask"]

# name -> (argument count: 0, 1 or None for "one or more", constructor from the int arguments)
_NAMES = {
    "causal": (0, lambda: masks.causal()),
    "sliding_window": (1, masks.sliding_window),
    "chunked": (1, masks.chunked),
    "prefix_lm": (1, masks.prefix_lm),
    "padding": (1, masks.padding),  # n valid keys in every sequence of the batch
    "documents": (None, lambda *lengths: masks.documents(_document_ids(lengths))),
}
MASK_NAMES = tuple(_NAMES)

_TOKEN = re.compile(r"\s*(?:(?P<int>-?\d+)|(?P<name>[A-Za-z_]\w*)|(?P<op>[&|~(),]))")
_SPACE = re.compile(r"\s*")

# Each nesting level costs a few Python frames to parse (parse_or -> parse_and -> parse_unary ->
# parse_atom) and one or two to evaluate (a Mask tree recurses), so this bound stays far below the
# interpreter's recursion limit (1000) wherever the caller stands.
MAX_DEPTH = 100
# documents(a, b, ...) materialises one int64 id per position (2**24 of them: 128 MiB).
MAX_DOCUMENT_POSITIONS = 1 << 24
# Around this many characters of a long expression are shown in an error, centred on the fault.
_SHOWN = 72


class MaskSyntaxError(ValueError):
    """A mask expression that does not parse; ``position`` is the 0-based character offset."""

    def __init__(self, text: str, position: int, message: str):
        self.text, self.position = text, position
        start = max(0, min(position - _SHOWN // 2, len(text) - _SHOWN))
        shown = text[start : start + _SHOWN]
        head, tail = ("..." if start else ""), ("..." if start + _SHOWN < len(text) else "")
        pointer = " " * (len(head) + position - start) + "^"
        where = f"at position {position} in mask expression"
        super().__init__(f"{message} {where}\n  {head}{shown}{tail}\n  {pointer}")


def _size_value(digits: str) -> int | None:
    """The int a decimal string spells, or None above 2**62 (the masks' position bound). Digit
    counts are compared first: int() of a 5000-digit string is slow, then refused by Python."""
    if len(digits.lstrip("-")) > len(str(masks.tiles.POSITION_LIMIT)):
        return None
    value = int(digits)
    return value if value <= masks.tiles.POSITION_LIMIT else None


def _short(digits: str, n: int = 24) -> str:
    return digits if len(digits) <= n else f"{digits[:n]}... ({len(digits)} digits)"


def _document_ids(lengths) -> torch.Tensor:
    """``(3, 2)`` -> ``[0, 0, 0, 1, 1]``: the document id of every position."""
    counts = torch.tensor(lengths)
    return torch.repeat_interleave(torch.arange(len(lengths)), counts)


def _tokens(text: str) -> list[tuple[str, str, int]]:
    """``(kind, value, position)`` triples; kind is ``int``, ``name``, ``op`` or ``end``.

    Linear in the text's length (long inputs are refused by the parser, never slowly sliced)."""
    out, pos = [], _SPACE.match(text).end()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise MaskSyntaxError(text, pos, f"unexpected character {text[pos]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind), m.start(kind)))
        pos = _SPACE.match(text, m.end()).end()
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

    def deeper(self, depth: int, tok) -> int:
        """``depth`` (of the mask tree built at ``tok``), refused past ``MAX_DEPTH``."""
        if depth > MAX_DEPTH:
            raise MaskSyntaxError(
                self.text,
                tok[2],
                f"mask expression nests deeper than {MAX_DEPTH} levels (parentheses and the "
                "&, |, ~ tree); simplify it or build the mask in Python with selfattn.masks",
            )
        return depth

    def parse(self) -> masks.Mask:
        if self.peek()[0] == "end":
            raise MaskSyntaxError(self.text, 0, f"empty mask expression; use one of {MASK_NAMES}")
        mask, _ = self.parse_or(0)
        if self.peek()[0] != "end":
            raise self.error(self.peek(), "'&', '|' or the end of the expression")
        return mask

    # Each parse_* returns (mask, depth of its tree); `nesting` counts the open parentheses.
    def parse_or(self, nesting: int) -> tuple[masks.Mask, int]:
        mask, depth = self.parse_and(nesting)
        while self.peek()[:2] == ("op", "|"):
            tok = self.take()
            right, d = self.parse_and(nesting)
            mask, depth = mask | right, self.deeper(max(depth, d) + 1, tok)
        return mask, depth

    def parse_and(self, nesting: int) -> tuple[masks.Mask, int]:
        mask, depth = self.parse_unary(nesting)
        while self.peek()[:2] == ("op", "&"):
            tok = self.take()
            right, d = self.parse_unary(nesting)
            mask, depth = mask & right, self.deeper(max(depth, d) + 1, tok)
        return mask, depth

    def parse_unary(self, nesting: int) -> tuple[masks.Mask, int]:
        nots = []  # a loop, not recursion: `~~~~...` is as long as the text allows
        while self.peek()[:2] == ("op", "~"):
            nots.append(self.take())
            self.deeper(len(nots), nots[-1])
        mask, depth = self.parse_atom(nesting)
        for tok in reversed(nots):
            mask, depth = ~mask, self.deeper(depth + 1, tok)
        return mask, depth

    def parse_atom(self, nesting: int) -> tuple[masks.Mask, int]:
        tok = self.take()
        kind, value, pos = tok
        if (kind, value) == ("op", "("):
            self.deeper(nesting + 1, tok)
            mask, depth = self.parse_or(nesting + 1)
            self.expect(")", "')' closing the '(' at position " + str(pos))
            return mask, depth
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
        if value == "documents" and sum(args) > MAX_DOCUMENT_POSITIONS:
            raise MaskSyntaxError(
                self.text,
                pos,
                f"documents lengths add up to {sum(args)} positions, above "
                f"MAX_DOCUMENT_POSITIONS = {MAX_DOCUMENT_POSITIONS} (one id is stored per "
                "position); describe a shorter sequence",
            )
        return build(*args), 1

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
            value = _size_value(tok[1])
            if value is None:
                raise MaskSyntaxError(
                    self.text,
                    tok[2],
                    f"{name} argument {_short(tok[1])} is too large; sizes are at most 2**62 "
                    f"({masks.tiles.POSITION_LIMIT})",
                )
            args.append((value, tok[2]))
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
