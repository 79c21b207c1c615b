"""The fleet's background upkeep: discovery, health checks and engine scrapes, started and
stopped together, and the pool's followers (index, metrics) wired in one place.

Start order matters: discovery first (so the fleet exists), then one round of health checks
and scrapes before the router listens (so the first request already sees healthy backends
and their load), then the loops.
"""

from __future__ import annotations

import asyncio

import aiohttp

from router.config import Config
from router.fleet.backends import Backend, BackendPool
from router.fleet.capacity import CapacitySizer
from router.fleet.discovery import build_discovery
from router.fleet.health import HealthMonitor
from router.fleet.scraper import LoadScraper
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.tasks import stop_task


class FleetUpkeep:
    def __init__(
        self,
        config: Config,
        pool: BackendPool,
        index: PrefixIndex,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.metrics = metrics
        self.monitor = HealthMonitor(pool, session, config.health)
        #: Re-sizes each backend's believed capacity to what its engine reports (router/fleet/capacity.py).
        self.sizer = CapacitySizer(index, config.index)
        self.scraper = (
            LoadScraper(pool, session, config.engine_metrics, metrics, on_stats=self.sizer.observe)
            if config.engine_metrics.enabled
            else None
        )
        self.discovery = build_discovery(config.discovery, pool)
        self._tasks: list[asyncio.Task[None]] = []
        pool.subscribe(self._on_added, self._on_removed)

    def _on_added(self, backend: Backend) -> None:
        capacity = backend.config.capacity_blocks or self.config.index.backend_capacity_blocks
        self.index.add_backend(backend.name, capacity)

    def _on_removed(self, backend: Backend) -> None:
        self.index.remove_backend(backend.name)
        self.sizer.forget(backend.name)
        self.metrics.forget_backend(backend.name)

    async def start(self) -> None:
        if self.discovery is not None:
            await self.discovery.sync_once()
        await self.monitor.check_once()
        self.monitor.follow_pool()
        loops = [("health", self.monitor.run())]
        if self.scraper is not None:
            await self.scraper.scrape_once()
            loops.append(("scraper", self.scraper.run()))
        if self.discovery is not None:
            loops.append(("discovery", self.discovery.run()))
        self._tasks = [asyncio.create_task(coro, name=f"kvroute-{name}") for name, coro in loops]

    async def close(self) -> None:
        for task in self._tasks:
            await stop_task(task)
        await self.monitor.close()
        if self.discovery is not None:
            await self.discovery.close()
