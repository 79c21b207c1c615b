"""Slow and idle clients: read deadlines and connection caps, at the connection level.

aiohttp's server reads a request's head and body with no deadline of its own (it only closes
idle kept-alive connections), so a client that trickles its head or body a byte at a time
holds a connection, a file descriptor and a buffer for as long as it likes: with a few
hundred such connections one client can exhaust the router (slowloris). nginx's answer, kept
here: a request head must arrive whole within ``client_header_timeout`` of its start, a body
must make progress every ``client_body_timeout``, and connections are capped (``limit_conn``).

Where: in the connection's protocol (:class:`ClientConnection`, aiohttp's ``RequestHandler``
answering its errors in the OpenAI shape), because only there is the parse state known
without a task per request. ``data_received`` runs for every chunk anyway; it notes which
phase the connection is in (waiting for a head, for body bytes, or neither: the request is
whole and the app has it) and when that phase must end. One timer per connection checks the
deadline lazily: moved deadlines are only read when it fires, so a request that arrives in
one chunk (the usual case) costs no timer operation at all, and body progress only a float
store. A connection past its deadline is aborted (no response: the client is not reading
its request's fate, and a reset frees the descriptor at once, TLS or not), and counted in
``kvroute_client_timeouts_total{listener, phase}``.

Caps: a new connection beyond ``max_connections`` (or beyond ``max_connections_per_client``
from one address) is closed at once, before a byte is read, and counted in
``kvroute_client_connections_refused_total``. Not a 503: answering one means reading the
request head first, which hands the very connections being shed a head timeout's worth of a
descriptor each; a closed connection costs nothing, and a request that never started is safe
for any client or load balancer to retry elsewhere. The default cap derives from the
process's file-descriptor limit so that client connections alone never reach it: at the
limit the event loop cannot accept (uvloop then accepts and closes at once, asyncio pauses
accepting for a second; neither spins) and, worse, the router could not open the upstream
connections its clients' requests need.

Idle kept-alive connections are aiohttp's own ``keepalive_timeout`` (``idle_timeout_s``);
streams to slow readers stay bounded by the transport's write buffer (the proxy waits for
it to drain before reading more from the engine).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader

from router.http.protocol_errors import OpenAIErrorHandler
from router.http.settings import ListenConfig
from router.metrics import RouterMetrics

log = logging.getLogger("kvroute.http")

#: Phases with a read deadline (the ``phase`` label of ``kvroute_client_timeouts_total``).
HEAD, BODY = "head", "body"
#: Descriptors kept out of the derived connection cap: the listening sockets, Redis, the
#: engines' metric scrapes and event streams, log files.
RESERVED_FDS = 64


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; the soft limit now.

    Container runtimes often start processes at a soft limit of 1024 under a hard one of half a
    million: a router would run out of descriptors (and its derived connection cap would be 480)
    for no reason but a default kept for programs that use ``select()``. Go's runtime does the
    same at start; the hard limit is the operator's bound, and stays."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a platform refusing an unlimited soft limit: keep it
            return soft
    return hard


def derived_max_connections() -> int:
    """Client connections one process can hold with a descriptor to spare for each one's upstream
    connection: half of the soft ``RLIMIT_NOFILE`` less :data:`RESERVED_FDS` (at least 1)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, (soft - RESERVED_FDS) // 2)


class ConnectionGuard:
    """One listener's deadlines, caps and their counts (one per listener and process)."""

    def __init__(self, listener: str, settings: ListenConfig, metrics: RouterMetrics) -> None:
        self.header_timeout = settings.header_timeout_s
        self.body_timeout = settings.body_timeout_s
        self.max_connections = settings.max_connections or derived_max_connections()
        self.max_per_client = settings.max_connections_per_client
        #: Open connections, in all and by client address.
        self.open = 0
        self.by_address: dict[str, int] = {}
        self._gauge = metrics.client_connections.labels(listener)
        self._timeouts = {phase: metrics.client_timeouts.labels(listener, phase) for phase in (HEAD, BODY)}
        self._refused = {
            reason: metrics.client_refused.labels(listener, reason)
            for reason in ("max_connections", "max_connections_per_client")
        }

    def admit(self, transport: asyncio.BaseTransport) -> str | None:
        """The client's address if the connection may stay (then :meth:`release` it), else None."""
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else ""
        if self.open >= self.max_connections:
            self._refused["max_connections"].inc()
            return None
        if self.max_per_client is not None:
            if self.by_address.get(address, 0) >= self.max_per_client:
                self._refused["max_connections_per_client"].inc()
                return None
            self.by_address[address] = self.by_address.get(address, 0) + 1
        self.open += 1
        self._gauge.inc()
        return address

    def release(self, address: str) -> None:
        self.open -= 1
        self._gauge.dec()
        if self.max_per_client is not None:
            left = self.by_address[address] - 1
            if left:
                self.by_address[address] = left
            else:
                del self.by_address[address]

    def timed_out(self, phase: str) -> None:
        self._timeouts[phase].inc()


class ClientConnection(OpenAIErrorHandler):
    """One client connection: aiohttp's protocol with the guard's caps and read deadlines."""

    __slots__ = ("_address", "_body", "_deadline", "_guard", "_phase", "_timer")

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        #: The client's address while admitted (None: refused, or not yet connected).
        self._address: str | None = None
        #: HEAD or BODY while the client owes bytes by ``_deadline``; None while it owes none.
        self._phase: str | None = None
        self._deadline = 0.0
        #: The body being received (its payload stream), while incomplete.
        self._body: StreamReader | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        address = self._guard.admit(transport)
        if address is None:
            transport.close()
            return
        self._address = address
        super().connection_made(transport)
        self._expect(HEAD, self._loop.time() + self._guard.header_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._address is None:  # refused at connection_made: nothing was set up
            return
        self._guard.release(self._address)
        self._address = None
        self._phase = self._body = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        requests = self._request_count
        super().data_received(data)
        if self._request_count != requests:
            # A head (or several, pipelined) arrived whole: the latest one's body may still be coming.
            payload = self._messages[-1][1] if self._messages else None
            if payload is not None and not payload.is_eof():
                self._body = payload
                self._expect(BODY, self._loop.time() + self._guard.body_timeout)
            else:
                self._body = self._phase = None
        elif self._body is not None:
            if self._body.is_eof():
                self._body = self._phase = None
            else:
                self._deadline = self._loop.time() + self._guard.body_timeout
        elif self._phase is None:
            # The first bytes of the next request on a kept-alive connection: its head's clock starts.
            self._expect(HEAD, self._loop.time() + self._guard.header_timeout)
        # else: more of a head already timed; trickling bytes do not extend its deadline.

    def _expect(self, phase: str, deadline: float) -> None:
        self._phase, self._deadline = phase, deadline
        timer = self._timer
        if timer is not None and timer.when() > deadline:
            timer.cancel()
            timer = None
        if timer is None:
            self._timer = self._loop.call_at(deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        self._timer = None
        if self._phase is None or self.transport is None:
            return
        now = self._loop.time()
        if self._phase == BODY and self._reading_paused:
            # Not reading is the router's doing (the body's buffer is full until the app reads it).
            self._deadline = now + self._guard.body_timeout
        elif self._phase == HEAD and (self._request_in_progress or self._messages):
            # A pipelined head while the previous request is still answered (a stream may run
            # for minutes): its clock starts once the router is ready to read it.
            self._deadline = now + self._guard.header_timeout
        if now < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)
            return
        self._guard.timed_out(self._phase)
        log.debug(
            "closed a connection from %s: its request %s was not received in time", self._address, self._phase
        )
        self.transport.abort()
