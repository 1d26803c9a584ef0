"""The server's limits against clients that would take more than their share
(:class:`~selfattn.serving.config.ServerLimits`, :mod:`selfattn.serving.http.limits`, the
per-request caps of :mod:`selfattn.serving.protocol`).

A body over the limit is answered 413 before the rest of it is read (the client is still
sending), while other requests are served; a text prompt that cannot fit is refused untokenised,
and tokenisation runs off the event loop; each per-request cap is a 400 naming its field;
connections beyond the bound get 503; a stream whose client stops reading is dropped (its request
aborted, its pages freed, counted on /metrics) while another stream is served in full. Each
network call has a timeout (``TIMEOUT_S``), each wait a deadline; the server runs on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from selfattn.serving import SamplingParams  # noqa: E402
from selfattn.serving.config import ServerLimits  # noqa: E402
from selfattn.serving.protocol import (  # noqa: E402
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    PROMPT_CHARS_PER_TOKEN,
)
from selfattn.serving.server import build_app  # noqa: E402
from tests._serving_helpers import running_server  # noqa: E402
from tests.serving.http.test_server import make_engine, wait_for  # noqa: E402

TIMEOUT_S = 20  # any one HTTP call or wait
NAME = "tiny"
OK = {"model": NAME, "prompt": "w5 w6", "max_tokens": 2}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}

pytestmark = pytest.mark.usefixtures("single_thread")


@contextlib.contextmanager
def served(model, tokenizer, engine_kw=None, server_kw=None, **app_kw):
    """(engine, base URL, the app's state) of a server running on a thread for the block."""
    engine = make_engine(model, tokenizer, **(engine_kw or {}))
    app = build_app(engine, model_name=NAME, **app_kw)
    with running_server(app, **(server_kw or {})) as url:
        yield engine, url, app.state.selfattn


def greedy_text(model, tokenizer, prompt: str, max_tokens: int) -> str:
    """What a greedy completion of ``prompt`` answers: ``Engine.generate`` on a fresh engine."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return make_engine(model, tokenizer).generate(prompt, sp)[0].outputs[0].text


def connect(url: str, **opts) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    for opt, value in opts.items():
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), value)
    sock.settimeout(TIMEOUT_S)
    sock.connect((host, int(port)))
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, what came of the body) of the one response on ``sock``, read until
    the server closes the connection."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def assert_error(status: int, body: bytes, want: int, param, *words) -> dict:
    error = json.loads(body)["error"]
    assert status == want, (status, error)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


# -- the request body ------------------------------------------------------------------------------

BIG = 64 * 2**20  # the user's 64 MiB prompt


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_64_mib_body_gets_413_before_it_is_read_while_others_are_served(
    model, tokenizer, framing
):
    want = greedy_text(model, tokenizer, "w5 w6 w7", 6)
    with served(model, tokenizer) as (engine, url, _):
        limit = ServerLimits().request_bytes(engine.max_model_len)
        sock = connect(url)
        length = (b"Content-Length: %d" % BIG) if framing == "content-length" else (
            b"Transfer-Encoding: chunked")  # fmt: skip
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n%s\r\n\r\n" % length)  # fmt: skip
        sent = [0]

        def upload():  # the body in 64 KiB pieces until the server stops taking them
            piece = b"a " * 2**15
            with contextlib.suppress(OSError):
                while sent[0] < BIG:
                    sock.sendall(piece if framing == "content-length" else
                                 b"%x\r\n%s\r\n" % (len(piece), piece))  # fmt: skip
                    sent[0] += len(piece)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            uploading = pool.submit(upload)
            ordinary = pool.submit(httpx.post, f"{url}/v1/completions", timeout=TIMEOUT_S,
                                   json={"model": NAME, "prompt": "w5 w6 w7", "max_tokens": 6,
                                         "temperature": 0, "ignore_eos": True})  # fmt: skip
            status, headers, body = read_response(sock)
            sock.close()
            uploading.result(TIMEOUT_S)
            r = ordinary.result(TIMEOUT_S)
        error = assert_error(status, body, 413, None, str(limit), "--max-request-bytes")
        assert error["code"] == "request_too_large" and headers["connection"] == "close"
        assert sent[0] < BIG, "the server read the whole body before answering"
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert engine.num_waiting() == 0 and not engine.scheduler.running


def test_a_body_within_the_limit_is_served_and_the_limit_is_settable(model, tokenizer):
    body = json.dumps({**OK, "user": "u" * 3000}).encode()
    kw = {"timeout": TIMEOUT_S, "headers": {"content-type": "application/json"}}
    with served(model, tokenizer, limits=ServerLimits(max_request_bytes=len(body))) as (_, url, _):
        r = httpx.post(f"{url}/v1/completions", content=body, **kw)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/completions", content=body + b" ", **kw)
        assert_error(r.status_code, r.content, 413, None, str(len(body)))
        assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200


@pytest.mark.parametrize(
    "bad", [{"max_request_bytes": 0}, {"max_connections": -1}, {"max_stream_backlog": 1.5}]
)
def test_server_limits_are_checked(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=f"ServerLimits {name} .*{bad[name]!r}"):
        ServerLimits(**bad)


# -- prompts ---------------------------------------------------------------------------------------


@pytest.fixture
def spied(model, tokenizer, monkeypatch):
    """A server whose tokenizer records, per call, whether an event loop runs on its thread."""
    calls = []

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    for name in ("encode", "apply_chat_template"):
        real = getattr(tokenizer, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append((_name, on_loop()))
            return _real(*args, **kw)

        monkeypatch.setattr(tokenizer, name, spy)
    with served(model, tokenizer) as (engine, url, _):
        yield engine, url, calls


def test_a_prompt_too_long_to_fit_is_refused_untokenised(spied):
    engine, url, calls = spied
    words = PROMPT_CHARS_PER_TOKEN * engine.max_model_len // 3 + 1  # "w5 " is 3 characters
    text = "w5 " * words
    r = httpx.post(f"{url}/v1/completions", json={**OK, "prompt": text}, timeout=TIMEOUT_S)
    error = assert_error(r.status_code, r.content, 400, "prompt", str(len(text)),
                         str(engine.max_model_len))  # fmt: skip
    assert error["code"] == "context_length_exceeded"
    chat = {**CHAT, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=TIMEOUT_S)
    assert_error(r.status_code, r.content, 400, "messages", str(len(text)))
    assert calls == [], "the over-long prompts were tokenised"
    # one that fits the characters' bound but not the context: tokenised, then a 400
    r = httpx.post(f"{url}/v1/completions", json={**OK, "prompt": "w5 " * 200},
                   timeout=TIMEOUT_S)  # fmt: skip
    assert_error(r.status_code, r.content, 400, "prompt", "200 tokens")


def test_prompts_are_tokenised_off_the_event_loop(spied):
    _, url, calls = spied
    assert httpx.post(f"{url}/v1/completions", json=OK, timeout=TIMEOUT_S).status_code == 200
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=TIMEOUT_S).status_code == 200
    names = [name for name, _ in calls]
    assert "encode" in names and "apply_chat_template" in names, calls
    assert not any(on_loop for _, on_loop in calls), calls


# -- per-request caps ------------------------------------------------------------------------------

MAX_NUM_SEQS = 4
CAPS = {
    "n > max_num_seqs": ("/v1/completions", {**OK, "n": MAX_NUM_SEQS + 1}, "n"),
    "best_of > max_num_seqs": ("/v1/completions", {**OK, "best_of": MAX_NUM_SEQS + 1}, "best_of"),
    "chat n > max_num_seqs": ("/v1/chat/completions", {**CHAT, "n": MAX_NUM_SEQS + 1}, "n"),
    "max_tokens > context": ("/v1/completions", {**OK, "max_tokens": 10**9}, "max_tokens"),
    "logprobs 21": ("/v1/completions", {**OK, "logprobs": 21}, "logprobs"),
    "chat top_logprobs 21": (
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    "5 stop strings": ("/v1/completions", {**OK, "stop": ["w1", "w2", "w3", "w4", "w7"]}, "stop"),
    "a long stop string": ("/v1/completions", {**OK, "stop": "w" * (MAX_STOP_CHARS + 1)}, "stop"),
    "logit_bias entries": (
        "/v1/chat/completions",
        {**CHAT, "logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}},
        "logit_bias",
    ),
}


@pytest.fixture(scope="module")
def capped(model, tokenizer):
    with served(model, tokenizer, {"max_num_seqs": MAX_NUM_SEQS}) as (engine, url, _):
        yield engine, url


@pytest.mark.parametrize("case", CAPS.values(), ids=CAPS.keys())
def test_each_cap_is_a_400_naming_its_field(capped, case):
    engine, url = capped
    path, body, field = case
    r = httpx.post(url + path, json=body, timeout=TIMEOUT_S)
    assert_error(r.status_code, r.content, 400, field, field.split("_")[0])
    assert engine.num_waiting() == 0 and not engine.scheduler.running
    assert httpx.post(f"{url}/v1/completions", json=OK, timeout=TIMEOUT_S).status_code == 200


def test_n_at_the_running_set_is_served(capped):
    _, url = capped
    r = httpx.post(f"{url}/v1/completions", json={**OK, "n": MAX_NUM_SEQS}, timeout=TIMEOUT_S)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_NUM_SEQS


# -- connections -----------------------------------------------------------------------------------


def test_connections_beyond_the_bound_get_503(model, tokenizer):
    # uvicorn counts the connection asking: with a bound of 3, two others fill it
    with served(model, tokenizer, server_kw={"limit_concurrency": 3}) as (_, url, _):
        idle = [connect(url), connect(url)]
        try:
            r = httpx.post(f"{url}/v1/completions", json=OK, timeout=TIMEOUT_S)
            assert r.status_code == 503
            idle.pop().close()  # the server sees it gone soon after: then a request fits

            def served_now() -> bool:
                return httpx.post(f"{url}/v1/completions", json=OK,
                                  timeout=TIMEOUT_S).status_code == 200  # fmt: skip

            wait_for(served_now, "a request to be served once a connection closed")
        finally:
            for sock in idle:
                sock.close()


# -- slow clients ----------------------------------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="accepted sockets inherit SO_SNDBUF on Linux")
def test_a_stream_whose_client_stops_reading_is_dropped_and_others_are_served(model, tokenizer):
    prompt, n_tokens = "w5 w6 w7", 100
    want = greedy_text(model, tokenizer, prompt, n_tokens)
    limits = ServerLimits(max_stream_backlog=4)
    with served(model, tokenizer, {"prefix_caching": False}, {"send_buffer": 4096},
                limits=limits) as (engine, url, state):  # fmt: skip
        pages = engine.kv.num_pages
        # events of ~3 KB a step (4 samples, 20 alternatives each): the server's buffers fill
        # within ~30 of its 100 steps, then its outputs wait for a client that never reads
        stalled = {"model": NAME, "prompt": prompt, "max_tokens": n_tokens, "n": 4,
                   "logprobs": 20, "stream": True, "ignore_eos": True}  # fmt: skip
        payload = json.dumps(stalled).encode()
        slow = connect(url, SO_RCVBUF=4096)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload),
                                                                             payload))  # fmt: skip
        reader = {"model": NAME, "prompt": prompt, "max_tokens": n_tokens, "temperature": 0,
                  "stream": True, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=reader, timeout=TIMEOUT_S) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want
        wait_for(lambda: state.streams_dropped == 1, "the stalled stream to be dropped")
        wait_for(lambda: engine.kv.pool.num_free == pages, "its pages to be freed")
        assert engine.metrics.requests_aborted == 1 and engine.metrics.requests_finished == 1
        _, _, body = read_response(slow)  # the server closed it: the read ends
        slow.close()
        assert not body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), "the stream was finished"
        metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
        assert 'selfattn_streams_dropped_total{model="tiny"} 1.0' in metrics
        r = httpx.post(f"{url}/v1/completions", json=OK, timeout=TIMEOUT_S)
        assert r.status_code == 200
    engine.check()
