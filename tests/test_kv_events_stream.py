"""Precise mode keeps its index equal to what simulated engines report, over real ZMQ sockets.

Engines publish their cache's changes in vLLM's or SGLang's format; the router subscribes
(endpoint discovered from the engine, or configured), and its index must hold exactly the
engine's blocks through inserts, evictions, a lost message (filled by replay), a cache reset
and an engine restart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from loadtest.sim.fleet import SimFleet
from loadtest.sim.timing import EngineTiming
from router.config import BackendConfig
from router.http.app import INDEX, POOL
from router.http.server import RouterServer
from router.index.precise import PreciseIndex
from tests.helpers import FAST, MakeRouter, backends_of, scrape, total, wait_for

#: Small KV caches (48 blocks of 16 tokens), so a handful of prompts forces evictions.
TIGHT = EngineTiming(
    prefill_base_s=FAST.prefill_base_s,
    prefill_per_token_s=FAST.prefill_per_token_s,
    decode_step_s=FAST.decode_step_s,
    kv_blocks=48,
)
EVENTS = {"mode": "events", "tokenizer": {"kind": "chunk"}}


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def engine_keys(fleet: SimFleet, i: int) -> set[int]:
    """What engine ``i`` holds, as its events name the blocks (SGLang: signed 64-bit)."""
    engine = fleet.engines[i]
    keys = engine.cache.keys()
    return {_signed(h) for h in keys} if engine.kv_events_format == "sglang" else keys


def backends(fleet: SimFleet) -> list[dict[str, Any]]:
    """The fleet as backends of its engine kind (which decides where discovery asks)."""
    return [
        {**b, "engine": e.kv_events_format} for b, e in zip(backends_of(fleet), fleet.engines, strict=True)
    ]


def index_of(router: RouterServer) -> PreciseIndex:
    index = router.app[INDEX]
    assert isinstance(index, PreciseIndex)
    return index


async def in_sync(router: RouterServer, fleet: SimFleet, i: int = 0) -> None:
    async def equal() -> bool:
        return index_of(router).engine_hashes(f"e{i}") == engine_keys(fleet, i)

    await wait_for(equal, what=f"the index of e{i} equal to its engine's cache")


async def live(http: aiohttp.ClientSession, router: RouterServer, fleet: SimFleet) -> None:
    """Wait until the subscription is live: a request's events reached the index.

    A SUB socket's subscription reaches the publisher a moment after it connects; batches
    published before are not delivered (ZMQ's "slow joiner"). Tests that lose a message on
    purpose first make sure the loss is theirs.
    """
    await synced(http, router)
    await complete(http, fleet.urls[0], prompt(0))
    await in_sync(router, fleet)


async def synced(http: aiohttp.ClientSession, router: RouterServer, count: int = 1) -> None:
    """Wait until ``count`` connect-resyncs completed (the stream is placed in its sequence)."""

    async def done() -> bool:
        samples = await scrape(http, router.url)
        return total(samples, "kvroute_kv_events_resyncs_total", reason="connect") >= count

    await wait_for(done, what=f"{count} connect-resyncs")


async def complete(http: aiohttp.ClientSession, url: str, text: str) -> dict[str, Any]:
    body = {"model": "sim-model", "prompt": text, "max_tokens": 2}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        return await resp.json()


def prompt(n: int, blocks: int = 12) -> str:
    """A distinct prompt of ``blocks`` full 16-token blocks (64 characters each)."""
    return "".join(f"<prompt {n} block {b}>".ljust(64, ".") for b in range(blocks))


@pytest.fixture(params=["vllm", "sglang"])
async def engines(request: pytest.FixtureRequest) -> AsyncIterator[SimFleet]:
    async with SimFleet(1, timing=TIGHT, kv_events=request.param) as fleet:
        yield fleet


async def test_index_follows_inserts_and_evictions(
    engines: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends(engines), index=EVENTS)
    await live(http, router, engines)
    for n in range(1, 6):
        await complete(http, router.url, prompt(n))
        await in_sync(router, engines)
    assert engines.engines[0].cache.evictions > 0
    assert len(engines.engines[0].cache) == 48
    assert index_of(router).blocks_of("e0") == 48


async def test_a_lost_message_is_recovered_by_replay(
    engines: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends(engines), index=EVENTS)
    await live(http, router, engines)
    publisher = engines.engines[0].publisher
    assert publisher is not None
    publisher.drop_next()
    await complete(http, engines.urls[0], prompt(1))
    await complete(http, engines.urls[0], prompt(2))
    await in_sync(router, engines)
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_kv_events_gaps_total", result="replayed") == 1
    assert total(samples, "kvroute_kv_events_gaps_total", result="lost") == 0
    assert publisher.published == 3


async def test_an_engine_restart_empties_its_entries_and_resyncs(
    engines: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends(engines), index=EVENTS)
    await live(http, router, engines)
    for n in range(1, 3):
        await complete(http, router.url, prompt(n))
    await in_sync(router, engines)
    assert index_of(router).blocks_of("e0") > 0

    await engines.engines[0].restart_kv_events()
    await synced(http, router, count=2)
    assert index_of(router).blocks_of("e0") == 0
    # Two requests: should the new subscription still be joining when the first one's batch
    # goes out, the second one's sequence number reveals the gap and replay fills it.
    await complete(http, router.url, prompt(7))
    await complete(http, router.url, prompt(8))
    await in_sync(router, engines)
    assert index_of(router).blocks_of("e0") == 24


async def test_a_prefix_cache_reset_clears_the_backends_entries(
    engines: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends(engines), index=EVENTS)
    await live(http, router, engines)
    async with http.post(f"{engines.urls[0]}/reset_prefix_cache") as resp:
        assert resp.status == 200
    await in_sync(router, engines)
    assert index_of(router).blocks_of("e0") == 0
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_kv_events_resyncs_total", reason="cleared") == 1


async def test_configured_endpoint_without_replay_counts_a_lost_gap(
    make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    async with SimFleet(1, timing=TIGHT, kv_events="vllm") as fleet:
        publisher = fleet.engines[0].publisher
        assert publisher is not None
        backends = [{"name": "e0", "url": fleet.urls[0], "kv_events": {"endpoint": publisher.endpoint}}]
        router = await make_router(backends, index=EVENTS)
        await live(http, router, fleet)
        publisher.drop_next()
        await complete(http, fleet.urls[0], prompt(1))
        await complete(http, fleet.urls[0], prompt(2))

        async def counted() -> bool:
            return total(await scrape(http, router.url), "kvroute_kv_events_gaps_total", result="lost") == 1

        await wait_for(counted, what="one lost gap counted")
        # The lost batch stored prompt 1; without replay the index never learns of it.
        held = index_of(router).engine_hashes("e0")
        assert held < fleet.engines[0].cache.keys()
        assert len(held) == 2 * 12


async def test_backends_added_and_removed_at_run_time_are_followed(
    make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    async with SimFleet(2, timing=TIGHT, kv_events="vllm") as fleet:
        first, second = backends_of(fleet)
        router = await make_router([first], index=EVENTS)
        await synced(http, router)
        # Discovery (or an operator) adds a backend: its events are followed from then on.
        pool = router.app[POOL]
        pool.add(BackendConfig(**second, models=["sim-model"]))
        await synced(http, router, count=2)
        await complete(http, fleet.urls[1], prompt(1))
        await in_sync(router, fleet, 1)
        assert index_of(router).blocks_of("e1") == 12

        pool.remove("e1")
        assert index_of(router).blocks_of("e1") == 0

        async def unsubscribed() -> bool:
            samples = await scrape(http, router.url)
            return total(samples, "kvroute_kv_events_connected", backend="e1") == 0

        await wait_for(unsubscribed, what="e1 unsubscribed")
        await complete(http, fleet.urls[1], prompt(2))
        assert index_of(router).engine_hashes("e1") == set()
