"""Autoregressive generation for our causal LMs and encoder-decoders: prefill, then decode.

``generate(model, input_ids, max_new_tokens, ...)`` drives the protocols documented in
:mod:`selfattn.models.decoder` (``model(input_ids, attention_mask, cache=, position_ids=)``,
``model.make_cache(kind, batch, max_len)``) and :mod:`selfattn.models.seq2seq`
(``model.encode``, ``model.decode``, ``decoder_start_token_id``)::

    prompt (left-padded)    prefill: one call over the prompt, K/V into the cache
    [pad a b c]             decode: one call per new token, its K/V appended
         -> d -> e -> ...   positions continue per row (real tokens only), padding stays masked

Token choice per step, in this order (as transformers' logits processors): ``temperature``
divides the logits, ``top_k`` keeps the k largest, ``top_p`` keeps the smallest set of most
likely tokens whose probability reaches ``top_p``; then the argmax (``do_sample=False``) or one
draw from the softmax (``torch.multinomial`` with ``generator``: seeded and reproducible).
A row that emitted a stop token is finished: it emits ``pad_token_id`` from then on, and
generation stops when every row is finished.

Where it stops, by default (:func:`stop_token_ids`): every id of the ``eos_token_id`` (an int
or a list) of the model's ``generation_config``, else of the model itself, and the tokenizer's
``stop_token_ids`` (its end of sequence and the chat template's end-of-turn tokens, e.g.
``<|im_end|>``, ``<|eot_id|>``) when a tokenizer is given: a chat model stops at the end of its
turn, on text or on token ids. ``eos_token_id=`` replaces that set; ``ignore_eos=True`` runs on
to ``max_new_tokens``.

The checkpoint's generation defaults (``model.generation_config``: a dict with transformers'
``generation_config.json`` keys, set by ``from_pretrained`` for a folder or a GGUF file) fill
every argument the call leaves as None: ``max_new_tokens`` (else ``max_length`` minus the
prompt, else 20), ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``pad_token_id``, as
transformers' ``generate`` does; greedy decoding where neither says otherwise.

Threads: a CPU runs each step on ``torch.get_num_threads()`` threads; ``torch.set_num_threads(n)``
sets them for the process (the ``selfattn`` command's ``--threads``, default the cores this
process may use, ``len(os.sched_getaffinity(0))``).

Speculative decoding (:mod:`selfattn.models.speculative`; transformers' keywords):
``prompt_lookup_num_tokens=k`` drafts ``k`` tokens a step by prompt lookup, ``assistant_model=``
with a draft model (``num_assistant_tokens=k``). Each row's drafts are checked in one forward of
``1 + k`` tokens over a paged cache (rows of their own lengths: no padding), the rejected ones
trimmed from it; greedy output is plain greedy output (float32: token for token; bfloat16: up
to a near-tie rounded the other way), sampled output keeps its distribution.

Text in, text out: given a ``tokenizer`` (:func:`selfattn.models.load_tokenizer`), the prompt
may be a string or a list of strings (left-padded into a batch) and the continuation comes back
as text. A ``streamer`` with transformers' protocol (``put``/``end``, e.g.
``transformers.TextStreamer``) gets the prompt ids ``(B, S)`` first, then each step's tokens
``(B,)``, then ``end()``, as transformers' ``generate`` calls it.
"""

from __future__ import annotations

import torch

from selfattn._validate import int_at_least
from selfattn.cache.base import ModelKVCache
from selfattn.kernels import determinism
from selfattn.models import speculative as spec
from selfattn.models.decode_fast import plain_blocks
from selfattn.models.decoder import DECODER_CACHE_KINDS, CausalLM
from selfattn.models.kv_compression import as_press, check_compressible, compress_prefill

__all__ = ["generate", "generation_defaults", "next_token", "stop_token_ids", "token_probs"]

DEFAULT_MAX_NEW_TOKENS = 20  # transformers' max_length default, counted in new tokens


def _token_ids(name: str, value) -> tuple[int, ...]:
    """``None`` / an int / a list of ints -> a tuple of ints."""
    if value is None:
        return ()
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}") from None
    if not values:
        raise ValueError(f"{name} must hold token ids, got {value!r}")
    return tuple(int_at_least(v, f"{name} token id", 0) for v in values)


def _id_list(value) -> list[int]:
    """An int, a list of ints or None -> a list (without None entries)."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if v is not None]


def generation_defaults(model) -> dict:
    """The model's generation defaults: ``model.generation_config`` (a dict with transformers'
    keys, set at load), ``{}`` where it has none."""
    config = getattr(model, "generation_config", None)
    return dict(config) if isinstance(config, dict) else {}


def stop_token_ids(model, tokenizer=None) -> tuple[int, ...]:
    """The tokens that end a reply by default: the ``eos_token_id`` of the model's
    ``generation_config`` where it has that key (None there: none), else the model's own (every
    id of a list; the GGUF loader adds end-of-turn ids), and ``tokenizer.stop_token_ids`` (end of
    sequence and the chat template's end-of-turn tokens; a tokenizer without it: its
    ``eos_token_id``). In that
    order, each once; ``()`` when none is known."""
    defaults = generation_defaults(model)
    if "eos_token_id" in defaults:  # a generation config's word is final, as in transformers
        ids = _id_list(defaults["eos_token_id"])
    else:
        ids = _id_list(getattr(model, "eos_token_id", None))
    if tokenizer is not None:
        stops = getattr(tokenizer, "stop_token_ids", None)
        ids += _id_list(stops if stops is not None else getattr(tokenizer, "eos_token_id", None))
    return tuple(dict.fromkeys(int(i) for i in ids))


def next_token(
    logits: torch.Tensor,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each row from ``logits (B, vocab)`` -> ``(B,)`` int64.

    Greedy (argmax) unless ``do_sample``; sampling applies temperature, top-k, top-p in that
    order and draws with ``generator`` (the global RNG when None).
    """
    if not do_sample:
        return logits.argmax(-1)
    probs = token_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B, 1) -> (B,)


def token_probs(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The distribution :func:`next_token` samples from: ``logits (B, vocab)`` -> float32
    probabilities ``(B, vocab)`` after temperature, top-k and top-p (in that order)."""
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]  # (B, 1): the k-th largest
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        # Drop a token when the more likely ones already reach top_p; the first always stays.
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def _check_sampling(do_sample, temperature, top_k, top_p) -> None:
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; use do_sample=False for greedy decoding"
        )
    if top_k is not None:
        int_at_least(top_k, "top_k", 1)
    bad_type = isinstance(top_p, bool) or not isinstance(top_p, (int, float))
    if top_p is not None and (bad_type or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


def _streamer_calls(streamer):
    """``(put, end)`` of a streamer: transformers' ``put``/``end`` protocol, or a plain callable
    (called with each step's tokens only; ``end`` None)."""
    if streamer is None:
        return None, None
    put, end = getattr(streamer, "put", None), getattr(streamer, "end", None)
    if callable(put) and callable(end):
        return put, end
    if callable(streamer):
        return streamer, None
    raise TypeError(
        f"streamer must have put(tokens) and end() (transformers' protocol) or be "
        f"callable(step_tokens), got {type(streamer).__name__}"
    )


def _generate_text(model, prompts, tokenizer, max_new_tokens, attention_mask, **kw):
    """``generate`` for a string or a list of strings: the continuation(s) as text."""
    if tokenizer is None:
        raise TypeError(
            "a text prompt needs tokenizer= (selfattn.models.load_tokenizer(path)); or pass "
            "input_ids (B, S)"
        )
    if attention_mask is not None:
        raise ValueError("attention_mask comes from the tokenizer for text prompts; drop it")
    batch = tokenizer(prompts)
    device = next(model.parameters()).device
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    if kw.get("pad_token_id") is None and generation_defaults(model).get("pad_token_id") is None:
        kw["pad_token_id"] = tokenizer.pad_token_id
    out = generate(model, ids, max_new_tokens, attention_mask=mask, tokenizer=tokenizer, **kw)
    # a decoder returns prompt + new tokens; an encoder-decoder [start] + new tokens
    prefix = 1 if getattr(model, "is_encoder_decoder", False) else ids.shape[1]
    texts = tokenizer.batch_decode(out[:, prefix:], skip_special_tokens=True)
    return texts[0] if isinstance(prompts, str) else texts


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor | str | list[str],
    max_new_tokens: int | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    cache: str | ModelKVCache | None = "auto",
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    ignore_eos: bool = False,
    streamer=None,
    page_size: int = 16,
    tokenizer=None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
    assistant_model=None,
    num_assistant_tokens: int | None = None,
    kv_compression=None,
    kv_compression_context: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor | str | list[str]:
    """Continue ``input_ids (B, S)`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a causal LM (see :mod:`selfattn.models.decoder`) or an encoder-decoder
            (``model.is_encoder_decoder``; ``input_ids`` then go to the encoder and the decoder
            starts from ``model.decoder_start_token_id``).
        attention_mask: ``(B, S)`` 1 = token, 0 = padding; prompts are left-padded.
        cache: ``"static"``, ``"window"``, ``"paged"`` (``page_size`` tokens a page),
            ``"kivi"`` (2-bit KIVI, :class:`~selfattn.cache.KIVICache`), or None to
            recompute the whole sequence at every step (slow; the reference for the caches).
            An empty cache from ``model.make_cache(...)`` (room for the prompt and the new
            tokens) is used as given: ``make_cache("kivi", B, n, bits=4)`` for 4-bit KIVI.
            ``"auto"`` (the default): ``"paged"`` where its decode steps take the fast path (a
            decoder-only model whose blocks are all the plain Llama layout, rows without
            padding: :mod:`selfattn.models.decode_fast`), else ``"static"``.
        max_new_tokens: None: the model's ``generation_config`` (module docstring), else 20.
        do_sample, temperature, top_k, top_p, generator: see :func:`next_token`; None takes
            the model's ``generation_config`` value, else greedy decoding (temperature 1, no
            top-k / top-p).
        eos_token_id: an int or a list; a row stops after emitting one (None: the model's and
            the tokenizer's stop tokens, :func:`stop_token_ids`).
        pad_token_id: what finished rows emit (default the ``generation_config``'s, the
            tokenizer's, else the first stop token).
        ignore_eos: run every row to ``max_new_tokens``, past its stop tokens.
        streamer: an object with transformers' ``put``/``end`` (``put`` gets the prompt ids
            first, as in transformers), or a callable given each step's tokens ``(B,)``.
        tokenizer: needed when ``input_ids`` is text (a string or a list of strings); with
            token ids, it adds its stop tokens (chat end-of-turn tokens) to the defaults.
        prompt_lookup_num_tokens: speculative decoding with ``k`` draft tokens a step from
            prompt lookup (:mod:`selfattn.models.speculative`): the last 3 down to 1 tokens
            matched earlier in the prompt and output (``max_matching_ngram_size`` sets the 3).
        assistant_model: speculative decoding with this draft model (a causal LM with the same
            vocabulary) proposing ``num_assistant_tokens`` tokens a step (default 5), greedily
            (or, when sampling, from its own processed distribution).
            Speculation emits what plain decoding emits (greedy: the same tokens; sampling: the
            same distribution), checking k drafts in one forward. It runs over a paged cache of
            ``page_size``-token pages whatever ``cache`` says (rows then hold different
            lengths; rejected drafts are rolled back), rows without padding, and
            decoder-only models.
        kv_compression: compress the prompt's KV once after the prefill, as kvpress does: a
            press (``selfattn.cache.compress.press("snapkv", 0.5)``) or a ``"POLICY:RATIO"``
            string (:mod:`selfattn.models.kv_compression`). It runs on the static cache
            (``cache="auto"`` picks it), for decoder-only models with global attention in every
            layer and rows without padding; None or ratio 0: exactly the uncompressed run.
        kv_compression_context: compress the first ``n`` prompt tokens only (kvpress's context)
            and prefill the rest (its question) after them uncompressed; None: the whole prompt.
        deterministic: each row's tokens and logits bitwise the same whatever the other rows
            and the thread count (:mod:`selfattn.kernels.determinism`: fixed key splits,
            batch-invariant linears; slower decode). It runs on the paged cache (``cache``
            ``"auto"`` or ``"paged"``), rows unpadded (prompts of one length: a padded row's
            keys and positions shift with the batch's longest prompt) and without speculation.

    Returns:
        ``(B, S + n)`` token ids: the prompt, then ``n <= max_new_tokens`` new tokens (fewer when
        every row finished early). Encoder-decoders return the decoder's ``(B, 1 + n)`` tokens,
        starting with ``decoder_start_token_id``, as transformers does. For a text prompt: the
        generated text (a string, or a list for a list of prompts), special tokens skipped.
    """
    if isinstance(input_ids, str) or (
        isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], str)
    ):
        return _generate_text(
            model, input_ids, tokenizer, max_new_tokens, attention_mask,
            cache=cache, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
            ignore_eos=ignore_eos, streamer=streamer, page_size=page_size,
            prompt_lookup_num_tokens=prompt_lookup_num_tokens,
            max_matching_ngram_size=max_matching_ngram_size, assistant_model=assistant_model,
            num_assistant_tokens=num_assistant_tokens, kv_compression=kv_compression,
            kv_compression_context=kv_compression_context, deterministic=deterministic,
        )  # fmt: skip
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ValueError(f"input_ids must be a (B, S) int tensor, got {got!r}")
    if input_ids.is_floating_point() or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must hold at least one integer token per row, got {input_ids.dtype} "
            f"{tuple(input_ids.shape)}"
        )
    defaults = generation_defaults(model)
    if max_new_tokens is None:
        max_new_tokens = _default_max_new(defaults, input_ids.shape[1])
    int_at_least(max_new_tokens, "max_new_tokens", 0)
    if isinstance(cache, str) and cache != "auto" and cache not in DECODER_CACHE_KINDS:
        raise ValueError(
            f"cache must be one of {(*DECODER_CACHE_KINDS, 'auto')}, None or an empty cache "
            f"from model.make_cache(...), got {cache!r}"
        )
    if do_sample is None:
        do_sample = bool(defaults.get("do_sample", False))
    if do_sample:  # the checkpoint's sampling values apply where the call gives none
        temperature = defaults.get("temperature", 1.0) if temperature is None else temperature
        top_k = defaults.get("top_k") if top_k is None else top_k
        top_p = defaults.get("top_p") if top_p is None else top_p
    temperature = 1.0 if temperature is None else temperature
    _check_sampling(do_sample, temperature, top_k, top_p)
    if not isinstance(ignore_eos, bool):
        raise TypeError(f"ignore_eos must be a bool, got {ignore_eos!r}")
    put, end = _streamer_calls(streamer)
    B, S = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (B, S):
        raise ValueError(
            f"attention_mask must match input_ids (B={B}, S={S}), got {tuple(attention_mask.shape)}"
        )
    if eos_token_id is None:
        eos = stop_token_ids(model, tokenizer)
    else:
        eos = _token_ids("eos_token_id", eos_token_id)
    if pad_token_id is None:
        pad_token_id = defaults.get("pad_token_id")
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    if ignore_eos:
        eos = ()
    _token_ids("pad_token_id", pad_token_id)
    pick = dict(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
    )
    spec = _speculation(model, prompt_lookup_num_tokens, max_matching_ngram_size,
                        assistant_model, num_assistant_tokens)  # fmt: skip
    kv_press = _compression(model, kv_compression, kv_compression_context, cache,
                            attention_mask, spec)  # fmt: skip
    if kv_press is not None:
        cache = "static"
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if deterministic:
        cache = _deterministic_cache(cache, attention_mask, spec, kv_press)
    with determinism.deterministic(deterministic):
        return _generate_checked(model, input_ids, attention_mask, cache, max_new_tokens,
                                 page_size, eos, pad_token_id, pick, put, end, spec,
                                 (kv_press, kv_compression_context))  # fmt: skip


def _deterministic_cache(cache, attention_mask, speculation, press):
    """The cache of a deterministic generation: the paged one (its kernel's key splits are the
    ones deterministic mode fixes); ValueError for another cache, speculation or compression
    (not made invariant yet) and for padded rows, whose results depend on the batch's longest
    prompt."""
    for what, given in (("speculative decoding", speculation), ("kv_compression", press)):
        if given is not None:
            raise ValueError(f"generate(deterministic=True) does not run {what} yet: drop it")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(
            "generate(deterministic=True) runs rows without padding: pass prompts of one "
            "length (or serve them with Engine(..., deterministic=True), which takes any)"
        )
    if cache not in ("auto", "paged"):
        raise ValueError(
            f"generate(deterministic=True) runs on the paged cache, got cache={cache!r}: pass "
            "cache='auto' or 'paged'"
        )
    return "paged"


def _generate_checked(model, input_ids, attention_mask, cache, max_new_tokens, page_size, eos,
                      pad_token_id, pick, put, end, spec, compression):  # fmt: skip
    """:func:`generate` once its arguments are checked: ``(B, S + n)`` token ids."""
    B = input_ids.shape[0]
    if spec is not None and max_new_tokens > 0:
        if end is not None:
            put(input_ids.cpu())
        out = _speculative_loop(model, input_ids, attention_mask, max_new_tokens, eos,
                                pad_token_id, pick, put, spec, page_size)  # fmt: skip
        if end is not None:
            end()
        return out
    if cache == "auto":
        cache = _auto_cache(model, attention_mask)
    if getattr(model, "is_encoder_decoder", False):
        step, prefix = _seq2seq_steps(
            model, input_ids, attention_mask, cache, max_new_tokens, page_size
        )
    else:
        step, prefix = _decoder_steps(
            model, input_ids, attention_mask, cache, max_new_tokens, page_size, compression
        )
    out = prefix.new_empty(B, prefix.shape[1] + max_new_tokens)
    out[:, : prefix.shape[1]] = prefix
    n = prefix.shape[1]
    if end is not None:
        put(prefix.cpu())  # transformers streams the prompt (decoder: the input ids) first
    out = _decode_loop(step, out, n, max_new_tokens, eos, pad_token_id, pick, put)
    if end is not None:
        end()
    return out


def _auto_cache(model, attention_mask) -> str:
    """``cache="auto"``: paged where the fast path takes its steps, else static."""
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if (
        not padded
        and type(model).make_cache is CausalLM.make_cache
        and not getattr(model, "is_encoder_decoder", False)
        and plain_blocks(model)
    ):
        return "paged"
    return "static"


def _default_max_new(defaults: dict, prompt_len: int) -> int:
    """``max_new_tokens`` of a call that gives none: the checkpoint's, else its ``max_length``
    less the prompt, else :data:`DEFAULT_MAX_NEW_TOKENS`."""
    if defaults.get("max_new_tokens") is not None:
        return int(defaults["max_new_tokens"])
    if defaults.get("max_length") is not None:
        return max(int(defaults["max_length"]) - prompt_len, 0)
    return DEFAULT_MAX_NEW_TOKENS


def _decode_loop(step, out, n: int, max_new_tokens: int, eos, pad_token_id, pick, put):
    """Prefill, then choose, record and stream one token per step into ``out (B, n + new)``."""
    if max_new_tokens == 0:
        return out
    B = out.shape[0]
    eos_t = torch.tensor(eos, device=out.device)
    unfinished = torch.ones(B, dtype=torch.bool, device=out.device)
    logits = step(None, n)  # prefill
    for t in range(max_new_tokens):
        tok = next_token(logits[:, -1], **pick)
        if eos:
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad_token_id))
        out[:, n] = tok
        n += 1
        if put is not None:
            put(tok.cpu())
        if eos:
            unfinished &= ~torch.isin(tok, eos_t)
            if not bool(unfinished.any()):
                break
        if t + 1 < max_new_tokens:
            logits = step(out[:, :n], n)
    return out[:, :n]


def _compression(model, spec, context_len, cache, attention_mask, speculation):
    """``generate``'s ``kv_compression`` checked -> a press, or None (none, or ratio 0)."""
    if spec is None:
        if context_len is not None:
            raise ValueError("kv_compression_context needs kv_compression=; drop it")
        return None
    kv_press = as_press(spec)
    check_compressible(model, cache, attention_mask)
    if speculation is not None:
        raise ValueError(
            "kv_compression runs on the static cache and speculation on the paged one; drop "
            "prompt_lookup_num_tokens / assistant_model or kv_compression"
        )
    return kv_press


def _step_cache(model, kind, batch: int, max_len: int, page_size: int):
    """The cache of a generation: None, ``model.make_cache(kind, ...)`` for a kind, or the
    caller's own cache, which must be empty (generation starts from position 0)."""
    if kind is None or isinstance(kind, str):
        return None if kind is None else model.make_cache(kind, batch, max_len, page_size=page_size)
    if kind.length:
        raise ValueError(
            f"generate needs an empty cache, got one holding {kind.length} tokens; reset() it "
            "or build a new one with model.make_cache(...)"
        )
    return kind


def _decoder_steps(model, input_ids, attention_mask, kind, max_new: int, page_size: int,
                   compression=(None, None)):  # fmt: skip
    """``step(tokens so far or None, n) -> logits`` for a causal LM, and the prefix to extend;
    ``compression``: ``(press or None, context length)`` for the prefill."""
    B, S = input_ids.shape
    total = S + max_new
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    mask = None
    if padded:  # the full (B, S + max_new) mask once; each step reads a prefix of it
        mask = attention_mask.new_ones(B, total)
        mask[:, :S] = attention_mask
        next_pos = attention_mask.long().sum(-1, keepdim=True)  # (B, 1): next real position
    cache = _step_cache(model, kind, B, total, page_size)

    def step(seq, n):
        nonlocal next_pos
        if seq is None and compression[0] is not None:  # prefill, then compress
            return compress_prefill(model, input_ids, cache, *compression)
        if seq is None:  # prefill
            m = None if mask is None else mask[:, :S]
            return model(input_ids, attention_mask=m, cache=cache, logits_to_keep=1)
        if cache is None:  # recompute everything: positions follow from the mask
            m = None if mask is None else mask[:, :n]
            return model(seq, attention_mask=m, logits_to_keep=1)
        if mask is None:
            return model(seq[:, -1:], cache=cache)
        pos = next_pos
        next_pos = next_pos + 1
        return model(seq[:, -1:], attention_mask=mask[:, :n], cache=cache, position_ids=pos)

    return step, input_ids


def _seq2seq_steps(model, input_ids, attention_mask, kind, max_new: int, page_size: int):
    """``step`` and the decoder prefix ``[decoder_start_token_id]`` for an encoder-decoder."""
    start = getattr(model, "decoder_start_token_id", None)
    if start is None:
        raise ValueError(
            f"{type(model).__name__} has no decoder_start_token_id; set it on the model before "
            "generating"
        )
    B = input_ids.shape[0]
    memory = model.encode(input_ids, attention_mask=attention_mask)  # once: (B, Se, d_model)
    prefix = torch.full((B, 1), start, dtype=input_ids.dtype, device=input_ids.device)
    cache = _step_cache(model, kind, B, 1 + max_new, page_size)

    def step(seq, n):
        dec = prefix if seq is None else seq if cache is None else seq[:, -1:]
        return model.decode(dec, memory, encoder_attention_mask=attention_mask, cache=cache)

    return step, prefix


def _speculation(model, lookup_k, ngram_max, draft, draft_k):
    """``generate``'s speculative options checked -> ``(k, ngram_max, draft model or None)``,
    or None without speculation."""
    if lookup_k is None and draft is None:
        for name, value in (("max_matching_ngram_size", ngram_max),
                            ("num_assistant_tokens", draft_k)):  # fmt: skip
            if value is not None:
                raise ValueError(
                    f"{name}={value!r} needs speculation: give prompt_lookup_num_tokens= or "
                    "assistant_model="
                )
        return None
    if lookup_k is not None and draft is not None:
        raise ValueError(
            "give prompt_lookup_num_tokens= (drafts from the text) or assistant_model= (drafts "
            "from a model), not both"
        )
    if getattr(model, "is_encoder_decoder", False) or not isinstance(model, CausalLM):
        raise ValueError(
            f"speculative decoding runs decoder-only causal LMs over a paged cache, not "
            f"{type(model).__name__}; drop prompt_lookup_num_tokens / assistant_model"
        )
    if draft is None:
        if draft_k is not None:
            raise ValueError("num_assistant_tokens is for assistant_model=; drop it")
        int_at_least(lookup_k, "prompt_lookup_num_tokens", 1)
        ngram_max = spec.DEFAULT_NGRAM_MAX if ngram_max is None else ngram_max
        spec.check_ngram_sizes(spec.DEFAULT_NGRAM_MIN, ngram_max)
        return lookup_k, ngram_max, None
    if ngram_max is not None:
        raise ValueError("max_matching_ngram_size is for prompt_lookup_num_tokens=; drop it")
    spec.check_draft_model(model, draft)
    k = spec.DEFAULT_NUM_SPECULATIVE_TOKENS if draft_k is None else draft_k
    int_at_least(k, "num_assistant_tokens", 1)
    return k, None, draft


def _speculative_loop(model, input_ids, attention_mask, max_new, eos, pad_token_id, pick, put,
                      speculation, page_size):  # fmt: skip
    """``generate`` with speculation: each row's real tokens as one sequence of a paged cache;
    per round, drafts for every unfinished row, one packed forward of ``1 + k`` tokens per row,
    the acceptance rule per row, the rejected tokens rolled back. Returns ``out`` as the plain
    loop does (rows finished early padded)."""
    k, ngram_max, draft_model = speculation
    B, S = input_ids.shape
    if attention_mask is None:
        rows = input_ids.tolist()
    else:
        keep = attention_mask.bool()
        rows = [input_ids[b][keep[b]].tolist() for b in range(B)]
    room = S + max_new + k + 1
    target = spec.PagedRunner(model, max_seqs=B, max_len=room, page_size=page_size)
    drafter = None
    if draft_model is not None:
        drafter = spec.PagedRunner(draft_model, max_seqs=B, max_len=room, page_size=page_size)
    sampling = {n: pick[n] for n in ("temperature", "top_k", "top_p")}
    gen, greedy = pick["generator"], not pick["do_sample"]

    def pick_draft(logits, _rows):
        if greedy:
            return logits.argmax(-1).tolist(), None
        q = token_probs(logits, **sampling)
        return torch.multinomial(q, 1, generator=gen).view(-1).tolist(), q

    first = next_token(torch.cat(target.forward(range(B), rows)), **pick).tolist()
    new = [[] for _ in range(B)]
    done = [False] * B
    for b in range(B):
        done[b] = _extend(new[b], [first[b]], eos, max_new)
    streamed = _stream(put, new, done, 0, pad_token_id, input_ids)
    while not all(done):
        live = [b for b in range(B) if not done[b]]
        ctx = [rows[b] + new[b] for b in live]
        ks = [min(k, max_new - len(new[b]) - 1) for b in live]
        if drafter is None:
            drafts = [spec.propose_ngram(c, n, ngram_max) if n else [] for c, n in zip(ctx, ks)]
            qs = [None] * len(live)
        else:
            drafts, qs = drafter.draft(live, ctx, ks, pick_draft)
        chunks = [[c[-1], *d] for c, d in zip(ctx, drafts)]
        logits = target.forward(live, chunks, keep_all=[True] * len(live))
        for i, b in enumerate(live):
            if greedy:
                emitted = spec.accept_greedy(logits[i].argmax(-1).tolist(), drafts[i])
            else:
                p = token_probs(logits[i], **sampling)
                emitted = spec.accept(p, drafts[i], qs[i], gen)
            kept = len(ctx[i]) + len(emitted) - 1  # the context and the accepted drafts
            target.trim(b, kept)
            if drafter is not None:
                drafter.trim(b, kept)
            done[b] = _extend(new[b], emitted, eos, max_new)
        streamed = _stream(put, new, done, streamed, pad_token_id, input_ids)
    n = max(len(t) for t in new)
    out = input_ids.new_full((B, S + n), pad_token_id)
    out[:, :S] = input_ids
    for b, t in enumerate(new):
        out[b, S : S + len(t)] = torch.tensor(t, dtype=out.dtype)
    return out


def _extend(new: list[int], emitted: list[int], eos, max_new: int) -> bool:
    """Append ``emitted`` to a row's ``new`` tokens up to a stop token or ``max_new``; returns
    whether the row is finished."""
    for t in emitted:
        new.append(t)
        if t in eos or len(new) >= max_new:
            return True
    return False


def _stream(put, new, done, streamed: int, pad_token_id, like) -> int:
    """Hand ``put`` each step's ``(B,)`` tokens that every row now knows (finished rows pad);
    returns the steps streamed so far."""
    if put is None:
        return streamed
    known = [len(t) for t, d in zip(new, done) if not d]
    ready = min(known) if known else max(len(t) for t in new)
    for j in range(streamed, ready):
        put(torch.tensor([t[j] if j < len(t) else pad_token_id for t in new], dtype=like.dtype))
    return max(ready, streamed)
