"""KV compression over HTTP: the ``kv_compression`` field on completions and chat, the server
default, the per-policy counters on /metrics and the 400s, on a tiny random byte-level Llama."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from selfattn.cache.compress import press  # noqa: E402
from selfattn.models import from_pretrained, generate, load_tokenizer  # noqa: E402
from selfattn.serving import Engine  # noqa: E402
from selfattn.serving.server import build_app  # noqa: E402
from tests._serving_helpers import running_server, save_tiny_byte_llama  # noqa: E402

TIMEOUT_S = 30
NAME = "tiny-compress"
TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
TEXT = "the quick brown fox jumps over the lazy dog, " * 3

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = save_tiny_byte_llama(tmp_path_factory.mktemp("tiny-byte-llama"), TEMPLATE)
    model, tok = from_pretrained(folder).eval(), load_tokenizer(folder)
    engine = Engine(model, tok, kv_cache_bytes=2**22, kv_compression="knorm:0.5")
    with (
        running_server(build_app(engine, model_name=NAME)) as url,
        httpx.Client(base_url=url, timeout=TIMEOUT_S) as client,
    ):
        yield client, engine, model, tok


def greedy(**kw):
    return {"model": NAME, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, **kw}


def expected(model, tok, text, p):
    ids = tok.encode(text)
    ids = getattr(ids, "ids", ids)
    out = generate(model, torch.tensor([ids]), 5, kv_compression=p)[0, len(ids) :]
    return out.tolist()


def test_the_field_and_the_default_run_the_policy(served):
    client, engine, model, tok = served
    spec = {"policy": "snapkv", "ratio": 0.5, "window": 8}
    r = client.post("/v1/completions", json=greedy(prompt=TEXT, kv_compression=spec))
    assert r.status_code == 200, r.text
    before = engine.metrics.kv_compression_by_policy["snapkv"][0]
    assert before >= 1
    want = expected(model, tok, TEXT, press("snapkv", 0.5, window=8))
    assert tok.decode(want) == r.json()["choices"][0]["text"]
    r = client.post("/v1/chat/completions",
                    json=greedy(messages=[{"role": "user", "content": TEXT}]))  # fmt: skip
    assert r.status_code == 200, r.text
    assert engine.metrics.kv_compression_by_policy["knorm"][0] >= 1  # the server's default
    r = client.post("/v1/completions", json=greedy(prompt=TEXT, kv_compression="none"))
    assert r.status_code == 200
    metrics = client.get("/metrics").text
    assert f'selfattn_kv_compression_prompts_total{{model="{NAME}",policy="snapkv"}}' in metrics
    assert "selfattn_kv_compression_pages_saved_total" in metrics


@pytest.mark.parametrize(
    "spec, match",
    [
        ("nope:0.5", "unknown KV-compression policy"),
        ({"policy": "snapkv", "ratio": 1.5}, "compression_ratio"),
        ("kivi4", "--kv-dtype kivi4"),
        ({"policy": "snapkv", "budget": 2}, "budget 2 is below"),
        (7, "kv_compression"),
        ({"policy": "knorm", "decode_budget": 16}, "'knorm' scores the prompt only"),
        ({"policy": "tova", "decode_budget": 0}, "decode_budget"),
        ({"policy": "tova", "decode_budget": 16, "decode_interval": -1}, "decode_interval"),
        ("tova,decode_budget=many", "'decode_budget=many' must be KEY=INT"),
    ],
)
def test_bad_policies_are_400s_naming_the_field(served, spec, match):
    client = served[0]
    r = client.post("/v1/completions", json=greedy(prompt="hi", kv_compression=spec))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"]


def test_decode_budget_evicts_while_generating_and_is_counted(served):
    """``decode_budget`` over HTTP (object and string forms): the request generates, its cache
    is cut back during decoding, counted per policy on /metrics; the schema lists the keys."""
    client, engine, *_ = served
    for spec in ({"policy": "tova", "decode_budget": 16, "decode_interval": 8},
                 "streaming_llm,decode_budget=16,decode_interval=8"):  # fmt: skip
        body = greedy(prompt=TEXT, kv_compression=spec, max_tokens=40)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 40
    by = engine.metrics.kv_decode_eviction_by_policy
    assert by["tova"][0] >= 1 and by["streaming_llm"][0] >= 1
    metrics = client.get("/metrics").text
    assert f'selfattn_kv_decode_evictions_total{{model="{NAME}",policy="tova"}}' in metrics
    schema = client.get("/openapi.json").json()["components"]["schemas"]["KVCompressionSpec"]
    assert {"policy", "ratio", "budget", "decode_budget", "decode_interval"} <= set(
        schema["properties"]
    )
