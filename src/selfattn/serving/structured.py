"""Structured output: what a request's text must match (:class:`Guide`), and the token masks that
keep it there.

A :class:`Guide` rides on :class:`~selfattn.serving.SamplingParams` (``guide=``); the engine
masks every token that would leave the guide's language before it samples::

    guide ─ Grammars.compile (llguidance grammar text; LRU by (kind, value))
          ─ Grammars.matcher ─ one matcher per sequence (forks copy it)
    each step: fill_bitmasks (one bit per vocabulary id, for the guided rows)
             ─ apply_bitmask on those logits rows ─ sample ─ matcher.consume_token

The grammar engine is llguidance (the ``serve`` extra): it reads the tokenizer from its
``tokenizers`` JSON (the tokenizer every selfattn checkpoint and GGUF file loads into, no
transformers needed) and builds a grammar's lexer lazily, so a new schema costs milliseconds
before its first token; its masks take tens of microseconds per sequence and step. JSON is
written compactly (``", "`` and ``": "`` between items, no other whitespace): a small model
given free whitespace may emit it forever.

The end-of-sequence tokens are allowed only where the grammar accepts the output so far; once
the grammar admits nothing more the sequence finishes (``"stop"``). A grammar that reaches a
state no token of the vocabulary continues (a vocabulary that cannot spell the language) ends
its sequence with ``"stop"`` and :data:`DEAD_END` as the stop reason.
"""

from __future__ import annotations

import collections
import json
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from selfattn._optional import require

if TYPE_CHECKING:
    import torch

__all__ = [
    "CACHE_SIZE",
    "DEAD_END",
    "JSON_OPTIONS",
    "Grammars",
    "Guide",
    "GuideError",
    "apply_bitmask",
    "grammar_text",
]

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled guides an engine keeps (least recently used dropped first)
# llguidance's JSON compiler options: compact separators as json.dumps writes them, and no
# free whitespace (vLLM's disable_any_whitespace): small models loop on whitespace otherwise.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEAD_END = "guide: no token of the vocabulary continues the output"


@dataclass(frozen=True)
class Guide:
    """The language a request's output must belong to.

    ``kind`` is one of ``json_object`` (any JSON object; ``value`` None), ``json_schema``
    (``value``: the schema as JSON text), ``regex`` (``value``: the pattern), ``choice``
    (``value``: a tuple of the allowed strings) or ``grammar`` (``value``: a Lark grammar, or
    GBNF / EBNF text with ``::=`` rules, converted to Lark).
    """

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    value: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Guide kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "json_object":
            if self.value is not None:
                raise ValueError("Guide('json_object') takes no value")
        elif self.kind == "choice":
            if (
                not isinstance(self.value, tuple)
                or not self.value
                or not all(isinstance(c, str) and c for c in self.value)
            ):
                raise ValueError(
                    f"Guide('choice') needs a tuple of non-empty strings, got {self.value!r}"
                )
        elif not isinstance(self.value, str) or not self.value:
            raise ValueError(f"Guide({self.kind!r}) needs its text as a string, got {self.value!r}")


class GuideError(ValueError):
    """A guide the grammar engine cannot compile; the message names the kind and the reason."""


def _llguidance():
    return require("llguidance", extra="serve", purpose="structured output (guided decoding)")


def grammar_text(guide: Guide) -> str:
    """llguidance's grammar text for ``guide`` (not yet checked against a tokenizer)."""
    M = _llguidance().LLMatcher
    kind, value = guide.kind, guide.value
    if kind in ("json_object", "json_schema"):
        schema = '{"type": "object"}' if kind == "json_object" else value
        try:
            if not isinstance(json.loads(schema), dict):
                raise ValueError("a JSON schema is an object")
            return M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GuideError(f"the JSON schema is not valid JSON: {e}") from None
    if kind == "regex":
        return M.grammar_from_regex(value)
    if kind == "choice":  # Lark's string literals are JSON strings
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return M.grammar_from_lark(any_to_lark(value))
    except Exception as e:  # the GBNF converter raises plain exceptions on bad input
        raise GuideError(f"the grammar is neither Lark nor GBNF: {e}") from None


class Grammars:
    """One engine's grammar state: the tokenizer as llguidance sees it (built at the first
    guided request: ~0.5 s for a 49k vocabulary), compiled guides cached by ``(kind, value)``
    (least recently used dropped beyond ``cache_size``), and the masks' worker threads.

    ``vocab_size`` is the width of the model's logits (which may exceed the tokenizer's
    vocabulary: ids without a token are never allowed); ``eos_ids`` the ids that end a
    sequence, allowed where the grammar accepts. Thread-safe: a server compiles on its
    handlers' threads while the engine's thread builds matchers.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = CACHE_SIZE):
        self.source, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = sorted(eos_ids)
        self.cache_size = cache_size
        self._tokenizer = None
        self._executor = None
        self._cache: collections.OrderedDict[Guide, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        """int32 words of one row's bitmask."""
        return math.ceil(self.vocab_size / 32)

    def tokenizer(self):
        """The llguidance ``LLTokenizer`` (built once)."""
        with self._lock:
            if self._tokenizer is None:
                ll = _llguidance()
                backend = getattr(self.source, "backend_tokenizer", None) or getattr(
                    self.source, "tokenizer", None
                )  # transformers' fast tokenizer, or selfattn's Tokenizer
                if not callable(getattr(backend, "to_str", None)):
                    raise GuideError(
                        f"structured output needs a tokenizer built on the tokenizers library "
                        f"(selfattn's load_tokenizer or transformers' fast tokenizers), got "
                        f"{type(self.source).__name__}"
                    )
                eos = self.eos_ids or None
                self._tokenizer = ll.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=eos)  # fmt: skip
                self._executor = ll.LLExecutor()
            return self._tokenizer

    def compile(self, guide: Guide) -> str:
        """``guide``'s grammar, checked against the tokenizer (cached); :class:`GuideError` names
        what the engine refused (an invalid regex, an unsupported schema keyword, ...)."""
        with self._lock:
            if guide in self._cache:
                self._cache.move_to_end(guide)
                return self._cache[guide]
        tok = self.tokenizer()
        text = grammar_text(guide)
        failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text, tok)
        if failed:
            reason = messages[0].strip() if messages else "unknown reason"
            raise GuideError(f"the {guide.kind} guide cannot be compiled: {reason}")
        with self._lock:
            self._cache[guide] = text
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return text

    def matcher(self, guide: Guide):
        """A fresh llguidance ``LLMatcher`` at the start of ``guide``'s language."""
        m = _llguidance().LLMatcher(self.tokenizer(), self.compile(guide), log_level=0)
        if m.is_error():
            raise GuideError(f"the {guide.kind} guide cannot be compiled: {m.get_error()}")
        return m

    def fill_bitmasks(self, matchers) -> torch.Tensor:
        """The next-token masks of ``matchers`` as ``(G, words)`` int32 bitmasks (bit ``t % 32``
        of word ``t // 32`` set: token ``t`` allowed); the work runs in llguidance's own threads
        with the GIL released. A matcher in an error state allows nothing."""
        import torch

        bits = torch.zeros(len(matchers), self.words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), self.words * 4, len(matchers)
        )
        return bits


def apply_bitmask(x: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of ``x (R, V)``'s ``rows (G,)`` whose bit in ``bits
    (G, words)`` is clear (ids past ``32 · words`` too).

    The words are read as little-endian bytes (token ``t``: bit ``t % 8`` of byte ``t // 8``)
    and each byte expanded to its 8 bits through a 256-entry table: one gather, where shifting
    every word by 0..31 costs 30x more at a 49k vocabulary.
    """
    import torch

    G, V = bits.shape[0], x.shape[1]
    table = _bit_table(bits.device)
    index = bits.contiguous().view(torch.uint8).view(-1).int()  # (G · 4 · words,)
    allowed = table.index_select(0, index).view(G, -1)[:, :V]  # (G, ≤V)
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    x[rows] = torch.where(allowed.to(x.device), x[rows], -math.inf)


_TABLES: dict = {}


def _bit_table(device) -> torch.Tensor:
    """``(256, 8)`` bool: bit ``k`` of byte ``b`` (built once per device)."""
    import sys

    import torch

    if sys.byteorder != "little":  # the words' bytes are read in memory order
        raise RuntimeError("apply_bitmask reads int32 words as little-endian bytes")
    table = _TABLES.get(device)
    if table is None:
        b = torch.arange(256, device=device).view(256, 1)
        table = _TABLES[device] = ((b >> torch.arange(8, device=device)) & 1).bool()
    return table
