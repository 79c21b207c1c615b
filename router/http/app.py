"""The HTTP face of the router: routes, body limits, error shapes, and the app's lifecycle.

Every request first gets its id and context (router/http/request_context.py). A forwarded
endpoint's request path starts in ``_forwarding_handler`` below: read the body once, parse it
into a RoutableRequest (``router.request_path.request``), and hand it to the Dispatcher
(``router.request_path.dispatch``). The endpoints are listed in router/request_path/endpoints.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.config import Config, ConfigSource
from router.errors import OpenAIError
from router.fleet.backends import Backend, BackendPool
from router.fleet.shared_load import start_shared_load
from router.fleet.upkeep import FleetUpkeep
from router.fleet.worker_sync import WorkerSync
from router.http.admin import admin_routes
from router.http.auth import auth_middleware
from router.http.config_view import config_routes
from router.http.reload import Runtime, reload_routes
from router.http.request_context import request_context
from router.http.worker_metrics import MetricsUnavailable, WorkerGroup, group_exposition
from router.index import PrefixIndex
from router.index.build import build_index
from router.index.worker_index import WorkerIndex
from router.metrics import RouterMetrics, WorkerSyncMetrics
from router.request_path.context import CONTEXT
from router.request_path.dispatch import Dispatcher
from router.request_path.endpoints import ENDPOINTS, LABEL_OF_PATH, Endpoint
from router.request_path.proxy import Proxy
from router.request_path.request import TENANT, parse_request
from router.request_path.tracing import Tracing
from router.request_path.upstream import UpstreamPool

log = logging.getLogger("kvroute.app")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DISPATCHER = web.AppKey("dispatcher", Dispatcher)
CONFIG = web.AppKey("config", Config)
POOL = web.AppKey("pool", BackendPool)
METRICS = web.AppKey("metrics", RouterMetrics)
INDEX = web.AppKey("index", PrefixIndex)
#: What a config reload may change (router/http/reload.py); the request path reads it per request.
RUNTIME = web.AppKey("runtime", Runtime)
#: The admin API's own app, served on ``admin.listen`` (router/http/server.py); absent when the
#: admin API shares the main listener (``admin.listen: null``, allowed only with an admin key).
ADMIN_APP = web.AppKey("admin_app", web.Application)
#: The tracer provider, with ``tracing.enabled`` (router/request_path/tracing.py).
TRACING = web.AppKey("tracing", Tracing)
#: ``/metrics``' own app when ``metrics.listen`` puts it on a separate port (router/http/server.py).
METRICS_APP = web.AppKey("metrics_app", web.Application)


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves in the OpenAI shape, including aiohttp's own 404/405/413.

    Errors the router answers itself are counted in ``kvroute_requests_total`` here, with
    empty model and backend: the model named in a bad request is client input and must not
    become a label value. Responses from a backend are counted by the dispatcher.
    """
    try:
        return await handler(request)
    except OpenAIError as exc:
        error = exc
    except web.HTTPRequestEntityTooLarge as exc:
        error = OpenAIError(413, f"Request body too large: {exc.text}", code="body_too_large")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = OpenAIError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))
    # ``endpoint`` label by path; any other path is ``other`` (bounded labels).
    endpoint = LABEL_OF_PATH.get(request.path, "other")
    request.app[METRICS].requests_by(endpoint, "", "", str(error.status)).inc()
    return error.response()


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(
            413,
            f"Request body of {request.content_length} bytes exceeds the limit of {limit} bytes.",
            code="body_too_large",
        )
    return await request.read()


def _forwarding_handler(endpoint: Endpoint):
    """The handler of an endpoint forwarded to the engines (router/request_path/endpoints.py)."""
    name = endpoint.name

    async def forward(request: web.Request) -> web.StreamResponse:
        runtime = request.app[RUNTIME]
        config = runtime.config
        body = await _read_body(request, config.limits.max_body_bytes)
        tenancy, session_header, tenant = config.tenancy, config.routing.session_header, request.get(TENANT)
        routable = parse_request(name, body, request.headers, tenancy, session_header, tenant)
        # Per-tenant limits (router/http/ratelimit.py): refused before any backend is touched; the
        # slot is held until the response (stream included) ends, on every path.
        prompt_tokens = math.ceil(len(routable.prompt) / config.index.chars_per_token)
        with runtime.limiter.admit(routable.tenant, prompt_tokens):
            return await request.app[DISPATCHER].dispatch(request, routable, request[CONTEXT])

    return forward


async def models(request: web.Request) -> web.Response:
    """Each engine's own model entry (vLLM's ``max_model_len``, ``root``, ``parent``...), the
    first seen winning for a model several serve, with ``kvroute_backends`` naming them all."""
    return _json({"object": "list", "data": request.app[POOL].model_cards()})


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    if request.app[POOL].any_healthy():
        return _json({"status": "ready"})
    return _json({"status": "no healthy backend"}, status=503)


def local_exposition(metrics: RouterMetrics, pool: BackendPool, index: PrefixIndex) -> bytes:
    """This process's metrics, the backends' state gauges read from the live pool now."""
    for backend in pool:
        backend.show(metrics)
        capacity = index.capacity_of(backend.name)
        if capacity is not None:
            metrics.index_capacity.labels(backend.name).set(capacity)
    metrics.index_blocks.set(index.size())
    return generate_latest(metrics.registry)


def _end_exchanges(upstream: UpstreamPool, backend: Backend) -> None:
    """A backend failed its health checks: end what the router has open there (see UpstreamPool.abort)."""
    ended = upstream.abort(backend.url, f"{backend.name} failed its health checks")
    if ended:
        log.warning("backend %s is down: ended %d request(s) in flight there", backend.name, ended)


def _metrics_handler(
    metrics: RouterMetrics, pool: BackendPool, index: PrefixIndex, group: WorkerGroup | None
) -> Handler:
    """``GET /metrics``: this process's, or with ``serve --workers N`` the whole group's
    (router/http/worker_metrics.py)."""

    async def handler(request: web.Request) -> web.Response:
        body = local_exposition(metrics, pool, index)
        if group is not None:
            try:
                body = await group_exposition(body, group)
            except MetricsUnavailable as exc:
                log.warning("%s", exc)
                raise OpenAIError(503, str(exc), code="metrics_unavailable") from None
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handler


async def _start_worker_sync(
    config: Config, group: WorkerGroup | None, pool: BackendPool, index: PrefixIndex, metrics: RouterMetrics
) -> WorkerSync | None:
    """A worker of ``serve --workers N`` with the memory store shares its index and load with the
    other workers (router/fleet/worker_sync.py); with the Redis store, Redis does."""
    if group is None or config.index.store != "memory":
        return None
    sync = WorkerSync(
        group.index,
        group.sync_socket_path(group.index),
        [group.sync_socket_path(peer) for peer in group.peers],
        pool,
        index if isinstance(index, WorkerIndex) else None,
        WorkerSyncMetrics(metrics.registry),
    )
    await sync.start()
    return sync


def build_app(
    config: Config, config_path: str | ConfigSource | None = None, group: WorkerGroup | None = None
) -> web.Application:
    """The router as an aiohttp Application; its background work starts and stops with it.

    ``config_path`` is the file a reload re-reads (SIGHUP, ``POST /admin/reload``), with the
    command line's settings on top when it is a :class:`ConfigSource`; ``group``: this process
    is one of ``serve --workers N``'s (its ``/metrics`` reports them all).
    """
    pool = BackendPool(config.backends, config.health, config.upstream.tls)
    router_metrics = RouterMetrics()
    runtime = Runtime(config, pool, router_metrics.registry, config_path)
    # Client keys on /v1/, the admin key on /admin/ (router/http/auth.py), read through the runtime
    # so that a reload switches keys for the next request.
    guard = auth_middleware(lambda: runtime.keys, lambda: runtime.admin_key)
    tracing = Tracing(config.tracing) if config.tracing.enabled else None
    middlewares = [request_context(runtime, tracing), openai_errors, guard]
    app = web.Application(middlewares=middlewares, client_max_size=config.limits.max_body_bytes)
    app[RUNTIME] = runtime
    if tracing is not None:
        app[TRACING] = tracing
    index = build_index(config, router_metrics, worker=group is not None)
    router_metrics.watch_index(index)
    app[CONFIG] = config
    app[POOL] = pool
    app[INDEX] = index
    app[METRICS] = router_metrics

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(
            total=None, connect=config.upstream.connect_timeout_s, sock_read=config.upstream.read_timeout_s
        )
        # This session carries the side traffic (health checks, metric scrapes, event-source
        # discovery); requests go through UpstreamPool (router/request_path/upstream.py), built for
        # the hot path.
        # limit=0: no queueing behind the pool; DummyCookieJar: never keep a backend's cookies.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        ) as session:
            upstream = UpstreamPool(config.upstream)
            pool.subscribe(lambda backend: None, lambda backend: upstream.forget(backend.url))
            pool.subscribe_down(lambda backend: _end_exchanges(upstream, backend))
            app[DISPATCHER] = Dispatcher(config, pool, index, config.policy, Proxy(upstream), router_metrics)
            runtime.dispatcher = app[DISPATCHER]
            upkeep = FleetUpkeep(config, pool, index, router_metrics, session)
            await upkeep.start()
            await index.start()
            shared_load = start_shared_load(index, pool)
            worker_sync = await _start_worker_sync(config, group, pool, index, router_metrics)
            kv_events = None
            if config.index.mode == "events":
                # Imported only in precise mode: pyzmq is the `precise` extra's, not a dependency.
                from router.kv_events.subscriber import start_kv_events

                kv_events = start_kv_events(config, pool, index, router_metrics.registry, session)
            app[DISPATCHER].start()
            try:
                yield
            finally:
                if kv_events is not None:
                    await kv_events.close()
                await upkeep.close()
                await app[DISPATCHER].close()
                if shared_load is not None:
                    await shared_load.close()
                if worker_sync is not None:
                    await worker_sync.close()
                await index.close()
                upstream.close()
                if tracing is not None:
                    tracing.shutdown()

    app.cleanup_ctx.append(lifecycle)
    for endpoint in ENDPOINTS:
        handler = _forwarding_handler(endpoint)
        for path in endpoint.paths:
            app.router.add_post(path, handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    metrics = _metrics_handler(router_metrics, pool, index, group)
    if config.metrics.listen is None:
        app.router.add_get("/metrics", metrics)
    else:
        metrics_app = web.Application(middlewares=[openai_errors])
        metrics_app.router.add_get("/metrics", metrics)
        app[METRICS_APP] = metrics_app
    admin = admin_routes(pool, index) + reload_routes(runtime) + config_routes(runtime)
    if config.admin.listen is None:
        app.router.add_routes(admin)
    else:
        admin_app = web.Application(middlewares=[openai_errors, guard])
        admin_app[METRICS] = router_metrics
        admin_app.router.add_routes(admin)
        app[ADMIN_APP] = admin_app
    return app
