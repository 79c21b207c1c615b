"""Settings of the request path: ``routing``, ``upstream``, ``tenancy``, ``index.tokenizer``.

Each section's type lives beside the code that reads it, at the bottom of the wing: it
imports nothing of ``router`` above it, so every wing may import it. Ranges are declared on
the fields (``policies.params``); rules tying fields together are in ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from policies.params import NonEmptyStr, NonNegativeFloat, PositiveFloat, PositiveInt
from router.fleet.settings import BackendTLSConfig


@dataclass(frozen=True)
class RetentionConfig:
    """``routing.retention``: keep the prefixes that come back cached on LRU engines by sending
    them again (policies/retention.py, router/request_path/retention.py)."""

    #: A kept prefix is refreshed once this share of its engine's turnover (the time its
    #: uncached prompt tokens take to fill its cache) passed without a request for it; 0: off.
    refresh_share: NonNegativeFloat = 0.0
    #: The most of each engine's cache the kept prefixes hold.
    kept_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5


@dataclass(frozen=True)
class RoutingConfig:
    """``routing``: the policy and its parameters.

    ``params`` stay a mapping here: their type is the policy's own ``Params`` dataclass, known
    only once ``policy`` is resolved. ``router.config`` builds the policy from them once, at
    load, and the loaded config holds it (``Config.policy``), parameters parsed.
    """

    #: A built-in policy's name, or a user's own as ``module:Class``.
    policy: NonEmptyStr = "latency"
    #: The policy's own parameters, checked against its ``Params`` (docs/policies.md).
    params: dict[str, Any] = field(default_factory=dict)
    #: Seed for the policy's tie-breaking; null draws one at start.
    seed: int | None = None
    #: Header whose value keeps a session together (session-aware policies); else the body's ``user``.
    session_header: str = "x-session-id"
    retention: RetentionConfig = field(default_factory=RetentionConfig)


@dataclass(frozen=True)
class DecodeRoutingConfig:
    """``disaggregation.decode_routing``: the policy choosing a request's decode engine."""

    #: Any routing policy; the default weighs load, KV usage and (where decode engines cache
    #: prefixes) the KV that would not need transferring.
    policy: NonEmptyStr = "decode_balance"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DisaggregationConfig:
    """``disaggregation``: prefill/decode pairs, used for a model whose backends have roles.

    A model served by ``role: prefill`` or ``role: decode`` backends is served by pairs: the
    prefill engine chosen by ``routing`` over the prefill pool (prefix matching there), the
    decode engine by ``decode_routing`` over the decode pool. The protocol follows the
    engines' kind: SGLang's bootstrap (both sent at once) or vLLM's ``kv_transfer_params``
    (prefill first, then decode with what it returned).
    """

    decode_routing: DecodeRoutingConfig = field(default_factory=DecodeRoutingConfig)
    #: The decode engines keep the prefixes they received in a prefix cache of their own (vLLM
    #: decode with prefix caching; SGLang decode with its radix cache on): the index then learns
    #: them from decode engines too, and the decode policy sees their matches.
    decode_caches_prefixes: bool = False
    #: vLLM: extra keys of the ``kv_transfer_params`` sent to the prefill engine, for connectors
    #: that want more than NixlConnector's ``do_remote_decode``/``do_remote_prefill``.
    vllm_kv_transfer_params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UpstreamConfig:
    """``upstream``: timeouts and retries of the requests to the engines."""

    connect_timeout_s: PositiveFloat = 5.0
    #: Idle stream: longest silence from a backend between two chunks, once it began sending.
    read_timeout_s: PositiveFloat = 600.0
    #: Longest wait from sending a request to the response's first body byte (queue + prefill;
    #: for a non-streamed request, the whole generation).
    first_byte_timeout_s: PositiveFloat = 300.0
    #: Backends tried for one request when the chosen one fails before sending anything.
    max_attempts: PositiveInt = 2
    #: Total time to get a first byte, over all attempts: no attempt starts after it, and an
    #: attempt's first-byte wait is cut short at it.
    retry_deadline_s: PositiveFloat = 600.0
    #: An idle keep-alive connection to a backend is reused only this long, kept under the
    #: engines' own keep-alive timeout (uvicorn's 5 s, which vLLM and SGLang serve with), so the
    #: router does not send a request on a connection the engine is closing at that moment.
    keepalive_s: PositiveFloat = 4.0
    #: TLS to engines at ``https://`` URLs that have no ``tls`` of their own (discovered ones
    #: included): CA bundle, client certificate, verification, SNI. Changing it needs a restart.
    tls: BackendTLSConfig = field(default_factory=BackendTLSConfig)
    #: Tell the engines who the client is: append its address to ``X-Forwarded-For`` and set
    #: ``X-Forwarded-Proto`` (kept when a proxy in front already set it), as nginx and Envoy do.
    forwarded_headers: bool = True


@dataclass(frozen=True)
class TracingConfig:
    """``tracing``: OpenTelemetry spans of every request (router/request_path/tracing.py).

    Needs the ``otel`` extra (``pip install 'kvroute[otel]'``). Endpoint, headers and TLS of
    the exporter default to the standard ``OTEL_EXPORTER_OTLP_*`` environment variables.
    """

    enabled: bool = False
    #: ``otlp``: export over OTLP; ``none``: spans are made and propagated but not exported
    #: (the engines' spans still nest under the router's context).
    exporter: Literal["otlp", "none"] = "otlp"
    #: OTLP over HTTP (protobuf, port 4318) or gRPC (port 4317).
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    #: The collector's URL, e.g. ``http://otel-collector:4318/v1/traces``; null: the environment's.
    endpoint: str | None = None
    #: Extra headers sent to the collector (an auth token, a tenant).
    headers: dict[str, str] = field(default_factory=dict)
    service_name: NonEmptyStr = "kvroute"
    #: Share of new traces sampled; a request continuing a client's trace follows its decision.
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0

    def validate(self) -> list[str]:
        if not self.enabled:
            return []
        needed = ["opentelemetry.sdk"]
        if self.exporter == "otlp":
            needed.append(
                "opentelemetry.exporter.otlp.proto.grpc"
                if self.protocol == "grpc"
                else "opentelemetry.exporter.otlp.proto.http"
            )
        absent = [name for name in needed if not _importable(name)]
        if absent:
            return [f"enabled: needs {', '.join(absent)}; install kvroute[otel]"]
        return []


def _importable(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


@dataclass(frozen=True)
class TenancyConfig:
    """``tenancy``: which tenant a request belongs to (cache salt and limits)."""

    #: Header naming the tenant (set by a trusted gateway in front of kvroute).
    header: str = "x-kvroute-tenant"
    #: Without that header, derive the tenant from a hash of the request's bearer API key.
    from_api_key: bool = True


@dataclass(frozen=True)
class TokenizerConfig:
    """``index.tokenizer``: how the router turns a request into the engine's token ids.

    Used only with ``index.mode: events``; its files and packages are checked then (see
    ``IndexConfig.validate``), so an approximate-mode config never needs them.
    """

    #: ``hf``: a local tokenizer.json (needs the ``precise`` extra); ``chunk``: the simulated
    #: engines' tokenizer (``chars_per_token`` characters per token), for tests and benchmarks.
    kind: Literal["hf", "chunk"] = "hf"
    #: ``hf``: path of the model's ``tokenizer.json``.
    path: str | None = None
    #: ``hf``: the chat template, as a ``tokenizer_config.json`` or a ``.jinja`` file; default:
    #: the ``tokenizer_config.json`` next to ``path``.
    chat_template: str | None = None
    #: ``chunk``: characters per token.
    chars_per_token: PositiveInt = 4

    def missing(self) -> list[str]:
        """What keeps this tokenizer from loading now (packages, files), as ``key: why`` messages."""
        needed = ("jinja2", "tokenizers") if self.kind == "hf" else ("jinja2",)
        absent = [name for name in needed if find_spec(name) is None]
        if absent:
            return [f"kind: needs {', '.join(absent)}; install kvroute[precise]"]
        if self.kind != "hf":
            return []
        if not self.path:
            return ["path: required with kind: hf (the model's tokenizer.json)"]
        problems = []
        if not Path(self.path).is_file():
            problems.append(f"path: no such file {self.path!r}")
        if self.chat_template and not Path(self.chat_template).is_file():
            problems.append(f"chat_template: no such file {self.chat_template!r}")
        return problems
