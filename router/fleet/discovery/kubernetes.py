"""Kubernetes discovery: EndpointSlices selected by label, listed then watched.

Plain HTTP against the API server (``discovery.k8s.io/v1``), no client library: list the
slices, then watch from the list's ``resourceVersion``. Whenever a watch ends — its server-
side timeout, a dropped connection, a ``410 Gone``, an API server restart — the loop lists
again before watching again, so events missed while disconnected can never leave a dead
pod in rotation: the list is the truth, the watch only makes it current sooner.

An endpoint counts as:

* **ready** (``conditions.ready`` true or absent, as the API says to read it): a backend.
* **terminating** (``conditions.terminating`` true): a backend still, drained — its in-flight
  requests finish, it gets no new ones — until it leaves the slice.
* neither (not ready, not terminating: starting, or failing its readiness probe): absent,
  so its believed cache entries go too.

In a pod the API server, token, CA and namespace come from the service account, as
``kubectl`` finds them; all four can be set instead (the tests point them at a local
server). The token file is re-read at every (re)connect, since projected tokens rotate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.fleet.backends import BackendPool
from router.fleet.discovery.base import Discovery, Endpoint, FleetSync
from router.fleet.settings import KubernetesDiscoveryConfig

log = logging.getLogger("kvroute.discovery.kubernetes")


#: What a failing or misbehaving API server can make a call raise (malformed JSON and objects too).
_API_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError)


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class KubernetesDiscovery(Discovery):
    def __init__(self, pool: BackendPool, config: KubernetesDiscoveryConfig) -> None:
        self.config = config
        self.fleet = FleetSync(pool, config, f"kubernetes {config.label_selector}")
        self.api_url = (config.api_url or _in_cluster_api_url()).rstrip("/")
        self.namespace = config.namespace or _read(config.namespace_file) or "default"
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        self._slices: dict[str, dict[str, Any]] = {}
        self._resource_version = ""
        self._session: aiohttp.ClientSession | None = None
        #: Completed list calls, for logs and tests.
        self.lists = 0

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            context: ssl.SSLContext | bool = True
            if self.api_url.startswith("https://") and Path(self.config.ca_file).is_file():
                context = ssl.create_default_context(cafile=self.config.ca_file)
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))
        return self._session

    def _headers(self) -> dict[str, str]:
        token = _read(self.config.token_file)
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    async def sync_once(self) -> bool:
        """List the slices and apply them; False (and the pool unchanged) when the API failed."""
        try:
            await self._list()
        except _API_ERRORS as exc:
            log.warning("cannot list EndpointSlices (%s): %s", self.config.label_selector, exc)
            return False
        return True

    async def run(self) -> None:
        listed = self.lists > 0  # sync_once ran at start; watch from where it left off
        while True:
            while not listed:
                listed = await self.sync_once()
                if not listed:
                    await asyncio.sleep(self.config.retry_s)
            listed = False
            started = asyncio.get_running_loop().time()
            try:
                await self._watch()
            except WatchExpired:
                log.info("EndpointSlice watch expired; listing again")
            except _API_ERRORS as exc:
                log.warning("EndpointSlice watch failed: %s; listing again", exc)
                await asyncio.sleep(self.config.retry_s)
            else:
                # A watch that keeps ending at once (a proxy cutting it) must not become a busy loop.
                if asyncio.get_running_loop().time() - started < self.config.retry_s:
                    await asyncio.sleep(self.config.retry_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _list(self) -> None:
        session = await self._client()
        params = {"labelSelector": self.config.label_selector}
        timeout = aiohttp.ClientTimeout(total=30)
        async with session.get(
            self.api_url + self.path, params=params, headers=self._headers(), timeout=timeout
        ) as resp:
            if resp.status != 200:
                raise ValueError(f"list answered {resp.status}: {(await resp.text())[:200]}")
            body = orjson.loads(await resp.read())
        self._slices = {item["metadata"]["name"]: item for item in body.get("items") or ()}
        self._resource_version = body.get("metadata", {}).get("resourceVersion", "")
        self.lists += 1
        self._apply()

    async def _watch(self) -> None:
        """Follow changes from the last list until the server ends the watch."""
        session = await self._client()
        params = {
            "labelSelector": self.config.label_selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": self._resource_version,
            "timeoutSeconds": str(self.config.watch_timeout_s),
        }
        # The server ends the watch after timeoutSeconds; silence well past it is a dead link.
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.config.watch_timeout_s + 30)
        async with session.get(
            self.api_url + self.path, params=params, headers=self._headers(), timeout=timeout
        ) as resp:
            if resp.status == 410:
                raise WatchExpired
            if resp.status != 200:
                raise ValueError(f"watch answered {resp.status}: {(await resp.text())[:200]}")
            # Split lines by hand: one event is one whole EndpointSlice, which can be larger
            # than the stream reader's line limit.
            pending = b""
            async for chunk in resp.content.iter_any():
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        self._on_event(orjson.loads(line))

    def _on_event(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise WatchExpired
            raise ValueError(f"watch error: {obj.get('message', obj)}")
        metadata = obj.get("metadata") or {}
        self._resource_version = metadata.get("resourceVersion", self._resource_version)
        if kind == "BOOKMARK":
            return
        if kind == "DELETED":
            self._slices.pop(metadata.get("name"), None)
        elif kind in ("ADDED", "MODIFIED"):
            self._slices[metadata["name"]] = obj
        self._apply()

    def _apply(self) -> None:
        endpoints = [e for s in sorted(self._slices) for e in self._endpoints(self._slices[s])]
        self.fleet.apply(endpoints)

    def _endpoints(self, slice_: dict[str, Any]) -> Iterator[Endpoint]:
        port = self._port(slice_)
        if port is None:
            return
        for endpoint in slice_.get("endpoints") or ():
            conditions = endpoint.get("conditions") or {}
            terminating = conditions.get("terminating") is True
            ready = conditions.get("ready") is not False
            if not (ready or terminating):
                continue
            target = endpoint.get("targetRef") or {}
            name = target.get("name") if target.get("kind") == "Pod" else None
            for address in endpoint.get("addresses") or ():
                yield Endpoint(address, name=name, port=port, terminating=terminating)
                # A pod is one backend, whatever number of addresses it lists.
                if name is not None:
                    break

    def _port(self, slice_: dict[str, Any]) -> int | None:
        """The slice's port named ``port_name``, or ``port`` when none is named."""
        if not self.config.port_name:
            return self.config.port
        for port in slice_.get("ports") or ():
            if port.get("name") == self.config.port_name and isinstance(port.get("port"), int):
                return port["port"]
        return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _in_cluster_api_url() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{port}"
