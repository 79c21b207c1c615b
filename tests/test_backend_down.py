"""An engine that stops mid-request: the router ends what it has open there and moves on.

vLLM's default ``--shutdown-timeout 0`` aborts its requests on SIGTERM and may keep their
connections open while it winds down: a stream that already had its first byte would hang until
the router's read timeout (600 s by default). When the backend fails its health checks, its
in-flight streams end with an SSE error at once and requests still waiting for their first byte
go to another backend. A request that arrives while it shuts down gets vLLM's 500 "cannot
schedule new futures after shutdown", which is the engine's state, not the request's: it is
retried elsewhere. Any other 500 still passes through (tests/test_failover_upstream.py).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from tests.fault_engine import MODEL, FaultEngine, backends
from tests.helpers import scrape, total, wait_for

ROUND_ROBIN = {"policy": "round_robin"}
#: Checks quick enough for a test: one failed check takes a backend out.
QUICK_HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "unhealthy_after": 1}


async def in_flight(http: aiohttp.ClientSession, router, backend: str) -> bool:
    return total(await scrape(http, router.url), "kvroute_backend_in_flight", backend=backend) == 1


async def test_a_stream_on_a_backend_that_fails_its_health_checks_ends_with_an_sse_error(
    fault_engines, make_router, http
):
    f0, f1 = await fault_engines("stall_mid_stream", "ok")
    router = await make_router(backends([f0, f1]), routing=ROUND_ROBIN, health=QUICK_HEALTH)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["x-kvroute-backend"] == "f0"
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        f0.healthy = False
        started = time.monotonic()
        rest = await asyncio.wait_for(resp.content.read(), timeout=5)
    assert time.monotonic() - started < 2
    events = [e for e in rest.split(b"\n\n") if e.startswith(b"data: ")]
    error = json.loads(events[-1][len(b"data: ") :])["error"]
    assert error["code"] == "upstream_stream_error" and "backend_down" in error["message"]
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_backend_in_flight") == 0
    f0.release.set()


async def test_a_request_waiting_for_its_first_byte_moves_to_another_backend(
    fault_engines, make_router, http
):
    f0, f1 = await fault_engines("hang", "ok")
    router = await make_router(backends([f0, f1]), routing=ROUND_ROBIN, health=QUICK_HEALTH)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    request = asyncio.create_task(http.post(f"{router.url}/v1/completions", json=body))
    await wait_for(lambda: in_flight(http, router, "f0"), what="the request waiting at f0")
    f0.healthy = False
    async with await asyncio.wait_for(request, timeout=5) as resp:
        assert resp.status == 200 and resp.headers["x-kvroute-backend"] == "f1"
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_upstream_errors_total", backend="f0", kind="backend_down") == 1
    assert total(samples, "kvroute_retries_total") == 1
    f0.release.set()


class StoppingEngine(FaultEngine):
    """Answers as vLLM 0.32 does to a request that arrives while it shuts down (``message``)."""

    message = "cannot schedule new futures after shutdown"

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.received += 1
        error = {
            "error": {
                "message": self.message,
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        return web.json_response(error, status=500)


@pytest.mark.parametrize(
    "message",
    [
        "cannot schedule new futures after shutdown",
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    ],
)
async def test_the_500_of_an_engine_shutting_down_is_retried_elsewhere(
    fault_engines, make_router, http, message
):
    stopping = StoppingEngine("f0")
    stopping.message = message
    await stopping.start()
    (f1,) = await fault_engines("ok")
    f1.name = "f1"
    try:
        router = await make_router(backends([stopping, f1]), routing=ROUND_ROBIN)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        async with http.post(f"{router.url}/v1/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["x-kvroute-backend"] == "f1"
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_upstream_errors_total", backend="f0", kind="engine_stopping") == 1
        assert stopping.received == 1
    finally:
        await stopping.stop()
