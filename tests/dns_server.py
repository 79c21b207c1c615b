"""A tiny authoritative DNS server on loopback UDP, for discovery tests.

``records`` maps a name to its A records and can be changed while it runs; a name not in it
gets NXDOMAIN, and every query gets SERVFAIL while ``failing`` is set. Messages are built
with dnspython (the resolver side's library too), but what passes between is real UDP DNS.
"""

from __future__ import annotations

import asyncio

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram endpoint's transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        self.server.queries += 1
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        addresses = self.server.records.get(question.name.to_text())
        if self.server.failing:
            response.set_rcode(dns.rcode.SERVFAIL)
        elif addresses is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and addresses:
            response.answer.append(dns.rrset.from_text_list(question.name, 5, "IN", "A", addresses))
        assert self.transport is not None
        self.transport.sendto(response.to_wire(), addr)


class DnsServer:
    def __init__(self) -> None:
        #: Fully qualified name (with the trailing dot) -> its A records.
        self.records: dict[str, list[str]] = {}
        self.queries = 0
        self.failing = False
        self.port = 0
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=("127.0.0.1", self.port)
        )
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]

    def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
