"""Redis misbehaving under a router serving requests: it loses its data, it turns slow. Every
request is answered 200 either way, and the router goes back to the shared state afterwards.

Redis down and restarted under load is tests/test_redis_router.py; down and slow at the index
level is tests/test_index_redis_store.py. Each test here gets a private redis-server from the
``redis_server`` fixture.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.helpers import backends_of, scrape, total, wait_for, wait_released
from tests.redis_servers import RedisServer

MODEL = "sim-model"
SYSTEM = "You are a careful assistant. " * 40


def redis_index(server: RedisServer) -> dict:
    return {"store": "redis", "redis": {"url": server.url, "retry_interval_s": 0.05, "timeout_ms": 50}}


async def chat(http: aiohttp.ClientSession, url: str, user: str) -> tuple[int, str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvroute-reason", "")


async def test_redis_losing_its_data_fails_nothing_and_is_refilled(redis_server, fleet, make_router, http):
    router = await make_router(backends_of(fleet), index=redis_index(redis_server))
    assert (await chat(http, router.url, "one"))[0] == 200
    client = redis_server.client()

    async def written() -> bool:
        return any(client.scan_iter("{kvroute}:blocks:*"))

    await wait_for(written, what="blocks written to Redis")
    client.flushall()  # an eviction storm, a FLUSHALL, a failover to an empty replica
    statuses = [await chat(http, router.url, f"after the flush {i}") for i in range(5)]
    assert [s for s, _ in statuses] == [200] * 5
    await wait_for(written, what="the shared index to fill up again from new requests")
    assert (await chat(http, router.url, "and again"))[1] == "latency_hit"
    await wait_released(http, router.url)


async def test_slow_redis_delays_no_request_beyond_its_deadline(redis_server, fleet, make_router, http):
    router = await make_router(backends_of(fleet), index=redis_index(redis_server))
    assert (await chat(http, router.url, "warm"))[0] == 200
    # CLIENT PAUSE: Redis holds every command for a while, as a busy or swapping server would.
    redis_server.client().execute_command("CLIENT", "PAUSE", 2500, "ALL")
    results = await asyncio.gather(*(chat(http, router.url, f"during the pause {i}") for i in range(6)))
    assert [s for s, _ in results] == [200] * 6
    # ...all answered on the local view while the router still counts Redis as down: nobody
    # waited for Redis to wake up (each lookup gave up at its deadline, then none were tried).
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_redis_up") == 0
    assert total(samples, "kvroute_redis_fallbacks_total") >= 6

    async def shared_again() -> bool:
        return total(await scrape(http, router.url), "kvroute_redis_up") == 1

    await wait_for(shared_again, what="the router to count Redis as up again", timeout=10)
    await wait_released(http, router.url)
