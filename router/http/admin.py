"""The admin API: the fleet's state, and draining a backend out of rotation.

    GET  /admin/backends                  every backend with its state, load and engine numbers
    POST /admin/backends/{name}/drain     no new requests; those in flight finish
    POST /admin/backends/{name}/undrain   back into rotation (subject to health)
    GET  /admin/config                    the running config, secrets redacted (router/http/config_view.py)

All admin routes are built here, by :func:`admin_routes`, so they can be mounted on another
app (a separate admin port) or wrapped (an admin key) in one place. A drain lasts until
undrained or until the backend leaves the pool; ``backends[].drain: true`` starts one drained.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from router.errors import OpenAIError
from router.fleet.backends import Backend, BackendPool
from router.index import PrefixIndex

log = logging.getLogger("kvroute.admin")


def describe(backend: Backend, index: PrefixIndex | None = None) -> dict[str, object]:
    """A backend as the admin API shows it; engine numbers are null when stale or never scraped.

    With the index: the blocks believed held and the capacity bounding them (router/fleet/capacity.py).
    """
    engine = backend.fresh_engine_stats()
    view: dict[str, object] = {
        "name": backend.name,
        "url": backend.url,
        "engine": backend.config.engine,
        "role": backend.role,
        "models": sorted(backend.models),
        "state": backend.state,
        "routable": backend.routable,
        "healthy": backend.healthy,
        "draining": backend.draining,
        "terminating": backend.terminating,
        "circuit": backend.circuit.state.name.lower(),
        "consecutive_request_failures": backend.circuit.consecutive_failures,
        "in_flight": backend.in_flight,
        # The other routers' (replicas through Redis, or the other workers of serve --workers N).
        "in_flight_others": backend.remote_in_flight,
        "engine_waiting": engine.waiting if engine else None,
        "engine_running": engine.running if engine else None,
        "kv_usage": engine.kv_usage if engine else None,
        "engine_capacity_tokens": engine.capacity_tokens if engine else None,
        "engine_mismatch": backend.engine_mismatch,
        "kv_events_mismatch": backend.kv_events_mismatch,
    }
    if backend.kv_events_state is not None:
        view["kv_events"] = {"state": backend.kv_events_state, "endpoints": list(backend.kv_events_endpoints)}
    if index is not None:
        view["index_blocks"] = index.blocks_of(backend.name)
        view["index_capacity_blocks"] = index.capacity_of(backend.name)
    return view


def _json(payload: object) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def admin_routes(pool: BackendPool, index: PrefixIndex | None = None) -> list[web.RouteDef]:
    def backend_named(request: web.Request) -> Backend:
        name = request.match_info["name"]
        if name not in pool:
            raise OpenAIError(404, f"No backend named '{name}'.", param="name", code="backend_not_found")
        return pool[name]

    async def list_backends(request: web.Request) -> web.Response:
        return _json({"backends": [describe(b, index) for b in sorted(pool, key=lambda b: b.name)]})

    async def drain(request: web.Request) -> web.Response:
        backend = backend_named(request)
        if not backend.draining:
            log.info("backend %s: draining (%d in flight)", backend.name, backend.in_flight)
        backend.draining = True
        return _json(describe(backend, index))

    async def undrain(request: web.Request) -> web.Response:
        backend = backend_named(request)
        if backend.draining:
            log.info("backend %s: back in rotation", backend.name)
        backend.draining = False
        return _json(describe(backend, index))

    return [
        web.get("/admin/backends", list_backends),
        web.post("/admin/backends/{name}/drain", drain),
        web.post("/admin/backends/{name}/undrain", undrain),
    ]
