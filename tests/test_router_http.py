"""The router end to end over real HTTP: simulated engines, the router, the official client."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import openai
import pytest

from loadtest.sim.fleet import SimFleet
from tests.helpers import FAST, backends_of, scrape, total, wait_for, wait_released

MODEL = "sim-model"
SYSTEM = "You are a careful assistant. " * 40  # ~1.1k characters: several 256-character blocks


def client(router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="test-key", max_retries=0)


def chat(user: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def test_chat_non_streaming_through_openai_client(fleet, make_router):
    router = await make_router(backends_of(fleet))
    raw = await client(router).chat.completions.with_raw_response.create(
        model=MODEL, messages=chat("hello"), max_tokens=5
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == " tok" * 5
    assert completion.usage.prompt_tokens > 0
    assert raw.headers["x-kvroute-backend"] in {"e0", "e1", "e2"}
    assert raw.headers["x-kvroute-reason"] == "latency_no_match"


async def test_chat_streaming_with_usage(fleet, make_router):
    router = await make_router(backends_of(fleet))
    stream = await client(router).chat.completions.create(
        model=MODEL,
        messages=chat("stream please"),
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    async for chunk in stream:
        pieces.extend(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(pieces) == " tok" * 7
    assert usage is not None and usage.completion_tokens == 7


async def test_completions_streaming_and_not(fleet, make_router):
    router = await make_router(backends_of(fleet))
    api = client(router)
    completion = await api.completions.create(model=MODEL, prompt="Once upon a time " * 30, max_tokens=4)
    assert completion.choices[0].text == " tok" * 4
    stream = await api.completions.create(
        model=MODEL, prompt="Once upon a time " * 30, max_tokens=4, stream=True
    )
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(texts) == " tok" * 4


async def test_stream_is_passed_through_as_it_arrives(make_router, http):
    """The first chunk reaches the client long before the engine finishes decoding."""
    slow_decode = FAST.__class__(decode_step_s=0.02, prefill_per_token_s=0.0)
    async with SimFleet(1, timing=slow_decode) as fleet:
        router = await make_router(backends_of(fleet))
        body = {"model": MODEL, "messages": chat("x"), "max_tokens": 25, "stream": True}
        started = time.perf_counter()
        async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
            first = await resp.content.readany()
            first_at = time.perf_counter() - started
            await resp.read()
            done_at = time.perf_counter() - started
    assert first.startswith(b"data: ")
    # 25 decode steps of 20 ms: buffering would deliver the first byte at the end (~0.5 s).
    assert first_at < done_at / 3


async def test_repeated_prefixes_stick_while_load_spreads(fleet, make_router):
    router = await make_router(backends_of(fleet))
    api = client(router)
    systems = [f"System prompt number {i}. " + "Background facts. " * 60 for i in range(9)]
    first_pick = {}
    for i, system in enumerate(systems):
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat("first turn", system), max_tokens=1
        )
        first_pick[i] = raw.headers["x-kvroute-backend"]
    # New prefixes spread: each backend got some of the nine.
    assert set(first_pick.values()) == {"e0", "e1", "e2"}
    for i, system in enumerate(systems):
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat("second turn", system), max_tokens=1
        )
        assert raw.headers["x-kvroute-backend"] == first_pick[i]
        assert raw.headers["x-kvroute-reason"] == "latency_hit"
        assert raw.parse().usage.prompt_tokens_details.cached_tokens > 0


async def test_one_hot_prefix_does_not_pile_onto_one_replica(fleet, make_router, http):
    """Concurrent requests sharing one prefix spread once a replica is loaded (the hot-spot guard)."""
    routing = {"policy": "prefix_aware", "params": {"balance_abs_threshold": 2}}
    router = await make_router(backends_of(fleet), routing=routing)
    api = client(router)
    await api.chat.completions.create(model=MODEL, messages=chat("warm up"), max_tokens=1)

    async def one(i: int) -> str:
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat(f"question {i}"), max_tokens=30
        )
        return raw.headers["x-kvroute-backend"]

    picks = Counter(await asyncio.gather(*(one(i) for i in range(24))))
    assert len(picks) == 3, picks
    assert max(picks.values()) <= 16, picks
    await wait_released(http, router.url)


async def test_requests_route_by_model(make_router, http):
    async with (
        SimFleet(2, timing=FAST, models=("model-a",)) as fleet_a,
        SimFleet(1, timing=FAST, models=("model-b",)) as fleet_b,
    ):
        # No models in config: each backend's are read from its /v1/models.
        router = await make_router(backends_of(fleet_a, "a") + backends_of(fleet_b, "b"))
        api = client(router)
        listed = sorted(m.id for m in (await api.models.list()).data)
        assert listed == ["model-a", "model-b"]
        for _ in range(4):
            raw = await api.chat.completions.with_raw_response.create(
                model="model-b", messages=chat("hi"), max_tokens=1
            )
            assert raw.headers["x-kvroute-backend"] == "b0"
            raw = await api.chat.completions.with_raw_response.create(
                model="model-a", messages=chat("hi"), max_tokens=1
            )
            assert raw.headers["x-kvroute-backend"] in {"a0", "a1"}
        with pytest.raises(openai.NotFoundError) as err:
            await api.chat.completions.create(model="nope", messages=chat("hi"))
        assert err.value.body["code"] == "model_not_found"
        assert err.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, "invalid_json"),
        (b'{"model": "sim-model"}', 400, "messages", "missing_required"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model", "missing_required"),
        (b'{"model": "sim-model", "messages": "hello"}', 400, "messages", "missing_required"),
        (
            b'{"model": "sim-model", "messages": [{"role": "user", "content": 5}]}',
            400,
            "messages[0].content",
            "invalid_type",
        ),
        (
            b'{"model": "sim-model", "stream": "yes", "messages": [{"role": "user", "content": "x"}]}',
            400,
            "stream",
            "invalid_type",
        ),
        (
            b'{"model": "sim-model", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}',
            400,
            "max_tokens",
            "invalid_type",
        ),
        (
            b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "model",
            "model_not_found",
        ),
        (
            b'{"model": "sim-model", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}',
            413,
            None,
            "body_too_large",
        ),
    ],
)
async def test_bad_requests_get_openai_error_shape(fleet, make_router, http, body, status, param, code):
    router = await make_router(backends_of(fleet), limits={"max_body_bytes": 4096})
    async with http.post(
        f"{router.url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        payload = await resp.json()
    assert resp.status == status
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["param"] == param
    assert payload["error"]["code"] == code
    assert payload["error"]["message"]


async def test_body_over_limit_without_content_length(fleet, make_router, http):
    """A chunked body over the limit is refused too, not only one with a Content-Length."""
    router = await make_router(backends_of(fleet), limits={"max_body_bytes": 4096})

    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    async with http.post(
        f"{router.url}/v1/chat/completions", data=chunks(), headers={"Content-Type": "application/json"}
    ) as resp:
        payload = await resp.json()
    assert resp.status == 413
    assert payload["error"]["code"] == "body_too_large"


async def test_wrong_content_type_and_unknown_route(fleet, make_router, http):
    router = await make_router(backends_of(fleet))
    async with http.post(
        f"{router.url}/v1/chat/completions",
        data=b"model=x",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    ) as resp:
        assert resp.status == 415
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    async with http.get(f"{router.url}/v1/nothing-here") as resp:
        assert resp.status == 404
        assert "error" in await resp.json()


async def test_no_healthy_backend_is_503_with_retry_after(make_router, http):
    async with SimFleet(1, timing=FAST) as fleet:
        url = fleet.urls[0]
    # The engine is gone before the router starts: its first health check fails.
    router = await make_router([{"name": "gone", "url": url, "models": [MODEL]}])
    async with http.get(f"{router.url}/ready") as resp:
        assert resp.status == 503
    async with http.get(f"{router.url}/health") as resp:
        assert resp.status == 200
    async with http.post(
        f"{router.url}/v1/chat/completions", json={"model": MODEL, "messages": chat("x")}
    ) as resp:
        payload = await resp.json()
    assert resp.status == 503
    assert int(resp.headers["Retry-After"]) >= 1
    assert payload["error"]["code"] == "no_healthy_backend"


async def test_backend_dying_before_response_is_retried_elsewhere(make_router, http):
    async with SimFleet(1, timing=FAST) as alive, SimFleet(1, timing=FAST) as doomed:
        router = await make_router(
            [{"name": "alive", "url": alive.urls[0]}, {"name": "doomed", "url": doomed.urls[0]}],
            routing={"policy": "round_robin"},
        )
        await doomed.stop()
        for i in range(4):
            async with http.post(
                f"{router.url}/v1/chat/completions", json={"model": MODEL, "messages": chat(f"x{i}")}
            ) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-backend"] == "alive"
                await resp.read()
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_retries_total") >= 1
        assert total(samples, "kvroute_upstream_errors_total", backend="doomed", kind="connect") >= 1
        assert total(samples, "kvroute_backend_in_flight") == 0


async def test_client_disconnect_mid_stream_cancels_upstream_and_releases_counters(make_router, http):
    slow = FAST.__class__(decode_step_s=0.02)
    async with SimFleet(1, timing=slow) as fleet:
        router = await make_router(backends_of(fleet))
        engine = fleet.engines[0]
        body = {"model": MODEL, "messages": chat("long answer"), "max_tokens": 500, "stream": True}
        async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
            assert (await resp.content.readany()).startswith(b"data: ")
            resp.close()  # the client goes away mid-stream

        async def cancelled() -> bool:
            return engine.stats()["cancelled"] == 1 and engine.stats()["running"] == 0

        await wait_for(cancelled, what="the engine to cancel the request", timeout=2.0)
        await wait_released(http, router.url)


async def test_client_disconnect_before_first_byte_cancels_upstream(make_router, http):
    slow_prefill = FAST.__class__(prefill_base_s=1.0)
    async with SimFleet(1, timing=slow_prefill) as fleet:
        router = await make_router(backends_of(fleet))
        engine = fleet.engines[0]
        body = {"model": MODEL, "messages": chat("x"), "max_tokens": 5, "stream": True}
        request = asyncio.create_task(http.post(f"{router.url}/v1/chat/completions", json=body))

        async def arrived() -> bool:
            return engine.stats()["received"] == 1

        await wait_for(arrived, what="the request at the engine")
        request.cancel()

        async def cancelled() -> bool:
            return engine.stats()["cancelled"] == 1

        await wait_for(cancelled, what="the engine to cancel the request", timeout=2.0)
        await wait_released(http, router.url)


async def test_metrics_count_requests_and_decisions(fleet, make_router, http):
    router = await make_router(backends_of(fleet))
    api = client(router)
    for _ in range(3):
        await api.chat.completions.create(model=MODEL, messages=chat("same"), max_tokens=1)
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_requests_total", endpoint="chat", model=MODEL, status="200") == 3
    assert total(samples, "kvroute_routing_decisions_total", policy="latency", reason="latency_hit") == 2
    assert total(samples, "kvroute_matched_tokens_total", model=MODEL) > 0
    assert total(samples, "kvroute_backend_healthy") == 3
    assert total(samples, "kvroute_index_blocks") > 0
