"""Prefill/decode disaggregation end to end: the official ``openai`` client, a real router, and
simulated prefill and decode engines speaking SGLang's bootstrap and vLLM's kv_transfer_params.

Failure paths use the fault engines (tests/fault_engine.py) on one side of a pair and simulated
engines on the other; every path ends with every ledger of both sides given back.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from loadtest.sim.engine import SimEngine
from loadtest.sim.fleet import SimFleet
from router.http.app import DISPATCHER, INDEX, POOL
from router.http.server import RouterServer
from tests.fault_engine import MODEL
from tests.helpers import FAST, scrape, total, wait_for, wait_released

ENGINES = ("sglang", "vllm")
#: A long shared system prompt: many full blocks, so a second turn finds the first's prefix cached.
SYSTEM = "You are a careful assistant who answers briefly. " * 40


def pd_backends(fleet: SimFleet, engine: str) -> list[dict[str, Any]]:
    """The fleet's engines as prefill (``p0``, ...) and decode (``d0``, ...) backends."""
    out: list[dict[str, Any]] = []
    for e in fleet.engines:
        entry: dict[str, Any] = {"url": e.url, "engine": engine, "role": e.role}
        if e.role == "prefill":
            entry["name"] = f"p{sum(1 for b in out if b['role'] == 'prefill')}"
            if engine == "sglang":
                entry["bootstrap_port"] = e.bootstrap_port
        else:
            entry["name"] = f"d{sum(1 for b in out if b['role'] == 'decode')}"
        out.append(entry)
    return out


@pytest.fixture
async def pd_fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(4, timing=FAST, roles=("prefill", "prefill", "decode", "decode")) as fleet:
        yield fleet


def client(router: RouterServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="test-key", max_retries=0)


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def assert_released(router: RouterServer) -> None:
    """Every ledger of every backend, on both sides, is back to zero."""
    for backend in router.app[POOL]:
        assert (backend.name, backend.in_flight, backend.pending_prefill_tokens) == (backend.name, 0, 0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_pair_serves_one_normal_openai_response(pd_fleet, make_router, http, engine, stream):
    router = await make_router(pd_backends(pd_fleet, engine))
    ai = client(router)
    prefills = [e for e in pd_fleet.engines if e.role == "prefill"]
    decodes = [e for e in pd_fleet.engines if e.role == "decode"]

    for turn, question in enumerate(["What is KV?", "And prefill?"]):
        if stream:
            raw = await ai.chat.completions.with_raw_response.create(
                model="sim-model",
                messages=messages(question),
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in raw.parse()]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            raw = await ai.chat.completions.with_raw_response.create(
                model="sim-model", messages=messages(question), max_tokens=5
            )
            completion = raw.parse()
            text, usage = completion.choices[0].message.content, completion.usage
        assert text == " tok" * 5
        assert usage.completion_tokens == 5
        prefill_name, decode_name = (
            raw.headers["x-kvroute-prefill-backend"],
            raw.headers["x-kvroute-decode-backend"],
        )
        assert prefill_name.startswith("p") and decode_name.startswith("d")
        assert raw.headers["x-kvroute-backend"] == decode_name
        assert raw.headers["x-kvroute-decode-reason"] == "decode_balance"
        prefill = prefills[int(prefill_name[1:])]
        # The client reads the prefill side's cache, not what the decode engine received.
        assert usage.prompt_tokens_details.cached_tokens == prefill.records[-1].cached_tokens
        if turn:
            assert raw.headers["x-kvroute-prefill-reason"].endswith("hit")
            assert usage.prompt_tokens_details.cached_tokens > 0

    # Prefill engines only prefilled (one token each); decode engines received the KV and decoded.
    assert sum(e.scheduler.completed for e in prefills) == 2
    assert all(r.output_tokens == 1 for e in prefills for r in e.records)
    assert sum(e.scheduler.completed for e in decodes) == 2
    assert sum(e.scheduler.transferred_tokens for e in decodes) > 0
    await wait_released(http, router.url)
    assert_released(router)
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_pd_decisions_total", side="decode", policy="decode_balance") == 2
    assert total(samples, "kvroute_requests_total", status="200") == 4  # two per request: one per side


async def test_prefill_follows_the_cache_and_decode_the_load(pd_fleet, make_router, http):
    router = await make_router(pd_backends(pd_fleet, "sglang"))
    ai = client(router)
    prefill_of: dict[int, set[str]] = {}
    decode_count: dict[str, int] = {}
    for i in range(12):
        conversation = i % 3
        raw = await ai.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=[
                {"role": "system", "content": f"Conversation {conversation}. " + SYSTEM},
                {"role": "user", "content": f"question {i}"},
            ],
            max_tokens=2,
        )
        prefill_of.setdefault(conversation, set()).add(raw.headers["x-kvroute-prefill-backend"])
        decode = raw.headers["x-kvroute-decode-backend"]
        decode_count[decode] = decode_count.get(decode, 0) + 1
    # Each conversation keeps its prefill engine (its prefix is cached there) ...
    assert all(len(names) == 1 for names in prefill_of.values())
    # ... while the decode side, all idle between requests, is spread at random, not piled on d0.
    assert set(decode_count) == {"d0", "d1"}
    assert_released(router)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_prefill_engine_down_is_replaced_before_any_byte(pd_fleet, make_router, http, engine):
    router = await make_router(pd_backends(pd_fleet, engine), upstream={"max_attempts": 3})
    ai = client(router)
    first = await ai.chat.completions.with_raw_response.create(
        model="sim-model", messages=messages("warm"), max_tokens=2
    )
    warm = first.headers["x-kvroute-prefill-backend"]
    # The engine holding the prefix dies; the router has not noticed (no health check ran).
    await next(e for e in pd_fleet.engines if e.role == "prefill" and e.name == f"sim{warm[1:]}").stop()

    again = await ai.chat.completions.with_raw_response.create(
        model="sim-model", messages=messages("warm"), max_tokens=3, stream=False
    )
    assert again.parse().choices[0].message.content == " tok" * 3
    assert again.headers["x-kvroute-prefill-backend"] != warm
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_pd_retries_total", side="prefill") == 1
    assert total(samples, "kvroute_upstream_errors_total", backend=warm, kind="connect") == 1
    await wait_released(http, router.url)
    assert_released(router)


async def _mixed_pair(
    engine: str, prefill_roles: list[str], decode: list[Any], make_router: Any, **sections: Any
) -> tuple[RouterServer, list[SimEngine]]:
    """Simulated prefill engines serving the fault engines' model, and the given decode backends."""
    prefills = [
        SimEngine(FAST, models=(MODEL,), name=f"sp{i}", role="prefill") for i in range(len(prefill_roles))
    ]
    for e in prefills:
        await e.start()
    backends: list[dict[str, Any]] = [
        {"name": f"p{i}", "url": e.url, "engine": engine, "role": "prefill", "models": [MODEL]}
        | ({"bootstrap_port": e.bootstrap_port} if engine == "sglang" else {})
        for i, e in enumerate(prefills)
    ]
    backends += [
        {"name": d.name, "url": d.url, "engine": engine, "role": "decode", "models": [MODEL]} for d in decode
    ]
    router = await make_router(backends, **sections)
    return router, prefills


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_failure_before_the_first_byte_retries_the_pair(
    engine, fault_engines, make_router, http
):
    failing, serving = await fault_engines("status", "ok")
    router, prefills = await _mixed_pair(
        engine,
        ["prefill"],
        [failing, serving],
        make_router,
        disaggregation={"decode_routing": {"policy": "round_robin"}},
    )
    try:
        ai = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="k", max_retries=0)
        raw = await ai.completions.with_raw_response.create(model=MODEL, prompt="hello " * 50, max_tokens=3)
        # Round robin starts on f0, which answers 503: the pair is tried again, prefilled again.
        assert raw.headers["x-kvroute-decode-backend"] == "f1"
        assert prefills[0].scheduler.completed == 2
        assert failing.received == 1 and serving.received == 1
        sent = serving.json_bodies[-1]
        if engine == "sglang":
            assert {"bootstrap_host", "bootstrap_port", "bootstrap_room"} <= sent.keys()
            assert sent["bootstrap_port"] == prefills[0].bootstrap_port
            # A retried pair gets a room of its own.
            assert sent["bootstrap_room"] != failing.json_bodies[-1]["bootstrap_room"]
        else:
            params = sent["kv_transfer_params"]
            assert params["do_remote_prefill"] and params["remote_engine_id"] == "sp0"
            assert sent["max_tokens"] == 3
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_pd_retries_total", side="decode") == 1
        assert total(samples, "kvroute_upstream_errors_total", backend="f0", kind="http_503") == 1
        await wait_released(http, router.url)
        assert_released(router)
    finally:
        for e in prefills:
            await e.stop()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_decode_failure_after_the_first_byte_ends_with_an_sse_error(
    engine, fault_engines, make_router, http
):
    (dying,) = await fault_engines("die_mid_stream")
    router, prefills = await _mixed_pair(engine, ["prefill"], [dying], make_router)
    try:
        ai = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="k", max_retries=0)
        stream = await ai.completions.create(model=MODEL, prompt="hello " * 50, max_tokens=3, stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert texts == [" t0", " t1", " t2"]
        assert dying.received == 1
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_requests_total", backend="f0", status="stream_error") == 1
        assert total(samples, "kvroute_pd_retries_total") == 0
        await wait_released(http, router.url)
        assert_released(router)
    finally:
        for e in prefills:
            await e.stop()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_prefill_engines_error_reaches_the_client_as_it_is(engine, fault_engines, make_router, http):
    refusing, decode = await fault_engines("status", "ok")
    refusing.status = 400
    backends = [
        {"name": "p0", "url": refusing.url, "engine": engine, "role": "prefill", "models": [MODEL]},
        {"name": "d0", "url": decode.url, "engine": engine, "role": "decode", "models": [MODEL]},
    ]
    router = await make_router(backends)
    ai = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        await ai.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert "f0 says 400" in str(err.value)
    assert err.value.response.headers["x-kvroute-prefill-backend"] == "p0"
    if engine == "vllm":  # (SGLang sent the decode engine the request at once, then dropped it)
        assert decode.received == 0
    await wait_released(http, router.url)
    assert_released(router)
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_requests_total", backend="p0", status="400") == 1
    assert total(samples, "kvroute_pd_retries_total") == 0


async def test_vllm_prefill_without_a_connector_is_a_failed_prefill(fault_engines, make_router, http):
    plain, decode = await fault_engines("ok", "ok")
    backends = [
        {"name": "p0", "url": plain.url, "role": "prefill", "models": [MODEL]},
        {"name": "d0", "url": decode.url, "role": "decode", "models": [MODEL]},
    ]
    router = await make_router(backends, disaggregation={"vllm_kv_transfer_params": {"connector_hint": "x"}})
    request = {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{router.url}/v1/completions", json=request) as resp:
        body = await resp.json()
    assert resp.status == 502
    assert "no kv_transfer_params" in body["error"]["message"]
    assert decode.received == 0
    # What the prefill engine was sent: one token, no stream, NixlConnector's params and the configured extra.
    (sent,) = plain.json_bodies
    assert (sent["max_tokens"], sent["stream"], "stream_options" in sent) == (1, False, False)
    assert sent["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "connector_hint": "x",
    }
    assert_released(router)


async def test_no_healthy_decode_backend_is_a_clear_503(pd_fleet, make_router, http):
    backends = [b for b in pd_backends(pd_fleet, "vllm") if b["role"] == "prefill"]
    backends.append({"name": "d0", "url": "http://127.0.0.1:9", "role": "decode", "models": ["sim-model"]})
    router = await make_router(backends)
    async with http.post(
        f"{router.url}/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2}
    ) as resp:
        body = await resp.json()
    assert resp.status == 503 and body["error"]["code"] == "no_healthy_backend"
    assert "decode" in body["error"]["message"]


async def test_a_pair_is_of_one_engine_kind(pd_fleet, make_router, http):
    backends = pd_backends(pd_fleet, "sglang")
    for backend in backends:
        if backend["role"] == "decode":
            backend["engine"] = "vllm"
    router = await make_router(backends)
    body = {"model": "sim-model", "prompt": "x", "max_tokens": 2}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        answer = await resp.json()
    assert resp.status == 503 and "No decode backend speaks the handoff" in answer["error"]["message"]
    assert sum(e.scheduler.received for e in pd_fleet.engines) == 0


async def test_a_co_located_fleet_never_takes_the_pair_branch(fleet, make_router, http):
    backends = [{"name": f"e{i}", "url": url} for i, url in enumerate(fleet.urls)]
    router = await make_router(backends)
    async with http.post(
        f"{router.url}/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2}
    ) as resp:
        assert resp.status == 200
        assert "x-kvroute-prefill-backend" not in resp.headers
    assert not router.app[POOL].role_split
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_pd_decisions_total") == 0


@pytest.mark.parametrize("decode_caches", [False, True])
async def test_the_index_learns_the_prefill_side_and_the_decode_side_when_it_caches(
    pd_fleet, make_router, http, decode_caches
):
    router = await make_router(
        pd_backends(pd_fleet, "vllm"),
        index={"closed_loop": True},
        disaggregation={"decode_caches_prefixes": decode_caches},
    )
    ai = client(router)
    reasons = []
    for question in ["one", "two", "three"]:
        raw = await ai.chat.completions.with_raw_response.create(
            model="sim-model", messages=messages(question), max_tokens=2
        )
        reasons.append(raw.headers["x-kvroute-decode-reason"])
    index = router.app[INDEX]
    held = {b.name: index.blocks_of(b.name) for b in router.app[POOL]}
    assert sum(held[name] for name in ("p0", "p1")) > 0
    if decode_caches:
        # The decode engine that received the prefix holds it: the next pair goes back there.
        assert sum(held[name] for name in ("d0", "d1")) > 0
        assert reasons[1:] == ["decode_cached", "decode_cached"]
    else:
        assert held["d0"] == held["d1"] == 0
        assert set(reasons) == {"decode_balance"}
    # Closed loop: the beliefs are checked against the prefill engines' reports, and only theirs.
    samples = await scrape(http, router.url)
    prefilled = sum(e.scheduler.cached_tokens for e in pd_fleet.engines if e.role == "prefill")
    assert prefilled > 0
    assert total(samples, "kvroute_belief_reported_tokens_total") == prefilled
    assert total(samples, "kvroute_belief_reported_tokens_total", backend="d0") == 0
    await wait_released(http, router.url)
    assert_released(router)


async def test_a_reload_switches_the_decode_policy_and_keeps_it_otherwise(pd_fleet, deploy, http):
    admin = {"Authorization": "Bearer admin-0123456789"}
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": pd_backends(pd_fleet, "vllm"),
        "routing": {"seed": 1},
        "admin": {"key": "admin-0123456789"},
    }
    deployment = await deploy(config)
    body = {"model": "sim-model", "prompt": SYSTEM, "max_tokens": 2}

    async def decode_reason() -> str:
        async with http.post(f"{deployment.server.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            return resp.headers["x-kvroute-decode-reason"]

    assert await decode_reason() == "decode_balance"
    kept = deployment.server.app[DISPATCHER].decode_policy
    deployment.write({**config, "log_level": "warning"})
    assert (await deployment.reload(http, admin))[0] == 200
    assert deployment.server.app[DISPATCHER].decode_policy is kept  # unchanged section: same policy
    deployment.write({**config, "disaggregation": {"decode_routing": {"policy": "round_robin"}}})
    status, payload = await deployment.reload(http, admin)
    assert status == 200 and "disaggregation" in payload["changed"]
    assert await decode_reason() == "round_robin"


async def test_precise_mode_learns_the_prefill_engines_from_their_kv_events(make_router, http):
    roles = ("prefill", "prefill", "decode", "decode")
    async with SimFleet(4, timing=FAST, kv_events="vllm", roles=roles) as fleet:
        router = await make_router(
            pd_backends(fleet, "vllm"), index={"mode": "events", "tokenizer": {"kind": "chunk"}}
        )

        async def subscribed() -> bool:
            samples = await scrape(http, router.url)
            return total(samples, "kvroute_kv_events_resyncs_total", reason="connect") == 4

        await wait_for(subscribed, what="every engine subscribed")
        # p1 prefills this prompt for somebody else (another router): this router never saw it.
        body = {"model": "sim-model", "messages": messages("behind your back"), "max_tokens": 1}
        prefill = {**body, "kv_transfer_params": {"do_remote_decode": True}}
        async with http.post(f"{fleet.engines[1].url}/v1/chat/completions", json=prefill) as resp:
            assert resp.status == 200
        index = router.app[INDEX]

        async def reported() -> bool:
            return index.engine_hashes("p1") == fleet.engines[1].cache.keys() != set()

        await wait_for(reported, what="p1's index equal to its engine's cache")
        async with http.post(f"{router.url}/v1/chat/completions", json={**body, "max_tokens": 2}) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-prefill-backend"] == "p1"
            assert resp.headers["x-kvroute-prefill-reason"] == "latency_hit"
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_learning_routing_policy_hears_the_prefill_side_it_chose(pd_fleet, make_router):
    router = await make_router(
        pd_backends(pd_fleet, "sglang"),
        routing={"policy": "tests.test_policy_outcomes:Recorder"},
        index={"closed_loop": True},
    )
    ai = client(router)
    await ai.chat.completions.create(model="sim-model", messages=messages("learn"), max_tokens=2)
    await ai.chat.completions.create(model="sim-model", messages=messages("learn"), max_tokens=2)
    outcomes = router.app[DISPATCHER].policy.outcomes
    assert [(o.backend, o.status, o.error) for o in outcomes] == [("p0", 200, None), ("p0", 200, None)]
    # The prefill side's report, not the decode engine's: the second prompt was cached on p0.
    assert outcomes[0].cached_tokens == pd_fleet.engines[0].records[0].cached_tokens
    assert outcomes[1].cached_tokens == pd_fleet.engines[0].records[1].cached_tokens > 0


async def test_the_access_log_names_both_engines_of_the_pair(pd_fleet, make_router, caplog):
    router = await make_router(pd_backends(pd_fleet, "sglang"), logging={"access_log": True})
    with caplog.at_level(logging.INFO, logger="kvroute.access"):
        raw = await client(router).chat.completions.with_raw_response.create(
            model="sim-model", messages=messages("log me"), max_tokens=2
        )
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvroute.access"]
    prefill, decode = raw.headers["x-kvroute-prefill-backend"], raw.headers["x-kvroute-decode-backend"]
    assert f"backend={decode} " in line
    assert f"prefill_backend={prefill} prefill_reason={raw.headers['x-kvroute-prefill-reason']} " in line
    assert line.endswith(f"decode_backend={decode} decode_reason=decode_balance")
    assert "cached_tokens=0 " in line  # the prefill side's report (a first prompt: nothing cached)
