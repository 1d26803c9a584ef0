"""Text in and out of a checkpoint folder: ``load_tokenizer(path)`` reads ``tokenizer.json`` with
the ``tokenizers`` library and the chat template with jinja2, as transformers'
``PreTrainedTokenizerFast`` does, without transformers.

Files read from the folder (or Hub id, resolved like :func:`selfattn.models.from_pretrained`):
``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens, ``chat_template``,
``clean_up_tokenization_spaces``) and ``chat_template.jinja`` (transformers 5 saves the template
there; it wins over the config's).

A GGUF file (or a folder holding one and no ``config.json``) is read by
:mod:`selfattn.models.gguf_tokenizer` from its ``tokenizer.ggml.*`` metadata, with llama.cpp's
token ids.

Chat templates come from model repositories: they render in jinja2's immutable sandbox (as in
transformers), with transformers' extras: ``raise_exception``, ``strftime_now``, a ``tojson``
that keeps non-ASCII text, ``{% generation %}`` blocks and loop controls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import torch

from selfattn._optional import require
from selfattn.models.hub import CheckpointError, read_json, resolve

__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "register_format",
]

# transformers' special-token attributes, passed to chat templates under these names
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
_SPECIAL += ("mask_token",)
# Tokens that close a chat turn in the Hub's templates (ChatML, Llama 3, Gemma, Phi-3, gpt-oss,
# DeepSeek): generation stops at those a template writes.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|end_of_text|>",
    "<|return|>", "<|call|>", "<turn|>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and contractions."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(old, new)
    for suffix in ("n't", "'m", "'s", "'ve", "'re"):
        text = text.replace(" " + suffix, suffix)
    return text


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with transformers' conveniences: special tokens by name,
    ``decode`` with ``skip_special_tokens``, batches as left-padded tensors, chat templates.

    ``decode(ids)`` accepts what :class:`transformers.TextStreamer` passes, so a TextStreamer
    built on this tokenizer prints what :func:`selfattn.models.generate` streams.
    ``stop_token_ids`` lists the ids generation stops at (eos and the chat's end-of-turn tokens).
    """

    def __init__(
        self,
        tokenizer,
        config: dict | None = None,
        chat_template: str | None = None,
        end_of_turn_ids=(),
        named_templates: dict[str, str] | None = None,
    ):
        config = config or {}
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # other templates by name (transformers' list of {name, template}; GGUF's
        # tokenizer.chat_template.NAME); apply_chat_template(chat_template=NAME) picks one
        self.named_templates = dict(named_templates or {})
        # ids that end a turn besides eos (GGUF's eot / eom ids)
        self.end_of_turn_ids = [int(i) for i in end_of_turn_ids]
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map: dict[str, str] = {}
        for name in _SPECIAL:
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens_map[name] = text
        extra = [_token_text(t) for t in config.get("additional_special_tokens") or []]
        if extra:
            self.special_tokens_map["additional_special_tokens"] = [t for t in extra if t]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.tokenizer.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids at which generation stops: eos, the end-of-turn ids the tokenizer was given, and
        the end-of-turn tokens (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...) that the
        vocabulary has and the chat template writes."""
        ids = {self.eos_token_id, *self.end_of_turn_ids}
        templates = [t for t in (self.chat_template, *self.named_templates.values()) if t]
        for text in END_OF_TURN_TOKENS:
            if any(text in t for t in templates):
                ids.add(self.tokenizer.token_to_id(text))
        return sorted(i for i in ids if i is not None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's specials unless told not to)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a string, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        """The text of ``ids`` (an int, a list, or a 1-D tensor); other keywords of
        transformers' ``decode`` are accepted and ignored."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        elif isinstance(ids, int):
            ids = [ids]
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        # transformers skips the clean-up for BPE models: it would eat real spaces there
        bpe = type(self.tokenizer.model).__name__ == "BPE"
        return _clean_up(text) if self.clean_up_tokenization_spaces and not bpe else text

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kw) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kw) for s in sequences]

    def __call__(self, texts: str | list[str], add_special_tokens: bool = True) -> dict:
        """``{"input_ids", "attention_mask"}``, both ``(B, S)`` int64, left-padded with
        ``pad_token_id`` (else ``eos_token_id``, else 0): the layout generation wants."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError("the tokenizer takes a string or a non-empty list of strings")
        rows = [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        S = max(len(r) for r in rows)
        if S == 0:
            raise ValueError(f"{texts!r} encodes to no tokens; nothing to condition on")
        pad = next((i for i in (self.pad_token_id, self.eos_token_id) if i is not None), 0)
        ids = torch.full((len(rows), S), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, S - len(r) :] = torch.tensor(r)
                mask[i, S - len(r) :] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str | list[int]:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template,
        as transformers does: the template sees ``messages``, ``add_generation_prompt``,
        ``tools`` and ``documents`` (None unless given: templates test ``tools is not none``),
        the special tokens by name (``bos_token``, ``eos_token``, ...) and ``kwargs``. Returns
        the text, or its ids (``tokenize=True``, no specials added: the template writes them;
        transformers 5 returns them in a dict by default).

        ``tools``: JSON schemas of functions, ``{"type": "function", "function": {"name",
        "description", "parameters"}}``; an assistant message's calls are ``"tool_calls":
        [{"type": "function", "function": {"name": ..., "arguments": {...}}}]`` and a tool's
        answer ``{"role": "tool", "content": ...}`` (transformers' convention)."""
        template = self.named_templates.get(chat_template, chat_template) or self.chat_template
        if template is None:
            raise ValueError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja); pass chat_template= or format the prompt yourself"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages must be a list of dicts such as {'role': 'user', ...}")
        text = _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


_TEMPLATES: dict[str, object] = {}


def _compile(template: str):
    """The compiled jinja2 template (cached per source text), in the immutable sandbox."""
    if template in _TEMPLATES:
        return _TEMPLATES[template]
    jinja2 = require("jinja2", purpose="chat templates")
    ext = require("jinja2.ext")
    Extension, loopcontrols = ext.Extension, ext.loopcontrols
    ImmutableSandboxedEnvironment = require("jinja2.sandbox").ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with
        it): rendered as its body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = _TEMPLATES[template] = env.from_string(template)
    return compiled


def _template_list(config: dict) -> dict:
    """``name -> template`` of a config whose ``chat_template`` is transformers' list of
    ``{"name": ..., "template": ...}``; ``{}`` for a single template or none."""
    template = config.get("chat_template")
    if not isinstance(template, list):
        return {}
    return {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}


def _named_templates(config: dict) -> dict[str, str]:
    """The config's named templates but ``default`` (:func:`_chat_template`'s)."""
    named = _template_list(config)
    return {k: v for k, v in named.items() if k != "default" and isinstance(v, str)}


def _chat_template(folder: Path, config: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = _template_list(config).get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(
            f"{str(folder / 'tokenizer_config.json')!r}: chat_template must be a string or a list "
            f"of {{name, template}} objects, got {type(template).__name__}"
        )
    return template


# Tokenizer sources besides a folder's tokenizer.json, each registered by its own module on
# import (gguf.py): ``(source, build)``, ``source(path_or_repo_id)`` the file it would read or
# None, ``build(file)`` the Tokenizer.
_FORMATS: list[tuple[Callable, Callable]] = []


def register_format(source: Callable, build: Callable) -> None:
    """Let :func:`load_tokenizer` build what ``source`` recognises with ``build``."""
    _FORMATS.append((source, build))


def load_tokenizer(path_or_repo_id, **resolve_kw) -> Tokenizer:
    """The tokenizer of a checkpoint folder, a Hub id (``resolve_kw``: ``revision``,
    ``cache_dir``, ``local_files_only``, as for ``from_pretrained``) or a GGUF file (or a folder
    holding one and no config.json): built from its ``tokenizer.ggml.*`` metadata by
    :mod:`selfattn.models.gguf_tokenizer`, giving llama.cpp's ids."""
    for source, build in _FORMATS:
        found = source(path_or_repo_id)
        if found is not None:
            return build(found)
    _Fast = require("tokenizers", purpose="load_tokenizer").Tokenizer
    folder = resolve(path_or_repo_id, **resolve_kw)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(
            f"{str(folder)!r} has no tokenizer.json (the fast-tokenizer file); save the tokenizer "
            "with transformers' save_pretrained, or convert a slow tokenizer to it"
        )
    try:
        fast = _Fast.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise CheckpointError(f"{str(file)!r} cannot be read by tokenizers: {e}") from None
    config_file = folder / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    return Tokenizer(
        fast, config, _chat_template(folder, config), named_templates=_named_templates(config)
    )
