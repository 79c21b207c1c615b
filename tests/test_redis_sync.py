"""Routers with ``index.redis.lookup: local``: each looks up in its own copy of the index, which
the other replicas' beliefs reach over a real Redis stream; Redis is never on the request path."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp

from loadtest.sim.fleet import SimFleet
from router.config import config_from_dict
from router.index.build import build_index
from router.metrics import RouterMetrics
from tests.helpers import FAST, backends_of, scrape, total, wait_for
from tests.redis_servers import RedisServer
from tests.test_redis_router import chat, statuses_through_an_outage


def synced_index(server: RedisServer, **redis: Any) -> dict[str, Any]:
    redis = {"url": server.url, "lookup": "local", "retry_interval_s": 0.05, **redis}
    return {"store": "redis", "redis": redis}


async def peer_updates(http: aiohttp.ClientSession, url: str) -> float:
    return total(await scrape(http, url), "kvroute_index_peer_updates_total")


async def stream_read(http: aiohttp.ClientSession, writer: Any, reader: Any) -> bool:
    """Whether ``writer`` has appended all it queued and ``reader`` has applied all of it.

    The reader's count of applied beliefs has stopped moving over a few polls once the writer's
    queue is empty: its blocking read wakes at once for anything appended."""
    counts = []
    for _ in range(3):
        samples = await scrape(http, writer.url)
        if total(samples, "kvroute_index_write_queue") > 0:
            return False
        counts.append(await peer_updates(http, reader.url))
        await asyncio.sleep(0.1)
    return len(set(counts)) == 1


async def test_a_prefix_routed_by_one_replica_is_looked_up_locally_by_another(
    redis_server, fleet, make_router, http
):
    one = await make_router(backends_of(fleet), index=synced_index(redis_server))
    two = await make_router(backends_of(fleet), index=synced_index(redis_server))
    first = await chat(http, one.url, "turn one")
    backend = first.headers["x-kvroute-backend"]

    async def taken() -> bool:
        return await peer_updates(http, two.url) >= 1

    await wait_for(taken, what="the second replica to take the first one's belief")
    second = await chat(http, two.url, "turn two")
    assert second.status == 200
    assert second.headers["x-kvroute-backend"] == backend
    assert second.headers["x-kvroute-reason"] == "latency_hit"
    samples = await scrape(http, two.url)
    assert total(samples, "kvroute_matched_tokens_total") > 0
    # No round trip on the request path: nothing was asked of Redis to route either request.
    assert total(samples, "kvroute_redis_latency_seconds_count", op="match") == 0
    assert total(samples, "kvroute_redis_fallbacks_total") == 0
    # Its own belief went out on the stream: the first replica took the second's.
    await wait_for(lambda: peer_updates(http, one.url), what="the first replica to take the second's")


async def test_a_burst_on_two_replicas_follows_the_first_pick_during_its_prefill(
    redis_server, make_router, http
):
    """A replica learns where a new prefix went at the pick, not at the engine's first byte."""
    async with SimFleet(3, timing=FAST.__class__(prefill_base_s=1.0)) as fleet:
        routing = {"policy": "prefix_aware"}
        one = await make_router(backends_of(fleet), index=synced_index(redis_server), routing=routing)
        two = await make_router(backends_of(fleet), index=synced_index(redis_server), routing=routing)
        first = asyncio.create_task(chat(http, one.url, "turn one"))

        async def taken() -> bool:
            return await peer_updates(http, two.url) >= 1

        await wait_for(taken, what="the pick to reach the other replica", timeout=0.9)
        assert not first.done()  # still in its one-second prefill
        second = await chat(http, two.url, "turn two")
        assert second.headers["x-kvroute-reason"] == "prefix_hit"
        assert second.headers["x-kvroute-backend"] == (await first).headers["x-kvroute-backend"]


async def test_a_busy_replica_appends_one_batch_per_sync_interval(redis_server, fleet, make_router, http):
    one = await make_router(backends_of(fleet), index=synced_index(redis_server, sync_interval_ms=500))
    two = await make_router(backends_of(fleet), index=synced_index(redis_server))
    for i in range(20):
        assert (await chat(http, one.url, f"prefix {i} " * 40)).status == 200

    async def all_taken() -> bool:
        return await peer_updates(http, two.url) >= 20

    await wait_for(all_taken, what="the 20 beliefs to reach the second replica")
    # The first left at once, the rest gathered while the writer waited (one per request
    # without the interval); generous for a slow machine: 20 requests within 2 s.
    assert redis_server.client().xlen("{kvroute}:beliefs") <= 5


async def redis_calls(http: aiohttp.ClientSession, url: str, op: str) -> float:
    return total(await scrape(http, url), "kvroute_redis_latency_seconds_count", op=op)


async def test_a_busy_replica_reads_the_stream_in_the_round_trip_of_its_appends(
    redis_server, fleet, make_router, http
):
    """One round trip per interval, not two: while the writer appends, it also takes the other
    replicas' entries, and the blocking reader stays out; once it is quiet, the reader reads."""
    one = await make_router(backends_of(fleet), index=synced_index(redis_server, sync_interval_ms=50))
    two = await make_router(backends_of(fleet), index=synced_index(redis_server))
    assert (await chat(http, two.url, "from the other replica")).status == 200
    await wait_for(lambda: peer_updates(http, one.url), what="the first replica to take the other's")
    reads, appends = await redis_calls(http, one.url, "sync"), await redis_calls(http, one.url, "record")
    for i in range(60):
        assert (await chat(http, one.url, f"busy {i} " * 40)).status == 200
    busy_reads = await redis_calls(http, one.url, "sync") - reads
    # Here 60 requests took about 0.4 s: 9 appends, each of which the reader had matched with a
    # read of its own. Now: the blocking read that was waiting when the spell began, woken by
    # its first append (and one more each time a loaded machine stalls past two intervals).
    busy_appends = await redis_calls(http, one.url, "record") - appends
    assert busy_appends >= 4
    assert busy_reads <= busy_appends / 3
    # The other replica's belief, appended during the spell, is taken by the writer's reads.
    await chat(http, two.url, "the other replica, again")
    await wait_for(lambda: peer_updates_at_least(http, one.url, 2), what="the writer to take it")
    # Quiet again: the reader takes over.
    await wait_for(
        lambda: redis_calls_above(http, one.url, "sync", reads + busy_reads),
        what="the blocking reader back once the writer is quiet",
    )


async def peer_updates_at_least(http: aiohttp.ClientSession, url: str, count: int) -> bool:
    return await peer_updates(http, url) >= count


async def redis_calls_above(http: aiohttp.ClientSession, url: str, op: str, count: float) -> bool:
    return await redis_calls(http, url, op) > count


async def test_the_stream_keeps_a_ttl_renewed_every_half_ttl_not_with_each_append(
    redis_server, fleet, make_router, http
):
    one = await make_router(backends_of(fleet), index=synced_index(redis_server, key_ttl_s=6))
    client = redis_server.client()
    stream = "{kvroute}:beliefs"
    assert (await chat(http, one.url, "turn one")).status == 200
    await wait_for(lambda: client.xlen(stream) >= 1, what="the first belief on the stream")
    assert 0 < client.pttl(stream) <= 6000
    # Within half the TTL (3 s) an append leaves the TTL alone (no PEXPIRE with every append) ...
    client.persist(stream)
    assert (await chat(http, one.url, "turn two")).status == 200
    await wait_for(lambda: client.xlen(stream) >= 2, what="the second belief on the stream")
    assert client.pttl(stream) == -1

    # ... and the first append past it renews the TTL, so an abandoned namespace still expires.
    turns = itertools.count(3)

    async def renewed() -> bool:
        assert (await chat(http, one.url, f"turn {next(turns)}")).status == 200
        return client.pttl(stream) > 0

    await wait_for(renewed, timeout=10, what="the TTL renewed")


async def test_a_starting_replica_replays_what_the_stream_keeps(redis_server, fleet, make_router, http):
    one = await make_router(backends_of(fleet), index=synced_index(redis_server))
    backend = (await chat(http, one.url, "turn one")).headers["x-kvroute-backend"]
    await wait_for(
        lambda: redis_server.client().xlen("{kvroute}:beliefs") >= 1, what="the belief on the stream"
    )
    late = await make_router(backends_of(fleet), index=synced_index(redis_server))

    async def replayed() -> bool:
        return await peer_updates(http, late.url) >= 1

    await wait_for(replayed, what="the late replica to replay the stream")
    second = await chat(http, late.url, "turn two")
    assert second.headers["x-kvroute-backend"] == backend
    assert second.headers["x-kvroute-reason"] == "latency_hit"


async def test_killing_and_restarting_redis_fails_no_request_and_sync_resumes(
    redis_server, fleet, make_router, http
):
    one = await make_router(backends_of(fleet), index=synced_index(redis_server))
    two = await make_router(backends_of(fleet), index=synced_index(redis_server))
    statuses = await statuses_through_an_outage(http, [two.url, one.url], redis_server, 120)
    assert statuses == [200] * 120

    async def both_up() -> bool:
        ups = [total(await scrape(http, r.url), "kvroute_redis_up") for r in (one, two)]
        return ups == [1, 1]

    await wait_for(both_up, what="both replicas to count Redis as up again")
    # The beliefs queued during the outage go out first; the second replica must have applied
    # them all before the new prefix is sent, or they would pass for the new belief's arrival.
    await wait_for(lambda: stream_read(http, one, two), what="the outage's backlog to be applied")
    before = await peer_updates(http, two.url)
    # Several blocks of its own: after the burst every engine holds SYSTEM, so a short user turn
    # would leave the pick to load alone.
    fresh = "a new prefix after the outage, " * 30
    backend = (await chat(http, one.url, fresh)).headers["x-kvroute-backend"]

    async def resumed() -> bool:
        return await peer_updates(http, two.url) > before and await stream_read(http, one, two)

    await wait_for(resumed, what="the stream to carry beliefs again")
    after = await chat(http, two.url, fresh + "continued")
    assert after.headers["x-kvroute-backend"] == backend
    assert after.headers["x-kvroute-reason"] == "latency_hit"


async def test_beliefs_for_backends_this_replica_does_not_have_are_skipped(redis_server):
    base = {
        "index": synced_index(redis_server),
        "backends": [{"name": "e0", "url": "http://127.0.0.1:1"}],
    }
    wider = {**base, "backends": [*base["backends"], {"name": "e9", "url": "http://127.0.0.1:2"}]}
    narrow_index = build_index(config_from_dict(base), RouterMetrics())
    wide_index = build_index(config_from_dict(wider), RouterMetrics())
    for index in (narrow_index, wide_index):
        await index.start()
    try:
        wide_index.record("e9", [1, 2, 3])
        wide_index.record("e0", [1, 2])
        await wait_for(lambda: narrow_index.size() == 2, what="the known backend's beliefs taken")
        assert await narrow_index.match([1, 2, 3], ["e0"]) == {"e0": 2}
        assert narrow_index.blocks_of("e9") == 0
    finally:
        for index in (narrow_index, wide_index):
            await index.close()
