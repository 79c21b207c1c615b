"""The live routing benchmark: a Mooncake trace slice, time-compressed, through each router.

    kvroute bench routing --minutes 10 --speedup 10 --engines 8 --capacity 1000000
    (or python -m loadtest.bench_routing ...)

For every contender — kvroute with each main policy, kvroute with plain round robin, and
SGLang's router (``sglang-router``, ``cache_aware``) when installed — a fresh fleet of
simulated engines (``kvroute sim``, its own process: empty caches every time) and a fresh
router process start; the trace's requests are sent at their (compressed) arrival times as
streaming chat completions whose prompts realise the trace's prefix structure
(:func:`loadtest.trace.prompt_messages`); then everything is stopped. One table compares them:
engine-reported hit ratio, TTFT mean/p50/p99 and end-to-end p50 as the client measures
them, throughput, failed requests, and the largest engine's share of requests over the
mean share. Beside it: the pooled-LRU and TTFT-floor bounds computed from the trace, and
what the offline simulator predicts for the same slice, to show where virtual time and the
live fleet disagree; and what each contender cost beyond the clients' requests, with the
clients' mean TTFT split at the engines (what placement decides) and outside them (the router,
the client, HTTP; the contender ``floor``, a proxy that does no routing, shows that part's
least on this stack).

Everything runs on this machine: the client, the engines and the router share its CPUs, so
absolute latencies include their contention; compare contenders within one run, as ratios.
``--minutes``, ``--speedup``, ``--engines`` and ``--max-output-tokens`` size the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest import workloads
from loadtest.client import Result, stream_chat
from loadtest.contenders import ADMIN_ON_ANY_PORT, Contender, floor, sglang, wait_listening
from loadtest.help_format import DefaultsHelpFormatter
from loadtest.ports import free_port, free_ports
from loadtest.report import Latencies, busiest_share, format_table, ratio, request_hit_ratio
from loadtest.sim.timing import EngineTiming
from loadtest.simulate import FleetModel, bounds, load_source, simulate
from loadtest.trace import DEFAULT_TRACE, TraceRequest, prompt_messages

MODEL = "sim-model"
#: kvroute contenders: (policy, routing params, closed-loop beliefs, routing.retention.refresh_share).
KVROUTE = {
    "round_robin": ("round_robin", {}, False, 0.0),
    "least_load": ("least_load", {}, False, 0.0),
    "prefix_aware": ("prefix_aware", {}, False, 0.0),
    "weighted": ("weighted", {}, False, 0.0),
    "cost": ("cost", {}, False, 0.0),
    "cost+closed_loop": ("cost", {}, True, 0.0),
    "latency": ("latency", {}, False, 0.0),
    "latency+refresh": ("latency", {}, False, 0.5),
    "latency+refresh0.25": ("latency", {}, False, 0.25),
    "latency+refresh0.35": ("latency", {}, False, 0.35),
}
#: Contenders that are not kvroute: SGLang's router, and ``floor``, aiohttp's server and
#: kvroute's upstream client passing requests round robin with no routing at all (what any
#: Python proxy on this stack costs: the work table's TTFT outside the engines).
OTHERS = {"sglang": sglang, "floor": floor}
DEFAULT_CONTENDERS = ("round_robin", "least_load", "prefix_aware", "cost", "latency", "sglang")


@dataclass(frozen=True)
class Bench:
    trace: Path
    minutes: float
    speedup: float
    engines: int
    #: KV tokens per engine (engines cache in 16-token blocks: capacity / 16 KV blocks).
    capacity_tokens: int
    #: The router's believed capacity per engine in tokens (kvroute's per-backend capacity_blocks).
    belief_capacity_tokens: int
    #: Cap on each request's output tokens (0: the trace's own); streaming cost grows with it.
    max_output_tokens: int
    #: Replace every prefix id by a fresh one: the same load with no prefix reuse at all.
    no_reuse: bool
    #: ``mooncake`` (the trace) or a generated workload of :mod:`loadtest.workloads`.
    workload: str = "mooncake"
    #: Seeds a generated workload.
    seed: int = 0
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Work:
    """The engines' counters (``GET /sim/stats``) and the processes' CPU time: at one moment, or
    over a replay (:meth:`since`)."""

    #: Requests each engine received.
    received: list[int] = field(default_factory=list)
    #: Prompt tokens the engines computed (not found cached), over the fleet.
    prefilled: int = 0
    #: CPU seconds of the router's and the engines' processes.
    router_cpu_s: float = 0.0
    engines_cpu_s: float = 0.0
    #: Streamed requests' first tokens at the engines, and their summed TTFT there (from arrival
    #: in the engine's scheduler): the clients' TTFT less the router, the client and HTTP.
    first_tokens: int = 0
    engines_ttft_s: float = 0.0

    def since(self, before: Work) -> Work:
        return Work(
            [n - b for n, b in zip(self.received, before.received, strict=True)],
            self.prefilled - before.prefilled,
            self.router_cpu_s - before.router_cpu_s,
            self.engines_cpu_s - before.engines_cpu_s,
            self.first_tokens - before.first_tokens,
            self.engines_ttft_s - before.engines_ttft_s,
        )

    @property
    def engines_ttft_mean(self) -> float:
        return self.engines_ttft_s / self.first_tokens if self.first_tokens else math.nan


@dataclass(frozen=True)
class Row:
    name: str
    results: list[Result]
    wall_s: float
    #: What the fleet and the processes did over the replay.
    work: Work = field(default_factory=Work)
    #: kvroute's warm-ups (refreshes included) by outcome, and its refreshes started.
    warmups: dict[str, float] = field(default_factory=dict)
    refreshes: float = 0.0
    missing: str | None = None


def load_requests(bench: Bench) -> list[TraceRequest]:
    source = str(bench.trace) if bench.workload == "mooncake" else bench.workload
    requests = load_source(
        source, minutes=bench.minutes, limit=None, seed=bench.seed, max_output_tokens=bench.max_output_tokens
    )
    return workloads.fresh_ids(requests) if bench.no_reuse else requests


def _kvroute_bin() -> str:
    return shutil.which("kvroute") or str(Path(sys.executable).with_name("kvroute"))


def _engines(bench: Bench, workdir: Path) -> tuple[Contender, list[str]]:
    base = free_ports(bench.engines)
    kv_blocks = bench.capacity_tokens // EngineTiming().block_tokens
    command = [_kvroute_bin(), "sim", "--engines", str(bench.engines), "--port", str(base)]
    command += ["--kv-blocks", str(kv_blocks)]
    urls = [f"http://127.0.0.1:{base + i}" for i in range(bench.engines)]
    return Contender("engines", base, command), urls


def _kvroute(
    name: str, bench: Bench, urls: Sequence[str], workdir: Path, checkout: Path | None = None
) -> Contender:
    """kvroute with the contender ``name``'s routing; ``checkout``: the kvroute of another source
    tree (``git worktree add /tmp/before HEAD~1``), named ``kvroute baseline NAME``."""
    policy, params, closed_loop, refresh_share = KVROUTE[name]
    port = free_port()
    block_tokens = 64  # index.block_size 256 characters at 4 characters per token
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        ADMIN_ON_ANY_PORT,
        "log_level: warning",
        f"routing: {{policy: {policy}, params: {params or '{}'}, seed: 1, "
        f"retention: {{refresh_share: {refresh_share}}}}}",
        f"index: {{closed_loop: {'true' if closed_loop else 'false'}}}",
        "health: {interval_s: 1.0}",
        "backends:",
    ]
    # Pinned per backend: the believed capacity may differ from the engines' on purpose
    # (--belief-capacity), and a backend's own capacity_blocks wins over its engine's report.
    capacity = bench.belief_capacity_tokens // block_tokens
    lines += [
        f"  - {{name: e{i}, url: '{url}', models: [{MODEL}], capacity_blocks: {capacity}}}"
        for i, url in enumerate(urls)
    ]
    config = workdir / f"kvroute-{name}-{port}.yaml"
    config.write_text("\n".join(lines) + "\n")
    command = [_kvroute_bin(), "serve", "--config", str(config)]
    if checkout is None:
        return Contender(f"kvroute {name}", port, command)
    return Contender(f"kvroute baseline {name}", port, command, env={"PYTHONPATH": str(checkout.resolve())})


async def wait_serving(url: str, timeout: float, model: str = MODEL) -> None:
    """Until the router answers a chat request (kvroute needs its first health check first)."""
    deadline = time.monotonic() + timeout
    body = {"model": model, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not serve a request within {timeout:.0f} s")


async def _replay(url: str, requests: Sequence[TraceRequest], bench: Bench) -> list[Result]:
    """Each request at its compressed arrival time, whatever the ones before it are doing."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one(request: TraceRequest) -> Result:
            await asyncio.sleep(max(0.0, start + request.arrival_s / bench.speedup - time.perf_counter()))
            messages = prompt_messages(request)
            return await stream_chat(
                session, url, MODEL, messages, max_tokens=request.output_tokens, timeout_s=bench.timeout_s
            )

        return await asyncio.gather(*(one(r) for r in requests))


async def _warmups(url: str) -> tuple[dict[str, float], float]:
    """The router's warm-ups by outcome and refreshes started, from its ``/metrics``."""
    outcomes: dict[str, float] = {}
    refreshes = 0.0
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvroute_warmups_total":
                outcome = sample.labels["outcome"]
                outcomes[outcome] = outcomes.get(outcome, 0.0) + sample.value
            elif sample.name == "kvroute_refreshes_total":
                refreshes += sample.value
    return outcomes, refreshes


async def _stats(urls: Sequence[str]) -> list[dict[str, int]]:
    async with aiohttp.ClientSession() as session:
        stats = []
        for url in urls:
            async with session.get(f"{url}/sim/stats") as resp:
                stats.append(await resp.json())
        return stats


def _work(urls: Sequence[str], router: Contender, engines: Contender) -> Work:
    stats = asyncio.run(_stats(urls))
    return Work(
        [int(s["received"]) for s in stats],
        sum(int(s["prompt_tokens"]) - int(s["cached_tokens"]) for s in stats),
        router.cpu_seconds(),
        engines.cpu_seconds(),
        sum(int(s["streamed_first_tokens"]) for s in stats),
        sum(int(s["streamed_ttft_us"]) for s in stats) / 1e6,
    )


def start_serving(engines: Contender, count: int, router: Contender, workdir: Path) -> str:
    """Start ``count`` engines (``kvroute sim`` on consecutive ports) and the router in front of
    them; the router's URL once it serves a request."""
    engines.start(workdir)
    for i in range(count):
        wait_listening(engines.port + i, 30.0, engines.process)
    router.start(workdir)
    wait_listening(router.port, 60.0, router.process)
    url = f"http://127.0.0.1:{router.port}"
    asyncio.run(wait_serving(url, 60.0))
    return url


def run_contender(
    name: str, bench: Bench, requests: Sequence[TraceRequest], workdir: Path, checkout: Path | None = None
) -> Row:
    """Replay ``requests`` through the contender ``name`` in front of fresh engines; ``checkout``:
    run a kvroute contender from another source tree."""
    engines, urls = _engines(bench, workdir)
    router = OTHERS[name](urls, None) if name in OTHERS else _kvroute(name, bench, urls, workdir, checkout)
    if router.missing:
        return Row(name, [], 0.0, missing=router.missing)
    try:
        url = start_serving(engines, bench.engines, router, workdir)
        before = _work(urls, router, engines)
        started = time.perf_counter()
        results = asyncio.run(_replay(url, requests, bench))
        wall = time.perf_counter() - started
        work = _work(urls, router, engines).since(before)
        warmups, refreshes = asyncio.run(_warmups(url)) if name in KVROUTE else ({}, 0.0)
        return Row(router.name, results, wall, work, warmups, refreshes)
    except RuntimeError as exc:
        return Row(router.name, [], 0.0, missing=f"{exc}; {router.log_tail() or engines.log_tail()}")
    finally:
        router.stop()
        engines.stop()


@dataclass(frozen=True)
class Figures(Latencies):
    hit_ratio: float
    throughput: float
    #: The busiest engine's share of the requests over the mean share.
    share: float


def figures(row: Row) -> Figures:
    ok = sum(1 for r in row.results if r.ok)
    return Figures(
        **Latencies.fields_of(row.results),
        hit_ratio=request_hit_ratio(row.results),
        throughput=ok / row.wall_s if row.wall_s else math.nan,
        share=busiest_share(row.work.received),
    )


def print_work(rows: Sequence[Row], requests: int) -> None:
    """What each contender cost the fleet beyond the clients' requests (kvroute's warm-ups and
    refreshes), and the CPU each side spent: on this machine the router, the engines and the
    client share the cores, so work that virtual time counts as free still costs latency here.
    And the clients' mean TTFT split at the engines: what placement decides (from arrival in an
    engine's scheduler to its first token) and what is outside it (the router, the client, HTTP)."""
    table = []
    for row in rows:
        if row.missing:
            continue
        work = row.work
        clients_prefill = sum(r.prompt_tokens - r.cached_tokens for r in row.results if r.ok)
        ttft_mean = float(Latencies.fields_of(row.results)["ttft_mean"])
        table.append(
            [
                row.name,
                f"{(sum(work.received) - requests) / requests:.2f}",
                f"{work.prefilled / clients_prefill - 1:+.1%}" if clients_prefill else "-",
                f"{row.refreshes:.0f}",
                " ".join(f"{outcome} {n:.0f}" for outcome, n in sorted(row.warmups.items())) or "-",
                f"{work.router_cpu_s:.1f}",
                f"{work.engines_cpu_s:.1f}",
                f"{work.engines_ttft_mean * 1000:.1f}",
                f"{(ttft_mean - work.engines_ttft_mean) * 1000:.1f}",
            ]
        )
    heads = ["work", "engine requests beyond clients' per request", "engine prefill beyond clients'"]
    heads += ["refreshes", "warm-ups by outcome", "router CPU s", "engines CPU s"]
    heads += ["TTFT mean at engines ms", "outside engines ms"]
    print(format_table(heads, table))


def print_report(bench: Bench, requests: Sequence[TraceRequest], rows: Sequence[Row]) -> None:
    table = []
    figs: dict[str, Figures] = {}
    for row in rows:
        if row.missing:
            table.append([row.name, "not run", "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        f = figs[row.name] = figures(row)
        table.append(
            [
                row.name,
                f.ok,
                f.failed,
                f"{f.hit_ratio:.1%}",
                f"{f.ttft_mean * 1000:.0f}",
                f"{f.ttft_p50 * 1000:.0f}",
                f"{f.ttft_p99 * 1000:.0f}",
                f"{f.e2e_p50 * 1000:.0f}",
                f"{f.throughput:.1f}",
                f"{f.share:.2f}",
            ]
        )
    headers = ["contender", "ok", "failed", "hit ratio", "TTFT mean ms", "p50", "p99", "e2e p50 ms"]
    print(format_table([*headers, "req/s", "max/mean share"], table))
    for row in rows:
        if row.missing:
            print(f"{row.name} not run: {row.missing}")
    print_work(rows, len(requests))

    model = FleetModel(
        engines=bench.engines,
        capacity_tokens=bench.capacity_tokens,
        belief_capacity_tokens=bench.belief_capacity_tokens,
        speedup=bench.speedup,
    )
    b = bounds(requests, model)
    print(
        f"\nbounds: pooled-LRU hit ratio {b.pooled_lru_hit_ratio:.1%}, Belady {b.belady_hit_ratio:.1%}; "
        f"TTFT floor mean "
        f"{b.ttft_floor_mean * 1000:.0f} ms, p99 {b.ttft_floor_p99 * 1000:.0f} ms"
    )
    sgl = figs.get("sglang cache_aware")
    rr = figs.get("kvroute round_robin")
    ll = figs.get("kvroute least_load")
    if sgl or rr:
        print()
        ratios = []
        for name, f in figs.items():
            ratios.append(
                [
                    name,
                    ratio(f.hit_ratio, sgl.hit_ratio) if sgl else "-",
                    ratio(f.ttft_mean, sgl.ttft_mean) if sgl else "-",
                    ratio(f.ttft_p99, sgl.ttft_p99) if sgl else "-",
                    ratio(f.e2e_p50, sgl.e2e_p50) if sgl else "-",
                    ratio(f.e2e_p50, rr.e2e_p50) if rr else "-",
                    ratio(f.ttft_p99, ll.ttft_p99) if ll else "-",
                    f"{f.share:.2f}",
                ]
            )
        heads = ["ratios", "hit vs sglang", "TTFT mean vs sglang", "TTFT p99 vs sglang", "e2e p50 vs sglang"]
        heads += ["e2e p50 vs RR", "TTFT p99 vs least_load", "max/mean share"]
        print(format_table(heads, ratios))

    predicted = []
    for row in rows:
        name = row.name.removeprefix("kvroute ")
        if row.missing or name not in KVROUTE:
            continue
        policy, params, closed_loop, refresh_share = KVROUTE[name]
        run_model = replace(model, closed_loop=closed_loop, refresh_share=refresh_share)
        _, s = simulate(requests, run_model, policy, params, seed=1)
        f = figs[row.name]
        predicted.append(
            [
                row.name,
                f"{s.hit_ratio:.1%} / {f.hit_ratio:.1%}",
                f"{s.ttft_mean * 1000:.0f} / {f.ttft_mean * 1000:.0f}",
                f"{s.ttft_p99 * 1000:.0f} / {f.ttft_p99 * 1000:.0f}",
                f"{s.e2e_p50 * 1000:.0f} / {f.e2e_p50 * 1000:.0f}",
            ]
        )
    if predicted:
        print("\nvirtual time (kvroute simulate) / live, same slice:")
        heads = ["contender", "hit ratio", "TTFT mean ms", "TTFT p99 ms", "e2e p50 ms"]
        print(format_table(heads, predicted))


def main(argv: Sequence[str] | None = None, prog: str = "python -m loadtest.bench_routing") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="Mooncake-format trace, JSONL or .jsonl.gz (the default is the one kvroute ships)",
    )
    parser.add_argument(
        "--workload",
        choices=("mooncake", *workloads.NAMES),
        default="mooncake",
        help="the trace (mooncake) or a generated workload (loadtest/workloads.py)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds a generated workload")
    parser.add_argument("--minutes", type=float, default=10.0, help="trace minutes to replay")
    parser.add_argument("--speedup", type=float, default=10.0, help="time compression")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=1_000_000, help="KV tokens per engine")
    parser.add_argument(
        "--belief-capacity", type=int, help="kvroute's believed tokens per engine (default: true)"
    )
    parser.add_argument("--max-output-tokens", type=int, default=0, help="cap outputs (0: the trace's own)")
    parser.add_argument("--no-reuse", action="store_true", help="fresh prefix ids: a workload without reuse")
    parser.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help=f"comma-separated, of {', '.join([*KVROUTE, *OTHERS])} (default: %(default)s)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another kvroute source tree (git worktree add /tmp/before HEAD~1): each kvroute "
        "contender is run from it too, right after itself, as 'kvroute baseline NAME'",
    )
    args = parser.parse_args(argv)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in KVROUTE and c not in OTHERS]
    if unknown or args.engines < 1 or args.speedup <= 0 or args.capacity < 64:
        parser.error(
            f"unknown contender {unknown[0]!r}" if unknown else "engines, speedup, capacity: positive"
        )
    if args.baseline is not None and not (args.baseline / "kvroute" / "cli.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a kvroute source tree (no kvroute/cli.py)")
    bench = Bench(
        trace=args.trace,
        minutes=args.minutes,
        speedup=args.speedup,
        engines=args.engines,
        capacity_tokens=args.capacity,
        belief_capacity_tokens=args.belief_capacity or args.capacity,
        max_output_tokens=args.max_output_tokens,
        no_reuse=args.no_reuse,
        workload=args.workload,
        seed=args.seed,
    )
    requests = load_requests(bench)
    generated = f"workload {bench.workload} (seed {bench.seed})"
    source = bench.trace.name if bench.workload == "mooncake" else generated
    print(
        f"{len(requests)} requests: the first {bench.minutes:g} min of {source}"
        f"{' (no reuse)' if bench.no_reuse else ''}, {bench.speedup:g}x compressed, streamed; "
        f"{bench.engines} engines x {bench.capacity_tokens:,} KV tokens, fresh for each contender\n",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-") as tmp:
        for name in contenders:
            checkouts = [None, args.baseline] if args.baseline is not None and name in KVROUTE else [None]
            for checkout in checkouts:
                row = run_contender(name, bench, requests, Path(tmp), checkout)
                print(f"  {row.name}: {'not run' if row.missing else f'{row.wall_s:.0f} s'}", flush=True)
                rows.append(row)
    print()
    print_report(bench, requests, rows)
    return 0 if all(not r.missing and figures(r).failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
