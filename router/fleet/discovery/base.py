"""What every dynamic discovery source shares: turning endpoints into pool changes."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from router.fleet.backends import BackendPool
from router.fleet.settings import BackendConfig, DiscoveredBackend

log = logging.getLogger("kvroute.discovery")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One discovered engine: its address, and whether it is on its way out."""

    address: str
    #: Stable name (a pod's); None names it ``address:port``.
    name: str | None = None
    #: The engine's port; None uses the configured one.
    port: int | None = None
    #: Terminating: finishes what it has in flight, gets nothing new.
    terminating: bool = False


class FleetSync:
    """Makes the pool hold exactly the endpoints one source reports, touching only its own.

    A backend of the static list is never removed or replaced by discovery, even when a
    discovered endpoint has its name.
    """

    def __init__(self, pool: BackendPool, template: DiscoveredBackend, source: str) -> None:
        self.pool = pool
        self.template = template
        self.source = source
        self._owned: set[str] = set()

    def backend_config(self, endpoint: Endpoint) -> BackendConfig:
        t = self.template
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        port = endpoint.port or t.port
        return BackendConfig(
            name=endpoint.name or f"{host}:{port}",
            url=f"{t.scheme}://{host}:{port}",
            engine=t.engine,
            models=t.models,
            capacity_blocks=t.capacity_blocks,
            role=t.role,
            bootstrap_port=t.bootstrap_port,
        )

    def apply(self, endpoints: Iterable[Endpoint]) -> None:
        wanted: dict[str, tuple[BackendConfig, bool]] = {}
        for endpoint in endpoints:
            config = self.backend_config(endpoint)
            wanted.setdefault(config.name, (config, endpoint.terminating))
        for name in sorted(self._owned - wanted.keys()):
            log.info("%s: backend %s is gone", self.source, name)
            self.pool.remove(name)
            self._owned.discard(name)
        for name, (config, terminating) in wanted.items():
            if name in self.pool and name not in self._owned:
                log.warning(
                    "%s: %s is a static backend's name; the discovered one is ignored", self.source, name
                )
                continue
            if name not in self._owned:
                log.info("%s: backend %s at %s", self.source, name, config.url)
            backend = self.pool.add(config)
            if terminating and not backend.terminating:
                log.info("%s: backend %s is terminating; draining it", self.source, name)
            backend.terminating = terminating
            self._owned.add(name)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._owned)


class Discovery(ABC):
    """A dynamic source: ``sync_once`` before serving, then ``run`` until cancelled."""

    @abstractmethod
    async def sync_once(self) -> bool:
        """Bring the pool up to date once; False when the source could not be read."""

    @abstractmethod
    async def run(self) -> None:
        """Keep the pool up to date until cancelled; never raises on a source's failure."""

    async def close(self) -> None:  # noqa: B027 -- optional hook; DNS holds nothing to release
        """Release what the source holds (connections)."""
