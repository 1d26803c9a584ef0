"""Hooks on one Engine request (selfattn.inspect.RequestHooks): its rows of each packed step
are captured and edited, its neighbours untouched.

Oracle: the same model run alone through ``hooks`` (capture: one forward over the prompt and
the output; edit: ``generate`` on the static cache with the same edit)."""

from __future__ import annotations

import pytest
import torch

from selfattn.inspect import RequestHooks, hooks, zero_ablation
from selfattn.models import generate
from selfattn.serving import Engine, SamplingParams
from selfattn.testing import assert_close_to_reference
from tests.models.test_generate_compress import tiny

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 64
GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=6)


def prompts(seed: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(5, 30, (count,), generator=g)]  # fmt: skip


def run(engine, batch, hooked_at, h):
    ids = []
    for i, p in enumerate(batch):
        ids.append(engine.add_request(p, SamplingParams(**GREEDY),
                                      hooks=h if i == hooked_at else None))  # fmt: skip
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def test_capture_follows_one_request_through_chunks_and_steps():
    model = tiny(dtype=torch.float32)
    model64 = tiny(dtype=torch.float64)
    batch = prompts(0, 5)
    engine = Engine(model, page_size=4, max_batch_tokens=16)  # prompts span chunks
    h = RequestHooks(capture=["blocks.1.hook_resid_post", "blocks.2.attn.hook_z"])
    outs = run(engine, batch, 2, h)
    whole = torch.tensor([batch[2] + outs[2][:-1]])
    with hooks(model64, capture=["blocks.1.hook_resid_post", "blocks.2.attn.hook_z"]) as c64:
        model64(whole)
    with hooks(model, capture=["blocks.1.hook_resid_post", "blocks.2.attn.hook_z"]) as c32:
        model(whole)
    for name in ("blocks.1.hook_resid_post", "blocks.2.attn.hook_z"):
        got = h.cache.stacked(name)
        assert got.shape == c64[name].shape
        assert_close_to_reference(got, c64[name], c32[name], factor=4.0)
    assert engine.kv.pool.num_used == engine.kv.index.num_cached_pages  # no page leaked


def test_an_edit_changes_its_request_only():
    model = tiny(dtype=torch.float64)
    batch = prompts(1, 4)
    plain = run(Engine(model, page_size=4), batch, None, None)
    edit = {"blocks.1.attn.hook_z": zero_ablation(heads=[0, 1])}
    got = run(Engine(model, page_size=4), batch, 1, RequestHooks(edit=edit))
    assert got[0] == plain[0] and got[2:] == plain[2:]
    with hooks(model, edit=edit):
        want = generate(model, torch.tensor([batch[1]]), 6, cache="static", ignore_eos=True)
    assert got[1] == want[0, len(batch[1]) :].tolist()
    assert got[1] != plain[1]  # the edit mattered


def test_refusals_name_the_fix():
    model = tiny(dtype=torch.float32)
    engine = Engine(model, page_size=4)
    with pytest.raises(ValueError, match="computes no attention weights"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2),
                           hooks=RequestHooks(capture="blocks.0.attn.hook_pattern"))  # fmt: skip
    with pytest.raises(ValueError, match="hooks follow one sequence"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, n=2),
                           hooks=RequestHooks(capture="*resid_post"))  # fmt: skip
    with pytest.raises(ValueError, match="no hook point matches"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2),
                           hooks=RequestHooks(capture="blocks.9.hook_z"))  # fmt: skip
