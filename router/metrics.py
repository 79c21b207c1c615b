"""Prometheus metrics under ``kvroute_``, in a registry of the app's own.

A registry per app (not the global one) lets tests and the demo run several routers in one
process. Label values are bounded: backends and models come from config or discovery,
reasons from the policies' fixed vocabularies, never from request content.

Conventions (Prometheus' naming guide, which promtool checks and a test runs on a real scrape):
the process metrics are the standard ``process_*`` every exporter has, so stock dashboards and
alerts find them; a unit is the name's suffix (``_seconds``, ``_bytes``, ``_ratio``); a state is
one 0/1 series per state with a ``state`` label, never a number standing for a state, so
``sum by (state)`` counts backends per state; no ``_created`` series (one more series per
counter and histogram child that no query here uses: disabled for the whole process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: A routing decision takes well under a millisecond locally; a remote index adds a round trip.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)


#: The ``state`` label values of ``kvroute_backend_circuit_state`` (router/fleet/circuit.py's
#: states, lower-cased): every backend has one series per state, exactly one of them 1.
CIRCUIT_STATES = ("closed", "half_open", "open")


class Children:
    """A labelled metric's children, memoised by label values.

    prometheus_client's ``labels()`` validates and converts the values and takes a lock on
    every call; the request path makes several calls per request, a measurable share of its
    CPU. Only for metrics whose children are never removed (counters and histograms here):
    a removed child would stay cached and count where no scrape sees it.
    """

    def __init__(self, metric: Counter | Histogram) -> None:
        self.metric = metric
        self._cache: dict[tuple[str, ...], Counter | Histogram] = {}

    def __call__(self, *values: str) -> Counter | Histogram:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self.metric.labels(*values)
        return child


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The router process's CPU, memory (most of it the prefix index under load) and file
        # descriptors (one per client and upstream connection), under the standard process_* names.
        ProcessCollector(registry=r)
        self.requests = Counter(
            "kvroute_requests",
            "Requests answered, by endpoint, model, backend and status; errors the router answers "
            "itself (no backend reached) have empty backend and model",
            ["endpoint", "model", "backend", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "kvroute_request_duration_seconds",
            "Time from request received to response finished, by endpoint and model",
            ["endpoint", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds",
            "Time from request received to the first upstream byte of the body, by endpoint and model",
            ["endpoint", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_time = Histogram(
            "kvroute_routing_decision_seconds",
            "Time from dispatch to backend chosen: hashing, index lookup (a round trip if remote), policy; "
            "by model",
            ["model"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "kvroute_routing_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens",
            "Estimated prompt tokens of routed requests",
            ["model"],
            registry=r,
        )
        self.matched_tokens = Counter(
            "kvroute_matched_tokens",
            "Prompt tokens the index predicted cached on the chosen backend",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvroute_backend_in_flight",
            "Requests in flight per backend, as this router counts them",
            ["backend"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvroute_backend_healthy",
            "1 when the backend is in rotation, else 0",
            ["backend"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "Failures talking to a backend, by kind",
            ["backend", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Requests sent to another backend after one failed before any byte",
            registry=r,
        )
        self.warmups = Counter(
            "kvroute_warmups",
            "Warm-ups (a prefix copied to a backend ahead of need, with max_tokens 1), by outcome: "
            "ok, failed, skipped (another is in flight, too many are, the prompt cannot be cut, "
            "or the target left rotation)",
            ["backend", "outcome"],
            registry=r,
        )
        self.refreshes = Counter(
            "kvroute_refreshes",
            "Refreshes started (routing.retention): a kept prefix sent again to the backend holding it, "
            "as a warm-up (kvroute_warmups_total says how each ended)",
            ["backend"],
            registry=r,
        )
        self.index_blocks = Gauge(
            "kvroute_index_blocks",
            "(backend, block) entries held by the prefix index",
            registry=r,
        )
        self.index_capacity = Gauge(
            "kvroute_index_backend_capacity_blocks",
            "Capacity bounding each backend's beliefs in the prefix index, in index blocks: the "
            "engine's reported KV cache size, or the configured one (see README, Engine capacity)",
            ["backend"],
            registry=r,
        )
        self.index_lookups = Counter(
            "kvroute_index_lookups",
            "Prefix index lookups; result is hit when some candidate held the chain's first block",
            ["result"],
            registry=r,
        )

        self.engine_waiting = Gauge(
            "kvroute_backend_engine_waiting",
            "Requests queued in the engine, from its last fresh /metrics scrape",
            ["backend"],
            registry=r,
        )
        self.engine_running = Gauge(
            "kvroute_backend_engine_running",
            "Requests running in the engine, from its last fresh /metrics scrape",
            ["backend"],
            registry=r,
        )
        self.engine_kv_usage = Gauge(
            "kvroute_backend_kv_usage_ratio",
            "Engine KV cache usage in [0, 1], from its last fresh /metrics scrape",
            ["backend"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "kvroute_backend_scrape_errors",
            "Failed scrapes of an engine's /metrics",
            ["backend"],
            registry=r,
        )
        self.engine_mismatch = Gauge(
            "kvroute_backend_engine_mismatch",
            "1 while the backend's /metrics answers but holds none of the metrics of its engine: kind",
            ["backend"],
            registry=r,
        )
        self.circuit_state = Gauge(
            "kvroute_backend_circuit_state",
            "Passive ejection per backend: 1 for the backend's state (closed: in rotation, half_open: "
            "one trial request at a time, open: ejected), 0 for the others",
            ["backend", "state"],
            registry=r,
        )
        self.draining = Gauge(
            "kvroute_backend_draining",
            "1 while the backend is drained (operator) or terminating (discovery), else 0",
            ["backend"],
            registry=r,
        )
        self.pair_decisions = Counter(
            "kvroute_pd_decisions",
            "Prefill/decode disaggregation: each side's choice, by side (prefill, decode), policy and reason",
            ["side", "policy", "reason"],
            registry=r,
        )
        self.pair_retries = Counter(
            "kvroute_pd_retries",
            "Prefill/decode pairs tried again after one side failed before any byte, by the side that failed",
            ["side"],
            registry=r,
        )
        # Client connections, per listener (main, admin): router/http/connections.py.
        self.client_connections = Gauge(
            "kvroute_client_connections",
            "Open client connections, by listener",
            ["listener"],
            registry=r,
        )
        self.client_timeouts = Counter(
            "kvroute_client_timeouts",
            "Client connections closed because a request's head or body did not arrive in time "
            "(listen.header_timeout_s, listen.body_timeout_s), by listener and phase",
            ["listener", "phase"],
            registry=r,
        )
        self.client_refused = Counter(
            "kvroute_client_connections_refused",
            "New client connections closed at once: the listener's max_connections or "
            "max_connections_per_client was reached (the reason)",
            ["listener", "reason"],
            registry=r,
        )
        # The request path's per-request metrics, through memoised children (see Children).
        self.requests_by = Children(self.requests)
        self.latency_by = Children(self.latency)
        self.ttft_by = Children(self.ttft)
        self.decision_time_by = Children(self.decision_time)
        self.decisions_by = Children(self.decisions)
        self.pair_decisions_by = Children(self.pair_decisions)
        self.prompt_tokens_by = Children(self.prompt_tokens)
        self.matched_tokens_by = Children(self.matched_tokens)
        self.index_lookups_by = Children(self.index_lookups)
        self.backend_gauges = (
            self.in_flight,
            self.healthy,
            self.engine_waiting,
            self.engine_running,
            self.engine_kv_usage,
            self.circuit_state,
            self.draining,
            self.engine_mismatch,
            self.index_capacity,
        )

    def show_backend(
        self,
        name: str,
        *,
        in_flight: int,
        healthy: bool,
        circuit_state: str,
        draining: bool,
        waiting: float | None,
        running: float | None,
        kv_usage: float | None,
    ) -> None:
        """Set a backend's state gauges (at scrape time); engine numbers given as None have no sample.

        In-flight requests too: the backend counts them (router/request_path/attempt.py), and
        reading that count here spares every request two gauge updates."""
        self.in_flight.labels(name).set(in_flight)
        self.healthy.labels(name).set(1 if healthy else 0)
        for state in CIRCUIT_STATES:
            self.circuit_state.labels(name, state).set(1 if state == circuit_state else 0)
        self.draining.labels(name).set(1 if draining else 0)
        for gauge, value in (
            (self.engine_waiting, waiting),
            (self.engine_running, running),
            (self.engine_kv_usage, kv_usage),
        ):
            if value is None:
                with contextlib.suppress(KeyError):
                    gauge.remove(name)
            else:
                gauge.labels(name).set(value)

    def forget_backend(self, name: str) -> None:
        """Drop a removed backend's gauges (its counters stay: they are history)."""
        for gauge in self.backend_gauges:
            if gauge is self.circuit_state:
                for state in CIRCUIT_STATES:
                    with contextlib.suppress(KeyError):
                        gauge.remove(name, state)
            else:
                with contextlib.suppress(KeyError):
                    gauge.remove(name)

    def watch_index(self, index: object) -> None:
        """Expose the index's own eviction count, read at scrape time.

        The index counts its evictions as a plain integer (it knows nothing of Prometheus);
        a collector reading it on each scrape keeps the count exact without a hook on the
        eviction path. Indexes without an ``evictions`` attribute expose no sample.
        """
        self.registry.register(_IndexEvictions(index))


class _IndexEvictions(Collector):
    def __init__(self, index: object) -> None:
        self._index = index

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        evictions = getattr(self._index, "evictions", None)
        if isinstance(evictions, int):
            family = self._family()
            family.add_metric([], evictions)
            yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "kvroute_index_evictions", "Blocks evicted from the prefix index since start"
        )


class WorkerSyncMetrics:
    """The workers of ``serve --workers N`` keeping each other's index and load in step without
    Redis (router/fleet/worker_sync.py). Registered only in such a worker, in the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.peer_beliefs = Counter(
            "kvroute_workers_peer_beliefs",
            "Beliefs taken from the other workers of serve --workers N (index.store: memory)",
            registry=registry,
        )
        self.dropped_beliefs = Counter(
            "kvroute_workers_dropped_beliefs",
            "Beliefs not sent to another worker: not connected with 4 MiB already waiting for it, "
            "or its connection's buffer full",
            ["reason"],
            registry=registry,
        )


#: Redis round trips on loopback take ~0.1-0.3 ms; the lookup deadline is a few ms.
REDIS_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 1)


class RedisMetrics:
    """The shared state's health: latency, errors, fallbacks to the local view, dropped updates.

    Registered only when ``index.store`` is ``redis``, in the app's registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.latency = Histogram(
            "kvroute_redis_latency_seconds",
            "Redis round trips, by operation (match, record, load, probe)",
            ["op"],
            buckets=REDIS_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "kvroute_redis_errors",
            "Failed Redis calls, by operation and kind (timeout, connection, auth, response)",
            ["op", "kind"],
            registry=r,
        )
        self.fallbacks = Counter(
            "kvroute_redis_fallbacks",
            "Lookups answered from this router's local view because Redis was down or slow",
            registry=r,
        )
        self.up = Gauge(
            "kvroute_redis_up",
            "1 while the router uses the shared state in Redis, 0 while it routes on its local view",
            registry=r,
        )
        self.dropped_updates = Counter(
            "kvroute_index_dropped_updates",
            "Index updates not written to Redis: the write queue was full, or Redis failed the batch",
            ["reason"],
            registry=r,
        )
        self.peer_updates = Counter(
            "kvroute_index_peer_updates",
            "Beliefs taken from other router replicas over the Redis stream (index.redis.lookup: local)",
            registry=r,
        )
        self.others_in_flight = Gauge(
            "kvroute_backend_in_flight_others",
            "Requests in flight per backend from the other router replicas (the shared load view)",
            ["backend"],
            registry=r,
        )
        self.write_queue = Gauge(
            "kvroute_index_write_queue",
            "Index updates waiting to be written to Redis",
            registry=r,
        )
