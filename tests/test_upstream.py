"""The request path's upstream client (router/request_path/upstream.py) against scripted backends
on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

from router.config import UpstreamConfig
from router.request_path.upstream import ConnectFailed, Disconnected, ProtocolError, ReadTimeout, UpstreamPool
from tests.helpers import wait_for

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

Script = Callable[["Backend", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Backend:
    """A loopback server running ``script`` on each connection; counts connections and requests."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.closed = 0
        self.requests: list[bytes] = []
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> Backend:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(self, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed += 1


async def keep_alive(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request on the connection with OK, keeping it open."""
    while True:
        await backend.read_request(reader)
        writer.write(OK)


def pool(**overrides: float) -> UpstreamPool:
    return UpstreamPool(UpstreamConfig(**overrides))


async def two_requests_in_turn(backend: Backend) -> list[bytes]:
    """Two requests one after the other through one pool, each read whole and released."""
    upstream = pool()
    bodies = []
    for _ in range(2):
        response = await upstream.post(backend.url, "/p", [], b"{}")
        bodies.append(await response.read())
        response.release()
    upstream.close()
    return bodies


async def test_sequential_requests_share_one_kept_alive_connection() -> None:
    async with Backend(keep_alive) as backend:
        upstream = pool()
        for _ in range(3):
            response = await upstream.post(backend.url, "/v1/completions", [("X-A", "1")], b'{"x": 1}')
            assert (response.status, response.content_type, await response.read()) == (
                200,
                "application/json",
                b"{}",
            )
            response.release()
        upstream.close()
    assert backend.connections == 1 and len(backend.requests) == 3
    first = backend.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert (
        b"\r\nX-A: 1\r\n" in first and b"\r\nContent-Length: 8\r\n" in first and first.endswith(b'{"x": 1}')
    )


async def test_a_reused_connection_closed_before_any_answer_is_replaced_once() -> None:
    """The keep-alive race: the engine closes an idle connection just as the router sends on it.
    Scripted here as a backend that answers the first request of a connection and closes on the
    next one without a byte; the router sends it once more on a new connection."""

    async def one_answer_per_connection(
        backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await backend.read_request(reader)
        writer.write(OK)
        await backend.read_request(reader)

    async with Backend(one_answer_per_connection) as backend:
        assert await two_requests_in_turn(backend) == [b"{}", b"{}"]
    assert backend.connections == 2 and len(backend.requests) == 3


async def test_a_new_connection_closed_before_any_answer_fails_without_a_second_try() -> None:
    async def hang_up(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)

    async with Backend(hang_up) as backend:
        with pytest.raises(Disconnected):
            await pool().post(backend.url, "/p", [], b"{}")
    assert backend.connections == 1


async def test_a_connection_idle_longer_than_keepalive_is_not_reused() -> None:
    async with Backend(keep_alive) as backend:
        upstream = pool(keepalive_s=0.05)
        for _ in range(2):
            response = await upstream.post(backend.url, "/p", [], b"{}")
            await response.read()
            response.release()
            await asyncio.sleep(0.1)
        upstream.close()
    assert backend.connections == 2


async def test_a_backend_that_left_the_fleet_has_its_idle_connections_closed() -> None:
    async with Backend(keep_alive) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        await response.read()
        response.release()
        assert backend.closed == 0
        upstream.forget(backend.url)

        async def closed() -> bool:
            return backend.closed == 1

        await wait_for(closed, what="the backend to see the connection closed")


async def test_connection_close_and_an_end_of_connection_body() -> None:
    """A body with neither length nor chunks ends with the connection; that connection is not reused."""

    async def until_eof(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: text/plain\r\n\r\nall of ")
        await writer.drain()
        writer.write(b"it")

    async with Backend(until_eof) as backend:
        assert await two_requests_in_turn(backend) == [b"all of it", b"all of it"]
    assert backend.connections == 2


@pytest.mark.parametrize("reading", ["readany", "pipe"])
async def test_a_chunked_stream_arrives_chunk_by_chunk_as_it_is_sent(reading: str) -> None:
    more = asyncio.Event()

    async def stream(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await backend.read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            writer.write(b"7\r\ndata: 1\r\n")
            await writer.drain()
            await more.wait()
            writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")

    async with Backend(stream) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        assert response.content_type == "text/event-stream"
        pieces: list[bytes] = []

        def take(piece: bytes) -> bool:
            pieces.append(piece)
            more.set()  # the backend sends the rest only once the first piece is here
            return True

        if reading == "pipe":
            assert await response.pipe(take) is True
        else:
            while piece := await response.readany():
                take(piece)
        assert pieces == [b"data: 1", b"data: 2"]
        response.release()
        # Read to its end, the connection serves the next exchange.
        again = await upstream.post(backend.url, "/p", [], b"{}")
        assert await again.read() == b"data: 1data: 2"
        again.release()
        assert backend.connections == 1
        upstream.close()


async def test_a_refusal_in_the_read_that_ends_the_body_keeps_the_rest_for_the_next_pipe() -> None:
    """The last pieces often come in one read with the end: a sink full at the first of them
    must not end the body without the others (the client would get a stream cut short)."""
    go = asyncio.Event()

    async def tail(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await go.wait()
        writer.write(b"5\r\nfirst\r\n6\r\nsecond\r\n0\r\n\r\n")  # one write, one read

    async with Backend(tail) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        received: list[bytes] = []

        def full(piece: bytes) -> bool:
            received.append(piece)
            return False

        piped = asyncio.create_task(response.pipe(full))
        await asyncio.sleep(0)  # the pipe waits, its sink set, before the backend sends
        go.set()
        assert await piped is False
        assert await response.pipe(lambda piece: received.append(piece) is None) is True
        assert received == [b"first", b"second"]
        response.release()
        upstream.close()


@pytest.mark.parametrize("reading", ["readany", "pipe"])
async def test_a_backend_silent_mid_body_times_out_by_the_read_timeout(reading: str) -> None:
    async def stall(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with Backend(stall) as backend:
        upstream = pool(read_timeout_s=0.2)
        response = await upstream.post(backend.url, "/p", [], b"{}")
        pieces: list[bytes] = []
        with pytest.raises(ReadTimeout) as caught:
            if reading == "pipe":
                await response.pipe(lambda piece: pieces.append(piece) is None)
            else:
                while True:
                    pieces.append(await response.readany())
        assert pieces == [b"abc"]
        assert caught.value.kind == "timeout"
        response.close()
        upstream.close()


async def test_a_sink_that_refuses_holds_the_backend_back_until_the_next_pipe() -> None:
    piece = b"x" * 65536
    pieces = 1024  # 64 MiB: far more than the socket buffers on the way hold
    sent = 0

    async def firehose(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(pieces):
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await writer.drain()
            sent += len(piece)
        writer.write(b"0\r\n\r\n")

    async with Backend(firehose) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        received = bytearray()

        def refusing(data: bytes) -> bool:
            received.extend(data)
            return False

        assert await response.pipe(refusing) is False
        last = -1

        async def backend_blocked() -> bool:
            nonlocal last
            before, last = last, sent
            await asyncio.sleep(0.1)
            return before == sent

        await wait_for(backend_blocked, what="the backend to stop sending (its reader paused)")
        assert sent < pieces * len(piece) // 2

        def taking(data: bytes) -> bool:
            received.extend(data)
            return True

        assert await response.pipe(taking) is True
        assert received == piece * pieces
        response.release()
        upstream.close()


async def test_a_backend_dying_mid_body_is_a_disconnect() -> None:
    async def die(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")

    async with Backend(die) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        with pytest.raises(Disconnected):
            await response.read()
        response.close()
        upstream.close()


async def test_a_malformed_response_is_a_protocol_error() -> None:
    async def garbage(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")

    async with Backend(garbage) as backend:
        upstream = pool()
        with pytest.raises(ProtocolError):
            await upstream.post(backend.url, "/p", [], b"{}")
        upstream.close()


async def test_an_unreachable_backend_is_a_connect_failure() -> None:
    async with Backend(lambda b, r, w: asyncio.sleep(0)) as backend:
        url = backend.url
    with pytest.raises(ConnectFailed) as caught:
        await pool().post(url, "/p", [], b"{}")
    assert caught.value.kind == "connect"
    assert f"cannot connect to 127.0.0.1:{url.rsplit(':', 1)[1]}: " in str(caught.value)
    assert "Errno 111" in str(caught.value)  # ECONNREFUSED: the reason is kept


async def test_a_connect_timeout_says_it_timed_out_and_after_how_long() -> None:
    """A listener whose accept queue is full (it never accepts) leaves a new connection's SYN
    unanswered: connecting hangs until the connect timeout, on loopback."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        fillers = [socket.socket() for _ in range(4)]
        try:
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex(address)
            slow = UpstreamPool(UpstreamConfig(connect_timeout_s=0.25))
            started = time.monotonic()
            with pytest.raises(ConnectFailed) as caught:
                await slow.post(f"http://127.0.0.1:{address[1]}", "/p", [], b"{}")
            waited = time.monotonic() - started
        finally:
            for filler in fillers:
                filler.close()
    assert caught.value.kind == "connect"
    assert str(caught.value) == f"connecting to 127.0.0.1:{address[1]} timed out after 0.25 s"
    assert waited >= 0.25


async def test_a_header_value_with_a_line_break_is_never_sent() -> None:
    async with Backend(lambda b, r, w: asyncio.sleep(0)) as backend:
        with pytest.raises(ValueError, match="line break"):
            await pool().post(backend.url, "/p", [("X-A", "1\r\nX-Injected: yes")], b"{}")
    assert backend.connections == 0


async def test_a_path_prefix_in_the_backend_url_goes_before_the_request_path() -> None:
    async def answer(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(OK)

    async with Backend(answer) as backend:
        upstream = pool()
        response = await upstream.post(backend.url + "/engine-a", "/v1/completions?x=1", [], b"{}")
        await response.read()
        response.release()
        upstream.close()
    assert backend.requests[0].startswith(b"POST /engine-a/v1/completions?x=1 HTTP/1.1\r\n")


async def test_informational_responses_are_skipped_for_the_final_one() -> None:
    async def early_hints(
        backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK)

    async with Backend(early_hints) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        assert (response.status, await response.read()) == (200, b"{}")
        assert "Link" not in response.headers
        upstream.close()


async def test_bytes_after_the_response_stay_out_of_it_and_retire_the_connection() -> None:
    async def surplus(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await backend.read_request(reader)
            writer.write(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nEVIL")

    async with Backend(surplus) as backend:
        assert await two_requests_in_turn(backend) == [b"{}", b"{}"]
    assert backend.connections == 2


async def test_trailers_are_not_forwarded_as_headers() -> None:
    async def trailer(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n"
        writer.write(head + b"2\r\n{}\r\n0\r\nX-T: 1\r\n\r\n")

    async with Backend(trailer) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        assert await response.read() == b"{}"
        assert "X-T" not in response.headers
        upstream.close()


async def test_header_values_keep_their_utf8() -> None:
    async def utf8(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Name: caf\xc3\xa9\r\nContent-Length: 2\r\n\r\n{}")

    async with Backend(utf8) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        assert response.headers["X-Name"] == "café"
        await response.read()
        upstream.close()


async def test_a_body_to_the_end_of_the_connection_under_a_non_chunked_transfer_coding() -> None:
    async def identity(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\nConnection: close\r\n\r\nall of it")

    async with Backend(identity) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        assert await response.read() == b"all of it"
        response.release()
        upstream.close()


async def test_a_connection_finishing_after_its_backend_was_forgotten_is_closed_not_pooled() -> None:
    async with Backend(keep_alive) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        upstream.forget(backend.url)  # the backend leaves the fleet while the answer is read
        await response.read()
        response.release()

        async def closed() -> bool:
            return backend.closed == 1

        await wait_for(closed, what="the backend to see the connection closed")
        upstream.close()


async def test_a_reused_connection_lost_well_after_sending_is_not_replayed() -> None:
    """The engine read the request and worked on it before failing: sending it again could run it
    twice, so the loss is reported and the dispatcher decides (another backend, counted)."""

    async def fail_while_working(
        backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await backend.read_request(reader)
        writer.write(OK)
        await backend.read_request(reader)
        await asyncio.sleep(0.5)  # well past REPLAY_WINDOW_S

    async with Backend(fail_while_working) as backend:
        upstream = pool()
        response = await upstream.post(backend.url, "/p", [], b"{}")
        await response.read()
        response.release()
        with pytest.raises(Disconnected):
            await upstream.post(backend.url, "/p", [], b"{}")
        upstream.close()
    assert len(backend.requests) == 2
