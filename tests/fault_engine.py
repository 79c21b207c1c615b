"""A stand-in engine with injectable faults, for failover and health tests.

It speaks just enough of the OpenAI API (``/v1/completions`` and ``/v1/chat/completions``,
streamed or not), ``/health`` and a settable ``/metrics`` text. ``mode`` says what the next
generation requests get:

* ``ok``: a normal answer (a stream of ``chunks`` SSE events, or one JSON body).
* ``hang``: headers never come; the request waits until the client gives up.
* ``hang_unstreamed``: ``hang`` for requests that ask for no stream (the router's own warm-ups
  and refreshes never do), ``ok`` for the rest.
* ``status``: ``status`` (e.g. 503, 500, 400) with an OpenAI-shaped error body.
* ``die_mid_stream``: a few SSE events, then the connection is dropped.
* ``stall_mid_stream``: a few SSE events, then silence until ``release`` is set.

Every generation request is counted in ``received``; ``open`` counts those still running.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from multidict import CIMultiDictProxy

MODEL = "fault-model"


class FaultEngine:
    def __init__(self, name: str, mode: str = "ok", status: int = 503, chunks: int = 3) -> None:
        self.name = name
        self.mode = mode
        self.status = status
        self.chunks = chunks
        self.healthy = True
        self.metrics_text = ""
        self.received = 0
        #: Each request body received, in order.
        self.json_bodies: list[dict] = []
        #: Each request's headers, in order.
        self.headers: list[CIMultiDictProxy[str]] = []
        self.open = 0
        #: Set to let ``hang``/slow streams finish.
        self.release = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def request_ids(self) -> list[str | None]:
        """Each request's ``X-Request-Id``, in order."""
        return [headers.get("X-Request-Id") for headers in self.headers]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self._generate),
                web.post("/v1/chat/completions", self._generate),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
            ]
        )
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if self.healthy else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received += 1
        self.json_bodies.append(body)
        self.headers.append(request.headers)
        self.open += 1
        try:
            if self.mode == "hang" or (self.mode == "hang_unstreamed" and not body.get("stream")):
                await self.release.wait()
            if self.mode == "status":
                error = {"message": f"{self.name} says {self.status}", "type": "error", "code": self.status}
                return web.json_response({"error": error}, status=self.status)
            if not body.get("stream"):
                return web.json_response({"id": self.name, "object": "text_completion", "choices": []})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(self.chunks):
                event = {"id": self.name, "choices": [{"index": 0, "text": f" t{i}"}]}
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
            if self.mode == "die_mid_stream":
                # Close the socket mid-body (buffered events still go out): a killed engine.
                assert request.transport is not None
                request.transport.close()
                return response
            if self.mode == "stall_mid_stream":
                await self.release.wait()
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.open -= 1


async def start_engines(*modes: str) -> list[FaultEngine]:
    engines = [FaultEngine(f"f{i}", mode) for i, mode in enumerate(modes)]
    for engine in engines:
        await engine.start()
    return engines


def backends(engines: list[FaultEngine]) -> list[dict[str, object]]:
    return [{"name": e.name, "url": e.url, "models": [MODEL]} for e in engines]
