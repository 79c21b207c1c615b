"""Beliefs waiting to leave for Redis: the write side shared by the Redis and synced indexes.

``record`` is on the request path, so it only appends here; one background task drains the
queue in batches, one Redis call per batch. The queue is bounded (``write_queue_size``):
when full, a belief is dropped and counted, never waited on. While Redis is down the queue is
held, and drained once it answers again.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from router.metrics import RedisMetrics
from router.redis.breaker import RedisLink

Belief = tuple[str, Sequence[int]]


class WriteQueue:
    def __init__(self, link: RedisLink, metrics: RedisMetrics) -> None:
        self.link = link
        self.config = link.config
        self.metrics = metrics
        self.items: deque[Belief] = deque()
        self._wake: asyncio.Event | None = None

    def push(self, backend: str, chain: Sequence[int]) -> None:
        """Queue a belief, or drop and count it when the queue is full."""
        if len(self.items) >= self.config.write_queue_size:
            self.metrics.dropped_updates.labels("queue_full").inc()
            return
        self.items.append((backend, chain))
        self.notify()

    def notify(self) -> None:
        """Wake the writer (queued before ``run`` started, it finds the work when it does)."""
        if self._wake is not None:
            self._wake.set()

    def take_batch(self) -> list[Belief]:
        """The next beliefs, at most ``write_batch_blocks`` blocks (a single longer chain goes alone)."""
        batch = [self.items.popleft()]
        blocks = len(batch[0][1])
        while self.items and blocks + len(self.items[0][1]) <= self.config.write_batch_blocks:
            batch.append(self.items.popleft())
            blocks += len(batch[-1][1])
        self.metrics.write_queue.set(len(self.items))
        return batch

    async def run(
        self,
        flush_once: Callable[[], Awaitable[None]],
        more: Callable[[], bool] | None = None,
        interval_s: float = 0.0,
    ) -> None:
        """The writer: ``flush_once`` while ``more()`` (by default: beliefs are queued) says there
        is work; held while Redis is down. After each flush it waits ``interval_s``, so that under
        load the next beliefs gather into one batch; after a quiet spell a belief leaves at once."""
        more = more or self._has_items
        self._wake = asyncio.Event()
        while True:
            if not more():
                await self._wake.wait()
                self._wake.clear()
                continue
            if not self.link.up:
                await asyncio.sleep(self.config.retry_interval_s)
                continue
            await flush_once()
            if interval_s:
                await asyncio.sleep(interval_s)

    async def drain(
        self, flush_once: Callable[[], Awaitable[None]], more: Callable[[], bool] | None = None
    ) -> None:
        """Write everything queued now, batch after batch, without waiting between them (at
        shutdown, or when a caller needs it written); stops early if Redis goes down."""
        more = more or self._has_items
        while self.link.up and more():
            await flush_once()

    def _has_items(self) -> bool:
        return bool(self.items)
