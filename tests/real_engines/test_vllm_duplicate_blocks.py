"""vLLM holds two physical copies of a block under one hash when requests fill it side by side
(identical requests decoding the same tokens in the same steps each cache their own copy of the
block those tokens complete), and reports a store and a removal for each copy. The precise index
counts copies (router/index/precise.py): after the copies are evicted under cache pressure, no
removal is unknown to it and its prediction still equals what the engine reports cached."""

from __future__ import annotations

import asyncio

import aiohttp
from openai import AsyncOpenAI

from loadtest.vllm_replicas import SERVED_MODEL, VllmReplica
from router.http.app import INDEX
from router.index.precise import PreciseIndex
from tests.helpers import MakeRouter, wait_for
from tests.real_engines.traffic import backends, complete, precise_index, subscribed, text


async def test_duplicate_copies_of_a_block_are_counted_until_the_last_is_evicted(
    vllm_pair: list[VllmReplica],
    make_router: MakeRouter,
    openai_client: AsyncOpenAI,
    http: aiohttp.ClientSession,
) -> None:
    router = await make_router(backends(vllm_pair), index=precise_index())
    await subscribed(http, router.url)
    index = router.app[INDEX]
    assert isinstance(index, PreciseIndex)
    e0 = openai_client.with_options(base_url=f"{vllm_pair[0].url}/v1")
    shared = text(1200, 500)
    # Four at once, straight to e0, decoding the same 100 tokens (greedy) side by side.
    await asyncio.gather(
        *(
            e0.completions.create(
                model=SERVED_MODEL,
                prompt=shared,
                max_tokens=100,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for _ in range(4)
        )
    )
    # Then enough other prompts (~1,600 tokens each) to cycle the whole cache (1,024 blocks of 32).
    for i in range(30):
        await complete(e0, text(1300 + i, 1400), max_tokens=1)
    await wait_for(lambda: index.evictions > 0, what="e0's evictions applied")
    assert index.stats.unknown_removals == 0
    assert index.stats.orphans == 0
    routed = await complete(openai_client.with_options(base_url=f"{router.url}/v1"), shared)
    assert routed.matched == routed.cached
