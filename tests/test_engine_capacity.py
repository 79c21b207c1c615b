"""The engine's reported KV capacity sizes the router's beliefs (router/fleet/capacity.py).

Unit level: the conversion to index blocks, who wins, and each store's ``set_capacity``.
End to end: a router configured with a capacity far from its simulated engines' caches learns
theirs from ``/metrics`` and then holds no more than that per backend, in memory and in Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loadtest.sim.fleet import SimFleet
from router.config import BackendConfig, EngineMetricsConfig, IndexConfig, config_from_dict
from router.fleet.backends import Backend, BackendPool
from router.fleet.capacity import CapacitySizer
from router.fleet.engines import EngineStats
from router.fleet.scraper import LoadScraper
from router.index import MemoryIndex
from router.index.build import build_index
from router.index.precise import PreciseIndex
from router.index.redis_store import RedisIndex
from router.kv_events.settings import EventsConfig
from router.metrics import RouterMetrics
from tests.helpers import FAST, backends_of, scrape, total, wait_for
from tests.redis_servers import RedisServer, redis_server

#: The simulated engines' cache: 48 blocks of 16 tokens = 768 tokens = 3072 characters.
ENGINE_TIMING = dataclasses.replace(FAST, kv_blocks=48, block_tokens=16, chars_per_token=4)
#: The router's blocks: 128 characters, so the engines hold 3072 / 128 = 24 of them.
INDEX_BLOCK_CHARS = 128
LEARNED = 24
#: Far from the engines' real size: what the router believes before their first scrape.
CONFIGURED = 100_000
PINNED = 7


def backend(name: str = "a", capacity_blocks: int | None = None) -> Backend:
    return Backend(BackendConfig(name=name, url="http://127.0.0.1:1", capacity_blocks=capacity_blocks))


def sized_memory(capacity: int = CONFIGURED) -> tuple[MemoryIndex, CapacitySizer]:
    index = MemoryIndex(1_000_000)
    index.add_backend("a", capacity)
    return index, CapacitySizer(index, IndexConfig(block_size=INDEX_BLOCK_CHARS, chars_per_token=4))


def test_engine_tokens_become_index_blocks_of_characters_or_event_blocks():
    _, approximate = sized_memory()
    assert approximate.blocks(768) == LEARNED
    assert approximate.blocks(31) == 1  # rounded down, never zero
    events = CapacitySizer(
        PreciseIndex(16, {}, 2.0, 1000), IndexConfig(mode="events", events=EventsConfig(block_size=16))
    )
    assert events.blocks(768) == 48


def test_a_scrape_resizes_the_backend_unless_its_capacity_is_configured():
    index, sizer = sized_memory()
    index.add_backend("pinned", PINNED)
    sizer.observe(backend("a"), EngineStats(capacity_tokens=768))
    sizer.observe(backend("pinned", capacity_blocks=PINNED), EngineStats(capacity_tokens=768))
    assert (index.capacity_of("a"), index.capacity_of("pinned")) == (LEARNED, PINNED)
    sizer.observe(backend("a"), EngineStats(capacity_tokens=None))
    assert index.capacity_of("a") == LEARNED


def test_small_moves_of_an_estimated_capacity_do_not_resize():
    index, sizer = sized_memory()
    sizer.observe(backend("a"), EngineStats(capacity_tokens=100_000))
    assert index.capacity_of("a") == 3125
    sizer.observe(backend("a"), EngineStats(capacity_tokens=105_000))
    assert index.capacity_of("a") == 3125
    sizer.observe(backend("a"), EngineStats(capacity_tokens=50_000))
    assert index.capacity_of("a") == 1562


def test_shrinking_the_memory_index_evicts_least_recently_used_first():
    index = MemoryIndex(1_000_000)
    index.add_backend("a", 100)
    old, recent = list(range(1, 11)), list(range(101, 111))
    index.record("a", old)
    index.record("a", recent)
    index.set_capacity("a", 10)
    assert index.blocks_of("a") == 10 and index.size() == 10 and index.evictions == 10
    assert index.match_now(old) == {} and index.match_now(recent) == {"a": 10}


def test_a_bound_lowered_by_the_closed_loop_stays_lowered_and_regrows_to_the_engines_capacity():
    index = MemoryIndex(1_000_000)
    index.add_backend("a", 100)
    index.record("a", list(range(1, 51)))
    # The engine lost block 41: it and the ten blocks below it go, and the bound drops to 40.
    assert index.forget_through("a", index.belief_rank("a", 41)) == 10
    assert index.capacity_of("a") == 40
    index.set_capacity("a", 200)
    assert index.capacity_of("a") == 40
    index.regrow("a", 1000)
    assert index.capacity_of("a") == 200
    index.set_capacity("a", 30)
    assert (index.capacity_of("a"), index.blocks_of("a")) == (30, 30)


def test_the_precise_index_records_a_capacity_but_never_evicts_for_it():
    index = PreciseIndex(16, {}, provisional_ttl_s=60.0, max_blocks=1000)
    index.add_backend("a", CONFIGURED)
    index.record("a", list(range(1, 21)))
    index.set_capacity("a", 5)
    assert index.capacity_of("a") == 5
    assert index.match_now(list(range(1, 21)), ["a"]) == {"a": 20}


async def test_shrinking_the_redis_index_trims_the_shared_set_without_waiting_for_a_write(redis_server):
    config = config_from_dict(
        {
            "backends": [{"name": "a", "url": "http://127.0.0.1:1"}],
            "index": {
                "store": "redis",
                "redis": {"url": redis_server.url},
                "backend_capacity_blocks": CONFIGURED,
            },
        }
    )
    index = build_index(config, RouterMetrics())
    assert isinstance(index, RedisIndex)
    await index.start()
    try:
        chain = list(range(1, 21))
        index.record("a", chain)
        await index.flush()
        client = redis_server.client()
        assert client.zcard("{kvroute}:blocks:a") == 20
        index.set_capacity("a", 5)

        async def trimmed() -> bool:
            return client.zcard("{kvroute}:blocks:a") == 5

        await wait_for(trimmed, what="backend a's Redis blocks trimmed to 5")
        # A chain's first blocks are the most valuable (every longer prompt shares them).
        assert await index.match(chain, ["a"]) == {"a": 5}
        assert index.capacity_of("a") == 5 and index.local.blocks_of("a") == 5
    finally:
        await index.close()


@pytest.fixture(params=["memory", "redis"])
async def store(request) -> AsyncIterator[tuple[dict[str, Any], RedisServer | None]]:
    if request.param == "memory":
        yield {"store": "memory"}, None
    else:
        with redis_server() as s:
            yield {"store": "redis", "redis": {"url": s.url}}, s


async def test_a_router_learns_its_engines_capacity_and_holds_no_more(store, make_router, http):
    index_store, redis = store
    async with SimFleet(3, timing=ENGINE_TIMING) as fleet:
        backends = backends_of(fleet)
        backends[2]["capacity_blocks"] = PINNED  # configured: wins over the engine's report
        index = {"block_size": INDEX_BLOCK_CHARS, "backend_capacity_blocks": CONFIGURED, **index_store}
        router = await make_router(backends, index=index)
        expected = {"e0": LEARNED, "e1": LEARNED, "e2": PINNED}

        async def learned() -> bool:
            return {
                b["name"]: b["index_capacity_blocks"] for b in await admin_backends(http, router.admin_url)
            } == expected

        await wait_for(learned, what="index capacities learned from the engines")
        # 45 distinct prompts of 15 blocks each, spread by load: ~225 blocks offered to each backend.
        gate = asyncio.Semaphore(3)

        async def send(i: int) -> None:
            async with gate:
                await complete(http, router.url, f"{i:03d} distinct prompt " * 100)

        await asyncio.gather(*(send(i) for i in range(45)))

        async def held() -> dict[str, int]:
            if redis is None:
                return {b["name"]: b["index_blocks"] for b in await admin_backends(http, router.admin_url)}
            client = redis.client()
            return {name: client.zcard(f"{{kvroute}}:blocks:{name}") for name in expected}

        async def full() -> bool:
            now = await held()
            assert all(now[name] <= cap for name, cap in expected.items()), now
            return now == expected

        await wait_for(full, what="every backend's believed cache full to its capacity")
        samples = await scrape(http, router.url)
        for name, cap in expected.items():
            assert total(samples, "kvroute_index_backend_capacity_blocks", backend=name) == cap


async def admin_backends(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with http.get(f"{url}/admin/backends") as resp:
        assert resp.status == 200
        return (await resp.json())["backends"]


async def complete(http: aiohttp.ClientSession, url: str, prompt: str) -> None:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        await resp.read()
        assert resp.status == 200, await resp.text()


async def test_a_scrape_that_outlives_its_backend_reports_nothing() -> None:
    """A backend replaced (a reload pinning its capacity) or removed while its /metrics was being
    read: the late numbers describe no member of the pool, so they size nothing."""
    asked, release = asyncio.Event(), asyncio.Event()

    async def metrics(_request: web.Request) -> web.Response:
        asked.set()
        await release.wait()
        return web.Response(text='vllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    pool = BackendPool([BackendConfig(name="a", url=url, models=["m"])])
    reported: list[tuple[str, int | None]] = []
    try:
        async with aiohttp.ClientSession() as session:
            scraper = LoadScraper(
                pool, session, EngineMetricsConfig(), RouterMetrics(),
                on_stats=lambda backend, stats: reported.append((backend.name, stats.capacity_tokens)),
            )  # fmt: skip
            late = asyncio.create_task(scraper.scrape_once())
            await asyncio.wait_for(asked.wait(), 5)
            pool.remove("a")
            pool.add(BackendConfig(name="a", url=url, models=["m"], capacity_blocks=7))
            release.set()
            await late
            assert reported == []
            await scraper.scrape_once()  # the new member's own scrape reports as usual
            assert reported == [("a", 64 * 16)]
    finally:
        await runner.cleanup()
