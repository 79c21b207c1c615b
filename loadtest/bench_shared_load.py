"""What the shared load view costs Redis, by fleet size.

    python -m loadtest.bench_shared_load [--fleets 4x4,4x16,8x32,16x64,32x128] [--calls 400]

Every router replica sharing load through Redis (``index.redis.share_load``) runs one script
every ``load_interval_s``: it publishes its counts for each backend and reads the others'
sums. Redis runs scripts one at a time: a long one holds up every lookup behind it.

For each fleet (``R``x``B``: R replicas, B backends) this starts a private ``redis-server``,
has R real ``SharedLoad`` publishers (the router's own code, each with B backends) call in
turn ``--calls`` times, every count changed before each call (seeded), and reads Redis's own
CPU time per call (``INFO commandstats``), so the figure is Redis's work, not the client's.
The table gives it, its ratio to the first fleet's, the interval the replicas call at with
the default settings (``load_interval_s``, stretched by ``load_interval_fleet`` on large
fleets), and the share of Redis's one core the fleet takes at that interval and at 100 ms
(the default before 2026-12-07). Everything runs on loopback and stops after the calls.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from prometheus_client import CollectorRegistry

from loadtest.redis_server import redis_server
from loadtest.report import format_table
from router.config import BackendConfig
from router.fleet.backends import BackendPool
from router.fleet.shared_load import SharedLoad
from router.redis.breaker import open_link
from router.redis.settings import RedisConfig

#: The interval the table compares with the default settings': the default before 2026-12-07.
OLD_INTERVAL_S = 0.1


def fleet_size(text: str) -> tuple[int, int]:
    """``RxB`` -> (replicas, backends)."""
    replicas, _, backends = text.partition("x")
    return int(replicas), int(backends)


async def redis_usec_per_call(replicas: int, backends: int, calls: int) -> tuple[float, float]:
    """Redis's CPU time, in µs, per shared-load call of ``replicas`` replicas over ``backends``,
    and the seconds between a replica's calls with the default settings."""
    with redis_server() as server:
        config = RedisConfig(url=server.url)
        names = [BackendConfig(name=f"e{i}", url="http://127.0.0.1:1") for i in range(backends)]
        links = [open_link(config, CollectorRegistry()) for _ in range(replicas)]
        try:
            views = [SharedLoad(link, BackendPool(names)) for link in links]
            for view in views:
                for backend in view.pool:
                    backend.in_flight = 3
                    backend.pending_prefill_tokens = 1000
                    backend.pending_prefill_requests = 1
                await view.sync_once()  # every replica live before the count starts
            client = server.client()
            client.config_resetstat()
            rng = random.Random(0)
            for k in range(calls):
                view = views[k % replicas]
                for backend in view.pool:  # every count moves between calls: the busy case
                    backend.in_flight = rng.randrange(8)
                    backend.pending_prefill_tokens = rng.randrange(10_000)
                    backend.pending_prefill_requests = rng.randrange(4)
                await view.sync_once()
            stats = [v for k, v in client.info("commandstats").items() if "eval" in k]
            return sum(s["usec"] for s in stats) / sum(s["calls"] for s in stats), views[0].interval()
        finally:
            for link in links:
                await link.close()


async def main_async(args: argparse.Namespace) -> int:
    rows = []
    first = None
    for replicas, backends in args.fleets:
        usec, interval = await redis_usec_per_call(replicas, backends, args.calls)
        first = first or usec
        shares = [f"{usec * replicas / (seconds * 1e6):.2%}" for seconds in (interval, OLD_INTERVAL_S)]
        fleet, cost = f"{replicas} x {backends}", f"{usec:,.0f} µs"
        rows.append([fleet, cost, f"{usec / first:.1f}", f"{interval * 1000:.0f} ms", *shares])
    headers = ["replicas x backends", "Redis per call", "vs first", "interval", "Redis core", "at 100 ms"]
    print(format_table(headers, rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_shared_load", description=__doc__)
    parser.add_argument(
        "--fleets",
        type=lambda text: [fleet_size(part) for part in text.split(",")],
        default=[(4, 4), (4, 16), (8, 32), (16, 64), (32, 128)],
        help="fleets as RxB (replicas x backends), comma-separated",
    )
    parser.add_argument("--calls", type=int, default=400, help="shared-load calls measured per fleet")
    return parser


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(build_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
