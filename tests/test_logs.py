"""The router's logs as an operator reads them: ``kvroute serve`` in its own process, its stderr.

Every line about a request carries its id; the access log writes one line per request with its
fields (JSON keys of their own with ``logging.format: json``); probes are not access-logged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from loadtest.ports import free_port
from loadtest.sim.engine import SimEngine
from tests.helpers import FAST, wait_for

MODEL = "sim-model"
DOCUMENT = "A long shared system prompt for the access log test. " * 20


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    started = SimEngine(FAST, name="only")
    await started.start()
    yield started
    await started.stop()


@pytest.fixture
async def serve(tmp_path: Path, engine: SimEngine) -> AsyncIterator[Callable[..., Any]]:
    """Start ``kvroute serve`` with extra config sections; yields (url, stop) where stop() ends it
    and returns its stderr lines."""
    procs: list[subprocess.Popen[bytes]] = []

    async def start(**sections: Any) -> tuple[str, Callable[[], list[str]]]:
        port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": [{"name": "e0", "url": engine.url}],
            **sections,
        }
        path = tmp_path / "kvroute.yaml"
        path.write_text(yaml.safe_dump(config))
        log = tmp_path / "stderr.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)],
                stdout=subprocess.DEVNULL,
                stderr=out,
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"

        async def ready() -> bool:
            try:
                async with aiohttp.ClientSession() as http, http.get(f"{url}/ready") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await wait_for(ready, what="kvroute serve to be ready", timeout=30.0, interval=0.1)

        def stop() -> list[str]:
            proc.terminate()
            proc.wait(timeout=30)
            return log.read_text().splitlines()

        return url, stop

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def requests_with_ids(url: str) -> tuple[str, str, str]:
    """A chat, a completion, a second completion with the same prefix, and a refused request;
    the ids of the last three."""
    ids = []
    async with aiohttp.ClientSession() as http:
        chat = {"model": MODEL, "messages": [{"role": "system", "content": DOCUMENT}], "max_tokens": 2}
        async with http.post(f"{url}/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200
        for i, headers in enumerate([{"X-Request-Id": "first-1"}, {}]):
            body = {"model": MODEL, "prompt": DOCUMENT + str(i), "max_tokens": 2}
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                ids.append(resp.headers["X-Request-Id"])
        async with http.post(f"{url}/v1/embeddings", json={"model": "missing", "input": "x"}) as resp:
            assert resp.status == 404
            ids.append(resp.headers["X-Request-Id"])
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 200
    return ids[0], ids[1], ids[2]


async def test_json_logs_carry_the_request_id_and_one_access_line_per_request(serve):
    url, stop = await serve(log_level="debug", logging={"format": "json", "access_log": True})
    first_id, completion_id, refused_id = await requests_with_ids(url)
    assert first_id == "first-1"
    records = [json.loads(line) for line in stop()]  # every line is one JSON object
    access = {r["request_id"]: r for r in records if r["logger"] == "kvroute.access"}
    assert len(access) == 4  # one per request, none for the probes
    first = access[first_id]
    assert first["endpoint"] == "completions" and first["model"] == MODEL and first["backend"] == "e0"
    assert first["status"] == 200 and first["tenant"] == "default" and first["attempts"] == 1
    assert first["reason"] == "latency_no_match"
    assert first["prompt_tokens"] > 0 and first["cached_tokens"] == 0
    assert first["duration_ms"] > 0 and first["ttft_ms"] is None  # not streamed: no first byte before the end
    completion = access[completion_id]
    # The engine reported the shared prefix cached, where the router predicted a match.
    assert completion["reason"] == "latency_hit"
    assert completion["cached_tokens"] > 0 and completion["matched_tokens"] > 0
    refused = access[refused_id]
    assert (refused["status"], refused["endpoint"], refused["model"], refused["backend"]) == (
        404,
        "embeddings",
        "missing",
        None,
    )
    # Lines written while a request is handled carry its id: the dispatcher's debug line here.
    routed = [r for r in records if r["logger"] == "kvroute.dispatch" and r["msg"].startswith("route ")]
    assert {first_id, completion_id} <= {r["request_id"] for r in routed}
    assert len(routed) == 3
    # Lines outside requests have none.
    assert any("request_id" not in r for r in records if r["logger"] != "kvroute.access")


async def test_text_logs_tag_lines_with_the_id_and_write_logfmt_access_lines(serve):
    url, stop = await serve(logging={"format": "text", "access_log": True})
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "input": "hello"}
        async with http.post(f"{url}/v1/embeddings", json=body, headers={"X-Request-Id": "emb-7"}) as resp:
            assert resp.status == 200
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "stream"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.post(
            f"{url}/v1/chat/completions", json=chat, headers={"X-Request-Id": "str-8"}
        ) as resp:
            assert resp.status == 200
            await resp.read()
    lines = {line.split("[", 1)[1].split("]", 1)[0]: line for line in stop() if "kvroute.access" in line}
    assert set(lines) == {"emb-7", "str-8"}
    embedded = lines["emb-7"]
    assert (
        "kvroute.access [emb-7]: tenant=default endpoint=embeddings model=sim-model backend=e0 " in embedded
    )
    assert " reason=latency_no_match status=200 attempts=1 " in embedded
    assert " ttft_ms=- " in embedded and " cached_tokens=0 " in embedded
    streamed = lines["str-8"]
    assert " endpoint=chat " in streamed and " cached_tokens=0 " in streamed
    ttft = float(streamed.split(" ttft_ms=", 1)[1].split()[0])
    duration = float(streamed.split(" duration_ms=", 1)[1].split()[0])
    assert 0 < ttft <= duration


async def test_the_access_log_is_off_by_default(serve):
    url, stop = await serve()
    await requests_with_ids(url)
    assert not [line for line in stop() if "kvroute.access" in line]
