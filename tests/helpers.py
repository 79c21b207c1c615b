"""What tests share besides fixtures: quick engine timing, config pieces, metrics reads, polling.

``conftest.py`` holds only fixtures, which pytest hands to tests by parameter name; whatever a test
imports by name lives here, so that no test module imports ``conftest``.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.ports import free_port, free_ports
from loadtest.programs import require
from loadtest.sim.fleet import SimFleet
from loadtest.sim.timing import EngineTiming
from router.config import Config, config_from_dict
from router.http.server import RouterServer
from router.index.build import build_index
from router.index.redis_store import RedisIndex
from router.metrics import RouterMetrics

#: Quick engines: tests need the shape of the timing model, not its scale.
FAST = EngineTiming(prefill_base_s=0.001, prefill_per_token_s=0.000005, decode_step_s=0.002)

#: What the ``make_router`` fixture yields: ``await make_router(backends, **config_sections)``.
MakeRouter = Callable[..., Awaitable[RouterServer]]

#: The admin API's listener in tests: loopback as by default, on any free port (the default
#: port, 8081, would collide between routers started side by side).
TEST_ADMIN_LISTEN = {"host": "127.0.0.1", "port": 0}

#: The backends of ``open_index``'s config (their URLs are never reached).
INDEX_BACKENDS = ["a", "b", "c"]


#: A system prompt of several index blocks, shared by every request of a test that checks routing.
SHARED_SYSTEM = "You are a careful assistant. " * 40


async def chat_after_system(
    http: aiohttp.ClientSession, url: str, user: str, max_tokens: int = 2
) -> aiohttp.ClientResponse:
    """A chat completion after ``SHARED_SYSTEM`` (body read); the response, for its status and headers."""
    body = {
        "model": "sim-model",
        "messages": [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
    }
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp


def write_workers_config(
    path: Path, port: int, backends: list[dict[str, Any]], index: dict[str, Any]
) -> Path:
    """A config for ``serve --workers N``: the router on ``port``, its admin API on a free port
    of its own (every worker binds both), routing by the deepest match."""
    path.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "admin": {"listen": {"host": "127.0.0.1", "port": free_port()}},
                "backends": backends,
                "index": index,
                # The deepest match, deterministically: the workers' tests test their shared
                # index, not the default policy's trade of a hit against load.
                "routing": {"policy": "prefix_aware"},
            }
        )
    )
    return path


async def wait_every_worker_answers(url: str, timeout: float) -> None:
    """Until ``/metrics`` at ``url`` answers 200, which it does once every worker of the group
    answers for itself (router/http/worker_metrics.py)."""

    async def answers() -> bool:
        try:
            async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False

    await wait_for(answers, what="every worker to listen", timeout=timeout)


async def assert_every_connection_hits(
    post: Callable[[], Awaitable[aiohttp.ClientResponse]], backend: str, times: int = 10
) -> None:
    """``times`` requests, each on a new connection (so the kernel spreads them over the workers
    of ``serve --workers N``), all find their prefix on ``backend``."""
    for _ in range(times):
        resp = await post()
        assert resp.status == 200
        assert (resp.headers["x-kvroute-backend"], resp.headers["x-kvroute-reason"]) == (
            backend,
            "prefix_hit",
        )


def admin_on_free_port(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the admin API on a free loopback port, unless it says where it listens."""
    admin = dict(config.get("admin") or {})
    admin.setdefault("listen", TEST_ADMIN_LISTEN)
    return {**config, "admin": admin}


def backends_of(fleet: SimFleet, prefix: str = "e") -> list[dict[str, Any]]:
    """The ``backends`` config section for a simulated fleet, named ``e0``, ``e1``, …"""
    return [{"name": f"{prefix}{i}", "url": url} for i, url in enumerate(fleet.urls)]


class Deployment:
    """A router started from a config file that the test rewrites, as an operator would."""

    def __init__(self, path: Path, server: RouterServer) -> None:
        self.path = path
        self.server = server

    def write(self, config: dict[str, Any] | str) -> None:
        """Rewrite the file; a mapping gets the admin listener the deployment was started with."""
        if not isinstance(config, str):
            config = yaml.safe_dump(admin_on_free_port(config))
        self.path.write_text(config)

    async def reload(
        self, http: aiohttp.ClientSession, headers: dict[str, str]
    ) -> tuple[int, dict[str, Any]]:
        async with http.post(f"{self.server.admin_url}/admin/reload", headers=headers) as resp:
            return resp.status, await resp.json()


def redis_index_config(redis: dict[str, Any], **index: Any) -> Config:
    """A config of three unreachable backends whose index is stored in Redis as ``redis`` says."""
    return config_from_dict(
        {
            "backends": [{"name": n, "url": f"http://127.0.0.1:1/{n}"} for n in INDEX_BACKENDS],
            "index": {"store": "redis", "redis": redis, **index},
        }
    )


@asynccontextmanager
async def open_index(redis: dict[str, Any], **index: Any) -> AsyncIterator[tuple[RedisIndex, RouterMetrics]]:
    """A started Redis index (as the router builds it) and its metrics; closed after."""
    metrics = RouterMetrics()
    built = build_index(redis_index_config(redis, **index), metrics)
    assert isinstance(built, RedisIndex)
    await built.start()
    try:
        yield built, metrics
    finally:
        await built.close()


def sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    """One sample of ``metrics`` read in-process, 0 when it was never recorded."""
    return metrics.registry.get_sample_value(name, labels) or 0.0


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


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([require("openssl"), *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> Path:
    """A throwaway CA in ``directory`` (``ca.crt``/``ca.key``), a server certificate it signed for
    127.0.0.1 and localhost (``server.crt``/``server.key``), and a client certificate for mutual
    TLS (``client.crt``/``client.key``), made by ``openssl``; returns ``directory``."""
    d = directory
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvroute test CA",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    extensions = {
        "server": "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for name, ext in extensions.items():
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=kvroute test {name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(ext)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)  # fmt: skip
    return d


def kvroute(*args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """``kvroute ARGS``; its output piped (read it with communicate), or appended to ``log``."""
    if log is None:
        return subprocess.Popen(
            [sys.executable, "-m", "kvroute.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "kvroute.cli", *args], stdout=out, stderr=out)


def free_port_pair() -> int:
    """A port P with P and P+1 free (the simulated fleet takes consecutive ports;
    a router its port and its admin listener the next)."""
    return free_ports(2)


def _timed_out(what: str, timeout: float, detail: Callable[[], object] | None) -> AssertionError:
    message = f"timed out after {timeout} s waiting for {what}"
    return AssertionError(f"{message}; last seen: {detail()}" if detail is not None else message)


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]],
    *,
    what: str,
    timeout: float = 5.0,
    interval: float = 0.02,
    detail: Callable[[], object] | None = None,
) -> None:
    """Poll ``condition`` (sync or async) until it is true; after ``timeout`` seconds fail naming
    ``what`` was awaited, and ``detail()`` (what the last look saw) when the caller gives one.

    Tests poll instead of sleeping a fixed time: a fixed sleep is either too short on a busy
    machine or wastes time on an idle one."""
    deadline = time.monotonic() + timeout
    while True:
        met = condition()
        if inspect.isawaitable(met):
            met = await met
        if met:
            return
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, detail)
        await asyncio.sleep(interval)


def wait_for_sync(
    condition: Callable[[], bool],
    *,
    what: str,
    timeout: float = 5.0,
    interval: float = 0.02,
    detail: Callable[[], object] | None = None,
) -> None:
    """``wait_for`` for tests without an event loop (blocking clients of a ``kvroute`` process)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, detail)
        time.sleep(interval)


async def wait_released(session: aiohttp.ClientSession, router_url: str, timeout: float = 2.0) -> None:
    """Wait until the router reports no request in flight on any backend."""

    async def released() -> bool:
        return total(await scrape(session, router_url), "kvroute_backend_in_flight") == 0

    await wait_for(released, what="no request in flight on any backend", timeout=timeout)
