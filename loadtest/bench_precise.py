"""Precise routing (KV events) against approximate routing and SGLang's router, on a Mooncake slice.

    python -m loadtest.bench_precise --policy cost --seeds 7,8,9

Two scenarios, each run with every contender on fresh engines (their own process, publishing
KV events in vLLM's format) and a fresh router process:

* **routing**: the routing benchmark's trace slice (:func:`loadtest.bench_routing.load_requests`),
  every request through the router;
* **stale**: the same slice with tighter KV capacity (``--stale-capacity``) and a share of the
  requests (``--direct-share``, a quarter by default) sent straight to a random engine, around
  the router, as happens when several routers or batch jobs share a fleet. Figures are over
  the requests the router routed.

Contenders: kvroute ``prefix_aware`` (or ``--policy``) in approximate mode (its default: beliefs from its own
routing history, character blocks), kvroute ``prefix_aware`` in precise mode (``index.mode:
events``, the simulator's tokenizer), and SGLang's router (``cache_aware``) when installed.

Besides hit ratio (engine-reported cached tokens over prompt tokens) and TTFT, each kvroute
contender's **accuracy** compares, request by request, the cached tokens the router predicted
for the backend it chose (its ``x-kvroute-matched-tokens`` header) with what the engine then
reported (``usage.prompt_tokens_details.cached_tokens``): ``sum(min) / sum(max)``, 1.0 when
every prediction is exact, lower for over- and under-estimates alike.

Prompts are sent as completions (``prompt`` = :func:`loadtest.trace.prompt_text`), so both of
kvroute's modes and SGLang see the trace's prefixes as plain text.

**Seeds** (``--seeds 7,8,9``): each scenario and contender runs once per seed (the seed picks
which requests go around the router, and to which engine; in the routing scenario it is a plain
repeat), in an order that rotates from seed to seed. Figures are pooled over the seeds, and
each seed's own TTFT p99 is shown beside the pooled one: a p99 over a few hundred requests is
their few slowest, so one queueing incident moves it by a tenth or more. ``--outcomes FILE``
keeps every request's outcome (backend, prompt, cached and predicted tokens, TTFT) as JSON
lines, to look into a tail.

Everything shares this machine's CPUs: compare contenders within one run, as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from loadtest.bench_routing import Bench, load_requests
from loadtest.contenders import ADMIN_ON_ANY_PORT, Contender, cpu_seconds, sglang, wait_listening
from loadtest.ports import free_port
from loadtest.report import format_table, mean, percentile, ratio
from loadtest.sim.engine import SimEngine
from loadtest.sim.timing import EngineTiming
from loadtest.trace import DEFAULT_TRACE, TraceRequest, prompt_text

MODEL = "sim-model"
CONTENDERS = ("approximate", "precise", "sglang")
#: Approximate mode's block: 256 characters, 64 simulated tokens.
APPROX_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Scenario:
    name: str
    capacity_tokens: int
    #: Share of requests sent straight to an engine, around the router.
    direct_share: float


@dataclass(frozen=True)
class Outcome:
    ok: bool
    routed: bool
    ttft: float | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: The router's prediction for the backend it chose (None: no header, or sent directly).
    predicted: int | None = None
    #: The backend that served it (the router's ``x-kvroute-backend``, or the engine sent to).
    backend: str | None = None
    #: Position of the request in the trace slice.
    position: int = -1


@dataclass(frozen=True)
class Row:
    scenario: str
    contender: str
    outcomes: list[Outcome]
    missing: str | None = None
    #: CPU seconds the router process used over the run (its own work: routing, events, proxying).
    router_cpu_s: float = math.nan
    #: The seed of the run (which requests go around the router, and to which engine).
    seed: int = 0


# -- the engines' process ------------------------------------------------------------------------


async def _serve_engines(ports: Sequence[int], kv_blocks: int) -> None:
    timing = EngineTiming(kv_blocks=kv_blocks)
    engines = [SimEngine(timing, (MODEL,), name=f"sim{i}", kv_events="vllm") for i in range(len(ports))]
    try:
        for engine, port in zip(engines, ports, strict=True):
            await engine.start("127.0.0.1", port)
        await asyncio.Event().wait()
    finally:
        for engine in engines:
            await engine.stop()


def _engines(ports: Sequence[int], capacity_tokens: int) -> Contender:
    kv_blocks = capacity_tokens // EngineTiming().block_tokens
    command = [sys.executable, "-m", "loadtest.bench_precise", "--serve-engines", ",".join(map(str, ports))]
    return Contender("engines", ports[0], [*command, "--kv-blocks", str(kv_blocks)])


# -- the routers -------------------------------------------------------------------------------


def _kvroute(
    name: str, policy: str, params: str, capacity_tokens: int, urls: Sequence[str], workdir: Path
) -> Contender:
    port = free_port()
    if name == "precise":
        index = "{mode: events, tokenizer: {kind: chunk}, events: {block_size: 16}}"
    else:
        index = f"{{backend_capacity_blocks: {capacity_tokens // APPROX_BLOCK_TOKENS}}}"
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        ADMIN_ON_ANY_PORT,
        "log_level: warning",
        f"routing: {{policy: {policy}, seed: 1, params: {params}}}",
        f"index: {index}",
        "health: {interval_s: 1.0}",
        "backends:",
        *(f"  - {{name: e{i}, url: '{url}', models: [{MODEL}]}}" for i, url in enumerate(urls)),
    ]
    config = workdir / f"kvroute-{name}.yaml"
    config.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config)]
    return Contender(f"kvroute {name}", port, command)


async def _ready(url: str, subscriptions: int, timeout: float) -> None:
    """Until the router serves a request and (precise mode) follows every engine's events."""
    deadline = time.monotonic() + timeout
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                    served = resp.status == 200
                following = 0
                if subscriptions:
                    async with session.get(f"{url}/metrics") as resp:
                        text = await resp.text()
                    following = sum(
                        line.startswith("kvroute_kv_events_resyncs_total") and 'reason="connect"' in line
                        for line in text.splitlines()
                    )
                if served and following >= subscriptions:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} was not ready within {timeout:.0f} s")


# -- the load ----------------------------------------------------------------------------------


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    request: TraceRequest,
    routed: bool,
    timeout_s: float,
    position: int = -1,
    engine: str | None = None,
) -> Outcome:
    body = {
        "model": MODEL,
        "prompt": prompt_text(request),
        "max_tokens": request.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    usage: dict = {}
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            header = resp.headers.get("x-kvroute-matched-tokens")
            backend = resp.headers.get("x-kvroute-backend") if routed else engine
            if resp.status != 200:
                return Outcome(False, routed, None, position=position)
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[5:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - started
                usage = chunk.get("usage") or usage
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Outcome(False, routed, ttft, position=position)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    predicted = int(header) if header is not None and routed else None
    prompt = usage.get("prompt_tokens", 0)
    return Outcome(True, routed, ttft, prompt, cached, predicted, backend, position)


async def _replay(
    router_url: str,
    engine_urls: Sequence[str],
    requests: Sequence[TraceRequest],
    scenario: Scenario,
    speedup: float,
    seed: int,
) -> list[Outcome]:
    """Every request at its compressed arrival time; a seeded share goes straight to an engine."""
    rng = random.Random(seed)

    def target() -> tuple[str, bool, str | None]:
        if rng.random() < scenario.direct_share:
            i = rng.randrange(len(engine_urls))
            return engine_urls[i], False, f"e{i}"
        return router_url, True, None

    targets = [target() for _ in requests]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one(
            position: int, request: TraceRequest, url: str, routed: bool, engine: str | None
        ) -> Outcome:
            await asyncio.sleep(max(0.0, start + request.arrival_s / speedup - time.perf_counter()))
            return await _stream(session, url, request, routed, 300.0, position, engine)

        return await asyncio.gather(
            *(one(i, r, *t) for i, (r, t) in enumerate(zip(requests, targets, strict=True)))
        )


def run(
    scenario: Scenario,
    contender: str,
    requests: Sequence[TraceRequest],
    args: argparse.Namespace,
    workdir: Path,
    seed: int,
) -> Row:
    ports = [free_port() for _ in range(args.engines)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    engines = _engines(ports, scenario.capacity_tokens)
    if contender == "sglang":
        router = sglang(urls, None)
    else:
        router = _kvroute(contender, args.policy, args.policy_params, scenario.capacity_tokens, urls, workdir)
    if router.missing:
        return Row(scenario.name, router.name, [], router.missing, seed=seed)
    try:
        engines.start(workdir)
        for port in ports:
            wait_listening(port, 30.0, engines.process)
        router.start(workdir)
        wait_listening(router.port, 60.0, router.process)
        url = f"http://127.0.0.1:{router.port}"
        asyncio.run(_ready(url, args.engines if contender == "precise" else 0, 60.0))
        assert router.pid is not None
        cpu_before = cpu_seconds(router.pid)
        outcomes = asyncio.run(_replay(url, urls, requests, scenario, args.speedup, seed))
        cpu = cpu_seconds(router.pid) - cpu_before
        return Row(scenario.name, router.name, outcomes, router_cpu_s=cpu, seed=seed)
    except RuntimeError as exc:
        reason = f"{exc}; {router.log_tail() or engines.log_tail()}"
        return Row(scenario.name, router.name, [], reason, seed=seed)
    finally:
        router.stop()
        engines.stop()


# -- the report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    routed: int
    failed: int
    hit_ratio: float
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    accuracy: float
    predicted: int
    reported: int


def figures(outcomes: Sequence[Outcome]) -> Figures:
    """Figures over the routed requests among ``outcomes`` (one run's, or several pooled)."""
    routed = [o for o in outcomes if o.routed]
    good = [o for o in routed if o.ok]
    ttfts = [o.ttft for o in good if o.ttft is not None]
    prompt = sum(o.prompt_tokens for o in good)
    judged = [o for o in good if o.predicted is not None]
    agree = sum(min(o.predicted, o.cached_tokens) for o in judged)  # type: ignore[type-var]
    span = sum(max(o.predicted, o.cached_tokens) for o in judged)  # type: ignore[type-var]
    return Figures(
        routed=len(routed),
        failed=len(routed) - len(good),
        hit_ratio=sum(o.cached_tokens for o in good) / prompt if prompt else math.nan,
        ttft_mean=mean(ttfts),
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p99=percentile(ttfts, 0.99),
        accuracy=agree / span if span else math.nan,
        predicted=sum(o.predicted for o in judged),  # type: ignore[misc]
        reported=sum(o.cached_tokens for o in judged),
    )


def _span(values: Sequence[float], fmt: str) -> str:
    """``low-high`` of per-seed values (one value alone when there is one seed)."""
    low, high = min(values), max(values)
    return format(low, fmt) if len(values) == 1 else f"{format(low, fmt)}-{format(high, fmt)}"


@dataclass(frozen=True)
class Pooled:
    """One scenario and contender over every seed: pooled figures and each seed's own p99."""

    figures: Figures
    #: Each seed's TTFT p99 (seconds), by seed.
    p99_by_seed: dict[int, float]
    cpu_s: float


def pool(rows: Sequence[Row]) -> dict[tuple[str, str], Pooled]:
    """Rows of the same scenario and contender, pooled over seeds (runs that failed to start left out)."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if not row.missing:
            groups.setdefault((row.scenario, row.contender), []).append(row)
    return {
        key: Pooled(
            figures([o for r in runs for o in r.outcomes]),
            {r.seed: figures(r.outcomes).ttft_p99 for r in runs},
            sum(r.router_cpu_s for r in runs) / len(runs),
        )
        for key, runs in groups.items()
    }


def print_report(rows: Sequence[Row]) -> None:
    pooled = pool(rows)
    table = []
    for row in rows:
        key = (row.scenario, row.contender)
        if row.missing:
            table.append([row.scenario, row.contender, *["-"] * 9, f"not run: {row.missing}"])
            continue
        if key not in pooled:
            continue
        p = pooled.pop(key)
        f = p.figures
        accuracy = "-" if math.isnan(f.accuracy) else f"{f.accuracy:.3f}"
        judged = f"{f.predicted:,} / {f.reported:,}" if not math.isnan(f.accuracy) else "-"
        ms = [f"{x * 1000:.0f}" for x in (f.ttft_mean, f.ttft_p50, f.ttft_p99)]
        seeds = _span([v * 1000 for v in p.p99_by_seed.values()], ".0f")
        cpu = f"{p.cpu_s:.1f}"
        table.append(
            [
                row.scenario,
                row.contender,
                f.routed,
                f.failed,
                f"{f.hit_ratio:.1%}",
                *ms,
                seeds,
                cpu,
                accuracy,
                judged,
            ]
        )
    heads = ["scenario", "contender", "routed", "failed", "hit ratio", "TTFT mean ms", "p50", "p99"]
    tail = ["p99 per seed", "router CPU s/run", "accuracy", "predicted / reported tokens"]
    print(format_table([*heads, *tail], table))

    pooled = pool(rows)
    ratios = []
    for scenario in dict.fromkeys(row.scenario for row in rows):
        precise = pooled.get((scenario, "kvroute precise"))
        if precise is None:
            continue
        for other in ("kvroute approximate", "sglang cache_aware"):
            base = pooled.get((scenario, other))
            if base is None:
                continue
            pf, bf = precise.figures, base.figures
            per_seed = [
                precise.p99_by_seed[s] / base.p99_by_seed[s]
                for s in precise.p99_by_seed
                if base.p99_by_seed.get(s)
            ]
            spread = _span(per_seed, ".2f") + "x" if per_seed else "-"
            hit, mean, p99 = (
                ratio(pf.hit_ratio, bf.hit_ratio),
                ratio(pf.ttft_mean, bf.ttft_mean),
                ratio(pf.ttft_p99, bf.ttft_p99),
            )
            ratios.append([scenario, f"precise vs {other}", hit, mean, p99, spread])
    if ratios:
        print()
        heads = ["scenario", "ratio", "hit ratio", "TTFT mean", "TTFT p99", "p99 per seed"]
        print(format_table(heads, ratios))


def write_outcomes(rows: Sequence[Row], path: Path) -> None:
    """Every request's outcome, one JSON object a line, for looking into a tail."""
    with open(path, "wb") as out:
        for row in rows:
            for o in row.outcomes:
                record = {"scenario": row.scenario, "contender": row.contender, "seed": row.seed, **vars(o)}
                out.write(orjson.dumps(record) + b"\n")


def run_order(contenders: Sequence[str], seeds: Sequence[int]) -> list[tuple[int, str]]:
    """Every contender once per seed; each seed starts with the next contender, so that a slow
    spell of the shared machine (other work, a warm-up) does not always fall on the same one."""
    order = []
    for turn, seed in enumerate(seeds):
        shift = turn % len(contenders)
        order.extend((seed, c) for c in [*contenders[shift:], *contenders[:shift]])
    return order


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_precise", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="Mooncake-format trace, JSONL or .jsonl.gz (default: the one kvroute ships)",
    )
    # The defaults are the routing benchmark's (loadtest/bench_routing.py): its trace slice,
    # time compression, fleet and capacity; the stale scenario halves the capacity.
    parser.add_argument("--minutes", type=float, default=10.0, help="trace minutes to replay (default 10)")
    parser.add_argument("--speedup", type=float, default=10.0, help="time compression (default 10)")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument(
        "--capacity", type=int, default=1_000_000, help="KV tokens per engine, routing scenario (default 1M)"
    )
    parser.add_argument(
        "--stale-capacity",
        type=int,
        default=500_000,
        help="KV tokens per engine, stale scenario (default 500k)",
    )
    parser.add_argument("--direct-share", type=float, default=0.25, help="stale scenario: share sent around")
    parser.add_argument("--max-output-tokens", type=int, default=32, help="cap outputs (0: the trace's own)")
    parser.add_argument("--scenarios", default="routing,stale")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="of approximate, precise, sglang")
    parser.add_argument("--policy", default="prefix_aware", help="kvroute's routing policy (both modes)")
    parser.add_argument(
        "--policy-params", default="{}", help="its parameters, a YAML flow mapping (both modes; default {})"
    )
    parser.add_argument(
        "--seeds",
        default="7",
        help="comma-separated; each scenario and contender runs once per seed, figures pooled (default 7)",
    )
    parser.add_argument("--outcomes", type=Path, help="write every request's outcome here (JSON lines)")
    parser.add_argument("--serve-engines", help=argparse.SUPPRESS)
    parser.add_argument("--kv-blocks", type=int, default=4096, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_engines:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve_engines([int(p) for p in args.serve_engines.split(",")], args.kv_blocks))
        return 0

    contenders = [c for c in args.contenders.split(",") if c]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        seeds = []
    if any(c not in CONTENDERS for c in contenders) or args.engines < 1 or not 0 <= args.direct_share < 1:
        parser.error(f"contenders: of {', '.join(CONTENDERS)}; engines >= 1; direct-share in [0, 1)")
    if not seeds:
        parser.error("seeds: one or more integers, comma-separated")
    # SIGTERM unwinds like Ctrl-C, so every engine and router process started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scenarios = {
        "routing": Scenario("routing", args.capacity, 0.0),
        "stale": Scenario("stale", args.stale_capacity, args.direct_share),
    }
    chosen = [scenarios[s] for s in args.scenarios.split(",") if s]
    bench = Bench(
        trace=args.trace,
        minutes=args.minutes,
        speedup=args.speedup,
        engines=args.engines,
        capacity_tokens=args.capacity,
        belief_capacity_tokens=args.capacity,
        max_output_tokens=args.max_output_tokens,
        no_reuse=False,
    )
    requests = load_requests(bench)
    print(
        f"{len(requests)} requests: the first {args.minutes:g} min of {args.trace.name}, "
        f"{args.speedup:g}x compressed, streamed, outputs capped at {args.max_output_tokens or 'the trace'}; "
        f"{args.engines} engines of {args.capacity:,} KV tokens (stale: {args.stale_capacity:,}, "
        f"{args.direct_share:.0%} sent around the router); fresh engines and router for each run\n",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-precise-") as tmp:
        for scenario in chosen:
            for seed, contender in run_order(contenders, seeds):
                began = time.perf_counter()
                row = run(scenario, contender, requests, args, Path(tmp), seed)
                state = "not run" if row.missing else f"{time.perf_counter() - began:.0f} s"
                print(f"  {scenario.name} / {row.contender} / seed {seed}: {state}", flush=True)
                rows.append(row)
    if args.outcomes:
        write_outcomes(rows, args.outcomes)
    print()
    print_report(rows)
    return 0 if all(not r.missing and figures(r.outcomes).failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
