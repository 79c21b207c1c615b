"""The router overhead benchmark's tooling: null backend, load generator, contenders, command.

Functional checks only (the benchmark's numbers are never asserted): responses are parsed
right however they are split, streams are counted, connections are reused, the contenders'
configs are what docs/benchmarks say, and one tiny run of the command ends with its tables.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from aiohttp import web

from loadtest import contenders as procs
from loadtest.httpload import Client, build_request
from loadtest.null_backend import STREAM_CHUNKS, serve
from loadtest.overhead import request_bodies, top_functions
from router.config import load_config
from router.redis.settings import RedisConfig

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
async def null_port():
    (server,) = await serve("127.0.0.1", [0])
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


def chat(port: int, stream: bool) -> bytes:
    return build_request(f"127.0.0.1:{port}", "/v1/chat/completions", request_bodies(stream, 1)[0])


async def test_null_backend_answers_json_and_fifty_chunk_streams_on_one_connection(null_port):
    client = Client("127.0.0.1", null_port)
    plain = await client.request(chat(null_port, False))
    stream = await client.request(chat(null_port, True))
    again = await client.request(chat(null_port, False))
    missing = await client.request(build_request(f"127.0.0.1:{null_port}", "/nope", b"{}"))
    client.close()
    assert (plain.ok, plain.status, plain.events) == (True, 200, 0)
    assert (stream.ok, stream.events) == (True, STREAM_CHUNKS + 1)  # the chunks and data: [DONE]
    assert 0 < stream.first_byte <= stream.latency
    assert again.ok and client.connections == 1  # keep-alive: one connection for all three
    assert (missing.ok, missing.status) == (False, 404)


async def test_a_paced_null_backend_sends_a_streams_chunks_an_interval_apart():
    (server,) = await serve("127.0.0.1", [0], token_interval_s=0.004)
    port = server.sockets[0].getsockname()[1]
    client = Client("127.0.0.1", port)
    stream = await client.request(chat(port, True))
    client.close()
    server.close()
    await server.wait_closed()
    assert (stream.ok, stream.events) == (True, STREAM_CHUNKS + 1)
    # 50 pauses of 4 ms at the least (an event loop's timer may only run late).
    assert stream.latency - stream.first_byte >= (STREAM_CHUNKS - 1) * 0.004


async def test_load_generator_parses_responses_split_anywhere():
    """A server that sends a chunked SSE response and a Content-Length one a few bytes at a time."""
    events = b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    chunked = b"".join(
        b"%x\r\n%s\r\n" % (len(events[i : i + 7]), events[i : i + 7]) for i in range(0, len(events), 7)
    )
    responses = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(events), events),
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            for i in range(0, len(response), 3):
                writer.write(response[i : i + 3])
                await writer.drain()
                await asyncio.sleep(0)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Client("127.0.0.1", port)
    samples = [await client.request(build_request(f"127.0.0.1:{port}", "/", b"{}")) for _ in responses]
    client.close()
    server.close()
    assert [(s.ok, s.events) for s in samples] == [(True, 3), (True, 3)]


async def test_fixed_rate_and_saturation_count_what_they_sent(null_port):
    client = Client("127.0.0.1", null_port)
    samples = await client.fixed_rate([chat(null_port, False)], rate=500, count=20)
    throughput = await client.saturate([chat(null_port, True)], concurrency=4, seconds=0.2, warmup=0.05)
    client.close()
    assert len(samples) == 20 and all(s.ok for s in samples)
    assert throughput.errors == 0 and throughput.requests > 0
    assert throughput.all_requests >= throughput.requests
    assert throughput.events == throughput.requests * (STREAM_CHUNKS + 1)


def test_contender_configs(tmp_path):
    backends = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    kv = procs.kvroute(tmp_path, backends, cpus="1")
    assert kv.command[:3] == ["taskset", "-c", "1"]
    config = load_config(kv.command[kv.command.index("--config") + 1])
    assert config.routing.policy == "prefix_aware" and [b.url for b in config.backends] == backends
    assert config.listen.port == kv.port
    nginx = procs.nginx(tmp_path, backends, cpus=None)
    if nginx.missing is None:
        conf = (tmp_path / "nginx.conf").read_text()
        for directive in ("worker_processes 1;", "least_conn;", "keepalive 256;", "proxy_buffering off;"):
            assert directive in conf
        assert "server 127.0.0.1:9001;" in conf and "server 127.0.0.1:9002;" in conf
    assert procs.pinned(["x"], None) == ["x"]


def test_the_access_log_contender_logs_each_request(tmp_path):
    logged = procs.kvroute(tmp_path, ["http://127.0.0.1:9001"], cpus=None, access_log=True)
    assert logged.name == "kvroute access-log"
    config = load_config(logged.command[logged.command.index("--config") + 1])
    assert config.logging.access_log and config.log_level == "info"
    plain = procs.kvroute(tmp_path, ["http://127.0.0.1:9001"], cpus=None)
    assert not load_config(plain.command[plain.command.index("--config") + 1]).logging.access_log


def test_profile_summary_merges_lines_of_a_function():
    collapsed = "\n".join(
        [
            "main (app.py:1);handle (app.py:10);parse (req.py:5) 30",
            "main (app.py:1);handle (app.py:12);parse (req.py:7) 10",
            "main (app.py:1);handle (app.py:14) 60",
        ]
    )
    samples, own, total = top_functions(collapsed)
    assert samples == 100
    assert own == [("handle (app.py)", 60), ("parse (req.py)", 40)]
    assert dict(total) == {"main (app.py)": 100, "handle (app.py)": 100, "parse (req.py)": 40}


def test_a_baseline_runs_the_kvroute_of_its_own_tree(tmp_path):
    before_the_move = tmp_path / "before"
    (before_the_move / "router").mkdir(parents=True)
    (before_the_move / "router" / "cli.py").write_text("")
    old = procs.kvroute(tmp_path, ["http://127.0.0.1:9001"], cpus=None, checkout=before_the_move)
    assert old.name == "kvroute baseline"
    assert old.command[1:3] == ["-m", "router.cli"]
    assert old.env == {"PYTHONPATH": str(before_the_move.resolve())}
    this_tree = procs.kvroute(tmp_path, ["http://127.0.0.1:9001"], cpus=None, checkout=REPO)
    assert this_tree.command[1:3] == ["-m", "kvroute.cli"]


async def test_overhead_command_runs_end_to_end(tmp_path):
    """The smallest real run: direct, kvroute, this tree again as the baseline, and the floor
    (nginx/SGLang need not be installed here)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest.overhead", "--only", "kvroute,floor", "--rounds", "1", "--rate", "50",
        "--baseline", str(REPO),
        "--seconds", "0.2", "--saturation-seconds", "0.2", "--concurrency", "4",
        "--proxy-cpu", "", "--harness-cpu", "", "--report", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), timeout=90)
    text = output.decode()
    assert process.returncode == 0, text
    rows = [
        line.split()[0] for line in text.splitlines() if line.startswith(("direct ", "kvroute ", "floor "))
    ]
    assert rows == ["direct", "kvroute", "kvroute", "floor"] * 2  # the latency and the saturation tables
    assert text.count("\nkvroute baseline ") == 2
    report = (tmp_path / "report.md").read_text()
    assert "## Latency (ms)" in report and "| kvroute |" in report


async def test_overhead_measures_workers_with_each_index_store(tmp_path):
    """``--workers 2``: workers with the memory store (sharing over Unix sockets), and two
    contenders sharing a private Redis, one per ``index.redis.lookup``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest.overhead", "--only", "kvroute", "--rounds", "1", "--rate", "50",
        "--workers", "2", "--seconds", "0.2", "--saturation-seconds", "0.2", "--concurrency", "4",
        "--proxy-cpu", "", "--harness-cpu", "",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), timeout=90)
    text = output.decode()
    assert process.returncode == 0, text
    for store in ("memory", "lookup local", "lookup shared"):
        rows = [line for line in text.splitlines() if line.startswith(f"kvroute x2 {store} ")]
        assert len(rows) == 3, text  # the latency, saturation and workers tables
        assert "not run" not in rows[0], text
        # The workers table: the measured ratio and the projection to two cores of their own.
        _, rate, measured, cpu, projected = rows[2].rsplit(maxsplit=4)
        assert int(rate) > 0 and int(cpu) > 0, rows[2]
        assert measured.endswith("x") and float(projected.rstrip("x")) > 0, rows[2]


async def test_router_never_replays_a_backends_cookies_to_other_clients(make_router):
    """The upstream session keeps no cookie jar: Set-Cookie goes to its client and nowhere else."""
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = web.json_response({"choices": [], "usage": {"prompt_tokens": 1}})
        response.set_cookie("session", "secret-of-client-1")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        # A host name, not an IP: aiohttp's default jar would keep this backend's cookies.
        router = await make_router([{"name": "b", "url": f"http://localhost:{port}", "models": ["m"]}])
        client = Client("127.0.0.1", router.port)
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        first = await client.request(build_request(f"127.0.0.1:{router.port}", "/v1/chat/completions", body))
        second = await client.request(build_request(f"127.0.0.1:{router.port}", "/v1/chat/completions", body))
        client.close()
    finally:
        await runner.cleanup()
    assert first.ok and second.ok
    assert seen == [None, None]


def test_the_workers_contender_sets_the_sync_interval_only_when_asked(tmp_path):
    backends = ["http://127.0.0.1:9001"]
    url = "redis://127.0.0.1:6390"
    asked = procs.kvroute(
        tmp_path, backends, None, workers=2, redis_url=url, redis_lookup="local", sync_interval_ms=20
    )
    default = procs.kvroute(tmp_path, backends, None, workers=2, redis_url=url, redis_lookup="local")
    configs = [load_config(c.command[c.command.index("--config") + 1]) for c in (asked, default)]
    assert [c.index.redis.lookup for c in configs] == ["local", "local"]
    assert configs[0].index.redis.sync_interval_ms == 20
    assert configs[1].index.redis.sync_interval_ms == RedisConfig().sync_interval_ms
