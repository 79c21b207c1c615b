"""The workers of one ``kvroute serve --workers N`` with ``index.store: memory`` share what each
believes and how busy each keeps every backend, over Unix sockets between them.

Without it each worker would route on a partial picture: the kernel spreads connections over
the workers (SO_REUSEPORT), so a burst sharing a new prefix would go to as many engines as
there are workers, and each worker would pile requests on an engine the others already keep
busy. Redis solves that across hosts (``index.store: redis``); within one host the workers have
a cheaper channel, and needing a Redis server only to run two processes on two cores was a
cost the operator had no reason to pay.

What goes over it, in one message kind (length-prefixed msgpack, one Unix stream connection
from each worker to each other one, in the private directory the supervisor makes):

- the beliefs this worker recorded or withdrew (router/index/worker_index.py's outbox), at most
  ``BELIEF_DELAY_S`` after the first of them, where the Redis stream took ``sync_interval_ms``
  plus a round trip; and for a fifth of its CPU (no client library, no server between: about
  2 % of a saturated worker's samples under py-spy, against about 10 % for the stream);
- this worker's in-flight requests and pending prefill per backend, with every message, and
  within ``LOAD_INTERVAL_S`` of a change (every ``KEEPALIVE_S`` when nothing changes). Each
  backend's view then adds the other workers' last counts to this worker's own, as the Redis
  shared load view does across replicas
  (router/fleet/shared_load.py). A worker not heard from for ``LOAD_TTL_S`` stops counting;
  a worker that stops cleanly withdraws its counts at once.

Nothing here is on the request path: a send never waits (a connection whose buffer is full
drops the message, and counts the beliefs it carried), and a worker whose sibling is not
listening yet, or has gone, keeps routing on its own picture, keeps what it would have sent
(bounded) and reconnects every ``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import struct
import time
from collections.abc import Sequence

import msgspec

from router.fleet.backends import BackendPool
from router.index.worker_index import WorkerIndex
from router.metrics import WorkerSyncMetrics
from router.tasks import stop_task

log = logging.getLogger("kvroute.workers")

#: Longest a belief waits before it is sent: sends of one burst of requests go together, and a
#: saturated worker sends at most a thousand messages a second. Sending on the next turn of the
#: event loop instead showed no clear gain on bursts (docs/benchmarks/2026-12-06-workers.md).
BELIEF_DELAY_S = 0.001
#: How often this worker's load is looked at, and sent if it changed (its age at most).
LOAD_INTERVAL_S = 0.01
#: Longest between two messages to each other worker while nothing changes: an idle group of
#: N workers does not send N x (N - 1) messages every ``LOAD_INTERVAL_S``.
KEEPALIVE_S = 0.25
#: A worker not heard from for this long (stalled or gone) stops counting in the load view.
LOAD_TTL_S = 1.0
#: Wait between attempts to connect to another worker (starting, or restarted).
RETRY_S = 0.05
#: Longest a stopping worker waits for the other workers' connections to it to close.
CLOSE_WAIT_S = 1.0
#: Bytes a connection may hold unsent before messages to that worker are dropped.
MAX_BUFFERED = 4 << 20

_LENGTH = struct.Struct(">I")


class Message(msgspec.Struct, array_like=True):
    """What one worker tells another: its id, its index's changes, and its load per backend."""

    sender: int
    #: (backend, chain, held): a belief recorded (True) or withdrawn after a failure (False).
    beliefs: list[tuple[str, list[int], bool]]
    #: (backend, in flight, pending prefill tokens, pending prefill requests).
    load: list[tuple[str, int, int, int]]
    #: The sender is stopping: its counts leave the load view at once.
    leaving: bool = False


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Message).decode


class _Incoming(asyncio.Protocol):
    """One other worker's connection: length-prefixed messages, each handed to ``take``."""

    def __init__(self, sync: WorkerSync) -> None:
        self.sync = sync
        self.buffer = bytearray()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.sync.incoming.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.sync.incoming.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        view = self.buffer
        start = 0
        while len(view) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(view, start)
            end = start + _LENGTH.size + length
            if end > len(view):
                break
            self.sync.take(_decode(bytes(view[start + _LENGTH.size : end])))
            start = end
        del self.buffer[:start]


class _Outgoing(asyncio.Protocol):
    """This worker's connection to one other worker; ``closed`` is set when it is lost."""

    def __init__(self) -> None:
        self.closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class WorkerSync:
    def __init__(
        self,
        worker: int,
        own_path: str,
        sibling_paths: Sequence[str],
        pool: BackendPool,
        index: WorkerIndex | None,
        metrics: WorkerSyncMetrics,
    ) -> None:
        """``index`` is None in precise mode, where every worker reads the engines' own events."""
        self.worker = worker
        self.own_path = own_path
        self.sibling_paths = list(sibling_paths)
        self.pool = pool
        self.index = index
        self.metrics = metrics
        #: Open connections to the other workers, by socket path.
        self._links: dict[str, asyncio.Transport] = {}
        #: Messages for a worker not connected yet (or reconnecting), sent once it is: the
        #: workers start together, and the first requests' beliefs must not be lost to the
        #: race. Bounded by ``MAX_BUFFERED`` bytes, as a connection's own buffer is.
        self._backlog: dict[str, list[bytes]] = {path: [] for path in sibling_paths}
        self._backlog_bytes: dict[str, int] = dict.fromkeys(sibling_paths, 0)
        #: The other workers' connections to this one (closed here on close: a server's
        #: ``wait_closed`` waits for them since Python 3.12).
        self.incoming: set[_Incoming] = set()
        #: Each other worker's last load counts, with when they came (monotonic).
        self._loads: dict[int, tuple[float, dict[str, tuple[int, int, int]]]] = {}
        self._flush_handle: asyncio.TimerHandle | None = None
        #: The load last sent, and when (monotonic): an unchanged load is not sent again soon.
        self._load_sent: list[tuple[str, int, int, int]] = []
        self._sent_at = -math.inf
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.own_path)
        self._server = await loop.create_unix_server(lambda: _Incoming(self), self.own_path)
        if self.index is not None:
            self.index.on_outbox = self._schedule_flush
        self._tasks = [
            asyncio.create_task(self._connect(path), name=f"kvroute-worker-sync-{i}")
            for i, path in enumerate(self.sibling_paths)
        ]
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="kvroute-worker-sync"))

    async def _connect(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                transport, link = await loop.create_unix_connection(_Outgoing, path)
            except OSError:  # not listening yet (starting) or any more (stopping)
                await asyncio.sleep(RETRY_S)
                continue
            for frame in self._backlog[path]:
                transport.write(frame)
            self._backlog[path] = []
            self._backlog_bytes[path] = 0
            self._links[path] = transport
            await link.closed
            self._links.pop(path, None)
            await asyncio.sleep(RETRY_S)

    def _schedule_flush(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(BELIEF_DELAY_S, self.flush)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            self.flush(quiet_ok=True)
            self._expire()

    def flush(self, quiet_ok: bool = False) -> None:
        """Send the changes waiting in the outbox and this worker's load to every other worker;
        with ``quiet_ok``, nothing when neither changed and the last send is recent."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        beliefs = self.index.take_outbox() if self.index is not None else []
        load = [(b.name, *b.own_load()) for b in self.pool]
        now = time.monotonic()
        if quiet_ok and not beliefs and load == self._load_sent and now - self._sent_at < KEEPALIVE_S:
            return
        self._load_sent, self._sent_at = load, now
        self._send(Message(self.worker, [(name, list(chain), held) for name, chain, held in beliefs], load))

    def _send(self, message: Message) -> None:
        payload = _encode(message)
        frame = _LENGTH.pack(len(payload)) + payload
        for path in self.sibling_paths:
            link = self._links.get(path)
            if link is None or link.is_closing():
                if self._backlog_bytes[path] + len(frame) > MAX_BUFFERED:
                    self.metrics.dropped_beliefs.labels("not_connected").inc(len(message.beliefs))
                elif message.beliefs or message.leaving:  # a load alone is soon out of date
                    self._backlog[path].append(frame)
                    self._backlog_bytes[path] += len(frame)
            elif link.get_write_buffer_size() > MAX_BUFFERED:
                self.metrics.dropped_beliefs.labels("buffer_full").inc(len(message.beliefs))
            else:
                link.write(frame)

    def take(self, message: Message) -> None:
        """Apply another worker's message: its index's changes here, its load into the view."""
        if self.index is not None and message.beliefs:
            applied = sum(self.index.apply(backend, chain, held) for backend, chain, held in message.beliefs)
            self.metrics.peer_beliefs.inc(applied)
        if message.leaving:
            self._loads.pop(message.sender, None)
        else:
            counts = {name: (n, tokens, requests) for name, n, tokens, requests in message.load}
            self._loads[message.sender] = (time.monotonic(), counts)
        self._set_remote()

    def _expire(self) -> None:
        stale = time.monotonic() - LOAD_TTL_S
        gone = [worker for worker, (heard, _) in self._loads.items() if heard < stale]
        for worker in gone:
            log.warning("worker %d has not reported its load for %.1f s: not counting it", worker, LOAD_TTL_S)
            del self._loads[worker]
        if gone:
            self._set_remote()

    def _set_remote(self) -> None:
        for backend in self.pool:
            count = tokens = requests = 0
            for _, load in self._loads.values():
                n, t, r = load.get(backend.name, (0, 0, 0))
                count += n
                tokens += t
                requests += r
            backend.set_remote_load(count, tokens, requests)

    async def close(self) -> None:
        """Send what is left, withdraw this worker's load from the others' view, disconnect."""
        for task in self._tasks:
            await stop_task(task)
        self._tasks = []
        self.flush()
        self._send(Message(self.worker, [], [], leaving=True))
        if self.index is not None:
            self.index.on_outbox = lambda: None
        for link in self._links.values():
            link.close()
        self._links.clear()
        if self._server is not None:
            self._server.close()
            for connection in list(self.incoming):
                if connection.transport is not None:
                    connection.transport.close()
            # Bounded: since Python 3.12 it waits for connections, and one accepted just now may
            # not be in ``incoming`` yet; its worker closes it as it stops too.
            with contextlib.suppress(asyncio.TimeoutError):  # not the builtin one before 3.11
                await asyncio.wait_for(self._server.wait_closed(), CLOSE_WAIT_S)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.own_path)
