"""The YAML configuration: every section parsed into its type once, at load, and validated whole.

Each section's type lives beside the code that owns it, in its wing's ``settings`` module
(``router/http/settings.py``, ``router/request_path/settings.py``, ``router/fleet/settings.py``,
``router/index/settings.py``, ``router/kv_events/settings.py``, ``router/redis/settings.py``);
this module only assembles them into the document (:class:`ConfigFile`), reads the YAML, and
builds what is built once per load: the routing policy (:attr:`Config.policy`).

Validation is ``policies.params.parse_params`` over the whole document: every mistake in the
file is reported, not only the first, one per line, each named by its path and saying what
was expected (``backends[1].url: expected an http:// or https:// URL, got 'ftp://x'``). The
same types give the config's JSON Schema (``kvroute config schema``, ``docs/config.schema.json``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from policies.params import ParamError, parse_params
from policies.routing import PolicyLoadError, build_policy
from policies.routing.base import RoutingPolicy
from router.fleet.settings import BackendConfig, DiscoveryConfig, EngineMetricsConfig, HealthConfig
from router.http.settings import (
    AdminConfig,
    AuthConfig,
    LimitsConfig,
    ListenConfig,
    LoggingConfig,
    MetricsConfig,
)
from router.index.settings import IndexConfig
from router.request_path.settings import (
    DisaggregationConfig,
    RoutingConfig,
    TenancyConfig,
    TracingConfig,
    UpstreamConfig,
)

LogLevel = Literal["debug", "info", "warning", "error"]


class ConfigError(ValueError):
    """The configuration is invalid: one message per line, each naming its key and what was
    expected. ``errors`` holds the messages."""

    def __init__(self, errors: str | Sequence[str]) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


@dataclass(frozen=True)
class ConfigFile:
    """The YAML document: every section, typed (what ``config.example.yaml`` documents and the
    JSON Schema describes). A section left out, or left empty, has its defaults."""

    listen: ListenConfig = field(default_factory=ListenConfig)
    #: The engines; may be empty (or absent) only when ``discovery`` supplies them.
    backends: tuple[BackendConfig, ...] = ()
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    engine_metrics: EngineMetricsConfig = field(default_factory=EngineMetricsConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    #: The router's log level: debug | info | warning | error.
    log_level: LogLevel = "info"
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def validate(self) -> list[str]:
        if not self.backends and self.discovery.kind == "static":
            return ["backends: expected a non-empty list of {name, url, engine}"]
        names = [b.name for b in self.backends]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            return [f"backends: duplicate backend name {duplicate!r}"]
        return []


@dataclass(frozen=True)
class Config(ConfigFile):
    """A loaded config: the document, and the routing policies built from it at load.

    The policies are built once per load (start or reload) and used by the app and the reload
    alike; they are no part of the document, so they are left out of comparisons and the repr.
    """

    policy: RoutingPolicy = field(kw_only=True, compare=False, repr=False)
    #: Chooses the decode engine of a prefill/decode pair (``disaggregation.decode_routing``).
    decode_policy: RoutingPolicy = field(kw_only=True, compare=False, repr=False)

    def document(self) -> ConfigFile:
        """The document alone, without the policy built from it."""
        return ConfigFile(**_sections(self))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (to each ``serve --workers`` process), a config carries its document only and
        builds its policy anew on arrival: every process draws its own seed when ``routing.seed``
        is null, as it would have started alone, and a user's policy need not pickle."""
        return (_with_policy, (self.document(),))


def _sections(document: ConfigFile) -> dict[str, Any]:
    return {f.name: getattr(document, f.name) for f in dataclasses.fields(ConfigFile)}


def _with_policy(document: ConfigFile) -> Config:
    """``document`` with its routing policies built (a validated document builds without error)."""
    routing = document.routing
    return Config(
        **_sections(document),
        policy=build_policy(routing.policy, routing.params, seed=routing.seed),
        decode_policy=_decode_policy(document),
    )


def _decode_policy(document: ConfigFile) -> RoutingPolicy:
    """The decode side's policy; seeded from ``routing.seed`` (its own stream, not the same draws)."""
    decode = document.disaggregation.decode_routing
    seed = document.routing.seed
    try:
        return build_policy(decode.policy, decode.params, seed=None if seed is None else seed + 1)
    except PolicyLoadError as exc:
        raise PolicyLoadError(str(exc).replace("routing.", "disaggregation.decode_routing.")) from None


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    """Validate a parsed YAML document and build the Config (and its policy), or raise
    ConfigError listing every mistake found."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    if "backends" in raw and raw["backends"] is None:
        # ``backends:`` left empty reads as null: no static backends, as when the key is absent
        # (allowed with discovery; refused with the usual message otherwise).
        raw = {key: value for key, value in raw.items() if key != "backends"}
    errors: list[str] = []
    try:
        document: ConfigFile | None = parse_params(ConfigFile, raw, where="")
    except ParamError as exc:
        document, errors = None, exc.errors
    routing = document.routing if document is not None else _valid_routing(raw, errors)
    policy = decode_policy = None
    if routing is not None:
        try:
            policy = build_policy(routing.policy, routing.params, seed=routing.seed)
        except PolicyLoadError as exc:
            errors = [*errors, *str(exc).splitlines()]
    if document is not None:
        try:
            decode_policy = _decode_policy(document)
        except PolicyLoadError as exc:
            errors = [*errors, *str(exc).splitlines()]
    if errors:
        raise ConfigError(errors)
    assert document is not None and policy is not None and decode_policy is not None
    return Config(**_sections(document), policy=policy, decode_policy=decode_policy)


def _valid_routing(raw: Mapping[str, Any], errors: list[str]) -> RoutingConfig | None:
    """``routing`` as given, when the rest of the document failed but no error is in it: so its
    policy's own mistakes are reported with the others."""
    if any(e.startswith(("routing.", "routing:")) for e in errors):
        return None
    return RoutingConfig(**(raw.get("routing") or {}))


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML file."""
    return ConfigSource(str(path)).load()


@dataclass(frozen=True)
class ConfigSource:
    """Where the running config comes from, so that a reload (SIGHUP, ``POST /admin/reload``)
    reads it the same way as the start did: a YAML file, settings given on the command line
    on top of it (``kvroute serve --backend ... --policy ...``: flags win), or flags alone.

    ``overrides`` is a partial document merged into the file's, section by section: a mapping
    merges key by key, anything else (``backends``, a list) replaces the file's value. A policy
    named by an override drops the file's ``routing.params`` when the file names another policy,
    since parameters belong to the policy they were written for.
    """

    path: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> Config:
        """The validated config; ConfigError naming the file (and line) for anything wrong."""
        raw = _read_yaml(self.path) if self.path is not None else {}
        return config_from_dict(_overlaid(raw, self.overrides) if self.overrides else raw)

    def __str__(self) -> str:
        if self.path is None:
            return "the command line"
        return f"{self.path} and the command line" if self.overrides else self.path


def _read_yaml(path: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read config file {path}: not UTF-8 text ({exc.reason})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}:{_yaml_place(exc)} not valid YAML: {_yaml_problem(exc)}") from None
    return raw if raw is not None else {}


def _yaml_place(exc: yaml.YAMLError) -> str:
    """``line:column:`` of a YAML error (1-based, as editors count), when it has a place."""
    mark = getattr(exc, "problem_mark", None)
    return f"{mark.line + 1}:{mark.column + 1}:" if mark is not None else ""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's words without its excerpt of the file (the place is already given)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        return ": ".join(part for part in (exc.context, exc.problem) if part) or "syntax error"
    return str(exc)


def _overlaid(raw: Any, overrides: Mapping[str, Any]) -> Any:
    if not isinstance(raw, Mapping):
        return raw  # config_from_dict reports a document that is not a mapping
    merged = dict(raw)
    routing = raw.get("routing")
    policy = (
        overrides.get("routing", {}).get("policy") if isinstance(overrides.get("routing"), Mapping) else None
    )
    if policy is not None and isinstance(routing, Mapping) and routing.get("policy", policy) != policy:
        merged["routing"] = {key: value for key, value in routing.items() if key != "params"}
    for key, value in overrides.items():
        below = merged.get(key)
        merged[key] = (
            _overlaid(below, value) if isinstance(value, Mapping) and isinstance(below, Mapping) else value
        )
    return merged
