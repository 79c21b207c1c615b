"""The ``kvroute`` command: the face of the whole distribution.

It stands above everything else: it imports ``router`` (``serve``) and ``loadtest`` (``sim``,
``demo``, ``simulate``, ``bench``), and nothing imports it, so the proxy never depends on its
test bench. Heavy imports happen inside each command, so ``kvroute --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urlsplit

from loadtest.help_format import DefaultsHelpFormatter
from loadtest.sim.timing import EngineTiming
from loadtest.trace import DEFAULT_TRACE
from router.config import ConfigError, ConfigSource
from router.fleet.settings import ENGINE_KINDS
from router.http.settings import DEFAULT_ADMIN_LISTEN, ListenConfig
from router.redis.settings import RedisConfig
from router.request_path.settings import RoutingConfig
from router.tasks import run_event_loop

#: The environment variable naming the config file when ``--config`` is not given.
CONFIG_ENV = "KVROUTE_CONFIG"


def kvroute_version() -> str:
    """The installed distribution's version: defined once, in pyproject.toml."""
    try:
        return version("kvroute")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        return "unknown (not installed)"


def backend_flag(value: str) -> dict[str, Any]:
    """``--backend [ENGINE=]URL`` as a ``backends`` entry, named after the URL's host:port."""
    engine, sep, url = value.partition("=")
    if not sep or "://" in engine:
        engine, url = "vllm", value
    if engine not in ENGINE_KINDS:
        raise argparse.ArgumentTypeError(
            f"unknown engine {engine!r} in {value!r} (one of {', '.join(ENGINE_KINDS)})"
        )
    return {"name": urlsplit(url).netloc or url, "url": url, "engine": engine}


def serve_source(args: argparse.Namespace) -> ConfigSource:
    """The config ``kvroute serve`` runs: its file (``--config``, else ``$KVROUTE_CONFIG``) with
    the flags on top, validated as one document."""
    overrides: dict[str, Any] = {}
    if args.backend:
        overrides["backends"] = args.backend
    if args.policy is not None:
        overrides["routing"] = {"policy": args.policy}
    listen = {key: value for key, value in (("host", args.host), ("port", args.port)) if value is not None}
    if listen:
        overrides["listen"] = listen
    if args.admin_port is not None:
        overrides["admin"] = {"listen": {"port": args.admin_port}}
    if args.redis_url is not None:
        overrides["index"] = {"store": "redis", "redis": {"url": args.redis_url}}
    if args.log_level is not None:
        overrides["log_level"] = args.log_level
    path = args.config or os.environ.get(CONFIG_ENV) or None
    return ConfigSource(path, overrides)


def _serve(args: argparse.Namespace) -> int:
    from router.http.server import ListenError, check_listen, serve_forever

    source = serve_source(args)
    if source.path is None and not args.backend:
        print(
            f"kvroute serve: no backends: give --backend URL (repeatable), --config FILE or ${CONFIG_ENV}",
            file=sys.stderr,
        )
        return 2
    try:
        config = source.load()
    except ConfigError as exc:
        print(f"kvroute: invalid config: {exc}", file=sys.stderr)
        return 2
    from router.http.processes import refusal, serve_processes

    reason = refusal(config, args.workers)
    if reason is not None:
        print(f"kvroute: {reason}", file=sys.stderr)
        return 2
    try:
        check_listen(config.listen.host, config.listen.port)
        for side in (config.admin.listen, config.metrics.listen):
            if side is not None:
                check_listen(side.host, side.port)
    except ListenError as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        return 2
    from router.http.logs import configure_logging

    configure_logging(config.logging, config.log_level)
    if args.workers > 1:
        return serve_processes(config, args.workers, source)
    try:
        run_event_loop(serve_forever(config, source))
    except ListenError as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        return 2
    return 0


def _sim(args: argparse.Namespace) -> int:
    from loadtest.sim.fleet import serve_fleet
    from loadtest.sim.kv_events import require_zmq

    if args.kv_events is not None:
        try:
            require_zmq()
        except RuntimeError as exc:
            print(f"kvroute sim: {exc}", file=sys.stderr)
            return 2

    logging.basicConfig(level=logging.INFO)
    link = {"kv_link_bytes_per_s": args.kv_link_gbytes_per_s * 1e9} if args.kv_link_gbytes_per_s else {}
    if args.kv_bytes_per_token:
        link["kv_bytes_per_token"] = args.kv_bytes_per_token
    if args.kv_blocks:
        link["kv_blocks"] = args.kv_blocks
    timing = EngineTiming(**link)
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    count = len(roles) or args.engines
    run_event_loop(serve_fleet(count, args.host, args.port, timing, kv_events=args.kv_events, roles=roles))
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
            replicas=args.replicas,
            load_interval_s=args.load_interval_s,
            belief_delay_s=args.belief_delay_s,
            load_on_lookup=args.load_on_lookup,
            refresh_share=args.refresh_share,
            kept_share=args.kept_share,
            timing=EngineTiming(prefill_per_token_s=args.prefill_per_token_s),
        )
    except ValueError as exc:
        print(f"kvroute simulate: {exc}", file=sys.stderr)
        return 2
    policies = [p for p in args.policy.split(",") if p]
    return run_command(
        args.workload or args.trace,
        policies,
        model,
        params=args.params,
        sweep=args.sweep,
        minutes=args.minutes,
        limit=args.limit,
        seed=args.seed,
        max_output_tokens=args.max_output_tokens,
        slowest=args.slowest,
        spread_s=args.spread_s,
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
    "partition": "loadtest.bench_partition",
    "report": "loadtest.report_md",
    "routing": "loadtest.bench_routing",
    "workers": "loadtest.bench_workers",
    "real-engines": "loadtest.bench_real_engines",
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = _BENCHMARKS[args.benchmark]
    if args.benchmark == "routing" and any(o == "--pd" or o.startswith("--pd=") for o in args.options):
        # A prefill/decode fleet: its own contenders and figures (loadtest/bench_disaggregation.py).
        module = "loadtest.bench_disaggregation"
    return importlib.import_module(module).main(args.options, prog=f"kvroute bench {args.benchmark}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="Cache-aware router for LLM inference engines",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvroute {kvroute_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, formatter_class=DefaultsHelpFormatter)

    serve = command("serve", "run the router in front of the backends given by flags, a config file, or both")
    serve.add_argument(
        "--config",
        help=f"YAML config (see config.example.yaml); default: ${CONFIG_ENV} when set. Flags win over it",
    )
    serve.add_argument(
        "--backend",
        action="append",
        type=backend_flag,
        metavar="[ENGINE=]URL",
        help="an engine to route to, repeatable; ENGINE is vllm (default) or sglang, e.g. sglang=http://h:30000",
    )
    serve.add_argument("--policy", help=f"routing.policy (a file without one: {RoutingConfig.policy})")
    serve.add_argument("--host", help=f"listen.host (a file without one: {ListenConfig.host})")
    serve.add_argument("--port", type=int, help=f"listen.port (a file without one: {ListenConfig.port})")
    serve.add_argument(
        "--admin-port",
        type=int,
        help=f"admin.listen.port: the admin API's own port, on loopback unless the file says otherwise "
        f"(a file without one: {DEFAULT_ADMIN_LISTEN.port})",
    )
    serve.add_argument("--redis-url", help="share the prefix index in Redis at this URL (index.store: redis)")
    serve.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="log_level (default info)"
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="router processes on the one port (SO_REUSEPORT), sharing their index and load",
    )
    serve.set_defaults(func=_serve)

    sim = command("sim", "run a simulated vLLM-like engine fleet (no GPU needed)")
    sim.add_argument("--engines", type=int, default=4, help="number of engines")
    sim.add_argument("--host", default="127.0.0.1", help="address the engines listen on")
    sim.add_argument("--port", type=int, default=8001, help="port of the first engine; the rest follow")
    sim.add_argument(
        "--kv-blocks",
        type=int,
        default=EngineTiming.kv_blocks,
        help="prefix cache capacity per engine, in blocks of 16 tokens",
    )
    sim.add_argument(
        "--kv-events",
        choices=ENGINE_KINDS,
        help="also publish KV cache events over ZMQ in this engine's format (for index.mode: events)",
    )
    sim.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="prefill/decode disaggregation: this many prefill engines first, then --decode ones "
        "(they replace --engines; both protocols: SGLang bootstrap, vLLM kv_transfer_params)",
    )
    sim.add_argument("--decode", type=int, default=0, help="decode engines after the --prefill ones")
    sim.add_argument(
        "--kv-bytes-per-token", type=int, default=0, help="KV bytes per token handed over (default 131072)"
    )
    sim.add_argument(
        "--kv-link-gbytes-per-s",
        type=float,
        default=0.0,
        help="prefill-to-decode link bandwidth in GB/s (default 100)",
    )
    sim.set_defaults(func=_sim)

    simulate = command(
        "simulate", "replay a Mooncake trace through routing policies on a model fleet, in virtual time"
    )
    simulate.add_argument(
        "--workload",
        choices=("chat", "agent", "no_reuse"),
        help="a generated workload instead of the trace (seeded by --seed; see loadtest/workloads.py)",
    )
    simulate.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        help="Mooncake-format trace, JSONL or .jsonl.gz (the default is the one kvroute ships)",
    )
    simulate.add_argument(
        "--policy",
        default="round_robin,least_load,prefix_aware,cost,latency",
        help="routing policy, or several separated by commas, each a table row",
    )
    simulate.add_argument("--params", help="the policies' parameters as a JSON object")
    simulate.add_argument("--engines", type=int, default=8, help="engines in the fleet")
    simulate.add_argument(
        "--capacity", type=int, default=1_000_000, help="KV capacity of each engine in tokens"
    )
    simulate.add_argument(
        "--belief-capacity", type=int, help="believed KV tokens per engine (default: the true capacity)"
    )
    simulate.add_argument("--eviction", default="lru", help="eviction of the router's beliefs: lru|lfu|ttl")
    simulate.add_argument("--block-tokens", type=int, default=64, help="router block in tokens")
    simulate.add_argument(
        "--prefill-per-token-s",
        type=float,
        default=EngineTiming.prefill_per_token_s,
        help="the engines' prefill time per uncached token (bench_redis's engines take 4e-6)",
    )
    simulate.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    simulate.add_argument(
        "--spread-s",
        type=float,
        default=0.0,
        help="move each arrival later by a random offset below this many trace seconds (seeded by "
        "--seed), as bench_redis --spread-s does",
    )
    simulate.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas sharing beliefs and load as through Redis, requests sent round robin",
    )
    simulate.add_argument(
        "--load-interval-s",
        type=float,
        default=RedisConfig.load_interval_s,
        help="with --replicas: index.redis.load_interval_s, how often each shares its load view",
    )
    simulate.add_argument(
        "--load-on-lookup",
        action="store_true",
        help="with --replicas: as lookup: shared with index.redis.load_on_lookup, each lookup reads the "
        "others' load and each pick's write publishes the replica's (with --belief-delay-s 0.001)",
    )
    simulate.add_argument(
        "--belief-delay-s",
        type=float,
        default=RedisConfig.sync_interval_ms / 1000,
        help="with --replicas: from a replica's pick until the others' lookups see it (0.005 as the "
        "belief stream of lookup: local; about 0.001 for lookup: shared); the idle interval is "
        "--sweep load_idle_interval_s=...",
    )
    simulate.add_argument(
        "--refresh-share",
        type=float,
        default=0.0,
        help="as routing.retention.refresh_share: keep prefixes that came back alive by asking for "
        "them again once this share of their engine's turnover passed without a request for them "
        "(policies/retention.py; 0: off)",
    )
    simulate.add_argument(
        "--kept-share",
        type=float,
        default=0.5,
        help="with --refresh-share: the most of each engine's capacity the kept prefixes hold",
    )
    simulate.add_argument(
        "--minutes", type=float, help="replay only the trace's first minutes (default: all)"
    )
    simulate.add_argument("--limit", type=int, help="replay only the trace's first requests (default: all)")
    simulate.add_argument("--sweep", help="key=v1,v2,...: one row per value of a policy or fleet parameter")
    simulate.add_argument(
        "--max-output-tokens",
        type=int,
        default=0,
        help="cap outputs, as bench routing does (0: the trace's own)",
    )
    simulate.add_argument(
        "--slowest",
        type=int,
        default=0,
        help="also print each run's slowest N requests and the reasons of its slowest 1 %%",
    )
    simulate.add_argument(
        "--seed", type=int, default=0, help="seed of the policies' random choices and of a generated workload"
    )
    simulate.set_defaults(func=_simulate)

    demo = command("demo", "compare round robin and prefix-aware routing on a simulated fleet")
    demo.add_argument("--conversations", type=int, default=96, help="multi-turn conversations to replay")
    demo.add_argument("--seed", type=int, default=7, help="seed of the workload")
    demo.set_defaults(func=_demo)

    config = command("config", "the config file: config schema")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    schema = config_commands.add_parser(
        "schema",
        help="print the config's JSON Schema (for editors and validators; docs/config.schema.json)",
        formatter_class=DefaultsHelpFormatter,
    )
    schema.set_defaults(func=_config_schema)

    bench = command(
        "bench",
        "benchmarks: bench overhead | bench partition | bench report | bench routing | bench workers"
        " | bench real-engines (each has --help)",
    )
    bench.add_argument("benchmark", choices=sorted(_BENCHMARKS), help="the benchmark to run")
    bench.add_argument(
        "options", nargs=argparse.REMAINDER, help="the benchmark's own options (see its --help)"
    )
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
