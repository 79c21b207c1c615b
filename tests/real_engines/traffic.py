"""Requests the real-engine tests send, through the official ``openai`` client, and what came back.

Each exchange returns the router's headers (which backend, why, how many prompt tokens it
believed cached there) beside the engine's own usage report (``cached_tokens``), so a test can
put the router's prediction next to the engine's truth.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from loadtest.vllm_replicas import BLOCK_SIZE, SERVED_MODEL, VllmReplica, engine_model
from tests.helpers import scrape, total, wait_for

WORDS = (
    "router replica prefix cache block token engine queue prompt conversation request policy "
    "latency throughput decode prefill memory schedule event index session tenant model stream"
).split()


def text(seed: int, words: int) -> str:
    """Deterministic filler text of ``words`` words."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def backends(replicas: list[VllmReplica]) -> list[dict[str, Any]]:
    return [{"name": r.name, "url": r.url, "models": [SERVED_MODEL]} for r in replicas]


def precise_index() -> dict[str, Any]:
    """``index`` for precise mode with the tiny model's tokenizer and the engines' block size."""
    tokenizer = Path(engine_model()) / "tokenizer.json"
    return {"mode": "events", "events": {"block_size": BLOCK_SIZE}, "tokenizer": {"path": str(tokenizer)}}


async def subscribed(http: aiohttp.ClientSession, router_url: str, count: int = 2) -> None:
    """Until the router at ``router_url`` follows ``count`` engines' KV events."""

    async def connected() -> bool:
        return total(await scrape(http, router_url), "kvroute_kv_events_connected") == count

    await wait_for(connected, timeout=30, what="subscribed to every engine's KV events")


async def backend_view(http: aiohttp.ClientSession, admin_url: str, name: str) -> dict[str, Any]:
    """Backend ``name`` as ``GET /admin/backends`` shows it (at the router's ``admin_url``)."""
    async with http.get(f"{admin_url}/admin/backends") as resp:
        return next(b for b in (await resp.json())["backends"] if b["name"] == name)


async def in_rotation(http: aiohttp.ClientSession, admin_url: str, names: list[str]) -> None:
    """Until the router at ``admin_url`` has every backend of ``names`` in rotation: a replica
    restarted just before (by a test, or the conftest's fixture) has missed a new router's first
    health check under CPU load, and would then wait out ``health.interval_s`` for the next."""

    async def routable() -> bool:
        async with http.get(f"{admin_url}/admin/backends") as resp:
            views = {b["name"]: b for b in (await resp.json())["backends"]}
        return all(views[name]["routable"] for name in names)

    await wait_for(routable, timeout=30, what="every replica in the router's rotation")


@dataclass
class Exchange:
    backend: str
    reason: str
    #: x-kvroute-matched-tokens: the prompt tokens the router believed cached on ``backend``.
    matched: int
    #: The engine's report: prompt tokens, and those it took from its prefix cache.
    prompt_tokens: int
    cached: int
    text: str


def _exchange(raw: Any, content: str) -> Exchange:
    parsed = raw.parse()
    details = parsed.usage.prompt_tokens_details
    return Exchange(
        backend=raw.headers.get("x-kvroute-backend", ""),
        reason=raw.headers.get("x-kvroute-reason", ""),
        matched=int(raw.headers.get("x-kvroute-matched-tokens", "0")),
        prompt_tokens=parsed.usage.prompt_tokens,
        cached=(details.cached_tokens or 0) if details is not None else 0,
        text=content,
    )


async def chat(client: AsyncOpenAI, messages: list[dict[str, str]], max_tokens: int = 8) -> Exchange:
    raw = await client.chat.completions.with_raw_response.create(
        model=SERVED_MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    parsed = raw.parse()
    return _exchange(raw, parsed.choices[0].message.content or "")


async def complete(client: AsyncOpenAI, prompt: str | list[int], max_tokens: int = 8) -> Exchange:
    raw = await client.completions.with_raw_response.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    parsed = raw.parse()
    return _exchange(raw, parsed.choices[0].text)


class Conversation:
    """A multi-turn chat: a long system prompt of its own, then user turns and the replies."""

    def __init__(self, seed: int, system_words: int = 300) -> None:
        self.seed = seed
        self.messages: list[dict[str, str]] = [{"role": "system", "content": text(seed, system_words)}]
        self.turns = 0
        self.exchanges: list[Exchange] = []

    async def turn(self, client: AsyncOpenAI) -> Exchange:
        self.turns += 1
        self.messages.append({"role": "user", "content": text(self.seed * 100 + self.turns, 40)})
        exchange = await chat(client, self.messages)
        self.messages.append({"role": "assistant", "content": exchange.text})
        self.exchanges.append(exchange)
        return exchange
