"""Prometheus metrics under ``kvroute_``, in a registry of the app's own.

A registry per app (not the global one) lets tests and the demo run several routers in one
process. Label values are bounded: backends and models come from config or discovery,
reasons from the policies' fixed vocabularies, never from request content.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Requests answered, by endpoint, model, backend and HTTP status",
            ["endpoint", "model", "backend", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "kvroute_request_duration_seconds",
            "Time from request received to response finished",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds",
            "Time from request received to the first upstream byte of the body",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
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
        self.index_blocks = Gauge(
            "kvroute_index_blocks",
            "(backend, block) entries held by the prefix index",
            registry=r,
        )
        self.index_evictions = Gauge(
            "kvroute_index_evictions",
            "Blocks evicted from the prefix index since start",
            registry=r,
        )
