"""Metrics by Prometheus' conventions, checked on real scrapes: promtool, names, state labels,
``metrics.listen``, and ``serve --workers N`` reporting the whole process group."""

from __future__ import annotations

import asyncio
import resource
import signal
import subprocess

import aiohttp
import yaml

from loadtest.ports import free_port
from loadtest.programs import require
from router.config import config_from_dict
from router.http.server import RouterServer
from router.http.worker_metrics import WorkerGroup
from router.metrics import CIRCUIT_STATES
from tests.helpers import admin_on_free_port, backends_of, kvroute, scrape, total, wait_for
from tests.redis_servers import redis_server

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 2}


def promtool_problems(text: str) -> str:
    """What ``promtool check metrics`` says of an exposition (empty when it is clean)."""
    checked = subprocess.run(
        [require("promtool"), "check", "metrics"],
        input=text.encode(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    return (checked.stdout + checked.stderr).decode() + ("" if checked.returncode == 0 else " (failed)")


async def metrics_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200, await resp.text()
        return await resp.text()


async def test_a_real_scrape_passes_promtool_and_follows_the_conventions(fleet, make_router, http):
    with redis_server() as redis:
        router = await make_router(backends_of(fleet), index={"store": "redis", "redis": {"url": redis.url}})
        for _ in range(3):
            async with http.post(f"{router.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
                assert resp.status == 200
                await resp.read()
        async with http.post(f"{router.url}/v1/chat/completions", json={"model": MODEL}) as resp:
            assert resp.status == 400
        text = await metrics_text(http, router.url)
        samples = await scrape(http, router.url)

    assert promtool_problems(text) == ""
    assert "_created" not in text
    assert "kvroute_process_" not in text
    assert total(samples, "process_cpu_seconds_total") > 0
    assert total(samples, "process_resident_memory_bytes") > 0
    for backend in ("e0", "e1", "e2"):
        states = {
            s: total(samples, "kvroute_backend_circuit_state", backend=backend, state=s)
            for s in CIRCUIT_STATES
        }
        assert states == {"closed": 1, "half_open": 0, "open": 0}
        assert ("kvroute_backend_kv_usage_ratio", (("backend", backend),)) in samples
    assert total(samples, "kvroute_request_duration_seconds_count", model=MODEL) == 3
    assert total(samples, "kvroute_ttft_seconds_count", model=MODEL) == 3


async def test_metrics_listen_moves_metrics_to_a_port_of_their_own(fleet, make_router, http):
    router = await make_router(backends_of(fleet), metrics={"listen": {"host": "127.0.0.1", "port": 0}})
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert router.metrics_port not in (None, router.port)
    async with http.get(f"{router.url}/metrics") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"
    samples = await scrape(http, router.metrics_url)
    assert total(samples, "kvroute_requests_total", status="200") == 1


async def test_every_scrape_of_several_workers_reports_the_whole_group(tmp_path, fleet):
    requests = 12
    with redis_server() as redis:
        port, metrics_port = free_port(), free_port()
        config = tmp_path / "c.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "listen": {"host": "127.0.0.1", "port": port},
                    "metrics": {"listen": {"host": "127.0.0.1", "port": metrics_port}},
                    "admin": {"listen": {"host": "127.0.0.1", "port": free_port()}},
                    "backends": backends_of(fleet),
                    "index": {"store": "redis", "redis": {"url": redis.url}},
                }
            )
        )
        process = kvroute("serve", "--config", str(config), "--workers", "2", log=tmp_path / "kvroute.log")
        try:
            replicas = redis.client()
            await wait_for(
                lambda: replicas.zcard("{kvroute}:replicas") == 2, what="both workers up", timeout=30
            )
            for i in range(requests):
                # A new connection each time: the kernel spreads connections, not requests.
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(
                        f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "user": str(i)}
                    ) as resp,
                ):
                    assert resp.status == 200
            soft_fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            metrics_url = f"http://127.0.0.1:{metrics_port}"
            for _ in range(6):
                async with aiohttp.ClientSession() as http:
                    text = await metrics_text(http, metrics_url)
                    samples = await scrape(http, metrics_url)
                assert total(samples, "kvroute_requests_total", status="200") == requests
                assert total(samples, "kvroute_request_duration_seconds_count") == requests
                # Each worker's limit, summed: both workers are in the answer.
                assert total(samples, "process_max_fds") == 2 * soft_fd_limit
                assert total(samples, "kvroute_backend_in_flight") == 0
            assert promtool_problems(text) == ""
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait, 40)
        assert process.returncode == 0


async def test_each_worker_answers_for_the_group_counters_summed_gauges_by_their_meaning(
    tmp_path, fleet, http
):
    """Two workers of one group, in this process, each sent its own requests: a scrape of
    either reports both, counters summed, in-flight summed, health as the maximum (1, not 2),
    and the earliest start time."""
    config = config_from_dict(
        admin_on_free_port({"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends_of(fleet)})
    )
    async with (
        RouterServer(config, group=WorkerGroup(str(tmp_path), 0, 2)) as first,
        RouterServer(config, group=WorkerGroup(str(tmp_path), 1, 2)) as second,
    ):
        for router, count in ((first, 3), (second, 2)):
            for _ in range(count):
                async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200
        alone = await scrape(http, first.url)
        for router in (first, second):
            samples = await scrape(http, router.url)
            assert total(samples, "kvroute_requests_total", status="200") == 5
            assert total(samples, "kvroute_backend_healthy", backend="e0") == 1
            assert total(samples, "kvroute_backend_in_flight") == 0
            assert total(samples, "process_start_time_seconds") <= total(alone, "process_start_time_seconds")
            assert promtool_problems(await metrics_text(http, router.url)) == ""


async def test_a_worker_that_does_not_answer_fails_the_scrape_rather_than_report_part(tmp_path, fleet, http):
    config = config_from_dict(
        admin_on_free_port({"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends_of(fleet)})
    )
    async with RouterServer(config, group=WorkerGroup(str(tmp_path), 0, 2)) as lonely:
        async with http.get(f"{lonely.url}/metrics") as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
        assert error["code"] == "metrics_unavailable"
        assert error["message"].startswith("worker 1 did not report its metrics:")
        # The router itself is fine: only its metrics are incomplete.
        async with http.post(f"{lonely.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
