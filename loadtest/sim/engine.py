"""One simulated inference engine: vLLM's HTTP API over a real prefix cache and real time.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (vLLM names, see :mod:`loadtest.sim.metrics`)
and ``GET /sim/stats`` (JSON counters for tests and reports).

With ``kv_events="vllm"`` (or ``"sglang"``) the engine also publishes its cache's changes as KV
events in that engine's format (:mod:`loadtest.sim.kv_events`), says where at that engine's own
discovery endpoint (vLLM ``GET /kv_event_sources``, SGLang ``GET /server_info``), and accepts
``POST /reset_prefix_cache`` (which publishes ``AllBlocksCleared``). Its token ids are the
simulator's (:func:`router.request_path.tokenize.chunk_token_ids`).

A client that goes away stops costing anything: the server runs with ``handler_cancellation``, so
the handler is cancelled on disconnect (aiohttp >= 3.9 does not cancel by default), and a failed
write ends it too; either way the request leaves the scheduler at once and counts as cancelled.
aiohttp sets ``TCP_NODELAY`` on every server connection, so each SSE chunk leaves when written.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
import time
from collections.abc import AsyncIterator, Sequence

import orjson
from aiohttp import web

from loadtest.sim.cache import PrefixCache
from loadtest.sim.kv_events import FORMATS, Format, KVEventPublisher, require_zmq
from loadtest.sim.metrics import CONTENT_TYPE, EngineMetrics
from loadtest.sim.protocol import (
    DONE_FRAME,
    ApiError,
    GenerationRequest,
    Kind,
    StreamFrames,
    completion_body,
    parse_request,
    usage,
)
from loadtest.sim.scheduler import RequestRecord, Scheduler, SimRequest, State
from loadtest.sim.timing import EngineTiming
from router.request_path.tokenize import chunk_token_ids

#: Long chat histories are large; vLLM sets no small body limit either.
_MAX_BODY_BYTES = 64 * 1024 * 1024
#: aiohttp's grace period for handlers at shutdown; generation handlers are cancelled before it
#: starts (see ``SimEngine.stop``), so this only bounds the odd request to another endpoint.
_SHUTDOWN_TIMEOUT_S = 1.0


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _error(error: ApiError) -> web.Response:
    return web.Response(body=error.body(), status=error.status, content_type="application/json")


def _http_url(host: str, port: int, scheme: str = "http") -> str:
    """The URL clients use for a server bound to ``host:port`` (a wildcard bind means localhost)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class SimEngine:
    """A simulated vLLM server serving ``models`` (default ``("sim-model",)``).

    Use :meth:`start` and :meth:`stop`, or mount :attr:`app` in another runner (pass
    ``handler_cancellation=True`` to it). ``name`` prefixes response ids and names the engine in
    stats. In-process users (tests, benchmarks) can read :attr:`cache`, :attr:`scheduler` and
    :attr:`records` directly.
    """

    def __init__(
        self,
        timing: EngineTiming | None = None,
        models: Sequence[str] = ("sim-model",),
        name: str = "sim",
        kv_events: Format | None = None,
    ) -> None:
        if not models:
            raise ValueError("an engine serves at least one model")
        if kv_events is not None and kv_events not in FORMATS:
            raise ValueError(f"kv_events must be one of {FORMATS} or None, got {kv_events!r}")
        self.timing = timing if timing is not None else EngineTiming()
        self.models = tuple(models)
        self.name = name
        self.cache = PrefixCache(self.timing.kv_blocks, self.timing.block_tokens, self.timing.chars_per_token)
        self.scheduler = Scheduler(self.timing, self.cache, on_first_token=self._observe_ttft)
        self.metrics = EngineMetrics(self.scheduler, self.models[0])
        #: Requests refused with a 4xx before reaching the scheduler.
        self.rejected = 0
        self._ids = itertools.count(1)
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        # Handler tasks of in-flight generation requests, aborted by stop().
        self._in_flight: set[asyncio.Task[object]] = set()
        #: Set by :meth:`start`.
        self.url: str | None = None
        self.app = web.Application(client_max_size=_MAX_BODY_BYTES)
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/sim/stats", self._stats),
            ]
        )
        self.kv_events_format = kv_events
        #: The KV event publisher, while started with ``kv_events``.
        self.publisher: KVEventPublisher | None = None
        if kv_events is not None:
            require_zmq()  # fail here, naming the extra, rather than when the engine starts
            discovery = "/server_info" if kv_events == "sglang" else "/kv_event_sources"
            self.app.add_routes(
                [
                    web.get(discovery, self._kv_event_sources),
                    web.post("/reset_prefix_cache", self._reset_cache),
                ]
            )
        self.app.on_shutdown.append(self._abort_in_flight)
        self.app.cleanup_ctx.append(self._run_scheduler)

    @property
    def records(self) -> Sequence[RequestRecord]:
        """The most recent finished requests, oldest first (bounded)."""
        return self.scheduler.records

    def stats(self) -> dict[str, int | str | None]:
        """``GET /sim/stats``: scheduler counters plus name, URL and rejected requests.

        ``received`` counts requests accepted for scheduling; at any time
        ``received == completed + cancelled + running + waiting``.
        """
        return {"name": self.name, "url": self.url, "rejected": self.rejected, **self.scheduler.stats()}

    async def start(self, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None) -> str:
        """Listen on ``host:port`` (0 picks a free port) and return the engine's URL; with ``tls``
        (a server context) over HTTPS, as an engine behind a TLS-terminating sidecar is reached."""
        if self._runner is not None:
            raise RuntimeError("engine already started")
        runner = web.AppRunner(
            self.app, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT_S, access_log=None
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, ssl_context=tls).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        bound_port = runner.addresses[0][1]
        self.url = _http_url(host, bound_port, "https" if tls is not None else "http")
        if self.kv_events_format is not None:
            await self._start_publisher(host if host not in ("", "0.0.0.0", "::") else "127.0.0.1")
        return self.url

    async def _start_publisher(self, host: str, port: int = 0, replay_port: int = 0) -> None:
        assert self.kv_events_format is not None
        publisher = KVEventPublisher(
            self.kv_events_format,
            block_size=self.timing.block_tokens,
            host=host,
            port=port,
            replay_port=replay_port,
        )
        await publisher.start()
        self.publisher = publisher
        self.cache.listener = publisher.publish

    async def restart_kv_events(self) -> None:
        """What the router sees of an engine restart: an empty cache and a new publisher (seq from 0).

        The new publisher binds the same ports, so subscribers reconnect by themselves.
        """
        if self.publisher is None:
            raise RuntimeError("engine does not publish KV events")
        old, self.publisher = self.publisher, None
        self.cache.listener = None
        await old.close()
        self.cache.clear()
        await self._start_publisher(old.host, old.port, old.replay_port)

    async def stop(self) -> None:
        """Stop at once, like a killed engine: in-flight requests are dropped, not drained.

        Their clients see the connection close (a truncated stream), and they count as cancelled;
        this is also how tests make an engine fail mid-stream.
        """
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            self.cache.listener = None
            await publisher.close()

    async def _run_scheduler(self, _app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.scheduler.run(), name=f"{self.name}-scheduler")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _abort_in_flight(self, _app: web.Application) -> None:
        for task in self._in_flight:
            task.cancel()

    def _observe_ttft(self, seconds: float) -> None:
        self.metrics.observe_ttft(seconds)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, http_request: web.Request, kind: Kind) -> web.StreamResponse:
        try:
            try:
                body = orjson.loads(await http_request.read())
            except orjson.JSONDecodeError as exc:
                raise ApiError(400, f"Invalid JSON body: {exc}") from None
            parsed = parse_request(kind, body, self.models, self.timing.default_max_tokens)
            # The sim's tokenizer: one token per chars_per_token characters (a partial one counts).
            prompt_tokens = -(-len(parsed.prompt) // self.timing.chars_per_token)
            total = prompt_tokens + parsed.max_tokens
            if total > self.timing.max_model_len:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {self.timing.max_model_len} tokens. However, "
                    f"you requested {total} tokens ({prompt_tokens} in the messages, {parsed.max_tokens} in "
                    "the completion). Please reduce the length of the messages or completion.",
                )
        except ApiError as error:
            self.rejected += 1
            return _error(error)

        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        response_id = f"{prefix}-{self.name}-{next(self._ids)}"
        sim_request = self.scheduler.submit(
            request_id=response_id,
            model=parsed.model,
            prompt_tokens=prompt_tokens,
            hashes=self.cache.hashes(parsed.prompt, parsed.model),
            max_tokens=parsed.max_tokens,
            stream=parsed.stream,
            token_ids=chunk_token_ids(parsed.prompt, self.timing.chars_per_token) if self.publisher else None,
        )
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs every handler in a task
        self._in_flight.add(task)
        try:
            if parsed.stream:
                return await self._stream(http_request, parsed, sim_request)
            while sim_request.state is not State.FINISHED:
                await sim_request.changed.wait()
                sim_request.changed.clear()
            usage_info = usage(prompt_tokens, sim_request.generated, sim_request.cached_tokens)
            return web.Response(
                body=completion_body(parsed, response_id, int(time.time()), usage_info),
                content_type="application/json",
            )
        finally:
            self._in_flight.discard(task)
            # A no-op when finished; otherwise the client went away (cancellation or a failed write).
            self.scheduler.release(sim_request)

    async def _stream(
        self, http_request: web.Request, parsed: GenerationRequest, sim_request: SimRequest
    ) -> web.StreamResponse:
        """Send headers at once (as vLLM does), then one SSE chunk per token as it is produced."""
        frames = StreamFrames(parsed, sim_request.id, int(time.time()))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        response.enable_chunked_encoding()
        try:
            await response.prepare(http_request)
            sent = 0
            while True:
                await sim_request.changed.wait()
                sim_request.changed.clear()
                produced = sim_request.generated
                if produced > sent:
                    # Normally one token; more only if this client reads slower than tokens come.
                    chunks = [frames.first] if sent == 0 else []
                    chunks.extend(frames.token for _ in range(sent, min(produced, parsed.max_tokens - 1)))
                    if produced == parsed.max_tokens:
                        chunks.append(frames.last)
                    await response.write(b"".join(chunks))
                    sent = produced
                if sim_request.state is State.FINISHED:
                    break
            tail = DONE_FRAME
            if parsed.include_usage:
                usage_info = usage(sim_request.prompt_tokens, sent, sim_request.cached_tokens)
                tail = frames.usage_frame(usage_info) + DONE_FRAME
            await response.write(tail)
            await response.write_eof()
        except ConnectionResetError:
            # Also catches aiohttp.ClientConnectionResetError (a subclass): the client went away.
            # The caller releases the request; nothing more can be sent.
            pass
        return response

    async def _models(self, _request: web.Request) -> web.Response:
        cards = [
            {
                "id": model,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": model,
                "parent": None,
                "max_model_len": self.timing.max_model_len,
                "permission": [],
            }
            for model in self.models
        ]
        return _json({"object": "list", "data": cards})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _stats(self, _request: web.Request) -> web.Response:
        return _json(self.stats())

    async def _kv_event_sources(self, _request: web.Request) -> web.Response:
        publisher = self.publisher
        if self.kv_events_format == "sglang":
            return _json({"version": "sim", "kv_events": publisher.describe_sglang() if publisher else None})
        return _json(publisher.describe_vllm() if publisher else {})

    async def _reset_cache(self, _request: web.Request) -> web.Response:
        self.cache.clear()
        return web.Response()
