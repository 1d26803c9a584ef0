"""selfattn.models.generate against transformers' generate(), through every cache kind.

Tiny perturbed models of each family (built by test_models_decoder.tiny_pair) generate from
left-padded prompts; greedy tokens must equal transformers' token for token, with our static,
window and paged caches and without a cache. Sampling with the same torch seed draws the same
tokens as transformers' sampling (the same filters, the same multinomial draws).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.models.generate import generate, next_token  # noqa: E402
from tests.models.test_models_decoder import VOCAB, left_padded, tiny_pair  # noqa: E402

NEW = 9  # new tokens per run: past the windows of 5, so ring buffers wrap


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """family -> (ours, prompt ids, mask, transformers' greedy output); built once."""
    out = {}
    for seed, family in enumerate(["gpt2", "llama", "mistral", "qwen2", "gemma2"]):
        hf, ours = tiny_pair(family, tmp_path_factory.mktemp(family), seed=seed)
        ids, mask = left_padded(3, 6, [3, 0, 1], seed=10 + seed)
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        out[family] = SimpleNamespace(hf=hf, ours=ours, ids=ids, mask=mask, ref=ref)
    return out


@pytest.mark.parametrize("cache", ["auto", "static", "window", "paged", None])
@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "gemma2"])
def test_greedy_equals_transformers(runs, family, cache):
    r = runs[family]
    got = generate(r.ours, r.ids, NEW, attention_mask=r.mask, cache=cache, page_size=4)
    assert got.shape == (3, 6 + NEW)
    assert torch.equal(got, r.ref)


def test_unpadded_batch_equals_transformers(runs):
    """No padding: the mask is dropped and plain causal attention runs."""
    r = runs["mistral"]
    ids = r.ids[1:2]
    ref = r.hf.generate(ids, max_new_tokens=NEW, do_sample=False)
    for cache in ("auto", "static", "window", None):
        assert torch.equal(generate(r.ours, ids, NEW, cache=cache), ref)


@pytest.mark.parametrize(
    "family, padded, want",
    [("llama", False, "paged"), ("llama", True, "static"), ("gpt2", False, "static")],
)
def test_auto_cache_is_paged_where_the_fast_path_runs(runs, family, padded, want, monkeypatch):
    """``cache="auto"`` (the default) plans a paged cache for a model whose blocks are all the
    plain Llama layout and rows without padding (its decode steps take the fast path), else a
    static one (GPT-2's LayerNorm blocks; a padded batch)."""
    gen = importlib.import_module("selfattn.models.generate")  # the package exports the function

    r = runs[family]
    kinds = []
    steps = gen._decoder_steps
    monkeypatch.setattr(
        gen,
        "_decoder_steps",
        lambda m, i, a, kind, *rest: kinds.append(kind) or steps(m, i, a, kind, *rest),
    )
    ids, mask = (r.ids, r.mask) if padded else (r.ids[1:2], None)
    generate(r.ours, ids, 2, attention_mask=mask)
    assert kinds == [want]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"temperature": 0.7},
        {"top_k": 5},
        {"top_p": 0.6},
        {"temperature": 1.3, "top_k": 20, "top_p": 0.9},
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "plain",
)
def test_sampling_equals_transformers_for_one_seed(runs, kw):
    """Same filters in the same order and one multinomial draw per step: transformers and we
    draw the same tokens from the same global seed (top_k=0 disables its default of 50)."""
    r = runs["llama"]
    torch.manual_seed(123)
    ref = r.hf.generate(
        r.ids, attention_mask=r.mask, max_new_tokens=NEW, do_sample=True, **{"top_k": 0, **kw}
    )
    torch.manual_seed(123)
    got = generate(r.ours, r.ids, NEW, attention_mask=r.mask, do_sample=True, **kw)
    assert torch.equal(got, ref)


def test_eos_stops_rows_and_pads_them_like_transformers(runs):
    r = runs["qwen2"]
    eos = [int(r.ref[0, 6 + 2]), 3]  # row 0 emits its first eos at step 2
    ref = r.hf.generate(
        r.ids,
        attention_mask=r.mask,
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    for cache in ("static", None):
        got = generate(
            r.ours, r.ids, NEW, attention_mask=r.mask, cache=cache, eos_token_id=eos, pad_token_id=0
        )
        assert torch.equal(got, ref)
    assert (got[0, 6 + 3 :] == 0).all()


def test_all_rows_finished_stops_early(runs):
    r = runs["llama"]
    first = r.ref[:, 6]
    got = generate(r.ours, r.ids, NEW, attention_mask=r.mask, eos_token_id=first.tolist())
    assert got.shape == (3, 7)  # every row emitted an eos at step 0
    assert torch.equal(got, r.ref[:, :7])


def test_streamer_sees_each_step(runs):
    r = runs["gemma2"]
    steps = []
    got = generate(r.ours, r.ids, NEW, attention_mask=r.mask, streamer=steps.append)
    assert len(steps) == NEW and all(s.shape == (3,) for s in steps)
    assert torch.equal(torch.stack(steps, 1), got[:, 6:])


class Recorder:
    """A streamer with transformers' put/end protocol that keeps what it is given."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        assert self.ends == 0, "put after end"
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_put_end_streamer_is_called_as_transformers_calls_it(runs):
    """The prompt first (B, S), then each step's tokens (B,), then end(): the same calls, with
    the same tensors, as transformers' generate makes on the same prompt."""
    r = runs["llama"]
    theirs, ours = Recorder(), Recorder()
    r.hf.generate(
        r.ids, attention_mask=r.mask, max_new_tokens=NEW, do_sample=False, streamer=theirs
    )
    got = generate(r.ours, r.ids, NEW, attention_mask=r.mask, streamer=ours)
    assert ours.ends == theirs.ends == 1
    assert [tuple(p.shape) for p in ours.puts] == [tuple(p.shape) for p in theirs.puts]
    assert all(torch.equal(a, b) for a, b in zip(ours.puts, theirs.puts))
    assert ours.puts[0].shape == r.ids.shape and len(ours.puts) == 1 + NEW
    assert torch.equal(torch.cat([ours.puts[0]] + [p[:, None] for p in ours.puts[1:]], 1), got)


def word_tokenizer(folder):
    """A WordLevel tokenizer over the tiny models' VOCAB ids ("w0" .. "w127", id 1 = </s>),
    saved by transformers and read back by load_tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from selfattn.models import load_tokenizer

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["</s>"] = vocab.pop("w1")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    hf.save_pretrained(folder)
    return load_tokenizer(folder)


def test_text_in_text_out_and_textstreamer(runs, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    r = runs["qwen2"]
    tok = word_tokenizer(tmp_path)
    prompts = ["w5 w9 w17", "w3 w4 w5 w6 w7"]
    batch = tok(prompts)
    ids = generate(r.ours, batch["input_ids"], NEW, attention_mask=batch["attention_mask"])
    want = [
        tok.decode(row, skip_special_tokens=True) for row in ids[:, batch["input_ids"].shape[1] :]
    ]
    assert generate(r.ours, prompts, NEW, tokenizer=tok) == want
    # transformers' TextStreamer decodes with our tokenizer and prints the same continuation
    streamer = transformers.TextStreamer(tok, skip_prompt=True)
    assert generate(r.ours, prompts[0], NEW, tokenizer=tok, streamer=streamer) == want[0]
    assert capsys.readouterr().out.strip() == want[0].strip()
    with pytest.raises(TypeError, match="a text prompt needs tokenizer="):
        generate(r.ours, "w5 w6", NEW)


def test_seeded_generator_is_reproducible(runs):
    r = runs["gpt2"]

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(
            r.ours, r.ids, NEW, attention_mask=r.mask, do_sample=True, top_p=0.95, generator=g
        )

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))
    g = torch.Generator().manual_seed(1)
    greedy_like = generate(
        r.ours, r.ids, NEW, attention_mask=r.mask, do_sample=True, top_k=1, generator=g
    )
    assert torch.equal(greedy_like, r.ref)


def test_zero_new_tokens_returns_the_prompt(runs):
    r = runs["llama"]
    assert torch.equal(generate(r.ours, r.ids, 0, attention_mask=r.mask), r.ids)


# -- next_token filters ----------------------------------------------------------------------------


def _draw(logits, n, **kw):
    g = torch.Generator().manual_seed(0)
    rows = logits.expand(n, -1)
    return next_token(rows, do_sample=True, generator=g, **kw)


def test_top_p_keeps_the_smallest_set_reaching_p():
    """probs (.5, .3, .15, .05), top_p=.8: {0, 1} reach .8; renormalised .625 / .375."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()[:, [2, 0, 3, 1]]  # shuffled vocab
    tokens = _draw(logits, 4000, top_p=0.8)
    assert set(tokens.tolist()) == {1, 3}
    share = float((tokens == 1).float().mean())
    assert abs(share - 0.625) < 5 * (0.625 * 0.375 / 4000) ** 0.5


def test_top_k_and_temperature():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 50, generator=g)
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(_draw(logits, 2000, top_k=3).tolist()) == top3
    # temperature -> 0 concentrates on the argmax; a high one spreads over the vocabulary
    assert set(_draw(logits, 200, temperature=1e-3).tolist()) == {int(logits.argmax())}
    assert len(set(_draw(logits, 2000, temperature=100.0).tolist())) > 40


# -- encoder-decoder protocol ---------------------------------------------------------------------


class _StubSeq2Seq(torch.nn.Module):
    """Logits depend on the current decoder token and the memory only: cached == uncached."""

    is_encoder_decoder = True
    decoder_start_token_id = 5

    def __init__(self, vocab: int = 11):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(vocab, vocab, generator=g)
        self.encoded, self.decoded = 0, []

    def encode(self, input_ids, attention_mask=None):
        self.encoded += 1
        m = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return (input_ids * m).float()[..., None]  # (B, Se) -> (B, Se, 1)

    def make_cache(self, kind, batch, max_len, *, dtype=None, page_size=16):
        return SimpleNamespace(kind=kind, length=0)

    def decode(self, ids, memory, *, encoder_attention_mask=None, cache=None):
        self.decoded.append(ids.shape[1])
        if cache is not None:
            cache.length += ids.shape[1]
        shift = memory.sum((1, 2)).long()[:, None] % self.table.shape[0]  # (B, 1)
        return self.table[(ids + shift) % self.table.shape[0]]  # (B, S) -> (B, S, vocab)


def test_seq2seq_encodes_once_and_decodes_from_the_start_token():
    ids = torch.tensor([[0, 3, 4, 2], [7, 1, 2, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    results = {}
    for cache in ("static", None):
        model = _StubSeq2Seq()
        results[cache] = generate(model, ids, 6, attention_mask=mask, cache=cache)
        assert model.encoded == 1
        expected = [1] * 6 if cache else list(range(1, 7))  # tokens fed per decode call
        assert model.decoded == expected
    out = results["static"]
    assert out.shape == (2, 7) and (out[:, 0] == 5).all()
    assert torch.equal(out, results[None])
    # each step is the argmax of the stub's logits for the previous token
    model = _StubSeq2Seq()
    memory = model.encode(ids, mask)
    for t in range(6):
        want = model.decode(out[:, t : t + 1], memory)[:, -1].argmax(-1)
        assert torch.equal(out[:, t + 1], want)


def test_seq2seq_needs_a_start_token():
    model = _StubSeq2Seq()
    model.decoder_start_token_id = None
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        generate(model, torch.ones(1, 3, dtype=torch.long), 2)


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"cache": "ring"}, ValueError, "cache must be one of .* got 'ring'"),
        ({"temperature": 0.0, "do_sample": True}, ValueError, "temperature must be > 0, got 0.0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be a number in \(0, 1\], got 1.5"),
        ({"top_k": 0}, ValueError, "top_k must be an int >= 1, got 0"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be an int >= 0, got -1"),
        (
            {"streamer": 3},
            TypeError,
            r"streamer must have put\(tokens\) and end\(\).* or be callable",
        ),
        ({"eos_token_id": [1, "x"]}, ValueError, "eos_token_id token id must be an int >= 0"),
        ({"do_sample": 1}, TypeError, "do_sample must be a bool"),
        ({"attention_mask": torch.ones(2, 4)}, ValueError, r"attention_mask must match .*\(2, 4\)"),
    ],
)
def test_bad_arguments_raise(runs, kw, exc, match):
    r = runs["llama"]
    kw = {"max_new_tokens": 2, **kw}
    with pytest.raises(exc, match=match):
        generate(r.ours, r.ids, **kw)


def test_bad_input_ids_raise(runs):
    ours = runs["llama"].ours
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, S\) int tensor"):
        generate(ours, torch.ones(4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="at least one integer token"):
        generate(ours, torch.ones(2, 3), 2)
    assert VOCAB == ours.config.vocab_size


# -- where generation stops by default, and the checkpoint's generation defaults ------------------


@pytest.fixture
def stops(runs):
    """The llama run's model with its generation config and eos set by each test (restored)."""
    r = runs["llama"]
    saved = r.ours.generation_config, r.ours.eos_token_id
    yield r
    r.ours.generation_config, r.ours.eos_token_id = saved


def _row0_token(r, step: int) -> int:
    """Row 0's greedy token at ``step`` (without any stop token)."""
    out = generate(r.ours, r.ids[:1], step + 1, attention_mask=r.mask[:1], ignore_eos=True)
    return int(out[0, -1])


def test_token_ids_stop_at_the_models_eos_list_by_default(stops):
    r = stops
    first, third = _row0_token(r, 0), _row0_token(r, 2)
    r.ours.generation_config = {}
    r.ours.eos_token_id = (VOCAB - 1, third)  # any id of a list stops
    got = generate(r.ours, r.ids[:1], NEW, attention_mask=r.mask[:1])
    assert got.shape[1] <= 6 + 3 and int(got[0, -1]) in (VOCAB - 1, third)
    # the generation config's eos wins over the model's, as in transformers
    r.ours.generation_config = {"eos_token_id": [first]}
    assert generate(r.ours, r.ids[:1], NEW, attention_mask=r.mask[:1]).shape[1] == 6 + 1
    # ignore_eos runs on to max_new_tokens
    assert generate(r.ours, r.ids[:1], NEW, ignore_eos=True).shape[1] == 6 + NEW
    # a generation config naming no eos stops nowhere
    r.ours.generation_config = {"eos_token_id": None}
    assert generate(r.ours, r.ids[:1], NEW, attention_mask=r.mask[:1]).shape[1] == 6 + NEW


def test_a_tokenizers_stop_tokens_end_token_id_input_too(stops):
    """A chat template's end-of-turn token (the tokenizer's ``stop_token_ids``) stops
    generation on token ids when the tokenizer is given."""
    from types import SimpleNamespace

    from selfattn.models.generate import stop_token_ids

    r = stops
    r.ours.generation_config = {"eos_token_id": None}
    eot = _row0_token(r, 1)
    tok = SimpleNamespace(stop_token_ids=[eot], eos_token_id=None)
    assert stop_token_ids(r.ours, tok) == (eot,)
    got = generate(r.ours, r.ids[:1], NEW, attention_mask=r.mask[:1], tokenizer=tok)
    assert got.shape[1] == 6 + 2 and int(got[0, -1]) == eot
    # without stop_token_ids: the tokenizer's eos
    assert stop_token_ids(r.ours, SimpleNamespace(eos_token_id=5)) == (5,)


def test_generation_config_supplies_the_defaults(stops):
    r = stops
    ids = r.ids[1:2]
    r.ours.generation_config = {"eos_token_id": None, "max_new_tokens": 3}
    assert generate(r.ours, ids).shape[1] == 6 + 3
    r.ours.generation_config = {"eos_token_id": None, "max_length": 8}
    assert generate(r.ours, ids).shape[1] == 8
    # do_sample and its values from the config: the same draws as passing them
    r.ours.generation_config = {"eos_token_id": None, "do_sample": True, "temperature": 0.7,
                                "top_k": 5}  # fmt: skip
    a = generate(r.ours, ids, 6, generator=torch.Generator().manual_seed(3))
    r.ours.generation_config = {"eos_token_id": None}
    b = generate(r.ours, ids, 6, do_sample=True, temperature=0.7, top_k=5,
                 generator=torch.Generator().manual_seed(3))  # fmt: skip
    assert torch.equal(a, b)
    # the call's own values win
    r.ours.generation_config = {"eos_token_id": None, "do_sample": True, "max_new_tokens": 3}
    greedy = generate(r.ours, ids, 5, do_sample=False)
    r.ours.generation_config = {"eos_token_id": None}
    assert torch.equal(greedy, generate(r.ours, ids, 5))


def test_from_pretrained_reads_generation_config_json(tmp_path):
    import json

    from selfattn.models.hub import read_generation_config

    assert read_generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": None, "transformers_version": "5"}
        )
    )
    assert read_generation_config(tmp_path) == {"eos_token_id": [2, 7], "temperature": 0.6}
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert read_generation_config(tmp_path) == {"bos_token_id": 1, "eos_token_id": None}


def test_ignore_eos_must_be_a_bool(runs):
    with pytest.raises(TypeError, match="ignore_eos must be a bool"):
        generate(runs["llama"].ours, runs["llama"].ids, 2, ignore_eos=1)
