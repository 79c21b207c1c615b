"""What kvroute reads off real vLLM replicas: load, KV usage and capacity are the engine's own."""

from __future__ import annotations

import aiohttp
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loadtest.vllm_replicas import BLOCK_SIZE, SERVED_MODEL, VllmReplica
from tests.helpers import MakeRouter, wait_for
from tests.real_engines.traffic import backend_view, backends, text


async def engine_samples(http: aiohttp.ClientSession, replica: VllmReplica) -> list[Sample]:
    """The engine's own ``/metrics``, read without blocking the event loop: the router under test
    runs on it, and a synchronous read of a busy engine (seconds, on a loaded CI machine) let the
    router's last scrape go stale, so that least_load saw no load anywhere and drew e0 at random."""
    async with http.get(f"{replica.url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        families = text_string_to_metric_families(await resp.text())
    return [s for f in families for s in f.samples if s.name.startswith("vllm:")]


async def engine_metrics(http: aiohttp.ClientSession, replica: VllmReplica) -> dict[str, float]:
    return {s.name: s.value for s in await engine_samples(http, replica)}


async def engine_capacity_tokens(http: aiohttp.ClientSession, replica: VllmReplica) -> int:
    (info,) = (s for s in await engine_samples(http, replica) if s.name == "vllm:cache_config_info")
    return int(info.labels["num_gpu_blocks"]) * int(info.labels["block_size"])


async def test_scraped_load_kv_usage_and_capacity_are_the_engines(
    vllm_pair: list[VllmReplica],
    make_router: MakeRouter,
    openai_client: AsyncOpenAI,
    http: aiohttp.ClientSession,
) -> None:
    e0 = vllm_pair[0]
    # A busy CPU engine can take seconds to answer /metrics on a loaded CI machine: with the
    # defaults (1 s timeout, stale after 2 s) its numbers went unknown (None) between two reads of
    # this test. What it checks is the numbers, not how soon they go stale, so both bounds are wide.
    router = await make_router(
        backends(vllm_pair),
        engine_metrics={"interval_s": 0.2, "timeout_s": 10, "stale_after_s": 30},
        routing={"policy": "least_load"},
    )
    before = await backend_view(http, router.admin_url, "e0")
    assert before["engine_capacity_tokens"] == await engine_capacity_tokens(http, e0) == 1024 * BLOCK_SIZE
    # A long generation straight to e0 keeps it running a request with blocks in use: a short
    # prompt leaves it most of the 2048-token context (about 8 s here), so that it still runs when
    # the assertions below read it, on a loaded machine too (with a 600-word prompt it did not).
    direct = openai_client.with_options(base_url=f"{e0.url}/v1")
    stream = await direct.completions.create(
        model=SERVED_MODEL,
        prompt=text(700, 100),
        max_tokens=1900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:

        async def busy() -> bool:
            view = await backend_view(http, router.admin_url, "e0")
            return view["engine_running"] == 1 and (view["kv_usage"] or 0) > 0

        await wait_for(busy, timeout=20, what="e0's running request and KV usage scraped")
        # The engine's usage grows by a block every 32 tokens decoded: the router's scrape, taken
        # between two reads of the engine's own /metrics, lies between them.
        before = (await engine_metrics(http, e0))["vllm:kv_cache_usage_perc"]

        async def scraped_since() -> bool:
            return ((await backend_view(http, router.admin_url, "e0"))["kv_usage"] or 0) >= before

        await wait_for(scraped_since, timeout=10, what="a scrape newer than the engine's first read")
        view = await backend_view(http, router.admin_url, "e0")
        after = await engine_metrics(http, e0)
        assert view["engine_running"] == after["vllm:num_requests_running"] == 1
        assert view["engine_waiting"] == after["vllm:num_requests_waiting"] == 0
        assert 0 < before <= view["kv_usage"] <= after["vllm:kv_cache_usage_perc"]
        # The busy replica is the one least_load avoids.
        answer = await openai_client.with_options(
            base_url=f"{router.url}/v1"
        ).completions.with_raw_response.create(model=SERVED_MODEL, prompt="hello", max_tokens=2)
        assert answer.headers["x-kvroute-backend"] == "e1", (
            answer.headers["x-kvroute-reason"],
            await backend_view(http, router.admin_url, "e0"),
            await backend_view(http, router.admin_url, "e1"),
        )
    finally:
        await stream.close()

    async def idle() -> bool:
        return (await backend_view(http, router.admin_url, "e0"))["engine_running"] == 0

    await wait_for(idle, timeout=20, what="the aborted stream gone from e0")
