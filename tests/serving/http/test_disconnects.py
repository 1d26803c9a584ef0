"""Clients that leave at every point of a request's life, and clients that send slowly: each
request they leave is aborted at once (its pages freed, counted in ``/metrics``), and nobody
else waits on them."""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from selfattn.serving import Engine  # noqa: E402
from selfattn.serving.server import build_app  # noqa: E402
from tests._serving_helpers import running_server  # noqa: E402

TIMEOUT_S = 30
NAME = "tiny"

pytestmark = pytest.mark.usefixtures("single_thread")


def raw(url: str, body: dict, *, send_body: bool = True, cut: int = 0) -> socket.socket:
    """A POST to /v1/completions on a socket of its own: the headers, then the body (or its
    first ``cut`` bytes only)."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\n\r\n").encode()  # fmt: skip
    s.sendall(head + (data if send_body else data[:cut]))
    return s


def until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def idle(engine: Engine) -> bool:
    cached = 0 if engine.kv.index is None else engine.kv.index.num_cached_pages
    return not engine.has_unfinished() and engine.kv.pool.num_used == cached


def long_body(**kw) -> dict:
    return {"model": NAME, "prompt": "w5 w6 w7", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, **kw}  # fmt: skip


@pytest.mark.parametrize("where", ["waiting", "computing", "streaming"])
def test_a_client_that_leaves_is_aborted_at_once(model, tokenizer, where):
    """Gone while its request waits for admission, while it computes (no byte sent yet), or
    mid-stream: its request ends as aborted, its pages are freed, the others finish."""
    engine = Engine(model, tokenizer, kv_cache_bytes=2**21, max_num_seqs=1)
    with running_server(build_app(engine, model_name=NAME)) as url:
        first = raw(url, long_body(stream=True))
        first.recv(1)  # running: it holds the one sequence slot
        if where == "waiting":
            gone = raw(url, long_body())
            until(lambda: engine.num_waiting() >= 1, "the second request never queued")
        elif where == "computing":
            first.close()
            until(lambda: idle(engine), "the first request was not aborted")
            gone = raw(url, long_body())
            until(lambda: engine.metrics.running == 1, "the request never ran")
            first = None
        else:
            gone = first
            first = None
        aborted = engine.metrics.requests_aborted
        gone.close()
        until(lambda: engine.metrics.requests_aborted > aborted, f"not aborted ({where})")
        if first is not None:  # the one still connected is served in full
            first.settimeout(TIMEOUT_S)
            chunks = b""
            while b"[DONE]" not in chunks:
                part = first.recv(65536)
                assert part, "the remaining stream was cut"
                chunks += part
            first.close()
        until(lambda: idle(engine), "pages left behind")
        metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
        assert "selfattn_requests_aborted_total" in metrics
    engine.check()


def test_a_slow_upload_holds_only_its_connection(model, tokenizer):
    """Half a body, then nothing: no engine work starts for it, others are served meanwhile,
    and when it hangs up nothing is left."""
    engine = Engine(model, tokenizer, kv_cache_bytes=2**21)
    with running_server(build_app(engine, model_name=NAME)) as url:
        slow = raw(url, long_body(), send_body=False, cut=20)
        t0 = time.monotonic()
        ok = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT_S,
                        json={**long_body(), "max_tokens": 3})  # fmt: skip
        assert ok.status_code == 200 and time.monotonic() - t0 < TIMEOUT_S / 2
        assert not engine.has_unfinished()
        slow.close()
        time.sleep(0.2)
        assert idle(engine)
    engine.check()
