"""A real ``kvroute serve`` process: SIGTERM drains up to ``listen.drain_timeout_s`` then exits,
and SIGHUP reloads the config file (an invalid one is refused in the log, the router serves on).

tests/test_shutdown_drain.py shows a stream that ends within the deadline finishing whole; here
a stream that never ends is cut at the deadline, the engine sees its request cancelled, and
the process exits 0 anyway.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.soak import start_router
from tests.fault_engine import MODEL, backends, start_engines
from tests.helpers import admin_on_free_port, wait_for

DRAIN_S = 1.0


async def log_line(process: asyncio.subprocess.Process, containing: str) -> str:
    """The process's next log line containing ``containing`` (others are skipped)."""
    assert process.stderr is not None
    while True:
        line = (await asyncio.wait_for(process.stderr.readline(), 10)).decode()
        assert line, "the process closed its log"
        if containing in line:
            return line


def write(path: Path, config: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(admin_on_free_port(config)))


async def test_sigterm_cuts_streams_at_the_drain_deadline_and_exits(tmp_path):
    (engine,) = await start_engines("stall_mid_stream")
    config = tmp_path / "kvroute.yaml"
    write(config, {"listen": {"port": 0, "drain_timeout_s": DRAIN_S}, "backends": backends([engine])})
    process, url = await start_router(config, stderr=asyncio.subprocess.PIPE)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "never ends", "max_tokens": 3, "stream": True}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert (await resp.content.readany()).startswith(b"data: ")
                signalled = time.monotonic()
                process.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(process.wait(), 20) == 0
                exited_after = time.monotonic() - signalled
                try:
                    rest = await resp.content.read()
                except aiohttp.ClientPayloadError:
                    rest = b""
            assert b"[DONE]" not in rest
        # The drain waited for the stream (not an immediate exit), and no longer than its deadline
        # plus the process's own start-up-sized overheads.
        assert DRAIN_S * 0.9 <= exited_after < DRAIN_S + 10

        async def upstream_cancelled() -> bool:
            return engine.open == 0

        await wait_for(upstream_cancelled, what="the engine's connection closed")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        engine.release.set()
        await engine.stop()


async def test_sighup_reloads_and_refuses_an_invalid_file(tmp_path):
    (engine,) = await start_engines("ok")
    config_path = tmp_path / "kvroute.yaml"
    config = {"listen": {"port": 0}, "backends": backends([engine]), "routing": {"policy": "round_robin"}}
    write(config_path, config)
    process, url = await start_router(config_path, stderr=asyncio.subprocess.PIPE)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    try:
        async with aiohttp.ClientSession() as http:

            async def reason() -> str:
                async with http.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return resp.headers["x-kvroute-reason"]

            assert await reason() == "round_robin"
            config_path.write_text("routing: [not, a, mapping\n")
            process.send_signal(signal.SIGHUP)
            refused = await log_line(process, "config reload")
            assert "refused, keeping the running config" in refused and "not valid YAML" in refused
            assert await reason() == "round_robin"

            write(config_path, {**config, "routing": {"policy": "least_load"}})
            process.send_signal(signal.SIGHUP)

            async def reloaded() -> bool:
                return await reason() == "least_load"

            await wait_for(reloaded, what="the reloaded policy least_load", timeout=10)
    finally:
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 20) == 0
        await engine.stop()
