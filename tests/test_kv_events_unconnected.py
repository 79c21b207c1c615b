"""A KV-event subscription that never connects is reported, not silent.

vLLM 0.32 binds its PUB socket only for ``tcp://*:port``, ``ipc://`` and ``inproc://``; given any
other TCP endpoint it connects, and nobody can subscribe. The router then routes on provisional
beliefs only: after ``index.events.connect_grace_s`` it says so in a log line, a metric and the
backend's ``kv_events`` state in ``/admin/backends``; and the state turns ``connected`` once the
publisher binds.
"""

from __future__ import annotations

import logging

import aiohttp
import zmq
import zmq.asyncio

from loadtest.ports import free_port
from tests.fault_engine import MODEL
from tests.helpers import MakeRouter, scrape, total, wait_for


async def kv_events_state(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/admin/backends") as resp:
        (backend,) = (await resp.json())["backends"]
        return backend["kv_events"]


async def test_a_subscription_without_a_connection_is_reported_after_the_grace(
    engines, make_router: MakeRouter, http: aiohttp.ClientSession, caplog
) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    backend = {"name": "e0", "url": engines[0].url, "models": [MODEL], "kv_events": {"endpoint": endpoint}}
    index = {"mode": "events", "tokenizer": {"kind": "chunk"}, "events": {"connect_grace_s": 0.3}}
    caplog.set_level(logging.WARNING, logger="kvroute.kv_events")
    router = await make_router([backend], index=index)

    async def reported() -> bool:
        samples = await scrape(http, router.url)
        return total(samples, "kvroute_kv_events_errors_total", backend="e0", kind="not_connected") == 1

    await wait_for(reported, what="the unconnected stream counted")
    assert await kv_events_state(http, router.admin_url) == {
        "state": "not_connected",
        "endpoints": [endpoint],
    }
    assert any("no connection to " + endpoint in r.getMessage() for r in caplog.records)

    # The publisher binds (the engine fixed): the subscription connects and says so.
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    try:

        async def connected() -> bool:
            return (await kv_events_state(http, router.admin_url))["state"] == "connected"

        await wait_for(connected, timeout=5, what="the subscription connected")
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_kv_events_connected", backend="e0") == 1
    finally:
        pub.close(linger=0)
        ctx.term()
