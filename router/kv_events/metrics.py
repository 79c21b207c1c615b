"""Prometheus metrics of the KV event streams (registered only with ``index.mode: events``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from router.index.precise import PreciseIndex


class KVEventMetrics:
    def __init__(self, registry: CollectorRegistry, index: PreciseIndex) -> None:
        r = registry
        self.batches = Counter(
            "kvroute_kv_events_batches",
            "KV event batches applied to the index, by backend",
            ["backend"],
            registry=r,
        )
        self.gaps = Counter(
            "kvroute_kv_events_gaps",
            "Sequence gaps in a backend's event stream; result is replayed (filled through the replay "
            "socket) or lost (no replay socket, timeout, or the engine's buffer no longer holds them)",
            ["backend", "result"],
            registry=r,
        )
        self.resyncs = Counter(
            "kvroute_kv_events_resyncs",
            "Completed rebuilds of a backend's entries from scratch; reason is connect (first or new "
            "connection), restart (sequence went back) or cleared (AllBlocksCleared)",
            ["backend", "reason"],
            registry=r,
        )
        self.errors = Counter(
            "kvroute_kv_events_errors",
            "Event stream errors by backend and kind: decode, discovery, not_connected (a stream without a "
            "connection past index.events.connect_grace_s)",
            ["backend", "kind"],
            registry=r,
        )
        self.connected = Gauge(
            "kvroute_kv_events_connected",
            "1 while the router's subscription to a backend's event stream is connected",
            ["backend"],
            registry=r,
        )
        r.register(_Unapplied(index))


class _Unapplied(Collector):
    """What the events could not place in the index, read from the index's counters at scrape time."""

    def __init__(self, index: PreciseIndex) -> None:
        self._index = index

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        stats = self._index.stats
        family.add_metric(["orphan"], stats.orphans)
        family.add_metric(["block_size"], stats.block_size_mismatches)
        family.add_metric(["unknown_removal"], stats.unknown_removals)
        family.add_metric(["budget"], stats.dropped)
        yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "kvroute_kv_events_unapplied_blocks",
            "Blocks in events the index could not apply: orphan (parent never announced), block_size "
            "(differs from index.events.block_size), unknown_removal, budget (index.max_blocks reached)",
            labels=["reason"],
        )
