"""The load loop: scrape every engine's ``/metrics`` on an interval.

The router's own in-flight count is the instant load signal but misses traffic that does
not pass through this router (other replicas, batch jobs sent to the engines directly). The
engines' own queue and KV usage cover everyone, one interval late. Each scrape is parsed by
the backend's engine adapter (router/fleet/engines/) and shown to the policies until it is
``stale_after_s`` old; after that the policies see None rather than numbers that may have
stopped being true (an engine that stopped answering its /metrics is the likeliest to be in
trouble). A failed scrape changes nothing else: health is the health checks' business.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.fleet.backends import Backend, BackendPool
from router.fleet.engines import ADAPTERS, EngineStats, engine_speaking
from router.fleet.settings import EngineMetricsConfig
from router.metrics import RouterMetrics

log = logging.getLogger("kvroute.scraper")


class LoadScraper:
    def __init__(
        self,
        pool: BackendPool,
        session: aiohttp.ClientSession,
        config: EngineMetricsConfig,
        metrics: RouterMetrics,
        on_stats: Callable[[Backend, EngineStats], None] | None = None,
    ) -> None:
        self.pool = pool
        self.session = session
        self.config = config
        self.metrics = metrics
        #: Told of every successful scrape (the capacity sizer, router/fleet/capacity.py).
        self.on_stats = on_stats
        self._failing: set[str] = set()

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(b) for b in self.pool))

    async def run(self) -> None:
        """Scrape every ``interval_s`` (the first round is the caller's, before serving)."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.scrape_once()

    async def _scrape(self, backend: Backend) -> None:
        adapter = ADAPTERS[backend.config.engine]
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        try:
            async with self.session.get(
                f"{backend.url}/metrics", timeout=timeout, **backend.client_options()
            ) as resp:
                resp.raise_for_status()
                text = await resp.text()
            stats = adapter.parse(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            self.metrics.scrape_errors.labels(backend.name).inc()
            if backend.name not in self._failing:
                self._failing.add(backend.name)
                log.warning("backend %s: cannot read /metrics: %s", backend.name, exc or type(exc).__name__)
            return
        if backend.name not in self.pool or self.pool[backend.name] is not backend:
            return  # removed or replaced while this scrape ran: its numbers describe no member
        if backend.name in self._failing:
            self._failing.discard(backend.name)
            log.info("backend %s: /metrics readable again", backend.name)
        self._check_engine(backend, adapter.speaks(text), text)
        backend.set_engine_stats(stats, self.config.stale_after_s)
        if self.on_stats is not None:
            self.on_stats(backend, stats)

    def _check_engine(self, backend: Backend, speaks: bool, text: str) -> None:
        """Say once (log, ``kvroute_backend_engine_mismatch``, ``/admin/backends``) that a backend's
        /metrics holds nothing its ``engine:`` reads: a wrong kind would otherwise leave its load
        unknown in silence. Said again only after it has been right in between."""
        engine = backend.config.engine
        mismatch = None
        if not speaks:
            looks_like = engine_speaking(text)
            mismatch = f"/metrics holds none of the {engine} metrics kvroute reads" + (
                f"; it looks like {looks_like}: set engine: {looks_like}" if looks_like else ""
            )
        if mismatch != backend.engine_mismatch:
            if mismatch is not None:
                log.warning("backend %s (engine: %s): %s", backend.name, engine, mismatch)
            elif backend.engine_mismatch is not None:
                log.info("backend %s: /metrics now holds %s metrics", backend.name, engine)
            backend.engine_mismatch = mismatch
        self.metrics.engine_mismatch.labels(backend.name).set(0 if mismatch is None else 1)
