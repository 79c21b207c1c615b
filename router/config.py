"""The YAML configuration: parsed into typed sections and validated completely at start.

Every section is a frozen dataclass whose fields are the accepted keys with their defaults
(``config.example.yaml`` documents each one). Validation errors name the key by its path,
``backends[1].url``, and say what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from policies.params import ParamError, parse_params
from policies.routing import PolicyLoadError, build_policy

ENGINES = ("vllm", "sglang")
STORES = ("memory", "redis")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and what was expected."""


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 8080

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port: expected an integer in [0, 65535]")


@dataclass(frozen=True)
class BackendConfig:
    name: str
    url: str
    engine: str = "vllm"
    #: Models served; when absent they are read from the backend's ``/v1/models``.
    models: list[str] | None = None
    #: Believed KV capacity in prefix blocks; defaults to ``index.backend_capacity_blocks``.
    capacity_blocks: int | None = None

    def validate(self) -> None:
        if not self.name:
            raise ValueError("name: expected a non-empty string")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url: expected an http:// or https:// URL, got {self.url!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {list(ENGINES)}, got {self.engine!r}")
        if self.models is not None and not all(self.models):
            raise ValueError("models: expected a list of non-empty model names")
        if self.capacity_blocks is not None and self.capacity_blocks <= 0:
            raise ValueError("capacity_blocks: expected a positive integer")


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
    #: A backend's believed blocks expire this long after its last recorded request.
    ttl_s: float = 3600.0
    #: Deadline of one lookup on the request path; past it the request routes on the local view.
    timeout_ms: float = 5.0
    #: Deadline of the off-path calls (batched writes, load sync, probes).
    background_timeout_ms: float = 1000.0
    #: Consecutive lookup timeouts that mark Redis as down (a connection error does at once).
    trip_after: int = 3
    #: While Redis is down, how often to probe it (the router returns to shared state by itself).
    retry_interval_s: float = 0.5
    #: Pending index updates held for the writer; beyond it updates are dropped and counted.
    write_queue_size: int = 10000
    #: Updates sent to Redis in one script call.
    write_batch_size: int = 64
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
        for name in ("ttl_s", "timeout_ms", "background_timeout_ms", "retry_interval_s", "load_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number")
        if self.load_ttl_s <= self.load_interval_s:
            raise ValueError("load_ttl_s: expected more than load_interval_s")
        for name in ("trip_after", "write_queue_size", "write_batch_size"):
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

    def validate(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes: expected a positive integer")


@dataclass(frozen=True)
class UpstreamConfig:
    connect_timeout_s: float = 5.0
    #: Longest silence from a backend while waiting for or reading a response.
    read_timeout_s: float = 600.0
    #: Backends tried for one request when the chosen one fails before sending anything.
    max_attempts: int = 2

    def validate(self) -> None:
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("connect_timeout_s/read_timeout_s: expected positive numbers")
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

    def validate(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.models_refresh_s <= 0:
            raise ValueError("interval_s/timeout_s/models_refresh_s: expected positive numbers")
        if self.unhealthy_after < 1:
            raise ValueError("unhealthy_after: expected an integer >= 1")


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
    log_level: str = "info"


_SECTIONS = {
    "listen": ListenConfig,
    "routing": RoutingConfig,
    "index": IndexConfig,
    "tenancy": TenancyConfig,
    "limits": LimitsConfig,
    "upstream": UpstreamConfig,
    "health": HealthConfig,
}
_LOG_LEVELS = ("debug", "info", "warning", "error")


def _section(raw: Mapping[str, Any], key: str, cls: type) -> Any:
    value = raw.get(key)
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    return parse_params(cls, value, where=key)


def _backends(raw: Any) -> tuple[BackendConfig, ...]:
    if not isinstance(raw, list) or not raw:
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
        backends = _backends(raw.get("backends"))
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
