"""The prefill/decode disaggregation benchmark: pairs of simulated engines behind each router.

    kvroute bench routing --pd 4,4 --workload trace --minutes 3 --speedup 10
    kvroute bench routing --pd 4,4 --workload chat

For every contender a fresh fleet of simulated engines (``kvroute sim``, its own process,
empty caches) and a fresh router start; the workload is sent at its (compressed) arrival
times as streaming chat completions; then everything stops. The contenders:

* ``colocated``: kvroute ``cost`` over P + D co-located engines (the same engine count,
  each prefilling and decoding): what disaggregation is measured against;
* ``pd_round_robin``: kvroute over P prefill + D decode engines, round robin on both sides;
* ``pd_cost``: kvroute's cache-aware pairs: ``cost`` over the prefill pool (prefix matches),
  ``decode_balance`` over the decode pool;
* ``sglang_pd``: SGLang's router in PD mode (``sglang-router --pd-disaggregation``) with the
  policies its documentation pairs for it: ``cache_aware`` prefill, ``power_of_two`` decode.

All PD contenders drive the simulated engines through SGLang's bootstrap protocol (the one
SGLang's router speaks), so every contender meets the same engines.

The hit ratio is the engines' own: the prompt tokens the prefilling engines found cached,
over those they prefilled (read from each engine's ``/sim/stats``, so no router's rewriting
of ``usage`` enters it). TTFT, ITL (the stream's time after its first token over the tokens
after the first) and end-to-end latency are the client's. Balance is each pool's largest
engine's share of requests over the mean share.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loadtest.bench_routing import _kvroute_bin, start_serving
from loadtest.client import Result, stream_chat
from loadtest.contenders import Contender
from loadtest.help_format import DefaultsHelpFormatter
from loadtest.ports import free_port, free_ports
from loadtest.report import busiest_share, format_table, mean, percentile, ratio
from loadtest.sim.timing import EngineTiming
from loadtest.trace import DEFAULT_TRACE, prompt_messages, read_trace
from loadtest.workload import chat_workload

MODEL = "sim-model"
CONTENDERS = ("colocated", "pd_round_robin", "pd_cost", "sglang_pd")
#: kvroute's PD contenders: (routing policy, decode policy).
KVROUTE_PD = {"pd_round_robin": ("round_robin", "round_robin"), "pd_cost": ("cost", "decode_balance")}


@dataclass(frozen=True)
class Job:
    """One request of a workload: when it is sent, what it asks, as which tenant."""

    arrival_s: float
    messages: list[dict[str, str]]
    max_tokens: int
    tenant: str


@dataclass(frozen=True)
class Setup:
    prefill: int
    decode: int
    capacity_tokens: int
    timeout_s: float = 300.0

    @property
    def engines(self) -> int:
        return self.prefill + self.decode


def trace_jobs(path: Path, minutes: float, speedup: float, max_output_tokens: int) -> list[Job]:
    """The first ``minutes`` of a Mooncake trace, ``speedup`` times faster."""
    return [
        Job(
            r.arrival_s / speedup,
            prompt_messages(r),
            max(2, min(r.output_tokens, max_output_tokens) if max_output_tokens else r.output_tokens),
            "default",
        )
        for r in read_trace(path, minutes=minutes)
    ]


def chat_jobs(conversations: int, rate: float, think_s: float, max_tokens: int, seed: int = 1) -> list[Job]:
    """Multi-turn chat of several tenants: conversations start as a Poisson stream of ``rate``
    per second; each turn follows the previous one's answer after ``think_s`` on average. A
    tenant's conversations share its system prompt (``chat_workload``'s system prompts, one per
    tenant). The simulator's answer to ``max_tokens`` is always the same text, so every turn's
    history is known up front."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    answer = " tok" * max_tokens
    start = 0.0
    for conversation in chat_workload(conversations, seed=seed):
        start += rng.expovariate(rate)
        tenant = conversation.system.split(".", 1)[0]
        history = [{"role": "system", "content": conversation.system}]
        at = start
        for turn in conversation.user_turns:
            history = [*history, {"role": "user", "content": turn}]
            jobs.append(Job(at, history, max_tokens, tenant))
            history = [*history, {"role": "assistant", "content": answer}]
            # The answer's own time is not known here; think time stands for both.
            at += rng.expovariate(1 / think_s)
    return sorted(jobs, key=lambda j: j.arrival_s)


def _fleet(setup: Setup, pd: bool) -> tuple[Contender, list[str]]:
    base = free_ports(setup.engines)
    command = [_kvroute_bin(), "sim", "--port", str(base)]
    command += ["--kv-blocks", str(setup.capacity_tokens // EngineTiming().block_tokens)]
    if pd:
        command += ["--prefill", str(setup.prefill), "--decode", str(setup.decode)]
    else:
        command += ["--engines", str(setup.engines)]
    return Contender("engines", base, command), [f"http://127.0.0.1:{base + i}" for i in range(setup.engines)]


def _kvroute(name: str, setup: Setup, urls: Sequence[str], workdir: Path) -> Contender:
    port = free_port()
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        "log_level: warning",
        "health: {interval_s: 1.0}",
    ]
    if name == "colocated":
        lines.append("routing: {policy: cost, seed: 1}")
        lines.append("backends:")
        lines += [f"  - {{name: e{i}, url: '{url}', models: [{MODEL}]}}" for i, url in enumerate(urls)]
    else:
        policy, decode_policy = KVROUTE_PD[name]
        lines.append(f"routing: {{policy: {policy}, seed: 1}}")
        lines.append(f"disaggregation: {{decode_routing: {{policy: {decode_policy}}}}}")
        lines.append("backends:")
        for i, url in enumerate(urls):
            port_of = url.rsplit(":", 1)[1]
            if i < setup.prefill:
                lines.append(
                    f"  - {{name: p{i}, url: '{url}', models: [{MODEL}], engine: sglang, role: prefill,"
                    f" bootstrap_port: {port_of}}}"
                )
            else:
                lines.append(
                    f"  - {{name: d{i - setup.prefill}, url: '{url}', models: [{MODEL}], engine: sglang,"
                    " role: decode}"
                )
    config = workdir / f"kvroute-{name}.yaml"
    config.write_text("\n".join(lines) + "\n")
    return Contender(f"kvroute {name}", port, [_kvroute_bin(), "serve", "--config", str(config)])


def _sglang_pd(setup: Setup, urls: Sequence[str]) -> Contender:
    port = free_port()
    if importlib.util.find_spec("sglang_router") is None:
        return Contender("sglang_pd", port, missing="sglang-router not installed (pip install sglang-router)")
    command = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url in urls[: setup.prefill]:
        command += ["--prefill", url, url.rsplit(":", 1)[1]]
    for url in urls[setup.prefill :]:
        command += ["--decode", url]
    command += ["--prefill-policy", "cache_aware", "--decode-policy", "power_of_two"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return Contender("sglang_pd", port, command)


async def _stats(urls: Sequence[str]) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        out = []
        for url in urls:
            async with session.get(f"{url}/sim/stats") as resp:
                out.append(await resp.json())
        return out


async def _replay(url: str, jobs: Sequence[Job], timeout_s: float) -> list[Result]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def one(job: Job) -> Result:
            await asyncio.sleep(max(0.0, start + job.arrival_s - time.perf_counter()))
            return await stream_chat(
                session,
                url,
                MODEL,
                job.messages,
                max_tokens=job.max_tokens,
                headers={"x-kvroute-tenant": job.tenant},
                timeout_s=timeout_s,
            )

        return await asyncio.gather(*(one(j) for j in jobs))


@dataclass(frozen=True)
class Row:
    name: str
    results: list[Result]
    jobs: Sequence[Job]
    wall_s: float
    #: Each engine's /sim/stats counters over the run (after minus before).
    stats: list[dict[str, int]]
    roles: list[str]
    missing: str | None = None


def run(name: str, setup: Setup, jobs: Sequence[Job], workdir: Path) -> Row:
    pd = name != "colocated"
    engines, urls = _fleet(setup, pd)
    router = _sglang_pd(setup, urls) if name == "sglang_pd" else _kvroute(name, setup, urls, workdir)
    roles = (["prefill"] * setup.prefill + ["decode"] * setup.decode) if pd else ["both"] * setup.engines
    if router.missing:
        return Row(name, [], jobs, 0.0, [], roles, missing=router.missing)
    try:
        url = start_serving(engines, setup.engines, router, workdir)
        before = asyncio.run(_stats(urls))
        started = time.perf_counter()
        results = asyncio.run(_replay(url, jobs, setup.timeout_s))
        wall = time.perf_counter() - started
        after = asyncio.run(_stats(urls))
        stats = [
            {k: v - b.get(k, 0) for k, v in a.items() if isinstance(v, int)}
            for a, b in zip(after, before, strict=True)
        ]
        return Row(name, results, jobs, wall, stats, roles)
    except RuntimeError as exc:
        return Row(
            name, [], jobs, 0.0, [], roles, missing=f"{exc}; {router.log_tail() or engines.log_tail()}"
        )
    finally:
        router.stop()
        engines.stop()


def pooled(rows: Sequence[Row]) -> Row:
    """One contender's rounds as one run: every request's result, every engine's counters summed."""
    failed = [r for r in rows if r.missing]
    if failed:
        return failed[0]
    engines = range(len(rows[0].stats))
    stats = [{key: sum(r.stats[i][key] for r in rows) for key in rows[0].stats[i]} for i in engines]
    return Row(
        rows[0].name,
        [result for r in rows for result in r.results],
        [job for r in rows for job in r.jobs],
        sum(r.wall_s for r in rows),
        stats,
        rows[0].roles,
    )


@dataclass(frozen=True)
class Figures:
    ok: int
    failed: int
    hit_ratio: float
    ttft_mean: float
    ttft_p99: float
    itl_mean: float
    e2e_p50: float
    e2e_p99: float
    prefill_share: float
    decode_share: float


def figures(row: Row) -> Figures:
    good = [(r, j) for r, j in zip(row.results, row.jobs, strict=True) if r.ok]
    ttfts = [r.ttft for r, _ in good if r.ttft is not None]
    itls = [
        (r.latency - r.ttft) / (j.max_tokens - 1) for r, j in good if r.ttft is not None and j.max_tokens > 1
    ]
    prefilling = [s for s, role in zip(row.stats, row.roles, strict=True) if role != "decode"]
    decoding = [s for s, role in zip(row.stats, row.roles, strict=True) if role != "prefill"]
    prompt = sum(s["prompt_tokens"] for s in prefilling)
    latencies = [r.latency for r, _ in good]
    return Figures(
        ok=len(good),
        failed=len(row.results) - len(good),
        hit_ratio=sum(s["cached_tokens"] for s in prefilling) / prompt if prompt else math.nan,
        ttft_mean=mean(ttfts),
        ttft_p99=percentile(ttfts, 0.99),
        itl_mean=mean(itls),
        e2e_p50=percentile(latencies, 0.5),
        e2e_p99=percentile(latencies, 0.99),
        prefill_share=busiest_share([s["received"] for s in prefilling]),
        decode_share=busiest_share([s["received"] for s in decoding]),
    )


def print_report(rows: Sequence[Row]) -> None:
    table, figs = [], {}
    for row in rows:
        if row.missing:
            table.append([row.name, "not run", *["-"] * 10])
            continue
        f = figs[row.name] = figures(row)
        table.append(
            [
                row.name,
                f.ok,
                f.failed,
                f"{f.hit_ratio:.1%}",
                f"{f.ttft_mean * 1000:.0f}",
                f"{f.ttft_p99 * 1000:.0f}",
                f"{f.itl_mean * 1000:.1f}",
                f"{f.e2e_p50 * 1000:.0f}",
                f"{f.e2e_p99 * 1000:.0f}",
                f"{f.prefill_share:.2f}",
                f"{f.decode_share:.2f}",
            ]
        )
    heads = [
        "contender",
        "ok",
        "failed",
        "hit ratio",
        "TTFT mean ms",
        "TTFT p99",
        "ITL mean ms",
        "e2e p50 ms",
    ]
    print(format_table([*heads, "e2e p99", "prefill max/mean", "decode max/mean"], table))
    for row in rows:
        if row.missing:
            print(f"{row.name} not run: {row.missing}")
    sgl = figs.get("sglang_pd")
    if sgl:
        print()
        ratios = [
            [
                name,
                ratio(f.hit_ratio, sgl.hit_ratio),
                ratio(f.ttft_mean, sgl.ttft_mean),
                ratio(f.itl_mean, sgl.itl_mean),
                ratio(f.e2e_p50, sgl.e2e_p50),
            ]
            for name, f in figs.items()
        ]
        print(format_table(["vs sglang_pd", "hit ratio", "TTFT mean", "ITL mean", "e2e p50"], ratios))


def main(argv: Sequence[str] | None = None, prog: str = "kvroute bench routing") -> int:
    parser = argparse.ArgumentParser(
        prog=f"{prog} --pd P,D", formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pd", required=True, help="prefill and decode engines, e.g. 4,4")
    parser.add_argument("--workload", choices=("trace", "chat"), default="trace")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace")
    parser.add_argument("--minutes", type=float, default=3.0, help="trace minutes to replay")
    parser.add_argument("--speedup", type=float, default=10.0, help="trace time compression")
    parser.add_argument("--max-output-tokens", type=int, default=64, help="cap on trace outputs")
    parser.add_argument("--conversations", type=int, default=120, help="chat: conversations")
    parser.add_argument("--rate", type=float, default=4.0, help="chat: conversations started per second")
    parser.add_argument("--think-s", type=float, default=2.0, help="chat: mean seconds between turns")
    parser.add_argument("--capacity", type=int, default=1_000_000, help="KV tokens per engine")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every contender, in rotating order, pooled"
    )
    args = parser.parse_args(argv)
    try:
        prefill, decode = (int(n) for n in args.pd.split(","))
    except ValueError:
        parser.error("--pd: expected two counts, e.g. 4,4")
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown or prefill < 1 or decode < 1 or args.rounds < 1:
        parser.error(f"unknown contender {unknown[0]!r}" if unknown else "--pd: at least one engine of each")
    setup = Setup(prefill, decode, args.capacity)
    if args.workload == "trace":
        jobs = trace_jobs(args.trace, args.minutes, args.speedup, args.max_output_tokens)
        what = f"the first {args.minutes:g} min of {args.trace.name}, {args.speedup:g}x compressed"
    else:
        jobs = chat_jobs(args.conversations, args.rate, args.think_s, 16)
        what = f"multi-tenant chat, {args.conversations} conversations at {args.rate:g}/s"
    print(
        f"{len(jobs)} requests: {what}, streamed; {prefill} prefill + {decode} decode engines "
        f"(co-located: {setup.engines}) x {args.capacity:,} KV tokens, fresh for each contender\n",
        flush=True,
    )
    runs: dict[str, list[Row]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-pd-") as tmp:
        for number in range(args.rounds):
            # Each round starts one contender later, so a slow spell of a shared machine does not
            # always fall on the same contender.
            for name in contenders[number % len(contenders) :] + contenders[: number % len(contenders)]:
                row = run(name, setup, jobs, Path(tmp))
                done = "not run" if row.missing else f"{row.wall_s:.0f} s"
                print(f"  round {number + 1}/{args.rounds} {row.name}: {done}", flush=True)
                runs[name].append(row)
    rows = [pooled(runs[name]) for name in contenders]
    print()
    print_report(rows)
    return 0 if all(not r.missing and figures(r).failed == 0 for r in rows) else 1
