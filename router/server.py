"""Run the router app on a socket: used by ``kvroute serve``, the demo and the tests."""

from __future__ import annotations

import asyncio

from aiohttp import web

from router.app import build_app
from router.config import Config


class RouterServer:
    """The router listening on ``config.listen`` (port 0 picks a free one; see ``url``)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.app = build_app(config)
        # handler_cancellation: when a client disconnects, its handler is cancelled, which
        # closes the upstream connection so the engine stops working for nobody.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.listen.host}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.listen.host, self.config.listen.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve_forever(config: Config) -> None:
    async with RouterServer(config) as server:
        print(f"kvroute listening on {server.url} with {len(config.backends)} backends", flush=True)
        await asyncio.Event().wait()
