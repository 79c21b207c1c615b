"""Requests aiohttp refuses before any handler runs get a 4xx in the OpenAI shape, over raw sockets."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web

from router.http.protocol_errors import OpenAIErrorRunner
from tests.helpers import backends_of

LIMITS = {"max_line_size": 1024, "max_field_size": 512, "max_headers": 20}

CASES = [
    (
        "long request line",
        b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        414,
        "request_line_too_long",
    ),
    (
        "long header value",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + b"b" * 2000 + b"\r\n\r\n",
        431,
        "header_field_too_large",
    ),
    (
        "long absolute-URL header value",
        b"GET / HTTP/1.1\r\nHost: x\r\nReferer: http://x/" + b"r" * 2000 + b"\r\n\r\n",
        431,
        "header_field_too_large",
    ),
    (
        "long header name",
        b"GET / HTTP/1.1\r\nHost: x\r\nX" + b"c" * 2000 + b": v\r\n\r\n",
        431,
        "header_field_too_large",
    ),
    (
        "too many headers",
        b"GET / HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(40)) + b"\r\n",
        431,
        "too_many_headers",
    ),
    ("invalid byte in a header name", b"GET / HTTP/1.1\r\nHo\x01st: x\r\n\r\n", 400, "invalid_header"),
    ("garbage request line", b"\x00\x01garbage\r\n\r\n", 400, "invalid_request_line"),
    ("not HTTP", b"HELLO THERE\r\n\r\n", 400, "invalid_request_line"),
]


async def raw_exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` on a fresh connection; the status, headers and body of the answer (read to EOF)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


def assert_openai_error(headers: dict[str, str], body: bytes, code: str) -> dict:
    assert headers["content-type"].startswith("application/json")
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    return error


@pytest.mark.parametrize(("data", "status", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_unparseable_requests_get_openai_errors(make_router, fleet, http, data, status, code):
    router = await make_router(backends_of(fleet), limits=LIMITS)
    got_status, headers, body = await raw_exchange(router.port, data)
    assert got_status == status
    error = assert_openai_error(headers, body, code)
    # The offending bytes are not echoed back.
    assert b"aaaa" not in body and b"bbbb" not in body and b"garbage" not in body
    if status == 431 and code == "too_many_headers":
        assert "20" in error["message"]
    # The router keeps serving, on new connections.
    async with http.get(f"{router.url}/health") as resp:
        assert resp.status == 200
    models_request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    ok_status, _, ok_body = await raw_exchange(router.port, models_request)
    assert ok_status == 200 and orjson.loads(ok_body)["object"] == "list"


async def test_limits_come_from_the_config(make_router, fleet):
    """A line just within the configured limits passes; just past them is refused."""
    router = await make_router(backends_of(fleet), limits=LIMITS)
    value = b"v" * (LIMITS["max_field_size"] - len("X-Fit") - 8)
    fits = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Fit: " + value + b"\r\nConnection: close\r\n\r\n"
    status, _, _ = await raw_exchange(router.port, fits)
    assert status == 200
    status, headers, body = await raw_exchange(router.port, fits.replace(value, value * 2))
    assert status == 431
    assert "512" in assert_openai_error(headers, body, "header_field_too_large")["message"]


async def test_the_separate_admin_listener_answers_in_the_openai_shape_too(make_router, fleet, http):
    router = await make_router(
        backends_of(fleet), limits=LIMITS, admin={"listen": {"host": "127.0.0.1", "port": 0}}
    )
    data = b"GET /admin/backends HTTP/1.1\r\nHost: x\r\nX-Long: " + b"b" * 2000 + b"\r\n\r\n"
    status, headers, body = await raw_exchange(router.admin_port, data)
    assert status == 431
    assert_openai_error(headers, body, "header_field_too_large")
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        assert resp.status == 200


async def test_a_handler_crash_is_a_500_in_the_openai_shape_without_details():
    """What no middleware catches (a bug) leaves as JSON too, naming nothing of the exception."""

    async def crash(request: web.Request) -> web.Response:
        raise RuntimeError("secret internals")

    app = web.Application()
    app.router.add_get("/crash", crash)
    runner = OpenAIErrorRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        status, headers, body = await raw_exchange(port, b"GET /crash HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        await runner.cleanup()
    assert status == 500 and headers["content-type"].startswith("application/json")
    error = orjson.loads(body)["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert b"secret internals" not in body
