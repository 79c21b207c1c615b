"""Free loopback ports for the servers the benchmarks and tests start, picked below the kernel's
ephemeral range.

Binding port 0 finds a free port in the ephemeral range, the range the kernel also draws from for
every outgoing connection. Between that pick and the server's own bind, one of the harness's
thousands of client connections can take the port: CI saw a ``--workers 2`` router fail with
"cannot listen … Address already in use" on an admin port picked before a saturation run. The
kernel never gives ports below the range to outgoing connections, so a port picked there stays
free unless another server binds it by number; picks are random (parallel test processes do not
walk the same sequence) and never repeat within a process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Where Linux keeps the ephemeral range ("32768	60999" by default).
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: The lowest port picked: clear of the well-known and registered services commonly run on a host.
LOWEST = 10000

_picked: set[int] = set()
_random = random.SystemRandom()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (IANA's 49152 where the kernel does not say)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def free_port(below: int = 65536) -> int:
    """A free loopback port under ``below`` (a Redis Cluster node also listens on its port + 10000)."""
    return free_ports(1, below)


def free_ports(count: int, below: int = 65536) -> int:
    """The first of ``count`` consecutive free loopback ports, all under ``below`` (the simulated
    fleet listens on consecutive ports)."""
    top = min(below, ephemeral_start()) - count
    if top <= LOWEST:
        raise RuntimeError(f"no room for {count} ports between {LOWEST} and the ephemeral range")
    for _ in range(200):
        first = _random.randrange(LOWEST, top)
        ports = range(first, first + count)
        if _picked.isdisjoint(ports) and all(map(_bindable, ports)):
            _picked.update(ports)
            return first
    raise RuntimeError(f"no {count} consecutive free ports between {LOWEST} and {top + count}")


def _bindable(port: int) -> bool:
    """Whether a listener can bind ``port`` now. Without SO_REUSEADDR, so that a port with
    connections still in TIME_WAIT counts as taken."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
