"""In precise mode the engines' events, not the router's own history, decide where a prompt goes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from loadtest.sim.fleet import SimFleet
from router.http.app import INDEX
from router.http.server import RouterServer
from router.index.precise import PreciseIndex
from tests.helpers import FAST, MakeRouter, backends_of, scrape, total, wait_for

EVENTS = {"mode": "events", "tokenizer": {"kind": "chunk"}}
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. " * 40},
    {"role": "user", "content": [{"type": "text", "text": "Summarise "}, {"type": "text", "text": "this."}]},
]


@pytest.fixture
async def pair() -> AsyncIterator[SimFleet]:
    async with SimFleet(2, timing=FAST, kv_events="vllm") as fleet:
        yield fleet


async def chat(http: aiohttp.ClientSession, url: str) -> tuple[str | None, str | None, dict[str, Any]]:
    body = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 2}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        payload = await resp.json()
        return resp.headers.get("x-kvroute-backend"), resp.headers.get("x-kvroute-reason"), payload["usage"]


async def started(http: aiohttp.ClientSession, router: RouterServer) -> PreciseIndex:
    async def subscribed() -> bool:
        samples = await scrape(http, router.url)
        return total(samples, "kvroute_kv_events_resyncs_total", reason="connect") == 2

    await wait_for(subscribed, what="both engines subscribed")
    index = router.app[INDEX]
    assert isinstance(index, PreciseIndex)
    return index


async def test_a_prompt_cached_behind_the_routers_back_is_routed_to_its_engine(
    pair: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends_of(pair), index=EVENTS)
    index = await started(http, router)
    # e1 serves the conversation directly (another router, a batch job): this router never saw it.
    await chat(http, pair.urls[1])

    async def reported() -> bool:
        return index.engine_hashes("e1") == pair.engines[1].cache.keys() != set()

    await wait_for(reported, what="e1's index equal to its engine's cache")
    backend, reason, usage = await chat(http, router.url)
    assert (backend, reason) == ("e1", "latency_hit")
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_an_eviction_the_engine_reports_overrides_where_the_router_sent_the_prompt(
    pair: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends_of(pair), index=EVENTS)
    index = await started(http, router)
    first, _, _ = await chat(http, router.url)
    assert first is not None
    other = "e1" if first == "e0" else "e0"
    first_engine, other_engine = (pair.engines[int(name[1])] for name in (first, other))

    # The engine that got the prompt drops its cache; the other one gets the prompt directly.
    async with http.post(f"{first_engine.url}/reset_prefix_cache") as resp:
        assert resp.status == 200
    await chat(http, other_engine.url)

    async def reported() -> bool:
        return (
            index.blocks_of(first) == 0 and index.engine_hashes(other) == other_engine.cache.keys() != set()
        )

    await wait_for(reported, what="the first engine's blocks gone and the other's reported")
    backend, reason, usage = await chat(http, router.url)
    assert (backend, reason) == (other, "latency_hit")
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_the_router_predicts_exactly_what_the_engine_reports_cached(
    pair: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends_of(pair), index=EVENTS)
    index = await started(http, router)
    await chat(http, pair.urls[0])

    async def reported() -> bool:
        return index.engine_hashes("e0") == pair.engines[0].cache.keys() != set()

    await wait_for(reported, what="e0's index equal to its engine's cache")
    body = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 2}
    async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
        predicted = int(resp.headers["x-kvroute-matched-tokens"])
        usage = (await resp.json())["usage"]
    assert predicted == usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_approximate_mode_stays_the_default_and_needs_no_tokenizer(
    pair: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends_of(pair))
    assert not isinstance(router.app[INDEX], PreciseIndex)
    backend, _, _ = await chat(http, router.url)
    assert backend in ("e0", "e1")
    assert total(await scrape(http, router.url), "kvroute_kv_events_connected") == 0


async def test_a_pick_that_failed_over_leaves_no_belief_behind(
    make_router: MakeRouter, http: aiohttp.ClientSession, fault_engines
) -> None:
    """Precise mode believes a pick at once; a backend that then fails before taking the prompt
    must not keep that belief, or the next requests with the prefix would follow it there."""
    (f0,) = await fault_engines("ok")
    async with SimFleet(1, timing=FAST, kv_events="vllm") as fleet:
        router = await make_router(
            [{"name": "f0", "url": f0.url, "models": ["sim-model"]}, *backends_of(fleet)], index=EVENTS
        )

        async def drain(name: str, action: str) -> None:
            async with http.post(f"{router.admin_url}/admin/backends/{name}/{action}") as resp:
                assert resp.status == 200

        async def only_f0_predicts() -> int:
            """f0 as the only candidate: the cached tokens the router believes it holds."""
            await drain("e0", "drain")
            body = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 2}
            async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["x-kvroute-backend"] == "f0"
                predicted = int(resp.headers["x-kvroute-matched-tokens"])
            await drain("e0", "undrain")
            return predicted

        await only_f0_predicts()
        assert await only_f0_predicts() > 0  # the first pick's belief: f0 holds the prompt

        f0.mode = "status"  # 503: the belief draws the prompt to f0, which fails; e0 serves it
        backend, _, _ = await chat(http, router.url)
        assert backend == "e0" and f0.received == 3
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_retries_total") == 1

        f0.mode = "ok"
        assert await only_f0_predicts() == 0


async def test_a_prompt_of_whole_blocks_is_predicted_one_block_short_like_the_engine(
    pair: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    """The engine computes a prompt's last token whatever it holds: of a fully cached prompt of
    exactly four blocks it takes three from its cache, and the router predicts three."""
    router = await make_router(backends_of(pair), index=EVENTS)
    await started(http, router)
    body = {"model": "sim-model", "prompt": "The cat sat on the mat, then ran" * 8, "max_tokens": 2}
    seen = []
    for _ in range(2):
        async with http.post(f"{router.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
            seen.append((int(resp.headers["x-kvroute-matched-tokens"]), usage))
    (_, first), (predicted, second) = seen
    assert first["prompt_tokens"] == second["prompt_tokens"] == 64
    assert predicted == second["prompt_tokens_details"]["cached_tokens"] == 48


async def test_approximate_mode_predicts_no_more_of_a_completion_than_before_its_last_byte(
    pair: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends_of(pair), index={"block_size": 64})
    body = {"model": "sim-model", "prompt": "The cat sat on the mat, then ran" * 8, "max_tokens": 2}
    assert len(body["prompt"]) == 4 * 64
    predicted = []
    for _ in range(2):
        async with http.post(f"{router.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            predicted.append(int(resp.headers["x-kvroute-matched-tokens"]))
    assert predicted == [0, 3 * 16]
