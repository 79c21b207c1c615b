"""Warm-ups (``Decision.warmup``): a prefix copied to an engine beside the request, through a real
router, on the success, failure and skip paths."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
import pytest

from loadtest.sim.fleet import SimFleet
from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView, Warmup
from router.config import config_from_dict
from router.fleet.backends import BackendPool
from router.http.app import INDEX, METRICS, POOL
from router.http.server import RouterServer
from router.request_path.warmup import MAX_IN_FLIGHT
from tests.fault_engine import MODEL, backends
from tests.helpers import FAST, MakeRouter, admin_on_free_port, scrape, total, wait_for, wait_released

#: The router's default character block (``index.block_size``).
BLOCK = 256
DOCUMENT = "".join(f"Clause {i}: the tenant keeps the premises in good repair. " for i in range(120))


class WarmTheOther(RoutingPolicy):
    """Routes to the first candidate by name and asks for the prompt's first ``blocks`` blocks to
    be warmed on the second (all of them when ``blocks`` is 0)."""

    uses_prefix_match = True
    blocks = 0

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        first, second = sorted(backends, key=lambda b: b.name)[:2]
        blocks = self.blocks or len(request.chain)
        return Decision(first.name, "test", first.matched_blocks, Warmup(second.name, blocks))


class WarmTheDocument(WarmTheOther):
    blocks = len(DOCUMENT) // BLOCK - 1  # blocks that lie wholly inside the system message


def policy(cls: type) -> dict[str, str]:
    return {"policy": f"{__name__}:{cls.__name__}"}


def chat(question: str) -> dict:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": DOCUMENT},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "It depends on the lease."},
            {"role": "user", "content": "And the garden?"},
        ],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def warmups(http: aiohttp.ClientSession, router: RouterServer, outcome: str) -> float:
    return total(await scrape(http, router.url), "kvroute_warmups_total", outcome=outcome)


async def wait_counted(
    http: aiohttp.ClientSession, router: RouterServer, outcome: str, count: int = 1
) -> None:
    """Until ``count`` warm-ups are counted with ``outcome``."""

    async def counted() -> bool:
        return await warmups(http, router, outcome) == count

    await wait_for(counted, what=f"{count} warm-up(s) {outcome}")


async def ask(http: aiohttp.ClientSession, url: str, body: dict, path: str = "/v1/chat/completions") -> str:
    """Send one request, read its answer whole; the backend the router chose."""
    async with http.post(f"{url}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers.get("x-kvroute-backend", "")


async def test_a_warmup_sends_the_fewest_whole_messages_holding_the_prefix_with_one_token(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    first, second = await fault_engines("ok", "ok")
    router = await make_router(backends([first, second]), routing=policy(WarmTheDocument))
    assert await ask(http, router.url, chat("Who fixes the roof?")) == "f0"
    await wait_for(lambda: second.received == 1, what="the warm-up reached f1")
    assert first.json_bodies == [chat("Who fixes the roof?")]  # the request itself, unchanged
    (warm,) = second.json_bodies
    assert warm["messages"] == [{"role": "system", "content": DOCUMENT}]
    assert (warm["max_tokens"], warm["stream"], warm["model"]) == (1, False, MODEL)
    assert "stream_options" not in warm
    # Its own request id upstream, which names the request it came with.
    (asked,), (warmed,) = first.request_ids, second.request_ids
    assert asked and warmed == f"{asked}-warmup"
    await wait_counted(http, router, "ok")
    await wait_released(http, router.url)


async def test_a_completion_is_cut_to_the_prefix_blocks(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    first, second = await fault_engines("ok", "ok")
    router = await make_router(backends([first, second]), routing=policy(WarmTheDocument))
    body = {"model": MODEL, "prompt": DOCUMENT + " Question: who fixes the roof?", "max_tokens": 5}
    await ask(http, router.url, body, "/v1/completions")
    await wait_for(lambda: second.received == 1, what="the warm-up reached f1")
    assert second.json_bodies[0]["prompt"] == DOCUMENT[: WarmTheDocument.blocks * BLOCK]


async def test_a_prompt_of_token_ids_is_not_cut_and_its_warmup_is_skipped(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    first, second = await fault_engines("ok", "ok")
    router = await make_router(backends([first, second]), routing=policy(WarmTheOther))
    body = {"model": MODEL, "prompt": list(range(2000)), "max_tokens": 5}
    await ask(http, router.url, body, "/v1/completions")

    await wait_counted(http, router, "skipped")
    assert second.received == 0
    await wait_released(http, router.url)


async def test_the_warmed_engine_then_serves_the_prefix_from_its_cache(
    make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    async with SimFleet(2, timing=FAST, models=(MODEL,)) as fleet:
        configured = [{"name": f"e{i}", "url": url, "models": [MODEL]} for i, url in enumerate(fleet.urls)]
        router = await make_router(configured, routing=policy(WarmTheDocument))
        assert await ask(http, router.url, chat("Who fixes the roof?")) == "e0"
        await wait_counted(http, router, "ok")
        warmed = fleet.engines[1]
        (record,) = warmed.records
        assert record.output_tokens == 1 and record.cached_tokens == 0
        # The index believes the copy made, and the engine holds it: another tenant's first
        # question there finds the document cached.
        assert router.app[INDEX].blocks_of("e1") >= WarmTheDocument.blocks
        await ask(http, fleet.urls[1], chat("Who pays the rates?"))
        assert warmed.records[-1].cached_tokens >= 0.9 * record.prompt_tokens
        await wait_released(http, router.url)


@pytest.mark.parametrize("status", [500, 502])
async def test_a_failed_warmup_costs_the_request_nothing_and_its_belief_is_withdrawn(
    status: int, fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    """500: the engine's own refusal; 502: a failure the router would retry elsewhere."""
    first, broken = await fault_engines("ok", "status")
    broken.status = status
    router = await make_router(backends([first, broken]), routing=policy(WarmTheOther))
    for question in ("Who fixes the roof?", "Who pays the rates?"):
        assert await ask(http, router.url, chat(question)) == "f0"

    await wait_counted(http, router, "failed", 2)
    assert router.app[INDEX].blocks_of("f1") == 0
    assert router.app[INDEX].blocks_of("f0") > 0
    await wait_released(http, router.url)
    for backend in router.app[POOL]:
        assert (backend.pending_prefill_tokens, backend.pending_prefill_requests) == (0, 0)


async def test_at_most_four_warmups_are_in_flight(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    first, slow = await fault_engines("ok", "hang")
    router = await make_router(backends([first, slow]), routing=policy(WarmTheOther))
    for n in range(MAX_IN_FLIGHT + 1):  # distinct prompts: no two share a prefix
        body = {"model": MODEL, "prompt": f"Lease {n}. " + DOCUMENT, "max_tokens": 5}
        await ask(http, router.url, body, "/v1/completions")
    await wait_for(lambda: slow.open == MAX_IN_FLIGHT, what="four warm-ups held by f1")
    assert await warmups(http, router, "skipped") == 1
    slow.release.set()

    await wait_counted(http, router, "ok", MAX_IN_FLIGHT)
    await wait_released(http, router.url)


class WarmTheChosenBackend(RoutingPolicy):
    """A policy bug: asks for a warm-up on the backend it routes the request to."""

    uses_prefix_match = True

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        first = min(backends, key=lambda b: b.name)
        return Decision(first.name, "test", first.matched_blocks, Warmup(first.name, len(request.chain)))


async def test_a_warmup_asked_for_the_chosen_backend_is_not_sent(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    first, second = await fault_engines("ok", "ok")
    router = await make_router(backends([first, second]), routing=policy(WarmTheChosenBackend))
    assert await ask(http, router.url, chat("Who fixes the roof?")) == "f0"
    await wait_released(http, router.url)
    assert (first.received, second.received) == (1, 0)
    metrics = await scrape(http, router.url)
    assert total(metrics, "kvroute_warmups_total") == 0


class WarmATargetThatStartsDraining(WarmTheDocument):
    """As WarmTheDocument, and the target starts draining right after the pick, before the
    warm-up's task runs (``pool`` is set by the test)."""

    pool: BackendPool

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        decision = super().choose(request, backends)
        assert decision.warmup is not None
        target = next(b for b in self.pool if b.name == decision.warmup.backend)
        asyncio.get_running_loop().call_soon(setattr, target, "draining", True)
        return decision


async def test_a_target_that_left_rotation_since_the_pick_gets_no_warmup(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    first, second = await fault_engines("ok", "ok")
    router = await make_router(backends([first, second]), routing=policy(WarmATargetThatStartsDraining))
    WarmATargetThatStartsDraining.pool = router.app[POOL]
    assert await ask(http, router.url, chat("Who fixes the roof?")) == "f0"

    await wait_counted(http, router, "skipped")
    assert second.received == 0
    await wait_released(http, router.url)


async def test_one_warmup_per_backend_and_prefix_is_in_flight(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    first, slow = await fault_engines("ok", "hang")
    router = await make_router(backends([first, slow]), routing=policy(WarmTheDocument))
    for question in ("Who fixes the roof?", "Who pays the rates?"):
        await ask(http, router.url, chat(question))
    # Both questions share the document's blocks: the second warm-up would repeat the first.
    assert await warmups(http, router, "skipped") == 1
    assert slow.received == 1
    slow.release.set()
    await wait_counted(http, router, "ok")
    await wait_released(http, router.url)


async def test_stopping_the_router_cancels_a_warmup_in_flight(
    fault_engines, http: aiohttp.ClientSession
) -> None:
    first, slow = await fault_engines("ok", "hang")
    config = config_from_dict(
        admin_on_free_port(
            {"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends([first, slow]),
             "routing": policy(WarmTheDocument)}
        )
    )  # fmt: skip
    router = RouterServer(config)
    await router.start()
    await ask(http, router.url, chat("Who fixes the roof?"))
    await wait_for(lambda: slow.open == 1, what="the warm-up held by f1")
    await router.stop()
    await wait_for(lambda: slow.open == 0, what="the warm-up's connection closed")
    # Counted once, as failed, and everything it held on f1 given back.
    registry = router.app[METRICS].registry
    labels = {"backend": "f1", "outcome": "failed"}
    assert registry.get_sample_value("kvroute_warmups_total", labels) == 1
    held = next(b for b in router.app[POOL] if b.name == "f1")
    assert (held.in_flight, held.pending_prefill_tokens, held.pending_prefill_requests) == (0, 0, 0)
