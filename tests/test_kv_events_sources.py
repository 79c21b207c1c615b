"""Where a backend's engine publishes: configured endpoints, and the engines' own answers."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from router.kv_events.settings import EndpointConfig
from router.kv_events.sources import DiscoveryError, EventSource, configured_sources, discover_sources


def test_configured_data_parallel_ranks_publish_on_consecutive_ports() -> None:
    config = EndpointConfig("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600", "kv", dp_size=2)
    assert configured_sources("a", config) == [
        EventSource("a", 0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600", "kv"),
        EventSource("a", 1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5601", "kv"),
    ]
    ipc = configured_sources("b", EndpointConfig("ipc:///tmp/kv", None, dp_size=2))
    assert [s.endpoint for s in ipc] == ["ipc:///tmp/kv", "ipc:///tmp/kv_dp1"]


async def _serve(path: str, payload: object, status: int = 200) -> tuple[web.AppRunner, str]:
    async def handler(_request: web.Request) -> web.Response:
        return web.json_response(payload, status=status)

    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_vllm_wildcard_endpoints_get_the_backends_host() -> None:
    answer = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5558", "topic": "kv"},
        "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5558",
              "replay_endpoint": None, "topic": "kv"},
    }  # fmt: skip
    runner, url = await _serve("/kv_event_sources", answer)
    try:
        async with aiohttp.ClientSession() as session:
            sources = await discover_sources(session, "a", url, "vllm", timeout_s=2)
    finally:
        await runner.cleanup()
    assert sources == [
        EventSource("a", 0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv"),
        EventSource("a", 1, "tcp://127.0.0.1:5558", None, "kv"),
    ]


async def test_sglang_server_info_names_base_ports_per_rank() -> None:
    block = {"publisher": "zmq", "endpoint_host": "0.0.0.0", "endpoint_port_base": 6000,
             "replay_endpoint_port_base": 6100, "topic": "", "block_size": 16, "dp_size": 2}  # fmt: skip
    info = {"kv_events": block}
    runner, url = await _serve("/server_info", info)
    try:
        async with aiohttp.ClientSession() as session:
            sources = await discover_sources(session, "b", url, "sglang", timeout_s=2)
    finally:
        await runner.cleanup()
    assert [(s.rank, s.endpoint, s.replay_endpoint) for s in sources] == [
        (0, "tcp://127.0.0.1:6000", "tcp://127.0.0.1:6100"),
        (1, "tcp://127.0.0.1:6001", "tcp://127.0.0.1:6101"),
    ]


@pytest.mark.parametrize(
    ("engine", "path", "payload", "status"),
    [
        ("vllm", "/kv_event_sources", {}, 200),  # render-only server, or events off
        ("vllm", "/kv_event_sources", {"0": {"enable_kv_cache_events": False}}, 200),
        ("vllm", "/other", {}, 200),  # an engine without the endpoint: 404
        ("sglang", "/server_info", {"kv_events": None}, 200),
        ("sglang", "/server_info", {"kv_events": {"publisher": "zmq"}}, 200),  # no port
        ("sglang", "/server_info", {}, 503),
    ],
)
async def test_engines_that_cannot_say_raise_discovery_error(
    engine: str, path: str, payload: object, status: int
) -> None:
    runner, url = await _serve(path, payload, status)
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(DiscoveryError):
                await discover_sources(session, "x", url, engine, timeout_s=2)
    finally:
        await runner.cleanup()


async def test_an_unreachable_engine_raises_discovery_error() -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DiscoveryError):
            await discover_sources(session, "x", "http://127.0.0.1:1", "vllm", timeout_s=1)
