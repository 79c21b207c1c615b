"""Request ids and forwarding headers over real HTTP: what the client gets back and what the
engine receives (the simulated engines remember each request's headers)."""

from __future__ import annotations

import re

import pytest

from loadtest.sim.engine import SimEngine
from tests.helpers import FAST

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
NEW_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
async def engine():
    started = SimEngine(FAST, name="only")
    await started.start()
    yield started
    await started.stop()


def last_seen(engine: SimEngine) -> dict[str, str]:
    return {k.lower(): v for k, v in engine.seen_headers[-1].items()}


async def test_a_sane_client_id_is_kept_end_to_end(engine, make_router, http):
    router = await make_router([{"name": "e0", "url": engine.url}])
    headers = {"X-Request-Id": "client-42.retry:1"}
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "client-42.retry:1"
    assert last_seen(engine)["x-request-id"] == "client-42.retry:1"


@pytest.mark.parametrize(
    "offered",
    [
        pytest.param(None, id="none"),
        pytest.param("", id="empty"),
        pytest.param("x" * 129, id="too-long"),
        pytest.param("id with spaces", id="spaces"),
        pytest.param("id\u00e9", id="non-ascii"),
        pytest.param("a;b", id="separator"),
    ],
)
async def test_a_missing_or_insane_id_is_replaced_by_a_new_one(engine, make_router, http, offered):
    router = await make_router([{"name": "e0", "url": engine.url}])
    headers = {} if offered is None else {"X-Request-Id": offered}
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
        given = resp.headers["X-Request-Id"]
    assert NEW_ID.fullmatch(given)
    assert last_seen(engine)["x-request-id"] == given


async def test_every_request_gets_a_distinct_id(engine, make_router, http):
    router = await make_router([{"name": "e0", "url": engine.url}])
    ids = set()
    for _ in range(5):
        async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
            ids.add(resp.headers["X-Request-Id"])
    assert len(ids) == 5


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        pytest.param("POST", "/v1/chat/completions", {**CHAT, "model": "unknown"}, 404, id="unknown-model"),
        pytest.param("POST", "/v1/chat/completions", {"model": MODEL}, 400, id="bad-body"),
        pytest.param("GET", "/nowhere", None, 404, id="no-route"),
        pytest.param("GET", "/v1/models", None, 200, id="models"),
        pytest.param("GET", "/health", None, 200, id="health"),
    ],
)
async def test_answers_of_the_router_itself_carry_the_id(
    engine, make_router, http, method, path, body, status
):
    router = await make_router([{"name": "e0", "url": engine.url}])
    headers = {"X-Request-Id": "mine-1"}
    async with http.request(method, router.url + path, json=body, headers=headers) as resp:
        assert resp.status == status
        assert resp.headers["X-Request-Id"] == "mine-1"


async def test_forwarded_headers_tell_the_engine_who_the_client_is(engine, make_router, http):
    router = await make_router([{"name": "e0", "url": engine.url}])
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    seen = last_seen(engine)
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    # Behind another proxy: its chain is extended, its protocol kept.
    headers = {"X-Forwarded-For": "203.0.113.7, 10.0.0.2", "X-Forwarded-Proto": "https"}
    async with http.post(
        f"{router.url}/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=headers
    ) as resp:
        assert resp.status == 200
    seen = last_seen(engine)
    assert seen["x-forwarded-for"] == "203.0.113.7, 10.0.0.2, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "https"


async def test_forwarded_headers_can_be_turned_off(engine, make_router, http):
    router = await make_router([{"name": "e0", "url": engine.url}], upstream={"forwarded_headers": False})
    headers = {"X-Forwarded-For": "203.0.113.7"}
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
    seen = last_seen(engine)
    assert seen["x-forwarded-for"] == "203.0.113.7"  # the client's own header, passed through as is
    assert "x-forwarded-proto" not in seen
    assert NEW_ID.fullmatch(seen["x-request-id"])
