"""Settings of the HTTP surface: ``listen`` (and ``admin.listen``), ``limits``, ``auth``, ``admin``,
``logging``.

Each section's type lives beside the code that reads it, at the bottom of the wing: it
imports nothing of ``router`` above it, so ``router.config`` assembles it without importing
the HTTP code (validating the config once reached up into ``auth.py`` for its key files).
Ranges are declared on the fields (``policies.params``); rules tying fields together, and
reading the key files, are in ``validate``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import UNSET, UnsetType

from policies.params import NonEmptyStr, NonNegativeFloat, PositiveFloat, PositiveInt

#: One tenant's client keys: a key, or a list of keys.
TenantKeys = Annotated[str | list[str], msgspec.Meta(extra={"expected": "a key or a list of keys"})]
#: 0 takes any free port (tests, ``kvroute demo``).
ListenPort = Annotated[int, msgspec.Meta(ge=0, le=65535)]


@dataclass(frozen=True)
class TLSConfig:
    """``listen.tls``: serve HTTPS with this certificate; mutual TLS when ``client_ca`` is given.

    The files are read at start and again on every reload (SIGHUP, ``POST /admin/reload``), so
    a certificate rotated in place (cert-manager, a mounted Secret) is served from the next
    handshake on (router/http/tls.py).
    """

    #: PEM certificate chain, the server's certificate first.
    cert: NonEmptyStr
    #: PEM private key of that certificate (unencrypted).
    key: NonEmptyStr
    #: PEM bundle of the CAs whose client certificates are accepted; given: every client must
    #: present one (mutual TLS), else the handshake fails.
    client_ca: NonEmptyStr | None = None

    def validate(self) -> list[str]:
        try:
            server_context(self)
        except ValueError as exc:
            return [str(exc)]
        return []


def server_context(tls: TLSConfig) -> ssl.SSLContext:
    """A server-side SSLContext from ``tls``'s files; ValueError naming the key whose file does not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"cert: cannot load the certificate {tls.cert} with the key {tls.key}: {_reason(exc)}"
        ) from None
    if tls.client_ca is not None:
        try:
            context.load_verify_locations(cafile=tls.client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"client_ca: cannot load {tls.client_ca}: {_reason(exc)}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _reason(exc: OSError) -> str:
    """What went wrong, in OpenSSL's words when it has some ("PEM lib" says only where)."""
    if isinstance(exc, ssl.SSLError):
        return f"not a PEM file of the expected kind, or the key does not match ({exc.reason or exc})"
    return exc.strerror or str(exc)


@dataclass(frozen=True)
class ListenConfig:
    """``listen`` (and ``admin.listen``): where the router accepts connections, and on what terms.

    The timeouts and caps protect the router from slow and idle clients (router/http/connections.py):
    nginx's ``client_header_timeout``, ``client_body_timeout``, ``keepalive_timeout`` and
    ``limit_conn``, at the connection level.
    """

    #: Address to listen on (0.0.0.0: every interface).
    host: str = "127.0.0.1"
    #: Port to listen on; 0 picks a free one (printed at start).
    port: ListenPort = 8080
    #: On SIGTERM: stop accepting, then give in-flight responses this long before exiting anyway.
    drain_timeout_s: NonNegativeFloat = 60.0
    #: HTTPS on this listener (null: plain HTTP).
    tls: TLSConfig | None = None
    #: A request's head (request line and headers) must arrive whole within this long of its first
    #: byte (of the connection, for its first request); else the connection is closed. Also bounds
    #: a TLS handshake.
    header_timeout_s: PositiveFloat = 30.0
    #: A request's body must make progress (some bytes) at least this often until it is whole.
    body_timeout_s: PositiveFloat = 30.0
    #: A kept-alive connection with no request for this long is closed. Keep it above the idle
    #: timeout of any HTTP load balancer in front (AWS ALB: 60 s), or it races the LB's reuse.
    idle_timeout_s: PositiveFloat = 75.0
    #: Open client connections per process on this listener; beyond it a new connection is closed
    #: at once. null: derived from the process's file-descriptor limit (half of it, less a reserve,
    #: leaving a descriptor for each connection's upstream one; ``kvroute serve`` raises its soft
    #: limit to the hard one at start).
    max_connections: PositiveInt | None = None
    #: Open connections per client IP address (null: no cap). Behind a proxy or load balancer every
    #: client shares its address: cap there, or set this above the proxy's own connection count.
    max_connections_per_client: PositiveInt | None = None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


@dataclass(frozen=True)
class LoggingConfig:
    """``logging``: the shape of the router's log lines and its access log (router/http/logs.py)."""

    #: ``text``: one human-readable line per record; ``json``: one JSON object per line, for
    #: log pipelines (Loki, Elasticsearch, Cloud Logging). Applied at start.
    format: Literal["text", "json"] = "text"
    #: One line per request (logger ``kvroute.access``): id, tenant, model, backend, reason,
    #: status, prompt tokens, cached tokens reported, TTFT and duration. Follows reloads.
    access_log: bool = False


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits (router/http/ratelimit.py); null means unlimited."""

    #: Sustained requests per second (the request bucket's refill rate).
    requests_per_s: PositiveFloat | None = None
    #: Requests admitted back to back after a quiet spell; default max(1, requests_per_s).
    request_burst: PositiveFloat | None = None
    #: Sustained prompt tokens per second (estimated from characters).
    prompt_tokens_per_s: PositiveFloat | None = None
    #: Prompt tokens admitted back to back; default one second's worth.
    prompt_token_burst: PositiveFloat | None = None
    #: Requests of the tenant in flight at once (a stream counts until it ends).
    max_concurrent: PositiveInt | None = None

    @property
    def unlimited(self) -> bool:
        return (
            self.requests_per_s is None and self.prompt_tokens_per_s is None and self.max_concurrent is None
        )


@dataclass(frozen=True)
class TenantOverride:
    """``limits.tenants.<name>``: the keys of TenantLimits this tenant has its own value for.

    A key left out keeps ``tenant_default``'s value, a key given as null is unlimited: the two
    differ, so a left-out key is ``UNSET`` (msgspec's marker for it), not None.
    """

    requests_per_s: PositiveFloat | UnsetType | None = UNSET
    request_burst: PositiveFloat | UnsetType | None = UNSET
    prompt_tokens_per_s: PositiveFloat | UnsetType | None = UNSET
    prompt_token_burst: PositiveFloat | UnsetType | None = UNSET
    max_concurrent: PositiveInt | UnsetType | None = UNSET

    def over(self, default: TenantLimits) -> TenantLimits:
        """``default`` with this tenant's own values in place."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(default, **{k: v for k, v in given.items() if v is not UNSET})


@dataclass(frozen=True)
class LimitsConfig:
    """``limits``: request sizes (fixed in the HTTP server) and per-tenant rates and caps."""

    #: Largest accepted request body; larger ones get 413.
    max_body_bytes: PositiveInt = 32 * 1024 * 1024
    #: Longest request line, longest header field, and most header fields (beyond: 400).
    max_line_size: PositiveInt = 8190
    max_field_size: PositiveInt = 8190
    max_headers: PositiveInt = 128
    #: Rate limits and concurrency cap of every tenant without its own entry (router/http/ratelimit.py).
    tenant_default: TenantLimits = field(default_factory=TenantLimits)
    #: Per-tenant overrides: tenant name -> the keys of ``tenant_default`` that differ.
    tenants: dict[str, TenantOverride] = field(default_factory=dict)

    def tenant_limits(self) -> dict[str, TenantLimits]:
        """Each named tenant's limits: its overrides merged key by key over ``tenant_default``."""
        return {name: override.over(self.tenant_default) for name, override in self.tenants.items()}


@dataclass(frozen=True)
class AuthConfig:
    """``auth``: client API keys, each mapped to its tenant (router/http/auth.py).

    Keys come from ``keys`` (tenant -> key or list of keys), ``keys_file`` (a YAML file of the
    same mapping) and ``keys_dir`` (a mounted Kubernetes Secret: one file per tenant, named by
    it, holding its keys one per line), all merged. With any key configured, every API request
    needs ``Authorization: Bearer <key>`` and its tenant is the key's. The files are read when
    the config is validated (at start and on each reload) and again when the keys are applied.
    """

    #: Tenant name -> its key, or a list of its keys.
    keys: dict[str, TenantKeys] = field(default_factory=dict, repr=False)
    #: A YAML file of the same mapping.
    keys_file: str | None = None
    #: A directory of one file per tenant (a mounted Secret), holding its keys one per line.
    keys_dir: str | None = None
    #: With keys configured, still take the tenant from ``tenancy.header`` when present: only
    #: for a trusted gateway in front that sets it (clients could otherwise pick any tenant).
    trust_tenant_header: bool = False

    def validate(self) -> list[str]:
        try:
            self.tenant_keys()
        except ValueError as exc:
            return [str(exc)]
        return []

    def tenant_keys(self) -> dict[str, list[str]]:
        """Every configured key by its tenant, from all sources; ValueError naming the fault."""
        sources: list[tuple[str, Mapping[Any, Any]]] = [("keys", self.keys)]
        if self.keys_file is not None:
            try:
                raw = yaml.safe_load(Path(self.keys_file).read_text(encoding="utf-8"))
            except OSError as exc:
                raise ValueError(f"keys_file: cannot read {self.keys_file}: {exc.strerror}") from None
            except yaml.YAMLError as exc:
                raise ValueError(f"keys_file: {self.keys_file} is not valid YAML: {exc}") from None
            if not isinstance(raw, Mapping):
                raise ValueError(f"keys_file: {self.keys_file} must map each tenant to its key(s)")
            sources.append((f"keys_file {self.keys_file}", raw))
        if self.keys_dir is not None:
            try:
                sources.append((f"keys_dir {self.keys_dir}", _read_keys_dir(Path(self.keys_dir))))
            except OSError as exc:
                raise ValueError(f"keys_dir: cannot read {self.keys_dir}: {exc.strerror}") from None
        tenants: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        for where, mapping in sources:
            for tenant, value in mapping.items():
                if not isinstance(tenant, str) or not tenant:
                    raise ValueError(f"{where}: tenant names must be non-empty strings, got {tenant!r}")
                for key in _keys_of(tenant, value, where):
                    if owner.setdefault(key, tenant) != tenant:
                        raise ValueError(
                            f"{where}: one key is given to two tenants ({owner[key]!r}, {tenant!r})"
                        )
                    tenants.setdefault(tenant, []).append(key)
        return tenants


def _keys_of(tenant: str, value: Any, where: str) -> list[str]:
    keys = [value] if isinstance(value, str) else value
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
        raise ValueError(f"{where}: expected a key or a list of keys for tenant {tenant!r}")
    return [k.strip() for k in keys]


def _read_keys_dir(path: Path) -> dict[str, list[str]]:
    """A mounted Secret: one file per tenant. Kubernetes' own ``..data`` links and dirs are skipped."""
    found: dict[str, list[str]] = {}
    for entry in sorted(path.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        keys = [line.strip() for line in entry.read_text(encoding="utf-8").splitlines() if line.strip()]
        found[entry.name] = _keys_of(entry.name, keys, f"keys_dir {path}/{entry.name}")
    return found


#: Where the admin API listens by default: loopback only, reachable with ``kubectl port-forward``.
DEFAULT_ADMIN_LISTEN = ListenConfig(host="127.0.0.1", port=8081)


@dataclass(frozen=True)
class AdminConfig:
    """``admin``: who may call the admin API (drain, reload, debug views), and where it listens.

    Safe by default: the admin API has a listener of its own on loopback (127.0.0.1:8081), never
    the main one. Without an admin key it may only listen on loopback; with a key it may listen
    anywhere, or share the main listener (``listen: null``).
    """

    #: The admin key, inline, from an environment variable, or from a file (at most one).
    key: NonEmptyStr | None = field(default=None, repr=False)
    #: ... or the name of an environment variable holding it.
    key_env: str | None = None
    #: ... or a file holding it (at most one of ``key``, ``key_env``, ``key_file``).
    key_file: str | None = None
    #: The admin API's own listener; null serves it on the main listener (needs a key).
    listen: ListenConfig | None = DEFAULT_ADMIN_LISTEN

    def admin_key(self) -> str | None:
        """The configured admin key, read from its source now (None: the admin API is open)."""
        if self.key_env is not None:
            return os.environ.get(self.key_env) or None
        if self.key_file is not None:
            return Path(self.key_file).read_text(encoding="utf-8").strip() or None
        return self.key

    @property
    def keyed(self) -> bool:
        """Whether a key is configured (its source is checked by ``validate``)."""
        return any(x is not None for x in (self.key, self.key_env, self.key_file))

    def validate(self) -> list[str]:
        if sum(x is not None for x in (self.key, self.key_env, self.key_file)) > 1:
            return ["key: give at most one of key, key_env, key_file"]
        if self.key_env is not None and not os.environ.get(self.key_env):
            return [f"key_env: environment variable {self.key_env} is not set or empty"]
        if self.key_file is not None:
            try:
                if not Path(self.key_file).read_text(encoding="utf-8").strip():
                    return [f"key_file: {self.key_file} is empty"]
            except OSError as exc:
                return [f"key_file: cannot read {self.key_file}: {exc.strerror}"]
        return self.exposure_refused()

    def exposure_refused(self) -> list[str]:
        """Why this admin API would be open to the network, or nothing: no key, no public listener."""
        if self.keyed:
            return []
        if self.listen is None:
            return [
                "listen: null serves the admin API on the main listener, which needs an admin key "
                "(key, key_env or key_file); without one it listens on loopback only (the default)"
            ]
        if not is_loopback(self.listen.host):
            return [
                f"listen.host: {self.listen.host!r} is not a loopback address; without an admin key "
                "(key, key_env or key_file) the admin API listens on loopback only (127.0.0.1)"
            ]
        return []


@dataclass(frozen=True)
class MetricsConfig:
    """``metrics``: where Prometheus scrapes ``/metrics``."""

    #: ``{host, port}`` to serve ``/metrics`` on its own listener (and not on the main one): the
    #: metrics then stay off the port clients reach. With ``serve --workers N`` every worker binds
    #: it (SO_REUSEPORT), and whichever answers reports the whole group (router/http/worker_metrics.py).
    listen: ListenConfig | None = None
