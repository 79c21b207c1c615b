"""Where backends come from: the static ``backends`` list, DNS, or the Kubernetes API.

The static list is loaded into the pool at start and never changes. A dynamic source
(``discovery.kind``) adds and removes its own backends while the router runs; the pool's
subscribers (index, health checks, metrics) follow, so a backend's index entries leave
with it.
"""

from __future__ import annotations

from router.fleet.backends import BackendPool
from router.fleet.discovery.base import Discovery, Endpoint, FleetSync
from router.fleet.discovery.dns import DnsDiscovery
from router.fleet.discovery.kubernetes import KubernetesDiscovery
from router.fleet.settings import DiscoveryConfig

__all__ = ["Discovery", "DnsDiscovery", "Endpoint", "FleetSync", "KubernetesDiscovery", "build_discovery"]


def build_discovery(config: DiscoveryConfig, pool: BackendPool) -> Discovery | None:
    """The configured dynamic source, or None for ``kind: static``."""
    if config.kind == "dns":
        return DnsDiscovery(pool, config.dns)
    if config.kind == "kubernetes":
        return KubernetesDiscovery(pool, config.kubernetes)
    return None
