"""What the shared load view costs Redis, by fleet size.

    python -m loadtest.bench_shared_load [--fleets 4x4,4x16,8x32,16x64,32x128] [--calls 400]
    python -m loadtest.bench_shared_load --picks [--fleets ...] [--calls 2000] [--rate 300]

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
(the default before 2026-12-07).

``--picks`` measures what ``index.redis.load_on_lookup`` adds instead: with ``lookup: shared``
each pick is a lookup (the MATCH script, which with the view on also reads the fleet's sums)
and the write that leaves after it (RECORD, pipelined with a LOAD publishing the replica's
counts). R real ``RedisIndex`` replicas, each with its ``SharedLoad``, make ``--calls`` picks
in turn, the view off and then on, each on a fresh ``redis-server``; each write is a batch of
its own, the most a pick can cost (a busy replica's writes leave in batches, each carrying one
publish). The table gives the scripts and Redis's CPU per pick both ways, what the view adds
at ``--rate`` picks a second across the fleet, and what the periodic calls it replaces cost
(all of them at most: a replica skips its call only while its writes published within the
interval). A fleet past ``load_interval_fleet`` does not ride: its two columns measure the
same work.

Everything runs on loopback and stops after the calls.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from loadtest.redis_server import RedisServer, redis_server
from loadtest.report import format_table
from router.config import BackendConfig
from router.fleet.backends import BackendPool
from router.fleet.shared_load import SharedLoad
from router.index.memory import MemoryIndex
from router.index.redis_store import RedisIndex
from router.redis.breaker import open_link
from router.redis.settings import RedisConfig

#: The interval the table compares with the default settings': the default before 2026-12-07.
OLD_INTERVAL_S = 0.1
#: Calls measured per fleet by default.
CALLS = 400
#: Picks measured per fleet by default: a pick's two scripts cost less each than a call, and
#: what the view adds is a difference of two measurements (400 picks moved it by +-50 %).
PICKS = 2000
#: ``--picks``: prompts share one of this many prefixes, so lookups find matches.
PREFIXES = 16
#: ``--picks``: blocks per prompt, of which the first half is its prefix's.
CHAIN_BLOCKS = 16


def fleet_size(text: str) -> tuple[int, int]:
    """``RxB`` -> (replicas, backends)."""
    replicas, _, backends = text.partition("x")
    return int(replicas), int(backends)


def backend_configs(backends: int) -> list[BackendConfig]:
    return [BackendConfig(name=f"e{i}", url="http://127.0.0.1:1") for i in range(backends)]


def set_busy_counts(pool: BackendPool, rng: random.Random) -> None:
    """Every count moves between calls: the busy case, each publish a change."""
    for backend in pool:
        backend.in_flight = rng.randrange(8)
        backend.pending_prefill_tokens = rng.randrange(10_000)
        backend.pending_prefill_requests = rng.randrange(4)


def redis_work(server: RedisServer) -> tuple[int, int]:
    """Redis's CPU time in its commands since the last reset, in µs, and the scripts it ran."""
    stats = server.client().info("commandstats")
    scripts = sum(entry["calls"] for name, entry in stats.items() if "eval" in name)
    return sum(entry["usec"] for entry in stats.values()), scripts


async def redis_usec_per_call(replicas: int, backends: int, calls: int) -> tuple[float, float]:
    """Redis's CPU time, in µs, per shared-load call of ``replicas`` replicas over ``backends``,
    and the seconds between a replica's calls with the default settings."""
    with redis_server() as server:
        config = RedisConfig(url=server.url)
        names = backend_configs(backends)
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
                set_busy_counts(view.pool, rng)
                await view.sync_once()
            stats = [v for k, v in client.info("commandstats").items() if "eval" in k]
            return sum(s["usec"] for s in stats) / sum(s["calls"] for s in stats), views[0].interval()
        finally:
            for link in links:
                await link.close()


@dataclass(frozen=True)
class PickCost:
    """Redis's work per pick (a lookup and its write), and whether the view rode on them."""

    usec: float
    scripts: float
    rides: bool


async def redis_work_per_pick(replicas: int, backends: int, picks: int, ride: bool) -> PickCost:
    """What a pick of ``replicas`` replicas over ``backends`` with ``lookup: shared`` and
    ``load_on_lookup`` set to ``ride`` costs Redis (a fleet past ``load_interval_fleet`` does
    not ride, whatever ``ride`` is)."""
    with redis_server() as server:
        config = RedisConfig(url=server.url, load_on_lookup=ride)
        names = [backend.name for backend in backend_configs(backends)]
        indexes = [
            RedisIndex(open_link(config, CollectorRegistry()), MemoryIndex(1 << 20)) for _ in range(replicas)
        ]
        try:
            views = []
            for index in indexes:
                for name in names:
                    index.add_backend(name, 1 << 16)
                view = SharedLoad(index.link, BackendPool(backend_configs(backends)))
                if ride:
                    view.ride(index)
                await view.sync_once()  # every replica live, and its interval known
                views.append(view)
            rng = random.Random(0)
            prefixes = [[rng.getrandbits(63) for _ in range(CHAIN_BLOCKS // 2)] for _ in range(PREFIXES)]

            async def pick(k: int) -> None:
                index, view = indexes[k % replicas], views[k % replicas]
                set_busy_counts(view.pool, rng)
                chain = rng.choice(prefixes) + [rng.getrandbits(63) for _ in range(CHAIN_BLOCKS // 2)]
                await index.match(chain, names)
                index.picked(rng.choice(names), chain)
                await index.flush()

            for k in range(replicas):  # the scripts loaded (a first call compiles them)
                await pick(k)
            server.client().config_resetstat()
            for k in range(picks):
                await pick(k)
            usec, scripts = redis_work(server)
            return PickCost(usec / picks, scripts / picks, views[0].riding())
        finally:
            for index in indexes:
                await index.link.close()


async def picks_table(args: argparse.Namespace) -> str:
    rows = []
    for replicas, backends in args.fleets:
        off = await redis_work_per_pick(replicas, backends, args.calls, ride=False)
        on = await redis_work_per_pick(replicas, backends, args.calls, ride=True)
        call, interval = await redis_usec_per_call(replicas, backends, args.calls)
        added = (on.usec - off.usec) * args.rate / 1e6
        periodic = call * replicas / (interval * 1e6)
        rows.append(
            [
                f"{replicas} x {backends}",
                "yes" if on.rides else "no",
                f"{off.scripts:g} / {on.scripts:g}",
                f"{off.usec:,.0f} µs",
                f"{on.usec:,.0f} µs",
                f"{added:.1%}",
                f"{periodic:.1%}",
            ]
        )
    headers = ["replicas x backends", "rides", "scripts per pick: off / on", "Redis per pick: view off"]
    headers += ["view on", f"added at {args.rate:g} picks/s", "periodic calls"]
    return format_table(headers, rows)


async def main_async(args: argparse.Namespace) -> int:
    if args.picks:
        print(await picks_table(args))
        return 0
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
    parser.add_argument(
        "--calls", type=int, help=f"calls (or picks) measured per fleet (default: {CALLS}, or {PICKS} picks)"
    )
    parser.add_argument(
        "--picks", action="store_true", help="what load_on_lookup adds to each pick (lookup and write)"
    )
    parser.add_argument(
        "--rate", type=float, default=300.0, help="--picks: picks a second across the fleet, for the shares"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.calls is None:
        args.calls = PICKS if args.picks else CALLS
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
