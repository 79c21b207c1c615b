"""``/metrics`` under ``kvroute serve --workers N``: every scrape reports the whole process group.

The kernel hands a scrape to any one worker (SO_REUSEPORT), so a scrape of one worker's own
registry would be a different process's counters each time, and ``rate()`` over them
meaningless. Instead the worker that takes the scrape asks every other worker for its own
exposition, over a Unix socket of its own (``worker-<i>.sock`` in a directory the supervisor
makes, mode 0700), and answers with the sum.

Why an aggregation of our own rather than prometheus_client's multiprocess mode: most of the
router's gauges are computed when a scrape comes (each backend's in-flight count, health,
circuit state and the engine's last numbers are read from the live pool then, see
``router.http.app.local_exposition``), and the index's evictions and the KV event streams'
unapplied blocks are custom collectors read at scrape time; the multiprocess mode supports
neither (it only reads values each process wrote to its mmap files, so a gauge set at scrape
time in one worker would be stale in all others), nor the ``process_*`` metrics. It would also
put a file write under a lock on every counter increment of the request path. Asking the
peers costs a local round trip per worker per scrape, which happens every few seconds.

How series combine: counters and histograms (every bucket, ``_sum`` and ``_count``) are summed,
so the group's ``rate()`` is the rate of all its workers. A gauge combines as its meaning asks
(``GAUGE_ACROSS_WORKERS``): in-flight requests, open client connections, memory and file
descriptors are summed, the
start time is the earliest, and every other gauge — the workers' views of the same fleet
(health, circuit state, the engines' scraped numbers) — takes the maximum: a 0/1 state series
reads "in at least one worker". If a worker does not answer, the scrape fails (503) rather than
report a partial sum, which Prometheus would take for a counter reset.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

#: How a gauge combines across workers when it is not the maximum (see the module docstring).
GAUGE_ACROSS_WORKERS: dict[str, Callable[[Iterable[float]], float]] = {
    "kvroute_backend_in_flight": sum,
    "kvroute_client_connections": sum,
    "kvroute_index_write_queue": sum,
    "process_resident_memory_bytes": sum,
    "process_virtual_memory_bytes": sum,
    "process_open_fds": sum,
    "process_max_fds": sum,
    "process_start_time_seconds": min,
    #: 0 while any worker routes on its local view.
    "kvroute_redis_up": min,
}
#: Longest wait for the other workers' expositions (Prometheus' default scrape timeout is 10 s).
PEER_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class WorkerGroup:
    """Where one worker of ``serve --workers N`` finds the others: their sockets in ``directory``."""

    directory: str
    index: int
    size: int

    def socket_path(self, index: int) -> str:
        return os.path.join(self.directory, f"worker-{index}.sock")

    def sync_socket_path(self, index: int) -> str:
        """Where worker ``index`` takes the others' beliefs and load (router/fleet/worker_sync.py)."""
        return os.path.join(self.directory, f"worker-{index}.sync.sock")

    @property
    def peers(self) -> list[int]:
        return [i for i in range(self.size) if i != self.index]


class MetricsUnavailable(Exception):
    """A worker of the group did not report its metrics."""


def merge(expositions: Iterable[str]) -> bytes:
    """The workers' text expositions as one: counters and histograms summed, gauges combined
    by ``GAUGE_ACROSS_WORKERS`` (the maximum by default)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            series = values[family.name]
            for s in family.samples:
                series.setdefault((s.name, tuple(s.labels.items())), []).append(s.value)
    merged = []
    for name, family in families.items():
        combine = GAUGE_ACROSS_WORKERS.get(name, max) if family.type == "gauge" else sum
        for (sample, labels), found in values[name].items():
            family.add_sample(sample, dict(labels), float(combine(found)))
        merged.append(family)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(merged))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


async def group_exposition(own: bytes, group: WorkerGroup) -> bytes:
    """This worker's exposition merged with every other worker's, asked for over their sockets."""
    texts = await asyncio.gather(*(_ask(group, peer) for peer in group.peers))
    return merge([own.decode(), *texts])


async def _ask(group: WorkerGroup, peer: int) -> str:
    timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)
    connector = aiohttp.UnixConnector(path=group.socket_path(peer))
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.get("http://worker/metrics") as resp,
        ):
            resp.raise_for_status()
            return await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        raise MetricsUnavailable(f"worker {peer} did not report its metrics: {reason}") from exc


async def serve_to_peers(group: WorkerGroup, local: Callable[[], bytes]) -> web.AppRunner:
    """Answer the other workers' ``GET /metrics`` with this worker's own exposition, on its socket."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=local(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, group.socket_path(group.index)).start()
    return runner
