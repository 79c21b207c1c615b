"""A lean HTTP/1.1 load generator for proxy benchmarks: keep-alive connections, exact timings.

aiohttp's client costs more CPU per request than a fast proxy does, so a benchmark driven
by it would measure the client. This one is a bare asyncio protocol (run it on uvloop):
requests are prebuilt bytes, responses are parsed just enough to find their end
(``Content-Length`` or chunked), and for streams it notes the arrival of the first body
bytes (time to first chunk) and counts SSE events (``data:`` lines). ``TCP_NODELAY`` is set:
a request must never wait for Nagle's algorithm.

Two modes: :meth:`Client.fixed_rate` (open loop, ``rate`` requests per second, for latency
at a moderate load) and :meth:`Client.saturate` (``concurrency`` requests back to back for
a time, for the highest sustained rate).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

_EVENT = b"data:"


@dataclass(frozen=True)
class Sample:
    ok: bool
    #: Seconds from writing the request to the end of the response.
    latency: float
    #: Seconds to the first body bytes (for a stream: its first chunk).
    first_byte: float
    #: SSE events (``data:`` lines) in the body.
    events: int
    status: int = 0


@dataclass(frozen=True)
class Throughput:
    #: Successful requests and their SSE events that finished inside the measured window.
    requests: int
    events: int
    errors: int
    seconds: float
    #: Successful requests and events over the whole run, warm-up and tail included.
    all_requests: int = 0
    all_events: int = 0

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def event_rate(self) -> float:
        return self.events / self.seconds


def build_request(host: str, path: str, body: bytes) -> bytes:
    """A complete keep-alive POST with a JSON body, ready to write."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.done: asyncio.Future[Sample] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.done is not None and not self.done.done():
            self.done.set_result(self._sample(False, time.perf_counter()))

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    async def exchange(self, request: bytes, timeout: float) -> Sample:
        assert self.transport is not None
        self.buffer.clear()
        self.status = 0
        self.chunked = False
        self.remaining = -1
        self.events = 0
        self.tail = b""
        self.first_at = 0.0
        self.done = asyncio.get_running_loop().create_future()
        self.sent_at = time.perf_counter()
        self.transport.write(request)
        try:
            return await asyncio.wait_for(self.done, timeout)
        except asyncio.TimeoutError:
            self.transport.close()
            return self._sample(False, time.perf_counter())

    def _sample(self, ok: bool, now: float) -> Sample:
        first = (self.first_at or now) - self.sent_at
        return Sample(ok and 200 <= self.status < 300, now - self.sent_at, first, self.events, self.status)

    def data_received(self, data: bytes) -> None:
        if self.done is None or self.done.done():
            return
        now = time.perf_counter()
        self.buffer += data
        if not self.status and not self._parse_head():
            return
        finished = self._parse_chunks(now) if self.chunked else self._parse_length(now)
        if finished:
            self.done.set_result(self._sample(True, now))

    def _parse_head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        del self.buffer[: end + 4]
        self.status = int(lines[0].split(b" ", 2)[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self.remaining = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self.chunked = True
        return True

    def _body(self, payload: bytes, now: float) -> None:
        if not self.first_at and payload:
            self.first_at = now
        # An event marker may straddle two reads: search the previous read's tail too.
        self.events += (self.tail + payload).count(_EVENT)
        self.tail = payload[-(len(_EVENT) - 1) :]

    def _parse_length(self, now: float) -> bool:
        take = len(self.buffer) if self.remaining < 0 else min(len(self.buffer), self.remaining)
        self._body(bytes(self.buffer[:take]), now)
        del self.buffer[:take]
        if self.remaining >= 0:
            self.remaining -= take
        return self.remaining == 0

    def _parse_chunks(self, now: float) -> bool:
        while True:
            eol = self.buffer.find(b"\r\n")
            if eol < 0:
                return False
            size = int(bytes(self.buffer[:eol]).split(b";", 1)[0], 16)
            if size == 0:
                if self.buffer.find(b"\r\n\r\n", eol) < 0:
                    return False
                self.buffer.clear()
                return True
            if len(self.buffer) < eol + 2 + size + 2:
                return False
            self._body(bytes(self.buffer[eol + 2 : eol + 2 + size]), now)
            del self.buffer[: eol + 2 + size + 2]


class Client:
    """A pool of keep-alive connections to one ``host:port``, grown as concurrency needs."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self._idle: list[_Connection] = []
        self.connections = 0

    async def request(self, request: bytes) -> Sample:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable:
                break
        else:
            try:
                _, connection = await asyncio.get_running_loop().create_connection(
                    _Connection, self.host, self.port
                )
            except OSError:
                return Sample(False, 0.0, 0.0, 0)
            self.connections += 1
        sample = await connection.exchange(request, self.timeout)
        if sample.ok and connection.usable:
            self._idle.append(connection)
        elif connection.transport is not None:
            connection.transport.close()
        return sample

    async def fixed_rate(self, requests: Sequence[bytes], rate: float, count: int) -> list[Sample]:
        """Send ``count`` requests (cycling through ``requests``) at ``rate`` per second, open loop."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for i in range(count):
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.request(requests[i % len(requests)])))
        return list(await asyncio.gather(*tasks))

    async def saturate(
        self, requests: Sequence[bytes], concurrency: int, seconds: float, warmup: float = 0.5
    ) -> Throughput:
        """``concurrency`` requests back to back; counts what finished in the ``seconds`` after ``warmup``."""
        loop = asyncio.get_running_loop()
        begin = loop.time() + warmup
        end = begin + seconds
        totals = [0, 0, 0, 0, 0]

        async def worker(k: int) -> None:
            i = k
            while loop.time() < end:
                sample = await self.request(requests[i % len(requests)])
                i += concurrency
                events = sample.events if sample.ok else 0
                totals[3] += sample.ok
                totals[4] += events
                if begin <= loop.time() <= end:
                    totals[0] += sample.ok
                    totals[1] += events
                    totals[2] += not sample.ok

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return Throughput(totals[0], totals[1], totals[2], seconds, totals[3], totals[4])

    def close(self) -> None:
        for connection in self._idle:
            if connection.transport is not None:
                connection.transport.close()
        self._idle.clear()
