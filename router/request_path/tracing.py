"""OpenTelemetry traces of the request path (``tracing.enabled``; the ``otel`` extra).

Each request is a SERVER span (``POST /v1/chat/completions``) continuing the client's W3C
``traceparent``, with children:

* ``route``: the routing decision, from the candidates' filter through the index lookup to
  the policy's pick, with its policy, reason, matched tokens and candidates;
* ``upstream`` (one per attempt, CLIENT): the exchange with one backend, whose own context is
  what the engine receives as ``traceparent``, so the engine's spans (vLLM's
  ``--otlp-traces-endpoint``) nest under the attempt that reached it.

Spans are exported over OTLP by the SDK's batch processor (a background thread: the request
path only appends to its queue). The provider is the router's own, not the global one, so
several routers in one process (tests) do not mix. This module imports OpenTelemetry only
when a Tracing is built: with tracing disabled nothing of it is imported, and the request
path pays one ``is None`` test per step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from policies.types import Decision, RequestView
from router.fleet.backends import Backend
from router.request_path.settings import TracingConfig

#: Attribute names: OpenTelemetry's semantic conventions where one exists, else ``kvroute.*``.
_SERVICE = "kvroute"


class Tracing:
    """The tracer provider of one router, built from ``tracing`` (imports OpenTelemetry)."""

    def __init__(self, config: TracingConfig) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        if config.exporter == "otlp":
            self.provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(config)))
        self.tracer = self.provider.get_tracer(_SERVICE)
        self.propagator = TraceContextTextMapPropagator()
        self.kinds = SpanKind
        self.error_status = Status(StatusCode.ERROR)

    def start(self, headers: Mapping[str, str], method: str, path: str, request_id: str) -> RequestTrace:
        """The span of one request, continuing the client's ``traceparent`` if it sent one."""
        parent = self.propagator.extract(headers)
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=self.kinds.SERVER,
            attributes={"http.request.method": method, "url.path": path, "kvroute.request_id": request_id},
        )
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Flush what is queued and stop the exporter (at the app's end)."""
        self.provider.shutdown()


def _otlp_exporter(config: TracingConfig) -> Any:
    """The OTLP exporter of ``tracing.protocol``; endpoint, headers and TLS default to the
    standard ``OTEL_EXPORTER_OTLP_*`` environment variables when not configured."""
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=config.endpoint, headers=config.headers or None)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=config.endpoint, headers=config.headers or None)


class RequestTrace:
    """One request's span and the children the dispatcher and its attempts open under it."""

    __slots__ = ("_context", "_tracing", "span")

    def __init__(self, tracing: Tracing, span: Any) -> None:
        from opentelemetry.trace import set_span_in_context

        self._tracing = tracing
        self.span = span
        self._context = set_span_in_context(span)

    @staticmethod
    def now() -> int:
        """A span timestamp (ns since the epoch), for a span opened after the fact."""
        return time.time_ns()

    def routed(
        self,
        started: int,
        policy: str,
        decision: Decision,
        view: RequestView,
        candidates: Sequence[Backend],
    ) -> None:
        """The ``route`` span, from ``started`` to now: the decision and what it was made among."""
        attributes = {
            "kvroute.policy": policy,
            "kvroute.reason": decision.reason,
            "kvroute.backend": decision.backend,
            "kvroute.matched_tokens": decision.matched_blocks * view.block_tokens,
            "kvroute.prompt_tokens": view.prompt_tokens,
            "kvroute.candidates": [b.name for b in candidates],
        }
        span = self._tracing.tracer.start_span(
            "route", context=self._context, attributes=attributes, start_time=started
        )
        span.end()

    def attempt(self, backend: str, url: str, number: int) -> AttemptSpan:
        """The span of one attempt on ``backend`` (the ``number``-th of the request)."""
        span = self._tracing.tracer.start_span(
            "upstream",
            context=self._context,
            kind=self._tracing.kinds.CLIENT,
            attributes={"kvroute.backend": backend, "server.address": url, "kvroute.attempt": number},
        )
        return AttemptSpan(self._tracing, span)

    def end(self, status: int, attributes: Mapping[str, Any]) -> None:
        """End the request's span with the status the client got and the access log's fields."""
        span = self.span
        span.set_attribute("http.response.status_code", status)
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(f"kvroute.{key}", value)
        if status >= 500:
            span.set_status(self._tracing.error_status)
        span.end()


class AttemptSpan:
    """One attempt's span; its context goes upstream as ``traceparent``."""

    __slots__ = ("_tracing", "span")

    def __init__(self, tracing: Tracing, span: Any) -> None:
        self._tracing = tracing
        self.span = span

    def headers(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` plus this span's ``traceparent`` (and ``tracestate``) for the engine."""
        from opentelemetry.trace import set_span_in_context

        carrier = dict(base)
        self._tracing.propagator.inject(carrier, context=set_span_in_context(self.span))
        return carrier

    def end(self, status: int | None, error: str | None) -> None:
        span = self.span
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(self._tracing.error_status)
        elif status is not None and status >= 500:
            span.set_status(self._tracing.error_status)
        span.end()
