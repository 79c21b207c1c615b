"""The routing benchmark on real engines: vLLM replicas (CPU build, tiny model), a trace slice.

    bash tests/real_engines/setup.sh      # once: the engine's venv and the tiny model
    kvroute bench real-engines --minutes 4 --speedup 2 --sample 4

Two vLLM replicas (``loadtest.vllm_replicas``; the machine holds no more) with small KV caches,
so that where a prompt goes decides whether its prefix is still cached; the shipped Mooncake
conversation trace, scaled down (each 512-token trace block becomes ``512 / --scale`` tokens'
worth of text, outputs capped), replayed at its compressed arrival times through each contender:
kvroute with ``round_robin``, ``least_load``, ``prefix_aware`` and its default policy
(``latency``), optionally kvroute in precise mode, and SGLang's router (``sglang-router``,
``cache_aware``). Between contenders the engines' prefix caches are reset
(``POST /reset_prefix_cache``, a dev endpoint: the replicas run with ``VLLM_SERVER_DEV_MODE=1``),
so each starts cold.

The figures are the engines' own: the prefix-cache hit ratio is the growth of
``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total`` during the run,
summed over both replicas; TTFT and end-to-end latency are what the client measured. Two CPU
cores run the engines, the routers and the client at once, so absolute times mean little: the
ratios against round robin and against SGLang's router, from one invocation, are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench_routing import wait_serving
from loadtest.client import Result, stream_chat
from loadtest.contenders import Contender, sglang, wait_listening
from loadtest.help_format import DefaultsHelpFormatter
from loadtest.ports import free_port
from loadtest.report import Latencies, format_table, ratio
from loadtest.trace import DEFAULT_TRACE, TRACE_BLOCK_TOKENS, TraceRequest, read_trace
from loadtest.vllm_replicas import (
    BLOCK_SIZE,
    SERVED_MODEL,
    VllmReplica,
    engine_installed,
    engine_model,
    start_replicas,
)

#: kvroute contenders: the YAML of their ``routing`` and ``index`` sections.
KVROUTE = {
    "round_robin": ("{policy: round_robin, seed: 1}", "{}"),
    "least_load": ("{policy: least_load, seed: 1}", "{}"),
    "prefix_aware": ("{policy: prefix_aware, seed: 1}", "{}"),
    "prefix_aware+events": ("{policy: prefix_aware, seed: 1}", None),
    "latency": ("{policy: latency, seed: 1}", "{}"),
    "latency+events": ("{policy: latency, seed: 1}", None),
}
DEFAULT_CONTENDERS = ("round_robin", "least_load", "latency", "sglang")
#: Common words, each one token of the tiny model's BPE (trained on kvroute's own text): a trace
#: block becomes as many of them as it has tokens, so prompt lengths come out as the trace scales
#: them (the simulated engines' ``<blk …>`` stamps cost that tokenizer about one token a character).
WORDS = (
    "the of and to in is for that with as on are by this it from be or an at which each its when not "
    "has can one all new block request engine prefix cache token router backend model"
).split()


@dataclass(frozen=True)
class Bench:
    trace: Path
    minutes: float
    speedup: float
    #: Trace tokens per benchmark token: a 512-token trace block becomes 512 / scale tokens.
    scale: int
    max_prompt_tokens: int
    max_output_tokens: int
    kv_cache_mib: int
    #: Keep one conversation in ``sample`` (1: all): a longer stretch of the trace, whose turns
    #: come back minutes apart, at a load two CPU replicas can serve.
    sample: int = 1
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Row:
    name: str
    results: list[Result]
    wall_s: float
    hits: float
    queries: float
    missing: str | None = None


def conversation(request: TraceRequest) -> int:
    """A stable number for the conversation a request belongs to: its first three blocks (the
    turns of one conversation extend the same prefix; unrelated ones part within a few blocks)."""
    return zlib.crc32(repr(request.hash_ids[:3]).encode())


def scaled(requests: Sequence[TraceRequest], bench: Bench) -> list[TraceRequest]:
    """One conversation in ``sample``, every length divided by ``scale``, prompts and outputs capped."""
    out = []
    for r in requests:
        if conversation(r) % bench.sample:
            continue
        tokens = min(max(1, r.input_tokens // bench.scale), bench.max_prompt_tokens)
        out.append(
            replace(r, input_tokens=tokens, output_tokens=min(r.output_tokens, bench.max_output_tokens))
        )
    return out


def block_words(hash_id: int, tokens: int) -> list[str]:
    """The text of one trace block, as words: equal ids give equal text, distinct ids differ."""
    rng = random.Random(hash_id)
    return [rng.choice(WORDS) for _ in range(tokens)]


def messages(request: TraceRequest, scale: int) -> list[dict[str, str]]:
    """One user message per trace block (``512 / scale`` words), cut to the prompt's length."""
    block_tokens = TRACE_BLOCK_TOKENS // scale
    remaining = request.input_tokens
    out = []
    for hash_id in request.hash_ids:
        words = block_words(hash_id, block_tokens)[:remaining]
        out.append({"role": "user", "content": " ".join(words)})
        remaining -= len(words)
        if remaining <= 0:
            break
    return out


def _kvroute(name: str, replicas: Sequence[VllmReplica], workdir: Path) -> Contender:
    routing, index = KVROUTE[name]
    if index is None:
        tokenizer = Path(engine_model()) / "tokenizer.json"
        index = f"{{mode: events, events: {{block_size: {BLOCK_SIZE}}}, tokenizer: {{path: '{tokenizer}'}}}}"
    port = free_port()
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        "log_level: warning",
        f"routing: {routing}",
        f"index: {index}",
        "health: {interval_s: 1.0}",
        "backends:",
        *(f"  - {{name: {r.name}, url: '{r.url}', models: [{SERVED_MODEL}]}}" for r in replicas),
    ]
    config = workdir / f"kvroute-{port}.yaml"
    config.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config)]
    return Contender(f"kvroute {name}", port, command)


def prefix_cache_counters(replicas: Sequence[VllmReplica]) -> tuple[float, float]:
    """Summed ``vllm:prefix_cache_hits_total`` and ``..._queries_total`` of the replicas."""
    hits = queries = 0.0
    for replica in replicas:
        with urllib.request.urlopen(f"{replica.url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


def reset_caches(replicas: Sequence[VllmReplica]) -> None:
    for replica in replicas:
        request = urllib.request.Request(f"{replica.url}/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()


async def _replay(url: str, requests: Sequence[TraceRequest], bench: Bench) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one(request: TraceRequest) -> Result:
            await asyncio.sleep(max(0.0, start + request.arrival_s / bench.speedup - time.perf_counter()))
            return await stream_chat(
                session,
                url,
                SERVED_MODEL,
                messages(request, bench.scale),
                max_tokens=request.output_tokens,
                timeout_s=bench.timeout_s,
            )

        return await asyncio.gather(*(one(r) for r in requests))


def run_contender(
    name: str, replicas: Sequence[VllmReplica], requests: Sequence[TraceRequest], bench: Bench, workdir: Path
) -> Row:
    urls = [r.url for r in replicas]
    router = sglang(urls, None) if name == "sglang" else _kvroute(name, replicas, workdir)
    if router.missing:
        return Row(router.name, [], 0.0, 0.0, 0.0, missing=router.missing)
    try:
        router.start(workdir)
        wait_listening(router.port, 60.0, router.process)
        url = f"http://127.0.0.1:{router.port}"
        asyncio.run(wait_serving(url, 60.0, SERVED_MODEL))
        reset_caches(replicas)
        hits0, queries0 = prefix_cache_counters(replicas)
        started = time.perf_counter()
        results = asyncio.run(_replay(url, requests, bench))
        wall = time.perf_counter() - started
        hits1, queries1 = prefix_cache_counters(replicas)
        return Row(router.name, results, wall, hits1 - hits0, queries1 - queries0)
    except RuntimeError as exc:
        return Row(router.name, [], 0.0, 0.0, 0.0, missing=f"{exc}; {router.log_tail()}")
    finally:
        router.stop()


@dataclass(frozen=True)
class Figures(Latencies):
    #: The replicas' own prefix-cache counters over the run (vLLM's hits over queries).
    hit_ratio: float


def figures(row: Row) -> Figures:
    hit_ratio = row.hits / row.queries if row.queries else math.nan
    return Figures(**Latencies.fields_of(row.results), hit_ratio=hit_ratio)


def print_report(rows: Sequence[Row]) -> None:
    figs = {row.name: figures(row) for row in rows if not row.missing}
    table = [
        [
            name,
            f.ok,
            f.failed,
            f"{f.hit_ratio:.1%}",
            f"{f.ttft_mean * 1000:.0f}",
            f"{f.ttft_p50 * 1000:.0f}",
            f"{f.ttft_p99 * 1000:.0f}",
            f"{f.e2e_mean * 1000:.0f}",
            f"{f.e2e_p50 * 1000:.0f}",
        ]
        for name, f in figs.items()
    ]
    heads = [
        "contender",
        "ok",
        "failed",
        "engine hit ratio",
        "TTFT mean ms",
        "p50",
        "p99",
        "e2e mean ms",
        "p50",
    ]
    print(format_table(heads, table))
    for row in rows:
        if row.missing:
            print(f"{row.name} not run: {row.missing}")
        failed = [r for r in row.results if not r.ok]
        if failed:
            print(f"{row.name}: {len(failed)} failed, the first with {failed[0].status}: {failed[0].error}")
    rr, sgl = figs.get("kvroute round_robin"), figs.get("sglang cache_aware")
    ratios = []
    for name, f in figs.items():
        ratios.append(
            [
                name,
                ratio(f.hit_ratio, rr.hit_ratio) if rr else "-",
                ratio(f.ttft_mean, rr.ttft_mean) if rr else "-",
                ratio(f.e2e_mean, rr.e2e_mean) if rr else "-",
                ratio(f.hit_ratio, sgl.hit_ratio) if sgl else "-",
                ratio(f.ttft_mean, sgl.ttft_mean) if sgl else "-",
                ratio(f.e2e_mean, sgl.e2e_mean) if sgl else "-",
            ]
        )
    print()
    heads = [
        "ratios",
        "hit vs RR",
        "TTFT vs RR",
        "e2e vs RR",
        "hit vs SGLang",
        "TTFT vs SGLang",
        "e2e vs SGLang",
    ]
    print(format_table(heads, ratios))


def main(argv: Sequence[str] | None = None, prog: str = "python -m loadtest.bench_real_engines") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="Mooncake-format trace (the default is the one kvroute ships)",
    )
    parser.add_argument("--minutes", type=float, default=0.5, help="trace minutes to replay")
    parser.add_argument("--speedup", type=float, default=0.5, help="time compression")
    parser.add_argument("--scale", type=int, default=16, help="trace tokens per benchmark token")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="prompt cap")
    parser.add_argument("--max-output-tokens", type=int, default=16, help="output cap")
    parser.add_argument("--sample", type=int, default=1, help="keep one conversation in N")
    parser.add_argument("--kv-cache-mib", type=int, default=8, help="each replica's KV cache")
    parser.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help=f"comma-separated, of {', '.join([*KVROUTE, 'sglang'])} (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in KVROUTE and c != "sglang"]
    if unknown:
        parser.error(f"unknown contender {unknown[0]!r}")
    if TRACE_BLOCK_TOKENS % args.scale or args.scale < 1:
        parser.error("--scale: a divisor of 512")
    if not engine_installed():
        print("no vLLM engine: run bash tests/real_engines/setup.sh first", file=sys.stderr)
        return 2
    bench = Bench(
        trace=args.trace,
        minutes=args.minutes,
        speedup=args.speedup,
        scale=args.scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        kv_cache_mib=args.kv_cache_mib,
        sample=args.sample,
    )
    requests = scaled(read_trace(bench.trace, minutes=bench.minutes), bench)
    print(
        f"{len(requests)} requests: the first {bench.minutes:g} min of {bench.trace.name}"
        f"{f' (one conversation in {bench.sample})' if bench.sample > 1 else ''}, lengths / "
        f"{bench.scale} (prompts <= {bench.max_prompt_tokens}, outputs <= {bench.max_output_tokens} tokens), "
        f"{bench.speedup:g}x compressed, streamed chat; 2 vLLM replicas x {bench.kv_cache_mib} MiB of KV "
        f"cache (blocks of {BLOCK_SIZE} tokens), caches reset for each contender\n",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-real-") as tmp:
        replicas = [
            VllmReplica(
                f"e{i}", kv_cache_bytes=bench.kv_cache_mib * 1024 * 1024, env={"VLLM_SERVER_DEV_MODE": "1"}
            )
            for i in range(2)
        ]
        start_replicas(replicas)
        rows = []
        try:
            for name in contenders:
                row = run_contender(name, replicas, requests, bench, Path(tmp))
                print(f"  {row.name}: {'not run' if row.missing else f'{row.wall_s:.0f} s'}", flush=True)
                rows.append(row)
        finally:
            for replica in replicas:
                replica.stop()
                replica.remove_files()
    print()
    print_report(rows)
    return 0 if all(not r.missing and figures(r).failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
