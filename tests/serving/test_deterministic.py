"""Deterministic mode (selfattn.kernels.determinism): a request's tokens and logprobs bitwise the
same alone and in any batch, at 1 and 2 threads, whatever the chunking, preemption and
prefix-cache hits; generate(deterministic=True) the same for a row alone and in a batch; the
paged kernel's fixed key splits still exact, and batch-invariant."""

from __future__ import annotations

import random

import pytest
import torch

from selfattn import masks
from selfattn.cache import kv_cache_bytes
from selfattn.functional import paged_attention
from selfattn.kernels import paged_decode, quant_matmul, rows_linear
from selfattn.kernels.determinism import (
    SPLIT_KEYS,
    deterministic,
    invariant_linear,
    is_deterministic,
)
from selfattn.models.decoder import DecoderConfig, Llama
from selfattn.models.generate import generate
from selfattn.nn.quant import quantize_
from selfattn.serving import Engine, SamplingParams
from selfattn.serving.config import EngineConfig
from tests._kernel_helpers import c_kernel
from tests._speculative import tiny_llama
from tests.cache.test_paged import check, make_paged

VOCAB = 300
P = 4  # tokens per page: every prompt spans several pages and key splits
needs_kernel = pytest.mark.c_kernel(paged_decode)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, every_thread):
    """1 and 2 intra-op threads, every C kernel call using all of them."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def tiny_model(dtype: torch.dtype, seed: int = 0, tie: float | None = None) -> Llama:
    """A random 2-layer Llama; ``tie``: its LM head's rows one row times ``1 + tie * noise``,
    so that the greedy token is decided by rounding (a row's results must then match bitwise
    for its tokens to)."""
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=128, max_positions=512)  # fmt: skip
    model = Llama(cfg).eval()
    if tie is not None:
        with torch.no_grad():
            w = model.lm_head.weight
            w.copy_(w[:1] * (1 + tie * torch.randn_like(w)))
    return model.to(dtype)


@pytest.fixture(scope="module", params=["fp32", "bf16", "q8_0"])
def model(request):
    """The tiny model in fp32, bf16, and with q8_0 weights (the quantised matmul's C kernel;
    its steps that keep no logits give the LM head zero rows)."""
    if request.param != "q8_0":
        return tiny_model(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[request.param]),
                          seed=1)  # fmt: skip
    c_kernel(quant_matmul)
    return quantize_(tiny_model(torch.float32, seed=1), "q8_0")


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)


def prompts(seed: int, count: int, longest: int = 45) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(2, VOCAB) for _ in range(g.randint(2, longest))] for _ in range(count)]


def served(model, requests, *, pages: int = 200, params=GREEDY, **knobs) -> list[tuple]:
    """Each request's ``(token ids, logprobs)`` under ``params`` from one deterministic engine,
    all queued at once (a few per step, in order); its metrics too."""
    c = model.config
    one = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, P, model.norm.weight.dtype)
    knobs = {"deterministic": True, **knobs}
    engine = Engine(model, kv_cache_bytes=pages * one, page_size=P, **knobs)
    ids, finals, pending = [], {}, list(requests)
    while pending or engine.has_unfinished():
        for prompt in pending[:3]:
            ids.append(engine.add_request(prompt, params))
        pending = pending[3:]
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    outs = [finals[i].outputs[0] for i in ids]
    return [(o.token_ids, o.logprobs) for o in outs], engine.metrics


def test_a_request_alone_and_in_batches_of_any_mix(model, threads):
    """The target request alone (one chunk, default budget) and among 7 others in three orders,
    under budgets that chunk its prompt differently: bitwise the same tokens and logprobs."""
    target = prompts(100, 1, longest=45)[0] + [7] * 5
    alone, _ = served(model, [target])
    others = prompts(threads, 7)
    for budget, at in ((1024, 0), (7, 3), (33, 7)):
        mix = [*others[:at], target, *others[at:]]
        got, _ = served(model, mix, max_batch_tokens=budget)
        assert got[at] == alone[0], f"budget {budget}, position {at}"


def test_after_preemption(model):
    """A pool too small for the batch preempts (recomputing the preempted prompts and tokens):
    every request still gets its tokens and logprobs alone."""
    reqs = prompts(5, 6, longest=30)
    got, metrics = served(model, reqs, pages=22, max_batch_tokens=16)
    assert metrics.preemptions > 0, "the pool was meant to force preemption"
    for i, r in enumerate(reqs):
        assert got[i] == served(model, [r], prefix_caching=False)[0][0], f"request {i}"


def test_with_and_without_a_prefix_cache_hit(model):
    """A request whose first pages another request cached (a hit) against the same request on
    an engine without prefix caching."""
    shared = prompts(9, 1, longest=20)[0][: 4 * P]
    first, second = [*shared, 3, 4, 5], [*shared, 9, 8, 7, 6, 5]
    got, metrics = served(model, [first, second, second])
    assert metrics.cached_prompt_tokens >= 2 * len(shared)
    alone, _ = served(model, [second], prefix_caching=False)
    assert got[1] == alone[0] and got[2] == alone[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generate_row_alone_equals_row_in_batch(dtype, threads):
    """generate(deterministic=True): a row's tokens alone and as row 0 or 2 of a batch of 4, on
    a model whose greedy choices are decided by rounding (fp32) or by bf16 ties."""
    model = tiny_model(dtype, seed=3, tie=3e-7 if dtype == torch.float32 else 1e-2)
    ids = torch.randint(2, VOCAB, (4, 23), generator=torch.Generator().manual_seed(4))
    alone = generate(model, ids[:1], 30, deterministic=True)[0]
    batch = generate(model, ids, 30, deterministic=True)
    swapped = generate(model, ids[[1, 2, 0, 3]], 30, deterministic=True)
    assert torch.equal(batch[0], alone) and torch.equal(swapped[2], alone)


def test_generate_refuses_what_it_does_not_make_invariant():
    model = tiny_model(torch.float32)
    ids = torch.randint(2, VOCAB, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match=r"deterministic=True\) runs rows without padding"):
        generate(model, ids, 3, attention_mask=mask, deterministic=True)
    with pytest.raises(ValueError, match="runs on the paged cache, got cache='static'"):
        generate(model, ids, 3, cache="static", deterministic=True)
    with pytest.raises(ValueError, match="does not run speculative decoding yet"):
        generate(model, ids, 3, prompt_lookup_num_tokens=2, deterministic=True)
    with pytest.raises(TypeError, match="deterministic must be a bool, got 1"):
        generate(model, ids, 3, deterministic=1)


def test_the_mode_is_scoped():
    assert not is_deterministic()
    with deterministic():
        assert is_deterministic()
        with deterministic(False):  # a caller passing its flag through leaves it on
            assert is_deterministic()
    with deterministic(False):
        assert not is_deterministic()
    assert not is_deterministic()


@pytest.fixture(params=["kernel", "padded matmul"])
def linear_path(request, monkeypatch):
    """invariant_linear's two paths: the C kernel, and torch's matmul over padded rows."""
    if request.param == "kernel":
        c_kernel(rows_linear)
    if request.param != "kernel":
        monkeypatch.setenv("SELFATTN_ROWS_KERNEL", "0")
    return request.param


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("N", "K"), [(97, 37), (64, 64), (130, 1025)])
def test_rows_kernel_against_the_oracle_and_its_twin(dtype, N, K):
    """rows_linear.linear with a bias against fp64 (ratio rule against torch's own product in
    the dtype), and its float32 sum against the plain-PyTorch twin of its order."""
    from selfattn.testing import assert_close_to_reference

    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(9, K, generator=g).to(dtype)
    w, b = torch.randn(N, K, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
    oracle = x.double() @ w.double().T + b.double()
    got = rows_linear.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (9, N)
    assert_close_to_reference(got, oracle, torch.nn.functional.linear(x, w, b), what="linear")
    twin = rows_linear.twin(x, w)
    assert_close_to_reference(rows_linear.linear(x.float(), w.float()), oracle - b.double(),
                              twin, what="against the twin")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_invariant_linear_rows_match_in_any_batch(dtype, linear_path):
    """Each row of invariant_linear over M rows equals the row alone, for M = 1 .. 40 (torch's
    own F.linear differs between these row counts on MKL: module docstring)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 96, generator=g).to(dtype)
    w, b = torch.randn(80, 96, generator=g).to(dtype), torch.randn(80, generator=g).to(dtype)
    alone = torch.cat([invariant_linear(x[i : i + 1], w, b) for i in range(40)])
    for M in range(1, 41):
        assert torch.equal(invariant_linear(x[:M], w, b), alone[:M]), f"M={M}"
    # 3-d input, as a model passes it
    assert torch.equal(invariant_linear(x[None, :3], w, b)[0], alone[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [37, 48, 128])
def test_invariant_rowwise_rows_match_in_any_batch(dtype, D, threads):
    """SiLU through invariant_rowwise: each row of a 1 .. 41-row batch equals the row alone
    (plain SiLU over a contiguous (M, 48) tensor rounds rows at its scalar tail differently);
    the values are SiLU's."""
    import torch.nn.functional as F

    from selfattn.kernels.determinism import invariant_rowwise

    x = torch.randn(41, D, generator=torch.Generator().manual_seed(D)).to(dtype)
    alone = torch.cat([invariant_rowwise(F.silu, x[i : i + 1]) for i in range(41)])
    for M in (1, 2, 7, 16, 41):
        assert torch.equal(invariant_rowwise(F.silu, x[:M]), alone[:M]), f"M={M}"
    torch.testing.assert_close(alone, F.silu(x))  # the same op: at most its lanes' rounding


def test_engine_config_and_serve_flag():
    from selfattn.cli.main import build_parser

    assert build_parser().parse_args(["serve", "m"]).deterministic is EngineConfig.deterministic
    assert build_parser().parse_args(["serve", "m", "--deterministic"]).deterministic is True
    with pytest.raises(TypeError, match="deterministic must be a bool, got 1"):
        EngineConfig(deterministic=1)


@needs_kernel
def test_kernel_fixed_splits_are_exact_and_batch_invariant(threads, monkeypatch):
    """The C kernel under deterministic mode: splits of SPLIT_KEYS keys (several for the long
    sequence) agree with the fp64 oracle (ratio rule), and sequence 0's rows are bitwise the
    same alone and beside sequences of other lengths."""
    monkeypatch.setattr("selfattn.kernels.determinism.SPLIT_KEYS", 16)
    lens = [150, 9, 61, 300]
    for dtype in (torch.float32, torch.bfloat16):
        q, kp, vp, table, sl = make_paged(lens, 4, 2, D=24, P=P, Sq=1, dtype=dtype, seed=7)
        with deterministic():
            assert paged_decode.key_splits(sl[:, None] * 0, sl[:, None], P)[1] == 16 // P
            out, _ = check(q, kp, vp, table, sl, mask=masks.causal())
            alone = paged_attention(q[:1], kp, vp, table[:1], sl[:1], mask=masks.causal())
        assert torch.equal(out[:1], alone)
    assert SPLIT_KEYS >= P


@pytest.mark.parametrize(
    "knobs",
    [{"kv_dtype": torch.int8}, {"kv_compression": "snapkv:0.5"}, {"speculative": "ngram"}],
    ids=["int8 pages", "snapkv", "ngram speculation"],
)
def test_alone_and_in_batches_with_int8_pages_compression_and_speculation(knobs):
    """The same invariance with int8 pages (a scale per token), a compressed prompt and n-gram
    speculation (its verify rows are rows like any other; requests asking for logprobs decode
    without drafts, so its requests ask for tokens only)."""
    model, params = tiny_model(torch.float32, seed=1), GREEDY
    target = prompts(100, 1, longest=45)[0] + [7] * 5
    if "kv_compression" in knobs:  # past SnapKV's 64-token window, so that it compresses
        target = prompts(101, 1, longest=45)[0] * 4
    if "speculative" in knobs:  # a small vocabulary repeats itself: n-gram drafts
        model, params = (
            tiny_llama(0),
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        )
        g = random.Random(102)
        target = [g.randrange(model.config.vocab_size) for _ in range(8)] * 4
    alone, metrics = served(model, [target], params=params, **knobs)
    if "kv_compression" in knobs:
        assert metrics.kv_evicted_tokens > 0, "the prompt was meant to be compressed"
    if "speculative" in knobs:
        assert metrics.spec_draft_tokens > 0, "drafts were meant to be verified"
    others = [[t % model.config.vocab_size for t in p] for p in prompts(3, 7)]
    for budget, at in ((1024, 0), (7, 3), (33, 7)):
        mix = [*others[:at], target, *others[at:]]
        got, _ = served(model, mix, max_batch_tokens=budget, params=params, **knobs)
        assert got[at] == alone[0], f"budget {budget}, position {at}"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, "kivi2", "kivi4"], ids=str)
def test_refuses_pages_whose_rounding_depends_on_others(kv_dtype):
    with pytest.raises(ValueError, match=r"deterministic=True cannot run kv_dtype=.*int8 pages"):
        EngineConfig(deterministic=True, kv_dtype=kv_dtype)
    EngineConfig(deterministic=False, kv_dtype=kv_dtype)  # the default mode runs them
