"""Record llama.cpp's token ids for the GGUF tokenizer parity test.

Tokenises a varied text set with llama.cpp (llama-cpp-python, ``Llama(vocab_only=True)``,
``tokenize(text, add_bos=True, special=True)``) for:

- the SmolLM2-135M-Instruct GGUF as it is (byte-level BPE, pre-tokenizer ``smollm``), and its
  vocabulary under other ``tokenizer.ggml.pre`` values (each a GGUF written here with the same
  vocabulary and merges), so every pre-tokenizer regex is checked against llama.cpp's;
- SentencePiece (``tokenizer.ggml.model = llama``) vocabularies made here: a BPE trained with
  ``tokenizers`` on the text set, rewritten in SentencePiece's spelling (``▁``, ``<0xNN>`` byte
  tokens, scores), with a user-defined token, with and without ``add_space_prefix``.

It writes ``tests/models/data/llama_cpp_token_ids.json``: the texts, the llama_cpp version, and
per case the GGUF's sha256 and metadata overrides (SmolLM2) or its whole tokenizer metadata (the
made-up vocabularies), the ids, and llama.cpp's ``llama_detokenize`` of them (specials kept).
Run it with this project's environment (it needs ``gguf`` and ``tokenizers``); llama.cpp runs in
the environment ``--llama-python`` names:

    .venv/bin/python tests/models/data/record_llama_cpp_ids.py --llama-python PYTHON

(llama-cpp-python builds from source, so it lives in an environment of its own:
``CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python`` there.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent / "llama_cpp_token_ids.json"

TEXTS = [
    "",
    "Hello world",
    " Hello world",
    "Hello  world   ",
    "hello\n\n\nworld\n",
    "\ttabs\tand\t\ttabs\t",
    "   leading and trailing spaces   ",
    "\n",
    " ",
    "    ",
    "don't we'll they're I've she'd it's I'M YOU'RE",
    "12 123 1234 12345 123456 3.14159 1,000,000",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "naïve café résumé Ünïcödé façade",
    "e\u0301 a\u0300 o\u0308 n\u0303 (combining marks)",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트",
    "مرحبا بالعالم",
    "Привет, мир! Ёлка.",
    "Γειά σου κόσμε",
    "emoji 🤗🔥 and 👍🏽",
    "family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text",
    "<|endoftext|><|endoftext|>",
    "<s> hello </s>",
    "MixedCASE camelCase snake_case kebab-case HTTPServer",
    "URL: https://example.com/path?q=1&r=2#frag",
    "!!! ??? ... --- ***",
    "$100 + 50% = ~150 <tag> |pipe| ^caret `tick`",
    "a\r\nb\rc",
    "line1\n  line2\n\tline3",
    "中文English混合123",
    "\u00a0non-breaking\u2009thin\u3000ideographic",
    "zero\u200bwidth",
    "The quick brown fox jumps over the lazy dog.",
    "call <tool>now</tool> <unk> and <s>x",
]

# the SmolLM2 vocabulary under these pre-tokenizers (with add_bos on in the last one)
PRE_VARIANTS = [
    {},
    {"tokenizer.ggml.pre": "gpt-2"},
    {"tokenizer.ggml.pre": "default"},
    {"tokenizer.ggml.pre": "llama-bpe"},
    {"tokenizer.ggml.pre": "qwen2"},
    {"tokenizer.ggml.pre": "starcoder"},
    {"tokenizer.ggml.pre": "tekken"},
    {"tokenizer.ggml.pre": "gpt-4o"},
    {"tokenizer.ggml.pre": "deepseek-llm"},
    {"tokenizer.ggml.pre": "deepseek-coder"},
    {"tokenizer.ggml.pre": "falcon"},
    {"tokenizer.ggml.pre": "poro-chat"},
    {"tokenizer.ggml.pre": "viking"},
    {"tokenizer.ggml.pre": "dbrx"},
    {"tokenizer.ggml.pre": "qwen35"},
    {"tokenizer.ggml.pre": "seed-coder"},
    {"tokenizer.ggml.pre": "ufakzeka"},
    {"tokenizer.ggml.pre": "bailingmoe"},
    {"tokenizer.ggml.pre": "exaone-moe"},
    {"tokenizer.ggml.pre": "deepseek-v3"},
    {"tokenizer.ggml.pre": "granite-embed-multi-97m"},
    {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": True},
    # no add_bos_token key: the pre-tokenizer's default (on for llama3 and tekken)
    {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": None},
    {"tokenizer.ggml.pre": "tekken", "tokenizer.ggml.add_bos_token": None},
    {"tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.add_bos_token": None},
]

# tokenize, then llama_detokenize (remove_special=False, unparse_special=True) the ids
LLAMA_PROGRAM = r"""
import ctypes, json, sys
import llama_cpp
job = json.load(sys.stdin)
out = {"version": llama_cpp.__version__, "ids": [], "text": []}
for path in job["files"]:
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    ids = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in job["texts"]]
    texts = []
    for row in ids:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_detokenize(
            vocab, (llama_cpp.llama_token * len(row))(*row), len(row), buf, 1 << 16, False, True
        )
        texts.append(buf.raw[:n].decode("utf-8", errors="replace"))
    out["ids"].append(ids)
    out["text"].append(texts)
    del llm
print(json.dumps(out))
"""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fields(path: Path) -> dict:
    """The GGUF file's metadata as Python values."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def write_gguf(path: Path, base: dict, metadata: dict) -> None:
    """A tensor-less GGUF: the base file's model keys (llama.cpp reads the hyper-parameters even
    for a vocabulary) and ``metadata``'s tokenizer keys."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch=base["general.architecture"])
    for key, value in {**base, **metadata}.items():
        if key == "general.architecture" or (key.startswith("tokenizer.") and key not in metadata):
            continue
        if key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(v) for v in value])
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(v) for v in value])
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            if value and isinstance(value[0], str):
                w.add_array(key, value)
            else:
                w.add_array(key, [int(v) for v in value])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def spm_vocabulary(add_space_prefix: bool, shuffle: bool = False) -> dict:
    """A SentencePiece-style vocabulary: ``<unk> <s> </s>``, the 256 byte tokens, a user-defined
    token, then a ``▁``-spelled BPE trained on the Latin-script texts (scores falling with the
    id, or distinct scores in a seeded random order: llama.cpp merges by score whatever the
    order the tokens were learnt in, as a Unigram vocabulary's log-probabilities are)."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # Latin-script texts only: the others' characters have no token and fall back to bytes
    corpus = [t for t in TEXTS if t and max(map(ord, t)) < 0x250] * 3 + [
        "the cat sat on the mat", "attention is all you need", "hello there general",
    ]  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    learned = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<tool>"]
    types = [2, 3, 3] + [6] * 256 + [4]
    tokens += [t for t, _ in learned if t not in tokens]
    types += [1] * (len(tokens) - len(types))
    scores = [0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)]
    if shuffle:
        learnt = scores[260:]
        random.Random(0).shuffle(learnt)
        scores[260:] = learnt
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--llama-python",
        default=sys.executable,
        help="an interpreter that imports llama_cpp (default: this one)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    from selfattn.models.bundled import chat_model_path

    SMOLLM2 = chat_model_path()
    base = fields(SMOLLM2)
    cases = [{"name": "smollm2", "gguf": SMOLLM2.name, "sha256": sha256(SMOLLM2), "overrides": o}
             for o in PRE_VARIANTS]  # fmt: skip
    cases += [{"name": "spm", "metadata": spm_vocabulary(prefix)} for prefix in (True, False)]
    cases += [{"name": "spm-shuffled", "metadata": spm_vocabulary(True, shuffle=True)}]
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, case in enumerate(cases):
            path = Path(tmp) / f"case{i}.gguf"
            if "overrides" in case:
                own = {k: v for k, v in base.items() if k.startswith("tokenizer.")}
                merged = {**own, **case["overrides"]}  # None: the key left out
                write_gguf(path, base, {k: v for k, v in merged.items() if v is not None})
            else:
                write_gguf(path, base, case["metadata"])
            files.append(str(path))
        job = json.dumps({"files": files, "texts": TEXTS})
        run = subprocess.run(
            [args.llama_python, "-c", LLAMA_PROGRAM], input=job, stdout=subprocess.PIPE, text=True,
            check=True,
        )  # fmt: skip
    result = json.loads(run.stdout)
    for case, ids, text in zip(cases, result["ids"], result["text"]):
        case["ids"], case["decoded"] = ids, text
    record = {"llama_cpp_version": result["version"], "texts": TEXTS, "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(cases)} cases x {len(TEXTS)} texts -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
