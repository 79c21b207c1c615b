"""The YAML configuration: parsed into typed sections and validated completely at start.

Every section is a frozen dataclass whose fields are the accepted keys with their defaults
(``config.example.yaml`` documents each one). Validation errors name the key by its path,
``backends[1].url``, and say what was expected.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from policies.eviction import POLICIES as EVICTION_POLICIES
from policies.params import ParamError, parse_params
from policies.routing import PolicyLoadError, build_policy
from router.http.ratelimit import TenantLimits
from router.kv_events.settings import EndpointConfig, EventsConfig, TokenizerConfig

ENGINES = ("vllm", "sglang")
STORES = ("memory", "redis")
INDEX_MODES = ("approximate", "events")
DISCOVERY_KINDS = ("static", "dns", "kubernetes")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and what was expected."""


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    #: On SIGTERM: stop accepting, then give in-flight responses this long before exiting anyway.
    drain_timeout_s: float = 60.0

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port: expected an integer in [0, 65535]")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s: expected a non-negative number")


@dataclass(frozen=True)
class BackendConfig:
    name: str
    url: str
    engine: str = "vllm"
    #: Models served; when absent they are read from the backend's ``/v1/models``.
    models: list[str] | None = None
    #: Believed KV capacity in prefix blocks; defaults to ``index.backend_capacity_blocks``.
    capacity_blocks: int | None = None
    #: Start out of rotation (draining): no new requests; undrain through the admin API.
    drain: bool = False
    #: With ``index.mode: events``, where the engine publishes KV events (see EndpointConfig);
    #: absent: asked of the engine (vLLM ``/kv_event_sources``, SGLang ``/server_info``).
    kv_events: dict | None = None
    #: Credential the engine expects (vLLM ``--api-key``), sent upstream as ``Authorization: Bearer``
    #: in place of the client's; given inline or as the name of an environment variable. Never
    #: shown by the admin API, never logged (``repr=False``), never returned to clients.
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None

    @property
    def upstream_api_key(self) -> str | None:
        """The engine's credential, from ``api_key`` or the environment (read once validated)."""
        if self.api_key_env is not None:
            return os.environ.get(self.api_key_env) or None
        return self.api_key

    def validate(self) -> None:
        if not self.name:
            raise ValueError("name: expected a non-empty string")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("api_key: give at most one of api_key, api_key_env")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env: environment variable {self.api_key_env} is not set or empty")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url: expected an http:// or https:// URL, got {self.url!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {list(ENGINES)}, got {self.engine!r}")
        if self.models is not None and not all(self.models):
            raise ValueError("models: expected a list of non-empty model names")
        if self.capacity_blocks is not None and self.capacity_blocks <= 0:
            raise ValueError("capacity_blocks: expected a positive integer")
        if self.kv_events is not None:
            parse_params(EndpointConfig, self.kv_events, where="kv_events")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix_aware"
    params: dict = field(default_factory=dict)
    #: Seed for the policy's tie-breaking; null draws one at start.
    seed: int | None = None
    #: Header whose value keeps a session together (session-aware policies); else the body's ``user``.
    session_header: str = "x-session-id"


@dataclass(frozen=True)
class RedisConfig:
    """``index.redis``: where the shared index and load view live, and how hard to try.

    One of three topologies: a standalone server (``url``), Sentinel (``sentinels`` +
    ``service_name``; ``url`` then only gives scheme, database and credentials), or Cluster
    (``cluster: true``; ``url`` is any seed node).
    """

    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    #: Password, or where to read it: an environment variable or a file (at most one of the three).
    password: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    #: Sentinel: ``host:port`` of each sentinel, and the monitored master's name.
    sentinels: list[str] = field(default_factory=list)
    service_name: str = "mymaster"
    cluster: bool = False
    #: TLS (``rediss://`` URLs): CA bundle, client certificate and key, and whether to verify the server.
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    #: Prefix of every key, so several deployments can share one Redis.
    namespace: str = "kvroute"
    #: Every key expires this long after its last write (a backend's beliefs: its last request).
    key_ttl_s: float = 3600.0
    #: Deadline of one lookup on the request path; past it the request routes on the local view.
    #: It guards against a stalled Redis, not a busy router: the clock runs while the router's
    #: event loop serves other requests, and a tighter one cost hit ratio (README, benchmark).
    timeout_ms: float = 20.0
    #: Deadline of the off-path calls (batched writes, load sync, probes).
    background_timeout_ms: float = 1000.0
    #: Consecutive lookup timeouts that mark Redis as down (a connection error does at once).
    trip_after: int = 3
    #: While Redis is down, how often to probe it (the router returns to shared state by itself).
    retry_interval_s: float = 0.5
    #: Pending index updates held for the writer; beyond it updates are dropped and counted.
    write_queue_size: int = 10000
    #: Most blocks written in one script call (a single longer chain goes alone). Redis runs one
    #: script at a time, so this bounds how long a write holds up lookups (~1 ms per 1000 blocks).
    write_batch_blocks: int = 1000
    #: Publish this router's in-flight counts and read everyone's (the shared load view).
    share_load: bool = True
    load_interval_s: float = 0.1
    #: A router that stopped publishing stops counting after this long (it died).
    load_ttl_s: float = 3.0

    def validate(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss") or not (parts.hostname or self.sentinels):
            raise ValueError(f"url: expected a redis:// or rediss:// URL, got {self.url!r}")
        if sum(x is not None for x in (self.password, self.password_env, self.password_file)) > 1:
            raise ValueError("password: give at most one of password, password_env, password_file")
        for sentinel in self.sentinels:
            host, _, port = sentinel.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"sentinels: expected host:port entries, got {sentinel!r}")
        if self.sentinels and self.cluster:
            raise ValueError("cluster: Sentinel and Cluster are exclusive; configure one")
        if not self.namespace or any(c in self.namespace for c in "{}"):
            raise ValueError("namespace: expected a non-empty string without braces")
        positive = ("key_ttl_s", "timeout_ms", "background_timeout_ms", "retry_interval_s", "load_interval_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number")
        if self.load_ttl_s <= self.load_interval_s:
            raise ValueError("load_ttl_s: expected more than load_interval_s")
        for name in ("trip_after", "write_queue_size", "write_batch_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer")


@dataclass(frozen=True)
class IndexConfig:
    store: str = "memory"
    #: Block size of the prefix chain in characters (UTF-8 bytes) of the prompt as the engine sees it.
    block_size: int = 256
    #: Characters per token, to turn matched blocks into estimated tokens for policies and metrics.
    chars_per_token: float = 4.0
    #: Default believed KV capacity of one backend, in blocks (LRU beyond it).
    backend_capacity_blocks: int = 65536
    #: Global bound on (backend, block) entries over the whole index: the memory budget.
    max_blocks: int = 2_000_000
    #: Connection and behaviour of the shared index when ``store: redis`` (see RedisConfig).
    redis: dict = field(default_factory=dict)
    #: What each backend's believed cache drops first: lru (what engines do) | lfu | ttl.
    eviction: str = "lru"
    #: With ``eviction: ttl``, seconds a block is believed held after its last use.
    ttl_s: float = 120.0
    #: Correct beliefs from the cached tokens engines report (router/request_path/beliefs.py).
    closed_loop: bool = False
    #: ... when an engine reports less than this share of the predicted cached tokens.
    closed_loop_tolerance: float = 0.5
    #: approximate: believe what the router routed (no tokenizer); events: what the engines'
    #: KV events report (precise mode; needs ``tokenizer``, see README "Precise routing").
    mode: str = "approximate"
    #: Precise mode's event handling (see EventsConfig).
    events: dict = field(default_factory=dict)
    #: Precise mode's tokenizer (see TokenizerConfig).
    tokenizer: dict = field(default_factory=dict)

    @property
    def events_config(self) -> EventsConfig:
        return parse_params(EventsConfig, self.events, where="events")

    @property
    def tokenizer_config(self) -> TokenizerConfig:
        return parse_params(TokenizerConfig, self.tokenizer, where="tokenizer")

    @property
    def redis_config(self) -> RedisConfig:
        """The ``redis`` mapping as a validated RedisConfig (validated once already at load)."""
        return parse_params(RedisConfig, self.redis, where="redis")

    def validate(self) -> None:
        if self.store not in STORES:
            raise ValueError(f"store: expected one of {list(STORES)}, got {self.store!r}")
        parse_params(RedisConfig, self.redis, where="redis")
        for name in ("block_size", "backend_capacity_blocks", "max_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive integer")
        if self.chars_per_token <= 0:
            raise ValueError("chars_per_token: expected a positive number")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction: expected one of {sorted(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.ttl_s <= 0:
            raise ValueError("ttl_s: expected a positive number")
        if not 0 < self.closed_loop_tolerance <= 1:
            raise ValueError("closed_loop_tolerance: expected a number in (0, 1]")
        if self.mode not in INDEX_MODES:
            raise ValueError(f"mode: expected one of {list(INDEX_MODES)}, got {self.mode!r}")
        parse_params(EventsConfig, self.events, where="events")
        if self.mode == "events":
            parse_params(TokenizerConfig, self.tokenizer, where="tokenizer")
            if self.store != "memory":
                raise ValueError("store: mode events keeps its index in memory (each replica subscribes)")


@dataclass(frozen=True)
class TenancyConfig:
    #: Header naming the tenant (set by a trusted gateway in front of kvroute).
    header: str = "x-kvroute-tenant"
    #: Without that header, derive the tenant from a hash of the request's bearer API key.
    from_api_key: bool = True


@dataclass(frozen=True)
class LimitsConfig:
    #: Largest accepted request body; larger ones get 413.
    max_body_bytes: int = 32 * 1024 * 1024
    #: Longest request line, longest header field, and most header fields (beyond: 400).
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 128
    #: Rate limits and concurrency cap of every tenant without its own entry (router/http/ratelimit.py).
    tenant_default: dict = field(default_factory=dict)
    #: Per-tenant overrides: tenant name -> the same keys as ``tenant_default``.
    tenants: dict = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("max_body_bytes", "max_line_size", "max_field_size", "max_headers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive integer")
        parse_params(TenantLimits, self.tenant_default, where="tenant_default")
        for tenant, limits in self.tenants.items():
            if not isinstance(limits, Mapping):
                raise ValueError(f"tenants.{tenant}: expected a mapping of limits")
            parse_params(TenantLimits, limits, where=f"tenants.{tenant}")


@dataclass(frozen=True)
class UpstreamConfig:
    connect_timeout_s: float = 5.0
    #: Idle stream: longest silence from a backend between two chunks, once it began sending.
    read_timeout_s: float = 600.0
    #: Longest wait from sending a request to the response's first body byte (queue + prefill;
    #: for a non-streamed request, the whole generation).
    first_byte_timeout_s: float = 300.0
    #: Backends tried for one request when the chosen one fails before sending anything.
    max_attempts: int = 2
    #: Total time to get a first byte, over all attempts: no attempt starts after it, and an
    #: attempt's first-byte wait is cut short at it.
    retry_deadline_s: float = 600.0
    #: An idle keep-alive connection to a backend is reused only this long, kept under the
    #: engines' own keep-alive timeout (uvicorn's 5 s, which vLLM and SGLang serve with), so the
    #: router does not send a request on a connection the engine is closing at that moment.
    keepalive_s: float = 4.0

    def validate(self) -> None:
        timeouts = ("connect_timeout_s", "read_timeout_s", "first_byte_timeout_s", "retry_deadline_s")
        for name in (*timeouts, "keepalive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number")
        if self.max_attempts < 1:
            raise ValueError("max_attempts: expected an integer >= 1")


@dataclass(frozen=True)
class HealthConfig:
    #: Seconds between active ``GET /health`` checks of each backend.
    interval_s: float = 5.0
    timeout_s: float = 2.0
    #: Consecutive failed checks before a backend leaves rotation (one success brings it back).
    unhealthy_after: int = 2
    #: Seconds between refreshes of ``/v1/models`` for backends without configured models.
    models_refresh_s: float = 30.0
    #: Passive ejection: consecutive failed requests (connection error, timeout, 5xx; never a
    #: 4xx) that take a backend out of rotation, for ``eject_s`` at first, doubling on each
    #: failed re-admission trial up to ``max_eject_s`` (see router/fleet/circuit.py).
    eject_after: int = 5
    eject_s: float = 10.0
    max_eject_s: float = 300.0

    def validate(self) -> None:
        for name in ("interval_s", "timeout_s", "models_refresh_s", "eject_s", "max_eject_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number")
        if self.unhealthy_after < 1:
            raise ValueError("unhealthy_after: expected an integer >= 1")
        if self.eject_after < 1:
            raise ValueError("eject_after: expected an integer >= 1")
        if self.max_eject_s < self.eject_s:
            raise ValueError("max_eject_s: expected at least eject_s")


@dataclass(frozen=True)
class EngineMetricsConfig:
    """``engine_metrics``: scraping each engine's ``/metrics`` for its queue and KV usage."""

    enabled: bool = True
    interval_s: float = 0.5
    timeout_s: float = 1.0
    #: A scrape older than this is not shown to the policies (they see None, not old numbers).
    stale_after_s: float = 2.0

    def validate(self) -> None:
        for name in ("interval_s", "timeout_s", "stale_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number")
        if self.stale_after_s <= self.interval_s:
            raise ValueError("stale_after_s: expected more than interval_s")


@dataclass(frozen=True)
class DiscoveredBackend:
    """What every discovered endpoint becomes: ``scheme://address:port`` of this engine kind."""

    port: int = 8000
    scheme: str = "http"
    engine: str = "vllm"
    #: Models served; when absent they are read from each backend's ``/v1/models``.
    models: list[str] | None = None
    capacity_blocks: int | None = None

    def validate(self) -> None:
        if not 0 < self.port <= 65535:
            raise ValueError("port: expected an integer in [1, 65535]")
        if self.scheme not in ("http", "https"):
            raise ValueError(f"scheme: expected http or https, got {self.scheme!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {list(ENGINES)}, got {self.engine!r}")
        if self.models is not None and not all(self.models):
            raise ValueError("models: expected a list of non-empty model names")
        if self.capacity_blocks is not None and self.capacity_blocks <= 0:
            raise ValueError("capacity_blocks: expected a positive integer")


@dataclass(frozen=True)
class DnsDiscoveryConfig(DiscoveredBackend):
    """``discovery.dns``: the A records of a name (a Kubernetes headless Service), re-resolved."""

    name: str = ""
    interval_s: float = 10.0
    #: Resolvers to ask; empty uses the system's (/etc/resolv.conf).
    nameservers: list[str] = field(default_factory=list)
    nameserver_port: int = 53
    timeout_s: float = 2.0

    def validate(self) -> None:
        super().validate()
        if not self.name:
            raise ValueError("name: expected the DNS name to resolve")
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("interval_s/timeout_s: expected positive numbers")
        if not 0 < self.nameserver_port <= 65535:
            raise ValueError("nameserver_port: expected an integer in [1, 65535]")
        for server in self.nameservers:
            try:
                ipaddress.ip_address(server)
            except ValueError:
                raise ValueError(f"nameservers: expected IP addresses, got {server!r}") from None


_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class KubernetesDiscoveryConfig(DiscoveredBackend):
    """``discovery.kubernetes``: EndpointSlices matching a label selector, watched."""

    label_selector: str = ""
    #: Namespace to watch; empty reads the pod's own (``namespace_file``).
    namespace: str = ""
    #: The EndpointSlice port to use, by name; empty uses ``port``.
    port_name: str = ""
    #: API server; empty uses the in-cluster one (KUBERNETES_SERVICE_HOST/PORT).
    api_url: str = ""
    token_file: str = f"{_SERVICE_ACCOUNT}/token"
    ca_file: str = f"{_SERVICE_ACCOUNT}/ca.crt"
    namespace_file: str = f"{_SERVICE_ACCOUNT}/namespace"
    #: Server-side bound of one watch call, after which it is re-opened from the last version.
    watch_timeout_s: int = 300
    #: Wait before re-listing after the API server failed or the watch expired.
    retry_s: float = 2.0

    def validate(self) -> None:
        super().validate()
        if not self.label_selector:
            raise ValueError("label_selector: expected a selector such as app=vllm")
        if self.api_url and urlsplit(self.api_url).scheme not in ("http", "https"):
            raise ValueError(f"api_url: expected an http:// or https:// URL, got {self.api_url!r}")
        if self.watch_timeout_s < 1 or self.retry_s <= 0:
            raise ValueError("watch_timeout_s/retry_s: expected positive numbers")


@dataclass(frozen=True)
class DiscoveryConfig:
    """``discovery``: where backends come from besides the static ``backends`` list."""

    kind: str = "static"
    dns: dict = field(default_factory=dict)
    kubernetes: dict = field(default_factory=dict)

    @property
    def dns_config(self) -> DnsDiscoveryConfig:
        return parse_params(DnsDiscoveryConfig, self.dns, where="dns")

    @property
    def kubernetes_config(self) -> KubernetesDiscoveryConfig:
        return parse_params(KubernetesDiscoveryConfig, self.kubernetes, where="kubernetes")

    def validate(self) -> None:
        if self.kind not in DISCOVERY_KINDS:
            raise ValueError(f"kind: expected one of {list(DISCOVERY_KINDS)}, got {self.kind!r}")
        if self.kind == "dns":
            parse_params(DnsDiscoveryConfig, self.dns, where="dns")
        if self.kind == "kubernetes":
            parse_params(KubernetesDiscoveryConfig, self.kubernetes, where="kubernetes")


@dataclass(frozen=True)
class AuthConfig:
    """``auth``: client API keys, each mapped to its tenant (router/http/auth.py).

    Keys come from ``keys`` (tenant -> key or list of keys), ``keys_file`` (a YAML file of the
    same mapping) and ``keys_dir`` (a mounted Kubernetes Secret: one file per tenant, named by
    it, holding its keys one per line), all merged. With any key configured, every API request
    needs ``Authorization: Bearer <key>`` and its tenant is the key's.
    """

    keys: dict = field(default_factory=dict, repr=False)
    keys_file: str | None = None
    keys_dir: str | None = None
    #: With keys configured, still take the tenant from ``tenancy.header`` when present: only
    #: for a trusted gateway in front that sets it (clients could otherwise pick any tenant).
    trust_tenant_header: bool = False

    def validate(self) -> None:
        from router.http.auth import load_keys

        load_keys(self)


@dataclass(frozen=True)
class AdminConfig:
    """``admin``: who may call the admin API (drain, reload, debug views), and where it listens."""

    #: The admin key, inline, from an environment variable, or from a file (at most one). Without
    #: one the admin API is open to whoever reaches it: bind it to a private ``listen`` then.
    key: str | None = field(default=None, repr=False)
    key_env: str | None = None
    key_file: str | None = None
    #: ``{host, port}`` to serve the admin API on its own listener (and not on the main one).
    listen: dict | None = None

    @property
    def listen_config(self) -> ListenConfig | None:
        return None if self.listen is None else parse_params(ListenConfig, self.listen, where="listen")

    def admin_key(self) -> str | None:
        """The configured admin key, read from its source now (None: the admin API is open)."""
        if self.key_env is not None:
            return os.environ.get(self.key_env) or None
        if self.key_file is not None:
            return Path(self.key_file).read_text(encoding="utf-8").strip() or None
        return self.key

    def validate(self) -> None:
        if sum(x is not None for x in (self.key, self.key_env, self.key_file)) > 1:
            raise ValueError("key: give at most one of key, key_env, key_file")
        if self.key_env is not None and not os.environ.get(self.key_env):
            raise ValueError(f"key_env: environment variable {self.key_env} is not set or empty")
        if self.key_file is not None:
            try:
                if not Path(self.key_file).read_text(encoding="utf-8").strip():
                    raise ValueError(f"key_file: {self.key_file} is empty")
            except OSError as exc:
                raise ValueError(f"key_file: cannot read {self.key_file}: {exc.strerror}") from None
        if self.key is not None and not self.key:
            raise ValueError("key: expected a non-empty string")
        if self.listen is not None:
            parse_params(ListenConfig, self.listen, where="listen")


@dataclass(frozen=True)
class Config:
    listen: ListenConfig
    backends: tuple[BackendConfig, ...]
    routing: RoutingConfig
    index: IndexConfig
    tenancy: TenancyConfig
    limits: LimitsConfig
    upstream: UpstreamConfig
    health: HealthConfig
    engine_metrics: EngineMetricsConfig = field(default_factory=EngineMetricsConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    log_level: str = "info"


_SECTIONS = {
    "listen": ListenConfig,
    "routing": RoutingConfig,
    "index": IndexConfig,
    "tenancy": TenancyConfig,
    "limits": LimitsConfig,
    "upstream": UpstreamConfig,
    "health": HealthConfig,
    "engine_metrics": EngineMetricsConfig,
    "discovery": DiscoveryConfig,
    "auth": AuthConfig,
    "admin": AdminConfig,
}
_LOG_LEVELS = ("debug", "info", "warning", "error")


def _section(raw: Mapping[str, Any], key: str, cls: type) -> Any:
    value = raw.get(key)
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    return parse_params(cls, value, where=key)


def _backends(raw: Any, discovered: bool) -> tuple[BackendConfig, ...]:
    """The static list; it may be empty (or absent) only when discovery supplies backends."""
    if discovered and raw is None:
        return ()
    if not isinstance(raw, list) or not (raw or discovered):
        raise ConfigError("backends: expected a non-empty list of {name, url, engine}")
    backends = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise ConfigError(f"backends[{i}]: expected a mapping with name and url")
        backends.append(parse_params(BackendConfig, item, where=f"backends[{i}]"))
    names = [b.name for b in backends]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"backends: duplicate backend name {duplicate!r}")
    return tuple(backends)


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    """Validate a parsed YAML document and build the Config, or raise ConfigError."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    known = {*_SECTIONS, "backends", "log_level"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key; expected one of {sorted(known)}")
    try:
        sections = {key: _section(raw, key, cls) for key, cls in _SECTIONS.items()}
        backends = _backends(raw.get("backends"), sections["discovery"].kind != "static")
    except ParamError as exc:
        raise ConfigError(str(exc)) from None
    log_level = raw.get("log_level", "info")
    if log_level not in _LOG_LEVELS:
        raise ConfigError(f"log_level: expected one of {list(_LOG_LEVELS)}, got {log_level!r}")
    routing: RoutingConfig = sections["routing"]
    try:
        build_policy(routing.policy, routing.params, seed=routing.seed)
    except PolicyLoadError as exc:
        raise ConfigError(str(exc)) from None
    return Config(backends=backends, log_level=log_level, **sections)


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return config_from_dict(raw if raw is not None else {})
