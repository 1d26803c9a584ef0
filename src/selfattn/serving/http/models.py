"""``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus).

``/metrics`` is written by ``prometheus_client`` from the engine's
:class:`~selfattn.serving.EngineMetrics` at each scrape (a collector on a registry of the
request's own: no process-global state, two apps in one process do not mix, and the text format,
escaping and histogram conventions are the reference implementation's rather than ours).
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations as objects.
from selfattn._optional import require
from selfattn.serving.http.common import error_response, responses, state

fastapi = require("fastapi", extra="serve", purpose="the OpenAI server")
prom = require("prometheus_client", extra="serve", purpose="the server's /metrics")
prom_core = require("prometheus_client.core", extra="serve")

router = fastapi.APIRouter()


@router.get("/health")
async def health(request: fastapi.Request):
    loop = state(request).loop
    if loop is not None and loop.held and not loop.alive:
        return error_response(503, "the engine worker thread has stopped", "server_error")
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: fastapi.Request):
    s = state(request)
    data = []
    if s.engine is not None:
        data.append({"id": s.model_name, "object": "model", "created": s.created,
                     "owned_by": "selfattn", "max_model_len": s.engine.max_model_len})  # fmt: skip
    if s.encoder is not None:
        data.append({"id": s.embedding_model_name, "object": "model", "created": s.created,
                     "owned_by": "selfattn"})  # fmt: skip
    return {"object": "list", "data": data}


@router.get("/metrics")
async def metrics(request: fastapi.Request):
    s = state(request)
    registry = prom.CollectorRegistry()
    if s.engine is not None:
        registry.register(_EngineCollector(s.engine, s.model_name, s.streams_dropped))
    return responses.Response(prom.generate_latest(registry),
                              media_type=prom.CONTENT_TYPE_LATEST)  # fmt: skip


class _EngineCollector:
    """The engine's gauges, counters and histograms at scrape time (module docstring)."""

    def __init__(self, engine, model_name: str, streams_dropped: int):
        self.engine, self.model, self.streams_dropped = engine, model_name, streams_dropped

    def _family(self, kind, name: str, doc: str):
        return kind(f"selfattn_{name}", doc, labels=["model"])

    def gauge(self, name, doc, value):
        g = self._family(prom_core.GaugeMetricFamily, name, doc)
        g.add_metric([self.model], value)
        return g

    def counter(self, name, doc, value):
        c = self._family(prom_core.CounterMetricFamily, name, doc)
        c.add_metric([self.model], value)
        return c

    def histogram(self, name, doc, h):
        out = self._family(prom_core.HistogramMetricFamily, name, doc)
        buckets = [("+Inf" if le == float("inf") else repr(le), n) for le, n in h.cumulative()]
        out.add_metric([self.model], buckets, h.sum)
        return out

    def compression(self, m):
        """KV compression's counters, labelled by policy as well as model."""
        prompt = (
            ("kv_compression_prompts", "Prompts whose KV was compressed.", 0),
            ("kv_compression_skipped", "Prompts too short for their policy, left whole.", 1),
            ("kv_compression_evicted_tokens", "Prompt tokens evicted from the KV cache.", 2),
            ("kv_compression_pages_saved", "KV pages compressed prompts gave back.", 3),
        )
        decode = (
            ("kv_decode_evictions", "Cuts of generating sequences back to a decode_budget.", 0),
            ("kv_decode_evicted_tokens", "Tokens evicted from the KV cache during decoding.", 1),
            ("kv_decode_pages_freed", "KV pages decode-time eviction gave back.", 2),
        )
        for by_policy, kinds in ((m.kv_compression_by_policy, prompt),
                                 (m.kv_decode_eviction_by_policy, decode)):  # fmt: skip
            for name, doc, i in kinds:
                c = prom_core.CounterMetricFamily(
                    f"selfattn_{name}", doc, labels=["model", "policy"]
                )
                for policy, counts in sorted(by_policy.items()):
                    c.add_metric([self.model, policy], counts[i])
                yield c

    def collect(self):
        m, gauge, counter = self.engine.metrics, self.gauge, self.counter
        yield gauge("num_requests_running", "Requests running in the engine.", m.running)
        yield gauge("num_requests_waiting", "Requests waiting for admission.", m.waiting)
        yield gauge("kv_pages_used", "Pages of the KV pool in use.", m.pages_used)
        yield gauge("kv_pages_free", "Free pages of the KV pool.", m.pages_free)
        yield gauge("kv_pages_cached", "Pages the prefix cache holds (some also in use).",
                    m.pages_cached)  # fmt: skip
        yield gauge("kv_pool_bytes", "Bytes of the KV pool.", m.pool_bytes)
        yield gauge("prefix_cache_hit_rate",
                    "Prompt tokens served from the prefix cache / prompt tokens admitted.",
                    m.prefix_hit_rate)  # fmt: skip
        yield gauge("generation_tokens_per_second",
                    "Tokens generated per second over the last 10 s.", m.tokens_per_s)  # fmt: skip
        yield counter("prompt_tokens", "Prompt tokens admitted.", m.prompt_tokens)
        yield counter("cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                      m.cached_prompt_tokens)  # fmt: skip
        yield counter("generation_tokens", "Tokens generated.", m.generated_tokens)
        yield counter("preemptions", "Sequences preempted (recomputed later).", m.preemptions)
        yield counter("requests_finished", "Requests finished.", m.requests_finished)
        yield counter("requests_aborted", "Requests aborted.", m.requests_aborted)
        yield counter("streams_dropped", "Streams dropped: their client stopped reading "
                      "(ServerLimits.max_stream_backlog).", self.streams_dropped)  # fmt: skip
        # speculative decoding, under vLLM's names
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                      m.spec_draft_tokens)  # fmt: skip
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      m.spec_accepted_tokens)  # fmt: skip
        yield gauge("spec_decode_draft_acceptance_rate",
                    "Draft tokens accepted / draft tokens verified.",
                    m.spec_acceptance_rate)  # fmt: skip
        yield from self.compression(m)
        yield self.histogram("time_to_first_token_seconds", "Arrival to first token.", m.ttft)
        yield self.histogram("inter_token_latency_seconds", "Between consecutive tokens.", m.itl)
