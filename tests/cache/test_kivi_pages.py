"""KIVI pages in the paged pool (selfattn.cache.paged.kivi): the pages against KIVI's rule
(the static KIVICache with group = page size, residual 0, itself tested against an fp64
reference in test_kivi.py), attention over them against fp64 attention over the dequantised
K/V, forks / trim / prefix reuse / page accounting, the Engine's greedy tokens against
the static KIVI cache's teacher-forced logits, and bad input."""

from __future__ import annotations

import pytest
import torch

from selfattn import masks
from selfattn.cache import KIVICache
from selfattn.cache.paged.kivi import KIVIPagedKV, kivi_page_bytes
from selfattn.cache.size import kv_cache_bytes
from selfattn.serving import Engine, SamplingParams
from selfattn.serving.config import EngineConfig

L, H, D, P = 2, 2, 16, 8


def pool(bits=4, pages=24, seqs=3, **kw):
    return KIVIPagedKV(L, pages, P, H, D, bits=bits, max_seqs=seqs, max_pages_per_seq=8, **kw)


def step(kv, seq_ids, S, g, q_heads=4, dtype=torch.float32):
    """One planned step of fresh random K/V over every layer; returns the K/V and outputs."""
    plan = kv.view(seq_ids).plan(S)
    B = len(seq_ids)
    got = []
    for layer in range(L):
        q = torch.randn(B, q_heads, S, D, generator=g, dtype=dtype)
        k = torch.randn(B, H, S, D, generator=g, dtype=dtype) * 3
        v = torch.randn(B, H, S, D, generator=g, dtype=dtype)
        got.append((q, k, v, plan.layers[layer].attend(q, k, v, mask=masks.causal())))
    return got


def naive(q, k, v, causal, dt):
    """Softmax attention computed in ``dt``."""
    s = (q.to(dt) @ k.to(dt).transpose(-1, -2)) / D**0.5
    return s.masked_fill(~causal, float("-inf")).softmax(-1) @ v.to(dt)


@pytest.mark.parametrize("bits", [2, 4])
def test_pages_equal_the_static_kivi_cache_and_attention_matches_fp64(bits):
    """Chunks crossing page boundaries: every layer's gathered K/V equal KIVICache(group=P,
    residual=0)'s history; the attention output is fp64 attention over that history within
    the ratio rule (vs the fp32 naive softmax's own error)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    kv = pool(bits)
    sid = kv.add_sequence()
    ref = [KIVICache(1, 64, H, D, bits=bits, group=P, residual=0) for _ in range(L)]
    for S in (5, 3, 1, 9, 11, 1):  # prefill-sized chunks (> PACKED_ROWS_MAX) and decode steps
        for layer, (q, k, v, out) in enumerate(step(kv, [sid], S, g)):
            kr, vr = ref[layer].update(k, v)
            ks, vs = kv.gather(sid, layer)
            torch.testing.assert_close(ks, kr[0], rtol=0, atol=0)
            torch.testing.assert_close(vs, vr[0], rtol=0, atol=0)
            n = kr.shape[2]
            causal = torch.ones(S, n, dtype=torch.bool).tril(n - S)
            kq = kr.repeat_interleave(2, 1)
            vq = vr.repeat_interleave(2, 1)

            exact = naive(q, kq, vq, causal, torch.float64)
            ours = (out.double() - exact).abs().max()
            low = (naive(q, kq, vq, causal, torch.float32).double() - exact).abs().max()
            assert ours <= 8 * low + 1e-12


def test_memory_is_bits_plus_scales_per_token():
    """A pool's codes and scales take, per token, KV head and layer, ``2D * bits / 8`` bytes
    of codes plus bf16 scale and zero: a key pair per channel per page (``D / P``) and a
    value pair per token per group of ``min(P, D)`` channels; the fill buffers are
    ``2 * max_seqs`` float pages."""
    for bits in (2, 4):
        kv = pool(bits, pages=40, seqs=1, dtype=torch.bfloat16)
        fills = kv.store.k_fill.nbytes + kv.store.v_fill.nbytes
        assert fills == 2 * kv_cache_bytes(L, H, D, P, "bf16")
        per_token = 2 * D * bits // 8 + 2 * 2 * (D // P + D // min(P, D))
        page = kivi_page_bytes(L, H, D, P, f"kivi{bits}", torch.bfloat16)
        assert page == L * H * P * per_token
        assert kv.nbytes - fills == 40 * page


def test_forks_trim_and_prefix_reuse_keep_pages_apart_and_balanced():
    """A fork of a sequence mid-page diverges without touching the parent (copy-on-write of
    the filling page); a trim back into a quantised page continues from its dequantised
    tokens; prefix reuse reads the cached full pages; the pool balances after frees."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    kv = pool(4, prefix_caching=True)
    a = kv.add_sequence()
    step(kv, [a], 12, g)  # one full page, one filling
    before = [kv.gather(a, layer) for layer in range(L)]
    b = kv.fork(a)
    step(kv, [b], 7, g)  # fills b's copy of the shared page, opens another
    for layer in range(L):
        torch.testing.assert_close(kv.gather(a, layer), before[layer], rtol=0, atol=0)
        ka, _ = kv.gather(b, layer)
        torch.testing.assert_close(ka[:, :P], before[layer][0][:, :P], rtol=0, atol=0)
    kv.trim(b, 10)  # back into the page quantised at the fork's step
    kept = [kv.gather(b, layer) for layer in range(L)]
    step(kv, [b], 3, g)
    for layer in range(L):
        torch.testing.assert_close(kv.gather(b, layer)[1][:, :10], kept[layer][1], rtol=0, atol=0)
    tokens = list(range(12))
    kv.cache_prefix(a, tokens)
    c, cached = kv.add_sequence_from_prefix(tokens)
    assert cached == P
    for layer in range(L):
        torch.testing.assert_close(kv.gather(c, layer)[0], before[layer][0][:, :P], rtol=0, atol=0)
    for s in (a, b, c):
        kv.free(s)
    kv.check()
    assert kv.pool.num_free == kv.num_pages - 1  # the cached page, held by the index alone


def test_fill_buffers_of_freed_pages_are_taken_back():
    """Sequences freed mid-page leave their fill buffers behind; later sequences take them
    back (2 x max_seqs buffers serve many more sequences than that), pages balance."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    kv = pool(2, seqs=1)
    for _ in range(6):
        sid = kv.add_sequence()
        step(kv, [sid], 5, g)  # one page filling
        kv.free(sid)
    kv.check()
    assert kv.pool.num_free == kv.num_pages


def test_bad_input_names_the_fix():
    with pytest.raises(TypeError, match=r"'kivi2' or 'kivi4', got 'kivi3'"):
        EngineConfig(kv_dtype="kivi3")
    from selfattn.cli.main import build_parser
    from selfattn.cli.serve import _engine_config

    args = build_parser().parse_args(
        ["serve", "m", "--kv-dtype", "kivi4", "--kv-cache-bytes", "64"]
    )
    assert _engine_config(args).kv_dtype == "kivi4"
    with pytest.raises(ValueError, match="multiple of 4"):
        KIVIPagedKV(1, 4, P, 1, 6, bits=2, max_seqs=1, max_pages_per_seq=4)
    with pytest.raises(ValueError, match="float dtype"):
        KIVIPagedKV(1, 4, P, 1, 8, bits=4, max_seqs=1, max_pages_per_seq=4, dtype=torch.int8)
    kv = pool()
    sid = kv.add_sequence()
    with pytest.raises(TypeError, match="plain PagedKV"):
        kv.compact(sid, torch.zeros(L, H, 0, dtype=torch.long))


@torch.no_grad()
def _kivi_logits_margin_and_error(model, tokens, prompt):
    """Teacher-forced over ``tokens (1, n)`` past ``prompt``: the static KIVI cache's logits
    (group 4, residual 0) per step, their top-2 margin, and each step's largest logit error
    against the unquantised static cache."""
    from tests.cache.test_kivi import teacher_forced_logits

    n = tokens.shape[1]
    ref = teacher_forced_logits(model, tokens, prompt, model.make_cache("static", 1, n))[0]
    kivi_cache = model.make_cache("kivi", 1, n, bits=4, group=4, residual=0)
    kivi = teacher_forced_logits(model, tokens, prompt, kivi_cache)[0]
    top2 = kivi.topk(2, -1).values
    return kivi, top2[:, 0] - top2[:, 1], (kivi - ref).abs().amax(-1)


def test_engine_greedy_follows_the_static_kivi_cache_where_the_margin_is_clear(tmp_path):
    """Engine(kv_dtype='kivi4') greedy tokens (batched, chunked prefill, decode) are the
    argmax of make_cache('kivi', bits=4, group=page size, residual=0)'s teacher-forced logits
    at every step whose top-2 margin exceeds the 4-bit cache's own error; a per-request kivi
    compression is refused naming --kv-dtype; pages balance."""
    from tests.models.test_models_decoder import VOCAB, tiny_pair

    _, model = tiny_pair("llama", tmp_path, seed=3)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 13, 21)]
    eng = Engine(model, kv_cache_bytes=2**20, page_size=4, kv_dtype="kivi4",
                 max_batch_tokens=16)  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    checked = 0
    for prompt, out in zip(prompts, outs):
        got = list(out.outputs[0].token_ids)
        tokens = torch.tensor([prompt + got])
        kivi, margin, err = _kivi_logits_margin_and_error(model, tokens, len(prompt))
        for t, token in enumerate(got):
            # the batch's chunks round K/V differently from one prompt's forward, and a value
            # at a quantisation boundary then lands one code away: only a step whose margin is
            # wider than the 4-bit cache's own logit error must pick the same token
            if margin[t] > 2 * err[t]:
                assert token == kivi[t].argmax().item(), f"prompt of {len(prompt)}, step {t}"
                checked += 1
    assert checked >= len(prompts) * 6 // 2, f"only {checked} steps had a margin above the error"
    spec = Engine(model, kv_cache_bytes=2**20, page_size=4, kv_dtype="kivi4",
                  speculative="ngram", num_speculative_tokens=3)  # fmt: skip
    rep = [prompts[1][:5] * 4]  # repeats: prompt lookup drafts, rejections trim pages back
    got = list(spec.generate(rep, params)[0].outputs[0].token_ids)
    # the first token comes from the prefill; later ones may differ where a rollback into a
    # quantised page requantises its kept tokens (module docstring of the pages)
    kivi, margin, err = _kivi_logits_margin_and_error(model, torch.tensor([rep[0] + got]), 20)
    assert len(got) == 6 and (margin[0] <= 2 * err[0] or got[0] == kivi[0].argmax().item())
    spec.kv.check()
    assert "kivi4" in repr(eng)
    with pytest.raises(ValueError, match="--kv-dtype kivi4"):
        eng.generate([prompts[0]], SamplingParams(max_tokens=1, kv_compression="kivi4"))
    eng.kv.check()  # the pages left are the prefix index's alone
    assert not eng.kv.seq_ids and eng.kv.pool.num_free < eng.kv.num_pages


def test_engine_preemption_over_kivi_pages_finishes_everything_and_balances(tmp_path):
    """A pool too small for the batch preempts and recomputes over KIVI pages: every request
    gets its tokens, the fill buffers and pages balance after each step and at the end; the
    greedy tokens of a request the pool never preempted equal the large pool's."""
    from tests.models.test_models_decoder import VOCAB, tiny_pair

    _, model = tiny_pair("llama", tmp_path, seed=4)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (9, 14, 11, 17, 6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    c = model.config
    page = kivi_page_bytes(c.n_layers, c.n_kv_heads, c.head_dim, 4, "kivi4", torch.float32)
    small = Engine(model, kv_cache_bytes=14 * page, page_size=4, kv_dtype="kivi4",
                   max_batch_tokens=16, prefix_caching=False)  # fmt: skip
    ids = [small.add_request(p, params) for p in prompts]
    finals = {}
    while small.has_unfinished():
        for out in small.step():
            if out.finished:
                finals[out.request_id] = out
        small.kv.check()
    assert small.metrics.preemptions > 0, "the pool was meant to force preemption"
    assert all(len(finals[r].outputs[0].token_ids) == 10 for r in ids)
    assert not small.kv.seq_ids and small.kv.pool.num_used == 0
    large = Engine(model, kv_cache_bytes=2**20, page_size=4, kv_dtype="kivi4",
                   max_batch_tokens=16, prefix_caching=False)  # fmt: skip
    first = large.generate(prompts[:1], params)[0].outputs[0].token_ids
    assert finals[ids[0]].outputs[0].token_ids == first  # the oldest request is never preempted
