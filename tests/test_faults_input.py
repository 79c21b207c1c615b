"""Property: fields the router does not know reach the engine untouched, byte for byte.

Complements tests/test_bad_input_property.py (no body gets a 5xx): here valid requests carry
arbitrary extra fields (vendor extensions, future OpenAI parameters, odd Unicode), and the
engine must receive exactly the bytes the client sent. Same set-up: one router and engine in
a thread of their own, so hypothesis drives plain synchronous requests.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import config_from_dict
from router.http.server import RouterServer
from tests.fault_engine import MODEL, FaultEngine, backends
from tests.helpers import admin_on_free_port

KNOWN = {"model", "messages", "prompt", "stream", "max_tokens", "max_completion_tokens", "user", "tools"}
SETTINGS = settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
extra_fields = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(lambda k: k not in KNOWN), json_values, max_size=4
)


class BodyRecorder(FaultEngine):
    def __init__(self) -> None:
        super().__init__("f0")
        self.bodies: list[bytes] = []

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        return await super()._generate(request)


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[str, BodyRecorder]]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, object] = {}

    async def run() -> None:
        engine = BodyRecorder()
        await engine.start()
        config = config_from_dict(admin_on_free_port({"listen": {"port": 0}, "backends": backends([engine])}))
        async with RouterServer(config) as server:
            state.update(url=server.url, engine=engine, stop=(stop := asyncio.Event()))
            ready.set()
            await stop.wait()
        await engine.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert ready.wait(15), "router did not start"
    yield str(state["url"]), state["engine"]  # type: ignore[misc]
    loop.call_soon_threadsafe(state["stop"].set)  # type: ignore[union-attr]
    thread.join(15)


def post(url: str, path: str, body: bytes) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=15)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@SETTINGS
@given(extra=extra_fields, chat=st.booleans(), indent=st.booleans())
def test_unknown_fields_reach_the_engine_byte_for_byte(deployment, extra, chat, indent):
    url, engine = deployment
    if chat:
        path, base = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, base = "/v1/completions", {"prompt": "hi"}
    body = json.dumps({"model": MODEL, **base, **extra}, indent=2 if indent else None).encode()
    assert post(url, path, body) == 200
    assert engine.bodies[-1] == body
