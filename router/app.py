"""The HTTP face of the router: routes, body limits, error shapes, and the app's lifecycle.

The request path starts in ``completions`` below: read the body once, parse it into a
RoutableRequest (``router.request``), and hand it to the Dispatcher (``router.dispatch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from policies.routing import build_policy
from router.backends import BackendPool
from router.config import Config
from router.dispatch import Dispatcher
from router.errors import OpenAIError
from router.health import HealthMonitor
from router.index import MemoryIndex, PrefixIndex
from router.metrics import RouterMetrics
from router.proxy import Proxy
from router.request import CHAT, COMPLETIONS, parse_request

log = logging.getLogger("kvroute.app")

DISPATCHER = web.AppKey("dispatcher", Dispatcher)
CONFIG = web.AppKey("config", Config)
POOL = web.AppKey("pool", BackendPool)
METRICS = web.AppKey("metrics", RouterMetrics)
INDEX = web.AppKey("index", PrefixIndex)


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves in the OpenAI shape, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge as exc:
        return OpenAIError(413, f"Request body too large: {exc.text}", code="body_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return OpenAIError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_")).response()


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(
            413,
            f"Request body of {request.content_length} bytes exceeds the limit of {limit} bytes.",
            code="body_too_large",
        )
    return await request.read()


def _completions_handler(endpoint: str):
    async def completions(request: web.Request) -> web.StreamResponse:
        config = request.app[CONFIG]
        body = await _read_body(request, config.limits.max_body_bytes)
        routable = parse_request(
            endpoint, body, request.headers, config.tenancy, config.routing.session_header
        )
        return await request.app[DISPATCHER].dispatch(request, routable)

    return completions


async def models(request: web.Request) -> web.Response:
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "kvroute"} for m in request.app[POOL].models()
    ]
    return _json({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    if request.app[POOL].any_healthy():
        return _json({"status": "ready"})
    return _json({"status": "no healthy backend"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    m, pool, index = request.app[METRICS], request.app[POOL], request.app[INDEX]
    for backend in pool:
        m.healthy.labels(backend.name).set(1 if backend.healthy else 0)
    m.index_blocks.set(index.size())
    body = generate_latest(m.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_index(config: Config) -> PrefixIndex:
    index = MemoryIndex(config.index.max_blocks)
    for backend in config.backends:
        index.add_backend(backend.name, backend.capacity_blocks or config.index.backend_capacity_blocks)
    return index


def build_app(config: Config) -> web.Application:
    """The router as an aiohttp Application; its background work starts and stops with it."""
    app = web.Application(middlewares=[openai_errors], client_max_size=config.limits.max_body_bytes)
    pool = BackendPool(config.backends)
    index = build_index(config)
    router_metrics = RouterMetrics()
    app[CONFIG] = config
    app[POOL] = pool
    app[INDEX] = index
    app[METRICS] = router_metrics

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(
            total=None, connect=config.upstream.connect_timeout_s, sock_read=config.upstream.read_timeout_s
        )
        # limit=0: the router must never queue requests behind its own connection pool;
        # auto_decompress=False: bodies pass through byte for byte.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            policy = build_policy(config.routing.policy, config.routing.params, seed=config.routing.seed)
            app[DISPATCHER] = Dispatcher(config, pool, index, policy, Proxy(session), router_metrics)
            monitor = HealthMonitor(pool, session, config.health)
            await monitor.check_once()
            task = asyncio.create_task(monitor.run(), name="kvroute-health")
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await index.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", _completions_handler(CHAT))
    app.router.add_post("/v1/completions", _completions_handler(COMPLETIONS))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app
