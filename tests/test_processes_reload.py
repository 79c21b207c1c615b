"""``kvroute serve --workers 2``: SIGHUP to the parent and ``POST /admin/reload`` reach every worker.

Workers share the port (SO_REUSEPORT), so which one answers depends on the connection: the
test opens a fresh connection per request and reads ``GET /admin/config``, whose ``pid``
names the worker, until every worker has shown the expected config (bounded by a deadline).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.helpers import backends_of, free_port_pair, kvroute, wait_for
from tests.redis_servers import redis_server

WORKERS = 2
ADMIN = {"Authorization": "Bearer admin-workers-key"}


def write(path: Path, port: int, backends: list[dict], redis_url: str, max_attempts: int) -> None:
    """The config of a router on ``port`` whose admin API listens on ``port + 1`` (every worker binds it)."""
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": backends,
        "index": {"store": "redis", "redis": {"url": redis_url}},
        "admin": {"key": "admin-workers-key", "listen": {"host": "127.0.0.1", "port": port + 1}},
        "upstream": {"max_attempts": max_attempts},
    }
    path.write_text(yaml.safe_dump(config))


async def worker_configs(url: str) -> dict[int, dict[str, Any]]:
    """One ``/admin/config`` per fresh connection: ``{pid: config}`` of whichever worker answered."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/admin/config", headers=ADMIN) as resp:
        assert resp.status == 200
        body = await resp.json()
    return {body["pid"]: body["config"]}


async def every_worker_shows(url: str, max_attempts: int, log: Path, timeout: float = 30.0) -> set[int]:
    """Poll until ``WORKERS`` distinct workers each answered with ``max_attempts``; their pids.
    ``log``: the router's, shown if they do not."""
    latest: dict[int, int] = {}

    def seen() -> str:
        tail = log.read_text()[-3000:] if log.exists() else "(no log)"
        return f"max_attempts by worker pid: {latest}; the router's log ends:\n{tail}"

    async def every_worker_answered() -> bool:
        try:
            for pid, config in (await worker_configs(url)).items():
                latest[pid] = config["upstream"]["max_attempts"]
        except aiohttp.ClientConnectionError:
            pass  # workers still starting
        return len(latest) == WORKERS and all(value == max_attempts for value in latest.values())

    await wait_for(
        every_worker_answered,
        what=f"all {WORKERS} workers to show max_attempts={max_attempts}",
        timeout=timeout,
        detail=seen,
    )
    return set(latest)


async def test_sighup_and_admin_reload_reach_every_worker(tmp_path, fleet):
    with redis_server() as server:
        port = free_port_pair()
        url = f"http://127.0.0.1:{port + 1}"  # the admin listener
        config = tmp_path / "c.yaml"
        log = tmp_path / "log"
        write(config, port, backends_of(fleet), server.url, max_attempts=1)
        process = kvroute("serve", "--config", str(config), "--workers", str(WORKERS), log=log)
        try:
            pids = await every_worker_shows(url, 1, log)

            # SIGHUP to the parent: every worker re-reads the file.
            write(config, port, backends_of(fleet), server.url, max_attempts=2)
            process.send_signal(signal.SIGHUP)
            assert await every_worker_shows(url, 2, log) == pids

            # POST /admin/reload lands on one worker; the others follow through the parent.
            write(config, port, backends_of(fleet), server.url, max_attempts=3)
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{url}/admin/reload", headers=ADMIN) as resp,
            ):
                assert resp.status == 200
                assert "upstream" in (await resp.json())["changed"]
            assert await every_worker_shows(url, 3, log) == pids
            # Each worker applied each file once: the one that answered did not reload twice.
            assert log.read_text().count("config reloaded from") == 2 * WORKERS
            assert process.poll() is None
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait, 40)
        assert process.returncode == 0


async def test_a_reload_asked_while_workers_start_waits_for_them(tmp_path, fleet):
    """SIGHUP as soon as the supervisor has started its workers, while they are still importing:
    the reload waits for each worker's handler instead of killing the worker (and the router)."""
    with redis_server() as server:
        port = free_port_pair()
        url = f"http://127.0.0.1:{port + 1}"  # the admin listener
        config = tmp_path / "c.yaml"
        log = tmp_path / "log"
        write(config, port, backends_of(fleet), server.url, max_attempts=1)
        process = kvroute("serve", "--config", str(config), "--workers", str(WORKERS), log=log)

        def workers_started() -> bool:
            assert process.poll() is None, "the supervisor exited"
            return f"with {WORKERS} workers" in (log.read_text() if log.exists() else "")

        try:
            await wait_for(
                workers_started, what=f"the supervisor to start {WORKERS} workers", timeout=30, interval=0.005
            )
            write(config, port, backends_of(fleet), server.url, max_attempts=2)
            process.send_signal(signal.SIGHUP)
            await every_worker_shows(url, 2, log)
            assert process.poll() is None
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait, 40)
        assert process.returncode == 0
