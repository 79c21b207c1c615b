"""Keeps each backend's health and model list fresh: active checks on an interval.

A backend leaves rotation after ``health.unhealthy_after`` failed checks in a row, and
returns after one good check. Backends without configured models are asked for
``/v1/models`` until they answer, then every ``models_refresh_s``. A backend discovered at
run time is checked at once, so it enters rotation without waiting for the next round.
Failures of real requests are the circuit breaker's business (router/fleet/circuit.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from router.fleet.backends import Backend, BackendPool
from router.fleet.settings import HealthConfig
from router.tasks import stop_task

log = logging.getLogger("kvroute.health")


class HealthMonitor:
    def __init__(self, pool: BackendPool, session: aiohttp.ClientSession, config: HealthConfig) -> None:
        self.pool = pool
        self.session = session
        self.config = config
        self._models_checked: dict[str, float] = {}
        self._first_checks: set[asyncio.Task[None]] = set()

    def follow_pool(self) -> None:
        """Check each backend as soon as it joins the pool (call once the loop runs)."""
        self.pool.subscribe(self._on_added, self._on_removed)

    def _on_added(self, backend: Backend) -> None:
        task = asyncio.create_task(self._check(backend), name=f"kvroute-health-{backend.name}")
        self._first_checks.add(task)
        task.add_done_callback(self._first_checks.discard)

    def _on_removed(self, backend: Backend) -> None:
        self._models_checked.pop(backend.name, None)

    async def close(self) -> None:
        for task in list(self._first_checks):
            await stop_task(task)

    async def check_once(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.pool))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.check_once()

    async def _check(self, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        was_healthy = backend.healthy
        try:
            async with self.session.get(
                f"{backend.url}/health", timeout=timeout, **backend.client_options()
            ) as resp:
                ok = resp.status == 200
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok:
            backend.record_success()
            if backend.discovers_models:
                await self._refresh_models(backend)
        else:
            backend.record_failure(self.config.unhealthy_after)
        if backend.healthy and not was_healthy:
            log.info("backend %s is healthy", backend.name)
        elif was_healthy and not backend.healthy:
            log.warning(
                "backend %s is unhealthy after %d failed checks", backend.name, backend.consecutive_failures
            )

    async def _refresh_models(self, backend: Backend) -> None:
        now = time.monotonic()
        last = self._models_checked.get(backend.name)
        if backend.models and last is not None and now - last < self.config.models_refresh_s:
            return
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        try:
            async with self.session.get(
                f"{backend.url}/v1/models", timeout=timeout, **backend.client_options()
            ) as resp:
                payload = await resp.json(content_type=None)
            cards = {
                m["id"]: m
                for m in payload.get("data", [])
                if isinstance(m, dict) and isinstance(m.get("id"), str)
            }
            models = frozenset(cards)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
            log.warning("backend %s: cannot read /v1/models: %s", backend.name, exc)
            return
        if models != backend.models:
            log.info("backend %s serves %s", backend.name, sorted(models))
        backend.models = models
        backend.model_cards = cards
        self._models_checked[backend.name] = now
