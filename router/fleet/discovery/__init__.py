"""Where backends come from: the static ``backends`` list, DNS, or the Kubernetes API.

The static list is loaded into the pool at start and never changes. A dynamic source
(``discovery.kind``) adds and removes its own backends while the router runs; the pool's
subscribers (index, health checks, metrics) follow, so a backend's index entries leave
with it. With ``discovery.roles`` (prefill/decode disaggregation) one source runs per role,
each owning the backends it found.
"""

from __future__ import annotations

import asyncio

from router.fleet.backends import BackendPool
from router.fleet.discovery.base import Discovery, Endpoint, FleetSync
from router.fleet.discovery.dns import DnsDiscovery
from router.fleet.discovery.kubernetes import KubernetesDiscovery
from router.fleet.settings import DiscoveryConfig, DnsDiscoveryConfig

__all__ = ["Discovery", "DnsDiscovery", "Endpoint", "FleetSync", "KubernetesDiscovery", "build_discovery"]


class Sources(Discovery):
    """Several sources of one kind, one per role, kept up to date side by side."""

    def __init__(self, sources: list[Discovery]) -> None:
        self.sources = sources

    async def sync_once(self) -> bool:
        results = await asyncio.gather(*(s.sync_once() for s in self.sources))
        return all(results)

    async def run(self) -> None:
        await asyncio.gather(*(s.run() for s in self.sources))

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sources))


def build_discovery(config: DiscoveryConfig, pool: BackendPool) -> Discovery | None:
    """The configured dynamic source (several with ``roles``), or None for ``kind: static``."""
    if config.kind == "static":
        return None
    sources: list[Discovery] = []
    for source in config.sources():
        if isinstance(source, DnsDiscoveryConfig):
            sources.append(DnsDiscovery(pool, source))
        else:
            sources.append(KubernetesDiscovery(pool, source))
    return sources[0] if len(sources) == 1 else Sources(sources)
