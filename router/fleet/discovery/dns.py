"""DNS discovery: the A records of a name, re-resolved every ``interval_s``.

Meant for a Kubernetes headless Service, whose name resolves to the ready pods' IPs. A name
that does not exist or has no A record means no backends (a headless Service without ready
pods answers NXDOMAIN); a resolver that fails or times out changes nothing, so a DNS hiccup
never empties the fleet.

The resolver is dnspython's asyncio one: it takes the nameservers and their port from
config (aiodns/c-ares cannot be told a port per nameserver through aiohttp's resolver), and
with none configured it reads /etc/resolv.conf with its search domains, as in a pod.
"""

from __future__ import annotations

import asyncio
import logging

import dns.asyncresolver
import dns.exception
import dns.resolver

from router.fleet.backends import BackendPool
from router.fleet.discovery.base import Discovery, Endpoint, FleetSync
from router.fleet.settings import DnsDiscoveryConfig

log = logging.getLogger("kvroute.discovery.dns")


class DnsDiscovery(Discovery):
    def __init__(self, pool: BackendPool, config: DnsDiscoveryConfig) -> None:
        self.config = config
        self.fleet = FleetSync(pool, config, f"dns {config.name}")
        if config.nameservers:
            self.resolver = dns.asyncresolver.Resolver(configure=False)
            self.resolver.nameservers = list(config.nameservers)
            self.resolver.port = config.nameserver_port
        else:
            self.resolver = dns.asyncresolver.Resolver()
        self.resolver.lifetime = config.timeout_s
        self._failing = False

    async def resolve(self) -> list[str] | None:
        """The name's addresses, sorted; [] when it has none; None when DNS could not say."""
        try:
            answer = await self.resolver.resolve(self.config.name, "A", search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:
            if not self._failing:
                log.warning("cannot resolve %s: %s", self.config.name, exc)
            self._failing = True
            return None
        self._failing = False
        return sorted({record.address for record in answer})

    async def sync_once(self) -> bool:
        addresses = await self.resolve()
        if addresses is None:
            return False
        self.fleet.apply(Endpoint(address) for address in addresses)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.sync_once()
