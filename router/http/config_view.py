"""``GET /admin/config``: the config in force, as JSON, with every secret redacted.

What it shows is the running config, not the file: after a reload, the new values, except
the sections that need a restart (router/http/reload.py), which show what still runs. ``pid``
names the process that answered, as with ``kvroute serve --workers N`` each worker answers
for itself; ``config_file`` is the file a reload re-reads.

Redaction fails closed, by name, over the whole tree, so a secret added to a section later
is hidden without touching this module:

* a mapping key whose last ``_``/``-`` separated word is a secret word (``key``, ``keys``,
  ``password``, ``secret``, ``token``, ``credentials``...) has its text values replaced by
  ``<redacted>`` (nested lists and mappings are walked, keeping their shape and mapping
  keys: ``auth.keys`` still lists its tenants). ``api_key``, ``admin.key``, ``auth.keys``,
  ``index.redis.password`` are caught this way; ``api_key_env``, ``key_file`` or
  ``password_file`` (where a secret is read from, not the secret) and numbers such as
  ``chars_per_token`` are shown;
* any string holding a URL has its user info (``user:password@``), every query value and
  its fragment redacted (query names stay, to show what is set: redis-py reads
  ``?password=``, and a signed URL's ``?sig=`` or an ``#access_token=`` are named anything):
  ``redis://`` and ``rediss://`` URLs, backend URLs, the Kubernetes API URL;
  ``user:password@host:port`` without a scheme (a Sentinel address; the password may hold
  an ``@``) loses its user info too. A URL that cannot be parsed is redacted whole.

The engines' resolved credentials (``upstream_api_key``, read from the environment) are
properties, never part of the tree.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from aiohttp import web

from router.config import Config

if TYPE_CHECKING:
    from router.http.reload import Runtime

REDACTED = "<redacted>"
_SECRET_WORDS = frozenset(
    {
        "key",
        "keys",
        "password",
        "passwd",
        "passphrase",
        "secret",
        "secrets",
        "token",
        "tokens",
        "credential",
        "credentials",
        # Headers sent to a service carry its credentials (``tracing.headers``: the collector's).
        "headers",
    }
)
_WORD_SPLIT = re.compile(r"[_\-.]")
#: ``user:password@host:port``, without a scheme (Sentinel addresses).
_BARE_USERINFO = re.compile(r"^[^/\s]+@(?=[^/\s@]+$)")


def is_secret_name(name: object) -> bool:
    """Whether a config key names a secret (its last word is a secret word)."""
    return isinstance(name, str) and _WORD_SPLIT.split(name.lower())[-1] in _SECRET_WORDS


def _mask(value: Any) -> Any:
    if isinstance(value, str):
        return REDACTED
    if isinstance(value, (list, tuple)):
        return [_mask(v) for v in value]
    if isinstance(value, dict):
        return {k: _mask(v) for k, v in value.items()}
    return value  # None, booleans, numbers: not secrets (None says "not set")


def scrub_url(text: str) -> str:
    """``text`` with a URL's user info, query values and fragment redacted (unchanged otherwise)."""
    if "://" not in text:
        return _BARE_USERINFO.sub(f"{REDACTED}@", text)
    try:
        parts = urlsplit(text)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, REDACTED) for k, _ in pairs], safe="<>")
        fragment = REDACTED if parts.fragment else ""
        return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))
    except ValueError:
        return REDACTED


def redact(value: Any) -> Any:
    """A JSON-able copy of ``value`` with every secret redacted (see the module docstring)."""
    if isinstance(value, dict):
        return {k: _mask(v) if is_secret_name(k) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return scrub_url(value)
    return value


def effective_config(config: Config) -> dict[str, Any]:
    """The config's document as a redacted mapping, every default filled in, and each of
    ``limits.tenants`` as the limits it runs with (its overrides merged over ``tenant_default``).
    The policy object built from ``routing`` is not part of it."""
    tree = dataclasses.asdict(config.document())
    tree["limits"]["tenants"] = {
        name: dataclasses.asdict(limits) for name, limits in config.limits.tenant_limits().items()
    }
    return redact(tree)


def config_routes(runtime: Runtime) -> list[web.RouteDef]:
    """``GET /admin/config``: the running config, redacted (behind the admin key like all /admin/)."""

    async def show(request: web.Request) -> web.Response:
        return web.json_response(
            {"pid": os.getpid(), "config_file": runtime.path, "config": effective_config(runtime.config)}
        )

    return [web.get("/admin/config", show)]
