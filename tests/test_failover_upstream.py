"""Failover: before the first byte a failed backend is replaced; after it, the client gets a
clean error and nothing is retried. In-flight counts return to zero on every path."""

from __future__ import annotations

import json
import socket

import aiohttp
import pytest

from loadtest.sim.fleet import SimFleet
from loadtest.sim.timing import EngineTiming
from tests.fault_engine import MODEL, FaultEngine, backends
from tests.helpers import FAST, backends_of, scrape, total, wait_for

ROUND_ROBIN = {"policy": "round_robin"}


async def post(http: aiohttp.ClientSession, router, stream: bool) -> tuple[int, dict, bytes]:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def assert_released(http: aiohttp.ClientSession, router, engines: list[FaultEngine]) -> None:
    async def released() -> bool:
        samples = await scrape(http, router.url)
        return total(samples, "kvroute_backend_in_flight") == 0 and all(e.open == 0 for e in engines)

    await wait_for(released, what="no request in flight in the router or at any engine")


@pytest.mark.parametrize("stream", [True, False])
async def test_hanging_backend_times_out_before_first_byte_and_is_retried(
    fault_engines, make_router, http, stream
):
    f0, f1 = await fault_engines("hang", "ok")
    router = await make_router(
        backends([f0, f1]), routing=ROUND_ROBIN, upstream={"first_byte_timeout_s": 0.3}
    )

    status, headers, body = await post(http, router, stream)

    assert status == 200 and headers["x-kvroute-backend"] == "f1"
    assert (f0.received, f1.received) == (1, 1)
    if stream:
        assert body.endswith(b"data: [DONE]\n\n")
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_upstream_errors_total", backend="f0", kind="first_byte_timeout") == 1
    assert total(samples, "kvroute_retries_total") == 1
    # The hung request was abandoned upstream too: the engine's handler saw the connection close.
    await assert_released(http, router, [f0, f1])


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_unavailable_statuses_before_first_byte_are_retried(fault_engines, make_router, http, status):
    f0, f1 = await fault_engines("status", "ok")
    f0.status = status
    router = await make_router(backends([f0, f1]), routing=ROUND_ROBIN)

    answered, headers, _ = await post(http, router, stream=True)

    assert answered == 200 and headers["x-kvroute-backend"] == "f1"
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_upstream_errors_total", backend="f0", kind=f"http_{status}") == 1
    await assert_released(http, router, [f0, f1])


@pytest.mark.parametrize("status", [400, 404, 422, 429, 500])
async def test_client_errors_and_500_pass_through_unretried(fault_engines, make_router, http, status):
    f0, f1 = await fault_engines("status", "ok")
    f0.status = status
    router = await make_router(backends([f0, f1]), routing=ROUND_ROBIN)

    answered, headers, body = await post(http, router, stream=True)

    assert answered == status and headers["x-kvroute-backend"] == "f0"
    assert json.loads(body)["error"]["message"] == f"f0 says {status}"
    assert f1.received == 0
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_retries_total") == 0


async def test_backend_killed_mid_stream_ends_with_an_sse_error_and_no_retry(
    fault_engines, make_router, http
):
    f0, f1 = await fault_engines("die_mid_stream", "ok")
    router = await make_router(backends([f0, f1]), routing=ROUND_ROBIN)

    status, headers, body = await post(http, router, stream=True)

    assert status == 200 and headers["x-kvroute-backend"] == "f0"
    events = [line.removeprefix(b"data: ") for line in body.split(b"\n\n") if line]
    assert len(events) == f0.chunks + 1
    assert json.loads(events[-1])["error"]["code"] == "upstream_stream_error"
    assert f1.received == 0
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_upstream_errors_total", backend="f0", kind="disconnect") == 1
    assert total(samples, "kvroute_requests_total", backend="f0", status="stream_error") == 1
    assert total(samples, "kvroute_retries_total") == 0
    await assert_released(http, router, [f0, f1])


async def test_idle_stream_times_out_with_an_sse_error(fault_engines, make_router, http):
    (f0,) = await fault_engines("stall_mid_stream")
    router = await make_router(backends([f0]), upstream={"read_timeout_s": 0.3})

    status, _, body = await post(http, router, stream=True)

    assert status == 200
    assert b'"code":"upstream_stream_error"' in body
    assert b"[DONE]" not in body
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_upstream_errors_total", backend="f0", kind="timeout") == 1
    await assert_released(http, router, [f0])


async def test_attempts_are_bounded(fault_engines, make_router, http):
    fleet = await fault_engines("status", "status", "status")
    router = await make_router(backends(fleet), routing=ROUND_ROBIN, upstream={"max_attempts": 2})

    status, _, body = await post(http, router, stream=False)

    assert status == 502
    assert json.loads(body)["error"]["code"] == "upstream_unavailable"
    assert sum(e.received for e in fleet) == 2
    await assert_released(http, router, fleet)


async def test_total_deadline_cuts_the_attempts_short(fault_engines, make_router, http):
    fleet = await fault_engines("hang", "hang")
    upstream = {"max_attempts": 3, "first_byte_timeout_s": 30, "retry_deadline_s": 0.4}
    router = await make_router(backends(fleet), routing=ROUND_ROBIN, upstream=upstream)

    status, _, body = await post(http, router, stream=True)

    # The first attempt's wait was cut at the deadline, and no attempt started after it.
    assert status == 504
    assert json.loads(body)["error"]["code"] == "upstream_timeout"
    assert [e.received for e in fleet] == [1, 0]
    await assert_released(http, router, fleet)


async def test_simulated_engine_killed_mid_stream_then_routed_around(make_router, http):
    slow = EngineTiming(prefill_base_s=0.001, prefill_per_token_s=0.000005, decode_step_s=0.01)
    async with SimFleet(2, timing=slow) as fleet:
        router = await make_router(
            backends_of(fleet), routing=ROUND_ROBIN, health={"interval_s": 0.05, "unhealthy_after": 1}
        )
        body = {"model": "sim-model", "prompt": "tell me a long story", "max_tokens": 500, "stream": True}
        async with http.post(f"{router.url}/v1/completions", json=body) as resp:
            assert resp.headers["x-kvroute-backend"] == "e0"
            received = await resp.content.readany()
            await fleet.engines[0].stop()
            received += await resp.content.read()
        assert b'"code":"upstream_stream_error"' in received
        assert b"[DONE]" not in received
        assert fleet.engines[1].stats()["received"] == 0

        # Connection refused before any byte: retried at once, and the dead engine leaves rotation.
        body["max_tokens"] = 2
        for _ in range(3):
            async with http.post(f"{router.url}/v1/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["x-kvroute-backend"] == "e1"
                await resp.read()
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_backend_in_flight") == 0
        assert total(samples, "kvroute_upstream_errors_total", backend="e0", kind="disconnect") == 1

        async def e0_out() -> bool:
            async with http.get(f"{router.admin_url}/admin/backends") as resp:
                states = {b["name"]: b["state"] for b in (await resp.json())["backends"]}
            return states == {"e0": "unhealthy", "e1": "closed"}

        await wait_for(e0_out, what="e0 unhealthy and e1 closed")


async def test_a_connect_timeout_is_logged_as_one_with_its_duration_and_fails_over(make_router, http, caplog):
    """The engine at e0's address goes away and a listener that never accepts takes its port
    (its accept queue full: a new connection's SYN goes unanswered), before the next health
    check: the request's connect times out, is logged as such, and e1 serves it."""
    async with SimFleet(2, timing=FAST) as fleet:
        port = int(fleet.urls[0].rsplit(":", 1)[1])
        router = await make_router(
            backends_of(fleet),
            routing=ROUND_ROBIN,
            health={"interval_s": 60},
            upstream={"connect_timeout_s": 0.25},
        )
        await fleet.engines[0].stop()
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(0)
            fillers = [socket.create_connection(("127.0.0.1", port), timeout=1)]
            fillers += [socket.socket() for _ in range(3)]
            for filler in fillers[1:]:
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
            try:
                answers = []
                for _ in range(2):
                    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 3}
                    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
                        answers.append((resp.status, resp.headers.get("x-kvroute-backend")))
            finally:
                for filler in fillers:
                    filler.close()
        assert answers == [(200, "e1")] * 2
        assert f"connecting to 127.0.0.1:{port} timed out after 0.25 s" in caplog.text
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_upstream_errors_total", backend="e0", kind="connect") >= 1
