"""Faults inside the server: a forward that raises in the middle of a batch, a tokenizer that
fails on one prompt, a pool too small for the requests at once. Each fails only what it must
(OpenAI's error JSON, or an error event in a stream, never the server's paths or a trace), and
the server goes on serving with no page leaked."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from selfattn.cache import kv_cache_bytes  # noqa: E402
from selfattn.serving import Engine  # noqa: E402
from selfattn.serving.server import build_app  # noqa: E402
from tests._serving_helpers import running_server  # noqa: E402

TIMEOUT_S = 60
NAME = "tiny"
SECRET = "/srv/secret/build/kernel.so"  # what a fault's message names, never sent out

pytestmark = pytest.mark.usefixtures("single_thread")


def drained(engine: Engine) -> None:
    engine.check()
    assert not engine.has_unfinished()
    cached = 0 if engine.kv.index is None else engine.kv.index.num_cached_pages
    assert engine.kv.pool.num_used == cached


def body(n: int, **kw) -> dict:
    return {"model": NAME, "prompt": "w5 w6 w7", "max_tokens": n, "temperature": 0,
            "ignore_eos": True, **kw}  # fmt: skip


def test_a_forward_that_raises_fails_its_step_only(model, tokenizer, monkeypatch):
    engine = Engine(model, tokenizer, kv_cache_bytes=2**21)
    armed, forward = threading.Event(), engine._forward

    def failing(x, step, rows):
        if armed.is_set():
            armed.clear()
            raise RuntimeError(f"the kernel at {SECRET} failed")
        return forward(x, step, rows)

    monkeypatch.setattr(engine, "_forward", failing)
    with running_server(build_app(engine, model_name=NAME)) as url:
        events, answer = [], {}

        def plain():
            answer["r"] = httpx.post(f"{url}/v1/completions", json=body(100), timeout=TIMEOUT_S)

        with httpx.stream("POST", f"{url}/v1/completions", json=body(100, stream=True),
                          timeout=TIMEOUT_S) as r:  # fmt: skip
            lines = r.iter_lines()
            events.append(next(x for x in lines if x.startswith("data: ")))
            other = threading.Thread(target=plain)
            other.start()
            deadline = time.monotonic() + TIMEOUT_S
            while engine.metrics.running < 2:  # both in the batch
                assert time.monotonic() < deadline, "the second request never ran"
                time.sleep(0.001)
            armed.set()
            events += [x for x in lines if x.startswith("data: ")]
        other.join(TIMEOUT_S)
        failed = json.loads(events[-2][6:])
        assert events[-1] == "data: [DONE]" and failed["error"]["type"] == "server_error"
        assert SECRET not in events[-2] and "RuntimeError" in failed["error"]["message"]
        r = answer["r"]
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert SECRET not in r.text
        after = httpx.post(f"{url}/v1/completions", json=body(4), timeout=TIMEOUT_S)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    drained(engine)


def test_a_tokenizer_error_fails_that_request_only(model, tokenizer, monkeypatch):
    engine = Engine(model, tokenizer, kv_cache_bytes=2**21)
    encode = tokenizer.encode

    def fragile(text, *a, **kw):
        if "w9 w9 w9" in text:
            raise UnicodeError(f"cannot read {SECRET}")
        return encode(text, *a, **kw)

    monkeypatch.setattr(tokenizer, "encode", fragile)
    with running_server(build_app(engine, model_name=NAME)) as url:
        bad = httpx.post(f"{url}/v1/completions", json={**body(3), "prompt": "w9 w9 w9"},
                         timeout=TIMEOUT_S)  # fmt: skip
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
        assert SECRET not in bad.text and "Traceback" not in bad.text
        ok = httpx.post(f"{url}/v1/completions", json=body(3), timeout=TIMEOUT_S)
        assert ok.status_code == 200
    drained(engine)


def test_a_pool_smaller_than_the_requests_serves_them_all(model, tokenizer):
    """Eight requests whose pages together outgrow the pool: preemption and recompute, every
    answer whole and equal to its own greedy run, no page left behind."""
    c = model.config
    one_page = kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, 16, "fp32")
    # 8 pages: four 2-page prompts are admitted at once, and their 24 new tokens outgrow them
    engine = Engine(model, tokenizer, kv_cache_bytes=8 * one_page, page_size=16)
    alone = Engine(model, tokenizer, kv_cache_bytes=2**21)
    prompts = [" ".join(f"w{3 + (i * 7 + j) % 50}" for j in range(20 + i)) for i in range(8)]
    step, started = engine.step, []

    def step_once_all_arrived():  # the first step waits for the eight (arrival is a race)
        if not started:
            until = time.monotonic() + TIMEOUT_S
            while engine.num_waiting() < len(prompts) and time.monotonic() < until:
                time.sleep(0.005)
            started.append(True)
        return step()

    engine.step = step_once_all_arrived
    with running_server(build_app(engine, model_name=NAME)) as url:
        answers = [None] * len(prompts)

        def ask(i):
            mine = {**body(24), "prompt": prompts[i]}
            answers[i] = httpx.post(f"{url}/v1/completions", json=mine, timeout=TIMEOUT_S)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
    from selfattn.serving import SamplingParams

    want = alone.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for r, w in zip(answers, want):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == w.outputs[0].text
    assert engine.metrics.preemptions > 0
    drained(engine)
