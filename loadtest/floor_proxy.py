"""The floor under kvroute's per-request cost: the same server and upstream client, nothing else.

    python -m loadtest.floor_proxy PORT BACKEND_URL [BACKEND_URL ...]

aiohttp's server and kvroute's own upstream client (:mod:`router.request_path.upstream`) on
uvloop, passing each POST to the next backend in turn and its answer back (streams chunk by
chunk, relayed as kvroute relays them: :func:`router.request_path.proxy.relay_body`), with none
of kvroute's parsing, routing, limits, metrics or retries. ``loadtest.overhead`` measures it
beside kvroute: the gap between the two is what kvroute's own work costs, and the floor itself
is what no change inside kvroute's request path can go below on this stack.
"""

from __future__ import annotations

import itertools
import sys

import uvloop
from aiohttp import web

from router.request_path.proxy import relay_body
from router.request_path.settings import UpstreamConfig
from router.request_path.upstream import UpstreamPool

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host"})


def build_app(backends: list[str]) -> web.Application:
    upstream = UpstreamPool(UpstreamConfig())
    turn = itertools.cycle(backends)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        answer = await upstream.post(next(turn), request.raw_path, headers, body)
        try:
            out = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
            if answer.content_type != "text/event-stream":
                return web.Response(status=answer.status, body=await answer.read(), headers=out)
            response = web.StreamResponse(status=answer.status, headers=out)
            await response.prepare(request)
            await relay_body(request, response, answer, await answer.readany())
            await response.write_eof()
            return response
        finally:
            answer.release()

    app = web.Application()
    app.router.add_post("/{path:.*}", forward)
    app.router.add_get("/{path:.*}", lambda request: web.json_response({"object": "list", "data": []}))
    return app


def main(argv: list[str]) -> None:
    port, backends = int(argv[0]), argv[1:]
    loop = uvloop.new_event_loop()
    web.run_app(build_app(backends), host="127.0.0.1", port=port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main(sys.argv[1:])
