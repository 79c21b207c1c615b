"""The memory index, kept in step across router replicas over a Redis stream (``lookup: local``).

The shared Redis index (router.index.redis_store) answers each lookup with a round trip: on a
busy router that is one more wait per request on the event loop, and on a small host the
Lua script and redis-py's work per call cost more CPU than the rest of the routing decision.
Here each replica keeps the whole index in its own memory and looks up there, as one router
does; what it believes (at the pick, as the memory index does) it appends to one Redis
stream, batched, and it applies what every other replica appended. A prefix one replica
routes reaches the others' lookups one stream read later (milliseconds), so a burst sharing a
new prefix, spread over the replicas, still lands on one engine.

Each replica evicts by its own copy's capacity and eviction order: the replicas see the same
beliefs in nearly the same order, so their copies agree closely, but not exactly (unlike the
shared index's one set of ZSETs). A failed pick is withdrawn locally only and left to eviction
elsewhere, as in the shared index. The stream keeps the last ``stream_length`` batches; a
starting replica replays them, so it starts with the fleet's recent beliefs rather than none.

Redis is never on the request path: while it is down, lookups go on as before and this
replica's beliefs wait in the bounded write queue; the others' are missed until it is back.
"""

from __future__ import annotations

import asyncio
import math
import struct
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from policies.eviction import BlockSet, LRUBlocks
from router.index.memory import MemoryIndex
from router.index.redis_scripts import Keys, pack_chain
from router.index.settings import IndexConfig
from router.index.write_queue import WriteQueue
from router.redis.breaker import RedisLink, RedisUnavailable, open_link
from router.redis.client import replica_id
from router.tasks import stop_task

#: How long one stream read waits for new entries before it asks again (a blocking read).
READ_BLOCK_MS = 200
#: Most stream entries taken in one read.
READ_COUNT = 256

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[tuple[str, bytes]]).decode


def unpack_chain(packed: bytes) -> list[int]:
    """The inverse of :func:`router.index.redis_scripts.pack_chain`."""
    return list(struct.unpack(f">{len(packed) // 8}Q", packed))


class SyncedIndex(MemoryIndex):
    def __init__(
        self, link: RedisLink, max_blocks: int, block_set: Callable[[int], BlockSet] = LRUBlocks
    ) -> None:
        super().__init__(max_blocks, block_set)
        self.link = link
        self.config = link.config
        self.metrics = link.metrics
        self.id = replica_id()
        self.stream = Keys(self.config.namespace).beliefs
        self.queue = WriteQueue(link, link.metrics)
        self._tasks: list[asyncio.Task[None]] = []
        #: Until when the stream's last TTL renewal leaves it at least half its TTL (monotonic).
        self._ttl_renewed_until = 0.0
        #: The newest stream entry taken here, as (milliseconds, sequence): reads resume after it,
        #: and an entry two overlapping reads both return is applied once.
        self._last = (0, 0)
        #: When the writer last read the stream along with its append (monotonic).
        self._exchanged_at = -math.inf

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(
                self.queue.run(self._exchange_once, interval_s=self._sync_interval),
                name="kvroute-redis-sync-writer",
            ),
            asyncio.create_task(self._read_loop(), name="kvroute-redis-sync-reader"),
        ]

    def record(self, backend: str, chain: Sequence[int]) -> None:
        """Believe it here at once, and queue it for the other replicas."""
        super().record(backend, chain)
        if chain and backend in self._backends:
            self.queue.push(backend, chain)

    def apply(self, batch: bytes) -> int:
        """Believe another replica's batch of beliefs here; how many were for known backends."""
        applied = 0
        for backend, packed in _decode(batch):
            if backend in self._backends:
                super().record(backend, unpack_chain(packed))
                applied += 1
        return applied

    @property
    def _background_timeout(self) -> float:
        return self.config.background_timeout_ms / 1000

    async def _exchange_once(self) -> None:
        """Append one batch of this replica's beliefs and take what the stream gained since the
        last read, in one round trip: a busy replica's writer is its reader too. Separate, each
        worker of ``--workers 2`` made an XADD and an XREAD every interval, which with the TTL
        renewed on each append took about 7 % of its CPU (py-spy under ``kvroute bench workers``).
        The stream's TTL (it lets an abandoned namespace expire) rides along every half TTL."""
        batch = self.queue.take_batch()
        fields = {"r": self.id, "b": _encode([(backend, pack_chain(chain)) for backend, chain in batch])}
        since = self._last_id
        renew = time.monotonic() >= self._ttl_renewed_until

        async def exchange() -> Any:
            async with self.link.client.pipeline(transaction=False) as pipe:
                pipe.xadd(self.stream, fields, maxlen=self.config.stream_length, approximate=True)
                pipe.xread({self.stream: since}, count=READ_COUNT)
                if renew:
                    pipe.pexpire(self.stream, int(self.config.key_ttl_s * 1000))
                return (await pipe.execute())[1]

        try:
            reply = await self.link.call("record", exchange, self._background_timeout)
        except RedisUnavailable:
            self.metrics.dropped_updates.labels("redis_unavailable").inc(len(batch))
            # A Redis that comes back may have lost the stream, and the next append would make
            # it anew without a TTL: renew it with that append.
            self._ttl_renewed_until = 0.0
            return
        now = time.monotonic()
        if renew:
            self._ttl_renewed_until = now + self.config.key_ttl_s / 2
        self._exchanged_at = now
        self._take(reply)

    @property
    def _last_id(self) -> str:
        return f"{self._last[0]}-{self._last[1]}"

    def _take(self, reply: Any) -> bool:
        """Apply the other replicas' entries of an XREAD reply not taken yet; whether it had any."""
        entries = [entry for _stream, stream_entries in reply or () for entry in stream_entries]
        for entry_id, fields in entries:
            millis, _, sequence = entry_id.partition(b"-")
            key = (int(millis), int(sequence))
            if key <= self._last:
                continue
            self._last = key
            if fields.get(b"r", b"").decode() != self.id:
                self.metrics.peer_updates.inc(self.apply(fields.get(b"b", b"\x90")))
        return bool(entries)

    @property
    def _sync_interval(self) -> float:
        """The wait after each append and each non-empty read: a round trip per request was the
        largest cost of ``--workers`` processes beyond one router's (``kvroute bench overhead
        --workers 2 --profile``)."""
        return self.config.sync_interval_ms / 1000

    async def _read_loop(self) -> None:
        """Take the other replicas' batches while this replica has none of its own to append
        (the writer reads with each append), from the oldest the stream keeps: a blocking read,
        which wakes as soon as anything is appended.

        After an outage the read resumes where it stopped; what the stream trimmed meanwhile
        is missed, and only costs hits until those prefixes are routed again.
        """
        timeout = self._background_timeout + READ_BLOCK_MS / 1000
        # The writer exchanges every interval while it has beliefs to append; past two intervals
        # without one it has gone quiet.
        writer_quiet_after = 2 * self._sync_interval
        while True:
            if not self.link.up:
                await asyncio.sleep(self.config.retry_interval_s)
                continue
            since_exchange = time.monotonic() - self._exchanged_at
            if since_exchange < writer_quiet_after:
                await asyncio.sleep(writer_quiet_after - since_exchange)
                continue
            read = partial(
                self.link.client.xread, {self.stream: self._last_id}, count=READ_COUNT, block=READ_BLOCK_MS
            )
            try:
                reply = await self.link.call("sync", read, timeout)
            except RedisUnavailable:
                await asyncio.sleep(self.config.retry_interval_s)
                continue
            if self._take(reply):
                await asyncio.sleep(self._sync_interval)

    async def close(self) -> None:
        """Stop reading, append what is queued (bounded by the background deadline), disconnect."""
        for task in self._tasks:
            await stop_task(task)
        self._tasks = []
        await self.queue.drain(self._exchange_once)
        await self.link.close()


def build_synced_index(
    index: IndexConfig, block_set: Callable[[int], BlockSet], registry: CollectorRegistry
) -> SyncedIndex:
    """The synced index of ``index.redis``, its link (breaker) and metrics in ``registry``."""
    return SyncedIndex(open_link(index.redis, registry), index.max_blocks, block_set)
