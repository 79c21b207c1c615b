"""Locust load test over the OpenAI chat API, in the traffic shapes of :mod:`loadtest.shapes`.

Against any OpenAI-compatible URL (kvroute, an engine, another router), headless::

    locust -f loadtest/locustfile.py --headless -H http://127.0.0.1:8080 \\
        --shape chat -u 16 -r 4 -t 60s --rate 8 --records run.jsonl

Every request streams (``stream_options.include_usage``). Beside locust's own row per shape
(``POST chat``: the whole response, first byte to ``[DONE]``), each shape gets rows
``TTFT`` (time to the first content token), ``ITL`` (each gap between content chunks) and
``HIT%`` (the engine-reported share of the prompt that was cached, per request: usage's
``prompt_tokens_details.cached_tokens``). Their "response time" columns are milliseconds,
except ``HIT%``'s, which are percent. At the end, the token-weighted hit ratio per shape is
printed. ``--records`` writes one JSON line per request for :mod:`loadtest.report_md`, and
with ``--sample-queues`` the engines' queue depth every ``--sample-interval`` seconds.

A request fails on a non-200 status, an error event in the stream, or a stream that ends
without ``data: [DONE]``; locust then exits with status 1.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import IO, Any

import gevent
import orjson
from locust import HttpUser, events, task
from locust.env import Environment
from locust.exception import StopUser

from loadtest.queue_sampler import queue_depth
from loadtest.shapes import SHAPES, Shape, ShapeOptions, make_shape, shared_trace
from loadtest.sse import ChatStream

log = logging.getLogger("kvroute.locust")

_user_numbers = itertools.count()


class _Run:
    """What the users of one process share: start time, records file, token totals."""

    started = time.monotonic()
    model: str = ""
    records: IO[bytes] | None = None
    sampler: gevent.Greenlet | None = None
    in_flight = 0
    trace_done = False
    #: shape -> [requests, prompt tokens, cached tokens]
    tokens: dict[str, list[int]] = {}


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    parser.add_argument(
        "--shape",
        default="chat",
        help=f"traffic shape(s), comma-separated, assigned to users in turn: {', '.join(SHAPES)}",
    )
    parser.add_argument("--model", default="", help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (trace: cap)")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="total requests/s over all users (0: each user back to back)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic text")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="bearer token")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM, SGLang): every reply is max-tokens long",
    )
    parser.add_argument("--trace", default="", help="Mooncake-format JSONL trace for --shape mooncake")
    parser.add_argument(
        "--trace-speedup",
        type=float,
        default=0.0,
        help="replay trace timestamps N times faster (0: ignore them)",
    )
    parser.add_argument("--trace-limit", type=int, default=0, help="replay only the first N trace records")
    parser.add_argument(
        "--trace-max-input-tokens",
        type=int,
        default=0,
        help="cut longer trace prompts to N tokens (0: never)",
    )
    parser.add_argument("--records", default="", help="write one JSON line per request to this file")
    parser.add_argument(
        "--sample-queues",
        default="",
        help="NAME=URL,... engines whose queue depth (/metrics) goes into --records (NAME: the backend name)",
    )
    parser.add_argument("--sample-interval", type=float, default=1.0, help="seconds between queue samples")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    names = {n.strip() for n in options.shape.split(",") if n.strip()}
    for name in names - set(SHAPES):
        raise SystemExit(f"--shape: unknown shape {name!r}; expected one of {', '.join(SHAPES)}")
    if "mooncake" in names:
        if not options.trace:
            raise SystemExit("--shape mooncake needs --trace: a Mooncake-format JSONL trace")
        try:
            shared_trace(options.trace, options.trace_limit)  # read once, before any user starts
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--trace: {exc}") from None
    _Run.started = time.monotonic()
    _Run.model = options.model or _first_model(environment)
    if options.records:
        _Run.records = open(options.records, "wb")  # noqa: SIM115 - closed at test_stop
        if options.sample_queues:
            _Run.sampler = gevent.spawn(
                _sample_queues, _engines(options.sample_queues), options.sample_interval
            )


def _engines(spec: str) -> dict[str, str]:
    engines = {}
    for item in filter(None, (i.strip() for i in spec.split(","))):
        name, sep, url = item.partition("=")
        engines[name if sep else item] = url if sep else item
    return engines


def _sample_queues(engines: dict[str, str], interval: float) -> None:
    """Write each engine's waiting requests to the records file every ``interval`` seconds."""
    import requests

    while _Run.records is not None:
        for name, url in engines.items():
            try:
                text = requests.get(f"{url.rstrip('/')}/metrics", timeout=max(1.0, interval)).text
                depth = queue_depth(text)
            except (requests.RequestException, ValueError):
                continue  # a missed sample must not disturb the load test
            if depth is not None and _Run.records is not None:
                row = {
                    "kind": "queue",
                    "t": round(time.monotonic() - _Run.started, 6),
                    "backend": name,
                    "depth": depth,
                }
                _Run.records.write(orjson.dumps(row) + b"\n")
        gevent.sleep(interval)


def _first_model(environment: Environment) -> str:
    """The first model the target serves: any OpenAI-compatible server lists them."""
    import requests  # locust's own dependency; imported here, after gevent patched the process

    url = f"{environment.host.rstrip('/')}/v1/models"
    response = requests.get(url, headers=_auth_headers(environment.parsed_options), timeout=30)
    response.raise_for_status()
    models = [m["id"] for m in response.json().get("data", [])]
    if not models:
        raise SystemExit(f"{url} lists no model; pass --model")
    return models[0]


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_: Any) -> None:
    if _Run.sampler is not None:
        _Run.sampler.kill()
        _Run.sampler = None
    if _Run.records is not None:
        _Run.records.close()
        _Run.records = None
    if not _Run.tokens:
        return
    lines = ["", "engine-reported prefix cache hits (cached / prompt tokens):"]
    for shape, (requests, prompt, cached) in sorted(_Run.tokens.items()):
        ratio = cached / prompt if prompt else 0.0
        lines.append(f"  {shape:<14} {requests:>7} requests  {cached:>12} / {prompt:<12} = {ratio:6.1%}")
    print("\n".join(lines), flush=True)


def _auth_headers(options: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}


def _shape_options(options: Any) -> ShapeOptions:
    return ShapeOptions(
        seed=options.seed,
        max_tokens=options.max_tokens,
        trace_path=options.trace or None,
        trace_speedup=options.trace_speedup,
        trace_limit=options.trace_limit,
        trace_max_input_tokens=options.trace_max_input_tokens,
    )


def _quit_when_drained(environment: Environment) -> None:
    """The trace is exhausted: end the run once the requests still in flight have finished."""
    while _Run.in_flight:
        gevent.sleep(0.05)
    log.info("trace replay finished")
    if environment.runner is not None:
        environment.runner.quit()


class ChatUser(HttpUser):
    """One user sending its shape's chat requests, streaming, one at a time."""

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.number = next(_user_numbers)
        names = [n.strip() for n in options.shape.split(",") if n.strip()]
        self.shape: Shape = make_shape(names[self.number % len(names)], self.number, _shape_options(options))
        self.headers = {"Content-Type": "application/json", **_auth_headers(options)}
        self.next_start = time.monotonic()

    def wait_time(self) -> float:
        """With ``--rate``, users space their requests so the total stays at the rate; else none."""
        options = self.environment.parsed_options
        if options.rate <= 0:
            return 0.0
        interval = max(1, options.num_users or 1) / options.rate
        now = time.monotonic()
        self.next_start = max(self.next_start + interval, now)
        return self.next_start - now

    @task
    def chat(self) -> None:
        request = self.shape.next_request()
        if request is None:
            if not _Run.trace_done:
                _Run.trace_done = True
                gevent.spawn(_quit_when_drained, self.environment)
            raise StopUser()
        if request.at is not None:
            gevent.sleep(max(0.0, _Run.started + request.at - time.monotonic()))
        options = self.environment.parsed_options
        body: dict[str, Any] = {
            "model": _Run.model,
            "messages": request.messages,
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            body["tools"] = request.tools
        if options.ignore_eos:
            body["ignore_eos"] = True
        _Run.in_flight += 1
        try:
            self._send(orjson.dumps(body), options.request_timeout)
        finally:
            _Run.in_flight -= 1

    def _send(self, body: bytes, timeout: float) -> None:
        shape = self.shape.name
        sent_at = time.monotonic() - _Run.started
        started = time.perf_counter()
        stream = ChatStream(started)
        received = 0
        with self.client.post(
            "/v1/chat/completions",
            data=body,
            headers=self.headers,
            name=shape,
            stream=True,
            catch_response=True,
            timeout=timeout,
        ) as response:
            backend = response.headers.get("x-kvroute-backend")
            error = getattr(response, "error", None)
            if response.status_code == 0 and error is not None:  # the request could not be sent
                failure: str | None = f"{type(error).__name__}: {error}"
            elif response.status_code != 200:
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                try:
                    for line in response.iter_lines():
                        received += len(line) + 1
                        stream.feed(line, time.perf_counter())
                    failure = stream.failure
                except Exception as exc:  # the connection broke mid-stream
                    failure = f"{type(exc).__name__}: {exc}"
            latency = time.perf_counter() - started
            # Locust timed the headers only (stream=True): report the whole response instead.
            response.request_meta["response_time"] = latency * 1000
            response.request_meta["response_length"] = received
            if failure:
                response.failure(failure)
            else:
                response.success()
        if not failure:
            self._record_stream(shape, stream)
            self.shape.on_reply(stream.text)
        if _Run.records is not None:
            row = {
                "kind": "request",
                "t": round(sent_at, 6),
                "shape": shape,
                "ok": failure is None,
                "status": response.status_code,
                "ttft": stream.ttft,
                "latency": latency,
                "prompt_tokens": stream.prompt_tokens,
                "cached_tokens": stream.cached_tokens,
                "output_tokens": stream.completion_tokens,
                "backend": backend,
                "error": failure,
            }
            _Run.records.write(orjson.dumps(row) + b"\n")

    def _record_stream(self, shape: str, stream: ChatStream) -> None:
        if stream.ttft is not None:
            self._metric("TTFT", shape, stream.ttft * 1000)
        for gap in stream.gaps:
            self._metric("ITL", shape, gap * 1000)
        if stream.prompt_tokens:
            self._metric("HIT%", shape, 100 * stream.cached_tokens / stream.prompt_tokens)
        totals = _Run.tokens.setdefault(shape, [0, 0, 0])
        totals[0] += 1
        totals[1] += stream.prompt_tokens
        totals[2] += stream.cached_tokens

    def _metric(self, kind: str, shape: str, value: float) -> None:
        """A row of locust's statistics that is not an HTTP request: ``value`` in its "response time"."""
        self.environment.events.request.fire(
            request_type=kind, name=shape, response_time=value, response_length=0, exception=None, context={}
        )
