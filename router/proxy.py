"""Forward one request to one backend and pass the response through as it arrives.

The body goes upstream byte for byte; the response comes back with its status and body
unchanged. Streams are never buffered: each chunk is written to the client as soon as the
backend sends it, with the client's own backpressure (``write`` waits when the client is
slow). The first chunk is read *before* the client sees anything, so a backend that fails
before sending a byte can still be replaced by another (``UpstreamFailed``). After that,
a failure ends the stream with an SSE error event and is never retried.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.errors import OpenAIError

#: RFC 9110 §7.6.1 connection-specific headers, plus those aiohttp recomputes itself.
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
    """The stream broke after the client got bytes: it was ended with an error event, not retried."""

    def __init__(self, kind: str, response: web.StreamResponse) -> None:
        super().__init__(kind)
        self.kind = kind
        self.response = response


class ClientGone(Exception):
    """The client disconnected mid-stream; the upstream request is abandoned with it."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


def failure_kind(exc: BaseException) -> str:
    """A small fixed vocabulary for the ``kind`` metric label."""
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return "disconnect"
    return "other"


def _copy_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _NOT_FORWARDED)


class Proxy:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def forward(
        self,
        request: web.Request,
        url: str,
        body: bytes,
        extra_headers: Mapping[str, str],
        on_accepted: Callable[[], None],
        on_first_byte: Callable[[float], None],
    ) -> web.StreamResponse:
        """Send ``body`` to ``url`` and answer ``request`` with what comes back.

        ``on_accepted`` runs once the backend answered with a success status (it has the
        prompt); ``on_first_byte`` gets the time the first byte of a stream arrived.
        """
        try:
            upstream = await self.session.post(url, data=body, headers=_copy_headers(request.headers))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamFailed.from_exc(exc) from exc
        finished = False
        try:
            if upstream.status < 400:
                on_accepted()
            headers = _copy_headers(upstream.headers)
            headers.update(extra_headers)
            if upstream.content_type == "text/event-stream":
                response = await self._stream(request, upstream, headers, on_first_byte)
            else:
                response = await self._buffered(upstream, headers)
            finished = True
            return response
        finally:
            # A response not read to its end must not go back to the pool: closing the
            # connection is also what tells the engine to stop working on it.
            if finished:
                upstream.release()
            else:
                upstream.close()

    @staticmethod
    async def _buffered(upstream: aiohttp.ClientResponse, headers: CIMultiDict[str]) -> web.Response:
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamFailed.from_exc(exc) from exc
        return web.Response(status=upstream.status, body=data, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        headers: CIMultiDict[str],
        on_first_byte: Callable[[float], None],
    ) -> web.StreamResponse:
        try:
            first = await upstream.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamFailed.from_exc(exc) from exc
        on_first_byte(time.perf_counter())

        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        chunk = first
        while chunk:
            try:
                await response.write(chunk)
            except ConnectionResetError as exc:
                # The client went away; leaving closes the upstream connection (see forward).
                raise ClientGone(response) from exc
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                await self._end_with_error(response, failure_kind(exc))
                raise StreamInterrupted(failure_kind(exc), response) from exc
        await response.write_eof()
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
