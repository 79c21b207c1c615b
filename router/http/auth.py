"""Who may call the router: client API keys mapped to tenants, the admin key, upstream credentials.

Client keys (``auth``) are optional. Without any, the router is open (as behind a gateway
that authenticates) and the tenant is ``tenancy.header`` or a hash of the bearer key, as
``router/request_path/request.py`` says. With keys, every request needs ``Authorization: Bearer <key>``
except ``/health``, ``/ready`` and ``/metrics`` (probes and Prometheus): deny by default.
A missing or unknown key gets 401 in the OpenAI shape. The tenant is the key's own: a
client-set ``tenancy.header`` is ignored (it would let a client pick another tenant's limits
and cache salt) unless ``auth.trust_tenant_header`` says a trusted gateway sets it.

Keys are never compared as strings: each configured key is kept as its SHA-256 digest, and a
presented key is digested and looked up by digest (the admin key: ``hmac.compare_digest`` of
digests). The time taken depends only on the digest of what the client sent, so it reveals
nothing about how close a guess is to a real key (a byte-by-byte string compare would), and
no plain key is kept in memory after loading.

The admin key guards ``/admin/`` (drain, reload, debug views); client keys never open it.
An engine's own credential (``backends[].api_key``) replaces the client's Authorization on
the way upstream; with client keys on, the client's key is never forwarded to an engine.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from aiohttp import web

from router.errors import OpenAIError
from router.request_path.request import TENANT

if TYPE_CHECKING:
    from router.config import AuthConfig, TenancyConfig

#: Paths that need the admin key (when one is set) instead of a client key.
ADMIN_PREFIX = "/admin/"
#: Paths open without any key: probes and Prometheus. Every other path needs a client key (when
#: keys are configured): deny by default, so a route added later is never open by accident.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _keys_of(tenant: str, value: Any, where: str) -> list[str]:
    keys = [value] if isinstance(value, str) else value
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
        raise ValueError(f"{where}: expected a key or a list of keys for tenant {tenant!r}")
    return [k.strip() for k in keys]


def _read_dir(path: Path) -> dict[str, list[str]]:
    """A mounted Secret: one file per tenant. Kubernetes' own ``..data`` links and dirs are skipped."""
    found: dict[str, list[str]] = {}
    for entry in sorted(path.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        keys = [line.strip() for line in entry.read_text(encoding="utf-8").splitlines() if line.strip()]
        found[entry.name] = _keys_of(entry.name, keys, f"keys_dir {path}/{entry.name}")
    return found


def load_keys(config: AuthConfig) -> dict[bytes, str]:
    """Every configured key's digest -> its tenant, from all sources; ValueError naming the fault."""
    sources: list[tuple[str, Mapping[str, Any]]] = [("keys", config.keys)]
    if config.keys_file is not None:
        try:
            raw = yaml.safe_load(Path(config.keys_file).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"keys_file: cannot read {config.keys_file}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"keys_file: {config.keys_file} is not valid YAML: {exc}") from None
        if not isinstance(raw, Mapping):
            raise ValueError(f"keys_file: {config.keys_file} must map each tenant to its key(s)")
        sources.append((f"keys_file {config.keys_file}", raw))
    if config.keys_dir is not None:
        try:
            sources.append((f"keys_dir {config.keys_dir}", _read_dir(Path(config.keys_dir))))
        except OSError as exc:
            raise ValueError(f"keys_dir: cannot read {config.keys_dir}: {exc.strerror}") from None
    table: dict[bytes, str] = {}
    for where, mapping in sources:
        for tenant, value in mapping.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"{where}: tenant names must be non-empty strings, got {tenant!r}")
            for key in _keys_of(tenant, value, where):
                digest = _digest(key)
                if table.get(digest, tenant) != tenant:
                    raise ValueError(
                        f"{where}: one key is given to two tenants ({table[digest]!r}, {tenant!r})"
                    )
                table[digest] = tenant
    return table


def bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class KeyStore:
    """The client keys in force; replaced whole on reload."""

    def __init__(self, config: AuthConfig, tenancy: TenancyConfig) -> None:
        self.configure(config, tenancy)

    def configure(self, config: AuthConfig, tenancy: TenancyConfig) -> None:
        self._table = load_keys(config)
        self._trust_header = config.trust_tenant_header
        self._tenant_header = tenancy.header

    @property
    def enabled(self) -> bool:
        return bool(self._table)

    def tenant_of(self, key: str) -> str | None:
        # A lookup by digest: its time depends on the digest of the guess, which a client cannot
        # steer towards a real key's digest, so it leaks nothing a string compare would.
        return self._table.get(_digest(key))

    def authenticate(self, request: web.Request) -> str:
        """The request's tenant, or a 401."""
        key = bearer(request)
        if key is None:
            raise OpenAIError(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                code="missing_api_key",
            )
        tenant = self.tenant_of(key)
        if tenant is None:
            raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
        if self._trust_header:
            return request.headers.get(self._tenant_header) or tenant
        return tenant


class AdminKey:
    """The admin key in force (None: the admin API is open); replaced on reload."""

    def __init__(self, key: str | None) -> None:
        self.digest = None if key is None else _digest(key)

    def check(self, request: web.Request) -> None:
        if self.digest is None:
            return
        key = bearer(request)
        if key is None or not hmac.compare_digest(_digest(key), self.digest):
            raise OpenAIError(401, "The admin API needs the admin key.", code="invalid_admin_key")


def auth_middleware(keys: Callable[[], KeyStore], admin: Callable[[], AdminKey]) -> Callable[..., Any]:
    """The admin key on ``/admin/``, client keys everywhere else but OPEN_PATHS; the getters see reloads."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(ADMIN_PREFIX):
            admin().check(request)
        elif request.path not in OPEN_PATHS:
            store = keys()
            if store.enabled:
                request[TENANT] = store.authenticate(request)
        return await handler(request)

    return authenticate
