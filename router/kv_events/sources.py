"""Where a backend's engine publishes its KV events: from config, or from the engine itself.

vLLM (>= 0.27) answers ``GET /kv_event_sources`` with its resolved ``KVEventsConfig`` per
data-parallel rank; SGLang answers ``GET /server_info`` with a ``kv_events`` block (host, base
ports, DP size). Engines bind wildcard hosts (``tcp://*:5557``); the router substitutes the
host it reaches the engine's HTTP server at. Rank r of a DP engine publishes on port + r
(vLLM appends ``_dp{r}`` to ipc endpoints instead).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from router.kv_events.settings import EndpointConfig

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True, slots=True)
class EventSource:
    """One event stream: one data-parallel rank of one backend."""

    backend: str
    rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str = ""


class DiscoveryError(RuntimeError):
    """The engine did not say where it publishes (not up yet, events off, or an old release)."""


def _offset(endpoint: str, rank: int) -> str:
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _with_host(endpoint: str, host: str) -> str:
    """``endpoint`` with a wildcard host replaced by ``host`` (where the engine is reachable)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    where, _, port = endpoint[len("tcp://") :].rpartition(":")
    if where in _WILDCARD_HOSTS:
        where = f"[{host}]" if ":" in host else host
    return f"tcp://{where}:{port}"


def configured_sources(backend: str, config: EndpointConfig) -> list[EventSource]:
    return [
        EventSource(
            backend,
            rank,
            _offset(config.endpoint, rank),
            _offset(config.replay_endpoint, rank) if config.replay_endpoint else None,
            config.topic,
        )
        for rank in range(config.dp_size)
    ]


def _vllm_sources(backend: str, host: str, payload: Any) -> list[EventSource]:
    if not isinstance(payload, dict) or not payload:
        raise DiscoveryError("GET /kv_event_sources returned no source (KV events disabled?)")
    sources = []
    for rank, cfg in payload.items():
        if (
            not isinstance(cfg, dict)
            or not cfg.get("enable_kv_cache_events")
            or cfg.get("publisher") != "zmq"
        ):
            raise DiscoveryError(f"rank {rank}: KV events are not published over zmq")
        replay = cfg.get("replay_endpoint")
        sources.append(
            EventSource(
                backend,
                int(rank),
                _with_host(str(cfg["endpoint"]), host),
                _with_host(str(replay), host) if replay else None,
                str(cfg.get("topic") or ""),
            )
        )
    return sources


def _sglang_sources(backend: str, host: str, payload: Any) -> list[EventSource]:
    info = payload.get("kv_events") if isinstance(payload, dict) else None
    if not isinstance(info, dict) or info.get("publisher") != "zmq":
        raise DiscoveryError("GET /server_info has no kv_events block (publishing off, or not over TCP)")
    where = str(info.get("endpoint_host") or "")
    where = host if where in _WILDCARD_HOSTS else where
    where = f"[{where}]" if ":" in where else where
    port = int(info["endpoint_port_base"])
    replay = info.get("replay_endpoint_port_base")
    return [
        EventSource(
            backend,
            rank,
            f"tcp://{where}:{port + rank}",
            f"tcp://{where}:{int(replay) + rank}" if replay is not None else None,
            str(info.get("topic") or ""),
        )
        for rank in range(int(info.get("dp_size") or 1))
    ]


async def discover_sources(
    session: aiohttp.ClientSession,
    backend: str,
    url: str,
    engine: str,
    timeout_s: float,
    options: Mapping[str, Any] | None = None,
) -> list[EventSource]:
    """Ask the engine at ``url`` where it publishes; DiscoveryError when it cannot say.
    ``options``: more keyword arguments of the request (the backend's TLS)."""
    path = "/server_info" if engine == "sglang" else "/kv_event_sources"
    host = urlsplit(url).hostname or "127.0.0.1"
    try:
        async with session.get(
            url.rstrip("/") + path, timeout=aiohttp.ClientTimeout(total=timeout_s), **(options or {})
        ) as resp:
            if resp.status != 200:
                raise DiscoveryError(f"GET {path} answered {resp.status}")
            payload = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise DiscoveryError(f"GET {path} failed: {type(exc).__name__}: {exc}") from None
    try:
        if engine == "sglang":
            return _sglang_sources(backend, host, payload)
        return _vllm_sources(backend, host, payload)
    except (KeyError, TypeError, ValueError) as exc:
        raise DiscoveryError(f"GET {path}: unexpected answer ({type(exc).__name__}: {exc})") from None
