"""A request's identity and story, for logs and traces: its id, where it went, how it ended.

Every request gets an id: the client's ``X-Request-Id`` when it is sane (at most 128
characters of a safe set: letters, digits and ``._:/+=@-``, so it can go into a log line, a
header and a trace attribute as is), else a new random one. It goes upstream as
``X-Request-Id`` (vLLM's OpenAI server takes that header as its request id, so the engine's log
joins the router's), back to the client in the response headers, and into every log line written
while the request is handled (:data:`REQUEST_ID`, read by the log filter of
router/http/logs.py; a context variable is per asyncio task, so concurrent requests never
mix).

The dispatcher and each attempt fill the context in as they go (model, tenant, backend,
reason, time to first token, the engine's cached tokens); the HTTP layer writes the access
log line from it when the response has ended.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from router.request_path.tracing import RequestTrace

#: The id of the request the running task handles; None outside of one (background loops).
REQUEST_ID: ContextVar[str | None] = ContextVar("kvroute_request_id", default=None)
#: Request-scoped key of the RequestContext (set by router/http/app.py for every request).
CONTEXT = web.RequestKey("kvroute_context", "RequestContext")

REQUEST_ID_HEADER = "X-Request-Id"
_SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id(offered: str | None) -> str:
    """``offered`` when it is a sane id, else a new one (128 random bits, hex)."""
    if offered is not None and _SANE_ID.fullmatch(offered):
        return offered
    return os.urandom(16).hex()


class RequestContext:
    """One request's id and what happened to it; ``None`` fields were never reached."""

    __slots__ = (
        "attempts",
        "backend",
        "cached_tokens",
        "endpoint",
        "id",
        "matched_tokens",
        "model",
        "pair",
        "prompt_tokens",
        "reason",
        "started",
        "status",
        "tenant",
        "trace",
        "ttft",
        "upstream_headers",
        "wants_usage",
    )

    def __init__(
        self,
        request_id: str,
        started: float,
        upstream_headers: dict[str, str],
        wants_usage: bool = False,
        trace: RequestTrace | None = None,
    ) -> None:
        self.id = request_id
        #: ``time.perf_counter()`` when the request arrived.
        self.started = started
        #: Headers every attempt sends upstream on top of the client's (request id, forwarding).
        self.upstream_headers = upstream_headers
        #: Whether the engine's reported cached tokens should be read from the response (access log).
        self.wants_usage = wants_usage
        #: The request's span and its children, with ``tracing.enabled``.
        self.trace = trace
        self.endpoint: str | None = None
        self.model: str | None = None
        self.tenant: str | None = None
        self.prompt_tokens: int | None = None
        self.backend: str | None = None
        self.reason: str | None = None
        self.matched_tokens: int | None = None
        self.attempts = 0
        self.ttft: float | None = None
        self.cached_tokens: int | None = None
        #: Set when the status the client saw differs from the response's (a client that left).
        self.status: int | None = None
        #: A prefill/decode pair: (prefill backend, its reason, decode backend, its reason).
        self.pair: tuple[str, str, str, str] | None = None
