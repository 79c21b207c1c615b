"""Config reload, on SIGHUP or ``POST /admin/reload``: all or nothing, never dropping a request.

The file the router was started from is read and validated completely (the same checks as
at start, key files and directories included). An invalid one changes nothing: the running
config stays, the error says why (the admin response, a log line, a metric). A valid one is
applied between two requests, on the event loop: requests already in flight finish with
what they started with (their backend object, policy decision and limits slot).

What applies live, and why the rest needs a restart:

* live: ``routing`` (policy and its parameters: the policy built once when the file was
  loaded, taken only when the section changed, so stateful policies keep their state
  otherwise), ``backends`` (with static discovery: added, removed, or replaced when their
  entry changed), ``upstream`` timeouts and attempts, ``tenancy``, ``limits`` rates and
  caps, ``auth`` keys, the ``admin`` key, ``log_level``.
* restart: ``listen``, ``admin.listen`` and ``metrics`` (sockets), ``upstream.tls`` (the TLS of
  backends without their own, built with them), ``index`` (the index and its hashing
  define what every stored belief means), ``discovery``, ``health``, ``engine_metrics``
  and ``routing.retention`` (background loops built at start), and ``limits`` body and
  header sizes (fixed in the HTTP server). A reload that changes them applies everything
  else, keeps their running values, and names them in ``restart_required``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from router.config import Config, ConfigError, ConfigFile, ConfigSource
from router.errors import OpenAIError
from router.fleet.backends import BackendPool
from router.http.auth import AdminKey, KeyStore
from router.http.ratelimit import RateLimiter
from router.http.tls import CertificateStore

if TYPE_CHECKING:
    from router.request_path.dispatch import Dispatcher

log = logging.getLogger("kvroute.reload")

#: Sections a running router cannot change (see the module docstring).
RESTART_SECTIONS = ("listen", "index", "discovery", "health", "engine_metrics", "metrics", "tracing")
#: ``limits`` keys fixed in the HTTP server at start.
RESTART_LIMITS = ("max_body_bytes", "max_line_size", "max_field_size", "max_headers")


def reload_counter(registry: CollectorRegistry | None) -> Counter:
    """``kvroute_config_reloads_total{result}``: applied or refused."""
    return Counter(
        "kvroute_config_reloads",
        "Config reloads by result (applied or refused).",
        ["result"],
        registry=registry,
    )


class Runtime:
    """What the request path reads per request and a reload may replace.

    Handlers go through here (not through values captured at start), so one assignment on
    the event loop switches every new request to the new config at once.
    """

    def __init__(
        self,
        config: Config,
        pool: BackendPool,
        registry: CollectorRegistry,
        source: str | ConfigSource | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        #: What a reload reads again: the file, with the command line's settings on top (None:
        #: started from a dict; reload is refused).
        self.source = ConfigSource(source) if isinstance(source, str) else source
        #: The file a reload re-reads (None: no file; reload is refused).
        self.path = self.source.path if self.source is not None else None
        self.keys = KeyStore(config.auth, config.tenancy)
        self.admin_key = AdminKey(config.admin.admin_key())
        self.limiter = RateLimiter(config.limits.tenant_default, config.limits.tenant_limits(), registry)
        #: Set once the app's client session exists (app startup).
        self.dispatcher: Dispatcher | None = None
        self.reloads = reload_counter(registry)
        #: Set by ``kvroute serve --workers N`` (router/http/processes.py): after ``POST /admin/reload``
        #: applied here, asks the supervisor to have every other worker reload too.
        self.reload_peers: Callable[[], None] | None = None
        #: The HTTPS listeners' certificates, re-read on every reload (set by router/http/server.py).
        self.certificates: list[CertificateStore] = []

    def reload_file(self) -> dict[str, object]:
        """Re-read ``path`` and apply it; ConfigError (nothing changed) when it is invalid."""
        if self.source is None or self.source.path is None:
            raise ConfigError("the router was not started from a config file; nothing to reload")
        try:
            new = self.source.load()
        except ConfigError as exc:
            self.reloads.labels("refused").inc()
            log.error("config reload from %s refused, keeping the running config: %s", self.path, exc)
            raise
        try:
            certificates = [(store, store.load()) for store in self.certificates]
        except ValueError as exc:
            self.reloads.labels("refused").inc()
            log.error("config reload refused, keeping the running config: %s", exc)
            raise ConfigError(str(exc)) from None
        try:
            outcome = self.apply(new)
        except (ValueError, OSError) as exc:  # a key file that changed or vanished since validation
            self.reloads.labels("refused").inc()
            log.error("config reload from %s refused, keeping the running config: %s", self.path, exc)
            raise ConfigError(str(exc)) from None
        for store, context in certificates:
            store.use(context)
        outcome["certificates_reloaded"] = [store.listener for store, _ in certificates]
        self.reloads.labels("applied").inc()
        log.info(
            "config reloaded from %s: changed %s%s",
            self.path,
            ", ".join(outcome["changed"]) or "nothing",  # type: ignore[arg-type]
            f"; restart needed for {', '.join(outcome['restart_required'])}"  # type: ignore[arg-type]
            if outcome["restart_required"]
            else "",
        )
        return outcome

    def apply(self, new: Config) -> dict[str, object]:
        """Switch to ``new`` (already validated); everything that can fail is built before any swap."""
        old = self.config
        running = self._keep_restart_only(old, new)
        exposed = running.admin.exposure_refused()
        if exposed:
            raise ValueError(f"admin.{exposed[0]} (admin.listen changes only at a restart)")
        restart = [s for s in RESTART_SECTIONS if getattr(old, s) != getattr(new, s)]
        restart += [f"limits.{k}" for k in RESTART_LIMITS if getattr(old.limits, k) != getattr(new.limits, k)]
        if old.admin.listen != new.admin.listen:
            restart.append("admin.listen")
        if old.upstream.tls != new.upstream.tls:
            restart.append("upstream.tls")
        if old.logging.format != new.logging.format:
            restart.append("logging.format")
        if old.routing.retention != new.routing.retention:
            restart.append("routing.retention")
        backends_live = old.discovery.kind == "static"
        if not backends_live and old.backends != new.backends:
            restart.append("backends")
        keys = KeyStore(running.auth, running.tenancy)
        admin_key = AdminKey(running.admin.admin_key())
        routing_changed = running.routing != old.routing
        if not routing_changed:
            # The policy the new file's load built is not used: a stateful policy keeps its state.
            running = dataclasses.replace(running, policy=old.policy)
        if running.disaggregation == old.disaggregation:
            running = dataclasses.replace(running, decode_policy=old.decode_policy)

        changed = [
            f.name for f in dataclasses.fields(ConfigFile) if getattr(old, f.name) != getattr(running, f.name)
        ]
        self.keys, self.admin_key = keys, admin_key
        self.limiter.configure(running.limits.tenant_default, running.limits.tenant_limits())
        if backends_live:
            self._sync_backends(running)
        if self.dispatcher is not None:
            self.dispatcher.config = running
            self.dispatcher.proxy.upstream.configure(running.upstream)
            if routing_changed:
                self.dispatcher.policy = running.policy
            self.dispatcher.decode_policy = running.decode_policy
        if running.log_level != old.log_level:
            logging.getLogger().setLevel(running.log_level.upper())
        self.config = running
        return {"status": "reloaded", "changed": changed, "restart_required": restart}

    @staticmethod
    def _keep_restart_only(old: Config, new: Config) -> Config:
        limits = dataclasses.replace(new.limits, **{k: getattr(old.limits, k) for k in RESTART_LIMITS})
        admin = dataclasses.replace(new.admin, listen=old.admin.listen)
        # The pool's default TLS is that of the backends it built (router/fleet/backends.py).
        upstream = dataclasses.replace(new.upstream, tls=old.upstream.tls)
        logs = dataclasses.replace(new.logging, format=old.logging.format)
        routing = dataclasses.replace(new.routing, retention=old.routing.retention)
        kept = {s: getattr(old, s) for s in RESTART_SECTIONS}
        if old.discovery.kind != "static":
            kept["backends"] = old.backends
        return dataclasses.replace(
            new, limits=limits, admin=admin, upstream=upstream, logging=logs, routing=routing, **kept
        )

    def _sync_backends(self, config: Config) -> None:
        """Make the pool match ``backends``; a replaced backend keeps its health if its URL stayed."""
        wanted = {b.name for b in config.backends}
        current = {b.name: b for b in self.pool}
        for name, backend in current.items():
            if name not in wanted:
                log.info("backend %s: removed by reload (%d in flight finish)", name, backend.in_flight)
                self.pool.remove(name)
        for backend_config in config.backends:
            previous = current.get(backend_config.name)
            backend = self.pool.add(backend_config)
            if previous is not None and backend is not previous and backend.url == previous.url:
                backend.healthy = previous.healthy
                if backend.discovers_models:
                    backend.models = previous.models
                    backend.model_cards = previous.model_cards


def reload_routes(runtime: Runtime) -> list[web.RouteDef]:
    """``POST /admin/reload``: 200 with what changed, or 400 naming what is wrong (nothing applied).

    Under ``--workers N`` the worker that took the request reloads at once (its outcome is the
    response), then has the others reload the same file: they follow within milliseconds. An
    invalid file is refused here and is not passed on (the others would refuse it alike).
    """

    async def reload(request: web.Request) -> web.Response:
        try:
            outcome = runtime.reload_file()
        except ConfigError as exc:
            raise OpenAIError(400, f"Config not reloaded: {exc}", code="invalid_config") from None
        if runtime.reload_peers is not None:
            runtime.reload_peers()
        return web.json_response(outcome)

    return [web.post("/admin/reload", reload)]
