"""The server against its own schema: Schemathesis draws requests from ``/openapi.json`` (every
route, bodies valid and not) and checks every answer: no 5xx, each status documented, each body
and media type as the document says. Then an ordinary request is served as before.

Bounded here (``SELFATTN_SCHEMA_EXAMPLES`` per route, default 20, with a key and then without
one); ``python -m selfattn.benchmarks.schema_fuzz`` runs it longer against ``selfattn serve``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("schemathesis")

from selfattn.benchmarks.schema_fuzz import fuzz  # noqa: E402
from selfattn.serving import Engine  # noqa: E402
from selfattn.serving.server import build_app  # noqa: E402
from tests._serving_helpers import running_server  # noqa: E402

EXAMPLES = int(os.environ.get("SELFATTN_SCHEMA_EXAMPLES", "20"))
KEY = "sk-test"

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("with_key", [True, False], ids=["key", "no-key"])
def test_every_route_answers_as_documented(model, tokenizer, with_key):
    engine = Engine(model, tokenizer, kv_cache_bytes=2**21, max_model_len=64)
    app = build_app(engine, model_name="tiny", api_key=KEY)
    with running_server(app) as url:
        headers = {"Authorization": f"Bearer {KEY}"} if with_key else {}
        report = fuzz(url, EXAMPLES, headers=headers, seed=0, model="tiny")
        assert report["requests"] >= 5 * EXAMPLES // 2, report
        assert report["failures"] == [], report["failures"][:5]
        assert not any(str(code).startswith("5") for code in report["statuses"]), report
        if not with_key:
            assert set(report["statuses"]) <= {"401", "413"}, report["statuses"]
        body = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 3}
        auth = {"Authorization": f"Bearer {KEY}"}
        ok = httpx.post(f"{url}/v1/completions", headers=auth, json=body, timeout=30)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 1
    engine.check()
