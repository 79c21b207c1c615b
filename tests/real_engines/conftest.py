"""Fixtures of the real-engine tests: two vLLM replicas (CPU build, tiny local model) per session.

The replicas take 25-50 s to start and 2-3 GB each, so one pair serves every test of the session
(tests that stop a replica start it again before they end, and a fixture restarts any replica a
failed test left down). Every test here is marked
``real_engine`` and runs after the rest of the suite. Without the engine's environment
(``bash tests/real_engines/setup.sh``) they are skipped on a developer's machine, and fail in CI
(``CI=true``): CI must never pass by skipping them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from loadtest.vllm_replicas import VllmReplica, engine_installed, engine_python, start_replicas
from router.http.server import RouterServer
from tests.helpers import MakeRouter
from tests.real_engines.traffic import in_rotation

HERE = os.path.dirname(__file__)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``real_engine`` and move them after every other test."""
    ours, others = [], []
    for item in items:
        (ours if str(item.path).startswith(HERE) else others).append(item)
    for item in ours:
        item.add_marker(pytest.mark.real_engine)
        item.add_marker(pytest.mark.timeout(420))
    items[:] = others + ours


@pytest.fixture(scope="session")
def vllm_pair() -> Iterator[list[VllmReplica]]:
    """Two replicas, ``e0`` and ``e1``, for the whole session; stopped (process groups) at its end."""
    if not engine_installed():
        message = f"no vLLM engine at {engine_python()}: run bash tests/real_engines/setup.sh"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI runs the real-engine tests: {message}", pytrace=False)
        pytest.skip(message)
    replicas = [VllmReplica("e0"), VllmReplica("e1")]
    start_replicas(replicas)
    try:
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()
            replica.remove_files()


@pytest.fixture(autouse=True)
def replicas_up_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, start again any replica it left stopped (a test that stops one and fails
    before its restart), so that one failure does not fail every later test with it."""
    yield
    if "vllm_pair" not in request.fixturenames:
        return
    pair: list[VllmReplica] = request.getfixturevalue("vllm_pair")
    down = [r for r in pair if r.process is None or r.process.poll() is not None]
    for replica in down:
        replica.kill()  # reaps a leader that exited; its group's leftovers go with it
    if down:
        start_replicas(down)


@pytest.fixture
def make_router(make_router: MakeRouter, http: aiohttp.ClientSession) -> MakeRouter:
    """The suite's ``make_router``, returning once every configured backend is in rotation, so
    that no test's first request meets a replica the router has not admitted yet."""

    async def make(backends: list[dict[str, Any]], **sections: Any) -> RouterServer:
        router = await make_router(backends, **sections)
        await in_rotation(http, router.admin_url, [b["name"] for b in backends])
        return router

    return make


@pytest.fixture
async def openai_client() -> AsyncIterator[AsyncOpenAI]:
    """Made per router: ``openai_client.with_options(base_url=...)``; no retries of its own."""
    async with AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused", max_retries=0) as client:
        yield client
