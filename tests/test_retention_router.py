"""Refreshes (``routing.retention``): a real router keeps a conversation that came back cached on
its engine by sending it again, and stops once the index no longer believes it there."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

from router.config import config_from_dict
from router.http.app import DISPATCHER, INDEX, METRICS, POOL
from router.http.server import RouterServer
from router.request_path.retention import IN_FLIGHT
from tests.fault_engine import MODEL, FaultEngine, backends
from tests.helpers import MakeRouter, admin_on_free_port, scrape, total, wait_for, wait_released

DOCUMENT = "".join(f"Clause {i}: the tenant keeps the premises in good repair. " for i in range(120))
#: Believed capacity of the engine, in router blocks of 256 characters: the document is ~27.
CAPACITY = 120
RETENTION = {"refresh_share": 0.1, "kept_share": 1.0}

Headers = dict[str, str] | None
Condition = Callable[[], Awaitable[bool]]


def turn(*questions: str) -> dict:
    """A conversation over the document, one user message per question."""
    messages: list[dict[str, str]] = [{"role": "system", "content": DOCUMENT}]
    for question in questions:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": "Yes."}]
    return {"model": MODEL, "messages": messages[:-1], "max_tokens": 5}


def one_shot(number: int) -> dict:
    """A prompt of ten fresh blocks nobody asks for again; streamed, so that an engine in
    ``hang_unstreamed`` mode answers it and holds only the router's refreshes."""
    text = "".join(f"Unrelated note {number}.{i}: nothing here comes back. " for i in range(60))
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 5, "stream": True}


async def ask(http: aiohttp.ClientSession, url: str, body: dict, headers: Headers = None) -> None:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def counted(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    return total(await scrape(http, url), name, **labels)


async def churn_until(http: aiohttp.ClientSession, url: str, condition: Condition, what: str) -> None:
    """Send one-shot prompts, one every 0.2 s and 30 at most, until ``condition``: uncached
    blocks arriving over several of the refresher's checks are what it measures the engine's
    turnover from."""
    for number in range(30):
        if await condition():
            return
        await ask(http, url, one_shot(number))
        await asyncio.sleep(0.2)
    raise AssertionError(f"no {what} after 30 one-shot prompts")


async def conversation_came_back(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession, headers: Headers = None
) -> tuple[FaultEngine, RouterServer]:
    """A router with refreshes in front of one engine, and a conversation's two turns through it
    (with ``headers``): the second makes the first's blocks a kept prefix there."""
    (engine,) = await fault_engines("ok")
    configured = [{**b, "capacity_blocks": CAPACITY} for b in backends([engine])]
    router = await make_router(configured, routing={"retention": RETENTION})
    await ask(http, router.url, turn("Who fixes the roof?"), headers)
    await ask(http, router.url, turn("Who fixes the roof?", "And the garden?"), headers)
    return engine, router


def refreshed(http: aiohttp.ClientSession, router: RouterServer, engine: FaultEngine) -> Condition:
    """Whether the router has sent ``engine`` a refresh."""

    async def condition() -> bool:
        return await counted(http, router.url, "kvroute_refreshes_total", backend=engine.name) >= 1

    return condition


async def test_a_conversation_that_came_back_is_refreshed_on_its_engine_with_one_token(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    engine, router = await conversation_came_back(fault_engines, make_router, http)
    await churn_until(http, router.url, refreshed(http, router, engine), "refresh of the conversation")
    refresh = next(body for body in engine.json_bodies if body["max_tokens"] == 1)
    # The fewest messages holding the blocks the first turn had brought whole: the document's (the
    # first question ends in a block the chain leaves out, as it is not full).
    assert refresh["messages"] == [{"role": "system", "content": DOCUMENT}]
    assert refresh["stream"] is False
    asked = [rid for rid, body in zip(engine.request_ids, engine.json_bodies, strict=True) if body is refresh]
    assert asked[0].endswith("-refresh")

    async def ok() -> bool:
        return await counted(http, router.url, "kvroute_warmups_total", outcome="ok") >= 1

    await wait_for(ok, what="the refresh answered")
    await wait_released(http, router.url)


async def test_a_prefix_no_longer_believed_cached_is_not_refreshed_but_forgotten(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    engine, router = await conversation_came_back(fault_engines, make_router, http)
    keeper = router.app[DISPATCHER].refresher.keeper
    assert keeper.kept_blocks(engine.name) > 0
    router.app[INDEX].remove_backend(engine.name)  # the index forgets what the engine holds
    router.app[INDEX].add_backend(engine.name, CAPACITY)

    async def forgotten() -> bool:
        return keeper.kept_blocks(engine.name) == 0

    await churn_until(http, router.url, forgotten, "forgetting of the prefix")
    assert await counted(http, router.url, "kvroute_refreshes_total", backend=engine.name) == 0
    assert all(body["max_tokens"] != 1 for body in engine.json_bodies)


async def test_a_prompt_no_warmup_can_cut_is_not_kept(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = await fault_engines("ok")
    configured = [{**b, "capacity_blocks": CAPACITY} for b in backends([engine])]
    router = await make_router(configured, routing={"retention": RETENTION})
    body = {"model": MODEL, "prompt": list(range(2000)), "max_tokens": 5}
    for _ in range(2):
        async with http.post(f"{router.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
    assert router.app[DISPATCHER].refresher.keeper.kept_blocks(engine.name) == 0


async def test_without_retention_the_router_sends_no_refresh(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    (engine,) = await fault_engines("ok")
    router = await make_router(backends([engine]))
    assert router.app[DISPATCHER].refresher is None
    await ask(http, router.url, turn("Who fixes the roof?"))
    await ask(http, router.url, turn("Who fixes the roof?", "And the garden?"))
    assert engine.received == 2


async def test_a_refresh_carries_the_clients_credentials_but_not_its_trace(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    """An engine that checks its callers sees the refresh come from the same caller; the client's
    trace ended with its request."""
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    client = {"Authorization": "Bearer tenant-7", "X-Tenant": "acme", "traceparent": trace}
    engine, router = await conversation_came_back(fault_engines, make_router, http, client)
    await churn_until(http, router.url, refreshed(http, router, engine), "refresh of the conversation")
    kept_turn = engine.headers[1]
    refresh = next(h for h, b in zip(engine.headers, engine.json_bodies, strict=True) if b["max_tokens"] == 1)
    assert kept_turn["traceparent"] == trace  # the client's own request carried it upstream
    assert refresh["Authorization"] == "Bearer tenant-7"
    assert refresh["X-Tenant"] == "acme"
    assert "traceparent" not in refresh


async def test_refreshes_in_flight_stop_at_the_limit_and_the_rest_wait(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    """More kept prefixes fall due at once than may be in flight: ``IN_FLIGHT`` are sent, the
    others skipped (and due again later), while the engine holds every refresh. The engine holds
    them from the start (the clients' requests are streamed, and answered): on a slow machine
    some fall due while the leases are still being asked for."""
    (engine,) = await fault_engines("hang_unstreamed")
    configured = [{**b, "capacity_blocks": 1000} for b in backends([engine])]
    router = await make_router(configured, routing={"retention": RETENTION})
    for lease in range(IN_FLIGHT + 6):
        document = "".join(f"Lease {lease}, clause {i}: the tenant keeps it tidy. " for i in range(20))
        messages = [{"role": "system", "content": document}]
        first = {"model": MODEL, "messages": messages, "max_tokens": 5, "stream": True}
        await ask(http, router.url, first)
        await ask(http, router.url, {**first, "messages": [*messages, {"role": "user", "content": "Hi"}]})

    async def over_the_limit() -> bool:
        # A skip alone is no proof of the limit: a prefix that falls due again while its first
        # refresh is held is skipped too.
        skipped = await counted(http, router.url, "kvroute_warmups_total", outcome="skipped")
        return engine.open >= IN_FLIGHT and skipped >= 1

    await churn_until(http, router.url, over_the_limit, "refreshes held at the limit and one skipped")
    assert await counted(http, router.url, "kvroute_refreshes_total", backend=engine.name) == IN_FLIGHT
    assert engine.open == IN_FLIGHT
    engine.release.set()
    await wait_released(http, router.url)


async def test_a_refresh_in_flight_is_no_pending_prefill_on_the_engine_that_holds_its_prefix(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    """A refresh goes only where its prefix is believed wholly cached: while the engine holds
    it, it counts in flight and as a request before its first byte, but none of its tokens as
    prefill waiting there (``latency`` would steer the prefix's next turns away from it)."""
    engine, router = await conversation_came_back(fault_engines, make_router, http)
    engine.mode = "hang_unstreamed"

    async def held() -> bool:
        return engine.open == 1

    await churn_until(http, router.url, held, "refresh held by the engine")
    (backend,) = router.app[POOL]
    assert (backend.in_flight, backend.pending_prefill_requests, backend.pending_prefill_tokens) == (1, 1, 0)
    engine.release.set()
    await wait_released(http, router.url)


async def test_stopping_the_router_cancels_the_refreshes_in_flight(
    fault_engines, http: aiohttp.ClientSession
) -> None:
    (engine,) = await fault_engines("ok")
    configured = [{**b, "capacity_blocks": CAPACITY} for b in backends([engine])]
    listen = {"host": "127.0.0.1", "port": 0}
    config = admin_on_free_port(
        {"listen": listen, "backends": configured, "routing": {"retention": RETENTION}}
    )
    router = RouterServer(config_from_dict(config))
    await router.start()
    await ask(http, router.url, turn("Who fixes the roof?"))
    await ask(http, router.url, turn("Who fixes the roof?", "And the garden?"))
    engine.mode = "hang_unstreamed"

    async def held() -> bool:
        return engine.open == 1

    await churn_until(http, router.url, held, "refresh held by the engine")
    await asyncio.wait_for(router.stop(), timeout=10)
    await wait_for(lambda: engine.open == 0, what="the refresh's connection closed")
    failed = {"backend": engine.name, "outcome": "failed"}
    assert router.app[METRICS].registry.get_sample_value("kvroute_warmups_total", failed) == 1
    (backend,) = router.app[POOL]
    assert (backend.in_flight, backend.pending_prefill_tokens, backend.pending_prefill_requests) == (0, 0, 0)


async def test_a_reloaded_first_byte_timeout_applies_to_refreshes(
    engines, deploy, http: aiohttp.ClientSession
) -> None:
    engine, _ = engines
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{**b, "capacity_blocks": CAPACITY} for b in backends([engine])],
        "routing": {"retention": RETENTION},
        "admin": {"key": "admin-0123456789"},
        "upstream": {"first_byte_timeout_s": 120},
    }
    deployment = await deploy(config)
    url = deployment.server.url
    await ask(http, url, turn("Who fixes the roof?"))
    await ask(http, url, turn("Who fixes the roof?", "And the garden?"))
    deployment.write({**config, "upstream": {"first_byte_timeout_s": 0.5}})
    status, payload = await deployment.reload(http, {"Authorization": "Bearer admin-0123456789"})
    assert status == 200, payload
    engine.mode = "hang_unstreamed"

    async def timed_out() -> bool:
        return await counted(http, url, "kvroute_warmups_total", backend=engine.name, outcome="failed") >= 1

    await churn_until(http, url, timed_out, "refresh given up after the reloaded timeout")
    await wait_for(lambda: engine.open == 0, what="the timed-out refresh's connection closed")
