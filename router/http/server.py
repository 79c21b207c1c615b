"""Run the router app on a socket: used by ``kvroute serve``, the demo and the tests."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable

from router.config import Config, ConfigError
from router.http.app import ADMIN_APP, METRICS, RUNTIME, build_app
from router.http.listeners import Listener


class RouterServer:
    """The router on its listeners: ``config.listen`` for the API (port 0 picks a free one; see
    ``url``) and, unless the admin API shares it, ``admin.listen`` for the admin API."""

    def __init__(self, config: Config, reuse_port: bool = False, config_path: str | None = None) -> None:
        self.config = config
        self.app = build_app(config, config_path)
        metrics = self.app[METRICS]
        # handler_cancellation: when a client disconnects, its handler is cancelled, which
        # closes the upstream connection so the engine stops working for nobody.
        # shutdown_timeout: on stop, in-flight handlers get this long (the SIGTERM drain).
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
        admin_app = self.app.get(ADMIN_APP)
        admin_listen = config.admin.listen
        #: The admin API's own listener (None: it shares the main one, behind the admin key).
        self.admin = (
            Listener(
                "admin",
                "admin.listen",
                admin_app,
                admin_listen,
                config.limits,
                metrics,
                shutdown_timeout=1.0,
                reuse_port=reuse_port,
            )
            if admin_app is not None and admin_listen is not None
            else None
        )
        self.listeners = [self.main] + ([self.admin] if self.admin is not None else [])
        self.app[RUNTIME].certificates = [
            x.certificates for x in self.listeners if x.certificates is not None
        ]

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

    def reload(self) -> None:
        """Re-read the config file (SIGHUP); an invalid file is logged and changes nothing."""
        # A refusal is logged by the runtime, with the reason; the running config stays.
        with contextlib.suppress(ConfigError):
            self.app[RUNTIME].reload_file()

    async def stop(self) -> None:
        for listener in reversed(self.listeners):
            await listener.stop()

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
    config_path: str | None = None,
    reuse_port: bool = False,
    reload_peers: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain: stop listening, let in-flight responses finish.

    Leaving the ``async with`` runs aiohttp's graceful shutdown (the listening socket closes
    first; running handlers get ``listen.drain_timeout_s``, 60 s by default, to finish, and
    are cancelled after it), which is what Kubernetes expects between SIGTERM and the end of
    the pod's grace period. SIGHUP reloads ``config_path`` (router/http/reload.py). ``reuse_port``:
    one of ``kvroute serve --workers N``'s processes (router/http/processes.py), whose
    ``reload_peers`` passes a ``POST /admin/reload`` on to the other workers.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with RouterServer(config, reuse_port=reuse_port, config_path=config_path) as server:
        server.app[RUNTIME].reload_peers = reload_peers
        loop.add_signal_handler(signal.SIGHUP, server.reload)
        # A worker starts with SIGHUP blocked (router/http/processes.py); a reload asked meanwhile runs now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        tune_gc()
        print(f"kvroute listening on {server.url} with {len(config.backends)} backends", flush=True)
        print(f"kvroute admin API on {server.admin_url}/admin/", flush=True)
        await stop.wait()
