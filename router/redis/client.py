"""One asyncio Redis client from ``index.redis``: standalone, Sentinel or Cluster, auth and TLS.

The client never retries on its own: on the request path a retry would spend the lookup's
whole deadline on a server that just failed, and off the path the callers already retry on
their own schedule. A failed call fails fast, and the index falls back to its local view.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from router.config import ConfigError
from router.redis.settings import RedisConfig

#: What the index and load view talk to; both client kinds offer the commands they use.
RedisClient = Redis | RedisCluster


def replica_id() -> str:
    """This process's name in shared state, unique per process and start: host, pid and a random
    suffix (no '/', the load view's field separator)."""
    host = socket.gethostname().replace("/", "_")
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def resolve_password(config: RedisConfig) -> str | None:
    """The password from config, an environment variable or a file (secrets stay out of YAML)."""
    if config.password_env is not None:
        value = os.environ.get(config.password_env)
        if value is None:
            raise ConfigError(
                f"index.redis.password_env: environment variable {config.password_env} is not set"
            )
        return value
    if config.password_file is not None:
        try:
            return Path(config.password_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f"index.redis.password_file: cannot read {config.password_file}: {exc.strerror}"
            ) from None
    if config.password is not None:
        return config.password
    url_password = urlsplit(config.url).password
    return unquote(url_password) if url_password is not None else None


def _connection_kwargs(config: RedisConfig) -> dict[str, Any]:
    # No socket_timeout on the data connections: every call has its own deadline (RedisLink),
    # and with one redis-py sends each command through asyncio.wait_for, a task per command.
    kwargs: dict[str, Any] = {
        "socket_timeout": None,
        "socket_connect_timeout": config.background_timeout_ms / 1000,
        "retry": Retry(NoBackoff(), 0),
        "password": resolve_password(config),
    }
    parts = urlsplit(config.url)
    username = config.username if config.username is not None else parts.username
    if username:
        kwargs["username"] = unquote(username)
    if parts.scheme == "rediss":
        kwargs.update(
            ssl=True,
            ssl_ca_certs=config.tls_ca_file,
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
            ssl_cert_reqs="required" if config.tls_verify else "none",
            ssl_check_hostname=config.tls_verify,
        )
    return kwargs


def _database(url: str) -> int:
    path = urlsplit(url).path.strip("/")
    return int(path) if path.isdigit() else 0


def build_client(config: RedisConfig) -> RedisClient:
    """A client for the configured topology; it connects lazily, on its first command."""
    kwargs = _connection_kwargs(config)
    if config.cluster:
        parts = urlsplit(config.url)
        return RedisCluster(host=parts.hostname, port=parts.port or 6379, **kwargs)
    if config.sentinels:
        hosts = [(h, int(p)) for h, _, p in (s.rpartition(":") for s in config.sentinels)]
        timeout = config.background_timeout_ms / 1000
        sentinel_kwargs = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": kwargs["retry"],
        }
        sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **kwargs)
        return sentinel.master_for(config.service_name, db=_database(config.url))
    parts = urlsplit(config.url)
    ssl = kwargs.pop("ssl", False)
    return Redis(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 6379,
        db=_database(config.url),
        ssl=ssl,
        **kwargs,
    )
