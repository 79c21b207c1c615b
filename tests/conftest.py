"""Shared fixtures: simulated engines and routers on loopback, and small helpers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim.engine import SimEngine
from loadtest.sim.fleet import SimFleet
from loadtest.sim.timing import EngineTiming
from router.config import config_from_dict, load_config
from router.http.server import RouterServer
from tests.fault_engine import FaultEngine, start_engines
from tests.redis_servers import RedisServer, redis_server

#: Quick engines: tests need the shape of the timing model, not its scale.
FAST = EngineTiming(prefill_base_s=0.001, prefill_per_token_s=0.000005, decode_step_s=0.002)

MakeRouter = Callable[..., Awaitable[RouterServer]]


def backends_of(fleet: SimFleet, prefix: str = "e") -> list[dict[str, Any]]:
    return [{"name": f"{prefix}{i}", "url": url} for i, url in enumerate(fleet.urls)]


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(3, timing=FAST) as f:
        yield f


@pytest.fixture
async def fault_engines() -> AsyncIterator[Callable[..., Awaitable[list[FaultEngine]]]]:
    """Start fault-injecting engines by mode (``await fault_engines("hang", "ok")``); all stop after."""
    started: list[FaultEngine] = []

    async def make(*modes: str) -> list[FaultEngine]:
        started.extend(await start_engines(*modes))
        return started

    yield make
    for engine in started:
        engine.release.set()
        await engine.stop()


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A private redis-server on a free port, stopped after the test."""
    with redis_server() as started:
        yield started


@pytest.fixture
async def engines(fault_engines) -> list[FaultEngine]:
    """Two fault engines in their well-behaved mode."""
    return await fault_engines("ok", "ok")


class Deployment:
    """A router started from a config file that the test rewrites, as an operator would."""

    def __init__(self, path: Path, server: RouterServer) -> None:
        self.path = path
        self.server = server

    def write(self, config: dict[str, Any] | str) -> None:
        self.path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))

    async def reload(
        self, http: aiohttp.ClientSession, headers: dict[str, str]
    ) -> tuple[int, dict[str, Any]]:
        async with http.post(f"{self.server.url}/admin/reload", headers=headers) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def deploy(tmp_path: Path) -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[Deployment]]]:
    """Start routers from a config written to a file (so that they can reload it); all stop after."""
    servers: list[RouterServer] = []

    async def start(config: dict[str, Any]) -> Deployment:
        path = tmp_path / "kvroute.yaml"
        path.write_text(yaml.safe_dump(config))
        server = RouterServer(load_config(path), config_path=str(path))
        await server.start()
        servers.append(server)
        return Deployment(path, server)

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def shared_port_engines() -> AsyncIterator[int]:
    """Two engines on one port, at 127.0.0.2 and 127.0.0.3 (as pods behind a headless Service)."""
    first = SimEngine(FAST, name="a")
    await first.start("127.0.0.2", 0)
    port = int(first.url.rsplit(":", 1)[1])
    second = SimEngine(FAST, name="b")
    await second.start("127.0.0.3", port)
    yield port
    await first.stop()
    await second.stop()


@pytest.fixture
async def make_router() -> AsyncIterator[MakeRouter]:
    """Start routers from config sections; all are stopped after the test."""
    servers: list[RouterServer] = []

    async def make(backends: list[dict[str, Any]], **sections: Any) -> RouterServer:
        routing = {"seed": 1, **sections.pop("routing", {})}
        config = config_from_dict(
            {"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends, "routing": routing, **sections}
        )
        server = RouterServer(config)
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` from a Prometheus endpoint."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(
        v for (n, ls), v in samples.items() if n == name and all((k, val) in ls for k, val in labels.items())
    )


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll ``check`` until it is true, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def wait_released(session: aiohttp.ClientSession, router_url: str, timeout: float = 2.0) -> None:
    """Wait until the router reports no request in flight on any backend."""

    async def released() -> bool:
        return total(await scrape(session, router_url), "kvroute_backend_in_flight") == 0

    await eventually(released, timeout=timeout)
