"""Run the router app on a socket: used by ``kvroute serve``, the demo and the tests."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
from collections.abc import Callable

from aiohttp import web

from router.config import Config, ConfigError, ConfigSource
from router.http.app import ADMIN_APP, INDEX, METRICS, METRICS_APP, POOL, RUNTIME, build_app, local_exposition
from router.http.connections import raise_fd_limit
from router.http.listeners import Listener, ListenError
from router.http.settings import ListenConfig
from router.http.worker_metrics import WorkerGroup, serve_to_peers


def check_listen(host: str, port: int) -> None:
    """Bind and release ``host:port`` as the server will (``SO_REUSEADDR``), so that a taken port
    is told at once, before the start's health checks and scrapes, in one line (ListenError).
    Port 0 always binds. The server's own bind still reports a port taken in between."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


class RouterServer:
    """The router on its listeners: ``config.listen`` for the API (port 0 picks a free one; see
    ``url``), ``admin.listen`` for the admin API unless it shares the main listener, and
    ``metrics.listen`` for ``/metrics`` when it has one (router/http/listeners.py)."""

    def __init__(
        self,
        config: Config,
        reuse_port: bool = False,
        config_path: str | ConfigSource | None = None,
        group: WorkerGroup | None = None,
    ) -> None:
        self.config = config
        #: One of ``serve --workers N``'s processes: it answers the others' metrics requests.
        self.group = group
        self.app = build_app(config, config_path, group)
        metrics = self.app[METRICS]
        # handler_cancellation: when a client disconnects, its handler is cancelled, which
        # closes the upstream connection so the engine stops working for nobody.
        # shutdown_timeout: on stop, in-flight handlers get this long (the SIGTERM drain).
        # reuse_port: every worker of ``serve --workers N`` binds each listener (SO_REUSEPORT).
        self.main = Listener(
            "main",
            "listen",
            self.app,
            config.listen,
            config.limits,
            metrics,
            shutdown_timeout=config.listen.drain_timeout_s,
            handler_cancellation=True,
            reuse_port=reuse_port,
        )
        #: The admin API's own listener (None: it shares the main one, behind the admin key).
        self.admin = self._side(
            "admin", "admin.listen", self.app.get(ADMIN_APP), config.admin.listen, reuse_port
        )
        #: ``/metrics``' own listener (None: it is on the main one); whichever worker answers
        #: reports the whole group (router/http/worker_metrics.py).
        self.metrics = self._side(
            "metrics", "metrics.listen", self.app.get(METRICS_APP), config.metrics.listen, reuse_port
        )
        # Started in this order: the side listeners bind before the app starts (the main
        # listener's setup runs its first health checks and scrapes), so no outgoing connection
        # of this process can have taken their port first; stopped in reverse, the main first.
        self.listeners = [x for x in (self.admin, self.metrics, self.main) if x is not None]
        self.app[RUNTIME].certificates = [
            x.certificates for x in self.listeners if x.certificates is not None
        ]
        self._peer_runner: web.AppRunner | None = None

    def _side(
        self,
        name: str,
        where: str,
        app: web.Application | None,
        listen: ListenConfig | None,
        reuse_port: bool,
    ) -> Listener | None:
        """A listener of its own for ``app``, when it has one."""
        if app is None or listen is None:
            return None
        limits, metrics = self.config.limits, self.app[METRICS]
        return Listener(
            name, where, app, listen, limits, metrics, shutdown_timeout=1.0, reuse_port=reuse_port
        )

    @property
    def port(self) -> int | None:
        return self.main.port

    @property
    def url(self) -> str:
        return self.main.url

    @property
    def admin_port(self) -> int | None:
        """The admin API's own port (None: it shares ``port``)."""
        return self.admin.port if self.admin is not None else None

    @property
    def admin_url(self) -> str:
        """Where the admin API answers: its own listener, or the main one when it shares it."""
        return self.admin.url if self.admin is not None else self.url

    @property
    def metrics_port(self) -> int | None:
        """``/metrics``' own port (None: it shares ``port``)."""
        return self.metrics.port if self.metrics is not None else None

    @property
    def metrics_url(self) -> str:
        """Where ``/metrics`` answers: its own listener if configured, else the main one."""
        return self.metrics.url if self.metrics is not None else self.url

    async def start(self) -> None:
        started: list[Listener] = []
        try:
            for listener in self.listeners:
                await listener.start()
                started.append(listener)
        except BaseException:
            for listener in reversed(started):
                await listener.stop()
            raise
        if self.group is not None:
            app = self.app
            self._peer_runner = await serve_to_peers(
                self.group, lambda: local_exposition(app[METRICS], app[POOL], app[INDEX])
            )

    def reload(self) -> None:
        """Re-read the config file (SIGHUP); an invalid file is logged and changes nothing."""
        # A refusal is logged by the runtime, with the reason; the running config stays.
        with contextlib.suppress(ConfigError):
            self.app[RUNTIME].reload_file()

    async def stop(self) -> None:
        for listener in reversed(self.listeners):
            await listener.stop()
        # Last: while this worker drains, the others' scrapes still get its numbers.
        if self._peer_runner is not None:
            await self._peer_runner.cleanup()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


#: Allocations between young-generation collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """Make the cyclic garbage collector cheap for a proxy that allocates per request.

    Every request allocates a few hundred short-lived objects (aiohttp's request, response and
    stream objects), so with CPython's defaults a young collection runs every few requests and
    a full one, scanning every long-lived object, every few hundred. Objects alive once the
    server listens (modules, the app, the config) are frozen out of collection for good, and
    young collections run ~30x less often. In A/B runs of the router under saturation on a
    shared, noisy 2-core VM this took up to 18 % off its CPU time per request (in other runs
    the difference was within the noise); cyclic garbage waits a little longer to be freed.
    """
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)


async def serve_forever(
    config: Config,
    config_path: str | ConfigSource | None = None,
    reuse_port: bool = False,
    reload_peers: Callable[[], None] | None = None,
    group: WorkerGroup | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain: stop listening, let in-flight responses finish.

    Leaving the ``async with`` runs aiohttp's graceful shutdown (the listening socket closes
    first; running handlers get ``listen.drain_timeout_s``, 60 s by default, to finish, and
    are cancelled after it), which is what Kubernetes expects between SIGTERM and the end of
    the pod's grace period. SIGHUP reloads ``config_path`` (router/http/reload.py). ``reuse_port``:
    one of ``kvroute serve --workers N``'s processes (router/http/processes.py), whose
    ``reload_peers`` passes a ``POST /admin/reload`` on to the other workers, and ``group`` says
    where the others answer for their metrics.
    """
    raise_fd_limit()  # before the listeners derive their connection caps from it
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with RouterServer(config, reuse_port=reuse_port, config_path=config_path, group=group) as server:
        server.app[RUNTIME].reload_peers = reload_peers
        loop.add_signal_handler(signal.SIGHUP, server.reload)
        # A worker starts with SIGHUP blocked (router/http/processes.py); a reload asked meanwhile runs now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        tune_gc()
        print(f"kvroute listening on {server.url} with {len(config.backends)} backends", flush=True)
        print(f"kvroute admin API on {server.admin_url}/admin/", flush=True)
        if server.metrics_port is not None:
            print(f"kvroute metrics on {server.metrics_url}/metrics", flush=True)
        await stop.wait()
