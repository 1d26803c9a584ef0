"""A tiny random Llama whose tokenizer spells JSON: byte-level BPE over printable ASCII (no
newline or tab: a guide needing one is a dead end), a few merged tokens, "</s>" the end of
sequence, and model logits wider than the vocabulary (ids without a token)."""

from __future__ import annotations

import torch

MODEL_VOCAB = 128  # logits width; the tokenizer has fewer ids
MERGES = [('"', ":"), ('"', ","), ("{", '"'), ("Ġ", '"'), ("t", "r"), ("tr", "u"), ("tru", "e")]
# tokens the head favours (times the favour), so that a random walk through a grammar closes
# strings, numbers, arrays and objects within a few tokens (the guide alone decides validity);
# the quote most: inside a string, it is the one that ends it
FAVOURED = {'"': 2.0, "}": 1.0, "]": 1.0, ",": 1.0, "</s>": 1.0}


def save_tiny_json_llama(path, favour: float = 4.0):
    """Saves the checkpoint (transformers' files) into ``path``; returns ``path``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps the bytes 0x21..0x7e to themselves and the space to "Ġ"
    printable = ["Ġ"] + [chr(b) for b in range(0x21, 0x7F)]
    assert all(c in alphabet for c in printable)
    vocab = {"</s>": 0}  # the end of sequence
    for c in printable:
        vocab.setdefault(c, len(vocab))
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) < MODEL_VOCAB
    tok = Tokenizer(models.BPE(vocab, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    hf.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    hf.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=0, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def load_tiny_json_llama(path, favour: float = 3.0):
    """:func:`save_tiny_json_llama`'s model and tokenizer from ``path``, its head biased by
    ``favour`` towards :data:`FAVOURED` (a Llama head has no bias: one is added here), so that
    a random walk through a grammar closes its strings, numbers and containers within tens of
    tokens; the guide alone decides validity."""
    from selfattn.models import from_pretrained, load_tokenizer

    model, tok = from_pretrained(path).eval(), load_tokenizer(path)
    bias = torch.zeros(MODEL_VOCAB)
    for t, weight in FAVOURED.items():
        bias[tok.tokenizer.token_to_id(t)] = favour * weight
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model, tok
