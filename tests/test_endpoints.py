"""Every forwarded endpoint end to end: the official ``openai`` client (or raw HTTP where it has no
method), the router, and simulated engines serving vLLM's shapes (docs/endpoints.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from loadtest.sim.engine import SimEngine
from loadtest.sim.fleet import SimFleet
from loadtest.sim.serving import EMBEDDING_DIM, embedding
from tests.helpers import FAST, backends_of, scrape, total, wait_for, wait_released

MODEL = "sim-model"
#: Long enough for several of the router's 256-character blocks and the engines' 64-character ones.
DOCUMENT = "The quick brown fox jumps over the lazy dog near the riverbank. " * 30


def client(router, key: str = "test-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0)


async def post_json(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, Any]:
    async with http.post(url, json=body) as resp:
        data = await resp.read()
        return (
            resp.status,
            dict(resp.headers),
            orjson.loads(data) if resp.content_type == "application/json" else data,
        )


async def test_embeddings_route_by_prefix_and_hit_the_engines_cache(fleet, make_router):
    router = await make_router(backends_of(fleet))
    api = client(router)
    first = await api.embeddings.with_raw_response.create(model=MODEL, input=DOCUMENT + "first question")
    second = await api.embeddings.with_raw_response.create(model=MODEL, input=DOCUMENT + "second question")
    assert first.headers["x-kvroute-reason"] == "latency_no_match"
    assert second.headers["x-kvroute-reason"] == "latency_hit"
    assert second.headers["x-kvroute-backend"] == first.headers["x-kvroute-backend"]
    assert int(second.headers["x-kvroute-matched-tokens"]) > 0
    result = second.parse()
    # The client asked for base64 (its default) and decoded it back to the engine's vector.
    assert result.data[0].embedding == pytest.approx(embedding(DOCUMENT + "second question"), rel=1e-6)
    assert len(result.data[0].embedding) == EMBEDDING_DIM
    assert result.usage.prompt_tokens_details["cached_tokens"] > 0


async def test_embeddings_count_in_the_endpoint_metrics(fleet, make_router, http):
    router = await make_router(backends_of(fleet))
    batch = await client(router).embeddings.create(model=MODEL, input=["one", "two", "three"])
    assert [d.index for d in batch.data] == [0, 1, 2]
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_requests_total", endpoint="embeddings", status="200") == 1
    assert total(samples, "kvroute_request_duration_seconds_count", endpoint="embeddings") == 1


async def test_responses_non_streamed_and_streamed(fleet, make_router, http):
    router = await make_router(backends_of(fleet))
    api = client(router)
    raw = await api.responses.with_raw_response.create(
        model=MODEL, instructions=DOCUMENT, input="What does the fox do?", max_output_tokens=5
    )
    response = raw.parse()
    assert response.output_text == " tok" * 5
    assert response.usage.input_tokens > 0
    events = []
    stream = await api.responses.create(
        model=MODEL, instructions=DOCUMENT, input="And the dog?", max_output_tokens=3, stream=True
    )
    async for event in stream:
        events.append(event)
    assert events[0].type == "response.created"
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == [" tok"] * 3
    completed = events[-1]
    assert completed.type == "response.completed"
    # The same instructions: the second request went where the first one's prefix is cached.
    assert completed.response.usage.input_tokens_details.cached_tokens > 0
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_routing_decisions_total", reason="latency_hit") == 1
    assert total(samples, "kvroute_ttft_seconds_count", endpoint="responses") == 1


async def test_a_chat_conversation_continued_as_a_response_shares_its_prefix(fleet, make_router):
    """Responses input items are keyed as the chat messages an engine renders them into."""
    router = await make_router(backends_of(fleet))
    api = client(router)
    chat = await api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "hi"}]
    )
    response = await api.responses.with_raw_response.create(
        model=MODEL,
        input=[
            {"role": "system", "content": DOCUMENT},
            {"role": "user", "content": [{"type": "input_text", "text": "hi again"}]},
        ],
    )
    assert response.headers["x-kvroute-reason"] == "latency_hit"
    assert response.headers["x-kvroute-backend"] == chat.headers["x-kvroute-backend"]


async def test_audio_transcriptions_are_routed_by_the_forms_model(make_router):
    """Two engines serving different models: the form's ``model`` decides where the audio goes."""
    speech, text = SimEngine(FAST, models=("whisper",), name="speech"), SimEngine(FAST, name="text")
    for engine in (speech, text):
        await engine.start()
    try:
        router = await make_router([{"name": "text", "url": text.url}, {"name": "speech", "url": speech.url}])
        audio = bytes(range(256)) * 200  # 51,200 bytes: five transcript tokens
        raw = await client(router).audio.transcriptions.with_raw_response.create(
            model="whisper", file=("clip.wav", audio, "audio/wav")
        )
        assert raw.headers["x-kvroute-backend"] == "speech"
        assert raw.headers["x-kvroute-reason"] == "least_load"
        transcript = raw.parse()
        assert transcript.text == "tok tok tok tok tok"
        assert speech.stats()["completed"] == 1 and text.stats()["completed"] == 0
    finally:
        for engine in (speech, text):
            await engine.stop()


async def test_a_form_with_the_file_before_the_model_is_forwarded_unchanged(make_router, http):
    async with SimFleet(2, timing=FAST, models=("whisper",)) as fleet:
        router = await make_router(backends_of(fleet))
        form = aiohttp.FormData()
        form.add_field("file", b"\x00\x01" * 15_000, filename="clip.wav", content_type="audio/wav")
        form.add_field("response_format", "text")
        form.add_field("model", "whisper")
        async with http.post(f"{router.url}/v1/audio/transcriptions", data=form) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.content_type == "text/plain"
            assert await resp.text() == "tok tok tok"


@pytest.mark.parametrize(
    ("content_type", "body", "status", "param"),
    [
        pytest.param("application/json", b'{"model": "whisper"}', 415, None, id="not-a-form"),
        pytest.param("multipart/form-data", b"--x\r\n", 415, None, id="no-boundary"),
        pytest.param("multipart/form-data; boundary=x", b"no delimiter", 400, None, id="no-delimiter"),
        pytest.param(
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nabc\r\n--x--\r\n',
            400,
            "model",
            id="no-model",
        ),
        pytest.param(
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper',
            400,
            None,
            id="cut-short",
        ),
    ],
)
async def test_bad_forms_get_clear_errors(fleet, make_router, http, content_type, body, status, param):
    router = await make_router(backends_of(fleet))
    headers = {"Content-Type": content_type}
    async with http.post(f"{router.url}/v1/audio/transcriptions", data=body, headers=headers) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["param"] == param
    assert sum(e.stats()["received"] for e in fleet.engines) == 0


@pytest.mark.parametrize(
    ("path", "body", "check"),
    [
        pytest.param(
            "/v1/rerank",
            {"model": MODEL, "query": "lazy dog", "documents": ["a cat", "the lazy dog"], "top_n": 1},
            lambda r: (
                r["results"] == [{"index": 1, "document": {"text": "the lazy dog"}, "relevance_score": 1.0}]
            ),
            id="v1-rerank",
        ),
        pytest.param(
            "/rerank",
            {"model": MODEL, "query": "fox", "documents": ["fox", "dog"]},
            lambda r: [x["index"] for x in r["results"]] == [0, 1],
            id="rerank",
        ),
        pytest.param(
            "/v1/score",
            {"model": MODEL, "text_1": "brown fox", "text_2": ["a brown fox", "a dog"]},
            lambda r: [d["score"] for d in r["data"]] == [1.0, 0.0] and r["object"] == "list",
            id="v1-score",
        ),
        pytest.param(
            "/tokenize",
            {"model": MODEL, "prompt": "hello world!"},
            lambda r: r["count"] == 3 and len(r["tokens"]) == 3 and r["max_model_len"] > 0,
            id="tokenize",
        ),
        pytest.param(
            "/detokenize",
            {"model": MODEL, "tokens": [1819043176, 1870078063, 560229490]},
            lambda r: r == {"prompt": "hello world!"},
            id="detokenize",
        ),
    ],
)
async def test_load_balanced_endpoints_over_raw_http(fleet, make_router, http, path, body, check):
    router = await make_router(backends_of(fleet))
    status, headers, payload = await post_json(http, router.url + path, body)
    assert status == 200, payload
    assert check(payload), payload
    assert headers["x-kvroute-reason"] == "least_load"
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_routing_decisions_total", policy="least_load", reason="least_load") == 1
    label = path.rsplit("/", 1)[1]
    assert total(samples, "kvroute_requests_total", endpoint=label, status="200") == 1


async def test_load_balanced_endpoints_spread_over_the_fleet(fleet, make_router, http):
    """The cache-aware policy stays out of it: in-flight load decides, so concurrent requests
    land on every engine even though they are identical."""
    slow = FAST.__class__(prefill_base_s=0.05)
    async with SimFleet(3, timing=slow) as slow_fleet:
        router = await make_router(backends_of(slow_fleet))
        body = {"model": MODEL, "query": DOCUMENT, "documents": [DOCUMENT]}
        results = await asyncio.gather(*(post_json(http, f"{router.url}/v1/rerank", body) for _ in range(6)))
        assert {r[0] for r in results} == {200}
        assert {r[1]["x-kvroute-backend"] for r in results} == {"e0", "e1", "e2"}
        await wait_released(http, router.url)


async def test_an_endpoint_the_engine_does_not_serve_passes_its_404_through(make_router, http):
    engine = SimEngine(FAST, endpoints=("chat", "completions"))
    await engine.start()
    try:
        router = await make_router([{"name": "gen", "url": engine.url}])
        status, headers, _ = await post_json(
            http, f"{router.url}/v1/embeddings", {"model": MODEL, "input": "x"}
        )
        assert status == 404
        assert headers["x-kvroute-backend"] == "gen"
        samples = await scrape(http, router.url)
        assert (
            total(samples, "kvroute_requests_total", endpoint="embeddings", backend="gen", status="404") == 1
        )
        # A 4xx is the request's fault, not the backend's: it stays in rotation, nothing retried.
        assert total(samples, "kvroute_retries_total") == 0
        status, _, _ = await post_json(
            http,
            f"{router.url}/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        )
        assert status == 200
    finally:
        await engine.stop()


async def test_a_dead_engine_is_retried_before_the_first_byte(make_router, http):
    async with SimFleet(2, timing=FAST) as fleet:
        router = await make_router(backends_of(fleet), upstream={"max_attempts": 2})
        await fleet.engines[0].stop()  # in rotation until a request or a check finds it dead
        for _ in range(20):
            status, headers, payload = await post_json(
                http, f"{router.url}/tokenize", {"model": MODEL, "prompt": "hello"}
            )
            assert status == 200, payload
            assert headers["x-kvroute-backend"] == "e1"
            if total(await scrape(http, router.url), "kvroute_retries_total"):
                break
        else:
            pytest.fail("no request was ever sent to the dead engine")
        await wait_released(http, router.url)


async def test_client_keys_and_limits_hold_for_every_endpoint(fleet, make_router, http):
    router = await make_router(
        backends_of(fleet),
        auth={"keys": {"acme": "acme-key"}},
        limits={"tenant_default": {"requests_per_s": 0.001, "request_burst": 1}},
    )
    body = {"model": MODEL, "prompt": "hi"}
    async with http.post(f"{router.url}/tokenize", json=body) as resp:
        assert resp.status == 401
    headers = {"Authorization": "Bearer acme-key"}
    async with http.post(f"{router.url}/tokenize", json=body, headers=headers) as resp:
        assert resp.status == 200
    async with http.post(
        f"{router.url}/detokenize", json={"model": MODEL, "tokens": [1]}, headers=headers
    ) as resp:
        assert resp.status == 429
    with pytest.raises(openai.AuthenticationError):
        await client(router, key="wrong").embeddings.create(model=MODEL, input="x")


async def test_models_keep_each_engines_own_entry_and_name_their_backends(make_router, http):
    first = SimEngine(FAST, models=("shared", "only-first"), name="first")
    second = SimEngine(FAST, models=("shared",), name="second")
    for engine in (first, second):
        await engine.start()
    try:
        router = await make_router([{"name": "a", "url": first.url}, {"name": "b", "url": second.url}])
        async with http.get(f"{first.url}/v1/models") as resp:
            own = {card["id"]: card for card in (await resp.json())["data"]}
        listed = await client(router).models.list()
        cards = {m.id: m.model_dump(exclude_unset=True) for m in listed.data}
        assert set(cards) == {"shared", "only-first"}
        assert cards["shared"] == {**own["shared"], "kvroute_backends": ["a", "b"]}
        assert cards["only-first"]["kvroute_backends"] == ["a"]
        assert (
            cards["shared"]["max_model_len"] == FAST.max_model_len and cards["shared"]["owned_by"] == "vllm"
        )
    finally:
        for engine in (first, second):
            await engine.stop()


async def test_configured_models_get_a_minimal_entry(fleet, make_router, http):
    backends = [{**b, "models": [MODEL]} for b in backends_of(fleet)]
    router = await make_router(backends)
    async with http.get(f"{router.url}/v1/models") as resp:
        data = (await resp.json())["data"]
    assert data == [
        {"id": MODEL, "object": "model", "owned_by": "kvroute", "kvroute_backends": ["e0", "e1", "e2"]}
    ]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/embeddings", {"model": MODEL, "input": DOCUMENT}, id="embeddings"),
        pytest.param(
            "/v1/responses",
            {"model": MODEL, "instructions": DOCUMENT, "input": "Summarise.", "max_output_tokens": 2},
            id="responses",
        ),
    ],
)
async def test_precise_mode_keys_embeddings_and_responses_as_the_engine_tokenizes_them(
    make_router, http, path, body
):
    """In precise mode a prompt an engine cached behind the router's back (its KV events say so)
    is routed there: the router's token ids for these endpoints are the engine's."""
    async with SimFleet(2, timing=FAST, kv_events="vllm") as fleet:
        router = await make_router(
            backends_of(fleet), index={"mode": "events", "tokenizer": {"kind": "chunk"}}
        )

        async def subscribed() -> bool:
            samples = await scrape(http, router.url)
            return total(samples, "kvroute_kv_events_resyncs_total", reason="connect") == 2

        await wait_for(subscribed, what="both engines subscribed")
        status, _, _ = await post_json(http, fleet.urls[1] + path, body)
        assert status == 200

        async def reported() -> bool:
            samples = await scrape(http, router.url)
            return total(samples, "kvroute_kv_events_batches_total", backend="e1") > 0

        await wait_for(reported, what="e1's KV events applied")
        status, headers, _ = await post_json(http, router.url + path, body)
        assert status == 200
        assert (headers["x-kvroute-backend"], headers["x-kvroute-reason"]) == ("e1", "latency_hit")
