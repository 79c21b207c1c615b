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
from router.http.protocol_errors import OpenAIErrorRunner
from router.http.server_log import HTTP_LOG
from router.http.settings import ListenConfig
from router.http.worker_metrics import WorkerGroup, serve_to_peers


class ListenError(RuntimeError):
    """The router cannot listen where its config says (the port is taken, or not ours to bind)."""


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
    """The router listening on ``config.listen`` (port 0 picks a free one; see ``url``)."""

    def __init__(
        self,
        config: Config,
        reuse_port: bool = False,
        config_path: str | ConfigSource | None = None,
        group: WorkerGroup | None = None,
    ) -> None:
        self.config = config
        #: SO_REUSEPORT: several worker processes listen on one port, the kernel spreads connections.
        self.reuse_port = reuse_port
        #: One of ``serve --workers N``'s processes: it answers the others' metrics requests.
        self.group = group
        self.app = build_app(config, config_path, group)
        limits = config.limits
        # handler_cancellation: when a client disconnects, its handler is cancelled, which
        # closes the upstream connection so the engine stops working for nobody.
        # shutdown_timeout: on stop, in-flight handlers get this long (the SIGTERM drain).
        # OpenAIErrorRunner: requests aiohttp refuses before any handler (malformed or oversized
        # request line or headers) are answered in the OpenAI shape too (router/http/protocol_errors.py).
        self._runner = OpenAIErrorRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=config.listen.drain_timeout_s,
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
            logger=HTTP_LOG,
        )
        admin_app = self.app.get(ADMIN_APP)
        self._admin_runner = (
            OpenAIErrorRunner(
                admin_app,
                access_log=None,
                shutdown_timeout=1.0,
                max_line_size=limits.max_line_size,
                max_field_size=limits.max_field_size,
                max_headers=limits.max_headers,
                logger=HTTP_LOG,
            )
            if admin_app is not None
            else None
        )
        metrics_app = self.app.get(METRICS_APP)
        self._metrics_runner = (
            web.AppRunner(metrics_app, access_log=None) if metrics_app is not None else None
        )
        self._peer_runner: web.AppRunner | None = None
        self.port: int | None = None
        #: ``/metrics``' own port, with ``metrics.listen`` (else it shares ``port``).
        self.metrics_port: int | None = None
        #: The admin API's own port, with ``admin.listen`` (else it shares ``port``).
        self.admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.listen.host}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.listen.host, self.config.listen.port, reuse_port=self.reuse_port or None
        )
        await self._bind(site, self.config.listen.host, self.config.listen.port)
        self.port = self._runner.addresses[0][1]
        admin_listen = self.config.admin.listen
        if self._admin_runner is not None and admin_listen is not None:
            await self._admin_runner.setup()
            admin_site = web.TCPSite(self._admin_runner, admin_listen.host, admin_listen.port)
            await self._bind(admin_site, admin_listen.host, admin_listen.port)
            self.admin_port = self._admin_runner.addresses[0][1]
        metrics_listen = self.config.metrics.listen
        if self._metrics_runner is not None and metrics_listen is not None:
            await self._metrics_runner.setup()
            # Every worker binds it too (SO_REUSEPORT): whichever answers reports the group.
            reuse = self.reuse_port or None
            metrics_site = web.TCPSite(
                self._metrics_runner, metrics_listen.host, metrics_listen.port, reuse_port=reuse
            )
            await self._bind(metrics_site, metrics_listen.host, metrics_listen.port)
            self.metrics_port = self._metrics_runner.addresses[0][1]
        if self.group is not None:
            app = self.app
            self._peer_runner = await serve_to_peers(
                self.group, lambda: local_exposition(app[METRICS], app[POOL], app[INDEX])
            )

    @property
    def metrics_url(self) -> str:
        """Where ``/metrics`` answers: its own listener if configured, else the main one."""
        return self._side_url(self.config.metrics.listen, self.metrics_port)

    async def _bind(self, site: web.TCPSite, host: str, port: int) -> None:
        """Start listening; a socket that cannot be bound stops what started and says where."""
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None

    @property
    def admin_url(self) -> str:
        """Where the admin API answers: its own listener if configured, else the main one."""
        return self._side_url(self.config.admin.listen, self.admin_port)

    def _side_url(self, listen: ListenConfig | None, port: int | None) -> str:
        if listen is None or port is None:
            return self.url
        return f"http://{listen.host}:{port}"

    def reload(self) -> None:
        """Re-read the config file (SIGHUP); an invalid file is logged and changes nothing."""
        # A refusal is logged by the runtime, with the reason; the running config stays.
        with contextlib.suppress(ConfigError):
            self.app[RUNTIME].reload_file()

    async def stop(self) -> None:
        for side in (self._admin_runner, self._metrics_runner):
            if side is not None:
                await side.cleanup()
        await self._runner.cleanup()
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
        if server.admin_port is not None:
            print(f"kvroute admin API on {server.admin_url}", flush=True)
        if server.metrics_port is not None:
            print(f"kvroute metrics on {server.metrics_url}/metrics", flush=True)
        await stop.wait()
