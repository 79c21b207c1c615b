"""The fleet as the router sees it: each backend's models, health, load and in-flight requests.

The pool changes at run time (discovery adds and removes backends); whoever keeps state per
backend (the prefix index, metrics, a KV event subscriber) subscribes to it and follows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from policies.types import BackendView
from router.fleet.circuit import CircuitBreaker
from router.fleet.engines.base import EngineStats
from router.fleet.settings import BackendConfig, BackendTLSConfig, HealthConfig
from router.fleet.tls import backend_tls
from router.metrics import RouterMetrics


class Backend:
    def __init__(
        self,
        config: BackendConfig,
        health: HealthConfig | None = None,
        tls: BackendTLSConfig | None = None,
    ) -> None:
        health = health or HealthConfig()
        self.config = config
        self.name = config.name
        self.url = config.url.rstrip("/")
        #: ``prefill``, ``decode`` or ``both`` (prefill/decode disaggregation).
        self.role = config.role
        #: For an ``https://`` URL, its TLS settings (its own ``tls``, else ``tls``: upstream.tls).
        self.tls = backend_tls(self.url, config.tls or tls or BackendTLSConfig())
        #: Configured models, or those last read from the backend's ``/v1/models``.
        self.models: frozenset[str] = frozenset(config.models or ())
        #: The engine's own ``/v1/models`` entries by id, as last read (none for configured models).
        self.model_cards: dict[str, dict[str, Any]] = {}
        #: Out of rotation until its first successful check (done before the router listens).
        self.healthy = False
        self.consecutive_failures = 0
        #: Requests this router has sent there and not yet finished (released on every path).
        self.in_flight = 0
        #: Requests the other router replicas have there, as last read from the shared load view.
        self.remote_in_flight = 0
        #: Uncached prompt tokens of this router's requests there without a first byte
        #: (router/request_path/attempt.py).
        self.pending_prefill_tokens = 0
        #: This router's requests there without a first byte (the owners of those tokens).
        self.pending_prefill_requests = 0
        #: The other replicas' pending prefill there, as last read from the shared load view.
        self.remote_pending_prefill_tokens = 0
        self.remote_pending_prefill_requests = 0
        #: Passive ejection from what real requests get (router/fleet/circuit.py).
        self.circuit = CircuitBreaker(health.eject_after, health.eject_s, health.max_eject_s)
        #: Taken out of rotation by an operator (config ``drain: true`` or the admin API).
        self.draining = config.drain
        #: Going away (a terminating Kubernetes endpoint): in-flight requests finish, no new ones.
        self.terminating = False
        #: The engine's last scrape, shown to policies until ``engine_fresh_until`` (monotonic).
        self.engine: EngineStats | None = None
        self.engine_fresh_until = 0.0
        #: Why the last readable /metrics told nothing (its ``engine:`` adapter found none of its
        #: metrics there), naming the engine it looks like when another adapter's are; else None.
        self.engine_mismatch: str | None = None
        #: Why its KV events look like another engine's (precise mode, router/kv_events/); else None.
        self.kv_events_mismatch: str | None = None
        #: With ``index.mode: events``, the subscription to the engine's KV events (written by
        #: router/kv_events/subscriber.py): ``discovering``, ``connecting``, ``connected`` or
        #: ``not_connected`` (past ``index.events.connect_grace_s``), and the endpoints followed.
        self.kv_events_state: str | None = None
        self.kv_events_endpoints: tuple[str, ...] = ()

    def record_failure(self, unhealthy_after: int) -> None:
        """A failed active check: after ``unhealthy_after`` in a row it leaves rotation."""
        self.consecutive_failures += 1
        if self.consecutive_failures >= unhealthy_after:
            self.healthy = False

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.healthy = True

    def set_engine_stats(self, stats: EngineStats, stale_after_s: float) -> None:
        self.engine = stats
        self.engine_fresh_until = time.monotonic() + stale_after_s

    def fresh_engine_stats(self) -> EngineStats | None:
        """The last scrape while it is fresh; None once it is older than the staleness bound."""
        return self.engine if time.monotonic() < self.engine_fresh_until else None

    @property
    def routable(self) -> bool:
        """In rotation: passes active checks, not ejected, not draining or terminating."""
        return self.healthy and not self.draining and not self.terminating and self.circuit.available()

    @property
    def state(self) -> str:
        """One word for the admin API and logs, most severe first."""
        if not self.healthy:
            return "unhealthy"
        if self.terminating:
            return "terminating"
        if self.draining:
            return "draining"
        return self.circuit.state.name.lower()

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments of an aiohttp request to this backend (its TLS, if any)."""
        return self.tls.aiohttp_options() if self.tls is not None else {}

    @property
    def discovers_models(self) -> bool:
        return self.config.models is None

    def show(self, metrics: RouterMetrics) -> None:
        """Set this backend's state gauges (at scrape time); stale engine numbers have no sample."""
        engine = self.fresh_engine_stats()
        metrics.show_backend(
            self.name,
            in_flight=self.in_flight,
            healthy=self.healthy,
            circuit_state=self.circuit.state.name.lower(),
            draining=self.draining or self.terminating,
            waiting=engine.waiting if engine else None,
            running=engine.running if engine else None,
            kv_usage=engine.kv_usage if engine else None,
        )

    def own_load(self) -> tuple[int, int, int]:
        """What this router tells the others of its load here: in flight, pending prefill tokens
        and requests (floored at 0: a release may briefly run ahead of its acquire's count)."""
        return self.in_flight, max(0, self.pending_prefill_tokens), max(0, self.pending_prefill_requests)

    def set_remote_load(self, count: int, tokens: int, requests: int) -> None:
        """The other routers' load here (router replicas through Redis, or the other workers)."""
        self.remote_in_flight = count
        self.remote_pending_prefill_tokens = tokens
        self.remote_pending_prefill_requests = requests

    def view(self, matched_blocks: int, cached_blocks: int) -> BackendView:
        engine = self.fresh_engine_stats()
        return BackendView(
            name=self.name,
            matched_blocks=matched_blocks,
            in_flight=self.in_flight + self.remote_in_flight,
            engine_waiting=engine.waiting if engine else None,
            engine_running=engine.running if engine else None,
            kv_usage=engine.kv_usage if engine else None,
            cached_blocks=cached_blocks,
            pending_prefill_tokens=self.pending_prefill_tokens + self.remote_pending_prefill_tokens,
            pending_prefill_requests=self.pending_prefill_requests + self.remote_pending_prefill_requests,
        )


#: Called with a backend just added to, or just removed from, the pool.
PoolListener = Callable[[Backend], None]


class BackendPool:
    def __init__(
        self,
        configs: Iterable[BackendConfig] = (),
        health: HealthConfig | None = None,
        tls: BackendTLSConfig | None = None,
    ) -> None:
        self.health = health or HealthConfig()
        #: TLS of backends without their own ``tls`` (``upstream.tls``), discovered ones included.
        self.tls = tls or BackendTLSConfig()
        self._backends = {c.name: Backend(c, self.health, self.tls) for c in configs}
        #: Whether any backend has a prefill or decode role: only then does the request path
        #: look for pairs (router/request_path/disaggregated.py).
        self.role_split = self._any_role()
        self._on_added: list[PoolListener] = []
        self._on_removed: list[PoolListener] = []
        self._on_down: list[PoolListener] = []

    def subscribe(self, on_added: PoolListener, on_removed: PoolListener) -> None:
        """Follow changes: ``on_added`` for each backend added from now on (those already in
        the pool are the caller's to iterate), ``on_removed`` for each one leaving (its
        in-flight requests still finish: they hold the Backend object)."""
        self._on_added.append(on_added)
        self._on_removed.append(on_removed)

    def subscribe_down(self, on_down: PoolListener) -> None:
        """Call ``on_down`` with each backend that has just failed its health checks (the request
        path ends what it has open there: router/request_path/upstream.py, ``abort``)."""
        self._on_down.append(on_down)

    def went_down(self, backend: Backend) -> None:
        """``backend`` has just left rotation by failing its health checks."""
        for listener in self._on_down:
            listener(backend)

    def add(self, config: BackendConfig) -> Backend:
        """Add a backend; one of the same name but another config is replaced."""
        current = self._backends.get(config.name)
        if current is not None:
            if current.config == config:
                return current
            self.remove(config.name)
        backend = Backend(config, self.health, self.tls)
        self._backends[config.name] = backend
        self.role_split = self._any_role()
        for listener in self._on_added:
            listener(backend)
        return backend

    def remove(self, name: str) -> Backend | None:
        backend = self._backends.pop(name, None)
        if backend is not None:
            self.role_split = self._any_role()
            for listener in self._on_removed:
                listener(backend)
        return backend

    def _any_role(self) -> bool:
        return any(b.role != "both" for b in self._backends.values())

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def __len__(self) -> int:
        return len(self._backends)

    def __iter__(self) -> Iterator[Backend]:
        """A snapshot: the pool may change while the caller awaits between items."""
        return iter(list(self._backends.values()))

    def __getitem__(self, name: str) -> Backend:
        return self._backends[name]

    def serving(self, model: str) -> list[Backend]:
        """Every backend that serves ``model``, healthy or not."""
        return [b for b in self._backends.values() if model in b.models]

    def models(self) -> list[str]:
        return sorted({m for b in self._backends.values() for m in b.models})

    def model_cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: each model's entry as its first backend (in pool order) reported it,
        with ``kvroute_backends`` naming every backend serving it. A configured model, never read
        from an engine, gets a minimal entry."""
        cards: dict[str, dict[str, Any]] = {}
        for backend in self._backends.values():
            for model in sorted(backend.models):
                card = cards.get(model)
                if card is None:
                    own = backend.model_cards.get(model)
                    card = (
                        dict(own)
                        if own is not None
                        else {"id": model, "object": "model", "owned_by": "kvroute"}
                    )
                    card["kvroute_backends"] = []
                    cards[model] = card
                card["kvroute_backends"].append(backend.name)
        return [cards[model] for model in sorted(cards)]

    def any_healthy(self) -> bool:
        return any(b.routable and b.models for b in self._backends.values())
