"""The router's own metrics, read back from ``GET /metrics`` of a real router over real HTTP."""

from __future__ import annotations

import re
from pathlib import Path

from router.http.ratelimit import RateLimiter
from router.http.reload import reload_counter
from router.http.settings import TenantLimits
from router.index.precise import PreciseIndex
from router.kv_events.metrics import KVEventMetrics
from router.metrics import RedisMetrics, RouterMetrics, WorkerSyncMetrics
from router.request_path.beliefs import BeliefMetrics
from tests.helpers import backends_of, scrape, total

METRICS_DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"

MODEL = "sim-model"
PROMPT = "Tell me a story about a lighthouse keeper. " * 20  # several 256-character blocks


async def _complete(http, router, body: dict) -> int:
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


async def test_router_made_errors_are_counted_without_client_input_in_labels(fleet, make_router, http):
    router = await make_router(backends_of(fleet))
    assert await _complete(http, router, {"model": "no-such-model-x1", "prompt": "hi"}) == 404
    assert await _complete(http, router, {"model": MODEL}) == 400
    async with http.get(f"{router.url}/v1/nowhere/a1b2c3") as resp:
        assert resp.status == 404

    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_requests_total", endpoint="completions", status="404", model="") == 1
    assert total(samples, "kvroute_requests_total", endpoint="completions", status="400", backend="") == 1
    assert total(samples, "kvroute_requests_total", endpoint="other", status="404") == 1
    label_values = {value for (_, labels), _ in samples.items() for _, value in labels}
    assert not label_values & {"no-such-model-x1", "/v1/nowhere/a1b2c3"}


async def test_no_healthy_backend_503_is_counted(make_router, http):
    router = await make_router([{"name": "down", "url": "http://127.0.0.1:9", "models": [MODEL]}])
    assert await _complete(http, router, {"model": MODEL, "prompt": "hi"}) == 503
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_requests_total", endpoint="completions", status="503") == 1


async def test_index_lookups_and_evictions(fleet, make_router, http):
    # Capacity of 2 blocks per backend: a prompt of several blocks must evict some of its own.
    backends = [{**b, "capacity_blocks": 2} for b in backends_of(fleet)]
    router = await make_router(backends, routing={"policy": "prefix_aware"})
    for _ in range(2):
        assert await _complete(http, router, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}) == 200

    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_index_lookups_total", result="miss") == 1
    assert total(samples, "kvroute_index_lookups_total", result="hit") == 1
    assert total(samples, "kvroute_index_evictions_total") > 0
    assert total(samples, "kvroute_index_blocks") == 2


def test_docs_document_every_metric_with_its_type():
    """docs/metrics.md's table and the registries cannot drift apart."""
    registry = RouterMetrics().registry
    RedisMetrics(registry)
    WorkerSyncMetrics(registry)
    BeliefMetrics(registry)
    KVEventMetrics(registry, PreciseIndex(16, {}, 2.0, 1000))
    RateLimiter(TenantLimits(), {}, registry)
    reload_counter(registry)
    exposed = {family.name: family.type for family in registry.collect()}
    section = METRICS_DOC.read_text().split("\n## ", 1)[0]
    rows = re.findall(r"^\| `((?:kvroute|process)_[a-z_]+)` \| (\w+) \|", section, flags=re.MULTILINE)
    documented = {name.removesuffix("_total") if kind == "counter" else name: kind for name, kind in rows}
    # The index's eviction count is read from the index at scrape time (RouterMetrics.watch_index).
    exposed["kvroute_index_evictions"] = "counter"
    assert documented == exposed
