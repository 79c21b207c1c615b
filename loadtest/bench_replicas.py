"""Router replicas in virtual time, over seeds: how close N replicas route to one router, and
how far one router is from itself.

    python -m loadtest.bench_replicas [--seeds 8] [--replicas 4] [--limit 1200] [--speedup 4]
                                      [--spread-s 3] [--engines 4] [--policy latency]

A live run of ``python -m loadtest.bench_redis`` replays one slice once, so a ratio of hit
ratios between two contenders mixes what the replicas lose with where a handful of random
choices sent the first copy of each prefix. This replays the same slice (bench_redis's by
default: the first 1,200 requests of the Mooncake trace at 4x, spread over their 3-second
ticks, 4 engines, prefill 4 µs a token, 16-token outputs) once per seed in virtual time
(``kvroute simulate``'s model, loadtest/simulate.py) through:

* one router (the reference of its seed);
* one router with another policy seed: the noise floor, what chance alone moves;
* N replicas sharing the load view every ``load_interval_s``, beliefs 5 ms after the pick
  (``lookup: local``'s stream, bench_redis's (e));
* N replicas with ``lookup: shared``, beliefs 1 ms after the pick, ``load_on_lookup`` off;
* the same with ``load_on_lookup`` on (the default): the view read on each lookup and
  published on each write.

and prints, per contender, the mean, least and greatest ratio to one router of the same seed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loadtest.help_format import DefaultsHelpFormatter
from loadtest.report import format_table
from loadtest.sim.timing import EngineTiming
from loadtest.simulate import FleetModel, Summary, load_source, simulate
from loadtest.trace import DEFAULT_TRACE

#: Added to a seed for the one router of "another seed"; far from any replica's (seed + 1000 k).
OTHER_SEED = 500


@dataclass(frozen=True)
class Contender:
    label: str
    #: FleetModel fields over the reference's (one router).
    fleet: dict[str, object]
    #: Added to the seed of the policies.
    seed_offset: int = 0


def contenders(replicas: int) -> list[Contender]:
    n = replicas
    return [
        Contender("one router", {}),
        Contender("one router, another seed", {}, OTHER_SEED),
        Contender(f"{n} replicas, lookup: local", {"replicas": n, "belief_delay_s": 0.005}),
        Contender(f"{n} replicas, shared, view every interval", {"replicas": n, "belief_delay_s": 0.001}),
        Contender(
            f"{n} replicas, shared, view on lookups",
            {"replicas": n, "belief_delay_s": 0.001, "load_on_lookup": True},
        ),
    ]


def ratios(runs: Sequence[Summary], references: Sequence[Summary]) -> tuple[list[float], list[float]]:
    """Hit ratio and TTFT mean of each run over its seed's reference."""
    hits = [run.hit_ratio / ref.hit_ratio for run, ref in zip(runs, references, strict=True)]
    ttfts = [run.ttft_mean / ref.ttft_mean for run, ref in zip(runs, references, strict=True)]
    return hits, ttfts


def spread(values: Sequence[float]) -> list[str]:
    return [f"{statistics.mean(values):.3f}", f"{min(values):.3f}", f"{max(values):.3f}"]


def run(args: argparse.Namespace) -> str:
    model = FleetModel(
        engines=args.engines,
        capacity_tokens=args.capacity,
        speedup=args.speedup,
        timing=EngineTiming(prefill_per_token_s=args.prefill_per_token_s),
    )
    chosen = contenders(args.replicas)
    results: dict[str, list[Summary]] = {c.label: [] for c in chosen}
    for seed in range(args.seeds):
        requests = load_source(
            str(args.trace),
            minutes=None,
            limit=args.limit,
            seed=seed,
            max_output_tokens=args.max_output_tokens,
            spread_s=args.spread_s,
        )
        for contender in chosen:
            fleet = replace(model, **contender.fleet)  # type: ignore[arg-type]
            _, summary = simulate(requests, fleet, args.policy, seed=seed + contender.seed_offset)
            results[contender.label].append(summary)
    reference = results[chosen[0].label]
    rows = []
    for contender in chosen[1:]:
        hits, ttfts = ratios(results[contender.label], reference)
        busiest = statistics.mean(s.imbalance for s in results[contender.label])
        rows.append([contender.label, *spread(hits), *spread(ttfts), f"{busiest:.2f}"])
    headers = ["contender", "hit vs one: mean", "min", "max", "TTFT mean vs one: mean", "min", "max"]
    headers.append("busiest engine")
    one = statistics.mean(s.ttft_mean for s in reference) * 1000
    hit = statistics.mean(s.hit_ratio for s in reference)
    title = (
        f"{args.seeds} seeds of {args.limit} requests at {args.speedup:g}x "
        f"(spread over {args.spread_s:g} s), {args.engines} engines, policy {args.policy}; "
        f"one router: hit ratio {hit:.1%}, TTFT mean {one:.0f} ms (means over seeds)"
    )
    return title + "\n\n" + format_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_replicas",
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format trace")
    parser.add_argument(
        "--seeds", type=int, default=8, help="seeds, each a spread of the slice and the policies' seed"
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--limit", type=int, default=1200, help="first N requests of the trace")
    parser.add_argument("--speedup", type=float, default=4.0)
    parser.add_argument("--spread-s", type=float, default=3.0, help="as bench_redis --spread-s")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=1_048_576, help="KV tokens per engine")
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--prefill-per-token-s", type=float, default=4e-6)
    parser.add_argument("--policy", default="latency")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seeds < 1 or args.replicas < 2 or args.limit < 1:
        print("bench_replicas: --seeds and --limit must be >= 1 and --replicas >= 2", file=sys.stderr)
        return 2
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
