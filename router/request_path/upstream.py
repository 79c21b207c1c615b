"""The request path's HTTP/1.1 client: pooled keep-alive connections to the backends.

Why not aiohttp's ``ClientSession`` (which the health checks, scrapers and event discovery
still use): on the hot path it was the largest single cost. Measured with the overhead
benchmark's harness (null backends, one proxy core), a bare aiohttp server forwarding through
``ClientSession`` spent 139 µs of CPU per request, the same server forwarding through this
client 52 µs. This client does only what the proxy needs: send a body it already holds, read
the status line and headers, then the body chunk by chunk as it arrives (chunked transfer
decoded by llhttp, through ``httptools``), read by the caller or handed to it from the read
callback (``pipe``), with backpressure, an idle-read timeout and connections kept alive for
the next request.

Connection reuse: an idle connection is reused (newest first) only while it has been idle less
than ``keepalive_s``, kept under the engines' own keep-alive timeout (uvicorn's 5 s, which vLLM
and SGLang serve with) so the router does not send on a connection the engine is closing. If a
reused connection still turns out closed before a single response byte came back, the request
is sent once more on a new connection, provided the loss came within ``REPLAY_WINDOW_S`` of
sending: the engine closed it idle and never saw the request. A later loss may be an engine
that worked on the request and failed; it is reported (``disconnect``), and the dispatcher
decides on a retry elsewhere, counted, within its attempts.

What reaches the proxy is one final response: informational (1xx) responses are skipped,
trailers dropped, and bytes after the response's end make the connection unfit for reuse.
Header values are read as UTF-8 (invalid bytes kept as surrogate escapes), as aiohttp's
server writes them back.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from router.fleet.tls import BackendTLS
from router.request_path.settings import UpstreamConfig

#: Response bytes buffered before the router stops reading the backend's socket: a slow client
#: then holds the engine back through TCP instead of filling the router's memory.
HIGH_WATER = 64 * 1024
#: Parsed backend URLs kept; past it the cache starts over (discovery replaces pods over time).
MAX_ORIGINS = 1024
#: Takes one piece of a response body as it arrives, from the connection's protocol callback
#: (:meth:`UpstreamResponse.pipe`); False when it cannot take more for now.
Sink = Callable[[bytes], bool]
#: A reused connection lost this soon after sending, before any answer byte, is taken for one
#: the engine closed idle (the request crossed its FIN) and the request is sent once more.
REPLAY_WINDOW_S = 0.1


class UpstreamError(Exception):
    """The exchange with a backend failed; ``kind`` is the ``kind`` metric label."""

    kind = "other"


class ConnectFailed(UpstreamError):
    kind = "connect"


class Disconnected(UpstreamError):
    kind = "disconnect"


class ReadTimeout(UpstreamError):
    kind = "timeout"


class ProtocolError(UpstreamError):
    kind = "protocol"


class BackendDown(UpstreamError):
    """The backend failed its health checks while this exchange was open (:meth:`UpstreamPool.abort`)."""

    kind = "backend_down"


@dataclass(frozen=True)
class Origin:
    """Where a backend URL points: scheme, host and port, and the path prefix before each request's."""

    host: str
    port: int
    tls: bool
    host_header: str
    path_prefix: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = parts.hostname or ""
        return cls(host, port, tls, parts.netloc.rpartition("@")[2], parts.path.rstrip("/"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: UpstreamPool, origin: Origin) -> None:
        self._loop = loop
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._sink: Sink | None = None
        self._paused = False
        self._last_data = 0.0
        self._error: UpstreamError | None = None
        self.in_exchange = False
        self.received = False
        self.head_done = False
        self.complete = False
        self._until_eof = False
        self._keep_alive = False
        self._informational = False
        self._sent_at = 0.0
        self.lost_at: float | None = None
        self.status = 0
        self.reason = ""
        self.raw_headers: list[tuple[str, str]] = []
        self.idle_since = 0.0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # A proxy must not hold back a small write for the next one (Nagle + delayed ACK).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.in_exchange:
            self._fail(ProtocolError("the backend sent bytes outside of a response"))
            return
        if self.complete:
            self._spoil()
            return
        self.received = True
        self._last_data = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.complete:  # the response is whole; what followed it is not ours to read
                self._spoil()
            else:
                self._fail(ProtocolError(f"malformed response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.lost_at = self._loop.time()
        if self.head_done and self._until_eof and exc is None:
            self.complete = True  # a body delimited by the end of the connection
        elif self.in_exchange and not self.complete:
            detail = f": {exc}" if exc else ""
            self._error = self._error or Disconnected(f"the backend closed the connection{detail}")
        self._wake()

    # httptools callbacks

    def on_status(self, reason: bytes) -> None:
        self.reason = reason.decode("latin-1")

    def on_message_begin(self) -> None:
        if self.complete:
            raise ProtocolError("a second response in one exchange")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a trailer: not forwarded (the client's response is not chunked by us)
        self.raw_headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._informational = True  # 100 Continue, 103 Early Hints: the answer follows
            self.raw_headers = []
            return
        self.status = status
        self.head_done = True
        headers = {name.lower(): value.lower() for name, value in self.raw_headers}
        chunked = headers.get("transfer-encoding", "").rstrip().endswith("chunked")
        self._until_eof = "content-length" not in headers and not chunked
        # Asked here: llhttp forgets it once the message is complete.
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        sink = self._sink
        if sink is not None:
            if sink(body):
                return
            # The sink is full: what follows is buffered, as for readany, until the next pipe.
            self._sink = None
            self._wake()
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER:
            self._pause()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.complete = True
        self._wake()

    # the exchange

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and self._error is None
            and self.transport is not None
            and not self.transport.is_closing()
            and not self._until_eof
            and self._keep_alive
            and not self._chunks
        )

    async def exchange(self, request: bytes, body: bytes) -> None:
        """Send the request and wait for the response's status line and headers."""
        assert self.transport is not None
        self.in_exchange = True
        self._pool._busy.setdefault(self.origin, set()).add(self)
        self.received = self.head_done = self.complete = self._until_eof = self._keep_alive = False
        self.raw_headers = []
        self._last_data = self._sent_at = self._loop.time()
        if len(body) < 16384:
            self.transport.write(request + body)
        else:
            self.transport.writelines((request, body))
        while not self.head_done:
            await self._wait()

    async def readany(self) -> bytes:
        """What arrived of the body since the last call, waiting for some; ``b""`` at its end."""
        while not self._chunks:
            if self.complete:
                return b""
            await self._wait_for_data()
        data = self._take_buffered()
        self._resume()
        return data

    async def pipe(self, sink: Sink) -> bool:
        """Hand the body to ``sink`` as it arrives, from :meth:`on_body`: True once it ended,
        False when ``sink`` refused more (what follows is buffered, the backend held back past
        HIGH_WATER, until the next call).

        Each piece goes on in the protocol callback that parsed it, with no task switch per
        piece: relaying a stream token by token is the router's largest per-request cost.
        """
        if self._chunks and not sink(self._take_buffered()):
            return False
        self._resume()
        self._sink = sink
        try:
            while self._sink is not None and not self.complete:
                await self._wait_for_data()
            # Ended with the sink still set: it took every piece. A refusal may come with the
            # end in the same read, the pieces after it buffered for the next call.
            return self._sink is not None
        finally:
            self._sink = None

    def _take_buffered(self) -> bytes:
        """What the body buffered since the last take, as one piece."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return data

    def _pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    async def _wait_for_data(self) -> None:
        """Wait for the next body event, within the idle-read timeout."""
        if self._timer is None:
            self._timer = self._loop.call_at(self._last_data + self._pool.read_timeout, self._check_idle)
        await self._wait()

    def finish(self) -> None:
        """The exchange is over (read to its end or abandoned): stop its timer."""
        self.in_exchange = False
        busy = self._pool._busy.get(self.origin)
        if busy is not None:
            busy.discard(self)
            if not busy:
                del self._pool._busy[self.origin]
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def abort(self, error: UpstreamError) -> None:
        """End the exchange now with ``error``: whoever waits for its head or body gets it."""
        self._fail(error)

    def close(self) -> None:
        self.finish()
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        if self.transport is None and not self.complete:
            raise Disconnected("the backend closed the connection")
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def lost_soon_after_sending(self) -> bool:
        """Lost before any answer byte, within REPLAY_WINDOW_S of sending (see the module docstring)."""
        return (
            not self.received and self.lost_at is not None and self.lost_at - self._sent_at < REPLAY_WINDOW_S
        )

    def _spoil(self) -> None:
        """Bytes came after the response: keep what was read, never reuse the connection."""
        self._keep_alive = False
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _check_idle(self) -> None:
        """The idle-read timer: fires at the last data plus the timeout, re-arms while data flows."""
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return
        timeout = self._pool.read_timeout
        due = self._last_data + timeout
        if self._loop.time() >= due:
            self._waiter.set_exception(ReadTimeout(f"no data from the backend for {timeout:g} s"))
        else:
            self._timer = self._loop.call_at(due, self._check_idle)


class UpstreamResponse:
    """A backend's answer: status and headers at once, the body as it arrives."""

    def __init__(self, pool: UpstreamPool, base_url: str, origin: Origin, connection: _Connection) -> None:
        self._pool = pool
        self._base_url = base_url
        self._origin = origin
        self._connection = connection
        self.status = connection.status
        self.reason = connection.reason
        self.headers: CIMultiDict[str] = CIMultiDict(connection.raw_headers)

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "").partition(";")[0].strip().lower()

    async def readany(self) -> bytes:
        return await self._connection.readany()

    async def pipe(self, sink: Sink) -> bool:
        """Hand the rest of the body to ``sink`` as it arrives (see :meth:`_Connection.pipe`):
        True once it ended, False when ``sink`` refused more for now."""
        return await self._connection.pipe(sink)

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while chunk := await self._connection.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if it can carry another exchange."""
        connection = self._connection
        if connection.reusable:
            connection.finish()
            self._pool._put(self._base_url, self._origin, connection)
        else:
            connection.close()

    def close(self) -> None:
        """Abandon the exchange: closing the connection is what tells the engine to stop."""
        self._connection.close()


class UpstreamPool:
    """Keep-alive connections per backend origin, opened on demand, never limited in number:
    the router must not queue requests behind its own pool."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.configure(config)
        self._idle: dict[Origin, deque[_Connection]] = {}
        #: Connections carrying an exchange, per origin: what :meth:`abort` ends.
        self._busy: dict[Origin, set[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._tls: ssl.SSLContext | None = None

    def configure(self, config: UpstreamConfig) -> None:
        """Take new timeouts (a config reload); exchanges in flight see them from their next wait."""
        self.connect_timeout = config.connect_timeout_s
        self.read_timeout = config.read_timeout_s
        self.keepalive = config.keepalive_s

    async def post(
        self,
        base_url: str,
        path: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        tls: BackendTLS | None = None,
    ) -> UpstreamResponse:
        """POST ``body`` to ``base_url`` + ``path`` and return once the status and headers are in.

        ``tls``: the backend's TLS settings (router/fleet/tls.py) for an ``https://`` URL; without
        them the system's trust store verifies the URL's host."""
        origin = self._origins.get(base_url)
        if origin is None:
            if len(self._origins) >= MAX_ORIGINS:
                self._origins.clear()  # backends come and go with discovery; parsing is cheap
            origin = self._origins[base_url] = Origin.parse(base_url)
        request = self._request_head(origin, path, headers, len(body))
        connection = self._reusable(origin)
        if connection is not None:
            try:
                await connection.exchange(request, body)
                return UpstreamResponse(self, base_url, origin, connection)
            except Disconnected:
                connection.close()
                if not connection.lost_soon_after_sending():
                    raise
            except BaseException:
                connection.close()
                raise
        connection = await self._connect(origin, tls)
        try:
            await connection.exchange(request, body)
        except BaseException:
            connection.close()
            raise
        return UpstreamResponse(self, base_url, origin, connection)

    def forget(self, base_url: str) -> None:
        """A backend left the fleet: close its idle connections and drop what was kept for it."""
        origin = self._origins.pop(base_url, None) or Origin.parse(base_url)
        for connection in self._idle.pop(origin, ()):
            connection.close()

    def abort(self, base_url: str, detail: str) -> int:
        """The backend at ``base_url`` is down (its health checks failed): end every exchange
        open with it, and close its idle connections. A request still waiting for its first byte
        fails over to another backend (the error is raised before the client got anything); a
        stream already under way ends with an SSE error instead of hanging until the read timeout
        on an engine that will not answer. Returns the number of exchanges ended."""
        origin = self._origins.get(base_url) or Origin.parse(base_url)
        busy = list(self._busy.pop(origin, ()))
        for connection in busy:
            connection.abort(BackendDown(detail))
        for connection in self._idle.pop(origin, ()):
            connection.close()
        return len(busy)

    def close(self) -> None:
        """Close every idle connection (those in use close with their exchange)."""
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()

    @staticmethod
    def _request_head(origin: Origin, path: str, headers: Iterable[tuple[str, str]], length: int) -> bytes:
        target = origin.path_prefix + path
        lines = [f"POST {target} HTTP/1.1\r\nHost: {origin.host_header}\r\nContent-Length: {length}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers]
        lines.append("\r\n")
        head = "".join(lines)
        if head.count("\n") != len(lines) + 2:
            # A value with a line break would smuggle headers, or a second request, upstream.
            raise ValueError("a header name or value holds a line break")
        return head.encode("utf-8", "surrogateescape")

    def _reusable(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        fresh_after = time.monotonic() - self.keepalive
        while idle:
            connection = idle.pop()
            open_ = connection.transport is not None and not connection.transport.is_closing()
            if open_ and connection.idle_since >= fresh_after:
                return connection
            connection.close()
        del self._idle[origin]  # no entry lingers for a backend that is gone
        return None

    def _put(self, base_url: str, origin: Origin, connection: _Connection) -> None:
        if self._origins.get(base_url) != origin:
            connection.close()  # its backend was forgotten while this exchange ran
            return
        now = time.monotonic()
        connection.idle_since = now
        idle = self._idle.setdefault(origin, deque())
        idle.append(connection)
        # The oldest sit at the left: close those idle too long, so unused connections do not linger.
        while idle and idle[0].idle_since < now - self.keepalive:
            idle.popleft().close()

    async def _connect(self, origin: Origin, tls: BackendTLS | None) -> _Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        server_hostname: str | None = None
        if origin.tls:
            if tls is not None:
                context, server_hostname = tls.context, tls.server_hostname
            else:
                context = self._tls = self._tls or ssl.create_default_context()
                server_hostname = origin.host
        opening = loop.create_connection(
            lambda: _Connection(loop, self, origin),
            origin.host,
            origin.port,
            ssl=context,
            server_hostname=server_hostname,
        )
        try:
            # The TLS handshake is part of connecting: it counts against the same timeout.
            _, connection = await asyncio.wait_for(opening, self.connect_timeout)
        except asyncio.TimeoutError as exc:
            # asyncio's (the builtin TimeoutError only since Python 3.11, which kvroute also
            # runs before); caught first: the builtin one is an OSError, and says nothing itself.
            detail = f"connecting to {origin.host}:{origin.port} timed out after {self.connect_timeout:g} s"
            raise ConnectFailed(detail) from exc
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        return connection
