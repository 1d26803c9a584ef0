"""A tiny Llama checkpoint with a tokenizer and chat template, and an HTTP server started and
stopped by a test (uvicorn on a thread, on a free loopback port)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import torch

VOCAB = 64
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"
START_TIMEOUT_S = 30


def save_random_llama(path, vocab_size: int, eos_token_id: int, max_positions: int) -> None:
    """A tiny random Llama (seeded) saved by transformers into ``path``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def save_tiny_llama(path, max_positions: int = 128):
    """A tiny random Llama and a WordLevel tokenizer over its ids ("w0" .. "w63", plus role
    words; "</s>" is id 1, the end of sequence), saved by transformers into ``path``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_random_llama(path, VOCAB, eos_token_id=1, max_positions=max_positions)
    vocab = {f"w{i}": i for i in range(VOCAB - 3)}
    vocab["</s>"] = vocab.pop("w1")
    for i, word in enumerate(("<user>", "<assistant>", "<system>")):
        vocab[word] = VOCAB - 3 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(path)
    return path


BYTE_SPECIALS = ("<|im_end|>", "<|im_start|>")  # the end of a turn (the eos) and its start
BYTE_ADDED = ("<tool_call>", "</tool_call>")  # ordinary added tokens, as Qwen2.5 has them


def save_tiny_byte_llama(path, chat_template: str, max_positions: int = 1024):
    """A tiny random Llama over a byte-level tokenizer that spells any text (256 byte tokens,
    no merges) plus ``BYTE_SPECIALS`` and ``BYTE_ADDED``; ``<|im_end|>`` is the end of
    sequence. Saved by transformers into ``path`` with ``chat_template``."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in BYTE_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False) for t in BYTE_ADDED])
    V = tok.get_vocab_size(with_added_tokens=True)
    save_random_llama(path, V, tok.token_to_id("<|im_end|>"), max_positions)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    hf.chat_template = chat_template
    hf.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app, port: int | None = None, send_buffer: int | None = None, **config_kw):
    """Serve ``app`` on 127.0.0.1 (``port``, or a free one) from a thread; yields the base URL
    (``http://127.0.0.1:PORT``); stops it (a graceful uvicorn shutdown) on exit.
    ``send_buffer``: SO_SNDBUF of the listening socket, which Linux gives each accepted
    connection (a client that stops reading then stalls the server's writes soon);
    ``config_kw``: more of ``uvicorn.Config``'s arguments."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", port or 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10, **config_kw)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        sock.close()


@contextlib.contextmanager
def tiny_llama_server(folder):
    """A server of :func:`save_tiny_llama`'s checkpoint (saved into ``folder``) on a free port;
    yields its base URL."""
    from selfattn.models import from_pretrained, load_tokenizer
    from selfattn.serving import Engine
    from selfattn.serving.server import build_app

    save_tiny_llama(folder)
    engine = Engine(from_pretrained(folder).eval(), load_tokenizer(folder), kv_cache_bytes=1 << 20)
    with running_server(build_app(engine, model_name="tiny-llama")) as url:
        yield url
