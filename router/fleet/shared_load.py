"""The shared load view: every router replica's in-flight requests per backend, summed, and
its pending prefill (the uncached prompt tokens of its requests there without a first byte,
and how many requests they are).

A policy weighing "how busy is this backend" must count the requests every replica sent
there, not only its own, or N replicas each pile up to the threshold on the same engine.
Each replica publishes its own counts every ``load_interval_s`` (one script call, which
also returns everyone else's sums), and each backend's view then shows its own in-flight
count, current to the request, plus the others', at most two intervals old (theirs and its
own). Redis keeps the sums as they go (router/index/redis_scripts.py, ``_LOAD_VIEW``), so a
call costs it in proportion to the backends, however many replicas there are.

While nothing is in flight anywhere (its own requests, and the others' as of its last call)
a replica calls only every ``load_idle_interval_s``: an idle fleet has nothing that ages, and
a 10 ms loop of calls took an idle router about 5 % of a core (3 % with this, against 1.7 %
at the old fixed 100 ms, by its CPU time over 20 s). It still looks at its own
counts every interval, so its first request after an idle spell is published within one; that
request is routed on a view up to the idle interval old. It is not idle until the others hold
its counts as they are, so the end of its last request is published within one interval too.

The interval is short (10 ms) because a request's prefill lasts tens of milliseconds: a view
100 ms old shows the others' requests mostly after their prefill is over, and four replicas
queued their prefills behind each other's (TTFT at the engines 1.12-1.17x one router's,
against 1.04-1.08x at 10 ms: docs/benchmarks/2026-12-07-shared-load.md). The fleet's calls
then cost Redis in proportion to replicas x backends / interval, so on a larger fleet each
replica stretches its interval by replicas x backends / ``load_interval_fleet`` (the live
replicas are counted by each call), which holds Redis's share of work for the view about
constant (``python -m loadtest.bench_shared_load``).

With ``lookup: shared`` (``index.redis.load_on_lookup``) the view also rides on the round
trips each request makes anyway: every lookup's script reads the fleet's sums (the others'
load is the sums less this replica's part), and every write, which leaves at once after a
pick, publishes this replica's counts in its pipeline. A pick then sees the others' load as
of their last pick, where the periodic calls alone show it up to two intervals old
(docs/benchmarks/2026-12-07-shared-load.md). A replica whose writes published within the
last interval, with its counts unchanged since, skips its periodic call; the calls carry the
view, and the liveness below, while it sends nothing. It rides only on a fleet within
``load_interval_fleet`` (``riding``): a publish per write costs Redis in proportion to the
backends, which past that size the stretched calls bound. At most one publish of a replica's
is in flight, and a lookup drops its read if one started since it was sent: Redis then holds
exactly ``_published`` as this replica's part, so its own load is never counted as the others'.

Liveness: a replica's counts live under its id with its last publish time; one that has
not published for ``load_ttl_s`` (it died) stops counting then, and its counts are withdrawn
by the next publisher. A replica that stops cleanly withdraws its counts at once. While
Redis is unavailable the others' counts are dropped after ``load_ttl_s``: the view falls
back to this replica's own, rather than steering by a frozen picture of the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from router.fleet.backends import Backend, BackendPool
from router.index.base import PrefixIndex
from router.index.redis_scripts import LEAVE, LOAD, Keys, LoadCall, Script, SumsRead
from router.index.redis_store import RedisIndex
from router.index.redis_sync import SyncedIndex
from router.redis.breaker import RedisLink, RedisUnavailable
from router.redis.client import replica_id
from router.tasks import stop_task

_LOAD = Script(LOAD)
_LEAVE = Script(LEAVE)


class SharedLoad:
    def __init__(self, link: RedisLink, pool: BackendPool) -> None:
        self.link = link
        self.pool = pool
        self.config = link.config
        self.keys = Keys(self.config.namespace)
        self._keys = [self.keys.replicas, self.keys.load_parts, self.keys.load_sums]
        self.id = replica_id()
        self._last_sync = 0.0
        #: Live replicas, this one included, as of the last call.
        self.replicas = 1
        #: This replica's counts per backend as it last published them: its part of Redis's sums.
        self._published: dict[str, tuple[int, int, int]] = {}
        #: Publishes started, and whether one is in flight: at most one is, so that Redis holds
        #: ``_published`` whenever none is, and a lookup's sums less it are the others' load.
        self._publishes = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        #: The sums' fields for the pool's backends, kept while the pool's names stay the same.
        self._fields: tuple[tuple[str, ...], list[str]] = ((), [])
        self._task: asyncio.Task[None] | None = None
        #: The index whose round trips carry the view too (``ride``), if any.
        self._rides: RedisIndex | None = None
        pool.subscribe(lambda backend: None, self._on_removed)

    def _on_removed(self, backend: Backend) -> None:
        """Its counts are withdrawn by the next publish, which no longer lists it."""
        with contextlib.suppress(KeyError):  # no sample yet: nothing to remove
            self.link.metrics.others_in_flight.remove(backend.name)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-shared-load")

    async def sync_once(self) -> None:
        """Publish this replica's counts and take in the others'; RedisUnavailable when Redis
        fails. Nothing to do while a write's publish is in flight: it carries the same."""
        call = self.publish_call()
        if call is None:
            return
        try:
            reply = await self.link.call(
                "load",
                lambda: _LOAD(self.link.client, call.keys, call.args),
                self.config.background_timeout_ms / 1000,
            )
        except BaseException:
            self.publish_failed()
            raise
        self.published(call, reply)

    def riding(self) -> bool:
        """Whether lookups and writes carry the view now: only on a fleet within
        ``load_interval_fleet``, since a publish per write costs Redis in proportion to the
        backends, which past that size the stretched periodic calls are there to bound."""
        return self._rides is not None and self.interval() <= self.config.load_interval_s

    def publish_call(self) -> LoadCall | None:
        """The LOAD script's call publishing this replica's counts as they are now; None while
        another is in flight. The caller reports its end: ``published`` or ``publish_failed``."""
        if not self._quiet.is_set():
            return None
        self._quiet.clear()
        self._publishes += 1
        args: list[object] = [self.id, int(self.config.load_ttl_s * 1000)]
        own = self._own()
        for name, load in own.items():
            args += [name, *load]
        return LoadCall(_LOAD, self._keys, args, own)

    def published(self, call: LoadCall, reply: list) -> None:
        """``call`` went through with ``reply``: the others' sums, as of now."""
        self._quiet.set()
        self._last_sync = time.monotonic()
        self._published = call.own
        self.replicas, sums = int(reply[0]), reply[1:]
        others = {
            (name.decode() if isinstance(name, bytes) else name): (int(count), int(tokens), int(requests))
            for name, count, tokens, requests in zip(
                sums[::4], sums[1::4], sums[2::4], sums[3::4], strict=True
            )
        }
        self._set_others(others)

    def publish_failed(self) -> None:
        """The publish in flight did not go through (or its outcome is unknown): the next may."""
        self._quiet.set()

    def sums_read(self) -> SumsRead | None:
        """What a lookup should read of the fleet's sums (None: nothing, while this replica's
        own part in Redis is in doubt, a publish being in flight, when not ``riding``, or with
        no backends to read)."""
        if not self.riding() or not self._quiet.is_set():
            return None
        names = tuple(backend.name for backend in self.pool)
        if not names:
            return None
        if names != self._fields[0]:
            self._fields = (names, [f"{kind}/{name}" for name in names for kind in "ntr"])
        return SumsRead(self.keys.load_sums, self._fields[1], self._publishes)

    def read_sums(self, read: SumsRead, values: list) -> None:
        """The fleet's sums as a lookup read them: the others' load is the sums less this
        replica's own part, which Redis held as ``_published`` if no publish of its own started
        since the read was sent (else the read is dropped: its part might be either)."""
        if read.publishes != self._publishes:
            return
        sums = dict(zip(read.fields, values, strict=True))
        others = {}
        for backend in self.pool:
            name = backend.name
            count, tokens, requests = self._published.get(name, (0, 0, 0))
            others[name] = (
                max(0, int(sums.get(f"n/{name}") or 0) - count),
                max(0, int(sums.get(f"t/{name}") or 0) - tokens),
                max(0, int(sums.get(f"r/{name}") or 0) - requests),
            )
        self._set_others(others)

    def _own(self) -> dict[str, tuple[int, int, int]]:
        return {backend.name: backend.own_load() for backend in self.pool}

    def _set_others(self, others: dict[str, tuple[int, int, int]]) -> None:
        for backend in self.pool:
            count, tokens, requests = others.get(backend.name, (0, 0, 0))
            backend.set_remote_load(count, tokens, requests)

    def _export(self) -> None:
        """The others' in-flight counts as gauges: once an interval (``_run``), not on each
        lookup or write that changes them."""
        for backend in self.pool:
            self.link.metrics.others_in_flight.labels(backend.name).set(backend.remote_in_flight)

    def idle(self) -> bool:
        """Nothing in flight anywhere, as far as this replica knows (its own requests, and the
        others' as of its last call), and the others already know its own counts as they are:
        nothing in the view is ageing, so it need not be fresh. Without the last condition a
        replica whose last request just ended would leave its last non-zero counts (pending
        prefill included) in the others' view for ``load_idle_interval_s``."""
        if any(backend.in_flight or backend.remote_in_flight for backend in self.pool):
            return False
        return self._published == self._own()

    async def _run(self) -> None:
        while True:
            since = time.monotonic() - self._last_sync
            # Riding on the index, a busy replica publishes with every write: a call of its own
            # within an interval of one would add nothing.
            ridden = self.riding() and since < self.interval() and self._published == self._own()
            due = since >= self.config.load_idle_interval_s
            if self.link.up and not ridden and (due or not self.idle()):
                with contextlib.suppress(RedisUnavailable):
                    await self.sync_once()
            if time.monotonic() - self._last_sync > self.config.load_ttl_s:
                self._set_others({})
            self._export()
            await asyncio.sleep(self.interval())

    def interval(self) -> float:
        """Seconds until the next call, for the fleet as of the last one (``RedisConfig.load_interval``)."""
        return self.config.load_interval(self.replicas, len(self.pool))

    def ride(self, index: RedisIndex) -> None:
        """Ride on ``index``'s lookups and writes (``index.redis.load_on_lookup``)."""
        index.load_rider = self
        self._rides = index

    async def close(self) -> None:
        """Stop publishing and withdraw this replica's counts (best effort, bounded)."""
        if self._rides is not None:
            self._rides.load_rider = None  # the index's last writes must not publish again
        if self._task is not None:
            await stop_task(self._task)
        with contextlib.suppress(TimeoutError):  # a write's publish in flight lands before LEAVE
            await asyncio.wait_for(self._quiet.wait(), self.config.background_timeout_ms / 1000)
        with contextlib.suppress(RedisUnavailable):
            await self.link.call(
                "load",
                lambda: _LEAVE(self.link.client, self._keys, [self.id]),
                self.config.background_timeout_ms / 1000,
            )


def start_shared_load(index: PrefixIndex, pool: BackendPool) -> SharedLoad | None:
    """The shared load view when the index lives in Redis with ``share_load`` on, started; else None."""
    if not isinstance(index, (RedisIndex, SyncedIndex)) or not index.config.share_load:
        return None
    shared = SharedLoad(index.link, pool)
    if isinstance(index, RedisIndex) and index.config.load_on_lookup:
        shared.ride(index)
    shared.start()
    return shared
