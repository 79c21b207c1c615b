"""OpenTelemetry traces of real requests, recorded by the real SDK (its in-memory exporter, and an
OTLP/HTTP export to a collector stand-in decoded with OpenTelemetry's own protobuf types)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from loadtest.sim.engine import SimEngine
from loadtest.sim.fleet import SimFleet
from router.config import ConfigError, config_from_dict
from router.http.app import TRACING
from tests.helpers import FAST, backends_of, wait_for

MODEL = "sim-model"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
DOCUMENT = "Tracing needs a prompt long enough for a few blocks of the index. " * 20
CHAT = {"model": MODEL, "messages": [{"role": "system", "content": DOCUMENT}], "max_tokens": 2}


def traced(router) -> InMemorySpanExporter:
    """Record the router's finished spans in memory, through the SDK's own processor."""
    exporter = InMemorySpanExporter()
    router.app[TRACING].provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def finished_spans(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    # The request's span ends once the response has been sent: poll for it.
    await wait_for(
        lambda: len(exporter.get_finished_spans()) >= count,
        what=f"{count} finished spans",
        detail=lambda: [s.name for s in exporter.get_finished_spans()],
    )
    return list(exporter.get_finished_spans())


def by_name(spans: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


async def test_a_request_is_a_span_continuing_the_clients_trace_with_route_and_upstream_children(
    fleet, make_router, http
):
    router = await make_router(backends_of(fleet), tracing={"enabled": True, "exporter": "none"})
    exporter = traced(router)
    headers = {"traceparent": TRACEPARENT, "X-Request-Id": "traced-1"}
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
        backend = resp.headers["x-kvroute-backend"]
    spans = by_name(await finished_spans(exporter, 3))
    (request,) = spans["POST /v1/chat/completions"]
    (route,) = spans["route"]
    (upstream,) = spans["upstream"]

    assert request.kind is SpanKind.SERVER
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(request.parent.span_id, "016x") == CLIENT_SPAN
    assert request.attributes["kvroute.request_id"] == "traced-1"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["kvroute.backend"] == backend
    assert request.attributes["kvroute.endpoint"] == "chat"

    assert route.parent.span_id == request.context.span_id
    assert route.attributes["kvroute.policy"] == "latency"
    assert route.attributes["kvroute.reason"] == "latency_no_match"
    assert route.attributes["kvroute.matched_tokens"] == 0
    assert sorted(route.attributes["kvroute.candidates"]) == ["e0", "e1", "e2"]
    assert route.start_time <= route.end_time <= upstream.start_time

    assert upstream.kind is SpanKind.CLIENT
    assert upstream.parent.span_id == request.context.span_id
    assert upstream.attributes["kvroute.backend"] == backend
    assert upstream.attributes["http.response.status_code"] == 200
    # The engine got the attempt's context: its own spans would nest under the attempt.
    engine = next(e for e, b in zip(fleet.engines, ["e0", "e1", "e2"], strict=True) if b == backend)
    seen = {k.lower(): v for k, v in engine.seen_headers[-1].items()}
    assert seen["traceparent"] == f"00-{TRACE_ID}-{format(upstream.context.span_id, '016x')}-01"


async def test_the_second_request_of_a_prefix_shows_the_match_in_its_route_span(fleet, make_router, http):
    router = await make_router(backends_of(fleet), tracing={"enabled": True, "exporter": "none"})
    exporter = traced(router)
    for _ in range(2):
        async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
    routes = by_name(await finished_spans(exporter, 6))["route"]
    assert [r.attributes["kvroute.reason"] for r in routes] == ["latency_no_match", "latency_hit"]
    assert routes[1].attributes["kvroute.matched_tokens"] > 0
    # Without a client traceparent each request starts a trace of its own.
    assert routes[0].context.trace_id != routes[1].context.trace_id


async def test_each_attempt_is_a_span_and_a_failed_one_says_why(make_router, http):
    async with SimFleet(2, timing=FAST) as fleet:
        router = await make_router(
            backends_of(fleet), upstream={"max_attempts": 2}, tracing={"enabled": True, "exporter": "none"}
        )
        exporter = traced(router)
        await fleet.engines[0].stop()
        for _ in range(20):
            body = {"model": MODEL, "query": "q", "documents": ["d"]}
            async with http.post(f"{router.url}/v1/rerank", json=body) as resp:
                assert resp.status == 200
            await wait_for(
                lambda: any(s.name == "POST /v1/rerank" for s in exporter.get_finished_spans()),
                what="the request span",
            )
            attempts = by_name(exporter.get_finished_spans()).get("upstream", [])
            if len(attempts) == 2:
                break
            exporter.clear()
        else:
            pytest.fail("no request was ever sent to the dead engine")
    failed, served = sorted(attempts, key=lambda s: s.attributes["kvroute.attempt"])
    assert failed.attributes["kvroute.backend"] == "e0" and failed.attributes["error.type"] == "connect"
    assert failed.status.status_code is StatusCode.ERROR
    assert (
        served.attributes["kvroute.backend"] == "e1" and served.attributes["http.response.status_code"] == 200
    )
    (route,) = by_name(exporter.get_finished_spans())["route"]
    assert route.attributes["kvroute.policy"] == "least_load"


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: keeps each export's protobuf body."""

    received: list[bytes] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[bytes]]]:
    received: list[bytes] = []
    handler = type("Collector", (_Collector,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", received
    server.shutdown()
    server.server_close()


async def test_spans_are_exported_over_otlp(fleet, make_router, http, collector):
    endpoint, received = collector
    tracing = {"enabled": True, "endpoint": endpoint, "service_name": "kvroute-test"}
    router = await make_router(backends_of(fleet), tracing=tracing)
    async with http.post(f"{router.url}/v1/embeddings", json={"model": MODEL, "input": DOCUMENT}) as resp:
        assert resp.status == 200
    await router.stop()  # the batch processor flushes at shutdown
    assert received
    names, services = set(), set()
    for body in received:
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            services |= {
                a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"
            }
            for scope in resource_spans.scope_spans:
                names |= {span.name for span in scope.spans}
    assert names == {"POST /v1/embeddings", "route", "upstream"}
    assert services == {"kvroute-test"}


def test_without_tracing_nothing_of_opentelemetry_is_imported():
    script = textwrap.dedent(
        """
        import asyncio, sys, aiohttp
        from loadtest.sim.engine import SimEngine
        from router.config import config_from_dict
        from router.http.server import RouterServer

        async def main():
            engine = SimEngine()
            await engine.start()
            config = config_from_dict({"listen": {"port": 0}, "backends": [{"name": "e", "url": engine.url}]})
            async with RouterServer(config) as router, aiohttp.ClientSession() as http:
                body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(router.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
            await engine.stop()
            # redis-py imports OpenTelemetry's API itself when it is installed; kvroute's tracing
            # would import the SDK's tracer and an exporter.
            tracing = ("opentelemetry.sdk.trace", "opentelemetry.exporter")
            print(sorted(m for m in sys.modules if m.startswith(tracing)))

        asyncio.run(main())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_tracing_without_the_extra_is_a_config_error(monkeypatch):
    # A package mapped to None in sys.modules is one that cannot be imported, as if not installed.
    for name in ("opentelemetry", "opentelemetry.sdk", "opentelemetry.exporter"):
        monkeypatch.setitem(sys.modules, name, None)
    raw = {"backends": [{"name": "e", "url": "http://127.0.0.1:1"}], "tracing": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"tracing\.enabled: needs .*install kvroute\[otel\]"):
        config_from_dict(raw)
    assert config_from_dict({**raw, "tracing": {"enabled": False}}).tracing.enabled is False


async def test_a_single_engine_sees_a_new_trace_when_the_client_sends_none(make_router, http):
    engine = SimEngine(FAST)
    await engine.start()
    try:
        router = await make_router(
            [{"name": "e0", "url": engine.url}], tracing={"enabled": True, "exporter": "none"}
        )
        exporter = traced(router)
        async with http.post(f"{router.url}/tokenize", json={"model": MODEL, "prompt": "x"}) as resp:
            assert resp.status == 200
        spans = by_name(await finished_spans(exporter, 3))
        (request,) = spans["POST /tokenize"]
        assert request.parent is None
        seen = {k.lower(): v for k, v in engine.seen_headers[-1].items()}
        assert seen["traceparent"].split("-")[1] == format(request.context.trace_id, "032x")
    finally:
        await engine.stop()


async def test_the_collectors_headers_are_redacted_in_the_config_view(fleet, make_router, http):
    tracing = {"enabled": True, "exporter": "none", "headers": {"Authorization": "Bearer collector-secret"}}
    router = await make_router(backends_of(fleet), tracing=tracing)
    async with http.get(f"{router.admin_url}/admin/config") as resp:
        shown = (await resp.json())["config"]["tracing"]
    assert shown["headers"] == {"Authorization": "<redacted>"}
