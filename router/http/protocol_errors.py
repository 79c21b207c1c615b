"""Errors aiohttp answers before any handler runs, in the OpenAI shape.

A request whose request line or headers cannot be parsed (too long, too many, invalid bytes,
not HTTP at all) never reaches the app, so the ``openai_errors`` middleware cannot see it:
aiohttp's connection protocol, ``web.RequestHandler``, answers it itself through
``RequestHandler.handle_error(request, status, exc, message)`` with a plain-text 400. The
same method answers a handler that raised something other than an HTTP exception (500) or a
timeout (504). :class:`OpenAIErrorHandler` overrides that one method and nothing else.

Why this way: ``handle_error`` is the single exit of every protocol-level error (parse
errors reach it through ``_make_error_handler``, handler crashes directly), with a stable
signature since aiohttp 1.x, so overriding it covers every path without touching parsing.
The class is installed through the public protocol-factory contract: ``web.Server`` is the
factory ``loop.create_server`` calls once per connection (``Server.__call__``), built from
its public constructor arguments. The one private hook is ``AppRunner._make_server`` (the
abstract method every ``BaseRunner`` implements): :class:`OpenAIErrorRunner` lets aiohttp
start the app and build its ``Server`` there, then serves with an :class:`OpenAIErrorServer`
built from that server's public attributes (``request_handler``, ``request_factory``) and
the runner's own arguments. If an aiohttp upgrade changes any of this, the raw-socket tests
in tests/test_protocol_errors.py fail.

Status codes: aiohttp reports every parse error as 400, so the exception decides:

* an over-long request line: 414 (RFC 9112 §3 asks 414 for a request-target longer than the
  server parses). aiohttp raises the same ``LineTooLong`` for an over-long request line and an
  over-long header field; the line's shape tells them apart (a request target starts with
  ``/``, the pure-Python parser's request line with a method and `` /``); a header value that
  itself starts with ``/`` is taken for a request target: a 414 instead of a 431, a 4xx JSON
  error either way;
* an over-long header field or too many header fields: 431;
* anything else unparseable: 400. Bodies too large stay 413 (the app's ``client_max_size``).

Messages are fixed texts naming the limit: the offending bytes are never echoed back.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, BadStatusLine, InvalidHeader, InvalidURLError, LineTooLong

from router.errors import OpenAIError

#: What aiohttp's parsers report as the start of an over-long request line (see the docstring).
_REQUEST_LINE = re.compile(rb"^(?:[A-Za-z]+ +)?/")
#: aiohttp's message for more than ``max_headers`` header fields (C and Python parsers alike).
_TOO_MANY_HEADERS = "Too many headers"
#: llhttp's (the C parser's) message for a byte not allowed in a header name.
_INVALID_HEADER = "Invalid header"


#: The message of each parse-error code; ``{h}`` is the connection's handler, holding the limits.
_MESSAGES = {
    "request_line_too_long": "Request line longer than {h.max_line_size} bytes (limits.max_line_size).",
    "header_field_too_large": (
        "Request header field longer than {h.max_field_size} bytes (limits.max_field_size)."
    ),
    "too_many_headers": "More than {h.max_headers} request header fields (limits.max_headers).",
    "invalid_header": "Invalid HTTP header.",
    "invalid_request_target": "Invalid request target.",
    "invalid_request_line": "Malformed HTTP request line.",
    "malformed_request": "Malformed HTTP request.",
}


def classify(exc: BaseException | None) -> tuple[int, str]:
    """Status and error code for a request aiohttp could not parse (also what the log names)."""
    if isinstance(exc, LineTooLong):
        line = exc.args[0] if exc.args and isinstance(exc.args[0], (bytes, bytearray)) else b""
        if _REQUEST_LINE.match(line):
            return 414, "request_line_too_long"
        return 431, "header_field_too_large"
    if isinstance(exc, BadHttpMessage) and exc.message.startswith(_TOO_MANY_HEADERS):
        return 431, "too_many_headers"
    if isinstance(exc, InvalidHeader) or (
        isinstance(exc, BadHttpMessage) and exc.message.startswith(_INVALID_HEADER)
    ):
        return 400, "invalid_header"
    if isinstance(exc, InvalidURLError):
        return 400, "invalid_request_target"
    if isinstance(exc, BadStatusLine):
        return 400, "invalid_request_line"
    return 400, "malformed_request"


def parse_error(exc: BaseException | None, handler: web.RequestHandler) -> OpenAIError:
    """The OpenAI error for a request aiohttp could not parse."""
    status, code = classify(exc)
    return OpenAIError(status, _MESSAGES[code].format(h=handler), code=code)


class OpenAIErrorHandler(web.RequestHandler):
    """aiohttp's connection protocol, answering its own errors in the OpenAI shape."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's own first: it logs the error and raises ConnectionError when part of a
        # response was already sent (the connection is then broken, nothing can follow).
        super().handle_error(request, status, exc, message)
        if status == 500:
            error = OpenAIError(500, "The router failed to handle the request.", code="internal_error")
        elif status < 500:
            error = parse_error(exc, self)
        else:
            error = OpenAIError(status, "The request timed out in the router.", code="router_timeout")
        response = error.response()
        response.force_close()
        return response


class OpenAIErrorServer(web.Server):
    """``web.Server`` whose connections are ``handler_class`` (an :class:`OpenAIErrorHandler`),
    each built with ``handler_args`` besides aiohttp's own arguments."""

    def __init__(
        self,
        handler: Any,
        *,
        request_factory: Any = None,
        handler_cancellation: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
        handler_class: type[OpenAIErrorHandler] = OpenAIErrorHandler,
        handler_args: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            handler,
            request_factory=request_factory,
            handler_cancellation=handler_cancellation,
            loop=loop,
            **kwargs,
        )
        self._handler_loop = loop or asyncio.get_running_loop()
        self._handler_class = handler_class
        #: What every connection's protocol is built with (the named arguments are the Server's).
        self._handler_kwargs = {**kwargs, **(handler_args or {})}

    def __call__(self) -> web.RequestHandler:
        return self._handler_class(self, loop=self._handler_loop, **self._handler_kwargs)


class OpenAIErrorRunner(web.AppRunner):
    """``web.AppRunner`` serving through :class:`OpenAIErrorServer` (same arguments, and that
    server's ``handler_class`` and ``handler_args``)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        server_only = ("handler_class", "handler_args")
        super().__init__(app, **{k: v for k, v in kwargs.items() if k not in server_only})
        #: What aiohttp's Server takes besides the app's handler (the runner keeps the others).
        self._server_kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("handle_signals", "shutdown_timeout", "handler_cancellation")
        }

    async def _make_server(self) -> web.Server:
        stock = await super()._make_server()  # starts the app; its Server is replaced unused
        return OpenAIErrorServer(
            stock.request_handler,
            request_factory=stock.request_factory,
            handler_cancellation=stock.handler_cancellation,
            **self._server_kwargs,
        )
