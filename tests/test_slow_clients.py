"""Slow and idle clients, through real sockets: heads and bodies that do not arrive in time are cut
at their deadline and counted, connection caps close what is beyond them at once, and a normal
client is served throughout. Deadlines here are short (about a second) so the file runs in seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from tests.fault_engine import MODEL as FAULT_MODEL
from tests.fault_engine import backends
from tests.helpers import MakeRouter, backends_of, scrape, total, wait_for

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
#: Deadlines of these tests: short, so that a connection cut too early or too late is seen.
HEAD_S, BODY_S = 1.0, 1.0
#: Slow connections of each kind opened at once.
SLOW = 60


async def open_connection(
    port: int, source: str = "127.0.0.1"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_after(reader: asyncio.StreamReader, started: float, limit: float) -> float:
    """Seconds from ``started`` until the router closed the connection (reading no response)."""
    with contextlib.suppress(ConnectionError):
        data = await asyncio.wait_for(reader.read(), limit)
        assert data == b"", data
    return time.monotonic() - started


async def slow_head(port: int, until: asyncio.Event) -> float:
    """Half a request head, then one byte every 0.2 s: trickling must not extend the deadline."""
    reader, writer = await open_connection(port)
    started = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            while not until.is_set() and not writer.is_closing():
                await asyncio.sleep(0.2)
                writer.write(b"X")
                await writer.drain()

    trickler = asyncio.create_task(trickle())
    try:
        return await closed_after(reader, started, 10)
    finally:
        trickler.cancel()
        writer.close()


async def stalled_body(port: int) -> float:
    """A whole head announcing 1 MB, then 10 bytes of it, then nothing."""
    reader, writer = await open_connection(port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n" + b'{"model":'
    )
    started = time.monotonic()
    try:
        return await closed_after(reader, started, 10)
    finally:
        writer.close()


async def silent(port: int) -> float:
    """A connection that never sends a byte: its first head's clock runs from the connect."""
    reader, writer = await open_connection(port)
    try:
        return await closed_after(reader, time.monotonic(), 10)
    finally:
        writer.close()


async def test_slow_heads_and_bodies_are_cut_at_their_deadline_while_others_are_served(
    fleet, make_router: MakeRouter, http
):
    router = await make_router(
        backends_of(fleet),
        listen={"host": "127.0.0.1", "port": 0, "header_timeout_s": HEAD_S, "body_timeout_s": BODY_S},
    )
    served: list[int] = []
    done = asyncio.Event()

    async def normal_client() -> None:
        while not done.is_set():
            async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
                served.append(resp.status)
                await resp.read()
            await asyncio.sleep(0.05)

    normal = asyncio.create_task(normal_client())
    heads = [asyncio.create_task(slow_head(router.port, done)) for _ in range(SLOW)]
    bodies = [asyncio.create_task(stalled_body(router.port)) for _ in range(SLOW)]
    silents = [asyncio.create_task(silent(router.port)) for _ in range(5)]
    head_times = await asyncio.gather(*heads)
    body_times = await asyncio.gather(*bodies)
    silent_times = await asyncio.gather(*silents)
    done.set()
    await normal

    # Cut at their deadline: not before it, and not long after (the machine may be busy).
    for elapsed in [*head_times, *silent_times]:
        assert HEAD_S * 0.9 <= elapsed < HEAD_S + 3, elapsed
    for elapsed in body_times:
        assert BODY_S * 0.9 <= elapsed < BODY_S + 3, elapsed
    assert len(served) >= 10 and set(served) == {200}
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_client_timeouts_total", listener="main", phase="head") == SLOW + 5
    assert total(samples, "kvroute_client_timeouts_total", listener="main", phase="body") == SLOW
    await wait_for(
        lambda: router.main.guard.open <= 1,
        what="every cut connection released",
        detail=lambda: router.main.guard.open,
    )


async def test_a_body_that_keeps_coming_is_not_cut(fleet, make_router: MakeRouter, http):
    """The body deadline is about progress: a slow upload that never stalls a whole deadline passes."""
    router = await make_router(
        backends_of(fleet),
        listen={"host": "127.0.0.1", "port": 0, "header_timeout_s": HEAD_S, "body_timeout_s": BODY_S},
    )
    body = json.dumps(CHAT).encode()
    reader, writer = await open_connection(router.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    started = time.monotonic()
    for i in range(0, len(body), len(body) // 6 + 1):  # ~2.5 body deadlines in all
        writer.write(body[i : i + len(body) // 6 + 1])
        await writer.drain()
        await asyncio.sleep(BODY_S * 0.4)
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert time.monotonic() - started > 2 * BODY_S
    assert status_line.startswith(b"HTTP/1.1 200"), status_line
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_client_timeouts_total") == 0


async def test_an_idle_kept_alive_connection_is_closed_after_the_idle_timeout(fleet, make_router: MakeRouter):
    router = await make_router(
        backends_of(fleet), listen={"host": "127.0.0.1", "port": 0, "idle_timeout_s": 0.5}
    )
    reader, writer = await open_connection(router.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(len(b'{"status":"ok"}'))
    idle_since = time.monotonic()
    assert await closed_after(reader, idle_since, 10) >= 0.4
    writer.close()


async def request_on(port: int, source: str = "127.0.0.1") -> bytes:
    """One request on a fresh connection; its status line, or b"" when the router closed it."""
    reader, writer = await open_connection(port, source)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            return await asyncio.wait_for(reader.readline(), 10)
        return b""
    finally:
        writer.close()


async def test_connections_beyond_the_caps_are_closed_at_once(fleet, make_router: MakeRouter, http):
    router = await make_router(
        backends_of(fleet),
        listen={"host": "127.0.0.1", "port": 0, "max_connections": 4, "max_connections_per_client": 2},
    )
    held = [await open_connection(router.port) for _ in range(2)]
    await wait_for(lambda: router.main.guard.open == 2, what="two connections from 127.0.0.1 admitted")
    # A third from the same address is closed before a byte is read; another address is admitted.
    assert await request_on(router.port) == b""
    assert (await request_on(router.port, "127.0.0.2")).startswith(b"HTTP/1.1 200")
    held += [await open_connection(router.port, source) for source in ("127.0.0.2", "127.0.0.3")]
    await wait_for(lambda: router.main.guard.open == 4, what="four connections admitted")
    assert await request_on(router.port, "127.0.0.4") == b""  # the process-wide cap
    for _, writer in held[:3]:
        writer.close()
    await wait_for(lambda: router.main.guard.open == 1, what="closed connections released")
    assert (await request_on(router.port)).startswith(b"HTTP/1.1 200")
    held[3][1].close()
    # The admin listener has caps of its own: flooding the public port leaves it reachable.
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        assert resp.status == 200
    samples = await scrape(http, router.url)
    refused = "kvroute_client_connections_refused_total"
    assert total(samples, refused, listener="main", reason="max_connections_per_client") == 1
    assert total(samples, refused, listener="main", reason="max_connections") == 1


async def test_a_head_pipelined_behind_a_long_stream_is_not_cut(fault_engines, make_router: MakeRouter):
    """The head deadline runs while the router waits for a head, not while it answers the one
    before: a stream may outlast it many times."""
    (engine,) = await fault_engines("stall_mid_stream")
    router = await make_router(
        backends([engine]), listen={"host": "127.0.0.1", "port": 0, "header_timeout_s": 0.3}
    )
    body = json.dumps({"model": FAULT_MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    reader, writer = await open_connection(router.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    await reader.readuntil(b"data: ")  # the stream has started, and stalls
    writer.write(b"GET /health HTTP/1.1\r\n")  # the next request's first bytes, pipelined
    await asyncio.sleep(1.0)  # over three head deadlines
    engine.release.set()
    writer.write(b"Host: x\r\n\r\n")
    await reader.readuntil(b"data: [DONE]")
    rest = await asyncio.wait_for(reader.readuntil(b'{"status":"ok"}'), 10)
    assert b"HTTP/1.1 200" in rest
    writer.close()
