"""Settings of the fleet: ``backends``, ``health``, ``engine_metrics``, ``discovery``, and the
one list of engine kinds.

Each section's type lives beside the code that reads it, at the bottom of the wing: it
imports nothing of ``router`` above it, so every wing (and the command line, the simulator)
may import it. Ranges are declared on the fields (``policies.params``); rules tying fields
together are in ``validate``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import ssl
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from policies.params import NonEmptyStr, PositiveFloat, PositiveInt
from router.kv_events.settings import EndpointConfig

#: The engines kvroute speaks to (``backends[].engine``): their metrics adapter, KV event
#: format and event-source discovery differ. The command line and the simulator take it from here.
EngineKind = Literal["vllm", "sglang"]
ENGINE_KINDS: tuple[EngineKind, ...] = typing.get_args(EngineKind)

#: What a backend does in prefill/decode disaggregation (``backends[].role``): ``both`` serves
#: whole requests (the default, and the only role of a co-located fleet); ``prefill`` computes a
#: prompt's KV and hands it over; ``decode`` receives it and generates. A ``both`` engine in a
#: role-split fleet may take either side of a pair (vLLM's ``kv_both`` connector role).
BackendRole = Literal["prefill", "decode", "both"]

#: Schemes are case-insensitive (RFC 3986 §3.1); spelled out as character classes because the
#: JSON Schema the same declaration produces speaks ECMA-262 regexes, which have no ``(?i)``.
HttpUrl = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://([^/?#@]*@)?(\[[0-9A-Fa-f:.]+\]|[^/?#@:\[\]]+)(:[0-9]*)?([/?#]|$)",
        extra={"expected": "an http:// or https:// URL"},
    ),
]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


@dataclass(frozen=True)
class BackendTLSConfig:
    """TLS to engines served at ``https://`` URLs (``backends[].tls``, default ``upstream.tls``).

    Used by every connection to the engine: requests, health checks, ``/v1/models``, metric
    scrapes and KV event discovery. Each file is read when the config loads (a reload reads it
    again), so a mistake is reported at load, by its path.
    """

    #: PEM bundle of the CAs that sign the engines' certificates (a private CA); default: the
    #: system's trust store.
    ca_file: str | None = None
    #: Client certificate and its key (PEM), for engines that ask for one (mutual TLS).
    cert_file: str | None = None
    key_file: str | None = None
    #: Verify the engine's certificate and name. Off only for a test bench: anyone between the
    #: router and the engine could then read and change prompts and answers.
    verify: bool = True
    #: The name sent as SNI and checked against the certificate; default: the URL's host. For
    #: engines reached by IP address or by a name their certificate does not carry.
    server_name: NonEmptyStr | None = None

    def validate(self) -> list[str]:
        if (self.cert_file is None) != (self.key_file is None):
            return ["cert_file: give cert_file and key_file together"]
        problems = [
            f"{key}: cannot read {path}"
            for key, path in (
                ("ca_file", self.ca_file),
                ("cert_file", self.cert_file),
                ("key_file", self.key_file),
            )
            if path is not None and not os.access(path, os.R_OK)
        ]
        if problems:
            return problems
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (ssl.SSLError, OSError) as exc:
            return [f"ca_file: not a PEM bundle of CA certificates ({exc})"]
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as exc:
                return [f"cert_file: cannot load it with key_file ({exc})"]
        return []


def client_context(tls: BackendTLSConfig) -> ssl.SSLContext:
    """The client side of TLS as ``tls`` says, built anew (the files are read now)."""
    context = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    if not tls.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


@dataclass(frozen=True)
class BackendConfig:
    """One entry of ``backends``: an engine the router sends requests to."""

    #: Unique; names the backend in metrics, logs and the ``x-kvroute-backend`` response header.
    name: NonEmptyStr
    #: Base URL of its OpenAI-compatible server, ``http://`` or ``https://``.
    url: HttpUrl
    #: The engine it runs: which ``/metrics`` names and KV event format it speaks.
    engine: EngineKind = "vllm"
    #: Models served; when absent they are read from the backend's ``/v1/models``.
    models: list[NonEmptyStr] | None = None
    #: Believed KV capacity in prefix blocks; defaults to ``index.backend_capacity_blocks``.
    capacity_blocks: PositiveInt | None = None
    #: Start out of rotation (draining): no new requests; undrain through the admin API.
    drain: bool = False
    #: With ``index.mode: events``, where the engine publishes KV events (see EndpointConfig);
    #: absent: asked of the engine (vLLM ``/kv_event_sources``, SGLang ``/server_info``).
    kv_events: EndpointConfig | None = None
    #: Credential the engine expects (vLLM ``--api-key``), sent upstream as ``Authorization: Bearer``
    #: in place of the client's; given inline or as the name of an environment variable. Never
    #: shown by the admin API, never logged (``repr=False``), never returned to clients.
    api_key: str | None = field(default=None, repr=False)
    #: ... or the name of the environment variable holding it (at most one of the two).
    api_key_env: str | None = None
    #: TLS to this engine (an ``https://`` URL); absent: ``upstream.tls``.
    tls: BackendTLSConfig | None = None
    role: BackendRole = "both"
    #: An SGLang prefill engine's ``--disaggregation-bootstrap-port``, sent to the decode engine
    #: as ``bootstrap_port`` (absent: null, the engine's default port).
    bootstrap_port: Port | None = None

    @property
    def upstream_api_key(self) -> str | None:
        """The engine's credential, from ``api_key`` or the environment (read once validated)."""
        if self.api_key_env is not None:
            return os.environ.get(self.api_key_env) or None
        return self.api_key

    def validate(self) -> list[str]:
        if self.bootstrap_port is not None and (self.engine != "sglang" or self.role == "decode"):
            return ["bootstrap_port: only an SGLang engine that prefills (role: prefill or both) has one"]
        if self.api_key is not None and self.api_key_env is not None:
            return ["api_key: give at most one of api_key, api_key_env"]
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            return [f"api_key_env: environment variable {self.api_key_env} is not set or empty"]
        return []


@dataclass(frozen=True)
class HealthConfig:
    """``health``: active checks and passive ejection of backends."""

    #: Seconds between active ``GET /health`` checks of each backend.
    interval_s: PositiveFloat = 5.0
    timeout_s: PositiveFloat = 2.0
    #: Consecutive failed checks before a backend leaves rotation (one success brings it back).
    unhealthy_after: PositiveInt = 2
    #: Seconds between refreshes of ``/v1/models`` for backends without configured models.
    models_refresh_s: PositiveFloat = 30.0
    #: Passive ejection: consecutive failed requests (connection error, timeout, 5xx; never a
    #: 4xx) that take a backend out of rotation, for ``eject_s`` at first, doubling on each
    #: failed re-admission trial up to ``max_eject_s`` (see router/fleet/circuit.py).
    eject_after: PositiveInt = 5
    eject_s: PositiveFloat = 10.0
    max_eject_s: PositiveFloat = 300.0

    def validate(self) -> list[str]:
        return ["max_eject_s: expected at least eject_s"] if self.max_eject_s < self.eject_s else []


@dataclass(frozen=True)
class EngineMetricsConfig:
    """``engine_metrics``: scraping each engine's ``/metrics`` for its queue and KV usage."""

    enabled: bool = True
    interval_s: PositiveFloat = 0.5
    timeout_s: PositiveFloat = 1.0
    #: A scrape older than this is not shown to the policies (they see None, not old numbers).
    stale_after_s: PositiveFloat = 2.0

    def validate(self) -> list[str]:
        if self.stale_after_s <= self.interval_s:
            return ["stale_after_s: expected more than interval_s"]
        return []


@dataclass(frozen=True)
class DiscoveredBackend:
    """What every discovered endpoint becomes: ``scheme://address:port`` of this engine kind."""

    port: Port = 8000
    scheme: Literal["http", "https"] = "http"
    engine: EngineKind = "vllm"
    #: Models served; when absent they are read from each backend's ``/v1/models``.
    models: list[NonEmptyStr] | None = None
    capacity_blocks: PositiveInt | None = None
    #: The role of every endpoint this source finds (``backends[].role``).
    role: BackendRole = "both"
    #: SGLang prefill engines' bootstrap port (``backends[].bootstrap_port``).
    bootstrap_port: Port | None = None


@dataclass(frozen=True)
class RoleSource:
    """One entry of ``discovery.roles``: the endpoints of one role, found by their own DNS name or
    label selector, with the rest of the source's settings (``discovery.dns`` or ``.kubernetes``)."""

    role: BackendRole
    #: ``kind: dns``: the name whose A records are this role's engines.
    name: str = ""
    #: ``kind: kubernetes``: the selector of this role's EndpointSlices, e.g. ``app=sglang,role=prefill``.
    label_selector: str = ""
    #: This role's port; absent: the source's ``port``.
    port: Port | None = None
    bootstrap_port: Port | None = None


@dataclass(frozen=True)
class DnsDiscoveryConfig(DiscoveredBackend):
    """``discovery.dns``: the A records of a name (a Kubernetes headless Service), re-resolved."""

    #: The name to resolve; required with ``discovery.kind: dns``.
    name: str = ""
    interval_s: PositiveFloat = 10.0
    #: Resolvers to ask (IP addresses); empty uses the system's (/etc/resolv.conf).
    nameservers: list[str] = field(default_factory=list)
    nameserver_port: Port = 53
    timeout_s: PositiveFloat = 2.0

    def validate(self) -> list[str]:
        problems = []
        for server in self.nameservers:
            try:
                ipaddress.ip_address(server)
            except ValueError:
                problems.append(f"nameservers: expected IP addresses, got {server!r}")
        return problems


_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class KubernetesDiscoveryConfig(DiscoveredBackend):
    """``discovery.kubernetes``: EndpointSlices matching a label selector, watched."""

    #: Which EndpointSlices, e.g. ``app=vllm``; required with ``discovery.kind: kubernetes``.
    label_selector: str = ""
    #: Namespace to watch; empty reads the pod's own (``namespace_file``).
    namespace: str = ""
    #: The EndpointSlice port to use, by name; empty uses ``port``.
    port_name: str = ""
    #: API server; empty uses the in-cluster one (KUBERNETES_SERVICE_HOST/PORT).
    api_url: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^($|[Hh][Tt][Tt][Pp][Ss]?://)", extra={"expected": "an http:// or https:// URL"}
        ),
    ] = ""
    token_file: str = f"{_SERVICE_ACCOUNT}/token"
    ca_file: str = f"{_SERVICE_ACCOUNT}/ca.crt"
    namespace_file: str = f"{_SERVICE_ACCOUNT}/namespace"
    #: Server-side bound of one watch call, after which it is re-opened from the last version.
    watch_timeout_s: PositiveInt = 300
    #: Wait before re-listing after the API server failed or the watch expired.
    retry_s: PositiveFloat = 2.0


@dataclass(frozen=True)
class DiscoveryConfig:
    """``discovery``: where backends come from besides the static ``backends`` list.

    Both sources' sections are always typed (their keys and ranges are checked); what only the
    chosen one needs (a name to resolve, a label selector) is required only for it.
    """

    #: Where backends come from: ``static`` (the ``backends`` list), ``dns`` or ``kubernetes``.
    kind: Literal["static", "dns", "kubernetes"] = "static"
    dns: DnsDiscoveryConfig = field(default_factory=DnsDiscoveryConfig)
    kubernetes: KubernetesDiscoveryConfig = field(default_factory=KubernetesDiscoveryConfig)
    #: Prefill/decode disaggregation: one source per role, each the chosen kind's section with
    #: its own name or selector (then ``dns.name``/``kubernetes.label_selector`` are not needed).
    roles: list[RoleSource] = field(default_factory=list)

    def validate(self) -> list[str]:
        if self.roles:
            if self.kind == "static":
                return ["roles: expected kind dns or kubernetes"]
            key = "name" if self.kind == "dns" else "label_selector"
            missing = [i for i, r in enumerate(self.roles) if not getattr(r, key)]
            return [f"roles[{i}].{key}: expected a value with kind {self.kind}" for i in missing]
        if self.kind == "dns" and not self.dns.name:
            return ["dns.name: expected the DNS name to resolve"]
        if self.kind == "kubernetes" and not self.kubernetes.label_selector:
            return ["kubernetes.label_selector: expected a selector such as app=vllm"]
        return []

    def sources(self) -> list[DnsDiscoveryConfig | KubernetesDiscoveryConfig]:
        """The chosen kind's section, once per role source (or once, without ``roles``)."""
        base = self.dns if self.kind == "dns" else self.kubernetes
        if not self.roles:
            return [base]
        out: list[DnsDiscoveryConfig | KubernetesDiscoveryConfig] = []
        for r in self.roles:
            target = {"name": r.name} if self.kind == "dns" else {"label_selector": r.label_selector}
            out.append(
                dataclasses.replace(
                    base, **target, role=r.role, port=r.port or base.port, bootstrap_port=r.bootstrap_port
                )
            )
        return out
