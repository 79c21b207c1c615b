"""``kvroute serve --workers N`` against one process, driven by a load generator that costs almost nothing.

    python -m loadtest.bench_workers            # or: kvroute bench workers

Why a benchmark of its own: ``kvroute bench overhead`` drives proxies with a Python load generator
and Python null backends, which at a router's saturation rate take about a third of a core. On a
machine of N cores, N workers then cannot have N cores, and their measured rate understates how
they scale. Here the load generator is wrk (C; Debian's ``wrk``) and the backends are nginx
answering from its config (:func:`loadtest.contenders.nginx_null_backends`): together about a
tenth of a router's CPU per request (the table's harness column says how much).

Contenders, interleaved over rounds, each saturated with ``--concurrency`` requests in flight per
router process:

- ``one process``: ``kvroute serve`` pinned to ``--proxy-cpu``, wrk and the backends on
  ``--harness-cpu``: one worker's saturation rate, on a core of its own;
- ``--workers N``: ``kvroute serve --workers N`` on ``--workers-cpu`` with the memory store, the
  workers sharing their index and load over Unix sockets (router/fleet/worker_sync.py);
- ``--workers N, Redis``: the same sharing through a private Redis with
  ``index.redis.lookup: local`` (what docs/redis.md recommends for workers on a Redis index),
  the Redis server's CPU counted as theirs;
- ``N separate processes``: N one-process routers with no shared index, pinned one per core of
  ``--workers-cpu``, each with its own wrk: the most N router processes reach on these cores
  with this harness, so the workers' ceiling;
- with ``--baseline DIR``, ``--workers N (baseline)``: the Redis workers run from another
  source tree (``git worktree add /tmp/before HEAD~1``) with a Redis namespace of their own, so
  a change to the workers is measured against its parent in the same rounds.

The routers route with ``--policy`` over the overhead benchmark's request bodies (a few shared
prefixes: hashing, matching and recording to do). The table gives each round's rate, their median,
the median over rounds of the rate against that round's one process (rounds interleave, so each
ratio compares runs seconds apart on a noisy machine), the routers' and the harness's CPU per
request, and errors. Exit status 1 if any request failed.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import orjson

from loadtest import contenders as procs
from loadtest.help_format import DefaultsHelpFormatter
from loadtest.overhead import request_bodies, wait_routable
from loadtest.ports import free_port
from loadtest.programs import require
from loadtest.redis_server import RedisServer
from loadtest.report import format_table
from router.tasks import run_event_loop

WRK_SCRIPT = Path(__file__).with_name("wrk_bodies.lua")


@dataclass(frozen=True)
class WrkRun:
    """What one wrk run reported (its ``done`` line, :file:`loadtest/wrk_bodies.lua`)."""

    requests: int
    seconds: float
    errors: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def parse_wrk(stdout: str) -> WrkRun:
    """The counts of wrk's last output line; a ValueError naming the output when there is none."""
    lines = stdout.strip().splitlines()
    try:
        counts = orjson.loads(lines[-1])
    except (IndexError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"wrk printed no counts: {stdout.strip()[-300:]!r}") from exc
    errors = counts["status_errors"] + counts["socket_errors"]
    return WrkRun(counts["requests"], counts["seconds"], errors)


def write_bodies(path: Path, bodies: Sequence[bytes]) -> Path:
    """The request bodies as :file:`loadtest/wrk_bodies.lua` reads them: one JSON body per line."""
    path.write_bytes(b"".join(body + b"\n" for body in bodies))
    return path


def wrk_command(port: int, concurrency: int, seconds: int, bodies: Path, cpus: str) -> list[str]:
    """One wrk thread keeping ``concurrency`` keep-alive connections busy for ``seconds``."""
    command = [require("wrk"), "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "5s"]
    command += ["-s", str(WRK_SCRIPT), f"http://127.0.0.1:{port}", "--", str(bodies)]
    return procs.pinned(command, cpus)


@dataclass
class Group:
    """One contender: the router processes saturated together, and what each round measured."""

    name: str
    routers: list[procs.Contender]
    rates: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    router_cpu: float = 0.0
    harness_cpu: float = 0.0

    @property
    def processes(self) -> int:
        return sum(router.processes for router in self.routers)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(group: Group, backends: procs.Contender, args: argparse.Namespace, bodies: Path) -> None:
    """One round: one wrk per router of the group, all at once; rates and CPU added to ``group``."""
    commands = [
        wrk_command(r.port, args.concurrency * r.processes, args.seconds, bodies, args.harness_cpu)
        for r in group.routers
    ]
    router_cpu = sum(r.cpu_seconds() for r in group.routers)
    harness_cpu = backends.cpu_seconds() + _children_cpu()
    running = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for c in commands]
    try:
        # Every wrk is waited for before any output is read, so none outlives a failed one.
        outputs = [p.communicate(timeout=args.seconds + 60)[0].decode(errors="replace") for p in running]
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
    runs = [parse_wrk(output) for output in outputs]
    group.router_cpu += sum(r.cpu_seconds() for r in group.routers) - router_cpu
    group.harness_cpu += backends.cpu_seconds() + _children_cpu() - harness_cpu
    group.rates.append(sum(run.rate for run in runs))
    group.requests += sum(run.requests for run in runs)
    group.errors += sum(run.errors for run in runs)


def workers_table(groups: Sequence[Group]) -> tuple[list[str], list[list[object]]]:
    """Each group's rounds against the first group's (one process) in the same rounds."""
    one = groups[0]
    headers = [
        "contender",
        "router processes",
        "req/s by round",
        "median req/s",
        "vs one process (median of rounds)",
        "router CPU us/req",
        "harness CPU us/req",
        "errors",
    ]
    rows = []
    for group in groups:
        ratios = [rate / base for rate, base in zip(group.rates, one.rates, strict=True) if base]
        spread = "n/a"
        if ratios:
            spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        per_request = 1e6 / group.requests if group.requests else float("nan")
        rows.append(
            [
                group.name,
                group.processes,
                " ".join(f"{rate:.0f}" for rate in group.rates),
                f"{statistics.median(group.rates):.0f}",
                spread,
                f"{group.router_cpu * per_request:.0f}",
                f"{group.harness_cpu * per_request:.0f}",
                group.errors,
            ]
        )
    return headers, rows


def run(args: argparse.Namespace, workdir: Path) -> list[Group]:
    bodies = write_bodies(workdir / "bodies.jsonl", request_bodies(False))
    ports = [free_port() for _ in range(args.backends)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    backends = procs.nginx_null_backends(workdir, ports, args.harness_cpu)
    if backends.missing:
        raise SystemExit(f"kvroute bench workers: {backends.missing}")
    require("wrk")
    redis = RedisServer()
    workers_cores = procs.cpu_list(args.workers_cpu)
    cores = [str(core) for core in sorted(workers_cores)] or [""]
    one = procs.kvroute(workdir, urls, args.proxy_cpu, policy=args.policy, name="one process")
    workers = procs.kvroute(
        workdir,
        urls,
        args.workers_cpu,
        workers=args.workers,
        policy=args.policy,
        name=f"--workers {args.workers}",
    )
    redis_workers_of = partial(
        procs.kvroute,
        workdir,
        urls,
        args.workers_cpu,
        workers=args.workers,
        redis_url=redis.url,
        redis_lookup="local",
        policy=args.policy,
        sync_interval_ms=args.sync_interval_ms,
    )
    redis_workers = redis_workers_of(name=f"--workers {args.workers}, Redis")
    # Those the Redis server's CPU counts to.
    on_redis = [redis_workers]
    separate = [
        procs.kvroute(workdir, urls, cores[i % len(cores)], policy=args.policy, name=f"separate {i}")
        for i in range(args.workers)
    ]
    groups = [
        Group(one.name, [one]),
        Group(workers.name, [workers]),
        Group(redis_workers.name, [redis_workers]),
        Group(f"{args.workers} separate processes", separate),
    ]
    if args.baseline:
        baseline = redis_workers_of(name=f"--workers {args.workers} (baseline)", checkout=Path(args.baseline))
        groups.append(Group(baseline.name, [baseline]))
        on_redis.append(baseline)
    routers = [router for group in groups for router in group.routers]
    try:
        backends.start(workdir)
        redis.start()
        if workers_cores:  # on the workers' cores: its CPU is theirs, and so is its core
            os.sched_setaffinity(redis.process.pid, workers_cores)
        for router in on_redis:
            router.cpu_also_of.append(redis.process.pid)
        for port in ports:
            procs.wait_listening(port, 10, backends.process)
        for router in routers:
            router.start(workdir)
        for router in routers:
            try:
                procs.wait_listening(router.port, 30, router.process)
                run_event_loop(wait_routable(router.port))
            except RuntimeError as exc:
                raise SystemExit(f"kvroute bench workers: {router.name}: {exc}: {router.log_tail()}") from exc
        for number in range(1, args.rounds + 1):
            # Each round starts one contender later, so none always runs first on a warm machine.
            shift = (number - 1) % len(groups)
            for group in groups[shift:] + groups[:shift]:
                print(f"round {number}/{args.rounds}: {group.name}", flush=True)
                measure(group, backends, args, bodies)
    finally:
        for router in routers:
            router.stop()
        backends.stop()
        redis.close()
    return groups


def build_parser(prog: str = "python -m loadtest.bench_workers") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=DefaultsHelpFormatter,
        description="kvroute serve --workers N against one process, with wrk and nginx as the harness.",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (N > 1)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds over the contenders")
    parser.add_argument("--seconds", type=int, default=5, help="duration of each saturation run (s)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per router process")
    parser.add_argument("--backends", type=int, default=2, help="null backends behind each router")
    parser.add_argument("--policy", default="latency", help="the routers' routing.policy")
    parser.add_argument(
        "--sync-interval-ms",
        type=float,
        default=None,
        help="the Redis workers' index.redis.sync_interval_ms (default: kvroute's, 5)",
    )
    parser.add_argument("--proxy-cpu", default="1", help="taskset CPU list of the one-process router")
    parser.add_argument(
        "--workers-cpu", default="0,1", help="CPU list of the workers and of the separate processes"
    )
    parser.add_argument("--harness-cpu", default="0", help="CPU list of wrk and the nginx backends")
    parser.add_argument(
        "--baseline", default="", help="another kvroute source tree: its Redis workers are one more contender"
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m loadtest.bench_workers") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.workers < 2:
        raise SystemExit(f"{prog}: --workers must be 2 or more")
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-workers-") as tmp:
        workdir = Path(tmp)
        workdir.chmod(0o755)  # nginx's worker runs as nobody
        groups = run(args, workdir)
    print(
        f"\n{args.policy} routing, {args.concurrency} in flight per router process, {args.seconds:.0f} s "
        f"runs, {args.rounds} rounds; one process on CPU {args.proxy_cpu}, the others on "
        f"{args.workers_cpu}, wrk and nginx on {args.harness_cpu}"
    )
    print(format_table(*workers_table(groups)))
    return 1 if any(group.errors for group in groups) else 0


if __name__ == "__main__":
    sys.exit(main())
