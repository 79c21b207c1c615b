"""Engines and clients misbehaving, through real sockets: each case ends in a correct answer or a
clear error, with nothing left behind (in-flight counts at zero, no upstream request open).

Covered elsewhere, and not repeated here: an engine that hangs, answers 5xx, or dies or stalls
mid-stream (tests/test_failover_upstream.py); a client leaving before the first byte or
mid-stream (tests/test_router_http.py); Redis down, slow and restarted (tests/test_redis_*.py,
tests/test_faults_redis.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from router.request_path.proxy import DEFAULT_HIGH_WATER, _ClientSink
from tests.fault_engine import MODEL, FaultEngine, backends
from tests.helpers import scrape, total, wait_for, wait_released

#: The fast stream a slow client reads: far more than any socket buffer on the way can hold.
FIREHOSE_CHUNK = 64 * 1024
FIREHOSE_CHUNKS = 1024  # 64 MiB
SSE_EVENTS = [f'data: {{"choices": [{{"index": 0, "text": " t{i}"}}]}}\n\n'.encode() for i in range(4)]


class MisbehavingEngine(FaultEngine):
    """The fault engine with more ways to go wrong (modes below); other modes as FaultEngine."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        #: Bytes the firehose has handed to its socket so far (its writes wait when buffers are full).
        self.sent = 0

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        mode = self.mode
        if mode not in ("rate_limited", "malformed_json", "sse_no_done", "byte_by_byte", "firehose"):
            return await super()._generate(request)
        await request.read()
        self.received += 1
        self.open += 1
        try:
            if mode == "rate_limited":
                error = {"error": {"message": "slow down", "type": "rate_limit_error", "code": 429}}
                return web.json_response(error, status=429, headers={"Retry-After": "7"})
            if mode == "malformed_json":
                return web.Response(
                    body=b'{"id": "x", "choices": [{"text": "cut', content_type="application/json"
                )
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if mode == "sse_no_done":
                for event in SSE_EVENTS:
                    await response.write(event)
            elif mode == "byte_by_byte":
                for byte in b"".join(SSE_EVENTS) + b"data: [DONE]\n\n":
                    await response.write(bytes([byte]))
                    await asyncio.sleep(0.001)
            else:
                chunk = b"data: " + b"x" * (FIREHOSE_CHUNK - 8) + b"\n\n"
                for _ in range(FIREHOSE_CHUNKS):
                    await response.write(chunk)
                    self.sent += len(chunk)
            await response.write_eof()
            return response
        finally:
            self.open -= 1


@pytest.fixture
async def engine():
    started = MisbehavingEngine("f0")
    await started.start()
    yield started
    started.release.set()
    await started.stop()


async def assert_released(http: aiohttp.ClientSession, url: str, engine: FaultEngine) -> None:
    await wait_released(http, url)

    async def upstream_closed() -> bool:
        return engine.open == 0

    await wait_for(upstream_closed, what="the engine to see its connection closed")


async def post(http: aiohttp.ClientSession, url: str, stream: bool = False, **headers: str):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        return resp.status, resp.headers, await resp.read()


async def test_engine_429_passes_through_with_retry_after_and_does_not_eject(engine, make_router, http):
    engine.mode = "rate_limited"
    router = await make_router(backends([engine]), health={"eject_after": 2})
    for _ in range(4):
        status, headers, body = await post(http, router.url)
        assert status == 429
        assert headers["Retry-After"] == "7"
        assert json.loads(body)["error"]["message"] == "slow down"
    assert engine.received == 4  # a 429 is the engine's answer to this request: not retried elsewhere
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        (backend,) = (await resp.json())["backends"]
    assert backend["routable"] and backend["circuit"] == "closed"
    await assert_released(http, router.url, engine)


@pytest.mark.parametrize("closed_loop", [False, True])
async def test_malformed_json_from_the_engine_passes_through_unchanged(
    engine, make_router, http, closed_loop
):
    """The router forwards bytes, it does not vouch for them; reading usage from them must not crash."""
    engine.mode = "malformed_json"
    router = await make_router(backends([engine]), index={"closed_loop": closed_loop})
    status, _, body = await post(http, router.url)
    assert (status, body) == (200, b'{"id": "x", "choices": [{"text": "cut')
    await assert_released(http, router.url, engine)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        pytest.param("sse_no_done", b"".join(SSE_EVENTS), id="sse-ended-without-done-passed-through-as-is"),
        pytest.param(
            "byte_by_byte", b"".join(SSE_EVENTS) + b"data: [DONE]\n\n", id="engine-answering-byte-by-byte"
        ),
    ],
)
async def test_an_odd_stream_reaches_the_client_unchanged(engine, make_router, http, mode, expected):
    engine.mode = mode
    router = await make_router(backends([engine]))
    status, _, body = await post(http, router.url, stream=True)
    assert (status, body) == (200, expected)
    await assert_released(http, router.url, engine)


async def raw_exchange(port: int, version: str, body: bytes) -> bytes:
    """Send one POST over a raw socket as HTTP/``version`` and read until the router closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    answer = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    return answer


def dechunk(body: bytes) -> bytes:
    """Decode a chunked transfer coding strictly: every size line, every CRLF, the last chunk."""
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", body
            return out
        assert body[size : size + 2] == b"\r\n", body[: size + 2]
        out, body = out + body[:size], body[size + 2 :]


@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_a_stream_is_framed_for_the_clients_http_version(engine, make_router, http, version):
    """Relayed byte by byte (each engine write its own read at the router): an HTTP/1.1 client
    gets each piece as a well-formed chunk and the last chunk at the end; an HTTP/1.0 client,
    which has no chunked coding, gets the bare bytes and the end of the connection."""
    engine.mode = "byte_by_byte"
    router = await make_router(backends([engine]))
    request = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    answer = await raw_exchange(router.port, version, request)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/{version} 200".encode()), head
    expected = b"".join(SSE_EVENTS) + b"data: [DONE]\n\n"
    if version == "1.1":
        assert b"transfer-encoding: chunked" in head.lower()
        assert dechunk(body) == expected
    else:
        assert b"transfer-encoding" not in head.lower()
        assert body == expected
    await assert_released(http, router.url, engine)


class _TransportWithoutLimits(asyncio.WriteTransport):
    """A transport shaped as asyncio's TLS transport before Python 3.10.3 (bpo-46487): it
    buffers and writes, but ``get_write_buffer_limits`` is the base class's NotImplementedError."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = b""

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.buffer += data

    def get_write_buffer_size(self) -> int:
        return len(self.buffer)


def test_a_client_transport_that_does_not_tell_its_limits_is_held_to_asyncios_default() -> None:
    """The relay to such a client frames and writes as to any other, and refuses more (so the
    proxy awaits the drain) once 64 KiB are buffered, as asyncio's socket transports do."""
    transport = _TransportWithoutLimits()
    request = SimpleNamespace(transport=transport)
    response = SimpleNamespace(headers={"Transfer-Encoding": "chunked"})
    sink = _ClientSink(request, response, None)  # type: ignore[arg-type]
    assert sink(b"data: 1\n\n") is True
    assert transport.buffer == b"9\r\ndata: 1\n\n\r\n"
    assert sink(b"x" * DEFAULT_HIGH_WATER) is False


async def test_a_slow_client_holds_back_the_engine_instead_of_filling_the_routers_memory(
    engine, make_router, http
):
    """Backpressure end to end: while the client reads nothing, the engine can only get as far as
    the socket buffers on the way let it, a fraction of the 64 MiB it wants to send; the router
    holds no more than its own small read buffer. Then the client reads everything, intact."""
    engine.mode = "firehose"
    router = await make_router(backends([engine]))
    total_bytes = FIREHOSE_CHUNK * FIREHOSE_CHUNKS
    request = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": True}).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(client, ("127.0.0.1", router.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(request)}\r\nConnection: close\r\n\r\n"
    ).encode()
    await loop.sock_sendall(client, head + request)
    try:
        last = -1

        async def engine_blocked() -> bool:
            nonlocal last
            sent, last = last, engine.sent
            await asyncio.sleep(0.2)
            return sent == engine.sent and engine.sent > 0

        await wait_for(
            engine_blocked, what="the engine to stop sending (blocked by the slow client)", timeout=15
        )
        assert engine.sent < total_bytes // 2, engine.sent
        head_and_start = b""
        while b"\r\n\r\n" not in head_and_start:
            head_and_start += await loop.sock_recv(client, 4096)
        received = head_and_start.split(b"\r\n\r\n", 1)[1].count(b"x")
        while data := await loop.sock_recv(client, 1 << 20):
            received += data.count(b"x")
    finally:
        client.close()
    assert received == FIREHOSE_CHUNKS * (FIREHOSE_CHUNK - 8)
    await assert_released(http, router.url, engine)


async def test_oversized_headers_are_refused_and_the_limit_is_configurable(engine, make_router, http, caplog):
    router = await make_router(backends([engine]))
    big = "v" * 10_000
    status, _, _ = await post(http, router.url, **{"X-Big": big})
    assert status == 431
    many = {f"X-H{i}": "1" for i in range(200)}
    status, _, _ = await post(http, router.url, **many)
    assert status == 431
    assert (await post(http, router.url))[0] == 200  # the router serves on
    # Logged as one line each, quoting nothing the client sent (it could be a credential).
    refusals = [r for r in caplog.records if r.name == "kvroute.http"]
    assert [r.levelname for r in refusals] == ["WARNING", "WARNING"]
    assert "refused a malformed request" in refusals[0].getMessage()
    assert refusals[0].getMessage().endswith("answered 431 header_field_too_large")
    assert refusals[1].getMessage().endswith("answered 431 too_many_headers")
    assert "vvvv" not in caplog.text and "Traceback" not in caplog.text
    roomy = await make_router(backends([engine]), limits={"max_field_size": 16_384, "max_headers": 256})
    # Named in Connection, the headers are hop-by-hop: the router takes them, the engine never sees them.
    assert (await post(http, roomy.url, **{"X-Big": big, "Connection": "X-Big"}))[0] == 200
    assert (await post(http, roomy.url, **many, Connection=", ".join(many)))[0] == 200
    await assert_released(http, router.url, engine)


async def test_an_engine_restarted_on_the_same_port_is_used_again(engine, make_router, http):
    router = await make_router(backends([engine]), health={"interval_s": 0.05, "unhealthy_after": 1})
    port = int(engine.url.rsplit(":", 1)[1])
    assert (await post(http, router.url))[0] == 200
    await engine.stop()
    status, _, body = await post(http, router.url)
    assert status in (502, 503) and json.loads(body)["error"]["message"]
    await engine.start(port=port)

    async def serving_again() -> bool:
        return (await post(http, router.url))[0] == 200

    await wait_for(serving_again, what="the router to serve again")
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_requests_total", status="200") >= 2
    await assert_released(http, router.url, engine)
