"""The Grafana dashboard, checked against a real Prometheus scraping a real router.

Two router replicas, one with the Redis index (a private ``redis-server``) and one in
precise mode on the engines' KV events, serve a short load through simulated engines: cache
hits and misses, streams, client errors, a lost event batch (replayed), a backend that dies
(a retry), and a Redis outage (fallbacks, Redis errors, dropped updates). A real Prometheus
scrapes the routers and the engines; then every expression of every panel must parse and
return data, and use only kvroute's metrics and the engines' own.

Each engine panel queries vLLM and SGLang names in one expression (``... or ...``), so it
works for mixed fleets; the simulated engines speak vLLM, so the SGLang half of those
expressions is checked for syntax only, by the same query.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.sim.fleet import SimFleet
from router.http.server import RouterServer
from tests.helpers import FAST, backends_of, scrape, total, wait_for
from tests.prometheus_server import PrometheusError, PrometheusServer
from tests.redis_servers import RedisServer, redis_server

DASHBOARD = Path(__file__).resolve().parent.parent / "helm" / "kvroute" / "dashboards" / "kvroute.json"
MODEL = "sim-model"
SYSTEMS = [f"You are assistant number {i}. Answer briefly and precisely. " * 12 for i in range(3)]
#: What Grafana puts in place of the dashboard's variables: every model and backend, and a
#: rate window that holds several of the test's 1 s scrapes.
VARIABLES = {"$__rate_interval": "30s", "$model": ".*", "$backend": ".*", "$job": ".*", "$namespace": ".*"}
#: PromQL words that are not metric names.
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "histogram_quantile", "by", "or", "and", "unless",
    "without", "on", "ignoring", "label_values",
}  # fmt: skip
#: Precise mode: the index follows the engines' KV events (prompts cut in fixed chunks).
PRECISE_INDEX = {"mode": "events", "tokenizer": {"kind": "chunk"}}
#: How long after the load the panels may take to fill (a few 1 s scrapes, on a busy machine).
SETTLE_S = 20.0
ENGINE_METRIC = re.compile(r"^(vllm|sglang):[a-z_]+$")
#: A selector of the router's own series (``process_*`` too, a name every exporter has).
ROUTER_SELECTOR = re.compile(r"\b((?:kvroute|process)_[a-z_]+)(\{[^}]*\})?")
#: The latency and time-to-first-token histograms: each of their panels follows ``$model``.
LATENCY_HISTOGRAM = re.compile(r"_seconds_bucket$")


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def expressions() -> list[tuple[str, str]]:
    return [(f"{p['title']} [{t['refId']}]", t["expr"]) for p in panels() for t in p["targets"]]


def variable_selectors() -> dict[str, tuple[str, str]]:
    """Each query variable's series selector and label, from its ``label_values(selector, label)``."""
    found = {}
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"])
            assert match, variable["definition"]
            found[variable["name"]] = (match[1], match[2])
    return found


def concrete(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown dashboard variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (label matchers, groupings and strings removed)."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare))
    return {w for w in words if w not in PROMQL_WORDS}


def test_dashboard_shape_variables_and_metric_names():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "job", "model", "backend"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    # Two releases (or two namespaces) scraped by one Prometheus never mix: every query of the
    # router's series, the variables' own included, is scoped to the chosen job and namespace.
    scoped = [v["definition"] for v in variables.values() if v["name"] in ("model", "backend")]
    for expr in scoped + [expr for _, expr in expressions()]:
        for name, matchers in ROUTER_SELECTOR.findall(expr):
            assert 'job=~"$job"' in matchers and 'namespace=~"$namespace"' in matchers, (name, expr)
            if LATENCY_HISTOGRAM.search(name) and not name.startswith("kvroute_redis_"):
                assert 'model=~"$model"' in matchers, (name, expr)
    assert "$namespace" in variables["job"]["definition"]
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
    for where, expr in expressions():
        for name in metric_names(expr):
            assert name.startswith(("kvroute_", "process_")) or ENGINE_METRIC.match(name), f"{where}: {name}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("hit ratio", "time to first token", "per backend", "retries", "redis", "index"):
        assert topic in titles, topic


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status


def _chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, "max_tokens": 3, **extra}


async def _serve_load(
    http: aiohttp.ClientSession,
    shared: RouterServer,
    precise: RouterServer,
    fleet: SimFleet,
    doomed: SimFleet,
    redis: RedisServer,
) -> None:
    """Cache hits and misses, streams, client errors, an event gap, a retry, a Redis outage."""
    for turn in range(4):
        for i, system in enumerate(SYSTEMS):
            assert await _post(http, shared.url, _chat(system, f"turn {turn}", stream=i == 0)) == 200
            assert await _post(http, precise.url, _chat(system, f"turn {turn}")) == 200
    assert await _post(http, shared.url, {**_chat(SYSTEMS[0], "x"), "model": "no-such-model"}) == 404
    assert await _post(http, shared.url, {"model": MODEL}) == 400

    # One lost event batch: the precise router sees the gap and replays it.
    publisher = fleet.engines[0].publisher
    assert publisher is not None
    publisher.drop_next()
    for i in range(2):
        assert await _post(http, fleet.urls[0], _chat(f"straight to the engine {i} " * 20, "hi")) == 200

    await doomed.stop()
    for i in range(len(fleet.urls) + 1):  # round robin reaches the dead backend in one round
        assert await _post(http, precise.url, _chat(f"fresh prompt {i} " * 30, "hi")) == 200
        if total(await scrape(http, precise.url), "kvroute_retries_total") >= 1:
            break
    else:
        raise AssertionError("the dead backend was never picked: no retry to show")

    redis.stop()
    for i in range(5):  # Redis is down: requests still succeed, on the router's local view
        assert await _post(http, shared.url, _chat(SYSTEMS[i % 3], f"during the outage {i}")) == 200


async def test_every_panel_query_parses_and_returns_data(make_router, http):
    """Two router replicas: one with the Redis index and closed-loop beliefs, one in precise
    mode on the engines' KV events (the engine without events gives it discovery errors)."""
    with redis_server() as redis:
        async with SimFleet(3, timing=FAST, kv_events="vllm") as fleet, SimFleet(1, timing=FAST) as doomed:
            backends = [*backends_of(fleet), {"name": "doomed", "url": doomed.urls[0]}]
            shared = await make_router(
                backends,
                routing={"policy": "prefix_aware"},
                # A tiny write queue: updates made during the Redis outage overflow it (dropped
                # updates); closed-loop beliefs compare predictions with the engines' reports.
                index={
                    "store": "redis",
                    "redis": {"url": redis.url, "retry_interval_s": 60, "write_queue_size": 2},
                    "closed_loop": True,
                },
            )
            # Round robin: it reaches the backend that dies within one round (a retry).
            precise = await make_router(backends, routing={"policy": "round_robin"}, index=PRECISE_INDEX)

            async def subscribed() -> bool:
                samples = await scrape(http, precise.url)
                return total(samples, "kvroute_kv_events_resyncs_total", reason="connect") == len(fleet.urls)

            await wait_for(subscribed, what="the precise router to subscribe to every engine")
            jobs = {
                "kvroute": [shared.url.removeprefix("http://"), precise.url.removeprefix("http://")],
                "engines": [url.removeprefix("http://") for url in fleet.urls],
            }
            async with PrometheusServer(jobs) as prometheus:
                await wait_for(prometheus.targets_up, what="every Prometheus target up", timeout=20)
                await _serve_load(http, shared, precise, fleet, doomed, redis)

                # Series the load created need two scrapes before rate() has a value, and
                # background loops (engine scrapes, Redis writes) record a little after the
                # load: poll, as a dashboard refreshes, until every panel has data.
                empty: list[str] = []

                async def every_panel_has_data() -> bool:
                    empty[:] = await _panels_without_data(prometheus)
                    return not empty

                await wait_for(
                    every_panel_has_data,
                    what="data in every panel",
                    timeout=SETTLE_S,
                    interval=0.5,
                    detail=lambda: "panels without data:\n" + "\n".join(empty),
                )
                # The variables' series selectors parse, and offer the values the test made
                # (a static scrape config sets no namespace label: its list stays empty here).
                offered = {}
                for name, (selector, label) in variable_selectors().items():
                    series = await prometheus.query(concrete(selector))
                    offered[name] = {s["metric"].get(label) for s in series} - {None}
                assert offered["job"] == {"kvroute"}
                assert MODEL in offered["model"] and "doomed" in offered["backend"]


async def _panels_without_data(prometheus: PrometheusServer) -> list[str]:
    """Every expression that parses but has no series over the last minute (the whole test),
    queried as a dashboard does: a range, a whole number of steps back from now."""
    now = time.time()
    return [
        f"{where}: {expr}"
        for where, expr in expressions()
        if not await prometheus.query_range(concrete(expr), now - 60, now)
    ]


async def test_prometheus_refuses_what_does_not_parse():
    """The check above can fail: Prometheus answers an unparsable expression with an error."""
    async with PrometheusServer({}) as prometheus:
        for bad in ("sum(rate(kvroute_requests_total[30s])", "kvroute_requests_total{a=}"):
            with pytest.raises(PrometheusError, match="bad_data"):
                await prometheus.query(bad)
