"""Property: whatever the body, the router answers 2xx or a 4xx in the OpenAI shape, never 5xx.

Hypothesis generates arbitrary JSON documents, valid requests with one field replaced by
arbitrary JSON, and raw bytes (invalid UTF-8 included), and posts them through a real
router to real simulated engines. One router and fleet serve the whole module, in a thread
of their own, so that hypothesis can drive plain synchronous requests.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.sim.fleet import SimFleet
from loadtest.sim.timing import EngineTiming
from router.config import config_from_dict
from router.http.server import RouterServer
from tests.helpers import admin_on_free_port

#: Engines with no decode delay: a generated max_tokens of thousands must still finish at once.
INSTANT = EngineTiming(prefill_base_s=0.0, prefill_per_token_s=0.0, decode_step_s=0.0, decode_per_seq_s=0.0)
PATHS = ("/v1/chat/completions", "/v1/completions")
SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, object] = {}

    async def run() -> None:
        async with SimFleet(2, timing=INSTANT) as fleet:
            config = config_from_dict(
                admin_on_free_port(
                    {
                        "listen": {"port": 0},
                        "backends": [{"name": f"e{i}", "url": u} for i, u in enumerate(fleet.urls)],
                        "limits": {"max_body_bytes": 65536},
                    }
                )
            )
            async with RouterServer(config) as server:
                state["url"] = server.url
                state["stop"] = stop = asyncio.Event()
                ready.set()
                await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert ready.wait(15), "router did not start"
    yield str(state["url"])
    loop.call_soon_threadsafe(state["stop"].set)  # type: ignore[union-attr]
    thread.join(15)


def post(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=15)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def assert_clean(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:300])
    if status >= 400:
        error = json.loads(body)["error"]
        assert {"message", "type", "param", "code"} <= set(error), error
        assert error["message"]


@SETTINGS
@given(path=st.sampled_from(PATHS), document=json_values)
def test_any_json_document(router_url, path, document):
    assert_clean(*post(router_url, path, json.dumps(document).encode()))


@SETTINGS
@given(
    field=st.sampled_from(["model", "messages", "stream", "max_tokens", "stream_options", "user", "tools"]),
    value=json_values,
)
def test_valid_chat_with_one_field_replaced(router_url, field, value):
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    body[field] = value
    assert_clean(*post(router_url, PATHS[0], json.dumps(body).encode()))


@SETTINGS
@given(role=json_values, content=json_values)
def test_valid_chat_with_arbitrary_message(router_url, role, content):
    body = {"model": "sim-model", "messages": [{"role": role, "content": content}], "max_tokens": 2}
    assert_clean(*post(router_url, PATHS[0], json.dumps(body).encode()))


@SETTINGS
@given(prompt=json_values)
def test_completion_with_arbitrary_prompt(router_url, prompt):
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    assert_clean(*post(router_url, PATHS[1], json.dumps(body).encode()))


@SETTINGS
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=200))
def test_raw_bytes(router_url, path, raw):
    assert_clean(*post(router_url, path, raw))


def test_deeply_nested_and_huge_numbers(router_url):
    for body in (
        b"[" * 5000 + b"]" * 5000,
        b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1'
        + b"0" * 40
        + b"}",
        b'{"model": "sim-model", "tools": ' + b"[" * 300 + b"]" * 300 + b', "messages": [{"role": "user"}]}',
    ):
        assert_clean(*post(router_url, PATHS[0], body))
