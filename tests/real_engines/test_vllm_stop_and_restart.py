"""A real vLLM replica stopped mid-stream and started again, behind a precise-mode router.

vLLM's default ``--shutdown-timeout 0`` aborts what it runs on SIGTERM. The stream the router
was passing through ends promptly and well-formed, not at the 600 s read timeout (straight from
vLLM, such a stream has also hung for over 30 s: the router's health checks end it); requests
sent meanwhile are all served, by the other replica; the health checks eject the stopped one and
re-admit it once it is back, and precise mode resyncs with the new engine (its cache started
empty) and learns what it holds again. The replica is back up when it ends (if it fails first,
the conftest's fixture starts it again).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
from openai import AsyncOpenAI

from loadtest.vllm_replicas import SERVED_MODEL, VllmReplica
from router.http.app import INDEX
from tests.helpers import MakeRouter, scrape, total, wait_for
from tests.real_engines.traffic import Conversation, backend_view, backends, precise_index, subscribed, text

HEALTH = {"interval_s": 0.5, "timeout_s": 1.0, "unhealthy_after": 2}


async def test_a_replica_stopped_mid_stream_then_restarted(
    vllm_pair: list[VllmReplica],
    make_router: MakeRouter,
    openai_client: AsyncOpenAI,
    http: aiohttp.ClientSession,
) -> None:
    router = await make_router(backends(vllm_pair), index=precise_index(), health=HEALTH)
    await subscribed(http, router.url)
    body = {
        "model": SERVED_MODEL,
        "prompt": text(900, 300),
        "max_tokens": 1800,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        victim_name = resp.headers["x-kvroute-backend"]
        victim = next(r for r in vllm_pair if r.name == victim_name)
        survivor = next(r for r in vllm_pair if r is not victim)
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        victim.signal(signal.SIGTERM)
        stopped = time.monotonic()
        # Meanwhile, more requests: every one is served (by the survivor, or retried onto it).
        client = openai_client.with_options(base_url=f"{router.url}/v1")
        answers = await asyncio.gather(
            *(
                client.completions.with_raw_response.create(
                    model=SERVED_MODEL, prompt=text(950 + i, 50), max_tokens=4
                )
                for i in range(6)
            )
        )
        rest = await asyncio.wait_for(resp.content.read(), timeout=30)
    took = time.monotonic() - stopped
    events = [e for e in (first + rest).split(b"\n\n") if e.startswith(b"data: ")]
    print(f"the stream on {victim_name} ended {took:.1f} s after SIGTERM: {events[-1][:200]!r}")
    assert took < 15
    # Every event is whole JSON, of one generation on one engine (no stream spliced from two),
    # and the stream has one of two well-formed ends. vLLM may end it itself, and the router
    # passes that through unchanged: seen here are a chunk with finish_reason "abort", vLLM's own
    # error event, and (once in CI) finish_reason "length" 0.1 s after the signal, most likely a
    # generation that had run to its length while the API server was starved of CPU behind its
    # engine core. Or the connection drops, or the engine hangs until the health checks eject it,
    # and the router ends the stream with its own error event.
    payloads = [json.loads(e[len(b"data: ") :]) for e in events if e != b"data: [DONE]"]
    assert len({p["id"] for p in payloads if "choices" in p}) == 1
    if events[-1] == b"data: [DONE]":
        assert all("choices" in p or "error" in p for p in payloads), payloads[-3:]
    else:
        assert payloads[-1]["error"]["code"] == "upstream_stream_error"
    assert all(a.http_response.status_code == 200 for a in answers)
    victim.process.wait(30)

    async def ejected() -> bool:
        return (await backend_view(http, router.admin_url, victim_name))["state"] == "unhealthy"

    await wait_for(ejected, timeout=10, what=f"{victim_name} out of rotation")
    served = await client.completions.with_raw_response.create(
        model=SERVED_MODEL, prompt="still up?", max_tokens=2
    )
    assert served.headers["x-kvroute-backend"] == survivor.name

    # Back up on the same ports: re-admitted, and its new (empty) cache resynced.
    connects_before = total(
        await scrape(http, router.url), "kvroute_kv_events_resyncs_total", backend=victim_name
    )
    victim.start()
    await asyncio.to_thread(victim.wait_ready)

    async def readmitted() -> bool:
        view = await backend_view(http, router.admin_url, victim_name)
        resyncs = total(
            await scrape(http, router.url), "kvroute_kv_events_resyncs_total", backend=victim_name
        )
        return view["routable"] and view["kv_events"]["state"] == "connected" and resyncs > connects_before

    await wait_for(readmitted, timeout=30, what=f"{victim_name} re-admitted and resynced")
    index = router.app[INDEX]
    assert index.blocks_of(victim_name) == 0
    # Traffic that went around the router to the restarted replica is learned again.
    conversation = Conversation(990)
    await conversation.turn(openai_client.with_options(base_url=f"{victim.url}/v1"))
    await wait_for(lambda: index.blocks_of(victim_name) > 0, what="the restarted engine's events applied")
    routed = await conversation.turn(client)
    assert routed.backend == victim_name and routed.matched == routed.cached > 0
