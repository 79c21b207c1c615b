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

The keys' sources (inline, a file, a mounted Secret) are read by ``AuthConfig.tenant_keys``
(router/http/settings.py), when the config is validated and again when the keys are applied.

The admin key guards ``/admin/`` (drain, reload, debug views); client keys never open it.
An engine's own credential (``backends[].api_key``) replaces the client's Authorization on
the way upstream; with client keys on, the client's key is never forwarded to an engine.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.errors import OpenAIError
from router.http.settings import AuthConfig
from router.request_path.request import TENANT
from router.request_path.settings import TenancyConfig

#: Paths that need the admin key (when one is set) instead of a client key.
ADMIN_PREFIX = "/admin/"
#: Paths open without any key: probes and Prometheus. Every other path needs a client key (when
#: keys are configured): deny by default, so a route added later is never open by accident.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class KeyStore:
    """The client keys in force; replaced whole on reload."""

    def __init__(self, config: AuthConfig, tenancy: TenancyConfig) -> None:
        self.configure(config, tenancy)

    def configure(self, config: AuthConfig, tenancy: TenancyConfig) -> None:
        """Apply ``config``'s keys, read from their sources now; ValueError (nothing applied) if one fails."""
        self._table = {_digest(key): tenant for tenant, keys in config.tenant_keys().items() for key in keys}
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
