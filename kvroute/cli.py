"""The ``kvroute`` command: the face of the whole distribution.

It stands above everything else: it imports ``router`` (``serve``) and ``loadtest`` (``sim``,
``demo``, ``simulate``, ``bench``), and nothing imports it, so the proxy never depends on its
test bench. Heavy imports happen inside each command, so ``kvroute --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

from router.config import ConfigError, load_config
from router.fleet.settings import ENGINE_KINDS
from router.tasks import run_event_loop


def _serve(args: argparse.Namespace) -> int:
    from router.http.server import serve_forever

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"kvroute: invalid config: {exc}", file=sys.stderr)
        return 2
    from router.http.processes import refusal, serve_processes

    reason = refusal(config, args.workers)
    if reason is not None:
        print(f"kvroute: {reason}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.workers > 1:
        return serve_processes(config, args.workers, args.config)
    run_event_loop(serve_forever(config, args.config))
    return 0


def _sim(args: argparse.Namespace) -> int:
    from loadtest.sim.fleet import serve_fleet
    from loadtest.sim.timing import EngineTiming

    logging.basicConfig(level=logging.INFO)
    timing = EngineTiming(kv_blocks=args.kv_blocks) if args.kv_blocks else EngineTiming()
    run_event_loop(serve_fleet(args.engines, args.host, args.port, timing, kv_events=args.kv_events))
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from loadtest.simulate import FleetModel, run_command

    try:
        model = FleetModel(
            engines=args.engines,
            capacity_tokens=args.capacity,
            block_tokens=args.block_tokens,
            belief_capacity_tokens=args.belief_capacity,
            eviction=args.eviction,
            speedup=args.speedup,
        )
    except ValueError as exc:
        print(f"kvroute simulate: {exc}", file=sys.stderr)
        return 2
    policies = [p for p in args.policy.split(",") if p]
    return run_command(
        args.trace or args.workload,
        policies,
        model,
        params=args.params,
        sweep=args.sweep,
        minutes=args.minutes,
        limit=args.limit,
        seed=args.seed,
    )


def _demo(args: argparse.Namespace) -> int:
    from loadtest.demo import run_demo

    logging.basicConfig(level=logging.WARNING)
    return run_event_loop(run_demo(conversations=args.conversations, seed=args.seed))


def _config_schema(args: argparse.Namespace) -> int:
    from kvroute.config_schema import config_schema, render

    sys.stdout.write(render(config_schema()))
    return 0


#: ``kvroute bench NAME``: the module whose ``main(argv)`` runs it (loadtest/, imported on use).
_BENCHMARKS = {
    "overhead": "loadtest.overhead",
    "report": "loadtest.report_md",
    "routing": "loadtest.bench_routing",
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(_BENCHMARKS[args.benchmark]).main(args.options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description="Cache-aware router for LLM inference engines"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the router in front of the backends in a config file")
    serve.add_argument("--config", required=True, help="YAML config (see config.example.yaml)")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="router processes on the one port (SO_REUSEPORT); more than 1 needs index.store: redis",
    )
    serve.set_defaults(func=_serve)

    sim = commands.add_parser("sim", help="run a simulated vLLM-like engine fleet (no GPU needed)")
    sim.add_argument("--engines", type=int, default=4, help="number of engines (default 4)")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8001, help="port of the first engine; the rest follow")
    sim.add_argument("--kv-blocks", type=int, default=0, help="prefix cache capacity per engine, in blocks")
    sim.add_argument(
        "--kv-events",
        choices=ENGINE_KINDS,
        help="also publish KV cache events over ZMQ in this engine's format (for index.mode: events)",
    )
    sim.set_defaults(func=_sim)

    simulate = commands.add_parser(
        "simulate", help="replay a Mooncake trace through routing policies on a model fleet, in virtual time"
    )
    source = simulate.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Mooncake-format JSONL trace")
    source.add_argument(
        "--workload",
        choices=("chat", "agent", "no_reuse"),
        help="a generated workload instead of a trace (seeded by --seed; see loadtest/workloads.py)",
    )
    simulate.add_argument(
        "--policy", required=True, help="routing policy, or several separated by commas, each a table row"
    )
    simulate.add_argument("--params", help="the policies' parameters as a JSON object")
    simulate.add_argument("--engines", type=int, default=8, help="engines in the fleet (default 8)")
    simulate.add_argument(
        "--capacity", type=int, default=1_000_000, help="KV capacity of each engine in tokens (default 1M)"
    )
    simulate.add_argument(
        "--belief-capacity", type=int, help="believed KV tokens per engine (default: the true capacity)"
    )
    simulate.add_argument("--eviction", default="lru", help="eviction of the router's beliefs: lru|lfu|ttl")
    simulate.add_argument("--block-tokens", type=int, default=64, help="router block in tokens (default 64)")
    simulate.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    simulate.add_argument("--minutes", type=float, help="replay only the trace's first minutes")
    simulate.add_argument("--limit", type=int, help="replay only the trace's first requests")
    simulate.add_argument("--sweep", help="key=v1,v2,...: one row per value of a policy or fleet parameter")
    simulate.add_argument("--seed", type=int, default=0, help="seeds the policy and a generated workload")
    simulate.set_defaults(func=_simulate)

    demo = commands.add_parser(
        "demo", help="compare round robin and prefix-aware routing on a simulated fleet"
    )
    demo.add_argument("--conversations", type=int, default=96, help="multi-turn conversations to replay")
    demo.add_argument("--seed", type=int, default=7)
    demo.set_defaults(func=_demo)

    config = commands.add_parser("config", help="the config file: config schema (see --help)")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    schema = config_commands.add_parser(
        "schema", help="print the config's JSON Schema (for editors and validators; docs/config.schema.json)"
    )
    schema.set_defaults(func=_config_schema)

    bench = commands.add_parser("bench", help="benchmarks: bench overhead | bench report (each has --help)")
    bench.add_argument("benchmark", choices=sorted(_BENCHMARKS), help="overhead | report | routing")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
