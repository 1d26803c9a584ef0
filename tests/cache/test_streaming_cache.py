"""StreamingCache: StreamingLLM's sinks plus a rolling window, at slot ("cache") and text
("absolute") RoPE positions, against full forwards with the equivalent mask (float64 oracle,
ratio rule)."""

from __future__ import annotations

import copy

import pytest
import torch

from selfattn import masks
from selfattn.cache import StreamingCache
from selfattn.models.decoder import DecoderConfig, Llama
from selfattn.positions import DynamicNTK, RoPE, YaRN
from selfattn.testing import assert_close_to_reference

VOCAB, N_SINK, WINDOW = 37, 3, 5
PREFILL, TOTAL = 7, 23  # past n_sink + window: the ring wraps and tokens are evicted


def tiny_llama(seed: int, n_layers: int = 2) -> Llama:
    torch.manual_seed(seed)
    cfg = DecoderConfig(
        vocab_size=VOCAB, d_model=24, n_layers=n_layers, n_heads=4, n_kv_heads=2, d_ff=40
    )
    return Llama(cfg).eval()


def streamed(model, ids, **kw) -> torch.Tensor:
    """Logits of a prefill of PREFILL tokens, then one token a step, with a streaming cache."""
    cache = model.make_cache("streaming", ids.shape[0], n_sink=N_SINK, window=WINDOW, **kw)
    out = [model(ids[:, :PREFILL], cache=cache)]
    out += [model(ids[:, t : t + 1], cache=cache) for t in range(PREFILL, ids.shape[1])]
    return torch.cat(out, 1)


def masked_forward(model, ids, mask, positions) -> torch.Tensor:
    """The model's full forward under ``mask`` (ANDed with causal by the blocks)."""
    h = model.embed(ids)
    for block in model.layers:
        h = block(h, mask=mask, positions=positions)
    return model.lm_head(model.norm(h))


@torch.no_grad()
def test_absolute_positions_equal_full_forward_with_sink_window_mask():
    """Every layer's keys at text positions: the cache decode is the full forward whose mask
    lets each query see the first N_SINK keys and its WINDOW (oracle in float64)."""
    model = tiny_llama(seed=1)
    ids = torch.randint(0, VOCAB, (2, TOTAL), generator=torch.Generator().manual_seed(11))
    actual = streamed(model, ids, positions="absolute")
    mask = masks.padding(N_SINK) | masks.sliding_window(WINDOW)
    pos = torch.arange(TOTAL)
    naive = masked_forward(model, ids, mask, pos)
    oracle = masked_forward(copy.deepcopy(model).double(), ids, mask, pos)
    assert_close_to_reference(actual, oracle, naive)
    # the sinks matter: plain windowing differs
    windowed = masked_forward(model, ids, masks.sliding_window(WINDOW), pos)
    assert not torch.allclose(naive, windowed)


@torch.no_grad()
def test_cache_positions_equal_forward_over_kept_tokens_at_slot_positions():
    """The paper's positions: a one-layer model's decode step at text position t equals a full
    forward over the tokens the cache keeps (sinks, then the window), at positions 0..n-1 (the
    slots), the query last. (With more layers the cached K/V also remember the contexts they
    were made in, so one layer is the exact statement.)"""
    model = tiny_llama(seed=2, n_layers=1)
    ids = torch.randint(0, VOCAB, (2, TOTAL), generator=torch.Generator().manual_seed(12))
    actual = streamed(model, ids, positions="cache")[:, PREFILL:]
    oracle64 = copy.deepcopy(model).double()
    rows_naive, rows_oracle = [], []
    for t in range(PREFILL, TOTAL):
        kept = [*range(N_SINK), *range(max(N_SINK, t - WINDOW + 1), t + 1)]
        sub, pos = ids[:, kept], torch.arange(len(kept))
        rows_naive.append(masked_forward(model, sub, None, pos)[:, -1:])
        rows_oracle.append(masked_forward(oracle64, sub, None, pos)[:, -1:])
    assert_close_to_reference(actual, torch.cat(rows_oracle, 1), torch.cat(rows_naive, 1))
    # and the slot positions are not the text positions
    assert not torch.allclose(actual, streamed(model, ids, positions="absolute")[:, PREFILL:])


ROPES = {
    "half": lambda: RoPE(8),
    "interleaved-partial": lambda: RoPE(8, interleaved=True, rotary_dim=6),
    "yarn": lambda: RoPE(8, scaling=YaRN(factor=4.0, original_max_position=16)),
}


@pytest.mark.parametrize("rope_kind", list(ROPES))
def test_rerotated_keys_equal_explicit_rotation_at_slots(rope_kind):
    """Keys handed over rotated at next_positions come back rotated at their current slots:
    exactly rope(raw keys of the kept tokens, arange(n)), whatever the layout and the YaRN
    attention factor, step after step as the window slides."""
    rope = ROPES[rope_kind]()
    g = torch.Generator().manual_seed(3)
    B, H, D = 2, 3, 8
    cache = StreamingCache(B, N_SINK, WINDOW, H, D, rope=rope, dtype=torch.float64)
    raw = torch.randn(B, H, TOTAL, D, generator=g, dtype=torch.float64)
    vals = torch.randn(B, H, TOTAL, D, generator=g, dtype=torch.float64)
    steps = [(0, PREFILL), *((t, t + 1) for t in range(PREFILL, TOTAL))]
    for a, b in steps:
        pos = cache.next_positions(b - a)
        kv = cache.update(rope(raw[:, :, a:b], pos), vals[:, :, a:b], positions=pos)
        kept = [*range(min(b, N_SINK)), *range(max(N_SINK, a - WINDOW + 1), b)]
        slots = torch.arange(len(kept))
        torch.testing.assert_close(kv[0], rope(raw[:, :, kept], slots), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(kv[1], vals[:, :, kept], rtol=0, atol=0)
        assert torch.equal(kv.positions, slots)
        assert torch.equal(pos, slots[-(b - a) :])  # the queries sit at the last slots


def test_absolute_mode_reports_text_positions_and_stays_bounded():
    """Memory is n_sink + window tokens however many steps: the storage tensors never grow and
    each step returns at most n_sink + window keys, labelled with their text positions."""
    B, H, D, steps = 1, 2, 4, 300
    cache = StreamingCache(B, N_SINK, WINDOW, H, D, positions="absolute")
    sizes = [t.shape for t in (cache.sinks.k, cache.sinks.v, cache.ring.k, cache.ring.v)]
    x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(4))
    for _ in range(steps):
        kv = cache.update(x, x)
    assert [t.shape for t in (cache.sinks.k, cache.sinks.v, cache.ring.k, cache.ring.v)] == sizes
    assert kv[0].shape[2] == N_SINK + WINDOW == cache.capacity
    want = [*range(N_SINK), *range(steps - WINDOW, steps)]
    assert kv.positions.tolist() == want and cache.length == steps


@torch.no_grad()
def test_model_cache_memory_is_flat_in_generated_length():
    model = tiny_llama(seed=5)
    cache = model.make_cache("streaming", 1, n_sink=2, window=4)
    before = cache.memory_bytes
    ids = torch.randint(0, VOCAB, (1, 1), generator=torch.Generator().manual_seed(5))
    for _ in range(40):
        model(ids, cache=cache)
    assert cache.memory_bytes == before and cache.length == 40
    assert cache.plan(1).positions.tolist() == [2 + 4 - 1]  # the query at the cache length


def test_zero_sinks_is_plain_windowing():
    cache = StreamingCache(1, 0, 4, 1, 2, positions="absolute")
    kv = None
    for _ in range(9):
        kv = cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    assert cache.sinks is None and kv.positions.tolist() == [5, 6, 7, 8]


@torch.no_grad()
def test_bad_uses_raise_clear_errors():
    model = tiny_llama(seed=6)
    with pytest.raises(ValueError, match="needs window="):
        model.make_cache("streaming", 1)
    with pytest.raises(ValueError, match="StreamingCache positions"):
        model.make_cache("streaming", 1, window=4, positions="text")
    with pytest.raises(ValueError, match="needs max_len"):
        model.make_cache("static", 1)
    with pytest.raises(ValueError, match="they are for 'streaming'"):
        model.make_cache("window", 1, 16, window=8)  # not silently ignored
    cache = model.make_cache("streaming", 2, window=4)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="takes no other"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), cache=cache)
    layer = StreamingCache(1, 2, 4, 1, 2)
    with pytest.raises(ValueError, match="appends only"):
        layer.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), positions=[5])
    with pytest.raises(ValueError, match="length-dependent"):
        StreamingCache(1, 2, 4, 1, 8, rope=RoPE(8, scaling=DynamicNTK(2.0, 16)))
    with pytest.raises(ValueError, match="n_sink"):
        StreamingCache(1, -1, 4, 1, 2)
    only_windows = ("sliding_attention",)
    cfg = DecoderConfig(9, 8, 1, 2, 8, sliding_window=3, layer_types=only_windows)
    windowed = Llama(cfg)
    with pytest.raises(ValueError, match="sliding-window layers"):
        windowed.make_cache("streaming", 1, window=4)


# -- paged pages: sink pages pinned, passed window pages back to the pool ------------------------


@pytest.mark.parametrize("page_size", [2, 4])
@torch.no_grad()
def test_paged_equals_full_forward_and_frees_passed_pages(page_size):
    """The paged streaming cache (text positions) decodes what the full forward with the
    sink/window mask computes; after every step the pool's accounting holds (PagedKV.check),
    a sequence never holds more than its pinned + window pages, and freeing it returns them
    all."""
    model = tiny_llama(seed=7)
    ids = torch.randint(0, VOCAB, (2, TOTAL), generator=torch.Generator().manual_seed(17))
    view = model.make_cache(
        "streaming", 2, PREFILL, n_sink=N_SINK, window=WINDOW, positions="absolute", paged=True,
        page_size=page_size,
    )  # fmt: skip
    kv = view.cache
    out = [model(ids[:, :PREFILL], cache=view)]
    held = []
    for t in range(PREFILL, TOTAL):
        out.append(model(ids[:, t : t + 1], cache=view))
        kv.check()
        held.append(len(kv.pages(view.seq_ids[0])))
    mask = masks.padding(N_SINK) | masks.sliding_window(WINDOW)
    pos = torch.arange(TOTAL)
    naive = masked_forward(model, ids, mask, pos)
    oracle = masked_forward(copy.deepcopy(model).double(), ids, mask, pos)
    assert_close_to_reference(torch.cat(out, 1), oracle, naive)
    assert view.length == TOTAL and kv.dropped(view.seq_ids[0]) > 0  # pages were freed
    bound = kv.sink_pages + -(-(WINDOW + 1) // page_size) + 1
    assert max(held[-5:]) <= bound
    for s in view.seq_ids:
        kv.free(s)
    kv.check()
    assert kv.pool.num_free == kv.num_pages  # no leak


def test_paged_fork_shares_and_frees_pages_once():
    """A forked streaming sequence shares its pages; each holder drops them on its own, and a
    page returns to the pool only when its last holder lets go."""
    kv = sa_streaming_paged(page_size=2)
    a = kv.add_sequence()
    kv.plan([a], 6)
    b = kv.fork(a)
    for _ in range(12):
        kv.plan([a, b], 1)
        kv.check()
    assert kv.dropped(a) == kv.dropped(b) > 0
    kv.free(a)
    kv.check()
    kv.free(b)
    kv.check()
    assert kv.pool.num_free == kv.num_pages


def sa_streaming_paged(page_size: int):
    from selfattn.cache import StreamingPagedKV

    pages = StreamingPagedKV.pages_needed(N_SINK, WINDOW, page_size, 6)
    return StreamingPagedKV(
        1, 2 * pages, page_size, 1, 2, n_sink=N_SINK, window=WINDOW, max_seqs=2,
        max_pages_per_seq=pages,
    )  # fmt: skip


@torch.no_grad()
def test_paged_bad_uses_raise():
    model = tiny_llama(seed=8)
    slots = model.make_cache("streaming", 1, n_sink=2, window=4, paged=True)
    with pytest.raises(TypeError, match="cannot fork"):
        slots.cache.fork(slots.seq_ids[0])
    view = model.make_cache("streaming", 2, n_sink=2, window=4, paged=True, positions="absolute")
    with pytest.raises(ValueError, match="takes no other"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[0, 1, 1], [1, 1, 1]]), cache=view)
    view.cache.check()
    assert view.length == 0  # the failed step was undone
    with pytest.raises(TypeError, match="no prefix caching"):
        view.cache.add_sequence_from_prefix([1, 2, 3])


@torch.no_grad()
def test_paged_ragged_batch_matches_each_sequence_alone():
    """Two sequences of different lengths (so different dropped pages) decoded in one batch:
    each row equals that sequence decoded alone, RoPE at its own text positions."""
    model = tiny_llama(seed=9)
    g = torch.Generator().manual_seed(19)
    ids = torch.randint(0, VOCAB, (2, TOTAL), generator=g)
    kw = dict(n_sink=N_SINK, window=WINDOW, positions="absolute", paged=True, page_size=2)
    view = model.make_cache("streaming", 2, TOTAL, **kw)
    kv, (a, b) = view.cache, view.seq_ids
    model(ids[:1, :PREFILL], cache=kv.view([a]))  # a is PREFILL - 2 tokens ahead of b
    model(ids[1:, :2], cache=kv.view([b]))
    rows = []
    for t in range(8):  # both rows in one batch, each at its own length
        step = torch.stack([ids[0, PREFILL + t], ids[1, 2 + t]])[:, None]
        rows.append(model(step, cache=view))
    kv.check()
    assert kv.dropped(a) != kv.dropped(b)
    for r, (row_ids, start) in enumerate(((ids[0], PREFILL), (ids[1], 2))):
        alone = model.make_cache("streaming", 1, TOTAL, **kw)
        model(row_ids[None, :start], cache=alone)
        want = torch.cat([model(row_ids[None, start + t : start + t + 1], cache=alone)
                          for t in range(8)], 1)  # fmt: skip
        got = torch.cat([x[r : r + 1] for x in rows], 1)
        torch.testing.assert_close(got, want)


@torch.no_grad()
def test_layer_defaults_to_the_caches_slot_positions():
    """A MultiHeadAttention over a StreamingCache rotates at the cache's next_positions by
    default (slots in "cache" mode), as a model's planned step does: same outputs as passing
    them explicitly, and not the text positions."""
    from selfattn.nn import MultiHeadAttention

    torch.manual_seed(10)
    rope = RoPE(6)
    layer = MultiHeadAttention(24, 4, n_kv_heads=2, rope=rope).eval()
    x = torch.randn(1, TOTAL, 24, generator=torch.Generator().manual_seed(20))
    runs = {}
    for how in ("default", "explicit", "text"):
        cache = StreamingCache(1, N_SINK, WINDOW, 2, 6, rope=rope)
        out = []
        for t in range(TOTAL):
            pos = {"default": None, "explicit": cache.next_positions(1), "text": torch.tensor([t])}
            out.append(layer(x[:, t : t + 1], mask=masks.causal(), cache=cache, positions=pos[how]))
        runs[how] = torch.cat(out, 1)
    torch.testing.assert_close(runs["default"], runs["explicit"], rtol=0, atol=0)
    assert not torch.allclose(runs["default"], runs["text"])


@pytest.mark.parametrize("page_size", [2, 4])
@torch.no_grad()
def test_paged_cache_positions_rerotate_pages_as_they_shift(page_size):
    """positions="cache" over pages: RoPE at the kernel's key index, the window pages'
    keys re-rotated in place each time pages before them are freed. A one-layer model's step
    at text position t equals a full forward over the visible tokens at their kernel indices
    (sinks first, the query last)."""
    model = tiny_llama(seed=11, n_layers=1)
    ids = torch.randint(0, VOCAB, (2, TOTAL), generator=torch.Generator().manual_seed(21))
    kw = dict(n_sink=N_SINK, window=WINDOW, paged=True, page_size=page_size)
    view = model.make_cache("streaming", 2, PREFILL, **kw)
    kv, seq = view.cache, view.seq_ids[0]
    model(ids[:, :PREFILL], cache=view)
    pinned = kv.sink_pages * page_size
    oracle64 = copy.deepcopy(model).double()
    actual, rows_naive, rows_oracle = [], [], []
    for t in range(PREFILL, TOTAL):
        actual.append(model(ids[:, t : t + 1], cache=view))
        kept = [*range(N_SINK), *range(max(N_SINK, t - WINDOW + 1), t + 1)]
        at = torch.tensor([p if p < pinned else p - kv.dropped(seq) for p in kept])
        rows_naive.append(masked_forward(model, ids[:, kept], None, at)[:, -1:])
        rows_oracle.append(masked_forward(oracle64, ids[:, kept], None, at)[:, -1:])
        kv.check()
    assert kv.dropped(seq) > 0
    actual = torch.cat(actual, 1)
    assert_close_to_reference(actual, torch.cat(rows_oracle, 1), torch.cat(rows_naive, 1))


@torch.no_grad()
@pytest.mark.parametrize("paged", [False, True])
def test_diffllama_streaming_cache_holds_its_paired_values(paged):
    """DiffLlama's values are 2·head_dim wide (nn.DiffAttention): the streaming caches hold
    them, and before any eviction decoding equals the full forward."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DiffLlamaConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, num_hidden_layers=2,
    ).to_dict()  # fmt: skip
    torch.manual_seed(7)
    model = Llama.from_config(config).eval()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    full = model(ids)
    cache = model.make_cache("streaming", 1, n_sink=2, window=4, paged=paged)
    steps = [model(ids[:, :3], cache=cache)] + [
        model(ids[:, i : i + 1], cache=cache) for i in (3, 4, 5)
    ]
    assert_close_to_reference(torch.cat(steps, 1), full.double(), full)
