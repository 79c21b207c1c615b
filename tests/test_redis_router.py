"""Routers sharing a real Redis over HTTP: one view of the caches, one view of load, and outages."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from loadtest.sim.fleet import SimFleet
from router.config import BackendConfig
from router.fleet.backends import BackendPool
from router.fleet.shared_load import SharedLoad, start_shared_load
from router.index.redis_store import RedisIndex
from router.metrics import RouterMetrics
from router.redis.breaker import open_link
from router.redis.settings import RedisConfig
from tests.helpers import FAST, INDEX_BACKENDS, backends_of, open_index, sample, scrape, total, wait_for
from tests.helpers import chat_after_system as chat
from tests.redis_servers import RedisServer, redis_server


def redis_index(server: RedisServer, **redis: Any) -> dict[str, Any]:
    return {"store": "redis", "redis": {"url": server.url, "retry_interval_s": 0.05, **redis}}


async def test_a_prefix_routed_by_one_replica_is_found_by_another(redis_server, fleet, make_router, http):
    one = await make_router(backends_of(fleet), index=redis_index(redis_server))
    two = await make_router(backends_of(fleet), index=redis_index(redis_server))
    first = await chat(http, one.url, "turn one")
    backend = first.headers["x-kvroute-backend"]

    async def written() -> bool:
        return redis_server.client().zcard(f"{{kvroute}}:blocks:{backend}") > 0

    await wait_for(written, what=f"blocks of {backend} written to Redis")
    second = await chat(http, two.url, "turn two")
    assert second.status == 200
    assert second.headers["x-kvroute-backend"] == backend
    assert second.headers["x-kvroute-reason"] == "latency_hit"
    samples = await scrape(http, two.url)
    assert total(samples, "kvroute_matched_tokens_total") > 0
    assert total(samples, "kvroute_redis_fallbacks_total") == 0
    assert total(samples, "kvroute_redis_latency_seconds_count", op="match") >= 1
    assert total(samples, "kvroute_index_blocks") > 0


async def statuses_through_an_outage(
    http: aiohttp.ClientSession, urls: list[str], redis_server: RedisServer, count: int
) -> list[int]:
    """Send ``count`` requests, six at a time and taking turns over ``urls``; stop Redis once a
    fifth of them are answered and start it again at a half: every status, in answer order."""
    statuses: list[int] = []
    gate = asyncio.Semaphore(6)

    async def one(i: int) -> None:
        async with gate:
            resp = await chat(http, urls[i % len(urls)], f"question {i % 17}")
            statuses.append(resp.status)

    requests = asyncio.gather(*(one(i) for i in range(count)))
    await wait_for(lambda: len(statuses) >= count // 5, what=f"{count // 5} answers", timeout=30)
    redis_server.stop()
    await wait_for(lambda: len(statuses) >= count // 2, what="answers with Redis stopped", timeout=30)
    redis_server.start()
    await requests
    return statuses


async def test_killing_and_restarting_redis_fails_no_request(redis_server, fleet, make_router, http):
    router = await make_router(backends_of(fleet), index=redis_index(redis_server))
    statuses = await statuses_through_an_outage(http, [router.url], redis_server, 150)
    assert statuses == [200] * 150

    async def recovered() -> bool:
        samples = await scrape(http, router.url)
        return total(samples, "kvroute_redis_up") == 1

    await wait_for(recovered, what="the router to count Redis as up again")
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_redis_fallbacks_total") > 0
    assert total(samples, "kvroute_redis_errors_total") > 0
    assert total(samples, "kvroute_requests_total", status="200") == 150
    # Back on shared state: new requests are written to the restarted (empty) Redis again.
    await chat(http, router.url, "after the outage")

    async def rewritten() -> bool:
        return any(redis_server.client().scan_iter("{kvroute}:blocks:*"))

    await wait_for(rewritten, what="blocks written to Redis again")


async def test_policies_see_in_flight_requests_of_other_replicas(redis_server, make_router, http):
    slow = FAST.__class__(decode_step_s=0.02)
    async with SimFleet(2, timing=slow) as fleet:
        backends = backends_of(fleet)
        # Replica one only knows e0, so its long requests all land there.
        one = await make_router(backends[:1], index=redis_index(redis_server, load_interval_s=0.02))
        two = await make_router(
            backends, index=redis_index(redis_server, load_interval_s=0.02), routing={"policy": "least_load"}
        )
        long_requests = asyncio.gather(*(chat(http, one.url, f"long {i}", max_tokens=150) for i in range(3)))

        async def two_sees_e0_busy() -> bool:
            samples = await scrape(http, two.url)
            return total(samples, "kvroute_backend_in_flight_others", backend="e0") == 3

        await wait_for(two_sees_e0_busy, what="router two to see e0's three requests in flight")
        picks = [(await chat(http, two.url, f"short {i}")).headers["x-kvroute-backend"] for i in range(6)]
        # Without the shared view, least_load would see two idle backends and use both.
        assert picks == ["e1"] * 6
        assert all(r.status == 200 for r in await long_requests)


async def test_a_replica_that_dies_stops_counting():
    with redis_server() as server:
        config = RedisConfig(url=server.url, load_interval_s=0.05, load_ttl_s=0.5)
        backends = [BackendConfig(name="e0", url="http://127.0.0.1:1")]
        links = [open_link(config, CollectorRegistry()) for _ in "ab"]
        dead_pool, live_pool = BackendPool(backends), BackendPool(backends)
        dead, live = SharedLoad(links[0], dead_pool), SharedLoad(links[1], live_pool)
        dead_pool["e0"].in_flight = 4
        await dead.sync_once()
        await live.sync_once()
        assert live_pool["e0"].remote_in_flight == 4
        assert live_pool["e0"].view(0, 0).in_flight == 4
        # ``dead`` never publishes again and never withdraws (a crash): within load_ttl_s it is gone.
        live.start()

        async def forgotten() -> bool:
            return live_pool["e0"].remote_in_flight == 0

        await wait_for(forgotten, what="e0's remote in-flight count forgotten", timeout=3)
        parts = server.client().hgetall("{kvroute}:loadparts")
        assert list(parts) == [live.id.encode()]  # the dead replica's counts were deleted
        await live.close()
        assert server.client().hlen("{kvroute}:loadparts") == 0  # a clean stop withdraws at once
        assert server.client().hget("{kvroute}:loadsums", "n/e0") in (None, b"0")
        for link in links:
            await link.close()


def script_calls(server: RedisServer) -> int:
    """Script calls the server has run (each shared-load call is one)."""
    calls = server.command_calls()
    return calls.get("eval", 0) + calls.get("evalsha", 0)


async def test_an_idle_fleet_is_quiet_and_a_busy_replica_shares_its_load_at_once():
    """Nothing in flight anywhere: no call until ``load_idle_interval_s``. A request in flight:
    a call every ``load_interval_s``, by the replica that sent it and by one that then has one."""
    with redis_server() as server:
        config = RedisConfig(url=server.url, load_interval_s=0.01, load_idle_interval_s=30, load_ttl_s=60)
        backends = [BackendConfig(name=n, url="http://127.0.0.1:1") for n in ("e0", "e1")]
        links = [open_link(config, CollectorRegistry()) for _ in "ab"]
        pool_one, pool_two = BackendPool(backends), BackendPool(backends)
        one, two = SharedLoad(links[0], pool_one), SharedLoad(links[1], pool_two)
        try:
            one.start()
            two.start()

            async def both_published() -> bool:
                return server.client().hlen("{kvroute}:loadparts") == 2

            await wait_for(both_published, what="both replicas' first call")
            quiet_from = script_calls(server)
            await asyncio.sleep(0.3)  # thirty intervals, nothing in flight
            assert script_calls(server) == quiet_from
            pool_one["e0"].in_flight = 2  # replica one sends two requests to e0

            async def published() -> bool:
                return server.client().hget("{kvroute}:loadsums", "n/e0") == b"2"

            await wait_for(published, what="replica one's requests published", timeout=3)
            assert pool_two["e0"].remote_in_flight == 0  # two is idle: it has not called since
            pool_one["e0"].in_flight = 0  # one's requests end: it publishes that, then is idle

            async def withdrawn() -> bool:
                return server.client().hget("{kvroute}:loadsums", "n/e0") == b"0"

            await wait_for(withdrawn, what="replica one's finished requests published", timeout=3)
            quiet_from = script_calls(server)
            await asyncio.sleep(0.1)
            assert script_calls(server) == quiet_from
            pool_one["e0"].in_flight = 2
            await wait_for(published, what="replica one's new requests published", timeout=3)
            pool_two["e1"].in_flight = 1  # replica two sends one, and reads the others' at once

            async def seen() -> bool:
                return pool_two["e0"].remote_in_flight == 2 and pool_one["e1"].remote_in_flight == 1

            await wait_for(seen, what="each replica's requests seen by the other", timeout=3)
        finally:
            await one.close()
            await two.close()
            for link in links:
                await link.close()


@contextlib.asynccontextmanager
async def riding_view(
    server: RedisServer, interval_s: float
) -> AsyncIterator[tuple[RedisIndex, RouterMetrics, BackendPool]]:
    """One replica's Redis index with the shared load view riding on it (``load_on_lookup``),
    its periodic calls every ``interval_s``; the view is closed after."""
    redis = {
        "url": server.url,
        "load_interval_s": interval_s,
        "load_idle_interval_s": interval_s,
        "load_ttl_s": 10,
    }
    async with open_index(redis) as (index, metrics):
        pool = BackendPool([BackendConfig(name=n, url=f"http://127.0.0.1:1/{n}") for n in INDEX_BACKENDS])
        view = start_shared_load(index, pool)
        assert view is not None
        try:
            yield index, metrics, pool
        finally:
            await view.close()


@pytest.mark.parametrize(("on_lookup", "fleet"), [(True, 32), (False, 32), (True, 2)])
async def test_a_pick_reaches_another_replicas_next_lookup_with_its_load(on_lookup: bool, fleet: int):
    """``load_on_lookup``: a replica's write after its pick publishes its load, and another
    replica's next lookup reads it, long before the periodic view's next call (1 s here).
    Without it, or past ``load_interval_fleet`` replicas x backends (2 x 3 > 2), the other
    replica sees the pick only at its next call."""
    rides = on_lookup and fleet == 32
    with redis_server() as server:
        redis = {
            "url": server.url,
            "load_interval_s": 1.0,
            "load_idle_interval_s": 1.0,
            "load_ttl_s": 10,
            "load_on_lookup": on_lookup,
            "load_interval_fleet": fleet,
        }
        backends = [BackendConfig(name=n, url=f"http://127.0.0.1:1/{n}") for n in INDEX_BACKENDS]
        async with open_index(redis) as (one, _), open_index(redis) as (two, _):
            pool_one, pool_two = BackendPool(backends), BackendPool(backends)
            views = [start_shared_load(one, pool_one), start_shared_load(two, pool_two)]
            try:

                async def both_published() -> bool:
                    return server.client().hlen("{kvroute}:loadparts") == 2

                await wait_for(both_published, what="both replicas' first call")
                chain = [1, 2, 3]
                await two.match(chain, INDEX_BACKENDS)  # loads the scripts: no first-call latency below
                # Replica one picks "b" for a prompt of 600 uncached tokens (as an Attempt counts it).
                pool_one["b"].in_flight += 1
                pool_one["b"].pending_prefill_tokens += 600
                pool_one["b"].pending_prefill_requests += 1
                one.picked("b", chain)
                await one.flush()
                before = server.command_calls()
                assert await two.match(chain, INDEX_BACKENDS) == {"a": 0, "b": 3, "c": 0}
                after = server.command_calls()
                # Still one round trip: the sums come back from the lookup's own script.
                assert after["evalsha"] - before["evalsha"] == 1
                assert after.get("hmget", 0) - before.get("hmget", 0) == (1 if rides else 0)
                seen = (
                    pool_two["b"].remote_in_flight,
                    pool_two["b"].remote_pending_prefill_tokens,
                    pool_two["b"].remote_pending_prefill_requests,
                )
                assert seen == ((1, 600, 1) if rides else (0, 0, 0))
                assert pool_one["b"].remote_in_flight == 0  # its own load is not counted twice
                await one.match(chain, INDEX_BACKENDS)
                assert pool_one["b"].remote_in_flight == 0
                # A Redis that lost its scripts (a restart) answers the pipelined calls after
                # loading them again.
                server.client().script_flush()
                pool_one["c"].in_flight += 1
                one.picked("c", [7, 8])
                await one.flush()
                assert await two.match([7, 8], INDEX_BACKENDS) == {"a": 0, "b": 0, "c": 2}
                assert pool_two["c"].remote_in_flight == (1 if rides else 0)
            finally:
                for view in views:
                    assert view is not None
                    await view.close()


async def test_a_load_that_fails_beside_a_write_loses_neither_the_write_nor_later_publishes():
    """The load is a passenger on the write: when its script fails (here the sums' key holds a
    string), the write still lands and is not counted as dropped, and once the key is right
    again the next write publishes the load."""
    with redis_server() as server:
        async with riding_view(server, interval_s=1.0) as (index, metrics, pool):

            async def first_call() -> bool:
                return server.client().hlen("{kvroute}:loadparts") == 1

            await wait_for(first_call, what="the first periodic call")
            server.client().set("{kvroute}:loadsums", "not a hash")
            pool["a"].in_flight = 1
            index.picked("a", [1, 2, 3])
            await index.flush()
            assert server.client().zcard("{kvroute}:blocks:a") == 3
            assert sample(metrics, "kvroute_index_dropped_updates_total", reason="redis_unavailable") == 0
            assert sample(metrics, "kvroute_redis_errors_total", op="load", kind="response") == 1
            server.client().delete("{kvroute}:loadsums")
            index.picked("a", [1, 2, 3, 4])
            await index.flush()
            assert server.client().hget("{kvroute}:loadsums", "n/a") == b"1"


async def test_a_replica_whose_writes_carry_its_load_skips_its_periodic_calls():
    """Riding on the index, a busy replica publishes with each write; while its writes come
    more often than ``load_interval_s`` its own periodic calls would add nothing, and stop."""
    with redis_server() as server:
        async with riding_view(server, interval_s=0.05) as (index, _, pool):
            view = index.load_rider
            assert isinstance(view, SharedLoad)
            calls = 0
            sync_once = view.sync_once

            async def counted() -> None:
                nonlocal calls
                calls += 1
                await sync_once()

            view.sync_once = counted  # type: ignore[method-assign]
            pool["a"].in_flight = 1  # busy: the periodic calls go on
            await asyncio.sleep(0.5)
            assert calls >= 5
            calls = 0
            for i in range(50):  # a write every 10 ms, each carrying the load
                index.picked("a", [i + 1])
                await asyncio.sleep(0.01)
            assert calls <= 1
            assert server.client().hget("{kvroute}:loadsums", "n/a") == b"1"


async def test_a_larger_fleet_shares_its_load_less_often_but_well_within_the_ttl():
    """Past ``load_interval_fleet`` replicas x backends each replica stretches its interval in
    proportion, so the fleet's calls cost Redis about the same whatever its size; never so far
    that the others would count it dead (a third of ``load_ttl_s`` at most)."""
    with redis_server() as server:
        backends = [BackendConfig(name=n, url="http://127.0.0.1:1") for n in ("e0", "e1")]
        for ttl, stretched in ((0.3, 0.03), (0.06, 0.02)):
            config = RedisConfig(url=server.url, load_interval_s=0.01, load_interval_fleet=2, load_ttl_s=ttl)
            links = [open_link(config, CollectorRegistry()) for _ in range(3)]
            views = [SharedLoad(link, BackendPool(backends)) for link in links]
            try:
                await views[0].sync_once()
                assert (views[0].replicas, views[0].interval()) == (1, 0.01)  # 1 x 2 backends: not past 2
                for view in views:
                    await view.sync_once()
                assert views[2].replicas == 3
                assert views[2].interval() == pytest.approx(stretched)  # 3 x 2 / 2 = 3x, or ttl / 3
            finally:
                for view in views:
                    await view.close()
                for link in links:
                    await link.close()


async def test_a_backend_leaving_one_replica_is_withdrawn_from_the_shared_view():
    with redis_server() as server:
        config = RedisConfig(url=server.url)
        backends = [BackendConfig(name=n, url="http://127.0.0.1:1") for n in ("e0", "e1")]
        links = [open_link(config, CollectorRegistry()) for _ in "ab"]
        pool_one, pool_two = BackendPool(backends), BackendPool(backends)
        one, two = SharedLoad(links[0], pool_one), SharedLoad(links[1], pool_two)
        pool_one["e0"].in_flight, pool_one["e1"].in_flight = 2, 5
        await one.sync_once()
        await two.sync_once()
        assert (pool_two["e0"].remote_in_flight, pool_two["e1"].remote_in_flight) == (2, 5)
        pool_one.remove("e1")  # discovery saw it go; its requests there no longer count
        await one.sync_once()
        await two.sync_once()
        assert (pool_two["e0"].remote_in_flight, pool_two["e1"].remote_in_flight) == (2, 0)
        for link in links:
            await link.close()


async def test_a_replica_publishes_a_new_prefix_at_the_pick_before_its_prefill_ends(
    redis_server, make_router, http
):
    """A burst sharing a new prefix that lands on two replicas during its prefill follows the
    first pick: the other replica learns where it went before the engine's first byte."""
    slow_prefill = FAST.__class__(prefill_base_s=1.0)
    async with SimFleet(3, timing=slow_prefill) as fleet:
        routing = {"policy": "prefix_aware"}
        one = await make_router(backends_of(fleet), index=redis_index(redis_server), routing=routing)
        two = await make_router(backends_of(fleet), index=redis_index(redis_server), routing=routing)
        first = asyncio.create_task(chat(http, one.url, "turn one"))
        keys = [f"{{kvroute}}:blocks:e{i}" for i in range(3)]

        async def published() -> bool:
            return any(redis_server.client().zcard(key) > 0 for key in keys)

        await wait_for(published, what="the pick published to Redis", timeout=0.9)
        assert not first.done()  # still in its one-second prefill
        second = await chat(http, two.url, "turn two")
        assert second.headers["x-kvroute-reason"] == "prefix_hit"
        assert second.headers["x-kvroute-backend"] == (await first).headers["x-kvroute-backend"]


async def test_replicas_share_their_pending_prefill_and_policies_see_it():
    """What the default policy reads of a backend (pending prefill, and so its decode batch)
    counts every replica's requests, not only this one's."""
    with redis_server() as server:
        config = RedisConfig(url=server.url)
        backends = [BackendConfig(name=n, url="http://127.0.0.1:1") for n in ("e0", "e1")]
        links = [open_link(config, CollectorRegistry()) for _ in "abc"]
        pools = [BackendPool(backends) for _ in links]
        views = [SharedLoad(link, pool) for link, pool in zip(links, pools, strict=True)]
        for pool, (tokens, requests) in zip(pools[:2], [(3000, 2), (500, 1)], strict=True):
            pool["e0"].in_flight = 4
            pool["e0"].pending_prefill_tokens = tokens
            pool["e0"].pending_prefill_requests = requests
        for view in views:
            await view.sync_once()
        e0 = pools[2]["e0"].view(0, 0)
        assert (e0.in_flight, e0.pending_prefill_tokens, e0.pending_prefill_requests) == (8, 3500, 3)
        assert e0.decoding == 5
        await views[0].sync_once()  # it published first: now it reads the others'
        mine = pools[0]["e0"].view(0, 0)  # its own counts plus the others', never twice
        assert (mine.in_flight, mine.pending_prefill_tokens, mine.pending_prefill_requests) == (8, 3500, 3)
        assert pools[2]["e1"].view(0, 0).pending_prefill_tokens == 0
        for link in links:
            await link.close()


async def test_the_shared_sums_match_every_live_replicas_counts_through_churn():
    """Replicas publish changing counts, leave, come back, and drop and regain backends; after
    every call the caller sees exactly the sum of the other live replicas' last counts."""
    rng = random.Random(5)
    names = ["e0", "e1", "e2"]
    with redis_server() as server:
        config = RedisConfig(url=server.url)
        links = [open_link(config, CollectorRegistry()) for _ in "abcd"]
        pools = [BackendPool([BackendConfig(name=n, url="http://127.0.0.1:1") for n in names]) for _ in links]
        views = [SharedLoad(link, pool) for link, pool in zip(links, pools, strict=True)]
        published: dict[int, dict[str, tuple[int, int, int]]] = {}
        for _ in range(120):
            i = rng.randrange(len(views))
            pool = pools[i]
            if rng.random() < 0.1:
                await views[i].close()
                published.pop(i, None)
                continue
            if rng.random() < 0.15 and len(pool) > 1:
                pool.remove(rng.choice([b.name for b in pool]))
            elif rng.random() < 0.15:
                for name in names:
                    pool.add(BackendConfig(name=name, url="http://127.0.0.1:1"))
            for backend in pool:
                backend.in_flight = rng.randrange(6)
                backend.pending_prefill_tokens = rng.randrange(5000)
                backend.pending_prefill_requests = rng.randrange(3)
            await views[i].sync_once()
            published[i] = {
                b.name: (b.in_flight, b.pending_prefill_tokens, b.pending_prefill_requests) for b in pool
            }
            for backend in pool:
                others = [
                    counts[backend.name]
                    for j, counts in published.items()
                    if j != i and backend.name in counts
                ]
                expected = tuple(sum(c[k] for c in others) for k in range(3))
                seen = (
                    backend.remote_in_flight,
                    backend.remote_pending_prefill_tokens,
                    backend.remote_pending_prefill_requests,
                )
                assert seen == expected
        for link in links:
            await link.close()


async def test_lost_sums_are_rebuilt_from_the_live_replicas_counts():
    """A sums key lost (evicted, flushed) or driven negative is rebuilt from what each live
    replica last published, at the next call."""
    with redis_server() as server:
        config = RedisConfig(url=server.url)
        backends = [BackendConfig(name="e0", url="http://127.0.0.1:1")]
        links = [open_link(config, CollectorRegistry()) for _ in "ab"]
        pools = [BackendPool(backends) for _ in links]
        one, two = (SharedLoad(link, pool) for link, pool in zip(links, pools, strict=True))
        pools[0]["e0"].in_flight = 3
        await one.sync_once()
        server.client().delete("{kvroute}:loadsums")
        await two.sync_once()
        assert pools[1]["e0"].remote_in_flight == 3
        server.client().hset("{kvroute}:loadsums", "n/e0", -10)
        pools[0]["e0"].in_flight = 2  # a change: its decrement finds the sum negative
        await one.sync_once()
        await two.sync_once()
        assert pools[1]["e0"].remote_in_flight == 2
        for link in links:
            await link.close()
