"""The client side of TLS to one engine: its context and the name it is checked against.

Built when a backend joins the pool, from its ``tls`` (or ``upstream.tls``), and used by every
connection to it: the request path's own client (router/request_path/upstream.py) and the side
traffic through aiohttp (health checks, ``/v1/models``, metric scrapes, KV event discovery).
Contexts are shared by backends with the same settings while the files they name are
unchanged: a fleet of discovered pods does not load the CA bundle once per pod, and a
certificate rotated on disk is read again by the backends (re)added after it.
"""

from __future__ import annotations

import functools
import os
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router.fleet.settings import BackendTLSConfig, client_context


@dataclass(frozen=True)
class BackendTLS:
    context: ssl.SSLContext
    #: Sent as SNI and verified against the certificate: ``server_name``, else the URL's host.
    server_hostname: str

    def aiohttp_options(self) -> dict[str, Any]:
        """Keyword arguments of an aiohttp request to this backend."""
        return {"ssl": self.context, "server_hostname": self.server_hostname}


def backend_tls(url: str, tls: BackendTLSConfig) -> BackendTLS | None:
    """How to reach ``url`` over TLS, or None for a plain ``http://`` URL."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "https":
        return None
    stamps = tuple(_modified(path) for path in (tls.ca_file, tls.cert_file, tls.key_file))
    return BackendTLS(_context(tls, stamps), tls.server_name or parts.hostname or "")


def _modified(path: str | None) -> int | None:
    try:
        return os.stat(path).st_mtime_ns if path is not None else None
    except OSError:
        return None  # loading it says what is wrong


@functools.lru_cache(maxsize=64)
def _context(tls: BackendTLSConfig, stamps: tuple[int | None, ...]) -> ssl.SSLContext:
    return client_context(tls)
