"""A null inference backend: answers every request at once, so what a benchmark times is the proxy.

It speaks just enough of HTTP/1.1 (keep-alive, ``Content-Length`` request bodies) and of the
OpenAI API for routers to accept it as a worker:

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate``: a small JSON completion,
  or, when the body asks for ``"stream": true``, 50 small SSE chunks and ``data: [DONE]``,
  each chunk its own socket write (chunked encoding), as an engine emits tokens: back to back,
  or ``--token-interval-ms`` apart, as an engine's decode steps are (then each chunk reaches a
  proxy in a read of its own, as in production, rather than several in one);
- ``GET /health``, ``/health_generate``, ``/v1/models``, ``/(get_)model_info``,
  ``/(get_)server_info``, ``/metrics``: what kvroute and SGLang's router probe.

It is a bare asyncio protocol rather than an aiohttp app so that it costs a small fraction of
any proxy in front of it; ``TCP_NODELAY`` is set so that no chunk waits for Nagle's algorithm.

    python -m loadtest.null_backend --port 9001 --port 9002
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import socket
import sys

import orjson

from router.tasks import run_event_loop

MODEL = "null-model"
#: SSE chunks per streamed response.
STREAM_CHUNKS = 50

COMPLETION = orjson.dumps(
    {
        "id": "null-1",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)
_CHUNK = (
    b"data: "
    + orjson.dumps(
        {
            "id": "null-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}],
        }
    )
    + b"\n\n"
)
_DONE = b"data: [DONE]\n\n"

GET_BODIES = {
    b"/health": b"{}",
    b"/health_generate": b"{}",
    b"/v1/models": orjson.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "null"}]}
    ),
    b"/get_model_info": orjson.dumps({"model_path": MODEL, "is_generation": True}),
    b"/model_info": orjson.dumps({"model_path": MODEL, "is_generation": True}),
    b"/get_server_info": orjson.dumps({"model_path": MODEL, "max_total_num_tokens": 1 << 20}),
    b"/server_info": orjson.dumps({"model_path": MODEL, "max_total_num_tokens": 1 << 20}),
    b"/metrics": b"",
}
#: Content types of the GET answers other than JSON.
GET_CONTENT_TYPES = {b"/metrics": "text/plain"}
_GENERATE = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/generate"))


def _response(status: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type
        + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_NOT_FOUND = _response(b"404 Not Found", b'{"error":{"message":"not found"}}')
_BAD = _response(b"400 Bad Request", b'{"error":{"message":"bad request"}}')


class NullProtocol(asyncio.Protocol):
    """One client connection; requests on it are answered in order."""

    def __init__(self, token_interval_s: float = 0.0) -> None:
        self.token_interval_s = token_interval_s
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.streaming: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.streaming is None:
            self._handle_buffered()

    def _handle_buffered(self) -> None:
        """Answer every complete request in the buffer, in order (a stream pauses the rest)."""
        while self.transport is not None and self.streaming is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            self._answer(head.split(b" ", 2), body)

    def _answer(self, request_line: list[bytes], body: bytes) -> None:
        assert self.transport is not None
        if len(request_line) < 2:
            self.transport.write(_BAD)
            return
        method, path = request_line[0], request_line[1].split(b"?", 1)[0]
        if method == b"GET" and path in GET_BODIES:
            content_type = GET_CONTENT_TYPES.get(path, "application/json").encode()
            self.transport.write(_response(b"200 OK", GET_BODIES[path], content_type))
        elif method == b"POST" and path in _GENERATE:
            if b'"stream":true' in body or b'"stream": true' in body:
                self.streaming = asyncio.get_running_loop().create_task(self._stream())
            else:
                self.transport.write(_response(b"200 OK", COMPLETION))
        else:
            self.transport.write(_NOT_FOUND)

    async def _stream(self) -> None:
        transport = self.transport
        assert transport is not None
        transport.write(_STREAM_HEAD)
        for _ in range(STREAM_CHUNKS):
            # Yield between chunks: each leaves in its own write, as tokens do from an engine.
            await asyncio.sleep(self.token_interval_s)
            if transport.is_closing():
                return
            transport.write(_chunk(_CHUNK))
        transport.write(_chunk(_DONE) + b"0\r\n\r\n")
        self.streaming = None
        self._handle_buffered()


async def serve(
    host: str, ports: list[int], token_interval_s: float = 0.0
) -> list[asyncio.base_events.Server]:
    """Listen on every port (0: a free one); the servers are returned, already serving.
    ``token_interval_s``: the pause between a stream's chunks."""
    loop = asyncio.get_running_loop()
    protocol = functools.partial(NullProtocol, token_interval_s)
    return [await loop.create_server(protocol, host, port, backlog=1024) for port in ports]


async def _main(host: str, ports: list[int], token_interval_s: float) -> None:
    servers = await serve(host, ports, token_interval_s)
    for server in servers:
        print(f"null backend on http://{host}:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.null_backend", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, action="append", required=True, help="repeat for more backends")
    parser.add_argument(
        "--token-interval-ms", type=float, default=0.0, help="between a stream's chunks (0: back to back)"
    )
    args = parser.parse_args(argv)
    run_event_loop(_main(args.host, args.port, args.token_interval_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
