"""``kvroute serve --workers N``: several processes on one port, sharing Redis; and the refusals."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from loadtest.ports import free_port
from router.config import config_from_dict
from router.http.processes import refusal
from tests.helpers import (
    assert_every_connection_hits,
    backends_of,
    kvroute,
    scrape,
    total,
    wait_for,
    write_workers_config,
)
from tests.redis_servers import redis_server

MODEL = "sim-model"


def test_workers_refuse_what_they_cannot_serve():
    def config(**sections):
        backends = [{"name": "a", "url": "http://127.0.0.1:1"}]
        return config_from_dict({"backends": backends, **sections})

    redis = {"store": "redis", "redis": {"url": "redis://127.0.0.1:1/0"}}
    listen = {"host": "127.0.0.1", "port": 8080}
    assert refusal(config(listen=listen), 1) is None
    assert refusal(config(listen=listen, index=redis), 4) is None
    # The memory store too: its workers share over Unix sockets (tests/test_worker_sync.py).
    assert refusal(config(listen=listen), 4) is None
    assert "fixed listen.port" in refusal(config(listen={"port": 0}, index=redis), 4)
    assert "fixed metrics.listen port" in refusal(
        config(listen=listen, index=redis, metrics={"listen": {"port": 0}}), 4
    )
    assert refusal(config(listen=listen, index=redis, metrics={"listen": {"port": 9091}}), 4) is None
    # Every worker binds the admin listener too (SO_REUSEPORT): it needs a fixed port as well.
    assert refusal(config(listen=listen, index=redis, admin={"listen": {"port": 9090}}), 4) is None
    assert "fixed admin.listen.port" in refusal(
        config(listen=listen, index=redis, admin={"listen": {"port": 0}}), 4
    )
    assert "positive" in refusal(config(listen=listen), 0)


@pytest.mark.parametrize("lookup", ["shared", "local"])
async def test_workers_share_one_port_and_redis(tmp_path, fleet, lookup):
    with redis_server() as server:
        port = free_port()
        index = {"store": "redis", "redis": {"url": server.url, "load_interval_s": 0.05, "lookup": lookup}}
        config = write_workers_config(tmp_path / "c.yaml", port, backends_of(fleet), index)
        log = tmp_path / "kvroute.log"
        process = kvroute("serve", "--config", str(config), "--workers", "2", log=log)
        try:
            replicas = server.client()

            async def both_workers_publish() -> bool:
                return replicas.zcard("{kvroute}:replicas") == 2

            await wait_for(both_workers_publish, what="both workers to publish their replica", timeout=30)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 200}], "max_tokens": 2}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"

            async def post() -> aiohttp.ClientResponse:
                # A new connection each time: the kernel spreads connections, not requests.
                async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
                    await resp.read()
                    return resp

            first = await post()
            assert first.status == 200
            backend = first.headers["x-kvroute-backend"]

            async def recorded() -> bool:
                if lookup == "shared":
                    return replicas.zcard(f"{{kvroute}}:blocks:{backend}") > 0
                # Each worker's own copy: the other one has taken the first one's belief.
                async with aiohttp.ClientSession() as http:
                    samples = await scrape(http, f"http://127.0.0.1:{port}")
                return total(samples, "kvroute_index_peer_updates_total") >= 1

            await wait_for(recorded, what=f"blocks of {backend} shared through Redis ({lookup})")
            # Whichever worker takes the connection finds the prefix in the shared index.
            await assert_every_connection_hits(post, backend)

            # SIGHUP reaches every worker: each re-reads the file (here refusing a broken one).
            config.write_text("listen: [not, a, mapping]\n")
            process.send_signal(signal.SIGHUP)

            async def both_refused() -> bool:
                return log.read_text().count("config reload from") == 2

            await wait_for(both_refused, what="both workers to refuse the reload", timeout=10)
            assert process.poll() is None
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait, 40)
        assert process.returncode == 0
        # Both workers stopped cleanly: they withdrew their load entries.
        assert server.client().zcard("{kvroute}:replicas") == 0
