"""Shared state in Redis, measured: does a fleet of router replicas route like one router?

    python -m loadtest.bench_redis [--requests 300] [--speedup 10] [--engines 4] [--replicas 4]
                                   [--spread-s S] [--policy NAME] [--params JSON]
                                   [--load-interval-s S] [--no-load-on-lookup] [--lookup-timeout-ms MS]

One invocation replays the same slice of the Mooncake conversation trace (time-compressed,
streaming) against a fresh simulated fleet for each contender, each router a real
``kvroute serve`` process:

  (a) one router, memory store            the reference: one router sees everything
  (b) one router, Redis store             what Redis costs one router
  (c) N replicas sharing one Redis        the point of this feature
  (d) N replicas, each its own memory     what replicas lose without it
  (e) N replicas, lookups local, synced   each its own copy of the index, kept in step over a
      over a Redis stream                 Redis stream (index.redis.lookup: local)
  (f) one router, --workers W, lookups    (e)'s sync between the worker processes of one
      local                               ``kvroute serve --workers W`` on one port
  (g) one router, --workers W, memory     the workers sharing over Unix sockets instead
      store                               (router/fleet/worker_sync.py), no Redis

Requests go to the replicas round robin, as a Kubernetes Service would spread them; the
kernel spreads (f)'s and (g)'s connections over their workers (SO_REUSEPORT). The
table gives the engines' hit ratio (engine-reported cached prompt tokens / prompt tokens),
TTFT at the client and at the engines (arrival there to first token: what placement decides,
without the routers' own processing, which on a shared machine grows with the number of
router processes whatever they decide), the routers' p99 decision time
(``kvroute_routing_decision_seconds``, merged over replicas), the Redis lookup's, and the
lookups routed on a local view instead (fallbacks, of which timeouts), all relative to (a)
from the same run. Below it: the Redis memory per stored (backend, block) entry and the
index's total for the trace.

The Mooncake trace's timestamps come in ticks of 3 s, about ten requests each, which a replay
sends at the same instant: each replica then decides its share of a tick on the same picture
of the fleet, before any of them has published what it sent. ``--spread-s 3`` spreads each
tick's arrivals over its 3 s (seeded by ``--seed``) as the real arrivals were.

Everything runs on this machine's loopback; the replay is bounded by the trace slice and
each request by a timeout. On a small shared machine the routers, the engines, the load
generator and Redis compete for the same cores: compare rows, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.client import Result, stream_chat
from loadtest.contenders import cpu_list
from loadtest.ports import free_port
from loadtest.redis_server import RedisServer
from loadtest.report import format_table, percentile, summarize
from loadtest.sim.fleet import SimFleet
from loadtest.sim.timing import EngineTiming
from loadtest.trace import DEFAULT_TRACE, TraceRequest, prompt_messages, read_trace, spread_arrivals
from router.config import config_from_dict
from router.index.build import build_index
from router.index.redis_store import RedisIndex
from router.metrics import RouterMetrics

MODEL = "sim-model"
#: Router blocks are 256 characters = 64 simulated tokens (4 characters per token).
ROUTER_BLOCK_TOKENS = 64
#: Requests sent one at a time after the replay, on the warm index: the decision time of a
#: router that is not competing for a core with the fleet, the client and the other routers.
AT_REST_REQUESTS = 100


@dataclass(frozen=True)
class Contender:
    label: str
    replicas: int
    store: str
    #: ``index.redis.lookup`` of a Redis contender: shared (a round trip a lookup) or local.
    lookup: str = "shared"
    #: ``kvroute serve --workers`` of each replica (1: one process).
    workers: int = 1


@dataclass
class Outcome:
    contender: Contender
    results: list[Result]
    wall_s: float
    decision_p50: float
    decision_p99: float
    match_p50: float
    match_p99: float
    fallbacks: float
    #: Lookups past their deadline; the other fallbacks came while Redis counted as down.
    timeouts: float
    #: Decision time of the requests sent one at a time after the replay (AT_REST_REQUESTS).
    rest_p50: float
    rest_p99: float
    #: Mean time from a streamed request's arrival at its engine to its first token (queue and
    #: prefill): the part of TTFT placement decides, without the routers' own processing, which
    #: on a shared machine grows with the number of router processes whatever they decide.
    engine_ttft_mean: float


def prioritize(pid: int, nice: int, cpus: set[int] | None = None) -> None:
    """Give ``pid`` the scheduling priority ``nice`` (0: leave it) and the CPUs ``cpus`` (None: any)."""
    if nice:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    if cpus:
        os.sched_setaffinity(pid, cpus)


@contextlib.contextmanager
def routers(
    contender: Contender,
    urls: Sequence[str],
    capacity_blocks: int,
    redis_url: str | None,
    workdir: Path,
    nice: int,
    redis_options: dict,
    cpus: set[int] | None = None,
    routing: dict | None = None,
) -> Iterator[list[str]]:
    """``contender.replicas`` ``kvroute serve`` processes in front of ``urls``; their base URLs."""
    processes: list[subprocess.Popen[bytes]] = []
    bases = []
    try:
        for i in range(contender.replicas):
            port = free_port()
            index: dict = {"store": contender.store, "backend_capacity_blocks": capacity_blocks}
            if contender.store == "redis":
                index["redis"] = {
                    "url": redis_url,
                    "namespace": contender.label,
                    "lookup": contender.lookup,
                    **redis_options,
                }
            # Workers each bind the admin listener with SO_REUSEPORT: a fixed port, not 0.
            admin_port = free_port() if contender.workers > 1 else 0
            config = {
                "listen": {"host": "127.0.0.1", "port": port},
                "admin": {"listen": {"host": "127.0.0.1", "port": admin_port}},
                "backends": [{"name": f"e{j}", "url": u, "models": [MODEL]} for j, u in enumerate(urls)],
                "routing": {"seed": i + 1, **(routing or {})},
                "index": index,
                "log_level": "warning",
            }
            path = workdir / f"{contender.label}-{i}.yaml"
            path.write_text(yaml.safe_dump(config))
            command = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)]
            if contender.workers > 1:
                command += ["--workers", str(contender.workers)]
            with open(workdir / f"{contender.label}-{i}.log", "wb") as log:
                processes.append(
                    subprocess.Popen(
                        command,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            prioritize(processes[-1].pid, nice, cpus)
            bases.append(f"http://127.0.0.1:{port}")
        yield bases
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def wait_ready(http: aiohttp.ClientSession, bases: Sequence[str], timeout_s: float = 60) -> None:
    """Until every router is ready and answers ``/metrics``: under ``--workers`` the first worker
    up answers ``/ready``, while a scrape fails (503) until every worker reports its metrics
    (router/http/worker_metrics.py), which a cold start (a fresh clone compiling its bytecode)
    had delay past a short replay."""
    deadline = time.monotonic() + timeout_s
    for base in bases:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{base}/ready") as ready, http.get(f"{base}/metrics") as metrics:
                    if ready.status == 200 and metrics.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {base} not ready after {timeout_s} s")
            await asyncio.sleep(0.1)


async def replay(
    bases: Sequence[str], trace: Sequence[TraceRequest], speedup: float, max_tokens: int
) -> list[Result]:
    """Send each trace request at its (compressed) arrival time to the next replica, round robin."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()
        origin = trace[0].arrival_s

        async def one(i: int, request: TraceRequest) -> Result:
            delay = (request.arrival_s - origin) / speedup - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            messages = prompt_messages(request)
            tokens = min(request.output_tokens, max_tokens)
            return await stream_chat(http, bases[i % len(bases)], MODEL, messages, max_tokens=tokens)

        return await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))


async def scrape(http: aiohttp.ClientSession, base: str) -> list:
    async with http.get(f"{base}/metrics") as resp:
        return list(text_string_to_metric_families(await resp.text()))


def merged_buckets(families_per_router: Sequence[list], name: str, **labels: str) -> dict[float, float]:
    """Cumulative histogram buckets ``{le: count}`` of ``name`` summed over routers."""
    buckets: dict[float, float] = {}
    for families in families_per_router:
        for family in families:
            for sample in family.samples:
                if sample.name != f"{name}_bucket":
                    continue
                if any(sample.labels.get(k) != v for k, v in labels.items()):
                    continue
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


def quantile(buckets: dict[float, float], q: float) -> float:
    """``q``-quantile by linear interpolation within a bucket (Prometheus' histogram_quantile)."""
    if not buckets or buckets.get(math.inf, 0) == 0:
        return math.nan
    rank = q * buckets[math.inf]
    lower, below = 0.0, 0.0
    for le in sorted(buckets):
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


async def decisions_at_rest(
    http: aiohttp.ClientSession, bases: Sequence[str], trace: Sequence[TraceRequest]
) -> dict[float, float]:
    """Decision-time buckets of the first AT_REST_REQUESTS trace requests, sent one at a time."""
    name = "kvroute_routing_decision_seconds"
    before = merged_buckets([await scrape(http, base) for base in bases], name)
    for i, request in enumerate(trace[:AT_REST_REQUESTS]):
        await stream_chat(http, bases[i % len(bases)], MODEL, prompt_messages(request), max_tokens=1)
    after = merged_buckets([await scrape(http, base) for base in bases], name)
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def counter_total(families_per_router: Sequence[list], name: str, **labels: str) -> float:
    return sum(
        s.value
        for families in families_per_router
        for f in families
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def run_contender(
    contender: Contender,
    trace: Sequence[TraceRequest],
    args: argparse.Namespace,
    redis_url: str,
    workdir: Path,
) -> Outcome:
    timing = EngineTiming(kv_blocks=args.kv_blocks, prefill_per_token_s=args.prefill_per_token_s)
    capacity = args.kv_blocks * timing.block_tokens // ROUTER_BLOCK_TOKENS
    async with SimFleet(args.engines, timing=timing) as fleet:
        redis_options: dict[str, float | bool] = {}
        if args.lookup_timeout_ms is not None:
            redis_options["timeout_ms"] = args.lookup_timeout_ms
        if args.write_batch_blocks is not None:
            redis_options["write_batch_blocks"] = args.write_batch_blocks
        if args.load_interval_s is not None:
            redis_options["load_interval_s"] = args.load_interval_s
        if args.no_load_on_lookup:
            redis_options["load_on_lookup"] = False
        routing = {
            **({"policy": args.policy} if args.policy else {}),
            **({"params": args.params} if args.params else {}),
        }
        placement = (workdir, args.nice, redis_options, args.router_cpus, routing)
        with routers(contender, fleet.urls, capacity, redis_url, *placement) as bases:
            async with aiohttp.ClientSession() as http:
                try:
                    await wait_ready(http, bases)
                except RuntimeError as exc:
                    logs = "".join(
                        p.read_text(errors="replace") for p in workdir.glob(f"{contender.label}-*.log")
                    )
                    raise RuntimeError(f"{exc}; router logs:\n{logs[-3000:]}") from None
                started = time.perf_counter()
                results = await replay(bases, trace, args.speedup, args.max_tokens)
                wall = time.perf_counter() - started
                engine_ttft = engine_ttft_mean(fleet)
                families = [await scrape(http, base) for base in bases]
                rest = await decisions_at_rest(http, bases, trace)
    decisions = merged_buckets(families, "kvroute_routing_decision_seconds")
    matches = merged_buckets(families, "kvroute_redis_latency_seconds", op="match")
    return Outcome(
        contender,
        results,
        wall,
        decision_p50=quantile(decisions, 0.5),
        decision_p99=quantile(decisions, 0.99),
        match_p50=quantile(matches, 0.5),
        match_p99=quantile(matches, 0.99),
        fallbacks=counter_total(families, "kvroute_redis_fallbacks_total"),
        timeouts=counter_total(families, "kvroute_redis_errors_total", op="match", kind="timeout"),
        rest_p50=quantile(rest, 0.5),
        rest_p99=quantile(rest, 0.99),
        engine_ttft_mean=engine_ttft,
    )


def engine_ttft_mean(fleet: SimFleet) -> float:
    """The mean engine-side TTFT of the streamed requests the fleet finished (the replay's; the
    routers' warm-ups are not streamed); NaN if an engine finished more than it keeps records of."""
    schedulers = [engine.scheduler for engine in fleet.engines]
    if any(s.completed > (s.records.maxlen or 0) for s in schedulers):
        return math.nan
    ttfts = [r.ttft_s for s in schedulers for r in s.records if r.stream]
    return sum(ttfts) / len(ttfts) if ttfts else math.nan


def redis_memory(server: RedisServer, namespace: str, baseline: int) -> tuple[int, int, int]:
    """(entries, MEMORY USAGE of the namespace's block ZSETs or belief stream, used_memory above
    ``baseline``); entries are (backend, block) pairs in the ZSETs, batches in the stream."""
    client = server.client()
    keys = list(client.scan_iter(f"{{{namespace}}}:blocks:*"))
    entries = sum(client.zcard(k) for k in keys)
    stream = f"{{{namespace}}}:beliefs"
    if client.exists(stream):
        keys.append(stream)
        entries += client.xlen(stream)
    usage = sum(client.memory_usage(k, samples=0) or 0 for k in keys)
    return entries, usage, client.info("memory")["used_memory"] - baseline


async def lookup_latency(redis_url: str, trace: Sequence[TraceRequest], engines: int) -> tuple[float, float]:
    """p50 and p99 of RedisIndex.match alone, one at a time, over the trace's chains: what a lookup
    costs without the rest of a busy router around it (no HTTP, no engines, no other requests)."""
    names = [f"e{i}" for i in range(engines)]
    config = config_from_dict(
        {
            "backends": [{"name": n, "url": "http://127.0.0.1:1"} for n in names],
            "index": {
                "store": "redis",
                "redis": {"url": redis_url, "namespace": "lookup", "timeout_ms": 1000},
            },
        }
    )
    index = build_index(config, RouterMetrics())
    assert isinstance(index, RedisIndex)
    await index.start()
    try:
        chains = [request.chain(ROUTER_BLOCK_TOKENS) for request in trace]
        for i, chain in enumerate(chains):
            index.record(names[i % engines], chain)
        await index.flush()
        timings = []
        for chain in chains:
            started = time.perf_counter()
            await index.match(chain, names)
            timings.append(time.perf_counter() - started)
    finally:
        await index.close()
    return percentile(timings, 0.5), percentile(timings, 0.99)


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.2f} ms"


async def main_async(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace, limit=args.requests)
    if args.spread_s:
        trace = spread_arrivals(trace, args.spread_s, seed=args.seed)
    contenders = [
        Contender("a_one_memory", 1, "memory"),
        Contender("b_one_redis", 1, "redis"),
        Contender(f"c_{args.replicas}_shared_redis", args.replicas, "redis"),
        Contender(f"d_{args.replicas}_own_memory", args.replicas, "memory"),
        Contender(f"e_{args.replicas}_synced_redis", args.replicas, "redis", lookup="local"),
        Contender(f"f_workers_{args.workers}_synced", 1, "redis", lookup="local", workers=args.workers),
        Contender(f"g_workers_{args.workers}_memory", 1, "memory", workers=args.workers),
    ]
    contenders = [c for c in contenders if c.label[0] in args.contenders]
    span = trace[-1].arrival_s - trace[0].arrival_s
    print(
        f"bench_redis: {len(trace)} trace requests ({span:.0f} s of trace at {args.speedup:g}x"
        + (f", arrivals spread over {args.spread_s:g} s, seed {args.seed}" if args.spread_s else "")
        + f"), {args.engines} simulated engines of {args.kv_blocks * 16:,} KV tokens, streaming\n",
        flush=True,
    )
    outcomes: list[Outcome] = []
    memory_rows = []
    if args.router_cpus:
        # The fleet and the client (this process) keep off the routers' and Redis's CPUs.
        others = os.sched_getaffinity(0) - args.router_cpus
        if not others or not args.router_cpus <= os.sched_getaffinity(0):
            print("bench_redis: --router-cpus must name some, not all, of the CPUs", file=sys.stderr)
            return 2
        os.sched_setaffinity(0, others)
    server = RedisServer().start()
    prioritize(server.process.pid, args.nice, args.router_cpus)
    try:
        with tempfile.TemporaryDirectory(prefix="kvroute-bench-redis-") as tmp:
            for contender in contenders:
                baseline = server.client().info("memory")["used_memory"]
                outcome = await run_contender(contender, trace, args, server.url, Path(tmp))
                outcomes.append(outcome)
                print(f"  {contender.label}: {outcome.wall_s:.1f} s", flush=True)
                if contender.store == "redis":
                    memory_rows.append((contender.label, *redis_memory(server, contender.label, baseline)))
            lookup_p50, lookup_p99 = await lookup_latency(server.url, trace, args.engines)
    finally:
        server.close()

    reference = summarize(outcomes[0].results)
    rows = []
    for outcome in outcomes:
        s = summarize(outcome.results)
        rows.append(
            [
                outcome.contender.label,
                s.ok,
                s.failed,
                f"{s.hit_ratio:.1%}",
                f"{s.hit_ratio / max(reference.hit_ratio, 1e-9):.3f}",
                ms(s.ttft_mean),
                f"{s.ttft_mean / max(reference.ttft_mean, 1e-9):.2f}",
                ms(outcome.engine_ttft_mean),
                f"{outcome.engine_ttft_mean / max(outcomes[0].engine_ttft_mean, 1e-9):.2f}",
                ms(s.ttft_p50),
                ms(s.ttft_p99),
                ms(outcome.decision_p50),
                ms(outcome.decision_p99),
                ms(outcome.match_p50),
                ms(outcome.match_p99),
                int(outcome.fallbacks),
                int(outcome.timeouts),
                ms(outcome.rest_p50),
                ms(outcome.rest_p99),
            ]
        )
    print()
    headers = ["contender", "ok", "failed", "hit ratio", "hit vs (a)", "TTFT mean", "vs (a)"]
    headers += ["at engine", "vs (a)", "TTFT p50", "TTFT p99"]
    headers += ["decision p50", "p99", "redis match p50", "p99", "fallbacks", "timeouts"]
    headers += ["at rest p50", "p99"]
    print(format_table(headers, rows))
    if len(outcomes) > 1 and outcomes[1].contender.label == "b_one_redis":
        a, b = outcomes[0], outcomes[1]
        print(
            f"\nRedis added {ms(b.decision_p50 - a.decision_p50)} to the median decision time and "
            f"{ms(b.decision_p99 - a.decision_p99)} to its p99 ((b) - (a)); at rest, one request at a "
            f"time after the replay, {ms(b.rest_p50 - a.rest_p50)} and {ms(b.rest_p99 - a.rest_p99)}."
        )
    print(
        f"A lookup alone (RedisIndex.match, one at a time, the trace's {len(trace)} chains over "
        f"{args.engines} backends): p50 {ms(lookup_p50)}, p99 {ms(lookup_p99)}."
    )
    print("\nRedis memory of the index at the end of each Redis run:")
    print(
        format_table(
            ["run", "entries", "MEMORY USAGE", "per entry", "used_memory delta", "per entry "],
            [
                [
                    label,
                    f"{n:,}",
                    f"{usage:,} B",
                    f"{usage / max(n, 1):.0f} B",
                    f"{used:,} B",
                    f"{used / max(n, 1):.0f} B",
                ]
                for label, n, usage, used in memory_rows
            ],
        )
    )
    return 0 if all(summarize(o.results).failed == 0 for o in outcomes) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_redis", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace (JSONL)")
    parser.add_argument("--requests", type=int, default=300, help="first N requests of the trace")
    parser.add_argument("--speedup", type=float, default=10.0, help="time compression of the arrivals")
    parser.add_argument(
        "--spread-s",
        type=float,
        default=0.0,
        help="move each arrival later by a random offset below this many trace seconds (3: spread "
        "the Mooncake trace's 3-second ticks, whose requests otherwise arrive at once)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --spread-s")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4, help="router replicas in (c), (d) and (e)")
    parser.add_argument("--kv-blocks", type=int, default=65536, help="KV blocks of 16 tokens per engine")
    parser.add_argument("--prefill-per-token-s", type=float, default=4e-6, help="simulated uncached prefill")
    parser.add_argument("--max-tokens", type=int, default=16, help="cap on each request's output tokens")
    parser.add_argument(
        "--lookup-timeout-ms", type=float, help="the routers' index.redis.timeout_ms (default: its default)"
    )
    parser.add_argument(
        "--write-batch-blocks",
        type=int,
        help="the routers' index.redis.write_batch_blocks (default: its default)",
    )
    parser.add_argument(
        "--load-interval-s",
        type=float,
        help="the routers' index.redis.load_interval_s (default: its default)",
    )
    parser.add_argument(
        "--no-load-on-lookup",
        action="store_true",
        help="the routers' index.redis.load_on_lookup off: (c) shares its load view only every "
        "load_interval_s, as before 2026-12-07",
    )
    parser.add_argument("--policy", help="the routers' routing.policy (default: the code default)")
    parser.add_argument(
        "--params",
        type=json.loads,
        help="the routers' routing.params as JSON, e.g. '{\"warmup_blocks\": 0}' (default: none)",
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes of the one router of (f) and (g)"
    )
    parser.add_argument(
        "--contenders", default="abcdefg", help="which of (a)-(g) to run; (a) is the reference"
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="scheduling priority (e.g. -10, as root) of the routers and redis-server, standing in for "
        "the cores of their own they have in production; engines and load generator keep theirs",
    )
    parser.add_argument(
        "--router-cpus",
        type=cpu_list,
        help="CPUs (e.g. 1) for the routers and redis-server alone; the fleet and the client get the "
        "others: the cores of their own that routers have in production",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
