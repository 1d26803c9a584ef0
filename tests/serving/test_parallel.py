"""Tensor parallelism (selfattn.serving.parallel) on 2 gloo ranks on the CPU.

Each family's split model gives the logits of one process by the ratio rule (float64 oracle,
the fp32 single process as the naive baseline), through a full forward and a paged prefill +
decode; the engine over 2 processes gives each request the greedy tokens of one process, through
shared prefixes, copy-on-write forks (n > 1) and preemption; a dead worker is a clear error on
rank 0, never a hang; close() ends the workers. Every test is bounded by a timeout.
"""

from __future__ import annotations

import random
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from selfattn.models import from_pretrained  # noqa: E402
from selfattn.serving import Engine, SamplingParams  # noqa: E402
from selfattn.serving.parallel import (  # noqa: E402
    TensorParallelError,
    tensor_parallel,
    tensor_parallel_engine,
)
from selfattn.testing import assert_close_to_reference  # noqa: E402
from tests import _dist_helpers as helpers  # noqa: E402
from tests.models.test_models_decoder import VOCAB, tiny_pair  # noqa: E402

FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "gemma2"]
# Qwen2's tiny config has one kv head; two ranks need whole kv heads each.
OVERRIDES = {"qwen2": {"num_key_value_heads": 2}}
W = 2
P = 4  # tokens per page
GREEDY = dict(temperature=0.0, ignore_eos=True)
TIMEOUT_S = 60  # each collective and the workers' start
DEADLINE_S = 240  # the group of the logits cases

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a saved tiny random checkpoint."""
    out = {}
    for i, f in enumerate(FAMILIES):
        out[f] = tmp_path_factory.mktemp(f)
        tiny_pair(f, out[f], seed=i, **OVERRIDES.get(f, {}))
    return out


def _ids(seed: int, S: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, S), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A full forward's logits, then a paged prefill of all but the last 3 tokens and 3 decode
    steps, concatenated: ``(S + S, vocab)``."""
    S = ids.shape[1]
    with torch.no_grad():
        full = model(ids)[0]
        cache = model.make_cache("paged", 1, S, page_size=P)
        steps = [model(ids[:, : S - 3], cache=cache)[0]]
        steps += [model(ids[:, t : t + 1], cache=cache)[0] for t in range(S - 3, S)]
    return torch.cat([full, *steps])


def split_logits(rank: int, W: int, folder: str, seed: int, quantize=None) -> tuple:
    """A rank's case: the family's fp32 model (``quantize``: kept quantised in that format)
    split across the group: its logits, and whether its blocks run the lean decode step."""
    from torch.distributed.device_mesh import init_device_mesh

    model = from_pretrained(folder, torch.float32, quantize=quantize)
    model = tensor_parallel(model, init_device_mesh("cpu", (W,)))
    lean = all(b.rows_step().unusable() is None for b in model.layers)
    return _logits(model, _ids(seed, 13)), lean


# A Llama whose row-wise parallel projections (out: 4 heads × 32, down: 128 inputs) split on
# 32-wide blocks across two ranks.
QUANT_SPLIT = {"head_dim": 32, "intermediate_size": 128}
QUANT_FORMATS = ("int4", "int8")


def test_split_model_logits_match_one_process(folders, tmp_path):
    cases = [(f, split_logits, {"folder": str(folders[f]), "seed": i})
             for i, f in enumerate(FAMILIES)]  # fmt: skip
    quantised = tmp_path / "llama-blocks"
    tiny_pair("llama", quantised, seed=7, **QUANT_SPLIT)
    cases += [(fmt, split_logits, {"folder": str(quantised), "seed": 7, "quantize": fmt})
              for fmt in QUANT_FORMATS]  # fmt: skip
    results = helpers.run_group(W, cases, tmp_path, TIMEOUT_S, DEADLINE_S)
    for i, f in enumerate(FAMILIES):
        errors = [v for status, v, _ in results[f] if status != "ok"]
        assert not errors, "\n".join(errors)
        got = [v for _, (v, _), _ in results[f]]
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)  # replicated outputs
        ids = _ids(i, 13)
        oracle = _logits(from_pretrained(folders[f], torch.float64), ids)
        naive = _logits(from_pretrained(folders[f], torch.float32), ids)
        assert_close_to_reference(got[0], oracle, naive, what=f"{f} logits")
        lean = [v for _, (_, v), _ in results[f]]
        one = all(b.rows_step().unusable() is None for b in from_pretrained(folders[f]).layers)
        assert lean == [one] * W, f"{f}: the ranks run the lean step {lean}, one process {one}"
    for fmt in QUANT_FORMATS:
        # The oracle: the same blocks dequantised in float64; the naive baseline: one process
        # with the blocks kept quantised (its kernel quantises activations as each rank's does).
        errors = [v for status, v, _ in results[fmt] if status != "ok"]
        assert not errors, "\n".join(errors)
        got = [v for _, (v, _), _ in results[fmt]]
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
        assert all(lean for _, (_, lean), _ in results[fmt])
        ids = _ids(7, 13)
        oracle = _logits(from_pretrained(quantised, torch.float64, quantize=fmt), ids)
        naive = _logits(from_pretrained(quantised, torch.float32, quantize=fmt), ids)
        assert_close_to_reference(got[0], oracle, naive, what=f"{fmt} split logits")


# -- the engine over two processes ----------------------------------------------------------------


def _prompts(seed: int, count: int) -> list[list[int]]:
    g = random.Random(seed)
    prefix = [g.randrange(2, VOCAB) for _ in range(9)]
    out = []
    for i in range(count):
        tail = [g.randrange(2, VOCAB) for _ in range(g.randint(1, 20))]
        out.append(prefix + tail if i % 2 else tail)
    return out


def _requests(seed: int):
    g = random.Random(seed)
    return [
        (p, SamplingParams(max_tokens=g.randint(1, 10), n=2 if i in (2, 5) else 1, **GREEDY))
        for i, p in enumerate(_prompts(seed, 8))
    ]


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(s.token_ids) for s in o.outputs] for o in outs]


@pytest.fixture
def tp_engine(folders):
    """``start(**engine_kwargs)``: a 2-process engine over the llama checkpoint, closed after."""
    started = []

    def start(folder=None, **kw):
        kw = {"kv_cache_bytes": 2**20, "page_size": P, "timeout_s": TIMEOUT_S, **kw}
        started.append(tensor_parallel_engine(folder or folders["llama"], W, **kw))
        return started[-1]

    yield start
    for e in started:
        e.close()
    assert not dist.is_initialized(), "close() left the process group"


def _one_page_bytes(folder) -> int:
    from selfattn.cache import kv_cache_bytes

    c = from_pretrained(folder).config
    return kv_cache_bytes(c.n_layers, c.n_kv_heads // W, c.head_dim, P, "fp32")


# The collectives' timeout in the engine test: long enough for a step of the tiny model on a
# loaded 2-core host (5 s timed out there), short enough that idling past it costs little.
STEP_TIMEOUT_S = 12


def test_engine_on_two_processes_equals_one_and_closes(folders, tp_engine):
    requests = _requests(seed=3)
    prompts, params = zip(*requests)
    one = Engine(from_pretrained(folders["llama"]), kv_cache_bytes=2**20, page_size=P)
    want = _tokens(one.generate(list(prompts), list(params)))
    # 16 pages per rank, at most 5 sequences and 12-token steps: preemption and chunked
    # prefill; n = 2 forks share pages until a write copies them on every rank.
    tp = tp_engine(kv_cache_bytes=16 * _one_page_bytes(folders["llama"]), max_num_seqs=5,
                   max_batch_tokens=12, timeout_s=STEP_TIMEOUT_S)  # fmt: skip
    assert tp.world_size == W and tp.kv.k_store.shape[3] == one.kv.k_store.shape[3] // W
    got = _tokens(tp.generate(list(prompts), list(params)))
    assert got == want
    assert tp.metrics.preemptions > 0, "the pool was meant to force preemption"
    assert tp.metrics.cached_prompt_tokens > 0, "no prefix was reused"
    # Idle longer than the collectives' timeout: the heartbeat keeps the worker waiting.
    time.sleep(STEP_TIMEOUT_S + 1)
    assert _tokens(tp.generate(list(prompts[:3]), list(params[:3]))) == want[:3]
    tp.check()
    tp.close()
    assert [w.wait(timeout=TIMEOUT_S) for w in tp._workers] == [0] * (W - 1)
    assert not dist.is_initialized()
    tp.close()  # idempotent


def test_deterministic_engine_on_two_processes(folders, tp_engine):
    """deterministic=True reaches the worker (its plans and kernels): a request's tokens and
    logprobs alone and among others, chunked by a small budget, are the same."""
    prompts = [p for p, _ in _requests(seed=5)]
    params = SamplingParams(max_tokens=6, logprobs=2, **GREEDY)
    tp = tp_engine(deterministic=True, max_batch_tokens=7, timeout_s=STEP_TIMEOUT_S)
    alone = tp.generate([prompts[0]], params)[0].outputs[0]
    batch = tp.generate(prompts, params)[0].outputs[0]
    assert (alone.token_ids, alone.logprobs) == (batch.token_ids, batch.logprobs)


def test_quantised_engine_speculates_on_two_processes(tmp_path, tp_engine):
    """A checkpoint kept quantised splits on its blocks, and speculative steps (drafts verified
    on every rank, rejected ones rolled back by the next step's lengths) give the greedy tokens
    of plain steps on the same split."""
    folder = tmp_path / "llama-blocks"
    tiny_pair("llama", folder, seed=5, **QUANT_SPLIT)
    g = random.Random(5)
    loop = [g.randrange(2, VOCAB) for _ in range(4)]
    prompts = [loop * 5, [g.randrange(2, VOCAB) for _ in range(11)], loop * 3 + [7]]
    params = SamplingParams(max_tokens=24, **GREEDY)
    plain = tp_engine(folder, quantize="int4")
    want = _tokens(plain.generate(prompts, [params] * len(prompts)))
    plain.close()
    spec = tp_engine(folder, quantize="int4", speculative="ngram",
                     num_speculative_tokens=3)  # fmt: skip
    got = _tokens(spec.generate(prompts, [params] * len(prompts)))
    assert got == want
    assert spec.metrics.spec_draft_tokens > 0, "no draft was verified"


def test_dead_worker_is_a_clear_error_on_rank_0(tp_engine):
    tp = tp_engine()
    prompt, params = _requests(seed=4)[0]
    tp.generate(prompt, params)
    worker = tp._workers[0]
    worker.kill()
    worker.wait(timeout=TIMEOUT_S)
    tp._check_workers = lambda: None  # skip the liveness check: the broadcast itself must fail
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        tp.generate(prompt, params)
    assert time.monotonic() - t0 < TIMEOUT_S, "the failure waited for the timeout"
    cause = info.value.__cause__
    assert isinstance(cause, TensorParallelError), repr(cause)
    assert "tensor-parallel step across 2 ranks failed" in str(cause)
    assert "rank 1: exited with code -9" in str(cause)
    with pytest.raises(RuntimeError) as again:  # every later step fails the same way
        tp.generate(prompt, params)
    assert isinstance(again.value.__cause__, TensorParallelError)


def test_bad_sizes_fail_before_any_worker_starts(folders, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            tensor_parallel_engine(folders["llama"], n)
    with pytest.raises(ValueError, match=r"n_kv_heads \(2\) must be divisible .* size \(4\)"):
        tensor_parallel_engine(folders["llama"], 4)
    with pytest.raises(ValueError, match=r"'cpu' .* or 'cuda'"):
        tensor_parallel_engine(folders["llama"], 2, device="meta")
    assert not started
    assert isinstance(tensor_parallel_engine(folders["llama"], 1), Engine)
