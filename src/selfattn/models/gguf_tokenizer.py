"""The tokenizer a GGUF file describes, built as a ``tokenizers.Tokenizer`` that gives llama.cpp's
token ids.

A GGUF carries no ``tokenizer.json``: its ``tokenizer.ggml.*`` metadata holds the vocabulary, the
merges or scores, each token's type and the special token ids, and ``tokenizer.chat_template``
the template. :func:`tokenizer_from_metadata` rebuilds from them what llama.cpp's
``llama-vocab.cpp`` runs:

- ``gpt2`` (byte-level BPE): the text is split by the regexes ``tokenizer.ggml.pre`` names (each
  regex in turn isolates its matches within the previous pieces), byte-encoded, and merged by
  rank; ``Split`` pre-tokenizers in that order, then ``ByteLevel`` without its own regex.
- ``llama`` (SentencePiece): spaces become ``▁``, a ``▁`` is prepended to every piece of text
  between added tokens (llama.cpp prefixes each fragment that follows a special token, and the
  start), then adjacent symbols merge while their concatenation is a token, highest score first.
  That is BPE with one merge per way of cutting a token in two, ranked by the token's score;
  characters without a token fall back to their ``<0xNN>`` byte tokens.

Token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte): control and
unknown tokens become special added tokens, user-defined ones plain added tokens, so both are cut
out of the text whole, as ``llama_tokenize(..., parse_special=true)`` does. llama.cpp also treats
tokens it recognises by their text (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, the FIM tokens, ...)
as control whatever the file says; so does this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from selfattn._optional import require
from selfattn.models.hub import CheckpointError
from selfattn.models.tokenizer import Tokenizer

__all__ = ["MODELS", "PRE_TOKENIZERS", "save_tokenizer", "tokenizer_from_metadata"]

# llama.cpp's token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer regexes of llama.cpp's llm_tokenizer_bpe, applied in order.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LATIN = (  # deepseek-llm's letter classes, code point for code point as llama.cpp has them
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-"
    "\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00"
    "-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-"
    "\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13"
    "-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK3 = (
    r"\p{N}{1,3}", _KANA,
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)  # fmt: skip
_QWEN35 = _QWEN2.replace(r"?\p{L}+", r"?[\p{L}\p{M}]+").replace(
    r"\p{L}\p{N}]+", r"\p{L}\p{M}\p{N}]+"
)
_SEED_CODER = _QWEN2.replace(r"[^\s\p{L}\p{N}]+[\r\n]*", r"[^\s\p{L}\p{N}\r\n]+")
_BAILING = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
_STARCODER = (r"\p{N}", _GPT2)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (regexes, ignore_merges, add_bos default); llama.cpp's names and groups
_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
for _names, _regexes, _ignore, _bos in (
    (("default", ""), _DEFAULT, False, False),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de",
      "jina-v2-code", "roberta-bpe", "gigachat", "mpt", "olmo", "jais", "exaone4", "mellum",
      "modern-bert", "trillion", "granite-docling", "a.x-4.0"), (_GPT2,), False, False),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
      "lfm2", "jina-v5-nano"), (_LLAMA3,), True, True),
    (("dbrx", "smaug-bpe"), (_LLAMA3,), False, False),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "kormo", "f2llmv2",
      "grok-2"), (_QWEN2,), False, False),
    (("qwen35",), (_QWEN35,), False, False),
    (("seed-coder",), (_SEED_CODER,), False, False),
    (("ufakzeka",), (_QWEN2.removeprefix(_CONTRACTIONS + "|"),), False, False),
    (("bailingmoe", "bailingmoe2", "llada-moe"), (_BAILING,), False, False),
    (("exaone-moe",), (_EXAONE_MOE,), False, False),
    (("deepseek-v3",), _DEEPSEEK3, False, False),
    # llama.cpp adds \p{M} to its rewrite of gpt-4o's classes, which hold \p{M} already
    (("granite-embed-multi-97m",), (_GPT4O,), True, False),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     _STARCODER, False, False),
    (("deepseek-llm",), (r"[\r\n]", rf"\s?[{_LATIN}]+", _DEEPSEEK_PUNCT, r"\s+$",
      _CJK, r"\p{N}+"), False, False),
    (("deepseek-coder",), (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), False, False),
    (("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2.removesuffix(r"|\s+"), "[0-9][0-9][0-9]"),
     False, False),
    (("poro-chat", "bloom", "gpt3-finnish"), (r" ?[^(\s|.,!?…。，、।۔،)]+",), False, False),
    (("viking",), (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"), False, False),
    (("chatglm-bpe",), (_LLAMA3,), False, False),
    (("glm4", "glm5"), (_LLAMA3,), True, False),
    (("tekken",), (_TEKKEN,), True, True),
    (("gpt-4o", "llama4", "kanana2", "talkie"), (_GPT4O,), False, False),
):  # fmt: skip
    for _name in _names:
        _PRE[_name] = (_regexes, _ignore, _bos)

PRE_TOKENIZERS = tuple(sorted(n for n in _PRE if n))
MODELS = ("gpt2", "llama")

# Tokens llama.cpp treats as control by their text, whatever their type in the file: the
# end-of-turn / end-of-generation and fill-in-the-middle tokens it looks up by name.
_END_OF_TURN = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<｜end▁of▁sentence｜>",
    "<end_of_utterance>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "</s>", "<eos>",
    "<turn|>", "<|tool_response>", "[e~[",
)  # fmt: skip
_FIM = (
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
    "<REPO>", "<reponame>", "<|file_sep|>",
)  # fmt: skip
# gpt-oss's channel tokens: llama.cpp makes them user-defined so that they are always rendered
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# tokenizer.ggml key -> transformers' special-token attribute
_SPECIAL_IDS = {
    "bos_token_id": "bos_token",
    "eos_token_id": "eos_token",
    "unknown_token_id": "unk_token",
    "padding_token_id": "pad_token",
    "seperator_token_id": "sep_token",  # llama.cpp's spelling of the key
    "cls_token_id": "cls_token",
    "mask_token_id": "mask_token",
}


def _key(metadata: Mapping, name: str, types, source: str, default=None):
    value = metadata.get(f"tokenizer.ggml.{name}", default)
    if value is not None and not isinstance(value, types):
        raise CheckpointError(
            f"{source!r}: tokenizer.ggml.{name} must be {getattr(types, '__name__', types)}, "
            f"got {type(value).__name__}"
        )
    return value


def _list(metadata: Mapping, name: str, n: int, source: str, default=None) -> list:
    value = _key(metadata, name, (list, tuple), source, default)
    if value is not None and len(value) < n:
        raise CheckpointError(
            f"{source!r}: tokenizer.ggml.{name} has {len(value)} entries for {n} tokens"
        )
    return value


def _token_types(tokens: list[str], types: list[int] | None) -> list[int]:
    """Each token's type after llama.cpp's renames by text."""
    types = list(types[: len(tokens)]) if types is not None else [NORMAL] * len(tokens)
    for i, text in enumerate(tokens):
        if text in _ALWAYS_USER_DEFINED:
            types[i] = USER_DEFINED
        elif text in _END_OF_TURN or text in _FIM:
            types[i] = CONTROL
    ids = {t: i for i, t in enumerate(tokens)}
    # llama.cpp's exceptions: gpt-oss's and solar-open's <|end|> is no end of generation but a
    # rendered token, and next to <|tool_response>/<|plamo:eos|> a </s> is plain text
    if "<|end|>" in ids and (
        {"<|return|>", "<|call|>"} <= ids.keys() or {"<|calls|>", "<|flush|>"} <= ids.keys()
    ):
        types[ids["<|end|>"]] = USER_DEFINED
    if "</s>" in ids and ("<|tool_response>" in ids or "<|plamo:eos|>" in ids):
        types[ids["</s>"]] = NORMAL
    return types


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every way of cutting a token in two tokens, best score of the whole first: llama.cpp's SPM
    merges adjacent symbols whose concatenation is a token, highest score first, which is BPE on
    these merges ranked by that score. Equal scores rank by token id, where llama.cpp takes the
    leftmost pair: the two differ only where tied merges compete in one piece of text (a
    vocabulary whose learnt tokens all score 0 does on a few texts; real ones score distinctly)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], i, ids[left], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _added(tokens: list[str], types: list[int]):
    AddedToken = require("tokenizers", purpose="GGUF tokenizers").AddedToken
    added = []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            special = kind != USER_DEFINED
            added.append((i, AddedToken(text, special=special, normalized=False)))
    return added


def _bpe(metadata: Mapping, tokens: list[str], source: str):
    tk = require("tokenizers", purpose="GGUF tokenizers")
    pre = _key(metadata, "pre", str, source, "default")
    if pre not in _PRE:
        raise CheckpointError(
            f"{source!r}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer this loader knows; "
            f"supported: {list(PRE_TOKENIZERS)}"
        )
    regexes, ignore_merges, add_bos = _PRE[pre]
    merges = _list(metadata, "merges", 0, source)
    if merges is None:
        raise CheckpointError(f"{source!r}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        # llama.cpp cuts a merge at its first space after the first character
        cut = m.find(" ", 1)
        left, right = (m[:cut], m[cut + 1 :]) if cut > 0 else (m, "")
        # a merge of or into text without a token never gives a token id; tokenizers refuses it
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))
    model = tk.models.BPE(vocab, pairs, ignore_merges=ignore_merges)
    fast = tk.Tokenizer(model)
    splits = [tk.pre_tokenizers.Split(tk.Regex(r), behavior="isolated") for r in regexes]
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    fast.pre_tokenizer = tk.pre_tokenizers.Sequence([*splits, byte_level])
    fast.decoder = tk.decoders.ByteLevel()
    return fast, add_bos


def _spm(metadata: Mapping, tokens: list[str], source: str):
    tk = require("tokenizers", purpose="GGUF tokenizers")
    scores = _list(metadata, "scores", len(tokens), source) or [0.0] * len(tokens)
    unk = _key(metadata, "unknown_token_id", int, source, 0)
    unk_token = tokens[unk] if 0 <= unk < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    model = tk.models.BPE(
        vocab, _spm_merges(tokens, [float(s) for s in scores]), unk_token=unk_token,
        byte_fallback=True, fuse_unk=True,
    )  # fmt: skip
    fast = tk.Tokenizer(model)
    steps = [tk.normalizers.Replace(" ", "▁")]
    if _key(metadata, "add_space_prefix", bool, source, True):
        steps.insert(0, tk.normalizers.Prepend("▁"))
        strip = [tk.decoders.Strip(" ", 1, 0)]
    else:
        strip = []
    fast.normalizer = tk.normalizers.Sequence(steps)
    fast.decoder = tk.decoders.Sequence(
        [tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse(), *strip]
    )
    return fast, True


def tokenizer_from_metadata(metadata: Mapping, source: str = "<metadata>") -> Tokenizer:
    """The :class:`~selfattn.models.tokenizer.Tokenizer` of a GGUF file's metadata (a mapping of
    key -> Python value, as :func:`selfattn.models.gguf.read_metadata` returns); ``source`` names
    the file in errors."""
    tk = require("tokenizers", purpose="GGUF tokenizers")
    kind = _key(metadata, "model", str, source)
    if kind not in MODELS:
        raise CheckpointError(
            f"{source!r}: tokenizer.ggml.model {kind!r} is not supported; supported: {list(MODELS)}"
        )
    tokens = _key(metadata, "tokens", (list, tuple), source)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{source!r}: tokenizer.ggml.tokens must be a non-empty string list")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp names them
    seen: dict[str, int] = {}
    for i, text in enumerate(tokens):  # llama.cpp refuses a vocabulary naming a token twice
        if seen.setdefault(text, i) != i:
            raise CheckpointError(
                f"{source!r}: tokens {seen[text]} and {i} are both {text!r}; "
                "the vocabulary must name each token once"
            )
    types = _token_types(tokens, _list(metadata, "token_type", len(tokens), source))
    if kind == "gpt2":
        fast, add_bos = _bpe(metadata, tokens, source)
    else:
        fast, add_bos = _spm(metadata, tokens, source)
    added = _added(tokens, types)
    fast.add_special_tokens([a for _, a in added if a.special])
    fast.add_tokens([a for _, a in added if not a.special])

    config: dict = {"clean_up_tokenization_spaces": False}
    for key, name in _SPECIAL_IDS.items():
        i = _key(metadata, key, int, source)
        if i is not None and 0 <= i < len(tokens):
            config[name] = tokens[i]
    add_bos = _key(metadata, "add_bos_token", bool, source, add_bos)
    add_eos = _key(metadata, "add_eos_token", bool, source, False)
    config["add_bos_token"], config["add_eos_token"] = add_bos, add_eos
    fast.post_processor = _post_processor(tk, config, fast, source)

    end_ids = [_key(metadata, k, int, source) for k in ("eot_token_id", "eom_token_id")]
    end_ids = [i for i in end_ids if i is not None and 0 <= i < len(tokens)]
    template = metadata.get("tokenizer.chat_template")
    named = {
        k.removeprefix("tokenizer.chat_template."): v
        for k, v in metadata.items()
        if k.startswith("tokenizer.chat_template.") and isinstance(v, str)
    }
    if template is not None and not isinstance(template, str):
        raise CheckpointError(
            f"{source!r}: tokenizer.chat_template must be a string, got {type(template).__name__}"
        )
    return Tokenizer(fast, config, template, end_of_turn_ids=end_ids, named_templates=named)


def _post_processor(tk, config: dict, fast, source: str):
    """llama.cpp's add_bos / add_eos as a template around each sequence (None: neither)."""
    pieces = {}
    for name in ("bos_token", "eos_token"):
        if not config[f"add_{name}"]:
            continue
        if name not in config:
            raise CheckpointError(
                f"{source!r}: tokenizer.ggml.add_{name} is set but the file names no {name} id"
            )
        text, i = config[name], fast.token_to_id(config[name])
        # a template piece is split at ':' and whitespace; other texts go by a stand-in name
        pieces[name] = (text if not any(c in text for c in ": \t\n") else f"<special_{i}>", i)
    if not pieces:
        return None
    bos = [pieces["bos_token"][0]] if "bos_token" in pieces else []
    eos = [pieces["eos_token"][0]] if "eos_token" in pieces else []
    second = [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    return tk.processors.TemplateProcessing(
        single=[*bos, "$A", *eos], pair=[*bos, "$A", *eos, *second],
        special_tokens=sorted(set(pieces.values())),
    )  # fmt: skip


def save_tokenizer(tokenizer: Tokenizer, folder) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` in transformers' layout to
    ``folder``, so ``transformers.AutoTokenizer.from_pretrained(folder)`` and
    :func:`selfattn.models.load_tokenizer` read the same tokenizer back."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": tokenizer.clean_up_tokenization_spaces,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": tokenizer.add_eos_token,
        "model_max_length": int(1e30),
    }
    config.update(tokenizer.special_tokens_map)
    decoder = {}
    for i, a in sorted(tokenizer.tokenizer.get_added_tokens_decoder().items()):
        decoder[str(i)] = {
            "content": a.content, "lstrip": a.lstrip, "normalized": a.normalized,
            "rstrip": a.rstrip, "single_word": a.single_word, "special": a.special,
        }  # fmt: skip
    config["added_tokens_decoder"] = decoder
    if tokenizer.named_templates:
        named = dict(tokenizer.named_templates)
        if tokenizer.chat_template is not None:
            named = {"default": tokenizer.chat_template, **named}
        config["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
    elif tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
