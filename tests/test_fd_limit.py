"""A router at its file-descriptor limit: ``kvroute serve`` in a process with a low RLIMIT_NOFILE.

With ``max_connections`` above the limit, a flood of connections takes every descriptor: the
router must keep serving the connections it has, not spin on a listening socket it cannot
accept from, and accept again once the flood goes. With the default cap (derived from the
limit) the flood is shed before the limit is reached, so a request that needs a new upstream
connection still gets one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.ports import free_port
from tests.helpers import backends_of, scrape, total, wait_for

#: Descriptors the router process may open: a few dozen for itself, the rest for connections.
NOFILE = 128
#: Connections the flood opens: well past NOFILE.
FLOOD = 300
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def start_router(
    tmp_path: Path,
    backends: list[dict[str, Any]],
    policy: str = "prefix_aware",
    nofile: tuple[int, int] = (NOFILE, NOFILE),
    **listen: Any,
) -> tuple[subprocess.Popen, str]:
    """``kvroute serve`` started with the soft and hard ``RLIMIT_NOFILE`` of ``nofile``."""
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port, **listen},
        "admin": {"listen": {"host": "127.0.0.1", "port": 0}},
        "backends": backends,
        "routing": {"policy": policy},
        # No background connection during the test: the limit is for the clients and upstreams.
        "health": {"interval_s": 60},
        "engine_metrics": {"enabled": False},
        "log_level": "warning",
    }
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(config))

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    log = (tmp_path / "router.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=low_limit,
    )
    return process, f"http://127.0.0.1:{port}"


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def ready(url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with aiohttp.ClientSession() as http, http.get(f"{url}/ready") as resp:
            return resp.status == 200
    return False


async def chat(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
        await resp.read()
        return resp.status


async def flood(url: str) -> list[asyncio.StreamWriter]:
    port = int(url.rsplit(":", 1)[1])
    writers = []
    for _ in range(FLOOD):
        with contextlib.suppress(OSError):
            writers.append((await asyncio.open_connection("127.0.0.1", port))[1])
    return writers


async def fresh_request_served(url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            return await chat(http, url) == 200
    return False


async def test_at_the_fd_limit_the_router_serves_what_it_has_without_spinning_and_recovers(tmp_path, fleet):
    process, url = start_router(tmp_path, backends_of(fleet)[:1], max_connections=10_000)
    try:
        await wait_for(lambda: ready(url), what="the router to be ready", timeout=30)
        # One kept-alive client connection, whose request leaves an upstream connection pooled.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as kept:
            assert await chat(kept, url) == 200
            writers = await flood(url)
            await asyncio.sleep(0.5)  # the router takes what it can of the flood
            assert not await fresh_request_served(url)  # every descriptor is taken
            before, started = cpu_seconds(process.pid), time.monotonic()
            await asyncio.sleep(2.0)
            spent = cpu_seconds(process.pid) - before
            assert spent < 0.5 * (time.monotonic() - started), f"{spent:.2f} s of CPU while at the limit"
            assert await chat(kept, url) == 200  # the connection it has is still served
            assert process.poll() is None
            for writer in writers:
                writer.close()
            await wait_for(
                lambda: fresh_request_served(url), what="a new connection served again", timeout=20
            )
    finally:
        process.terminate()
        process.wait(30)
    assert process.returncode == 0, (tmp_path / "router.log").read_text()


async def test_the_default_cap_sheds_a_flood_before_the_fd_limit(tmp_path, fleet):
    process, url = start_router(tmp_path, backends_of(fleet), policy="round_robin")
    try:
        await wait_for(lambda: ready(url), what="the router to be ready", timeout=30)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as kept:
            assert await chat(kept, url) == 200
            writers = await flood(url)
            samples: dict = {}

            async def shed() -> bool:
                samples.update(await scrape(kept, url))
                return (
                    total(samples, "kvroute_client_connections_refused_total", reason="max_connections") > 0
                )

            await wait_for(shed, what="connections beyond the derived cap refused", timeout=10)
            cap = (NOFILE - 64) // 2
            assert total(samples, "kvroute_client_connections", listener="main") == cap
            # Descriptors were left for upstream connections: round robin reaches every engine,
            # two of them through connections opened now.
            answers = set()
            for _ in range(6):
                async with kept.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                    await resp.read()
                    answers.add((resp.status, resp.headers.get("x-kvroute-backend")))
            assert answers == {(200, "e0"), (200, "e1"), (200, "e2")}
            for writer in writers:
                writer.close()
    finally:
        process.terminate()
        process.wait(30)
    assert process.returncode == 0, (tmp_path / "router.log").read_text()


async def test_the_router_raises_its_soft_fd_limit_to_the_hard_one(tmp_path, fleet):
    """A runtime's low soft limit (1024 under a far higher hard one is common) is raised at start."""
    process, url = start_router(tmp_path, backends_of(fleet), nofile=(NOFILE, 4 * NOFILE))
    try:
        await wait_for(lambda: ready(url), what="the router to be ready", timeout=30)
        async with aiohttp.ClientSession() as http:
            assert total(await scrape(http, url), "process_max_fds") == 4 * NOFILE
    finally:
        process.terminate()
        process.wait(30)
