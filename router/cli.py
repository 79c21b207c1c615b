"""The ``kvroute`` command: the face of the whole distribution.

This is the only module of ``router`` that imports ``loadtest``: the proxy itself never
depends on its test bench, but the command offers both (``sim``, ``demo``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any

from router.config import ConfigError, load_config


def _run(main: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop where it is installed (it is a dependency on Linux and macOS)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _serve(args: argparse.Namespace) -> int:
    from router.server import serve_forever

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"kvroute: invalid config: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _run(serve_forever(config))
    return 0


def _sim(args: argparse.Namespace) -> int:
    from loadtest.sim.fleet import serve_fleet
    from loadtest.sim.timing import EngineTiming

    logging.basicConfig(level=logging.INFO)
    timing = EngineTiming(kv_blocks=args.kv_blocks) if args.kv_blocks else EngineTiming()
    _run(serve_fleet(args.engines, args.host, args.port, timing))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from loadtest.demo import run_demo

    logging.basicConfig(level=logging.WARNING)
    return _run(run_demo(conversations=args.conversations, seed=args.seed))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description="Cache-aware router for LLM inference engines"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the router in front of the backends in a config file")
    serve.add_argument("--config", required=True, help="YAML config (see config.example.yaml)")
    serve.set_defaults(func=_serve)

    sim = commands.add_parser("sim", help="run a simulated vLLM-like engine fleet (no GPU needed)")
    sim.add_argument("--engines", type=int, default=4, help="number of engines (default 4)")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8001, help="port of the first engine; the rest follow")
    sim.add_argument("--kv-blocks", type=int, default=0, help="prefix cache capacity per engine, in blocks")
    sim.set_defaults(func=_sim)

    demo = commands.add_parser(
        "demo", help="compare round robin and prefix-aware routing on a simulated fleet"
    )
    demo.add_argument("--conversations", type=int, default=96, help="multi-turn conversations to replay")
    demo.add_argument("--seed", type=int, default=7)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
