"""One simulated inference engine: vLLM's HTTP API over a real prefix cache and real time.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses``
(streamed or not), ``POST /v1/embeddings``, ``/v1/rerank`` (``/rerank``, ``/v2/rerank``),
``/v1/score`` (``/score``), ``/tokenize``, ``/detokenize``, ``/v1/audio/transcriptions``
(shapes in :mod:`loadtest.sim.serving`), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(vLLM names, see :mod:`loadtest.sim.metrics`) and ``GET /sim/stats`` (JSON counters for tests
and reports). Everything that runs on the GPU in vLLM goes through the scheduler here: a
pooling request (embeddings, rerank, score) is a prefill with one output, prefix-cached like
any prompt; a transcription decodes its transcript; tokenize and detokenize do not.

With ``kv_events="vllm"`` (or ``"sglang"``) the engine also publishes its cache's changes as KV
events in that engine's format (:mod:`loadtest.sim.kv_events`), says where at that engine's own
discovery endpoint (vLLM ``GET /kv_event_sources``, SGLang ``GET /server_info``), and accepts
``POST /reset_prefix_cache`` (which publishes ``AllBlocksCleared``). Its token ids are the
simulator's (:func:`router.request_path.tokenize.chunk_token_ids`).

With a ``role`` (``prefill`` or ``decode``) the engine is one side of prefill/decode
disaggregation and speaks both engines' handoff shapes (:mod:`loadtest.sim.handoff`): a prefill
engine prefills and offers the KV, a decode engine takes it (charged its transfer time) and
decodes. A ``both`` engine serves whole requests, and either side of a vLLM handoff.

A client that goes away stops costing anything: the server runs with ``handler_cancellation``, so
the handler is cancelled on disconnect (aiohttp >= 3.9 does not cancel by default), and a failed
write ends it too; either way the request leaves the scheduler at once and counts as cancelled.
aiohttp sets ``TCP_NODELAY`` on every server connection, so each SSE chunk leaves when written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Sequence

import orjson
from aiohttp import web

from loadtest.sim.cache import PrefixCache
from loadtest.sim.handoff import HUB, ROLES, Offer, Role, Side, TransferHub, parse_side, vllm_transfer_params
from loadtest.sim.kv_events import FORMATS, Format, KVEventPublisher, require_zmq
from loadtest.sim.metrics import CONTENT_TYPE, EngineMetrics
from loadtest.sim.protocol import (
    DONE_FRAME,
    TOKEN_TEXT,
    ApiError,
    GenerationRequest,
    Kind,
    StreamFrames,
    completion_body,
    parse_request,
    usage,
)
from loadtest.sim.scheduler import RequestRecord, Scheduler, SimRequest, State
from loadtest.sim.serving import (
    PairRequest,
    ResponseShapes,
    detokenize,
    detokenize_ids,
    embedding_body,
    parse_embedding,
    parse_rerank,
    parse_responses,
    parse_score,
    rerank_body,
    score_body,
    tokenize_text,
    transcript_tokens,
    transcription_body,
)
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


#: The endpoint groups an engine can serve (``SimEngine(endpoints=...)``; default all).
ENDPOINTS = frozenset(
    {"chat", "completions", "embeddings", "rerank", "score", "tokenize", "transcriptions", "responses"}
)


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
        endpoints: Collection[str] | None = None,
        role: Role = "both",
        bootstrap_port: int | None = None,
        hub: TransferHub = HUB,
    ) -> None:
        if not models:
            raise ValueError("an engine serves at least one model")
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        #: An SGLang prefill engine's bootstrap port, named in the handoffs it offers; absent, the
        #: engine's HTTP port once started (nothing listens there: the handoff is in process).
        self.bootstrap_port = bootstrap_port
        self.hub = hub
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
        served = ENDPOINTS if endpoints is None else frozenset(endpoints)
        unknown = served - ENDPOINTS
        if unknown:
            raise ValueError(f"unknown endpoints {sorted(unknown)}; known: {sorted(ENDPOINTS)}")
        #: The endpoints served (an engine serving only some answers the others 404, as a vLLM
        #: serving a generative model answers rerank).
        self.endpoints = served
        routes = {
            "chat": [web.post("/v1/chat/completions", self._chat)],
            "completions": [web.post("/v1/completions", self._completions)],
            "embeddings": [web.post("/v1/embeddings", self._embeddings)],
            "rerank": [web.post(path, self._rerank) for path in ("/v1/rerank", "/rerank", "/v2/rerank")],
            "score": [web.post(path, self._score) for path in ("/v1/score", "/score")],
            "tokenize": [web.post("/tokenize", self._tokenize), web.post("/detokenize", self._detokenize)],
            "transcriptions": [web.post("/v1/audio/transcriptions", self._transcriptions)],
            "responses": [web.post("/v1/responses", self._responses)],
        }
        self.app.add_routes([route for name in sorted(served) for route in routes[name]])
        #: The headers of the most recent API requests (POSTs; newest last, bounded), for tests
        #: of what the router sends upstream (request id, forwarding, trace context). Health
        #: checks and scrapes are left out: they come at any time.
        self.seen_headers: deque[dict[str, str]] = deque(maxlen=64)
        self.app.middlewares.append(self._remember_headers)
        self.app.add_routes(
            [
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
        return {
            "name": self.name,
            "url": self.url,
            "role": self.role,
            "rejected": self.rejected,
            **self.scheduler.stats(),
        }

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
        if self.bootstrap_port is None and self.role == "prefill":
            self.bootstrap_port = bound_port
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
            side = parse_side(body, self.role)
            if side is not None and side.side == "prefill":
                # A prefill engine computes the first token only; the decode engine generates.
                parsed = dataclasses.replace(parsed, max_tokens=1)
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
            if side is not None and side.side == "decode":
                await self._receive(side)
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
            transferred=side is not None and side.side == "decode",
        )
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs every handler in a task
        self._in_flight.add(task)
        offering = side is not None and side.side == "prefill"
        key = (side.key if side.protocol == "sglang" else (self.name, response_id)) if offering else None
        try:
            if parsed.stream:
                return await self._stream(http_request, parsed, sim_request)
            while sim_request.state is not State.FINISHED:
                await sim_request.changed.wait()
                sim_request.changed.clear()
            usage_info = usage(prompt_tokens, sim_request.generated, sim_request.cached_tokens)
            extra = None
            if offering and side.protocol == "vllm":
                blocks = -(-prompt_tokens // self.timing.block_tokens)
                params = vllm_transfer_params(self.name, response_id, self.url, blocks)
                extra = {"kv_transfer_params": params}
            return web.Response(
                body=completion_body(parsed, response_id, int(time.time()), usage_info, extra),
                content_type="application/json",
            )
        finally:
            self._in_flight.discard(task)
            if offering:
                self._offer(key, sim_request)
            # A no-op when finished; otherwise the client went away (cancellation or a failed write).
            self.scheduler.release(sim_request)

    async def _receive(self, side: Side) -> None:
        """A decode engine waits for its prefill engine's KV (the transfer itself is scheduled)."""
        offer = await self.hub.take(side.key, self.timing.kv_transfer_timeout_s)
        if side.bootstrap_port is not None and side.bootstrap_port != offer.bootstrap_port:
            raise ApiError(
                500,
                f"KV transfer failed: no prefill engine at bootstrap port {side.bootstrap_port} "
                f"(room {side.key} was prefilled by {offer.engine}, bootstrap port {offer.bootstrap_port}).",
            )

    def _offer(self, key: object, sim_request: SimRequest) -> None:
        if sim_request.state is State.FINISHED:
            self.hub.offer(key, Offer(self.name, self.bootstrap_port, sim_request.prompt_tokens))
        else:
            self.hub.withdraw(key, f"{self.name} dropped the request")

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

    @web.middleware
    async def _remember_headers(self, request: web.Request, handler) -> web.StreamResponse:
        if request.method == "POST":
            self.seen_headers.append(dict(request.headers))
        return await handler(request)

    def _next_id(self, prefix: str) -> str:
        return f"{prefix}-{self.name}-{next(self._ids)}"

    async def _json_body(self, request: web.Request) -> object:
        try:
            return orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"Invalid JSON body: {exc}") from None

    def _submit(
        self,
        request_id: str,
        model: str,
        text: str,
        max_tokens: int,
        stream: bool = False,
        cached: bool = True,
    ) -> SimRequest:
        """Schedule ``text`` as a prompt (prefix-cached unless ``cached`` is False); a 400 if it
        cannot fit, as vLLM refuses a request over ``max_model_len``."""
        prompt_tokens = -(-len(text) // self.timing.chars_per_token)
        if prompt_tokens + max_tokens > self.timing.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.timing.max_model_len} tokens. However, "
                f"you requested {prompt_tokens + max_tokens} tokens.",
            )
        return self.scheduler.submit(
            request_id=request_id,
            model=model,
            prompt_tokens=prompt_tokens,
            hashes=self.cache.hashes(text, model) if cached else [],
            max_tokens=max_tokens,
            stream=stream,
            token_ids=chunk_token_ids(text, self.timing.chars_per_token)
            if self.publisher and cached
            else None,
        )

    async def _finish(self, sim_request: SimRequest) -> SimRequest:
        """Wait for a non-streamed request to finish; released on every path."""
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        try:
            while sim_request.state is not State.FINISHED:
                await sim_request.changed.wait()
                sim_request.changed.clear()
            return sim_request
        finally:
            self._in_flight.discard(task)
            self.scheduler.release(sim_request)

    async def _pooled(self, request_id: str, model: str, texts: list[str]) -> tuple[int, int]:
        """Prefill each text as a pooling request (one output); ``(prompt tokens, cached tokens)``."""
        prompt_tokens = cached_tokens = 0
        for i, text in enumerate(texts):
            done = await self._finish(self._submit(f"{request_id}-{i}", model, text, 1))
            prompt_tokens += done.prompt_tokens
            cached_tokens += done.cached_tokens
        return prompt_tokens, cached_tokens

    def _refused(self, error: ApiError) -> web.Response:
        self.rejected += 1
        return _error(error)

    async def _embeddings(self, request: web.Request) -> web.Response:
        try:
            parsed = parse_embedding(await self._json_body(request), self.models)
            response_id = self._next_id("embd")
            prompt_tokens, cached = await self._pooled(response_id, parsed.model, parsed.inputs)
        except ApiError as error:
            return self._refused(error)
        body = embedding_body(parsed, response_id, int(time.time()), prompt_tokens, cached)
        return web.Response(body=body, content_type="application/json")

    async def _rerank(self, request: web.Request) -> web.Response:
        return await self._pairs(request, parse_rerank, "rerank", rerank_body)

    async def _score(self, request: web.Request) -> web.Response:
        return await self._pairs(request, parse_score, "score", score_body)

    async def _pairs(
        self,
        request: web.Request,
        parse: Callable[[object, tuple[str, ...]], PairRequest],
        prefix: str,
        build: Callable[[PairRequest, str, int, int], bytes],
    ) -> web.Response:
        """Rerank and score: each query-document pair is prefilled as one pooling request."""
        try:
            parsed = parse(await self._json_body(request), self.models)
            response_id = self._next_id(prefix)
            pairs = [parsed.query + document for document in parsed.documents]
            prompt_tokens, _ = await self._pooled(response_id, parsed.model, pairs)
        except ApiError as error:
            return self._refused(error)
        body = build(parsed, response_id, int(time.time()), prompt_tokens)
        return web.Response(body=body, content_type="application/json")

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            _model, text = tokenize_text(await self._json_body(request), self.models)
        except ApiError as error:
            return self._refused(error)
        tokens = chunk_token_ids(text, self.timing.chars_per_token)
        return _json(
            {
                "count": len(tokens),
                "max_model_len": self.timing.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            _model, tokens = detokenize_ids(await self._json_body(request), self.models)
        except ApiError as error:
            return self._refused(error)
        return _json({"prompt": detokenize(tokens)})

    async def _transcriptions(self, request: web.Request) -> web.StreamResponse:
        """A multipart form (``file``, ``model``, ``response_format``); the audio is not cached."""
        form = await request.post()
        upload = form.get("file")
        try:
            if not isinstance(upload, web.FileField):
                raise ApiError(400, "`file` is required and must be an uploaded file.", "file")
            model = form.get("model")
            if model is not None and model not in self.models:
                raise ApiError(404, f"The model `{model}` does not exist.", "model")
            audio = upload.file.read()
            tokens = transcript_tokens(audio)
            done = await self._finish(
                self._submit(self._next_id("trsc"), str(model or self.models[0]), "", tokens, cached=False)
            )
        except ApiError as error:
            return self._refused(error)
        body = transcription_body(audio, done.generated)
        if form.get("response_format") == "text":
            return web.Response(text=orjson.loads(body)["text"], content_type="text/plain")
        return web.Response(body=body, content_type="application/json")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        try:
            parsed = parse_responses(
                await self._json_body(request), self.models, self.timing.default_max_tokens
            )
            response_id = self._next_id("resp")
            sim_request = self._submit(
                response_id, parsed.model, parsed.prompt, parsed.max_output_tokens, parsed.stream
            )
        except ApiError as error:
            return self._refused(error)
        shapes = ResponseShapes(parsed, response_id, int(time.time()))
        if not parsed.stream:
            done = await self._finish(sim_request)
            text = TOKEN_TEXT * done.generated
            usage_info = shapes.usage(done.prompt_tokens, done.generated, done.cached_tokens)
            return _json(shapes.response("completed", text, usage_info))
        return await self._stream_response(request, shapes, sim_request)

    async def _stream_response(
        self, http_request: web.Request, shapes: ResponseShapes, sim_request: SimRequest
    ) -> web.StreamResponse:
        """The Responses API's event stream: the opening events at once, a delta per token."""
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        response.enable_chunked_encoding()
        try:
            await response.prepare(http_request)
            await response.write(shapes.opening())
            sent = 0
            while True:
                if sim_request.generated > sent:
                    await response.write(b"".join(shapes.delta() for _ in range(sent, sim_request.generated)))
                    sent = sim_request.generated
                if sim_request.state is State.FINISHED:
                    break
                await sim_request.changed.wait()
                sim_request.changed.clear()
            usage_info = shapes.usage(sim_request.prompt_tokens, sent, sim_request.cached_tokens)
            await response.write(shapes.closing(TOKEN_TEXT * sent, usage_info))
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; the request is released below
        finally:
            self._in_flight.discard(task)
            self.scheduler.release(sim_request)
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
