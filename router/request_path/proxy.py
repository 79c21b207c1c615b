"""Forward one request to one backend and pass the response through as it arrives.

The body goes upstream byte for byte; the response comes back with its status and body
unchanged. Streams are never buffered: each chunk is written to the client as soon as the
backend sends it (from the upstream connection's read callback, :func:`relay_body`), with the
client's own backpressure (the backend's socket is not read while the client's is backed
up). The first chunk is read *before* the client sees anything, so a backend that fails
before sending a byte can still be replaced by another (``UpstreamFailed``). After that,
a failure ends the stream with an SSE error event and is never retried.

Before the first byte a backend fails when it cannot be reached, when it answers 502, 503
or 504 (a gateway or an engine that is overloaded, starting or stopping: another replica
may well serve the request), or when the first byte does not come within the attempt's
first-byte timeout. Every other status passes through to the client unchanged: a 4xx is
the client's request at fault and would fail the same anywhere; a 500 may be caused by the
request itself and is not replayed on the rest of the fleet. One 500 is recognised as the
engine's, not the request's: vLLM's answer to a request that arrives while it shuts down or
after its engine core died (``SHUTTING_DOWN_MARKERS``), which another replica serves.

The proxy keeps no books: it reports each step to the request's attempt
(router/request_path/attempt.py), which holds the counters, the circuit and the beliefs.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from aiohttp import web
from multidict import CIMultiDict

from router.errors import OpenAIError
from router.fleet.tls import BackendTLS
from router.request_path.request import TENANT
from router.request_path.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from router.request_path.usage import ResponseTap

#: RFC 9110 §7.6.1 connection-specific headers, plus those the router sets itself.
_NOT_FORWARDED = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
        # The router read the whole body before choosing a backend: a client's 100-continue
        # expectation was met there, and the engine gets the body with the request head.
        "Expect",
    )
)


class UpstreamFailed(Exception):
    """The backend failed before any byte reached the client: safe to try another backend."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind

    @classmethod
    def from_exc(cls, exc: BaseException) -> UpstreamFailed:
        return cls(failure_kind(exc), str(exc) or type(exc).__name__)


class StreamInterrupted(Exception):
    """The stream broke after the client got bytes: it was ended with an error event, not retried
    (the proxy reports it to the attempt, and answers the client with what it sent)."""

    def __init__(self, kind: str, response: web.StreamResponse) -> None:
        super().__init__(kind)
        self.kind = kind
        self.response = response


class ClientGone(Exception):
    """The client disconnected mid-response; the upstream request is abandoned with it (the
    proxy reports it to the attempt)."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


def failure_kind(exc: BaseException) -> str:
    """A small fixed vocabulary for the ``kind`` metric label (router/request_path/upstream.py
    names the kinds)."""
    if isinstance(exc, UpstreamError):
        return exc.kind
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    return "other"


#: The client connection's write high-water mark where its transport does not say: asyncio's
#: own default for its socket transports (64 KiB).
DEFAULT_HIGH_WATER = 64 * 1024

#: Statuses that mean "this replica cannot serve now", not "this request is wrong".
RETRYABLE_STATUSES = frozenset({502, 503, 504})

#: What a 500's body says when the engine is stopping or stopped, not failing on the request.
#: vLLM (0.32) answers a request that arrives during its shutdown with Python's
#: ``RuntimeError("cannot schedule new futures after shutdown")``, and one that reaches its API
#: server after its engine core died with ``EngineDeadError`` ("EngineCore encountered an
#: issue..."). Narrow on purpose: any other 500 passes through.
SHUTTING_DOWN_MARKERS = (
    b"cannot schedule new futures after shutdown",
    b"EngineCore encountered an issue. See stack trace (above) for the root cause.",
)


def _copy_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    # Headers the Connection header names are hop-by-hop as well (RFC 9110 §7.6.1).
    connection = headers.get("Connection")
    dropped = _NOT_FORWARDED
    if connection:
        dropped = dropped | {token.strip().lower() for token in connection.split(",")}
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in dropped])


@dataclass(frozen=True, slots=True)
class Replay:
    """What a request the router sends later on its own (a refresh, router/request_path/retention.py)
    keeps of the client's request it stems from: the headers, the path, and whether a tenant
    was authenticated for it, all the proxy reads of a client's request."""

    headers: CIMultiDict[str]
    raw_path: str
    tenant: bool

    @classmethod
    def of(cls, request: web.Request) -> Replay:
        headers = _copy_headers(request.headers)
        for name in _TRACE_CONTEXT:  # the client's trace ended with its request
            headers.popall(name, None)
        return cls(headers, request.raw_path, TENANT in request)

    def __contains__(self, key: object) -> bool:
        return key is TENANT and self.tenant


#: W3C trace context headers: a replayed request does not belong to the client's trace.
_TRACE_CONTEXT = ("traceparent", "tracestate")

#: What the proxy sends upstream on behalf of: a client's request, or one replayed from it.
Outgoing = web.Request | Replay

_T = TypeVar("_T")

if sys.version_info >= (3, 11):

    async def _bounded(awaitable: Awaitable[_T], timeout: float | None) -> _T:
        """``awaitable`` within ``timeout`` s, in the caller's task: ``wait_for`` would start a new
        task for every request (3.10 and 3.11), which the profile of the hot path showed."""
        async with asyncio.timeout(timeout):
            return await awaitable

else:
    _bounded = asyncio.wait_for


class Forwarding(Protocol):
    """What the proxy needs of one attempt (router/request_path/attempt.py), and what it reports
    to it: ``answered``, ``first_byte``, then one of ``finished``, ``interrupted``, ``client_gone``.
    A failure before the client got a byte is raised as UpstreamFailed instead."""

    url: str
    #: The engine's TLS settings (an ``https://`` URL), or None.
    tls: BackendTLS | None
    #: The engine's own API key (``backends[].upstream_api_key``), or None.
    upstream_key: str | None
    body: bytes
    #: Headers added to the response (``x-kvroute-*``, the request id).
    headers: Mapping[str, str]
    #: Headers set on the request upstream, over the client's (request id, forwarding, trace).
    upstream_headers: Mapping[str, str]
    #: Bounds the wait from sending to the first body byte.
    first_byte_timeout: float | None
    #: Sees the response go by, for the engine's usage report (router/request_path/usage.py).
    tap: ResponseTap | None

    def answered(self, status: int) -> None: ...

    def first_byte(self, at: float) -> None: ...

    def finished(self, status: int) -> None: ...

    def interrupted(self, kind: str) -> None: ...

    def client_gone(self) -> None: ...


class Proxy:
    def __init__(self, upstream: UpstreamPool) -> None:
        self.upstream = upstream

    async def forward(self, request: web.Request, attempt: Forwarding) -> web.StreamResponse:
        """Send ``attempt.body`` to ``attempt.url`` (at the request's own path and query) and answer
        ``request`` with what comes back, reporting each step to ``attempt``."""
        upstream, first = await self.open(request, attempt)
        return await self.relay(request, attempt, upstream, first)

    async def open(self, request: Outgoing, attempt: Forwarding) -> tuple[UpstreamResponse, bytes]:
        """Send the request and read the first chunk within the attempt's first-byte timeout; a
        failure (a retryable status included) is UpstreamFailed. The caller owns the response:
        :meth:`relay` it, or close it."""
        timeout = attempt.first_byte_timeout
        try:
            return await _bounded(self._open(request, attempt), timeout)
        except UpstreamError as exc:
            raise UpstreamFailed.from_exc(exc) from exc
        except asyncio.TimeoutError as exc:
            raise UpstreamFailed("first_byte_timeout", f"no first byte in {timeout:.3g} s") from exc

    async def relay(
        self, request: web.Request, attempt: Forwarding, upstream: UpstreamResponse, first: bytes
    ) -> web.StreamResponse:
        """Answer ``request`` with an opened response, streamed as it arrives."""
        read_to_end = False
        try:
            attempt.answered(upstream.status)
            headers = _copy_headers(upstream.headers)
            headers.update(attempt.headers)
            if upstream.content_type == "text/event-stream":
                attempt.first_byte(time.perf_counter())
                response = await self._stream(request, upstream, first, headers, attempt.tap)
            else:
                response = await self._buffered(request, upstream, first, headers, attempt.tap)
            read_to_end = True
            attempt.finished(upstream.status)
            return response
        except StreamInterrupted as exc:
            attempt.interrupted(exc.kind)
            return exc.response
        except ClientGone as exc:
            attempt.client_gone()
            return exc.response
        finally:
            # A response not read to its end must not go back to the pool: closing the
            # connection is also what tells the engine to stop working on it.
            if read_to_end:
                upstream.release()
            else:
                upstream.close()

    async def fetch(self, request: Outgoing, attempt: Forwarding) -> tuple[int, bytes]:
        """Send the request and read its whole (non-streamed) answer for the router itself, not
        the client: a prefill engine's reply. Its end is the prefill's first byte. Failures
        before the answer is whole are UpstreamFailed."""
        upstream, first = await self.open(request, attempt)
        try:
            try:
                data = first + await upstream.read()
            except (UpstreamError, asyncio.TimeoutError) as exc:
                raise UpstreamFailed.from_exc(exc) from exc
            attempt.answered(upstream.status)
            attempt.first_byte(time.perf_counter())
            if attempt.tap is not None:
                attempt.tap.body(data)
            attempt.finished(upstream.status)
        except BaseException:
            upstream.close()
            raise
        upstream.release()
        return upstream.status, data

    async def _open(self, request: Outgoing, attempt: Forwarding) -> tuple[UpstreamResponse, bytes]:
        """Send the request and read the first chunk; a retryable status fails the attempt."""
        outgoing = _copy_headers(request.headers)
        outgoing.update(attempt.upstream_headers)
        if attempt.upstream_key is not None or TENANT in request:
            upstream_credentials(outgoing, attempt.upstream_key)
        upstream = await self.upstream.post(
            attempt.url, request.raw_path, outgoing.items(), attempt.body, attempt.tls
        )
        try:
            if upstream.status in RETRYABLE_STATUSES:
                detail = f"answered {upstream.status} {upstream.reason}"
                raise UpstreamFailed(f"http_{upstream.status}", detail)
            first = await upstream.readany()
            if upstream.status == 500 and any(marker in first for marker in SHUTTING_DOWN_MARKERS):
                raise UpstreamFailed("engine_stopping", "answered 500: the engine is shutting down")
        except BaseException:
            upstream.close()
            raise
        return upstream, first

    @staticmethod
    async def _buffered(
        request: web.Request,
        upstream: UpstreamResponse,
        first: bytes,
        headers: CIMultiDict[str],
        tap: ResponseTap | None,
    ) -> web.Response:
        try:
            data = first + await upstream.read()
        except (UpstreamError, asyncio.TimeoutError) as exc:
            raise UpstreamFailed.from_exc(exc) from exc
        if tap is not None:
            data = tap.body(data)
        response = web.Response(status=upstream.status, body=data, headers=headers)
        # Sent here rather than by aiohttp after the handler returns: the attempt's bookkeeping
        # (metrics, circuit, counters) then runs after the client has its answer.
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionResetError as exc:
            raise ClientGone(response) from exc
        return response

    async def _stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        first: bytes,
        headers: CIMultiDict[str],
        tap: ResponseTap | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        try:
            await relay_body(request, response, upstream, first, tap)
            await response.write_eof()
        except ConnectionResetError as exc:
            # The client went away; leaving closes the upstream connection (see forward).
            raise ClientGone(response) from exc
        except (UpstreamError, asyncio.TimeoutError) as exc:
            await self._end_with_error(response, failure_kind(exc))
            raise StreamInterrupted(failure_kind(exc), response) from exc
        return response

    @staticmethod
    async def _end_with_error(response: web.StreamResponse, kind: str) -> None:
        error = OpenAIError(
            502,
            f"The backend failed mid-stream ({kind}); the response is incomplete.",
            code="upstream_stream_error",
        )
        try:
            await response.write(error.sse_event())
            await response.write_eof()
        except ConnectionResetError:
            pass


async def relay_body(
    request: web.Request,
    response: web.StreamResponse,
    upstream: UpstreamResponse,
    first: bytes,
    tap: ResponseTap | None = None,
) -> None:
    """Send ``first`` and the rest of ``upstream``'s body on the prepared ``response`` as it
    arrives. ConnectionResetError: the client went away; UpstreamError or TimeoutError: the
    backend failed. The response is left open (``write_eof`` is the caller's)."""
    # aiohttp has sent the head at prepare; the chunks after the first bypass its writer.
    await response.write(tap.chunk(first) if tap is not None else first)
    client = _ClientSink(request, response, tap)
    while not await upstream.pipe(client):
        if client.gone:
            raise ConnectionResetError("client disconnected")
        await request.writer.drain()


class _ClientSink:
    """Writes a stream's chunks to the client's connection from the upstream connection's
    protocol callback (:meth:`UpstreamResponse.pipe`), framed as aiohttp frames them.

    Relaying an SSE stream is the router's largest cost per request: one chunk per token. This
    saves each chunk a task switch and aiohttp's two coroutine layers; the bytes on the wire
    are the same. It refuses more (and the proxy awaits aiohttp's drain) when the client's
    connection buffers past its high-water mark, or is closing (``gone``).
    """

    __slots__ = ("chunked", "gone", "high_water", "tap", "transport")

    def __init__(self, request: web.Request, response: web.StreamResponse, tap: ResponseTap | None) -> None:
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("client disconnected")
        self.transport = transport
        # Set by aiohttp when it prepared the response (HTTP/1.1, no Content-Length).
        self.chunked = response.headers.get("Transfer-Encoding") == "chunked"
        try:
            self.high_water = transport.get_write_buffer_limits()[1]
        except NotImplementedError:  # asyncio's TLS transport before Python 3.10.3 (bpo-46487)
            self.high_water = DEFAULT_HIGH_WATER
        self.tap = tap
        self.gone = False

    def __call__(self, chunk: bytes) -> bool:
        transport = self.transport
        if transport.is_closing():
            self.gone = True
            return False
        if self.tap is not None:
            chunk = self.tap.chunk(chunk)
        if chunk:
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)
        return transport.get_write_buffer_size() <= self.high_water


def upstream_credentials(headers: CIMultiDict[str], backend_key: str | None) -> None:
    """The credentials an engine gets, for a request with an engine key or a client key.

    The engine's own key replaces the client's; with client keys on, the client's key is the
    router's credential and is dropped. Without either, the client's Authorization goes
    through unchanged (this is not called), for engines that check their callers themselves.
    """
    headers.popall("Authorization", None)
    if backend_key is not None:
        headers["Authorization"] = f"Bearer {backend_key}"
