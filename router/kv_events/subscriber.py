"""Follow engines' KV event streams and keep the precise index equal to what they report.

One :class:`StreamSubscriber` per stream (a backend's data-parallel rank) holds a ZMQ SUB
socket and numbers what it receives. The engines number batches ``0, 1, 2, ...`` per publisher
process, which gives three cases besides the expected next one:

* **a gap** (``seq`` ahead of the next expected): batches were lost (PUB drops past its
  high-water mark, or the subscription was not yet active). They are fetched from the engine's
  replay socket through a **DEALER**, which, unlike REQ, receives every reply of the one request.
* **a step back** (``seq`` below it, and not a duplicate of batches just replayed): a new
  publisher, i.e. the engine restarted. Its cache started empty.
* **a (re)connection** of the SUB socket (seen on the socket's monitor): whatever happened
  while disconnected, possibly a restart, is unknown.

The last two **resync** the stream: forget what it reported, then rebuild from a replay from
sequence 0, which is exact while the engine's replay buffer (``buffer_steps``, 10,000 batches
by default) still reaches back to the publisher's start. Without a replay socket, or past
that buffer, what was missed stays missed and is counted (``kvroute_kv_events_gaps``): the
index then under-believes, never over-believes, except for removals lost in a gap.
``AllBlocksCleared`` (a prefix cache reset) empties the stream's entries in the index.

:class:`KVEventsManager` runs the subscribers of every backend, finding each one's streams in
its config or by asking the engine (see :mod:`router.kv_events.sources`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from zmq.utils.monitor import parse_monitor_message

from router.config import Config
from router.fleet.backends import Backend, BackendPool
from router.fleet.settings import ENGINE_KINDS, EngineKind
from router.index import PrefixIndex
from router.index.precise import PreciseIndex
from router.kv_events.decode import AllBlocksCleared, DecodeError, decode_batch, parse_live, parse_replay
from router.kv_events.engine_shape import engine_of_batch
from router.kv_events.metrics import KVEventMetrics
from router.kv_events.settings import EndpointConfig, EventsConfig
from router.kv_events.sources import DiscoveryError, EventSource, configured_sources, discover_sources
from router.tasks import stop_task

log = logging.getLogger("kvroute.kv_events")

#: ZMQ heartbeats, so a silently dead engine shows up as a disconnection (and a resync later).
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000
_RECONNECT_IVL_MS = 100


class StreamSubscriber:
    """Applies one stream to the index; :meth:`run` until cancelled."""

    def __init__(
        self,
        source: EventSource,
        index: PreciseIndex,
        metrics: KVEventMetrics,
        ctx: zmq.asyncio.Context,
        replay_timeout_s: float,
        engine: EngineKind | None = None,
        on_wrong_engine: Callable[[EngineKind], None] | None = None,
    ) -> None:
        self.source = source
        #: The backend's declared ``engine:``; batches whose hashes are of the other engine's
        #: shape are reported once through ``on_wrong_engine`` (router/kv_events/engine_shape.py).
        self.engine = engine
        self._on_wrong_engine = on_wrong_engine
        self.index = index
        self.metrics = metrics
        self._ctx = ctx
        self._replay_timeout_s = replay_timeout_s
        #: Sequence number of the next batch; None until the stream is placed (after a resync).
        self.expected: int | None = None
        #: Sequence numbers just applied from a replay, which the live socket may still deliver.
        self._replayed: tuple[int, int] | None = None

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        connected = self.metrics.connected.labels(self.source.backend)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_CONNECTED:
                        connected.set(1)
                        await self._resync("connect")
                    else:
                        connected.set(0)
                        self.expected = None
                if sub in ready:
                    await self.on_live(await sub.recv_multipart())
        finally:
            connected.set(0)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def on_live(self, frames: list[bytes]) -> None:
        """Place one live message in the stream's sequence, filling or resyncing as needed."""
        try:
            seq, payload = parse_live(frames)
        except DecodeError as exc:
            self._decode_error(exc)
            return
        if self.expected is None:
            if seq > 0:
                self._count_gap(await self._fill(0))
        elif seq < self.expected:
            low, high = self._replayed or (0, -1)
            if low <= seq <= high:
                return
            log.info("KV events of %s went back to seq %d: engine restarted", self.source.backend, seq)
            await self._resync("restart")
        elif seq > self.expected:
            self._count_gap(await self._fill(self.expected))
        if self.expected is not None and seq < self.expected:
            return
        self._replayed = None
        self._apply(payload)
        self.expected = seq + 1

    async def _resync(self, reason: str) -> None:
        """Forget the stream's entries and rebuild them from a replay from sequence 0."""
        self.index.clear_source(self.source.backend, self.source.rank)
        self.expected = None
        self._replayed = None
        if self.source.replay_endpoint is not None and not await self._fill(0):
            self.metrics.gaps.labels(self.source.backend, "lost").inc()
        self.metrics.resyncs.labels(self.source.backend, reason).inc()

    def _count_gap(self, filled: bool) -> None:
        self.metrics.gaps.labels(self.source.backend, "replayed" if filled else "lost").inc()

    async def _fill(self, start: int) -> bool:
        """Apply the buffered batches from ``start`` on; True when none from ``start`` was missing."""
        batches = await self._replay(start) if self.source.replay_endpoint else None
        if batches is None:
            return False
        if not batches:
            self.expected = start
            return True
        for _, payload in batches:
            self._apply(payload)
        self.expected = batches[-1][0] + 1
        self._replayed = (start, batches[-1][0])
        return batches[0][0] == start

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered batches with ``seq >= start``, or None when the replay socket fails to answer."""
        assert self.source.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay_endpoint)
        try:
            return await asyncio.wait_for(self._request_replay(dealer, start), self._replay_timeout_s)
        except asyncio.TimeoutError:
            log.warning("replay from %s timed out", self.source.replay_endpoint)
        except DecodeError as exc:
            self._decode_error(exc)
        finally:
            dealer.close(linger=0)
        return None

    @staticmethod
    async def _request_replay(dealer: zmq.asyncio.Socket, start: int) -> list[tuple[int, bytes]]:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        batches = []
        while (reply := parse_replay(await dealer.recv_multipart())) is not None:
            if reply[0] >= start:
                batches.append(reply)
        return batches

    def _apply(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self._decode_error(exc)
            return
        if self.engine is not None and self._on_wrong_engine is not None:
            shape = engine_of_batch(batch)
            if shape is not None and shape != self.engine:
                self._on_wrong_engine(shape)
                self._on_wrong_engine = None  # once per stream
        self.index.apply(self.source.backend, self.source.rank, batch)
        self.metrics.batches.labels(self.source.backend).inc()
        if any(isinstance(event, AllBlocksCleared) for event in batch.events):
            self.metrics.resyncs.labels(self.source.backend, "cleared").inc()

    def _decode_error(self, exc: DecodeError) -> None:
        self.metrics.errors.labels(self.source.backend, "decode").inc()
        log.warning("undecodable KV event message from %s: %s", self.source.backend, exc)


class KVEventsManager:
    """Subscribes to every backend's streams; backends can come and go while it runs."""

    def __init__(
        self,
        index: PreciseIndex,
        settings: EventsConfig,
        metrics: KVEventMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self.index = index
        self.settings = settings
        self.metrics = metrics
        self._session = session
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._removals: set[asyncio.Task[None]] = set()
        #: Each backend's subscribers once its streams are known, for introspection and tests.
        self.subscribers: dict[str, list[StreamSubscriber]] = {}

    def add_backend(
        self,
        name: str,
        url: str,
        engine: EngineKind,
        endpoint: EndpointConfig | None,
        options: Mapping[str, Any] | None = None,
        on_wrong_engine: Callable[[str], None] | None = None,
    ) -> None:
        """Follow ``name``'s streams: those configured in ``endpoint``, else those its engine names
        (asked with ``options``, the backend's TLS).

        A backend whose events are the other engine's (its discovery answers only at the other
        engine's path, or its hashes have the other engine's shape) is reported once: a warning,
        ``kvroute_kv_events_errors_total{kind="wrong_engine"}``, and ``on_wrong_engine(why)``
        (``/admin/backends`` shows it)."""
        if name in self._tasks:
            return
        report = _WrongEngineReport(name, engine, self.metrics, on_wrong_engine)
        self._tasks[name] = asyncio.create_task(
            self._follow(name, url, engine, endpoint, options, report), name=f"kv-events-{name}"
        )

    def follow(self, pool: BackendPool) -> None:
        """Subscribe to the pool's backends, and to those discovery adds later (and stop with removals)."""
        for backend in pool:
            self._added(backend)
        pool.subscribe(self._added, self._removed)

    def _added(self, backend: Backend) -> None:
        config = backend.config

        def wrong_engine(why: str) -> None:
            backend.kv_events_mismatch = why

        options = backend.client_options()
        self.add_backend(backend.name, backend.url, config.engine, config.kv_events, options, wrong_engine)

    def _removed(self, backend: Backend) -> None:
        task = asyncio.create_task(self.remove_backend(backend.name))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def remove_backend(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        self.subscribers.pop(name, None)
        if task is not None:
            await stop_task(task)

    async def close(self) -> None:
        for name in list(self._tasks):
            await self.remove_backend(name)
        if self._removals:
            await asyncio.gather(*self._removals)
        self._ctx.term()

    async def _follow(
        self,
        name: str,
        url: str,
        engine: EngineKind,
        endpoint: EndpointConfig | None,
        options: Mapping[str, Any] | None,
        report: _WrongEngineReport,
    ) -> None:
        if endpoint is not None:
            sources = configured_sources(name, endpoint)
        else:
            sources = await self._discover(name, url, engine, options, report)
        log.info("following KV events of %s at %s", name, ", ".join(s.endpoint for s in sources))
        subscribers = [
            StreamSubscriber(
                source,
                self.index,
                self.metrics,
                self._ctx,
                self.settings.replay_timeout_s,
                engine,
                report.hashes,
            )
            for source in sources
        ]
        self.subscribers[name] = subscribers
        await asyncio.gather(*(s.run() for s in subscribers))

    async def _discover(
        self,
        name: str,
        url: str,
        engine: EngineKind,
        options: Mapping[str, Any] | None,
        report: _WrongEngineReport,
    ) -> list[EventSource]:
        interval = self.settings.discovery_interval_s
        while True:
            try:
                return await discover_sources(self._session, name, url, engine, interval, options)
            except DiscoveryError as exc:
                self.metrics.errors.labels(name, "discovery").inc()
                log.warning("KV events of %s not found (%s); retrying in %.0f s", name, exc, interval)
                if not report.said:
                    await self._ask_the_other_engines(name, url, engine, options, report)
            await asyncio.sleep(interval)

    async def _ask_the_other_engines(
        self,
        name: str,
        url: str,
        engine: EngineKind,
        options: Mapping[str, Any] | None,
        report: _WrongEngineReport,
    ) -> None:
        """Whether an engine of another kind answers where it says it publishes: then the
        backend's ``engine:`` is wrong, and saying so beats retrying in silence."""
        interval = self.settings.discovery_interval_s
        for other in ENGINE_KINDS:
            if other == engine:
                continue
            try:
                await discover_sources(self._session, name, url, other, interval, options)
            except DiscoveryError:
                continue
            report.discovery(other)
            return


class _WrongEngineReport:
    """Says once per backend that its KV events are another engine's (see ``add_backend``)."""

    def __init__(
        self,
        backend: str,
        engine: str,
        metrics: KVEventMetrics,
        on_wrong_engine: Callable[[str], None] | None,
    ) -> None:
        self.backend = backend
        self.engine = engine
        self.metrics = metrics
        self.on_wrong_engine = on_wrong_engine
        self.said = False

    def discovery(self, other: str) -> None:
        path = "/server_info" if other == "sglang" else "/kv_event_sources"
        self._say(f"its engine answers {path}, where {other} names its KV events", other)

    def hashes(self, other: str) -> None:
        self._say(f"its KV events carry {other}'s block hashes", other)

    def _say(self, evidence: str, other: str) -> None:
        if self.said:
            return
        self.said = True
        why = f"{evidence}: it looks like {other}: set engine: {other}"
        log.warning("backend %s (engine: %s): %s", self.backend, self.engine, why)
        self.metrics.errors.labels(self.backend, "wrong_engine").inc()
        if self.on_wrong_engine is not None:
            self.on_wrong_engine(why)


def start_kv_events(
    config: Config,
    pool: BackendPool,
    index: PrefixIndex,
    registry: CollectorRegistry,
    session: aiohttp.ClientSession,
) -> KVEventsManager | None:
    """With ``index.mode: events``, follow every backend's KV events into ``index``; else None."""
    if not isinstance(index, PreciseIndex):
        return None
    manager = KVEventsManager(index, config.index.events, KVEventMetrics(registry, index), session)
    manager.follow(pool)
    return manager
