"""``kvroute serve`` drains on SIGTERM, as the Helm chart's termination sequence relies on.

Kubernetes removes a terminating pod from the Service, waits the chart's preStop drain, then
sends SIGTERM: the router must stop accepting connections but finish the responses it is
streaming, and exit 0. Tested on the real command in a subprocess.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import yaml

from loadtest.sim.fleet import SimFleet
from tests.helpers import FAST, admin_on_free_port, wait_for

MODEL = "sim-model"
#: Slow decode: the stream is still running when SIGTERM arrives.
SLOW_DECODE = FAST.__class__(decode_step_s=0.02)
TOKENS = 40


async def _start_router(tmp_path, fleet: SimFleet) -> tuple[asyncio.subprocess.Process, str]:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            admin_on_free_port(
                {
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "backends": [{"name": "e0", "url": fleet.urls[0]}],
                }
            )
        )
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config), stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 20)).decode()
    assert line.startswith("kvroute listening on "), line
    return process, line.split()[3]


async def test_sigterm_stops_listening_and_finishes_running_streams(tmp_path):
    async with SimFleet(1, timing=SLOW_DECODE) as fleet, aiohttp.ClientSession() as http:
        process, url = await _start_router(tmp_path, fleet)
        try:
            body = {"model": MODEL, "prompt": "drain me", "max_tokens": TOKENS, "stream": True}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                received = await resp.content.readany()
                assert received.startswith(b"data: ")
                process.send_signal(signal.SIGTERM)

                async def refuses_new_connections() -> bool:
                    try:
                        async with aiohttp.ClientSession() as fresh, fresh.get(f"{url}/health"):
                            return False
                    except aiohttp.ClientConnectionError:
                        return True

                await wait_for(
                    refuses_new_connections, what="the draining router to refuse new connections", timeout=5
                )
                received += await resp.content.read()
            assert resp.status == 200
            assert received.count(b'"text"') == TOKENS
            assert received.rstrip().endswith(b"data: [DONE]")
            assert await asyncio.wait_for(process.wait(), 20) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
