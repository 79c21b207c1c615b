"""The router's listeners: one socket each, serving one app on the terms of its ``ListenConfig``.

The main listener serves the API; the admin API has a listener of its own by default
(``admin.listen``, loopback only). Each :class:`Listener` owns its aiohttp runner, its TLS
certificates (router/http/tls.py) and its connection guard (deadlines and caps,
router/http/connections.py), so another listener (a metrics port) is one more instance.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from router.http.connections import ClientConnection, ConnectionGuard
from router.http.protocol_errors import OpenAIErrorRunner
from router.http.server_log import HTTP_LOG
from router.http.settings import LimitsConfig, ListenConfig
from router.http.tls import CertificateStore
from router.metrics import RouterMetrics


class ListenError(RuntimeError):
    """The router cannot listen where its config says (the port is taken, or not ours to bind)."""


#: Pending connections the kernel queues for a listener (nginx's default; aiohttp's is 128).
BACKLOG = 511


class Listener:
    """``app`` served on ``settings``' address; ``name`` labels its metrics and log lines, ``where``
    is the settings' path in the config (``listen``, ``admin.listen``)."""

    def __init__(
        self,
        name: str,
        where: str,
        app: web.Application,
        settings: ListenConfig,
        limits: LimitsConfig,
        metrics: RouterMetrics,
        *,
        shutdown_timeout: float,
        handler_cancellation: bool = False,
        reuse_port: bool = False,
    ) -> None:
        self.name = name
        self.settings = settings
        #: SO_REUSEPORT: each ``--workers`` process binds the same port; the kernel spreads connections.
        self.reuse_port = reuse_port
        self.guard = ConnectionGuard(name, settings, metrics)
        self.certificates = (
            CertificateStore(name, settings.tls, f"{where}.tls") if settings.tls is not None else None
        )
        # OpenAIErrorRunner: requests aiohttp refuses before any handler are answered in the
        # OpenAI shape too (router/http/protocol_errors.py); ClientConnection adds the guard.
        self._runner = OpenAIErrorRunner(
            app,
            handler_class=ClientConnection,
            handler_args={"guard": self.guard},
            handler_cancellation=handler_cancellation,
            access_log=None,
            shutdown_timeout=shutdown_timeout,
            keepalive_timeout=settings.idle_timeout_s,
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
            logger=HTTP_LOG,
        )
        #: The bound port once started (``settings.port`` 0 picks a free one).
        self.port: int | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.certificates is not None else "http"
        return f"{scheme}://{self.settings.host}:{self.port}"

    async def start(self) -> None:
        """Start the app and listen; ListenError (the app stopped again) when the socket cannot be bound."""
        await self._runner.setup()
        try:
            await _Site(self).start()
        except OSError as exc:
            await self._runner.cleanup()
            where = f"{self.settings.host}:{self.settings.port}"
            raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}") from None
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        await self._runner.cleanup()


class _Site(web.BaseSite):
    """aiohttp's TCPSite, with the TLS handshake bounded by the head timeout (TCPSite leaves
    asyncio's 60 s) and a larger backlog."""

    __slots__ = ("_listener",)

    def __init__(self, listener: Listener) -> None:
        certificates = listener.certificates
        super().__init__(
            listener._runner,
            ssl_context=certificates.served if certificates is not None else None,
            backlog=BACKLOG,
        )
        self._listener = listener

    @property
    def name(self) -> str:
        return self._listener.url

    async def start(self) -> None:
        await super().start()
        listener, server = self._listener, self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server,
            listener.settings.host,
            listener.settings.port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_port=listener.reuse_port or None,
            ssl_handshake_timeout=listener.settings.header_timeout_s if self._ssl_context else None,
        )
