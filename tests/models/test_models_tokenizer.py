"""load_tokenizer against transformers' PreTrainedTokenizerFast on tokenizers built offline.

A tiny BPE (trained in the test on a few sentences, with a post-processor adding <s>) and a
WordLevel tokenizer are wrapped by transformers, given a chat template and saved with
save_pretrained; ours reads the same folder. Encodings, decodings and rendered chats must be equal.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")

from selfattn.models import CheckpointError, load_tokenizer  # noqa: E402

CORPUS = [
    "Self-attention lets every token look at every other token.",
    "The cat sat on the mat, didn't it? Yes!",
    "Ünïcödé text and numbers 12345 are tokens too.",
] * 4
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]

# A template in the style of the Hub's: a BOS, role headers, raise_exception, a generation block,
# loop controls, tojson of non-ASCII text and a generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'system' and not loop.first %}{% continue %}{% endif %}"
    "<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n"
    "{% endfor %}{% if meta is defined %}{{ meta | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Does the cat sit on the mat?"},
    {"role": "assistant", "content": "Yes, it didn't move."},
    {"role": "user", "content": "Ünïcödé?"},
]
TEXTS = ["The cat sat on the mat.", "token token, didn't it?", "Ünïcödé 12345!", ""]


def bpe_folder(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
    )  # fmt: skip
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def wordlevel_folder(folder, clean_up):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for s in CORPUS for w in pre_tokenizers.Whitespace().pre_tokenize_str(s)})
    vocab = {t: i for i, t in enumerate(SPECIALS + [w for w, _ in words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=clean_up,
    )  # fmt: skip
    hf.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_bpe_encode_decode_equal_transformers(tmp_path):
    theirs = bpe_folder(tmp_path)
    ours = load_tokenizer(tmp_path)
    assert ours.vocab_size == len(theirs)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name)
    for text in TEXTS:
        for specials in (True, False):
            ids = ours.encode(text, add_special_tokens=specials)
            assert ids == theirs.encode(text, add_special_tokens=specials)
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )


@pytest.mark.parametrize("clean_up", [False, True])
def test_wordlevel_decode_cleans_up_spaces_as_configured(tmp_path, clean_up):
    theirs = wordlevel_folder(tmp_path, clean_up)
    ours = load_tokenizer(tmp_path)
    for text in CORPUS[:3]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tmp_path, generation_prompt):
    theirs = bpe_folder(tmp_path)
    ours = load_tokenizer(tmp_path)
    kw = dict(add_generation_prompt=generation_prompt)
    text = ours.apply_chat_template(MESSAGES, tokenize=False, **kw)
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False, **kw)
    assert text.startswith("<s><|system|>")
    assert text.endswith("<|assistant|>\n") == generation_prompt
    ids = ours.apply_chat_template(MESSAGES, **kw)
    assert ids == theirs.apply_chat_template(MESSAGES, tokenize=True, return_dict=False, **kw)
    # extra keywords reach the template, non-ASCII JSON stays readable
    extra = ours.apply_chat_template(MESSAGES, tokenize=False, meta={"ü": 1})
    assert extra == theirs.apply_chat_template(MESSAGES, tokenize=False, meta={"ü": 1})
    assert '{"ü": 1}' in extra


def test_chat_template_from_the_config_and_its_errors(tmp_path):
    bpe_folder(tmp_path)
    jinja_file = tmp_path / "chat_template.jinja"
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if jinja_file.is_file():  # transformers 5 writes the template beside the config
        jinja_file.unlink()
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    config_file.write_text(json.dumps(config))
    ours = load_tokenizer(tmp_path)
    assert ours.apply_chat_template(MESSAGES[:1], tokenize=False) == "You are terse.!"
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=CHAT_TEMPLATE)
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path).apply_chat_template(MESSAGES)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_sandbox_refuses_attribute_escapes(tmp_path):
    bpe_folder(tmp_path)
    ours = load_tokenizer(tmp_path)
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError, match=r"'__class__' .* is unsafe"):
        ours.apply_chat_template(MESSAGES, tokenize=False, chat_template=evil)


def test_batch_is_left_padded(tmp_path):
    bpe_folder(tmp_path)
    ours = load_tokenizer(tmp_path)
    batch = ours(["The cat sat on the mat.", "Yes!"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    short = ours.encode("Yes!")
    assert ids.shape == mask.shape == (2, len(ours.encode("The cat sat on the mat.")))
    assert ids[1, -len(short) :].tolist() == short and mask[1].sum() == len(short)
    assert (ids[1, : -len(short)] == ours.pad_token_id).all() and not mask[1, 0]


TOOL_TEMPLATE = (
    "{% if tools is not none %}[tools]{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "{% else %}[no tools]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% endfor %}"
)


def test_tools_reach_the_template_as_transformers_passes_them(tmp_path):
    """``tools`` is the template's variable, None when not given (templates test ``tools is
    not none``), and a call's arguments render as the template writes them."""
    theirs = bpe_folder(tmp_path)
    ours = load_tokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "f", "description": "ü",
                                               "parameters": {"type": "object"}}}]  # fmt: skip
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "2"}]  # fmt: skip
    for kw in ({}, {"tools": tools}):
        text = ours.apply_chat_template(messages, tokenize=False, chat_template=TOOL_TEMPLATE, **kw)
        want = theirs.apply_chat_template(
            messages, tokenize=False, chat_template=TOOL_TEMPLATE, **kw
        )
        assert text == want
        assert text.startswith("[tools]" if kw else "[no tools]") and 'f{"x": 1}' in text
