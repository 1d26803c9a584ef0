"""EngineLoop, the one loop stepping an engine: its thread ends with the work unless a server
holds it, a held loop keeps generate() off the engine, stop() drains, and generate() steps on the
caller's thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

transformers = pytest.importorskip("transformers")

from selfattn.serving import Engine, SamplingParams  # noqa: E402
from selfattn.serving.loop import ShuttingDown  # noqa: E402
from tests.models.test_models_decoder import tiny_pair  # noqa: E402

TIMEOUT_S = 30
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_pair("llama", tmp_path_factory.mktemp("llama"), seed=6)[1]


def make_engine(model) -> Engine:
    return Engine(model, kv_cache_bytes=1 << 20, page_size=4, admit_window_s=0.0)


def test_generate_steps_on_the_callers_thread(model, monkeypatch):
    engine = make_engine(model)
    threads = set()
    real = engine.step

    def step():
        threads.add(threading.current_thread())
        return real()

    monkeypatch.setattr(engine, "step", step)
    (out,) = engine.generate([3, 4, 5], PARAMS)
    assert len(out.outputs[0].token_ids) == 4
    assert threads == {threading.current_thread()} and not engine.loop.alive


def test_the_stream_thread_ends_with_the_work_and_comes_back(model):
    engine = make_engine(model)

    async def run(prompt):
        return [out async for out in engine.stream(prompt, PARAMS)][-1]

    for prompt in ([3, 4], [5, 6, 7]):
        last = asyncio.run(run(prompt))
        assert last.finished and len(last.outputs[0].token_ids) == 4
        deadline = time.monotonic() + TIMEOUT_S
        while engine.loop.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.loop.alive
    engine.close()
    engine.check()


def test_a_held_loop_refuses_generate_and_stop_drains(model):
    engine = make_engine(model)
    loop = engine.loop
    loop.start(hold=True)
    with pytest.raises(RuntimeError, match="server worker steps this engine"):
        engine.generate([3, 4], PARAMS)
    got = []

    async def submit_and_stop():
        queue = asyncio.Queue()
        loop.submit([3, 4, 5], PARAMS, "r", asyncio.get_running_loop(), queue)
        await asyncio.to_thread(loop.stop, TIMEOUT_S)  # drains: the request runs to its end
        while not queue.empty():
            got.append((await queue.get())[1])

    asyncio.run(submit_and_stop())
    assert got[-1].finished and len(got[-1].outputs[0].token_ids) == 4
    assert not loop.alive and not loop.held
    assert engine.generate([3, 4], PARAMS)[0].finished  # the loop takes requests again
    engine.check()


def test_a_draining_loop_takes_no_new_requests(model, monkeypatch):
    engine = make_engine(model)
    loop, release, real = engine.loop, threading.Event(), engine.step

    def step():  # holds the drain open until the test has seen the refusal
        release.wait(TIMEOUT_S)
        return real()

    monkeypatch.setattr(engine, "step", step)
    asyncio.run(_submit(loop, [3, 4]))
    stopper = threading.Thread(target=loop.stop, args=(TIMEOUT_S,))
    stopper.start()
    deadline = time.monotonic() + TIMEOUT_S
    with pytest.raises(ShuttingDown, match="shutting down"):
        while time.monotonic() < deadline:  # until stop() has begun draining
            loop.add([5, 6], PARAMS)
            time.sleep(0.01)
    release.set()
    stopper.join(TIMEOUT_S)
    assert not loop.alive and not engine.has_unfinished()
    engine.check()


async def _submit(loop, prompt) -> None:
    loop.submit(prompt, PARAMS, None, asyncio.get_running_loop(), asyncio.Queue())
