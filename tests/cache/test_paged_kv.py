"""The model-level paged KV (selfattn.cache.PagedKV): one allocator, block table and prefix index
for every layer, planned once per step, inside our decoders.

Tiny random decoders in float64 (so cached and uncached logits agree to ~1e-12): paged == static
== no cache, ragged steps, fork / copy-on-write and prefix hits at model level, atomic failures;
paged_attention planned once per step (PagedAttentionPlan) for every layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import selfattn as sa
from selfattn import masks, scores
from selfattn.backends.paged import plan as paged_plan
from selfattn.backends.paged.call import PagedCall
from selfattn.cache import PagedAttentionPlan, PagedKV, StaticCache, paged_attention
from selfattn.cache.base import InPlaceKVCache
from selfattn.models.decoder import GPT2, Llama

F64 = torch.float64
VOCAB = 61
RTOL = 1e-10  # float64: cached and uncached logits differ by rounding only
CONFIGS = {
    "llama": dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=24, intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    ),
    "mistral": dict(
        model_type="mistral", vocab_size=VOCAB, hidden_size=24, intermediate_size=40,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, sliding_window=5,
    ),
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=24, n_layer=3, n_head=3),
}  # fmt: skip

pytestmark = pytest.mark.usefixtures("single_thread")


def tiny(family: str, seed: int = 0):
    torch.manual_seed(seed)
    cls = GPT2 if family == "gpt2" else Llama
    return cls.from_config(CONFIGS[family]).to(F64).eval()


def kv_for(model, pages: int = 24, P: int = 4, max_seqs: int = 4, **kw) -> PagedKV:
    c = model.config
    return PagedKV(
        c.n_layers, pages, P, c.n_kv_heads, c.head_dim, max_seqs=max_seqs, max_pages_per_seq=8,
        dtype=F64, **kw,
    )  # fmt: skip


def tokens(B: int, S: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def assert_rel(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= RTOL, f"{what}: relative error {err:.3g}"


def snapshot(kv: PagedKV):
    return {s: (kv.pages(s), kv.length(s)) for s in kv.seq_ids}, kv.pool.num_free


@pytest.mark.parametrize("family", list(CONFIGS))
@torch.no_grad()
def test_paged_kv_equals_static_cache_and_full_forward(family):
    """Chunks of 7, 1, 3, 1 tokens through make_cache("paged") (one PagedKV for all layers) and
    through static caches give the full forward's logits."""
    model = tiny(family, seed=1)
    ids = tokens(2, 12, seed=1)
    full = model(ids)
    paged = model.make_cache("paged", 2, 12, page_size=4)
    static = model.make_cache("static", 2, 12)
    assert isinstance(paged.cache, PagedKV) and paged.cache.n_layers == model.config.n_layers
    assert paged.cache.k_store.shape[:3] == (model.config.n_layers, 2 * 3, 4)  # (L, N, P, ...)
    assert all(type(c) is StaticCache for c in static.layers)
    n = 0
    for size in (7, 1, 3, 1):
        chunk = ids[:, n : n + size]
        assert_rel(model(chunk, cache=paged), full[:, n : n + size], f"paged at {n}")
        assert_rel(model(chunk, cache=static), full[:, n : n + size], f"static at {n}")
        n += size
    assert paged.length == static.length == 12
    paged.cache.check()


@torch.no_grad()
def test_one_plan_and_one_block_table_per_step(monkeypatch):
    """The bookkeeping runs once per forward: every layer gets the same planned tensors."""
    model = tiny("llama")
    cache = model.make_cache("paged", 2, 16, page_size=4)
    model(tokens(2, 5, seed=2), cache=cache)
    plans, tables = [], []
    plan, write = PagedKV.plan, PagedKV.write_rows

    def spy_plan(self, *args, **kw):
        plans.append(args)
        return plan(self, *args, **kw)

    def spy_write(self, layer, step, *args):  # every layer writes, on either decoder path
        tables.append((step.block_table, step.seq_lens))
        return write(self, layer, step, *args)

    monkeypatch.setattr(PagedKV, "plan", spy_plan)
    monkeypatch.setattr(PagedKV, "write_rows", spy_write)
    model(tokens(2, 1, seed=3), cache=cache)
    assert len(plans) == 1 and len(tables) == model.config.n_layers
    assert all(t is tables[0][0] and s is tables[0][1] for t, s in tables)
    assert tables[0][1].tolist() == [6, 6]


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
@torch.no_grad()
def test_ragged_step_follows_each_sequence(family):
    """Sequences of one PagedKV at lengths 9 and 4 take a 3-token step together (positions
    (B, S) from the plan): each row equals its sequence run alone without a cache."""
    model = tiny(family, seed=4)
    ids = tokens(2, 12, seed=4)
    kv = kv_for(model)
    a, b = kv.add_sequences(2)
    model(ids[:1, :9], cache=kv.view([a]))
    model(ids[1:, :4], cache=kv.view([b]))
    step = torch.stack([ids[0, 9:12], ids[1, 4:7]])  # (B, 3)
    got = model(step, cache=kv.view([a, b]))
    assert_rel(got[0], model(ids[:1, :12])[0, 9:], "sequence at 9")
    assert_rel(got[1], model(ids[1:, :7])[0, 4:], "sequence at 4")
    assert (kv.length(a), kv.length(b)) == (12, 7)
    kv.check()


@pytest.mark.parametrize("family", ["llama", "mistral"])
@torch.no_grad()
def test_a_long_ragged_step_attends_query_blocks(family, monkeypatch):
    """A step of more than PACKED_ROWS_MAX tokens a sequence (a prefill chunk after earlier
    tokens, ragged) attends each sequence's gathered keys with the dense attention(): every
    layer does, and each row equals its sequence run alone without a cache (a sliding window
    too); the weights asked for come from the same gathered keys."""
    from selfattn.cache.paged import PACKED_ROWS_MAX
    from selfattn.cache.paged import layer as paged_layer

    calls = []
    dense = paged_layer.attention
    monkeypatch.setattr(paged_layer, "attention", lambda *a, **k: calls.append(1) or dense(*a, **k))
    model = tiny(family, seed=6)
    S = PACKED_ROWS_MAX + 3
    ids = tokens(2, 9 + S, seed=6)
    kv = kv_for(model, pages=32, P=8)
    a, b = kv.add_sequences(2)
    model(ids[:1, :9], cache=kv.view([a]))
    model(ids[1:, :2], cache=kv.view([b]))
    step = torch.stack([ids[0, 9 : 9 + S], ids[1, 2 : 2 + S]])
    got = model(step, cache=kv.view([a, b]))
    assert len(calls) == 2 * model.config.n_layers  # two sequences, every layer
    assert_rel(got[0], model(ids[:1, : 9 + S])[0, 9:], "sequence at 9")
    assert_rel(got[1], model(ids[1:, : 2 + S])[0, 2:], "sequence at 2")
    kv.check()
    c = model.config
    q = torch.randn(2, c.n_heads, S, c.head_dim, dtype=F64)
    k, v = (torch.randn(2, c.n_kv_heads, S, c.head_dim, dtype=F64) for _ in range(2))
    step = kv.view([a, b]).plan(S)
    out, w = step.layers[0].attend(q, k, v, mask=masks.causal(), return_weights=True)
    assert w.shape == (2, c.n_heads, S, 9 + 2 * S) and torch.equal(
        w[1, ..., 2 + 2 * S :], w[1, ..., 2 + 2 * S :] * 0
    )
    for row, seq in ((0, a), (1, b)):
        ks, vs = kv.gather(seq, 0)
        want = sa.attention(q[row : row + 1], ks[None], vs[None], mask=masks.causal())
        assert_rel(out[row], want[0], f"row {row}")
        assert_rel(w[row, ..., : ks.shape[1]].sum(-1), torch.ones_like(w[row, ..., 0]), "weights")


@torch.no_grad()
def test_fork_copies_the_shared_page_in_every_layer():
    """A forked sequence shares its parent's pages (one reference per page for all layers);
    the first write into the shared, partly filled last page copies it, in every layer."""
    model = tiny("llama", seed=5)
    prompt = tokens(1, 6, seed=5)  # P = 4: page 0 full, page 1 holds 2 tokens
    kv = kv_for(model)
    a = kv.add_sequence()
    model(prompt, cache=kv.view([a]))
    b = kv.fork(a)
    shared = kv.pages(a)
    assert kv.pages(b) == shared and all(kv.pool.refcount(p) == 2 for p in shared)
    nxt = torch.tensor([[7], [11]])
    got = model(nxt, cache=kv.view([a, b]))
    for row in range(2):
        seq = torch.cat([prompt, nxt[row : row + 1]], 1)
        assert_rel(got[row], model(seq)[0, -1:], f"row {row} after the fork")
    pa, pb = kv.pages(a), kv.pages(b)
    assert pa[0] == pb[0] == shared[0] and kv.pool.refcount(shared[0]) == 2
    assert pa[1] != pb[1] and shared[1] in (pa[1], pb[1])  # one copy; the last sharer keeps it
    for layer in range(model.config.n_layers):  # the copy holds the prompt's tokens 4, 5
        ka, _ = kv.gather(a, layer)
        kb, _ = kv.gather(b, layer)
        assert torch.equal(ka[:, :6], kb[:, :6])
    more = torch.tensor([[3], [5]])
    got = model(more, cache=kv.view([a, b]))
    for row in range(2):
        seq = torch.cat([prompt, nxt[row : row + 1], more[row : row + 1]], 1)
        assert_rel(got[row], model(seq)[0, -1:], f"row {row}, second step")
    kv.check()


@torch.no_grad()
def test_prefix_hit_reuses_pages_of_every_layer():
    """Pages cached from one request serve a later one: only the uncached suffix runs through
    the model, and its logits equal a run from scratch."""
    model = tiny("mistral", seed=6)
    ids = tokens(1, 14, seed=6)
    kv = kv_for(model, prefix_caching=True)
    a = kv.add_sequence()
    model(ids[:, :10], cache=kv.view([a]))
    assert kv.cache_prefix(a, ids[0, :10]) == 2  # two full pages of 4
    cached_pages = kv.pages(a)[:2]
    kv.free(a)
    b, hit = kv.add_sequence_from_prefix(ids[0])
    assert hit == 8 and kv.pages(b) == cached_pages
    got = model(ids[:, hit:], cache=kv.view([b]))
    assert_rel(got, model(ids)[:, hit:], "suffix after a prefix hit")
    kv.check()


@torch.no_grad()
def test_pool_exhaustion_changes_nothing():
    model = tiny("gpt2", seed=7)
    ids = tokens(2, 16, seed=7)
    kv = kv_for(model, pages=5)
    a, b = kv.add_sequences(2)
    view = kv.view([a, b])
    model(ids[:, :8], cache=view)  # 4 of 5 pages in use
    before = snapshot(kv)
    with pytest.raises(RuntimeError, match=r"needs 2 free page\(s\) but the pool has 1 of 5"):
        model(ids[:, 8:10], cache=view)
    assert snapshot(kv) == before
    kv.check()
    kv.free(b)
    got = model(ids[:1, 8:10], cache=kv.view([a]))
    assert_rel(got, model(ids[:1, :10])[:, 8:], "after the refused step")


@torch.no_grad()
def test_a_failing_layer_undoes_the_step(monkeypatch):
    """An error in layer 1 of a step leaves the cache as before the step: retrying gives the
    right logits (a half-written step would shift every later position)."""
    model = tiny("llama", seed=8)
    ids = tokens(2, 8, seed=8)
    cache = model.make_cache("paged", 2, 12, page_size=4)
    model(ids[:, :4], cache=cache)  # the next token opens a page
    before = snapshot(cache.cache)
    write, calls = PagedKV.write_rows, []

    def fail_in_layer_1(*args, **kw):  # every layer writes, on either decoder path
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom in layer 1")
        return write(*args, **kw)

    monkeypatch.setattr(PagedKV, "write_rows", fail_in_layer_1)
    with pytest.raises(RuntimeError, match="boom in layer 1"):
        model(ids[:, 4:5], cache=cache)
    assert snapshot(cache.cache) == before
    cache.cache.check()
    monkeypatch.setattr(PagedKV, "write_rows", write)
    assert_rel(model(ids[:, 4:6], cache=cache), model(ids[:, :6])[:, 4:], "the retried step")
    wrong = model.make_cache("paged", 2, 12, page_size=4, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"q is torch\.float64 but the cache stores torch\.float32"):
        model(ids[:, :3], cache=wrong)
    assert wrong.length == 0 and wrong.cache.pool.num_free == wrong.cache.num_pages


@torch.no_grad()
def test_a_planned_step_is_a_cache():
    """plan() outside the model (a serving engine, a compiled step) and pass the step."""
    model = tiny("llama", seed=9)
    ids = tokens(2, 6, seed=9)
    cache = model.make_cache("paged", 2, 8, page_size=4)
    model(ids[:, :5], cache=cache)
    step = cache.plan(1)
    assert step.positions.tolist() == [5] and step.past == 5
    assert all(isinstance(layer, InPlaceKVCache) for layer in step.layers)
    assert_rel(model(ids[:, 5:6], cache=step), model(ids)[:, 5:], "pre-planned step")
    with pytest.raises(ValueError, match="planned for 1 new token"):
        step.plan(2)


def test_layers_keep_their_own_pages_and_views_check_inputs():
    gen = torch.Generator().manual_seed(10)
    kv = PagedKV(3, 6, 4, 2, 5, 3, max_seqs=2, max_pages_per_seq=3, dtype=F64)
    s = kv.add_sequence()
    plan = kv.plan([s], 6)
    ks = [torch.randn(1, 2, 6, 5, generator=gen, dtype=F64) for _ in range(3)]
    vs = [torch.randn(1, 2, 6, 3, generator=gen, dtype=F64) for _ in range(3)]
    for layer in range(3):
        kv.write(layer, plan, ks[layer], vs[layer])
    for layer in range(3):
        k, v = kv.gather(s, layer)
        assert torch.equal(k, ks[layer][0]) and torch.equal(v, vs[layer][0])
    assert plan.block_table.tolist() == [[0, 1, -1]] and plan.slots.tolist() == list(range(6))
    with pytest.raises(TypeError, match="has 3 layers: plan each step once"):
        kv.view([s]).attend(*(torch.zeros(1, 2, 1, 5, dtype=F64),) * 2, vs[0][:, :, :1])
    with pytest.raises(ValueError, match="n_tokens must be an int >= 0, got -1"):
        kv.plan([s], -1)
    with pytest.raises(ValueError, match="n_layers must be a positive int, got 0"):
        PagedKV(0, 6, 4, 2, 5, max_seqs=2, max_pages_per_seq=3)


def test_a_cache_of_another_model_is_refused_before_planning():
    """zip() over fewer layer caches than layers would silently skip layers."""
    model = tiny("llama")
    kv = PagedKV(2, 8, 4, 2, 6, max_seqs=1, max_pages_per_seq=4, dtype=F64)  # llama has 3
    view = kv.view(kv.add_sequences(1))
    with pytest.raises(ValueError, match="cache holds 2 layers but the model has 3"):
        model(tokens(1, 3, seed=11), cache=view)
    assert view.length == 0


# -- paged_attention planned once per step (PagedAttentionPlan) --------------------------------


def _spy_backend_plans(monkeypatch) -> list[str]:
    """Record each call of a paged backend's ``plan`` hook (the per-step work) by name."""
    registry = sa.backends.registry("paged")
    calls: list[str] = []
    for name in registry.names():
        backend = registry.get(name)
        if backend.plan is None:
            continue

        def plan(*args, _backend=backend):
            calls.append(_backend.name)
            return _backend.plan(*args)

        monkeypatch.setitem(registry._backends, name, dataclasses.replace(backend, plan=plan))
    return calls


LAYER_CASES = {
    "none": {},
    "causal": dict(mask=masks.causal()),
    "window": dict(mask=masks.sliding_window(5)),
    "softcap": dict(mask=masks.causal(), score_mod=scores.softcap(2.0)),  # the PyTorch path
}


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_a_plan_prepares_once_for_every_layer(case, backend, monkeypatch):
    """Three layers (own pages, own scale) over one ragged block table through one plan: each
    layer's answer is the unplanned call's, and the backend's per-step work ran once (auto: the
    C kernel where it builds; triton in its interpreter on CPU)."""
    kw = LAYER_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    B, Hq, Hkv, D, P, N, L = 3, 4, 2, 8, 4, 13, 3
    seq_lens = torch.tensor([7, 1, 13], dtype=torch.int32)
    table = torch.randperm(N, generator=g)[: B * 4].view(B, 4).to(torch.int32)
    pages = torch.randn(L, 2, N, P, Hkv, D, generator=g)
    qs = torch.randn(L, B, Hq, 1, D, generator=g)
    layers = [(qs[i], pages[i, 0], pages[i, 1], table, seq_lens) for i in range(L)]
    if backend != "auto":
        why = sa.backends.registry("paged").get(backend).reject(*layers[0], PagedCall(**kw))
        if why is not None:
            pytest.skip(why)
    want = [paged_attention(*a, scale=0.3 + i, backend=backend, **kw) for i, a in enumerate(layers)]
    calls = _spy_backend_plans(monkeypatch)
    built = []  # each layer's PagedCall is built once, the first layer's included
    layer_call = paged_plan.layer_call
    monkeypatch.setattr(
        paged_plan, "layer_call", lambda *a, **k: built.append(1) or layer_call(*a, **k)
    )
    plan = PagedAttentionPlan(table, seq_lens)
    for i, args in enumerate(layers):
        got = paged_attention(*args, scale=0.3 + i, backend=backend, plan=plan, **kw)
        assert torch.equal(got, want[i]), f"layer {i}"
    assert len(calls) == 1, calls
    assert len(built) == L, f"{len(built)} PagedCalls built for {L} layers"


def test_a_plan_builds_one_call_for_layers_passing_the_same_arguments(monkeypatch):
    """The layers of a decode step pass one scale and no dequantisation scales or sinks: the
    plan checks and builds their PagedCall once. Another scale is a new call; a bad one is still
    refused."""
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, P, N, L = 2, 4, 2, 8, 4, 9, 4
    seq_lens = torch.tensor([6, 3], dtype=torch.int32)
    table = torch.randperm(N, generator=g)[: B * 2].view(B, 2).to(torch.int32)
    pages = torch.randn(L, 2, N, P, Hkv, D, generator=g)
    qs = torch.randn(L, B, Hq, 1, D, generator=g)
    built = []
    layer_call = paged_plan.layer_call
    monkeypatch.setattr(
        paged_plan, "layer_call", lambda *a, **k: built.append(1) or layer_call(*a, **k)
    )
    plan, causal = PagedAttentionPlan(table, seq_lens), masks.causal()
    for i in range(L):
        args = (qs[i], pages[i, 0], pages[i, 1], table, seq_lens)
        got = paged_attention(*args, mask=causal, scale=0.5, plan=plan)
        assert torch.equal(got, paged_attention(*args, mask=causal, scale=0.5)), f"layer {i}"
    assert len(built) == 1, f"{len(built)} PagedCalls built for {L} layers of one scale"
    got = paged_attention(*args, mask=causal, scale=0.25, plan=plan)
    assert torch.equal(got, paged_attention(*args, mask=causal, scale=0.25))
    assert len(built) == 2
    for bad in (True, float("nan")):
        with pytest.raises(TypeError, match="scale must be a finite number"):
            paged_attention(*args, mask=causal, scale=bad, plan=plan)


def test_a_plan_checks_its_tensors_and_each_layout():
    """A plan serves only its own table and lengths; bad values and a layer of another layout
    are refused with the unplanned call's errors."""
    q, k_pages = torch.randn(2, 4, 1, 8), torch.randn(6, 4, 2, 8)
    table = torch.tensor([[0, 1], [2, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 6], dtype=torch.int32)
    plan = PagedAttentionPlan(table, seq_lens)
    with pytest.raises(ValueError, match="another block_table"):
        paged_attention(q, k_pages, k_pages, table.clone(), seq_lens, plan=plan)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]=7 is out of range for N=6"):
        paged_attention(q, k_pages, k_pages, table, seq_lens, plan=plan)
    table[1, 1] = 3
    paged_attention(q, k_pages, k_pages, table, seq_lens, plan=plan)
    with pytest.raises(ValueError, match="head dim D=9"):
        paged_attention(torch.randn(2, 4, 1, 9), k_pages, k_pages, table, seq_lens, plan=plan)
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor"):
        paged_attention(None, k_pages, k_pages, table, seq_lens, plan=plan)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@torch.no_grad()
def test_a_decode_step_prepares_paged_attention_once(family, monkeypatch):
    """Over the model-level paged KV, one step's layers share the per-step attention work: the
    backend's plan (key intervals, key splits) runs once per kind of layer, not per layer."""
    model = tiny(family).float()
    cache = model.make_cache("paged", 2, 16, page_size=4)
    model(tokens(2, 5, seed=2), cache=cache)
    calls = _spy_backend_plans(monkeypatch)
    model(tokens(2, 1, seed=3), cache=cache)
    assert len(calls) == len(set(model._windows)), calls


def test_a_plan_sees_its_table_changed_in_place():
    """Writing into the planned table (or lengths) between layers makes the plan check again:
    a page id outside the pool is refused, never read."""
    q, k_pages = torch.randn(2, 4, 1, 8), torch.randn(6, 4, 2, 8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 6], dtype=torch.int32)
    plan, causal = PagedAttentionPlan(table, seq_lens), masks.causal()
    paged_attention(q, k_pages, k_pages, table, seq_lens, mask=causal, plan=plan)
    table[1, 1] = 9
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]=9 is out of range for N=6"):
        paged_attention(q, k_pages, k_pages, table, seq_lens, mask=causal, plan=plan)
    table[1, 1] = 4
    seq_lens[0] = 3  # fewer keys for sequence 0: its key interval is planned again
    got = paged_attention(q, k_pages, k_pages, table, seq_lens, mask=causal, plan=plan)
    want = paged_attention(q, k_pages, k_pages, table, seq_lens, mask=causal)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["static", "window", "paged", "streaming"])
def test_fast_in_place_check_agrees_with_the_protocol(kind):
    # attends_in_place replaces typing's slow runtime protocol check on the decode path; it must
    # classify every cache a model offers, and every layer of a planned paged step, alike.
    from selfattn.cache.base import attends_in_place

    model = tiny("mistral" if kind == "window" else "llama")
    extra = {"n_sink": 2, "window": 4} if kind == "streaming" else {}
    cache = model.make_cache(kind, 1, 16, **extra)
    model(torch.randint(0, VOCAB, (1, 3)), cache=cache)
    step = cache.plan(1)
    objects = [cache, *step.layers]
    assert [attends_in_place(c) for c in objects] == [
        isinstance(c, InPlaceKVCache) for c in objects
    ]
    assert attends_in_place(step.layers[0]) == (kind == "paged")


@torch.no_grad()
def test_own_table_is_not_checked_again(monkeypatch):
    """A PagedKV vouches for its own block table and lengths (valid_for): its steps never read
    them back to check them; a plan of a caller's table still checks it once."""
    checks = []
    real = paged_plan.check_values
    monkeypatch.setattr(paged_plan, "check_values", lambda *a: checks.append(real(*a)))
    model = tiny("llama")
    cache = model.make_cache("paged", 2, 16, page_size=4)
    model(tokens(2, 5, seed=2), cache=cache)
    model(tokens(2, 1, seed=3), cache=cache)
    assert checks == []
    kv, step = cache.cache, cache.cache.plan(cache.seq_ids, 1)
    plan = PagedAttentionPlan(step.block_table, step.seq_lens)  # no word given: checked
    q = torch.randn(2, 4, 1, 6, dtype=F64)
    for layer in range(kv.n_layers):
        paged_attention(q, kv.k_layers[layer], kv.v_layers[layer], step.block_table,
                        step.seq_lens, plan=plan)  # fmt: skip
    assert len(checks) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("value_dim", [None, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_keys_and_values_land_in_their_pages_in_either_pool_layout(dtype, value_dim, packed):
    # Dv == D: one kv_store (L, N, 2, P, Hkv, D), a page's keys then its values; else two pools.
    # Every written row must read back (gather) as written, under autograd or not, and a page's
    # keys must sit right before its values.
    L, N, P, Hkv, D = 2, 9, 3, 2, 5
    kv = PagedKV(L, N, P, Hkv, D, value_dim, max_seqs=3, max_pages_per_seq=4, dtype=dtype)
    Dv = D if value_dim is None else value_dim
    if value_dim is None:
        assert kv.kv_store.shape == (L, N, 2, P, Hkv, D)
        step = kv.kv_store[0, 1].nbytes // 2  # a page's keys, then its values
        assert kv.v_store.data_ptr() - kv.k_store.data_ptr() == step
        assert kv.k_layers[1].data_ptr() == kv.kv_store[1].data_ptr()
    else:
        assert kv.kv_store is None and kv.v_store.shape[-1] == Dv
    ids = kv.add_sequences(3)
    g = torch.Generator().manual_seed(0)
    written = {s: ([], []) for s in ids}
    for counts, grad in (([4, 1, 2], False), ([2, 3, 1], True), ([1, 1, 1], False)):
        if packed:
            plan = kv.plan_packed(ids, counts)
            plan = plan.layers[0].plan
        else:
            counts = [counts[0]] * 3
            plan = kv.plan(ids, counts[0])
        T = sum(counts)
        for layer in range(L):
            k = torch.randn(T, Hkv, D, generator=g)
            v = torch.randn(T, Hkv, Dv, generator=g)
            with torch.set_grad_enabled(grad):
                kv.write_rows(layer, plan, k, v)
            if layer == 1:
                at = 0
                for s, c in zip(ids, counts):
                    written[s][0].append(k[at : at + c])
                    written[s][1].append(v[at : at + c])
                    at += c
    for s in ids:
        got_k, got_v = kv.gather(s, layer=1)  # (Hkv, n, ·)
        want_k, want_v = (torch.cat(x).transpose(0, 1) for x in written[s])
        if dtype == torch.int8:  # one int8 step of each row's largest, and the scale's rounding
            for got, want in ((got_k, want_k), (got_v, want_v)):
                bound = want.abs().amax(-1, keepdim=True) / 127 * 1.02
                assert ((got - want).abs() <= bound).all()
        else:
            torch.testing.assert_close(
                got_k, want_k.to(dtype).float().to(got_k.dtype), rtol=0, atol=0
            )
            torch.testing.assert_close(
                got_v, want_v.to(dtype).float().to(got_v.dtype), rtol=0, atol=0
            )
    kv.check()
