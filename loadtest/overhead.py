"""Router overhead: what a proxy adds in front of backends that answer at once.

    python -m loadtest.overhead            # or: kvroute bench overhead

One invocation starts null backends (:mod:`loadtest.null_backend`: a small JSON body, or 50
small SSE chunks) and measures, one contender at a time:

- ``direct``: the load generator talks to a backend itself (the baseline);
- ``kvroute``: ``kvroute serve`` with ``prefix_aware`` routing, one process (and with
  ``--workers N`` when ``--workers`` is given here: with the memory store, the workers sharing
  over Unix sockets, and when redis-server is installed sharing a Redis index in each
  ``index.redis.lookup`` mode, the Redis server's CPU counted as theirs; and a table of
  their rate against one process's, measured and on N cores of their own);
- ``nginx``: Debian's nginx-light, one worker, ``least_conn``, upstream keepalive,
  ``proxy_buffering off`` — what operators would otherwise put there;
- ``sglang cache_aware``: SGLang's Rust router (``sglang-router``);
- ``floor``: aiohttp's server and kvroute's upstream client passing requests through with no
  routing at all (:mod:`loadtest.floor_proxy`): the cost of the stack kvroute is built on,
  below which nothing inside kvroute's request path can go;
- ``kvroute access-log``, with ``--access-log``: kvroute with ``logging.access_log`` on, one
  line per request written to its log file;
- ``kvroute baseline``, with ``--baseline DIR``: the kvroute of another source tree (e.g.
  ``git worktree add /tmp/before HEAD~3``), so a change is measured against its parent in
  the same invocation, on the same noisy machine.

For each: latency at a fixed moderate rate (``--rate``, open loop), non-streaming and
streaming (time to the first chunk, and to the end), and the added latency over ``direct``;
then the saturation rate (``--concurrency`` requests back to back for each of the proxy's
processes) and streamed chunks per second, with the proxy pinned to ``--proxy-cpu`` while the
load generator and the backends share ``--harness-cpu``. Rates are also given as ratios
against kvroute. The request bodies are chat requests whose prompts share a few long
prefixes, so cache-aware routing has real work to do (hashing, matching, recording).

With ``--profile DIR``, py-spy samples each kvroute contender (with ``--workers``, its worker
processes) during the run; the top functions by own time are printed, and the raw stacks kept
in DIR, one file per contender.

Numbers depend on the machine and on what else runs on it; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from loadtest import contenders as procs
from loadtest.help_format import DefaultsHelpFormatter
from loadtest.httpload import Client, Sample, Throughput, build_request
from loadtest.null_backend import MODEL, STREAM_CHUNKS
from loadtest.ports import free_port
from loadtest.redis_server import RedisServer
from loadtest.report import format_table, percentile
from router.tasks import run_event_loop

PATH = "/v1/chat/completions"
_LINE = re.compile(r":\d+\)$")
#: Distinct shared prefixes among the request bodies, and bodies in all.
PREFIXES, BODIES = 16, 256


def request_bodies(stream: bool, count: int = BODIES) -> list[bytes]:
    """Chat bodies of ~1.3 kB whose system prompts come from a few shared prefixes."""
    bodies = []
    for i in range(count):
        system = f"System prompt {i % PREFIXES}: " + "you are a helpful assistant. " * 36
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}: " * 8}]
        body = {"model": MODEL, "messages": messages, "max_tokens": STREAM_CHUNKS, "stream": stream}
        bodies.append(orjson.dumps(body))
    return bodies


@dataclass
class Measurement:
    """One contender's samples, pooled over rounds; saturation figures are the best round's."""

    name: str
    missing: str | None = None
    plain: list[Sample] = field(default_factory=list)
    stream: list[Sample] = field(default_factory=list)
    plain_max: Throughput | None = None
    stream_max: Throughput | None = None
    saturation_errors: int = 0
    #: The proxy's CPU seconds during the saturation runs, and what they served (all rounds).
    plain_cpu: float = 0.0
    plain_served: int = 0
    stream_cpu: float = 0.0
    stream_served: int = 0

    @property
    def cpu_per_request(self) -> float:
        """Proxy CPU seconds per non-streamed request: its cost, whatever CPU share it got."""
        return self.plain_cpu / self.plain_served if self.plain_served and self.plain_cpu else math.nan

    @property
    def cpu_per_chunk(self) -> float:
        """Proxy CPU seconds per streamed chunk."""
        return self.stream_cpu / self.stream_served if self.stream_served and self.stream_cpu else math.nan

    def quantile(self, samples: list[Sample], q: float, first_byte: bool = False) -> float:
        good = [s.first_byte if first_byte else s.latency for s in samples if s.ok]
        return percentile(good, q)

    def errors(self) -> int:
        return sum(not s.ok for s in self.plain + self.stream) + self.saturation_errors

    def add_saturation(self, plain: Throughput, stream: Throughput) -> None:
        self.saturation_errors += plain.errors + stream.errors
        if self.plain_max is None or plain.rate > self.plain_max.rate:
            self.plain_max = plain
        if self.stream_max is None or stream.event_rate > self.stream_max.event_rate:
            self.stream_max = stream


async def measure_round(contender: procs.Contender, result: Measurement, args: argparse.Namespace) -> None:
    """One round for one contender: the two latency runs, then the two saturation runs."""
    host = f"127.0.0.1:{contender.port}"
    plain = [build_request(host, PATH, b) for b in request_bodies(False)]
    stream = [build_request(host, PATH, b) for b in request_bodies(True)]
    client = Client("127.0.0.1", contender.port)
    try:
        count = int(args.rate * args.seconds)
        await client.fixed_rate(plain, args.rate, max(1, count // 5))  # warm up connections and caches
        result.plain += await client.fixed_rate(plain, args.rate, count)
        result.stream += await client.fixed_rate(stream, args.rate, count)
        cpu = contender.cpu_seconds
        before = cpu()
        in_flight = args.concurrency * contender.processes
        plain_max = await client.saturate(plain, in_flight, args.saturation_seconds)
        middle = cpu()
        stream_max = await client.saturate(stream, in_flight, args.saturation_seconds)
        result.plain_cpu += middle - before
        result.stream_cpu += cpu() - middle
        result.plain_served += plain_max.all_requests
        result.stream_served += stream_max.all_events
        result.add_saturation(plain_max, stream_max)
    finally:
        client.close()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def _ratio(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or not base:
        return "n/a"
    return f"{value / base:.2f}x"


def latency_table(results: Sequence[Measurement], rate: float) -> tuple[list[str], list[list[object]]]:
    base = results[0]
    headers = [
        "contender",
        "p50 ms",
        "p99 ms",
        "added p50",
        "added p99",
        "stream 1st chunk p50",
        "p99",
        "added p50",
        "added p99",
        "stream end p50",
        "errors",
    ]
    rows = []
    for r in results:
        if r.missing:
            rows.append([r.name, f"not run: {r.missing}", *[""] * (len(headers) - 2)])
            continue
        q = r.quantile
        rows.append(
            [
                r.name,
                _ms(q(r.plain, 0.5)),
                _ms(q(r.plain, 0.99)),
                _ms(q(r.plain, 0.5) - base.quantile(base.plain, 0.5)),
                _ms(q(r.plain, 0.99) - base.quantile(base.plain, 0.99)),
                _ms(q(r.stream, 0.5, True)),
                _ms(q(r.stream, 0.99, True)),
                _ms(q(r.stream, 0.5, True) - base.quantile(base.stream, 0.5, True)),
                _ms(q(r.stream, 0.99, True) - base.quantile(base.stream, 0.99, True)),
                _ms(q(r.stream, 0.5)),
                r.errors(),
            ]
        )
    return headers, rows


def saturation_table(results: Sequence[Measurement]) -> tuple[list[str], list[list[object]]]:
    """Best-round rates, and the proxy's CPU cost per request and per chunk, as capacity per core.

    On a shared machine a pinned proxy gets an unknown share of its core, so its rate alone
    says little; CPU time per request does not depend on that share, and 1 / (CPU per
    request) is the rate one whole core would sustain. Ratios compare kvroute with each.
    """
    kv = next((r for r in results if r.name == "kvroute" and not r.missing), None)
    headers = [
        "contender",
        "req/s",
        "CPU us/req",
        "req/s per core",
        "kvroute / this",
        "stream req/s",
        "chunks/s",
        "CPU us/chunk",
        "chunks/s per core",
        "kvroute / this",
    ]
    rows = []
    for r in results:
        if r.missing or r.plain_max is None or r.stream_max is None:
            continue
        rows.append(
            [
                r.name,
                f"{r.plain_max.rate:.0f}",
                _us(r.cpu_per_request),
                _per_core(r.cpu_per_request),
                _ratio(r.cpu_per_request, kv.cpu_per_request) if kv else "n/a",
                f"{r.stream_max.rate:.0f}",
                f"{r.stream_max.event_rate:.0f}",
                _us(r.cpu_per_chunk),
                _per_core(r.cpu_per_chunk),
                _ratio(r.cpu_per_chunk, kv.cpu_per_chunk) if kv else "n/a",
            ]
        )
    return headers, rows


def workers_table(results: Sequence[Measurement], workers: int) -> tuple[list[str], list[list[object]]]:
    """``kvroute xN`` against one kvroute: the rate measured, and the rate on N cores of their own.

    On a machine whose cores the load generator and the backends share, N workers cannot get
    N whole cores, so their measured rate understates how they scale. What does not depend on
    the share they got is their CPU per request (the Redis server's included): N cores of
    their own would serve N / (that) requests a second, against 1 / (one worker's) on one.
    """
    one = next((r for r in results if r.name == "kvroute" and not r.missing and r.plain_max), None)
    headers = ["contender", "req/s", "vs one worker", "CPU us/req", f"on {workers} cores of their own"]
    rows = []
    for r in results:
        if one is None or not r.name.startswith(f"kvroute x{workers} ") or r.missing or r.plain_max is None:
            continue
        own_cores = workers * one.cpu_per_request / r.cpu_per_request
        rows.append(
            [
                r.name,
                f"{r.plain_max.rate:.0f}",
                f"{r.plain_max.rate / one.plain_max.rate:.2f}x",
                _us(r.cpu_per_request),
                "n/a" if math.isnan(own_cores) else f"{own_cores:.2f}x",
            ]
        )
    return headers, rows


def _us(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e6:.0f}"


def _per_core(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{1 / seconds:.0f}"


class Profiler:
    """py-spy attached to one process until stopped, writing collapsed stacks (``--format raw``)."""

    def __init__(self, pid: int, output: Path) -> None:
        sibling = Path(sys.executable).with_name("py-spy")  # installed with the bench extra
        binary = str(sibling) if sibling.exists() else shutil.which("py-spy") or "py-spy"
        command = [binary, "record", "--pid", str(pid), "--format", "raw", "--output", str(output)]
        # --subprocesses: `kvroute serve --workers N` does its work in the children.
        command += ["--rate", "250", "--nonblocking", "--subprocesses"]
        self.output = output
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> None:
        """Interrupt py-spy, which then writes what it sampled."""
        self.process.send_signal(signal.SIGINT)
        _, err = self.process.communicate(timeout=60)
        if not self.output.exists():
            print(f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}", file=sys.stderr)


def top_functions(
    collapsed: str, limit: int = 15
) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """Samples, and the top functions by own (leaf) and total samples, from py-spy's raw output."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = [_LINE.sub(")", frame) for frame in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    return samples, own.most_common(limit), total.most_common(limit)


def profile_path(directory: str, contender: str) -> Path:
    """Where one kvroute contender's samples go: ``kvroute x2 local`` -> ``kvroute-x2-local.txt``."""
    return Path(directory) / f"{contender.replace(' ', '-')}.txt"


def print_profile(contender: str, path: Path, limit: int = 15) -> None:
    samples, own, total = top_functions(path.read_text(), limit)
    if not samples:
        print(f"profile {path}: no samples")
        return
    print(f"\nprofile of {contender} under the benchmark ({samples} samples, {path}):")
    print(format_table(["own %", "function (file)"], [[f"{100 * n / samples:.1f}", f] for f, n in own]))
    print()
    print(format_table(["total %", "function (file)"], [[f"{100 * n / samples:.1f}", f] for f, n in total]))


async def run(args: argparse.Namespace, workdir: Path) -> list[Measurement]:
    backend_ports = [free_port() for _ in range(args.backends)]
    backend_urls = [f"http://127.0.0.1:{p}" for p in backend_ports]
    command = procs.null_backends(backend_ports, args.harness_cpu, args.token_interval_ms)
    backends = procs.Contender("null backends", backend_ports[0], command)
    chosen = set(args.only.split(",")) if args.only else None
    contenders = [procs.direct(backend_ports[0]), procs.kvroute(workdir, backend_urls, args.proxy_cpu)]
    if args.baseline:
        baseline = Path(args.baseline)
        contenders.append(procs.kvroute(workdir, backend_urls, args.proxy_cpu, checkout=baseline))
    if args.access_log:
        contenders.append(procs.kvroute(workdir, backend_urls, args.proxy_cpu, access_log=True))
    redis: RedisServer | None = None
    if args.workers > 1:
        contenders.append(procs.kvroute(workdir, backend_urls, args.proxy_cpu, args.workers))
        missing = _redis_missing()
        if missing:
            contenders.append(procs.Contender(f"kvroute x{args.workers} redis", 0, missing=missing))
        else:
            # A private Redis holds the workers' shared index, in both lookup modes; its CPU
            # time counts as theirs. Give them the cores (--proxy-cpu 0,1) to see them scale.
            redis = RedisServer()
            for lookup in ("local", "shared"):
                contenders.append(
                    procs.kvroute(
                        workdir, backend_urls, args.proxy_cpu, args.workers, redis.url, redis_lookup=lookup
                    )
                )
    contenders += [
        procs.floor(backend_urls, args.proxy_cpu),
        procs.nginx(workdir, backend_urls, args.proxy_cpu),
        procs.sglang(backend_urls, args.proxy_cpu),
    ]
    if chosen:
        contenders = [c for c in contenders if c.name == "direct" or c.name.split()[0] in chosen]
    if redis is not None and not any(c.name.startswith("kvroute x") for c in contenders):
        redis.close()  # only its temporary directory exists yet
        redis = None

    results = {c.name: Measurement(c.name, missing=c.missing) for c in contenders}
    running = [c for c in contenders if not c.missing]
    profilers: list[Profiler] = []
    try:
        backends.start(workdir)
        if redis is not None:
            redis.start()
            for contender in contenders:
                if contender.name.startswith("kvroute x"):
                    contender.cpu_also_of.append(redis.process.pid)
        for port in backend_ports:
            procs.wait_listening(port, 10, backends.process)
        # All start at once and idle while another is measured; rounds interleave them, so a
        # burst of unrelated load on this machine does not fall on one contender only.
        for contender in running:
            contender.start(workdir)
        for contender in list(running):
            try:
                procs.wait_listening(contender.port, 30, contender.process)
                await wait_routable(contender.port)
            except RuntimeError as exc:
                results[contender.name].missing = f"{exc}: {contender.log_tail()}"
                running.remove(contender)
        # Sampled only while they run; py-spy leaves idle threads out, so the samples are each
        # kvroute under the benchmark's load, not waiting for the others' rounds.
        if args.profile:
            profilers = [
                Profiler(c.pid, profile_path(args.profile, c.name))
                for c in running
                if c.name.startswith("kvroute") and c.pid
            ]
        for number in range(1, args.rounds + 1):
            # Each round starts one contender later: whoever runs right after another on a
            # warm machine measured up to 15 % cheaper here, so no contender keeps one place.
            shift = (number - 1) % len(running)
            for contender in running[shift:] + running[:shift]:
                print(f"round {number}/{args.rounds}: {contender.name}", flush=True)
                await measure_round(contender, results[contender.name], args)
    finally:
        for profiler in profilers:
            profiler.stop()
        for contender in [*running, backends]:
            contender.stop()
        if redis is not None:
            redis.close()
    return list(results.values())


def _redis_missing() -> str | None:
    """Why ``kvroute serve --workers`` cannot be measured with the Redis index here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server not installed (needed for the workers' Redis index)"
    return None


async def wait_routable(port: int, timeout: float = 30.0) -> None:
    """Until a real request goes through: routers may listen before their backends are healthy."""
    request = build_request(f"127.0.0.1:{port}", PATH, request_bodies(False, 1)[0])
    client = Client("127.0.0.1", port, timeout=2.0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while not (await client.request(request)).ok:
            if loop.time() > deadline:
                raise RuntimeError(f"no successful request through port {port} after {timeout:.0f} s")
            await asyncio.sleep(0.1)
    finally:
        client.close()


def build_parser(prog: str = "python -m loadtest.overhead") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=DefaultsHelpFormatter,
        description="Router overhead against null backends.",
    )
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s of the latency runs")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each latency run")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="requests in flight per proxy process when saturating (--workers N: N times as many)",
    )
    parser.add_argument(
        "--saturation-seconds", type=float, default=3.0, help="duration of each saturation run"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds over all contenders: latency pooled, saturation best of"
    )
    parser.add_argument("--backends", type=int, default=2, help="null backends behind each proxy")
    parser.add_argument(
        "--token-interval-ms",
        type=float,
        default=0.0,
        help="the null backends' pause between a stream's chunks, as an engine's decode step "
        "(0: back to back, so a proxy often reads several chunks at once)",
    )
    parser.add_argument("--proxy-cpu", default="1", help="taskset CPU list for the proxy")
    parser.add_argument("--harness-cpu", default="0", help="CPU list for the load generator and backends")
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="also run kvroute serve --workers N (N > 1; memory and Redis index)",
    )
    parser.add_argument(
        "--baseline", default="", help="another kvroute source tree, measured as 'kvroute baseline'"
    )
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="also run kvroute with its access log on ('kvroute access-log')",
    )
    parser.add_argument("--only", default="", help="comma-separated contenders: kvroute,floor,nginx,sglang")
    parser.add_argument(
        "--profile",
        default="",
        help="directory: py-spy samples each kvroute contender, top functions printed",
    )
    parser.add_argument("--report", default="", help="directory: also write report.md with the tables")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m loadtest.overhead") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.harness_cpu and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, procs.cpu_list(args.harness_cpu))
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvroute-overhead-") as tmp:
        workdir = Path(tmp)
        workdir.chmod(0o755)  # nginx's worker runs as nobody
        results = run_event_loop(run(args, workdir))

    heading = (
        f"null backends x{args.backends}, {STREAM_CHUNKS}-chunk streams"
        f"{f' ({args.token_interval_ms:g} ms apart)' if args.token_interval_ms else ''}; "
        f"latency at {args.rate:.0f} req/s "
        f"for {args.seconds:.0f} s; saturation: {args.concurrency} in flight per process, "
        f"proxy on CPU {args.proxy_cpu}"
    )
    latency = latency_table(results, args.rate)
    saturation = saturation_table(results)
    print(f"\n{heading}\n\nlatency (ms; added = minus direct)")
    print(format_table(*latency))
    print(
        "\nsaturation: best round; CPU = the proxy's own CPU time, per core = 1 / CPU per request; "
        "direct = the load generator's ceiling"
    )
    print(format_table(*saturation))
    tables = [("Latency (ms)", *latency), ("Saturation", *saturation)]
    if args.workers > 1:
        workers = workers_table(results, args.workers)
        print(f"\n--workers {args.workers} against one kvroute (with Redis, CPU includes the Redis server's)")
        print(format_table(*workers))
        tables.append((f"--workers {args.workers}", *workers))
    if args.profile:
        for result in results:
            if result.name.startswith("kvroute") and not result.missing:
                with contextlib.suppress(FileNotFoundError):
                    print_profile(result.name, profile_path(args.profile, result.name))
    if args.report:
        from loadtest.report_md import write_report

        command = "python -m loadtest.overhead " + " ".join(argv if argv is not None else sys.argv[1:])
        print(
            write_report([], args.report, "Router overhead", intro=f"`{command}`\n\n{heading}", tables=tables)
        )
    return 1 if any(r.errors() for r in results if not r.missing) else 0


if __name__ == "__main__":
    sys.exit(main())
