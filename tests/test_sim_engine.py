"""The simulated engine fleet (loadtest/sim), through real HTTP on 127.0.0.1.

Timing assertions use the engine's own records of what it charged (deterministic), not wall
clocks; waits poll the engine's state with a deadline instead of sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from loadtest.sim import EngineTiming, PrefixCache, SimEngine, SimFleet, render_chat, serve_fleet
from tests.helpers import wait_for

MODEL = "sim-model"
#: Fast but not instant: prefill still costs 20 us per uncached token, so cache hits show.
FAST = EngineTiming(prefill_base_s=0.001, decode_step_s=0.001, decode_per_seq_s=0.0)

EngineFactory = Callable[..., Awaitable[SimEngine]]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    """Start engines with ``FAST`` timing, overridden by keyword; all are stopped at the end."""
    engines: list[SimEngine] = []

    async def make(**timing: Any) -> SimEngine:
        engine = SimEngine(replace(FAST, **timing), models=(MODEL, "other-model"))
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
        return response.status, orjson.loads(await response.read())


async def read_sse(response: aiohttp.ClientResponse) -> list[Any]:
    """The stream's events: decoded JSON chunks, then the string ``"[DONE]"``."""
    events: list[Any] = []
    async for line in response.content:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


async def raw_post(
    url: str, path: str, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a request over a bare socket, so a test can drop the connection whenever it likes."""
    target = URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    data = orjson.dumps(body)
    head = f"POST {path} HTTP/1.1\r\nHost: {target.host}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


async def hang_up(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def complete(prompt: object, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **fields}


def tokens_of(text: str) -> int:
    return -(-len(text) // FAST.chars_per_token)


# --- protocol --------------------------------------------------------------------------------------


def test_render_chat_uses_the_chatml_template_and_joins_text_parts() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        {"role": "assistant", "content": None},
    ]
    assert render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


async def test_chat_completion_non_stream(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    engine = await make_engine()
    body = chat("What is a KV cache?", max_tokens=5)
    status, data = await post(session, f"{engine.url}/v1/chat/completions", body)
    assert status == 200
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert data["model"] == MODEL
    [choice] = data["choices"]
    assert choice["message"] == {"role": "assistant", "content": " tok" * 5, "tool_calls": []}
    assert choice["finish_reason"] == "length"
    prompt_tokens = tokens_of(render_chat(body["messages"]))
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert not engine.records[-1].stream  # a router's warm-up looks like this, unlike a client's stream


async def test_completion_non_stream_uses_default_max_tokens(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine(default_max_tokens=3)
    status, data = await post(session, f"{engine.url}/v1/completions", complete(["x" * 10]))
    assert status == 200
    assert data["object"] == "text_completion"
    assert data["id"].startswith("cmpl-")
    [choice] = data["choices"]
    assert choice["text"] == " tok" * 3
    assert choice["finish_reason"] == "length"
    assert data["usage"]["prompt_tokens"] == 3  # 10 characters: two full tokens and a partial one
    assert data["usage"]["completion_tokens"] == 3
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_chat_stream_sends_one_chunk_per_token_then_usage_and_done(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine()
    body = chat("Stream me.", max_completion_tokens=4, max_tokens=99, stream=True)
    body["stream_options"] = {"include_usage": True}
    async with session.post(f"{engine.url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["Transfer-Encoding"] == "chunked"
        events = await read_sse(response)
    role, *tokens, usage_chunk, done = events
    assert done == "[DONE]"
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    assert len({e["id"] for e in events[:-1]}) == 1
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # max_completion_tokens wins over max_tokens
    assert [t["choices"][0]["delta"] for t in tokens] == [{"content": " tok"}] * 4
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, None, "length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["prompt_tokens"] == tokens_of(render_chat(body["messages"]))
    assert engine.records[-1].stream


async def test_completion_stream_without_usage(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine()
    body = complete("Once upon a time", max_tokens=3, stream=True)
    async with session.post(f"{engine.url}/v1/completions", json=body) as response:
        assert response.status == 200
        events = await read_sse(response)
    *tokens, done = events
    assert done == "[DONE]"
    assert [t["object"] for t in tokens] == ["text_completion"] * 3
    assert [t["choices"][0]["text"] for t in tokens] == [" tok"] * 3
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in t for t in tokens)


async def test_stats_sum_the_streamed_requests_ttft_and_leave_warmups_out(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    """``streamed_ttft_us`` is the engines' side of the clients' TTFT (``kvroute bench routing``
    splits the clients' TTFT with it): streamed requests only, as a router's warm-ups are not."""
    engine = await make_engine()
    url = f"{engine.url}/v1/completions"
    assert (await post(session, url, complete("a warm-up " * 50, max_tokens=1)))[0] == 200
    for prompt in ("first " * 400, "second " * 10):
        async with session.post(url, json=complete(prompt, max_tokens=2, stream=True)) as response:
            assert (await read_sse(response))[-1] == "[DONE]"
    stats = engine.stats()
    streamed = [r.ttft_s for r in engine.records if r.stream]
    assert stats["streamed_first_tokens"] == len(streamed) == 2
    assert stats["streamed_ttft_us"] == pytest.approx(sum(streamed) * 1e6, abs=2)


# --- prefix cache ------------------------------------------------------------------------------------


async def test_repeated_prompt_hits_the_cache_and_prefills_faster(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine()
    prompt = "".join(f"{i:05d} " for i in range(3334))[:20_000]  # 5000 tokens, 312 full blocks
    url = f"{engine.url}/v1/completions"
    results = [await post(session, url, complete(prompt, max_tokens=2)) for _ in range(2)]
    first, second = (data["usage"]["prompt_tokens_details"]["cached_tokens"] for _, data in results)
    assert first == 0
    # Everything but the last token is reusable; only full 16-token blocks count.
    assert second == (5000 - 1) // 16 * 16 == 4992

    cold, warm = engine.records
    assert cold.prefill_s == pytest.approx(FAST.prefill_seconds(5000))  # ~0.1 s
    assert warm.prefill_s == pytest.approx(FAST.prefill_seconds(8))
    assert warm.prefill_s < cold.prefill_s / 10
    assert cold.ttft_s >= cold.prefill_s - 0.002  # the charged time was really waited
    stats = engine.stats()
    assert stats["prefix_cache_queries_tokens"] == 10_000
    assert stats["prefix_cache_hits_tokens"] == stats["cached_tokens"] == 4992

    # The model name seeds the hash chain: another model does not share the entries.
    _, data = await post(session, url, {"model": "other-model", "prompt": prompt, "max_tokens": 1})
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _cache() -> PrefixCache:
    return PrefixCache(capacity_blocks=8, block_tokens=4, chars_per_token=1)


def _chain(cache: PrefixCache, letter: str, blocks: int) -> list[int]:
    return cache.hashes(letter * (4 * blocks), MODEL)


def _cached(cache: PrefixCache, chain: list[int]) -> int:
    return cache.lookup(chain, prompt_tokens=4 * len(chain) + 1)


def test_lru_evicts_the_least_recently_used_chain() -> None:
    cache = _cache()
    a, b, c = (_chain(cache, letter, 4) for letter in "abc")
    cache.insert(a)
    cache.insert(b)
    cache.insert(a)  # touch: now b is the least recently used
    cache.insert(c)
    assert (_cached(cache, a), _cached(cache, b), _cached(cache, c)) == (4, 0, 4)
    assert len(cache) == 8
    assert cache.evictions == 4


def test_a_chain_is_evicted_from_its_tail() -> None:
    cache = _cache()
    a, b = _chain(cache, "a", 6), _chain(cache, "b", 4)
    cache.insert(a)
    cache.insert(b)  # two blocks must go: a's last two, so a's first four still match
    assert _cached(cache, a) == 4
    assert _cached(cache, b) == 4


def test_lookup_matches_consecutive_blocks_and_never_the_last_token() -> None:
    cache = _cache()
    chain = _chain(cache, "a", 3)
    cache.insert(chain)
    assert cache.lookup(chain, prompt_tokens=12) == 2  # a fully cached prompt recomputes its last block
    assert cache.lookup(chain, prompt_tokens=13) == 3
    diverging = cache.hashes("a" * 4 + "x" * 8, MODEL)
    assert diverging[0] == chain[0] and cache.lookup(diverging, prompt_tokens=13) == 1
    assert (cache.queries_tokens, cache.hits_tokens) == (38, 24)


async def test_filling_the_cache_over_http_evicts_the_oldest_prompt(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine(kv_blocks=64)  # 1024 tokens
    url = f"{engine.url}/v1/completions"
    prompts = [letter * 1600 for letter in "abc"]  # 400 tokens, 25 full blocks each
    for prompt in prompts:
        await post(session, url, complete(prompt, max_tokens=1))
    assert engine.stats()["cache_blocks"] == 64
    assert engine.stats()["cache_evictions"] == 11  # 75 blocks into 64: the tail of "a"
    _, data = await post(session, url, complete(prompts[0], max_tokens=1))
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == (25 - 11) * 16


# --- metrics, models, health ---------------------------------------------------------------------------


async def test_metrics_use_vllm_names_and_labels(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine()
    await post(session, f"{engine.url}/v1/chat/completions", chat("hi " * 100, max_tokens=2))
    async with session.get(f"{engine.url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await response.text()
    samples = {
        sample.name: sample for family in text_string_to_metric_families(text) for sample in family.samples
    }
    core = {
        "vllm:num_requests_running": 0,
        "vllm:num_requests_waiting": 0,
        "vllm:kv_cache_usage_perc": 0,
        "vllm:prefix_cache_queries_total": engine.cache.queries_tokens,
        "vllm:prefix_cache_hits_total": engine.cache.hits_tokens,
        "vllm:prompt_tokens_total": engine.stats()["prompt_tokens"],
        "vllm:generation_tokens_total": 2,
        "vllm:request_success_total": 1,
        "vllm:time_to_first_token_seconds_count": 1,
    }
    for name, value in core.items():
        assert samples[name].value == value, name
        assert samples[name].labels["model_name"] == MODEL
        assert samples[name].labels["engine"] == "0"
    assert samples["vllm:request_success_total"].labels["finished_reason"] == "length"
    assert "vllm:time_to_first_token_seconds_bucket" in samples
    info = samples["vllm:cache_config_info"]
    assert info.value == 1
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == str(FAST.kv_blocks)


async def test_models_and_health(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    engine = await make_engine()
    async with session.get(f"{engine.url}/health") as response:
        assert response.status == 200
    async with session.get(f"{engine.url}/v1/models") as response:
        data = await response.json()
    assert data["object"] == "list"
    assert [card["id"] for card in data["data"]] == [MODEL, "other-model"]
    assert {card["object"] for card in data["data"]} == {"model"}
    assert data["data"][0]["max_model_len"] == FAST.max_model_len


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", chat("hi") | {"model": "no-such-model"}, 404, "model"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
        ("/v1/chat/completions", chat("hi", max_tokens="5"), 400, "max_tokens"),
        ("/v1/chat/completions", chat("hi", max_tokens=0), 400, "max_tokens"),
        ("/v1/chat/completions", chat("hi", stream="yes"), 400, "stream"),
        ("/v1/chat/completions", chat("hi", stream_options={"include_usage": True}), 400, "stream_options"),
        ("/v1/completions", complete(""), 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]}, 400, "prompt"),
        ("/v1/completions", complete("x" * (4 * FAST.max_model_len)), 400, None),
    ],
)
async def test_bad_requests_get_openai_errors(
    make_engine: EngineFactory,
    session: aiohttp.ClientSession,
    path: str,
    body: Any,
    status: int,
    param: str | None,
) -> None:
    engine = await make_engine()
    got_status, data = await post(session, f"{engine.url}{path}", body)
    assert got_status == status
    error = data["error"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert error["code"] == status
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    assert engine.stats()["rejected"] == 1
    assert engine.stats()["received"] == 0


# --- scheduling and disconnects ----------------------------------------------------------------------


async def test_fifo_admission_respects_max_running(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine(max_running=2, decode_step_s=0.01)
    url = f"{engine.url}/v1/completions"
    tasks = []
    for i in range(5):  # submitted one after another, so the arrival order is known
        body = complete(f"request {i}", max_tokens=20)
        tasks.append(asyncio.create_task(post(session, url, body)))
        await wait_for(
            lambda n=i + 1: engine.scheduler.received == n, what=f"request {i} received", timeout=3.0
        )
    stats = engine.stats()
    assert (stats["running"], stats["waiting"]) == (2, 3)
    async with session.get(f"{engine.url}/metrics") as response:
        assert 'vllm:num_requests_waiting{engine="0",model_name="sim-model"} 3.0' in await response.text()
    results = await asyncio.gather(*tasks)
    assert [status for status, _ in results] == [200] * 5
    ids = [data["id"] for _, data in results]
    assert [record.id for record in engine.records] == ids  # finished in arrival order
    queue = [record.queue_s for record in engine.records]
    assert queue[2] > 0.1 and queue[4] > queue[2]  # each waited for a slot (~0.2 s per request)
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["completed"], stats["received"]) == (0, 0, 5, 5)


async def test_kv_reservation_gates_admission(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine(kv_blocks=64, decode_step_s=0.01)
    url = f"{engine.url}/v1/completions"
    body = complete("z" * 2400, max_tokens=40)  # 600 + 40 tokens = 40 blocks
    first = asyncio.create_task(post(session, url, body))
    await wait_for(lambda: engine.scheduler.running == 1, what="one request running", timeout=3.0)
    second = asyncio.create_task(post(session, url, body))
    await wait_for(lambda: engine.scheduler.waiting == 1, what="one request waiting", timeout=3.0)
    assert engine.scheduler.running == 1  # a running slot is free, but the KV cache is not
    async with session.get(f"{engine.url}/metrics") as response:
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.625' in await response.text()
    assert [status for status, _ in await asyncio.gather(first, second)] == [200, 200]
    assert engine.stats()["kv_blocks_reserved"] == 0


async def test_disconnect_mid_stream_cancels_the_request(make_engine: EngineFactory) -> None:
    engine = await make_engine(decode_step_s=0.02)
    body = chat("hi", max_tokens=1000, stream=True)
    reader, writer = await raw_post(engine.url, "/v1/chat/completions", body)
    await asyncio.wait_for(reader.readuntil(b"data: "), 2)  # the stream has started (20 s to go)
    assert engine.stats()["running"] == 1
    await hang_up(writer)
    await wait_for(lambda: engine.stats()["cancelled"] == 1, what="one request cancelled", timeout=1.0)
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["kv_blocks_reserved"] == stats["completed"] == 0


async def test_disconnect_while_waiting_leaves_the_queue(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine(max_running=1, decode_step_s=0.02)
    _, busy = await raw_post(engine.url, "/v1/chat/completions", chat("hold the slot", max_tokens=1000))
    await wait_for(lambda: engine.scheduler.running == 1, what="one request running", timeout=3.0)
    _, queued = await raw_post(engine.url, "/v1/chat/completions", chat("wait", max_tokens=1, stream=True))
    await wait_for(lambda: engine.scheduler.waiting == 1, what="one request waiting", timeout=3.0)
    await hang_up(queued)  # nothing was generated for it yet
    await wait_for(lambda: engine.stats()["cancelled"] == 1, what="one request cancelled", timeout=1.0)
    assert (engine.scheduler.waiting, engine.scheduler.running) == (0, 1)
    await hang_up(busy)  # a non-streamed request waiting for its answer
    await wait_for(lambda: engine.stats()["cancelled"] == 2, what="two requests cancelled", timeout=1.0)
    assert (engine.scheduler.running, engine.scheduler.reserved_blocks) == (0, 0)
    status, _ = await post(session, f"{engine.url}/v1/chat/completions", chat("no leaked slot", max_tokens=1))
    assert status == 200


async def test_disconnect_during_prefill_frees_the_prefill_lane(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    engine = await make_engine(prefill_per_token_s=0.002)  # 1000 tokens: a 2 s prefill
    _, writer = await raw_post(engine.url, "/v1/completions", complete("p" * 4000))
    await wait_for(lambda: engine.scheduler.running == 1, what="one request running", timeout=3.0)
    await hang_up(writer)
    await wait_for(lambda: engine.stats()["cancelled"] == 1, what="one request cancelled", timeout=1.0)
    status, _ = await post(session, f"{engine.url}/v1/completions", complete("q", max_tokens=1))
    assert status == 200
    [record] = engine.records
    assert record.queue_s < 0.5  # it did not wait for the abandoned prefill
    assert engine.stats()["prompt_tokens"] == 1  # the abandoned prompt was never counted as processed


async def test_stop_drops_in_flight_requests_at_once(make_engine: EngineFactory) -> None:
    engine = await make_engine(decode_step_s=0.02)
    reader, _ = await raw_post(engine.url, "/v1/chat/completions", chat("hi", max_tokens=1000, stream=True))
    await asyncio.wait_for(reader.readuntil(b"data: "), 2)
    started = time.monotonic()
    await engine.stop()
    assert time.monotonic() - started < 0.5  # like a killed engine: no draining
    rest = await asyncio.wait_for(reader.read(), 1)  # the connection closes mid-stream
    assert b"[DONE]" not in rest
    stats = engine.stats()
    assert (stats["cancelled"], stats["running"], stats["received"]) == (1, 0, 1)


# --- fleet ---------------------------------------------------------------------------------------------


async def test_fleet_runs_engines_on_their_own_ports(session: aiohttp.ClientSession) -> None:
    async with SimFleet(3, timing=FAST) as fleet:
        assert len(set(fleet.urls)) == 3
        assert [engine.name for engine in fleet.engines] == ["sim0", "sim1", "sim2"]
        for url in fleet.urls:
            status, _ = await post(session, f"{url}/v1/completions", complete("hi", max_tokens=1))
            assert status == 200
        stats = fleet.stats()
        assert [s["completed"] for s in stats["engines"]] == [1, 1, 1]
        assert stats["totals"]["completed"] == 3
        urls = fleet.urls
    with pytest.raises(aiohttp.ClientConnectionError):
        await session.get(f"{urls[0]}/health")


async def test_serve_fleet_prints_urls_and_stops_when_cancelled(capsys: pytest.CaptureFixture[str]) -> None:
    task = asyncio.create_task(serve_fleet(2, "127.0.0.1", 0, FAST))
    await wait_for(
        lambda: capsys.readouterr().out.count("http://127.0.0.1:") == 2 or task.done(),
        what="both engine URLs printed (or the fleet task ended)",
        timeout=3.0,
    )
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
