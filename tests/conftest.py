"""Shared fixtures: simulated engines, routers and a private redis-server on loopback.

Helpers that tests import by name live in ``tests/helpers.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from loadtest.sim.engine import SimEngine
from loadtest.sim.fleet import SimFleet
from router.config import config_from_dict, load_config
from router.http.server import RouterServer
from tests import redis_servers
from tests.fault_engine import FaultEngine, start_engines
from tests.helpers import FAST, Deployment, MakeRouter, admin_on_free_port
from tests.redis_servers import RedisServer

#: A test whose program is missing fails with one line naming it and its install command.
pytest_plugins = ("tests.missing_programs",)


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
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server on a free port, stopped after the test."""
    with redis_servers.redis_server() as started:
        yield started


@pytest.fixture
async def engines(fault_engines) -> list[FaultEngine]:
    """Two fault engines in their well-behaved mode."""
    return await fault_engines("ok", "ok")


@pytest.fixture
async def deploy(tmp_path: Path) -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[Deployment]]]:
    """Start routers from a config written to a file (so that they can reload it); all stop after."""
    servers: list[RouterServer] = []

    async def start(config: dict[str, Any]) -> Deployment:
        path = tmp_path / "kvroute.yaml"
        path.write_text(yaml.safe_dump(admin_on_free_port(config)))
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
            admin_on_free_port(
                {
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "backends": backends,
                    "routing": routing,
                    **sections,
                }
            )
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
