"""``index.redis``: where the shared index and load view live, and how hard to try.

The section's type lives beside the Redis code that reads it, at the bottom of the wing: it
imports nothing of ``router`` above it, so every wing may import it. Ranges are declared on
the fields (``policies.params``); the rules that tie fields together are in ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec

from policies.params import NonNegativeFloat, PositiveFloat, PositiveInt

#: Case-insensitive scheme, as ``HttpUrl`` in router/fleet/settings.py.
RedisUrl = Annotated[
    str,
    msgspec.Meta(pattern=r"^[Rr][Ee][Dd][Ii][Ss][Ss]?://", extra={"expected": "a redis:// or rediss:// URL"}),
]
#: A Sentinel's ``host:port`` (``user:password@host:port`` too).
SentinelAddress = Annotated[
    str, msgspec.Meta(pattern=r"^.+:[0-9]+$", extra={"expected": "a host:port entry"})
]
Namespace = Annotated[
    str, msgspec.Meta(pattern=r"^[^{}]+$", extra={"expected": "a non-empty string without braces"})
]


@dataclass(frozen=True)
class RedisConfig:
    """``index.redis``: where the shared index and load view live, and how hard to try.

    One of three topologies: a standalone server (``url``), Sentinel (``sentinels`` +
    ``service_name``; ``url`` then only gives scheme, database and credentials), or Cluster
    (``cluster: true``; ``url`` is any seed node).
    """

    url: RedisUrl = "redis://127.0.0.1:6379/0"
    username: str | None = None
    #: Password, or where to read it: an environment variable or a file (at most one of the three).
    password: str | None = field(default=None, repr=False)
    password_env: str | None = None
    password_file: str | None = None
    #: Sentinel: ``host:port`` of each sentinel, and the monitored master's name.
    sentinels: list[SentinelAddress] = field(default_factory=list)
    service_name: str = "mymaster"
    cluster: bool = False
    #: TLS (``rediss://`` URLs): CA bundle, client certificate and key, and whether to verify the server.
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    #: Prefix of every key, so several deployments can share one Redis.
    namespace: Namespace = "kvroute"
    #: Where lookups read. ``shared``: Redis, one round trip on the request path (the shared view
    #: as it is now). ``local``: this router's own copy of the whole index, which every
    #: replica's beliefs reach over a Redis stream within milliseconds: no Redis call on the
    #: request path, a copy of the index in each replica's memory (docs/redis.md).
    lookup: Literal["shared", "local"] = "shared"
    #: With ``lookup: local``: belief batches the stream keeps; a starting replica replays them.
    stream_length: PositiveInt = 10000
    #: With ``lookup: local``: after each append to the stream, and after each read that
    #: returned something, wait this long, so a busy replica makes one round trip per interval
    #: rather than one per request. The first belief after a quiet spell still leaves at once.
    sync_interval_ms: NonNegativeFloat = 5.0
    #: Every key expires this long after its last write (a backend's beliefs: its last request).
    key_ttl_s: PositiveFloat = 3600.0
    #: Deadline of one lookup on the request path; past it the request routes on the local view.
    #: It guards against a stalled Redis, not a busy router: the clock runs while the router's
    #: event loop serves other requests, and a tighter one cost hit ratio (README, benchmark).
    timeout_ms: PositiveFloat = 20.0
    #: Deadline of the off-path calls (batched writes, load sync, probes).
    background_timeout_ms: PositiveFloat = 1000.0
    #: Consecutive lookup timeouts that mark Redis as down (a connection error does at once).
    trip_after: PositiveInt = 3
    #: While Redis is down, how often to probe it (the router returns to shared state by itself).
    retry_interval_s: PositiveFloat = 0.5
    #: Pending index updates held for the writer; beyond it updates are dropped and counted.
    write_queue_size: PositiveInt = 10000
    #: Most blocks written in one script call (a single longer chain goes alone). Redis runs one
    #: script at a time, so this bounds how long a write holds up lookups (~1 ms per 1000 blocks).
    write_batch_blocks: PositiveInt = 1000
    #: Publish this router's in-flight counts and read everyone's (the shared load view).
    share_load: bool = True
    #: How often the shared load view is published and read: how old the others' load is. A
    #: prefill lasts tens of milliseconds, and at 100 ms four replicas queued theirs behind each
    #: other's (docs/benchmarks/2026-12-07-shared-load.md). Every replica makes a call each
    #: interval, costing Redis time in proportion to the backends (``python -m
    #: loadtest.bench_shared_load``); see ``load_interval_fleet``. What an interval costs a
    #: fleet's placement: ``kvroute simulate --replicas N --sweep load_interval_s=...``.
    load_interval_s: PositiveFloat = 0.01
    #: With ``lookup: shared``: carry the view on the round trips each request already makes,
    #: so a pick sees the others' load as of their last pick rather than one or two intervals
    #: old. Each lookup's script also reads the fleet's sums (the same round trip), and each
    #: write, which leaves at once after a pick, also publishes this router's counts (a LOAD
    #: call in its pipeline: Redis time in proportion to the backends, per write batch). Only
    #: within ``load_interval_fleet`` replicas x backends; past it the periodic calls alone.
    load_on_lookup: bool = True
    #: Replicas x backends up to which ``load_interval_s`` holds; on a larger fleet each replica
    #: stretches its interval in proportion (x2 at twice this, at most a third of
    #: ``load_ttl_s``), so the fleet's calls take about the same share of Redis's core whatever
    #: its size (4-13 % on a 2-core VM, docs/redis.md).
    load_interval_fleet: PositiveInt = 32
    #: How often the view is shared while nothing is in flight anywhere (this router's requests,
    #: and the others' as of its last call): an idle fleet has nothing that ages, and a 10 ms
    #: loop of calls costs an idle router about 5 % of a core (docs/redis.md).
    load_idle_interval_s: PositiveFloat = 0.1
    #: A router that stopped publishing stops counting after this long (it died).
    load_ttl_s: PositiveFloat = 3.0

    def load_interval(self, replicas: int, backends: int) -> float:
        """Seconds between a replica's load calls: ``load_interval_s``, stretched on a fleet of
        more than ``load_interval_fleet`` replicas x backends so that the fleet's calls take
        about the same share of Redis's core whatever its size; a stretch goes no further than
        a third of ``load_ttl_s``, after which the others would count the replica dead."""
        stretched = self.load_interval_s * max(1.0, replicas * backends / self.load_interval_fleet)
        return min(stretched, max(self.load_interval_s, self.load_ttl_s / 3))

    def validate(self) -> list[str]:
        problems = []
        try:
            host = urlsplit(self.url).hostname
        except ValueError:
            host = None
        if not (host or self.sentinels):
            problems.append(f"url: expected a redis:// or rediss:// URL with a host, got {self.url!r}")
        if sum(x is not None for x in (self.password, self.password_env, self.password_file)) > 1:
            problems.append("password: give at most one of password, password_env, password_file")
        if self.sentinels and self.cluster:
            problems.append("cluster: Sentinel and Cluster are exclusive; configure one")
        if self.load_ttl_s <= max(self.load_interval_s, self.load_idle_interval_s):
            problems.append("load_ttl_s: expected more than load_interval_s and load_idle_interval_s")
        return problems
