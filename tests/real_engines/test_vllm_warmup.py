"""A warm-up against a real vLLM: the leading whole messages it sends, with ``max_tokens`` 1, leave
the prefix in that engine's cache, so the next conversation over the same document there finds
it cached (the engine's own ``cached_tokens``), as ``latency``'s warm-ups count on."""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
from openai import AsyncOpenAI

from loadtest.vllm_replicas import BLOCK_SIZE, SERVED_MODEL, VllmReplica
from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView, Warmup
from tests.helpers import MakeRouter, scrape, total, wait_for
from tests.real_engines.traffic import backends, chat, text

#: The router's default character block (``index.block_size``).
ROUTER_BLOCK = 256
DOCUMENT = text(701, 300)


class WarmTheDocumentOnE1(RoutingPolicy):
    """Routes to ``e0`` and asks for the blocks lying wholly inside the system message to be
    warmed on ``e1``: what ``latency`` asks when e1 is cheap and holds none of the document."""

    uses_prefix_match = True

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        chosen = next(b for b in backends if b.name == "e0")
        return Decision("e0", "test", chosen.matched_blocks, Warmup("e1", len(DOCUMENT) // ROUTER_BLOCK - 1))


def conversation(question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": DOCUMENT},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "It depends on the replica."},
        {"role": "user", "content": "And the queue?"},
    ]


async def document_tokens(http: aiohttp.ClientSession, replica: VllmReplica) -> int:
    """The system message's tokens as the engine's chat template renders it alone."""
    body = {
        "model": SERVED_MODEL,
        "messages": [{"role": "system", "content": DOCUMENT}],
        "add_generation_prompt": False,
    }
    async with http.post(f"{replica.url}/tokenize", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["count"]


async def test_a_warmup_leaves_the_document_in_the_real_engines_cache(
    vllm_pair: list[VllmReplica],
    make_router: MakeRouter,
    openai_client: AsyncOpenAI,
    http: aiohttp.ClientSession,
) -> None:
    e1 = vllm_pair[1]
    direct = openai_client.with_options(base_url=f"{e1.url}/v1")
    # A control first: a document e1 has never seen finds under one engine block cached there.
    unseen = [{"role": "system", "content": text(702, 300)}, {"role": "user", "content": "Who?"}]
    assert (await chat(direct, unseen)).cached < BLOCK_SIZE

    policy = {"policy": f"{__name__}:{WarmTheDocumentOnE1.__name__}"}
    router = await make_router(backends(vllm_pair), routing=policy)
    client = openai_client.with_options(base_url=f"{router.url}/v1")
    assert (await chat(client, conversation("Who restarts the engine?"))).backend == "e0"

    async def warmed() -> bool:
        return total(await scrape(http, router.url), "kvroute_warmups_total", outcome="ok") == 1

    await wait_for(warmed, timeout=60, what="the warm-up answered by e1")
    # Another conversation over the document, straight to e1: the engine reports the
    # document's whole blocks as taken from its cache, put there by the warm-up alone.
    later = await chat(direct, conversation("Who drains the queue?"))
    document = await document_tokens(http, e1)
    # Every engine block lying wholly inside the system message (measured: 352 of 376 tokens).
    assert later.cached >= document // BLOCK_SIZE * BLOCK_SIZE, (later.cached, document)
    assert later.cached < later.prompt_tokens
