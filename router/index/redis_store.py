"""The Redis prefix index: one view of the fleet's caches for every router replica and worker.

Reads are on the request path, so a lookup is one script call (one round trip) with a
deadline of ``index.redis.timeout_ms``; writes are not, so ``record`` only appends to a
bounded queue that a background task drains in batches, one script call per batch.

Every update is also applied to a local MemoryIndex, the mirror. When Redis is down or
slow (see router.redis.breaker), lookups are answered from the mirror: this router's own
recent routing history, the view it would have without Redis. Requests never wait on a
dead Redis and never fail because of one; the shared view returns by itself.

The key layout, the eviction scores and the Cluster trade-off are described in
router.index.redis_scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from router.index.base import PrefixIndex
from router.index.memory import MemoryIndex
from router.index.redis_scripts import MATCH, RECORD, Keys, LoadCall, Script, SumsRead, pack_chain
from router.index.settings import IndexConfig
from router.index.write_queue import WriteQueue
from router.redis.breaker import RedisLink, RedisUnavailable, open_link
from router.tasks import stop_task

#: Eviction policies the Redis scripts implement (the score of a block in a backend's ZSET).
EVICTIONS = ("lru", "lfu", "ttl")
#: Connections opened at start: enough for the lookups of a burst of requests to find one open.
WARM_CONNECTIONS = 8
#: How often the shared index's per-backend sizes are re-read for ``size``/``blocks_of``.
SIZE_REFRESH_S = 1.0

_MATCH = Script(MATCH)
_RECORD = Script(RECORD)


class LoadRider(Protocol):
    """The shared load view, riding on this index's round trips (``index.redis.load_on_lookup``;
    router.fleet.shared_load.SharedLoad): each lookup reads the fleet's sums, and each write,
    which leaves at once after a pick, publishes this replica's counts."""

    def sums_read(self) -> SumsRead | None: ...

    def read_sums(self, read: SumsRead, values: list[Any]) -> None: ...

    def riding(self) -> bool: ...

    def publish_call(self) -> LoadCall | None: ...

    def published(self, call: LoadCall, reply: list[Any]) -> None: ...

    def publish_failed(self) -> None: ...


class RedisIndex(PrefixIndex):
    def __init__(
        self, link: RedisLink, local: MemoryIndex, eviction: str = "lru", belief_ttl_s: float = 120.0
    ) -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"the Redis index supports eviction {list(EVICTIONS)}, not {eviction!r}")
        self.link = link
        self.config = link.config
        self.metrics = link.metrics
        #: The mirror: every local update, answering lookups while Redis is unavailable.
        self.local = local
        self.eviction = eviction
        self._belief_ttl_ms = int(belief_ttl_s * 1000)
        self.keys = Keys(self.config.namespace)
        self._capacity: dict[str, int] = {}
        #: Each backend's block count in Redis, as last read (lookups and a periodic refresh).
        self._shared_blocks: dict[str, int] = {}
        self.queue = WriteQueue(link, link.metrics)
        self._deleted: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        #: Entries this router's writes evicted in Redis (capacity and global budget).
        self.evictions = 0
        #: The shared load view, when it rides on lookups and writes (router/fleet/shared_load.py).
        self.load_rider: LoadRider | None = None

    async def start(self) -> None:
        await self._warm(WARM_CONNECTIONS)
        # What was queued before start (the first scrape may re-size capacities) is written first.
        self._tasks = [
            asyncio.create_task(
                self.queue.run(self._flush_once, self._has_writes), name="kvroute-redis-writer"
            ),
            asyncio.create_task(self._refresh_loop(), name="kvroute-redis-sizes"),
        ]

    async def _warm(self, connections: int) -> None:
        """Open ``connections`` pooled connections, one ping each, before the first request.

        A lookup that finds no open connection pays a connect and a handshake on top of its
        round trip; the first burst of requests would otherwise all do so at once.
        """
        pings = (
            self.link.call("probe", self.link.client.ping, self._background_timeout)
            for _ in range(connections)
        )
        await asyncio.gather(*pings, return_exceptions=True)

    @property
    def _background_timeout(self) -> float:
        return self.config.background_timeout_ms / 1000

    def add_backend(self, name: str, capacity_blocks: int) -> None:
        self.local.add_backend(name, capacity_blocks)
        self._capacity.setdefault(name, capacity_blocks)

    def set_capacity(self, name: str, capacity_blocks: int) -> None:
        """Every write passes the capacity to the script; an empty write trims the set now."""
        self.local.set_capacity(name, capacity_blocks)
        if name not in self._capacity:
            return
        self._capacity[name] = capacity_blocks
        self.queue.items.append((name, ()))  # never dropped: it trims the set
        self.queue.notify()

    def capacity_of(self, name: str) -> int | None:
        return self._capacity.get(name)

    def remove_backend(self, name: str) -> None:
        self.local.remove_backend(name)
        if self._capacity.pop(name, None) is None:
            return
        self._shared_blocks.pop(name, None)
        self.queue.items = deque(item for item in self.queue.items if item[0] != name)
        self._deleted.append(self.keys.blocks(name))
        self.queue.notify()

    async def match(self, chain: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        names = list(backends)
        if not chain or not names:
            return dict.fromkeys(names, 0)
        if self.link.up:
            keys = [self.keys.epochs, *(self.keys.blocks(name) for name in names)]
            args: list[object] = [self.eviction, self._belief_ttl_ms, pack_chain(chain)]
            rider = self.load_rider
            read = rider.sums_read() if rider is not None else None
            if read is not None:
                # The fleet's load sums come back with the depths: the pick that follows sees
                # every other replica's load as they last published it (at their last write,
                # so their last pick), not as of this replica's last periodic call.
                keys.append(read.key)
                args += [len(read.fields), *read.fields]
            try:
                reply = await self.link.call(
                    "match", partial(_MATCH, self.link.client, keys, args), self.config.timeout_ms / 1000
                )
            except RedisUnavailable:
                pass
            else:
                if rider is not None and read is not None:
                    rider.read_sums(read, reply[2 * len(names) :])
                depths = {}
                for i, name in enumerate(names):
                    depths[name] = int(reply[2 * i])
                    if name in self._capacity:
                        self._shared_blocks[name] = int(reply[2 * i + 1])
                return depths
        self.metrics.fallbacks.inc()
        return await self.local.match(chain, names)

    def record(self, backend: str, chain: Sequence[int]) -> None:
        self.local.record(backend, chain)
        if not chain or backend not in self._capacity:
            return
        self.queue.push(backend, chain)

    def picked(self, backend: str, chain: Sequence[int]) -> None:
        """Believed at the pick, here and (the write queue drains at once) in Redis: the other
        replicas learn where a new prefix went while its prefill runs, not after it.

        Waiting for the engine's answer (as the memory index does) costs one router nothing,
        since it sees its own burst; but a burst sharing a new prefix that arrives across N
        replicas during that prefill would spread over N engines before any replica told the
        others. A pick that then fails before the engine took the prompt leaves its belief to
        capacity eviction (and the closed loop, when on): rare, and only ever a cache miss.
        """
        self.record(backend, chain)

    def failed(self, backend: str, chain: Sequence[int]) -> None:
        """Withdrawn from the local mirror; the shared belief is left to eviction (see ``picked``)."""
        self.local.failed(backend, chain)

    def blocks_of(self, backend: str) -> int:
        if self.link.up and backend in self._shared_blocks:
            return self._shared_blocks[backend]
        return self.local.blocks_of(backend)

    def size(self) -> int:
        if self.link.up and self._shared_blocks:
            return sum(self._shared_blocks.values())
        return self.local.size()

    def _has_writes(self) -> bool:
        return bool(self.queue.items or self._deleted)

    async def _flush_once(self) -> None:
        """Send the deletions, or one batch of updates, in one round trip."""
        client = self.link.client
        if self._deleted:
            deleted, self._deleted = self._deleted, []
            with contextlib.suppress(RedisUnavailable):
                await self.link.call("record", lambda: client.delete(*deleted), self._background_timeout)
            return
        batch = self.queue.take_batch()
        names = list(self._capacity)
        position = {name: i + 3 for i, name in enumerate(names)}
        keys = [self.keys.clock, self.keys.epochs, *(self.keys.blocks(name) for name in names)]
        key_ttl_ms = int(self.config.key_ttl_s * 1000)
        args: list[object] = [self.eviction, key_ttl_ms, self._belief_ttl_ms, self.local.max_blocks]
        for backend, chain in batch:
            if backend in position:
                args += [position[backend], self._capacity[backend], pack_chain(chain)]
        write = partial(_RECORD, client, keys, args)
        rider = self.load_rider
        # Only while the link is up: then the call runs the write, which reports the publish's end.
        load = rider.publish_call() if rider is not None and rider.riding() and self.link.up else None
        if rider is not None and load is not None:
            write = partial(self._record_and_publish_load, rider, load, keys, args)
        try:
            evicted = await self.link.call("record", write, self._background_timeout)
        except RedisUnavailable:
            self.metrics.dropped_updates.labels("redis_unavailable").inc(len(batch))
        else:
            self.evictions += int(evicted)

    async def _record_and_publish_load(
        self, rider: LoadRider, load: LoadCall, keys: list[str], args: list[Any]
    ) -> Any:
        """A batch of writes and this replica's load in one round trip: a write leaves at once
        after a pick, so the others' next lookups see the pick's load with its belief. The load
        is a passenger: its failure is counted and never fails (or loses) the write."""
        client = self.link.client
        settled = False
        try:
            pipe = client.pipeline(transaction=False)
            _RECORD.queue(pipe, keys, args)
            load.script.queue(pipe, load.keys, load.args)
            written, loaded = await pipe.execute(raise_on_error=False)
            try:
                reply = await load.script.settle(client, loaded, load.keys, load.args)
            except RedisError:
                self.metrics.errors.labels("load", "response").inc()
            else:
                rider.published(load, reply)
                settled = True
            return await _RECORD.settle(client, written, keys, args)
        finally:
            if not settled:
                rider.publish_failed()

    async def _refresh_loop(self) -> None:
        """Keep ``size``/``blocks_of`` current for metrics and policies, even without traffic."""
        while True:
            await asyncio.sleep(SIZE_REFRESH_S)
            names = list(self._capacity)
            if not self.link.up or not names:
                continue
            keys = [self.keys.epochs, *(self.keys.blocks(name) for name in names)]
            args = [self.eviction, self._belief_ttl_ms, b""]
            with contextlib.suppress(RedisUnavailable):
                reply = await self.link.call(
                    "sizes", partial(_MATCH, self.link.client, keys, args), self._background_timeout
                )
                self._shared_blocks.update((name, int(reply[2 * i + 1])) for i, name in enumerate(names))

    async def close(self) -> None:
        """Flush what is queued (bounded by the background deadline), then disconnect."""
        for task in self._tasks:
            await stop_task(task)
        self._tasks = []
        await self.flush()
        await self.link.close()

    async def flush(self) -> None:
        """Write everything queued now, batch after batch; stops early if Redis goes down."""
        await self.queue.drain(self._flush_once, self._has_writes)


def build_redis_index(index: IndexConfig, local: MemoryIndex, registry: CollectorRegistry) -> RedisIndex:
    """The Redis index of ``index.redis``, its link (breaker) and metrics in ``registry``."""
    return RedisIndex(
        open_link(index.redis, registry), local, eviction=index.eviction, belief_ttl_s=index.ttl_s
    )
