"""Every built-in policy behind the real router, over HTTP, against simulated engines."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.sim.fleet import SimFleet
from policies.routing import BUILTIN
from router.http.app import POOL
from tests.helpers import FAST, backends_of, scrape, total, wait_for
from tests.test_policies_rules import REASONS

MODEL = "sim-model"
SYSTEM = "You are a careful assistant. " * 40


def body(text: str, **extra) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **extra}


@pytest.mark.parametrize("policy", sorted(BUILTIN))
async def test_no_healthy_backend_is_503_whatever_the_policy(policy, make_router, http):
    """'All unhealthy' never reaches a policy: the dispatcher answers first."""
    async with SimFleet(2, timing=FAST) as gone:
        backends = [{**b, "models": [MODEL]} for b in backends_of(gone)]
    router = await make_router(backends, routing={"policy": policy})
    async with http.post(f"{router.url}/v1/chat/completions", json=body("x")) as resp:
        payload = await resp.json()
    assert resp.status == 503
    assert payload["error"]["code"] == "no_healthy_backend"


@pytest.mark.parametrize("policy", sorted(REASONS))
async def test_each_policy_routes_and_labels_its_reason(policy, fleet, make_router, http):
    router = await make_router(backends_of(fleet), routing={"policy": policy})
    for i in range(6):
        async with http.post(f"{router.url}/v1/chat/completions", json=body(f"q{i % 2}")) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-reason"] in REASONS[policy]
            assert resp.headers["x-kvroute-backend"] in {"e0", "e1", "e2"}
            await resp.read()
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_routing_decisions_total", policy=policy) == 6
    assert total(samples, "kvroute_backend_in_flight") == 0


async def test_session_affinity_follows_the_header_then_the_user_field(fleet, make_router, http):
    router = await make_router(backends_of(fleet), routing={"policy": "session_affinity"})
    url = f"{router.url}/v1/chat/completions"
    for session in ("alpha", "beta", "gamma"):
        seen = set()
        for i in range(4):
            async with http.post(url, json=body(f"turn {i}"), headers={"x-session-id": session}) as resp:
                assert resp.headers["x-kvroute-reason"] == "session"
                seen.add(resp.headers["x-kvroute-backend"])
            async with http.post(url, json=body(f"turn {i}", user=session)) as resp:
                seen.add(resp.headers["x-kvroute-backend"])
        assert len(seen) == 1
    async with http.post(url, json=body("anonymous")) as resp:
        assert resp.headers["x-kvroute-reason"] == "no_session_least_load"


async def test_consistent_hash_sends_a_shared_prompt_head_to_one_backend(fleet, make_router, http):
    router = await make_router(backends_of(fleet), routing={"policy": "consistent_hash"})
    picks = set()
    for i in range(8):
        async with http.post(f"{router.url}/v1/chat/completions", json=body(f"question {i}")) as resp:
            assert resp.headers["x-kvroute-reason"] == "ring_owner"
            picks.add(resp.headers["x-kvroute-backend"])
    assert len(picks) == 1


async def test_pending_prefill_is_held_until_the_first_byte_and_released_on_every_path(make_router, http):
    slow_prefill = FAST.__class__(prefill_base_s=0.3)
    async with SimFleet(1, timing=slow_prefill) as fleet:
        router = await make_router(backends_of(fleet), routing={"policy": "cost"})
        backend = router.app[POOL]["e0"]
        url = f"{router.url}/v1/chat/completions"

        async def pending() -> bool:
            return backend.pending_prefill_tokens > 0 and backend.pending_prefill_requests == 1

        async def released() -> bool:
            return backend.pending_prefill_tokens == 0 and backend.pending_prefill_requests == 0

        # A stream: held while the engine prefills, released at its first byte.
        async with http.post(url, json=body("stream", stream=True, max_tokens=50)) as resp:
            assert backend.pending_prefill_tokens == 0
            await resp.read()
        await wait_for(released, what="pending prefill released at the first byte")
        # A non-streamed response, and a client that leaves before the first byte.
        plain = asyncio.create_task(http.post(url, json=body("plain")))
        await wait_for(pending, what="pending prefill held for the plain request")
        await (await plain).read()
        await wait_for(released, what="pending prefill released after the plain answer")
        abandoned = asyncio.create_task(http.post(url, json=body("gone", stream=True)))
        await wait_for(pending, what="pending prefill held for the abandoned request")
        abandoned.cancel()
        await wait_for(released, what="pending prefill released after the client left", timeout=2.0)


@pytest.mark.parametrize(("policy", "spreads"), [("latency", True), ("cost", False)])
async def test_a_shared_document_spreads_once_its_holders_batch_costs_more(
    policy, spreads, make_router, http
):
    """Issue 20's hot-spot over HTTP: requests behind one long shared document, each still
    decoding when the next comes. ``cost`` keeps them all on the document's holder; the
    default ``latency`` prices the decode batch each one joins and copies the (reused)
    document to other engines."""
    slow_decode = FAST.__class__(decode_step_s=0.02)
    document = "The shared reference document, long enough to matter. " * 150  # ~2,000 tokens
    async with SimFleet(3, timing=slow_decode) as fleet:
        router = await make_router(backends_of(fleet), routing={"policy": policy, "seed": 1})
        url = f"{router.url}/v1/chat/completions"
        streams, picks = [], []
        for i in range(9):
            messages = [{"role": "system", "content": document}, {"role": "user", "content": f"q{i}"}]
            request = {"model": MODEL, "messages": messages, "max_tokens": 60, "stream": True}
            resp = await http.post(url, json=request)  # its head comes with the first byte
            assert resp.status == 200
            picks.append(resp.headers["x-kvroute-backend"])
            streams.append(resp)
        for resp in streams:
            await resp.read()
    assert (len(set(picks)) > 1) is spreads, picks
    if spreads:
        assert max(picks.count(b) for b in set(picks)) <= 6


async def test_a_request_sharing_a_prefix_still_in_prefill_follows_it(make_router, http):
    """The index believes a chain at the pick, not at the engine's first byte: a request that
    shares the prefix and arrives during its prefill goes where that prefix is being built."""
    slow_prefill = FAST.__class__(prefill_base_s=0.5)
    async with SimFleet(3, timing=slow_prefill) as fleet:
        router = await make_router(backends_of(fleet))
        url = f"{router.url}/v1/chat/completions"
        first = asyncio.create_task(http.post(url, json=body("first", stream=True)))
        backend = router.app[POOL]

        async def sent() -> bool:
            return any(b.pending_prefill_requests for b in backend)

        await wait_for(sent, what="the first request picked and sent")
        async with http.post(url, json=body("second")) as resp:
            assert resp.headers["x-kvroute-reason"] == "latency_hit"
            second = resp.headers["x-kvroute-backend"]
        async with await first as resp:
            assert resp.headers["x-kvroute-backend"] == second
            await resp.read()
