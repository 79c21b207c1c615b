"""Whether Redis is usable right now: one breaker per process, shared by the index and load view.

Every Redis call goes through :meth:`RedisLink.call`, which puts a deadline on it, times
it, and counts its failures. A connection error (the server is gone) marks Redis down at
once; timeouts do after ``trip_after`` in a row (one slow answer on a busy host is not an
outage). While down, callers skip Redis entirely — no request waits on a dead server —
and a probe pings it every ``retry_interval_s``; the first answer brings shared state
back. Each outage is logged once when it starts and once when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.metrics import RedisMetrics
from router.redis.client import RedisClient, build_client
from router.redis.settings import RedisConfig
from router.tasks import stop_task

if sys.version_info >= (3, 11):
    from asyncio import timeout as deadline
else:  # redis-py depends on async-timeout below 3.11.3
    from async_timeout import timeout as deadline

log = logging.getLogger("kvroute.redis")

T = TypeVar("T")


class RedisUnavailable(Exception):
    """Redis could not answer this call in time; use the local view."""


def _kind(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.TimeoutError, RedisTimeoutError)):
        return "timeout"
    if isinstance(exc, AuthenticationError):
        return "auth"
    if isinstance(exc, (RedisConnectionError, OSError)):
        return "connection"
    return "response"


class RedisLink:
    def __init__(self, client: RedisClient, config: RedisConfig, metrics: RedisMetrics) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        self.up = True
        self._slow_in_a_row = 0
        self._down_since = 0.0
        self._probe: asyncio.Task[None] | None = None
        metrics.up.set(1)

    async def call(self, op: str, fn: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """``await fn()`` within ``timeout_s``, or raise RedisUnavailable (counted, maybe tripping).

        The deadline cancels ``fn`` in the calling task: ``asyncio.wait_for`` (before Python
        3.12) would run it in a task of its own, and the hand-offs between the two tasks cost
        two extra passes of the event loop per call, which on a busy router took longer than
        the round trip itself (README, "The Redis benchmark").
        """
        if not self.up:
            raise RedisUnavailable("redis is down")
        started = time.perf_counter()
        try:
            async with deadline(timeout_s):
                result = await fn()
        except (asyncio.TimeoutError, RedisError, OSError) as exc:
            kind = _kind(exc)
            self.metrics.errors.labels(op, kind).inc()
            if kind == "timeout":
                self._slow_in_a_row += 1
                if self._slow_in_a_row >= self.config.trip_after:
                    self._trip(f"{self._slow_in_a_row} calls in a row slower than their deadline")
            elif kind != "response":
                # A response error (the server answered: OOM, a script error) fails this
                # call only; a lost or refused connection means every call would fail.
                self._trip(f"{type(exc).__name__}: {exc}")
            raise RedisUnavailable(str(exc) or kind) from exc
        self._slow_in_a_row = 0
        self.metrics.latency.labels(op).observe(time.perf_counter() - started)
        return result

    def _trip(self, reason: str) -> None:
        if not self.up:
            return
        self.up = False
        self._down_since = time.monotonic()
        self.metrics.up.set(0)
        log.warning("Redis unavailable (%s); routing on this router's local view until it answers", reason)
        self._probe = asyncio.get_running_loop().create_task(self._recover(), name="kvroute-redis-probe")

    async def _recover(self) -> None:
        while True:
            await asyncio.sleep(self.config.retry_interval_s)
            started = time.perf_counter()
            try:
                async with deadline(self.config.background_timeout_ms / 1000):
                    await self.client.ping()
            except (asyncio.TimeoutError, RedisError, OSError) as exc:
                self.metrics.errors.labels("probe", _kind(exc)).inc()
                continue
            self.metrics.latency.labels("probe").observe(time.perf_counter() - started)
            self.up = True
            self._slow_in_a_row = 0
            self.metrics.up.set(1)
            down_for = time.monotonic() - self._down_since
            log.warning("Redis is back after %.1f s; using the shared state again", down_for)
            return

    async def close(self) -> None:
        if self._probe is not None:
            await stop_task(self._probe)
        await self.client.aclose()


def open_link(config: RedisConfig, registry: CollectorRegistry) -> RedisLink:
    """The link to ``config``'s Redis: its client, its breaker, its metrics in ``registry``."""
    return RedisLink(build_client(config), config, RedisMetrics(registry))
