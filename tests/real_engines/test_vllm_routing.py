"""kvroute in front of two real vLLM replicas: conversations stick, and precise mode agrees with
the engine token for token (``x-kvroute-matched-tokens`` equals the engine's ``cached_tokens``)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
from openai import AsyncOpenAI

from loadtest.vllm_replicas import BLOCK_SIZE, VllmReplica
from router.http.app import INDEX
from router.index.precise import PreciseIndex
from tests.helpers import MakeRouter, wait_for
from tests.real_engines.traffic import (
    Conversation,
    backends,
    chat,
    complete,
    precise_index,
    subscribed,
    text,
)


async def test_approximate_routing_sticks_conversations_to_their_replica(
    vllm_pair: list[VllmReplica], make_router: MakeRouter, openai_client: AsyncOpenAI
) -> None:
    router = await make_router(backends(vllm_pair))
    client = openai_client.with_options(base_url=f"{router.url}/v1")
    conversations = [Conversation(seed) for seed in range(101, 105)]
    for _ in range(3):
        for conversation in conversations:
            await conversation.turn(client)
    placed = {}
    for conversation in conversations:
        exchanges = conversation.exchanges
        assert len({e.backend for e in exchanges}) == 1, [e.backend for e in exchanges]
        placed[conversation.seed] = exchanges[0].backend
        # The engine confirms: later turns found the conversation's prefix in its cache.
        assert all(e.cached >= BLOCK_SIZE for e in exchanges[1:]), [e.cached for e in exchanges]
    assert set(placed.values()) == {"e0", "e1"}, "both replicas get conversations"


async def test_precise_routing_predicts_exactly_what_the_engine_caches(
    vllm_pair: list[VllmReplica],
    make_router: MakeRouter,
    openai_client: AsyncOpenAI,
    http: aiohttp.ClientSession,
) -> None:
    """Sequential chat, completion and token-id traffic: the router's prediction is the engine's
    report, exactly, on every request (first turns included: 0 and 0)."""
    router = await make_router(backends(vllm_pair), index=precise_index())
    await subscribed(http, router.url)
    client = openai_client.with_options(base_url=f"{router.url}/v1")
    seen = []
    for conversation in [Conversation(seed) for seed in range(201, 204)]:
        for _ in range(3):
            seen.append(await conversation.turn(client))
    # A prompt of exactly 8 blocks: the engine computes its last token, so 7 blocks are a hit.
    ids = [(7 * i) % 3000 + 100 for i in range(8 * BLOCK_SIZE)]
    for _ in range(2):
        seen.append(await complete(client, ids))
    assert seen[-1].prompt_tokens == 8 * BLOCK_SIZE and seen[-1].cached == 7 * BLOCK_SIZE
    prompt = text(301, 400)
    for suffix in ("", " and one more", " and one more thing"):
        seen.append(await complete(client, prompt + suffix))
    assert [e.matched for e in seen] == [e.cached for e in seen]
    assert sum(e.cached for e in seen) > 0


async def test_precise_routing_learns_traffic_that_bypassed_the_router(
    vllm_pair: list[VllmReplica],
    make_router: MakeRouter,
    openai_client: AsyncOpenAI,
    http: aiohttp.ClientSession,
) -> None:
    router = await make_router(backends(vllm_pair), index=precise_index())
    await subscribed(http, router.url)
    index = router.app[INDEX]
    assert isinstance(index, PreciseIndex)
    conversation = Conversation(401)
    # Another client talks to e1 directly: this router never sees the request.
    direct = openai_client.with_options(base_url=f"{vllm_pair[1].url}/v1")
    await conversation.turn(direct)
    await wait_for(lambda: index.blocks_of("e1") > 0, what="e1's events applied")
    routed = await conversation.turn(openai_client.with_options(base_url=f"{router.url}/v1"))
    assert routed.backend == "e1" and routed.reason == "latency_hit"
    assert routed.matched == routed.cached > 0


async def test_precise_mode_finds_the_engines_event_sources_itself(
    vllm_pair: list[VllmReplica], make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(backends(vllm_pair), index=precise_index())
    await subscribed(http, router.url)
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        shown = {b["name"]: b["kv_events"] for b in (await resp.json())["backends"]}
    for replica in vllm_pair:
        with urllib.request.urlopen(f"{replica.url}/kv_event_sources", timeout=5) as resp:
            advertised = json.load(resp)["0"]
        assert advertised["endpoint"] == replica.events_endpoint
        assert shown[replica.name] == {"state": "connected", "endpoints": [replica.events_endpoint]}


async def test_predictions_under_concurrency(
    vllm_pair: list[VllmReplica],
    make_router: MakeRouter,
    openai_client: AsyncOpenAI,
    http: aiohttp.ClientSession,
    record_property,
) -> None:
    """Eight at a time, four conversations: events and requests interleave, so a prediction can
    be made between a sibling's pick and its events. The share of exact predictions is reported
    (``record_property``, and printed); most must be exact, and none may claim more than the
    prompt can hit."""
    router = await make_router(backends(vllm_pair), index=precise_index())
    await subscribed(http, router.url)
    client = openai_client.with_options(base_url=f"{router.url}/v1")
    prefixes = [text(500 + i, 300) for i in range(4)]
    questions = [
        [{"role": "system", "content": prefixes[i % 4]}, {"role": "user", "content": text(600 + i, 30)}]
        for i in range(32)
    ]
    gate = asyncio.Semaphore(8)

    async def ask(messages: list[dict[str, str]]):
        async with gate:
            return await chat(client, messages)

    seen = await asyncio.gather(*(ask(m) for m in questions))
    exact = sum(e.matched == e.cached for e in seen) / len(seen)
    record_property("exact_share", exact)
    print(f"exact predictions under concurrency 8: {exact:.0%} of {len(seen)}")
    assert exact >= 0.5
    assert all(e.matched <= e.prompt_tokens - 1 for e in seen)


async def test_closed_loop_reads_usage_yet_the_client_gets_the_stream_it_asked_for(
    vllm_pair: list[VllmReplica], make_router: MakeRouter, openai_client: AsyncOpenAI
) -> None:
    """The router asks the engine for usage (closed loop) and strips it again; the engine's
    system_fingerprint, which vLLM 0.32 then puts on the usage chunk, still reaches the client."""
    router = await make_router(backends(vllm_pair), index={"closed_loop": True})
    client = openai_client.with_options(base_url=f"{router.url}/v1")
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": text(800, 60)}], max_tokens=6, stream=True
    )
    served_by = next(r for r in vllm_pair if r.name == raw.headers["x-kvroute-backend"])
    chunks = [chunk async for chunk in raw.parse()]
    assert all(chunk.usage is None for chunk in chunks)
    assert [c.system_fingerprint for c in chunks if c.system_fingerprint] == [engine_fingerprint(served_by)]


def engine_fingerprint(replica: VllmReplica) -> str:
    """The engine's own system_fingerprint, as a direct non-streamed answer shows it."""
    request = urllib.request.Request(
        f"{replica.url}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return str(json.load(resp)["system_fingerprint"])
