"""The outermost middleware: every request's id, forwarding headers, span and access log line.

It runs around everything else (error shaping, auth, the handler), so a request the router
refuses itself (401, 404, 413, 429) has an id, a span and an access log line too. The id
(router/request_path/context.py) is set for the request's task, so every log line written
while it is handled carries it; it is answered in ``X-Request-Id`` and sent upstream.

Probes and scrapes (``/health``, ``/ready``, ``/metrics``) get an id but no access log line:
a probe every few seconds per kubelet would drown the requests in it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.http.auth import OPEN_PATHS
from router.http.logs import log_access
from router.http.reload import Runtime
from router.request_path.attempt import CLIENT_CLOSED
from router.request_path.context import CONTEXT, REQUEST_ID, REQUEST_ID_HEADER, RequestContext, request_id
from router.request_path.request import TENANT
from router.request_path.tracing import Tracing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def forwarded(request: web.Request) -> dict[str, str]:
    """``X-Forwarded-For`` with the client's address appended, and ``X-Forwarded-Proto``: the
    value a proxy in front set, else the scheme the client used here."""
    peer = request.remote or "unknown"
    chain = request.headers.get("X-Forwarded-For")
    return {
        "X-Forwarded-For": f"{chain}, {peer}" if chain else peer,
        "X-Forwarded-Proto": request.headers.get("X-Forwarded-Proto") or request.scheme,
    }


def request_context(runtime: Runtime, tracing: Tracing | None) -> Callable[..., Any]:
    """The middleware; ``runtime`` is read per request, so a reload switches the access log."""

    @web.middleware
    async def with_context(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        config = runtime.config
        rid = request_id(request.headers.get(REQUEST_ID_HEADER))
        token = REQUEST_ID.set(rid)
        upstream_headers = {REQUEST_ID_HEADER: rid}
        if config.upstream.forwarded_headers:
            upstream_headers.update(forwarded(request))
        access_log = config.logging.access_log and request.path not in OPEN_PATHS
        trace = tracing.start(request.headers, request.method, request.path, rid) if tracing else None
        context = RequestContext(rid, started, upstream_headers, access_log, trace)
        request[CONTEXT] = context
        status = int(CLIENT_CLOSED)
        try:
            response = await handler(request)
            # A proxied response was sent with the id already (the attempt's headers).
            if not response.prepared:
                response.headers[REQUEST_ID_HEADER] = rid
            status = context.status or response.status
            return response
        except asyncio.CancelledError:
            raise  # the client left: booked as 499 below
        except web.HTTPException as exc:  # a redirect, or an error openai_errors did not shape
            status = exc.status
            raise
        except BaseException:
            status = 500
            raise
        finally:
            if context.tenant is None:
                context.tenant = request.get(TENANT)
            if access_log:
                log_access(context, status, time.perf_counter() - started)
            if trace is not None:
                trace.end(status, _trace_fields(context))
            REQUEST_ID.reset(token)

    return with_context


def _trace_fields(context: RequestContext) -> dict[str, Any]:
    return {
        "endpoint": context.endpoint,
        "model": context.model,
        "tenant": context.tenant,
        "backend": context.backend,
        "reason": context.reason,
        "attempts": context.attempts,
        "cached_tokens": context.cached_tokens,
    }
