"""KV compression in the Engine (selfattn.serving.kv_compression) against generate()'s.

Oracle: ``selfattn.models.generate(..., kv_compression=press)`` of each request alone, on the
static cache (itself checked against a direct attention over each head's kept keys in
tests/models/test_generate_compress.py, AdaKV's per-head budgets included). The engine runs
the same press on its paged pool, with prompts split over several prefill chunks (the
observation window spans chunks), prefixes shared through the prefix cache, samples forked
after the prompt, and a pool small enough to preempt and recompute: every greedy output must
equal the oracle's, no page may leak, and ratio 0 must be bit-identical to no policy.
"""

from __future__ import annotations

import random

import pytest
import torch

from selfattn.cache import PagedKV, kv_cache_bytes
from selfattn.cache.compress import press
from selfattn.models import generate
from selfattn.serving import Engine, EngineConfig, SamplingParams
from tests.models.test_generate_compress import tiny

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, P = 64, 4
GREEDY = dict(temperature=0.0, ignore_eos=True)
PRESSES = {
    "snapkv": press("snapkv", 0.5, window=4),
    "knorm": press("knorm", 0.6),
    "tova": press("tova", 0.5),
    "observed_attention": press("observed_attention", 0.5),
    "expected_attention": press("expected_attention", 0.5, n_future_positions=8),
    "streaming_llm": press("streaming_llm", 0.75, n_sink=2),
}


@pytest.fixture(scope="module")
def model():
    return tiny(dtype=torch.float32)


def engine_for(model, pages: int, **kw) -> Engine:
    c = model.config
    one = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, P, "fp32")
    return Engine(model, kv_cache_bytes=pages * one, page_size=P, **kw)


def prompts_for(seed: int, count: int, lo: int = 14, hi: int = 44, shared: int = 8):
    g = random.Random(seed)
    prefix = [g.randrange(VOCAB) for _ in range(shared)]
    out = []
    for i in range(count):
        tail = [g.randrange(VOCAB) for _ in range(g.randint(lo - shared, hi - shared))]
        out.append(prefix + tail if i % 2 else [g.randrange(VOCAB) for _ in range(shared)] + tail)
    return out


def alone(model, prompt, n, p):
    return generate(model, torch.tensor([prompt]), n, kv_compression=p)[0, len(prompt) :].tolist()


def assert_drained(engine: Engine) -> None:
    engine.check()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    cached = 0 if engine.kv.index is None else engine.kv.index.num_cached_pages
    assert engine.kv.pool.num_used == cached


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_each_policy_equals_generate_and_frees_pages(model, name):
    p = PRESSES[name]
    prompts = prompts_for(len(name), 5)
    engine = engine_for(model, 120, max_batch_tokens=12)  # every prompt in several chunks
    params = SamplingParams(max_tokens=6, kv_compression=p, **GREEDY)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == alone(model, prompt, 6, p)
    m = engine.metrics
    assert m.kv_compressed_prompts == len(prompts) and m.kv_compression_skipped == 0
    evicted = sum(len(x) - p.budget(len(x)) for x in prompts)
    assert m.kv_evicted_tokens == evicted
    assert m.kv_compression_by_policy[name][2] == evicted
    assert m.kv_pages_saved > 0
    assert_drained(engine)


def test_compressed_requests_hold_fewer_pages(model):
    """While decoding, a compressed prompt holds ceil(kept / P) pages, not ceil(S / P)."""
    prompt = prompts_for(3, 1, lo=40, hi=40)[0]
    p = PRESSES["knorm"]
    engine = engine_for(model, 64, prefix_caching=False)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, kv_compression=p, **GREEDY))
    engine.step()  # the prefill, compressed, and the first token
    (seq,) = engine.scheduler.running
    kept = p.budget(len(prompt))
    assert engine.kv.length(seq.kv_id) == kept + 0  # the first token is not computed yet
    assert len(engine.kv.pages(seq.kv_id)) == -(-kept // P)
    assert engine.kv.evicted(seq.kv_id) == len(prompt) - kept
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics.kv_pages_saved == -(-len(prompt) // P) - -(-kept // P)
    del rid
    assert_drained(engine)


def test_ratio_zero_and_none_are_bit_identical_to_no_policy(model):
    prompts = prompts_for(7, 4)
    kw = dict(max_tokens=5, logprobs=3, temperature=0.8, seed=11)
    plain = engine_for(model, 100, max_batch_tokens=12).generate(prompts, SamplingParams(**kw))
    for spec in ("snapkv:0", {"policy": "knorm", "ratio": 0.0}, "none"):
        engine = engine_for(model, 100, max_batch_tokens=12, kv_compression="snapkv:0.5")
        outs = engine.generate(prompts, SamplingParams(kv_compression=spec, **kw))
        for a, b in zip(plain, outs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert engine.metrics.kv_compressed_prompts == 0


def test_engine_default_and_budget(model):
    """EngineConfig.kv_compression applies to requests without their own; ``budget`` caps the
    kept tokens; a prompt no longer than the policy's window stays whole (counted skipped)."""
    prompts = prompts_for(5, 3, lo=30, hi=40)
    engine = engine_for(model, 120, kv_compression="knorm:0.5")
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == alone(model, prompt, 4, press("knorm", 0.5))
    spec = {"policy": "snapkv", "window": 4, "budget": 10}
    short = [prompts[0][:3]]
    outs = engine.generate(prompts[:1] + short, SamplingParams(max_tokens=4, kv_compression=spec,
                                                               **GREEDY))  # fmt: skip
    S = len(prompts[0])
    want = alone(model, prompts[0], 4, press("snapkv", 1 - 10 / S, window=4))
    assert list(outs[0].outputs[0].token_ids) == want
    assert list(outs[1].outputs[0].token_ids) == alone(model, short[0], 4, None)
    assert engine.metrics.kv_compression_by_policy["snapkv"][:3] == [1, 1, S - 10]


def test_soak_with_compression_preemption_forks_and_shared_prefixes(model):
    """Mixed policies and none, n = 2, a shared prefix through the prefix cache, a pool that
    preempts: each sample's greedy tokens equal its request's generate() alone; nothing leaks."""
    g = random.Random(4)
    prompts = prompts_for(9, 40)
    names = [None, *sorted(PRESSES)]
    requests = []
    for prompt in prompts:
        name = g.choice(names)
        params = SamplingParams(max_tokens=g.randint(4, 14), n=g.choice([1, 2]),
                                kv_compression=PRESSES.get(name), **GREEDY)  # fmt: skip
        requests.append((prompt, params, name))
    engine = engine_for(model, 24, max_batch_tokens=20, max_num_seqs=8)
    ids = {engine.add_request(p, params): i for i, (p, params, _) in enumerate(requests)}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out
        engine.check()
    assert len(finals) == len(requests)
    assert engine.metrics.preemptions > 0 and engine.metrics.kv_compressed_prompts > 0
    for i, (prompt, params, name) in enumerate(requests):
        want = alone(model, prompt, params.max_tokens, PRESSES.get(name))
        for sample in finals[i].outputs:
            assert list(sample.token_ids) == want, f"request {i} ({name})"
    assert_drained(engine)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantised_pools_compress_and_account(model, kv_dtype):
    prompts = prompts_for(2, 4)
    c = model.config
    one = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, P, kv_dtype)
    engine = Engine(model, kv_cache_bytes=80 * one, page_size=P, kv_dtype=kv_dtype,
                    max_batch_tokens=16)  # fmt: skip
    params = SamplingParams(max_tokens=4, kv_compression=PRESSES["snapkv"], **GREEDY)
    outs = engine.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert engine.metrics.kv_compressed_prompts == len(prompts)
    assert_drained(engine)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("kivi2", "quantises"),
        ("snapkv:1.5", "compression_ratio"),
        ("snapkv:-0.1", "compression_ratio"),
        ("nope:0.5", "unknown KV-compression policy 'nope'"),
        ({"policy": "snapkv", "budget": 8}, "budget 8 is below the 64"),
        ({"ratio": 0.5}, "names no policy"),
        ({"policy": "knorm", "ratio": 0.5, "nope": 1}, "no knob 'nope'"),
        (0.5, "must be 'POLICY:RATIO'"),
    ],
)
def test_refusals_name_the_value_and_the_fix(model, spec, match):
    engine = engine_for(model, 20)
    with pytest.raises((ValueError, TypeError), match=match):
        engine.add_request([1, 2, 3], SamplingParams(kv_compression=spec))
    assert not engine.has_unfinished()


def test_refusals_of_the_engine_and_the_model(model):
    with pytest.raises(ValueError, match="EngineConfig kv_compression: unknown"):
        EngineConfig(kv_compression="nope:0.5")
    windowed = tiny(dtype=torch.float32, sliding_window=8, layer_types=("sliding_attention",) * 3)
    engine = engine_for(windowed, 20)
    with pytest.raises(ValueError, match="sliding_attention"):
        engine.add_request([1, 2, 3], SamplingParams(kv_compression="knorm:0.5"))


def test_pyramidkv_equals_generate_and_saves_by_its_largest_layer(model):
    """Per-layer budgets on one page list: greedy tokens equal generate()'s on the static cache
    (each layer its own count), prompts over several chunks; the sequence holds the pages of its
    largest layer budget, the other layers' slots past their budgets a hole."""
    p = press("pyramidkv", 0.5, window=4, beta=4)
    prompts = prompts_for(12, 4, lo=30, hi=44)
    engine = engine_for(model, 120, max_batch_tokens=12)
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, kv_compression=p, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == alone(model, prompt, 6, p)
    assert_drained(engine)
    L, S = model.config.n_layers, len(prompts[0])
    budgets = [p.budget(S, i, L) for i in range(L)]
    assert len(set(budgets)) > 1  # the pyramid is ragged here
    engine.add_request(prompts[0], SamplingParams(max_tokens=3, kv_compression=p, **GREEDY))
    while not engine.scheduler.running or not engine.scheduler.running[0].compressed:
        engine.step()  # the prompt's chunks, then its compaction
    (seq,) = engine.scheduler.running
    assert len(engine.kv.pages(seq.kv_id)) == -(-max(budgets) // P)
    assert engine.kv.blocks.holes(seq.kv_id)[:, 0, 0].tolist() == budgets
    while engine.has_unfinished():
        engine.step()
    assert_drained(engine)


def test_adakv_equals_generate_on_the_kernel_and_the_fallback(model, monkeypatch):
    """Per-head budgets: the engine's greedy tokens (holes in its paged pool, prompts over
    several chunks, shared prefixes) equal generate()'s on the static cache (each head its
    own count, its hole masked; checked against a direct softmax over each head's kept K/V in
    tests/models/test_generate_compress.py), with the C kernel and with the PyTorch path."""
    p = press("adakv_snapkv", 0.5, window=4)
    prompts = prompts_for(14, 6, lo=24, hi=40)
    want = [alone(model, prompt, 12, p) for prompt in prompts]
    for kernel in ("1", "0"):
        monkeypatch.setenv("SELFATTN_DECODE_KERNEL", kernel)
        engine = engine_for(model, 120, max_batch_tokens=12)
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, kv_compression=p, **GREEDY))
        assert [list(out.outputs[0].token_ids) for out in outs] == want
        assert engine.metrics.kv_compressed_prompts == len(prompts)
        assert_drained(engine)


def test_adakv_on_the_kernel_equals_the_fallback_with_preemption_and_forks(model, monkeypatch):
    """Per-head budgets (AdaKV over SnapKV): greedy tokens with the C kernel equal those of the
    PyTorch path (each checked against attention over exactly the kept keys per head in
    tests/cache/test_paged_holes.py), in a roomy pool and in one small enough to preempt and
    recompute, with forked samples; pages saved, none leaked."""
    p = press("adakv_snapkv", 0.5, window=4)
    prompts = prompts_for(13, 6, lo=24, hi=40)
    params = SamplingParams(max_tokens=8, n=2, kv_compression=p, **GREEDY)
    runs = []
    for kernel, pages in (("1", 120), ("1", 24), ("0", 120)):
        monkeypatch.setenv("SELFATTN_DECODE_KERNEL", kernel)
        engine = engine_for(model, pages, max_batch_tokens=16, max_num_seqs=6)
        outs = engine.generate(prompts, params)
        runs.append([[list(o.token_ids) for o in out.outputs] for out in outs])
        assert engine.metrics.kv_pages_saved > 0
        assert_drained(engine)
        if pages == 24:
            assert engine.metrics.preemptions > 0
    assert runs[0] == runs[1] == runs[2]
    assert all(samples[0] == x for samples in runs[0] for x in samples)  # greedy forks agree


def test_compact_moves_each_heads_tokens_and_never_writes_shared_pages():
    """PagedKV.compact against a gather of the kept indices, in every dtype; a fork's pages
    are untouched and the accounting holds."""
    torch.manual_seed(0)
    L, N, Hkv, D, T = 2, 24, 3, 8, 13
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        kv = PagedKV(L, N, P, Hkv, D, max_seqs=4, max_pages_per_seq=8, dtype=dtype)
        s = kv.add_sequence()
        plan = kv.plan([s], T)
        for layer in range(L):
            kv.write(layer, plan, torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D))
        before = [kv.gather(s, layer) for layer in range(L)]
        f = kv.fork(s)
        n = 6
        kept = torch.stack([torch.stack([torch.randperm(T)[:n].sort().values
                                         for _ in range(Hkv)]) for _ in range(L)])  # fmt: skip
        removed, freed = kv.compact(s, kept)
        assert (removed, freed) == (T - n, -(-T // P) - -(-n // P))
        kv.check()
        assert kv.length(s) == n and kv.evicted(s) == T - n and kv.evicted(f) == 0
        for layer in range(L):
            k0, v0 = before[layer]
            k1, v1 = kv.gather(s, layer)
            heads = torch.arange(Hkv)[:, None]
            assert torch.equal(k1, k0[heads, kept[layer]]), dtype
            assert torch.equal(v1, v0[heads, kept[layer]]), dtype
            assert all(torch.equal(a, b) for a, b in zip(kv.gather(f, layer), before[layer]))
        step = kv.plan_packed([s, f], [2, 1])
        plan = step.layers[0].plan
        assert plan.positions.view(-1).tolist() == [T, T + 1, T]  # positions continue
        assert plan.seq_lens.tolist() == [n + 1, n + 2, T + 1]  # attention reads slots
        kv.free(f)
        kv.free(s)
        kv.check()
        assert kv.pool.num_free == N
    with pytest.raises(ValueError, match="ascending, distinct"):
        kv = PagedKV(1, 8, P, 1, 4, max_seqs=1, max_pages_per_seq=4)
        s = kv.add_sequence()
        kv.plan([s], 5)
        kv.compact(s, torch.tensor([[[3, 1]]]))


def test_an_engine_that_refuses_compression_names_why(model):
    """A tensor-parallel engine's ranks mirror rank 0's pages: it refuses every policy."""
    from selfattn.serving.kv_compression import PromptCompression
    from selfattn.serving.parallel import TensorParallelEngine

    why = TensorParallelEngine.compression_refused
    engine = engine_for(model, 20)
    pc = PromptCompression(model, engine.kv, None, refused=why)
    with pytest.raises(ValueError, match="tensor-parallel"):
        pc.resolve(SamplingParams(kv_compression="knorm:0.5"))
    assert pc.resolve(SamplingParams(kv_compression="none")) is None
    with pytest.raises(ValueError, match="tensor-parallel"):
        PromptCompression(model, engine.kv, "knorm:0.5", refused=why)


def test_a_long_prompt_waits_for_room_for_all_of_it(model):
    """Admission counts a prompt's every page, not its first chunk's: two prompts that do not
    fit together run one after the other, without preempting and recomputing each other."""
    prompts = prompts_for(11, 2, lo=30, hi=30)
    engine = engine_for(model, 12, max_batch_tokens=8, prefix_caching=False)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == alone(model, prompt, 4, None)
    assert engine.metrics.preemptions == 0
    assert_drained(engine)


@pytest.mark.parametrize(
    "name",
    [
        "observed_attention",
        "expected_attention",
        "adakv_observed_attention",
        "adakv_expected_attention",
    ],
)
def test_streamed_policies_hold_a_statistic_not_the_prompts_rows(model, name):
    """Policies that read every prompt query keep, per sequence and layer during the prefill,
    a statistic of O(Hq x C + Hq x D^2) floats (attention sums, query moments), never the
    prompt's C x d_model attention inputs; greedy tokens still equal generate()'s."""
    knobs = {"n_future_positions": 8} if "expected" in name else {}
    p = press(name, 0.5, **knobs)
    prompt = prompts_for(21, 1, lo=60, hi=60)[0]
    C, c = len(prompt), model.config
    Hq, D = c.n_heads, c.head_dim
    bound = Hq * C * 4 + Hq * (D + D * D) * 8  # float32 sums; float64 mean and moment
    assert bound < C * c.d_model * 4  # what recording the rows would hold
    engine = engine_for(model, 64, max_batch_tokens=9, prefix_caching=False)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6, kv_compression=p, **GREEDY))
    checked, out = 0, None
    while engine.has_unfinished():
        for o in engine.step():
            out = o if o.request_id == rid else out
        for seq in engine.scheduler.running:
            if not seq.compressing:
                continue
            assert len(seq.observed) == c.n_layers
            for stat in seq.observed:
                if "observed" in name:
                    assert stat.sums.shape == (1, Hq, seq.num_computed)
                else:
                    assert stat.mean.shape == (1, Hq, D) and stat.m2.shape == (1, Hq, D, D)
                held = [t.nbytes for t in vars(stat).values() if isinstance(t, torch.Tensor)]
                assert sum(held) <= bound
            checked += 1
    assert checked >= 5  # several chunks before the prompt's end
    assert list(out.outputs[0].token_ids) == alone(model, prompt, 6, p)
    assert engine.metrics.kv_compressed_prompts == 1
    assert_drained(engine)
