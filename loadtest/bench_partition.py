"""How far partitioning the fleet by reuse class could raise the hit ratio, given a perfect classifier.

    kvroute bench partition --minutes 20 --capacity 400000

Issue 20's moonshot asks for placement that beats the pooled-LRU bound: keep prompts that will
never be reused away from the caches that hold prefixes that will be. The engines evict LRU,
so the only lever a router has is which engine's LRU sees which prompt. The strongest form of
that idea is a two-pool partition driven by a clairvoyant classifier, and this benchmark
measures it on a trace, in a cache-only model (no timing), so that a real classifier's result
can be read against what a perfect one would reach:

* The fleet is split into ``scratch`` engines and ``kept`` engines; each pool is modelled as
  one LRU cache as large as its engines together (perfect placement inside a pool, the same
  generosity as the pooled-LRU bound).
* A request whose prefix one pool holds deeper than the other, past the blocks every prompt
  starts with, goes there (its history is there: sending it elsewhere would miss it).
* Otherwise the **oracle** decides: a request whose new blocks some later request uses goes to
  ``kept``, every other one to ``scratch`` — unless the scratch pool's share of all prefill so
  far already exceeds ``cap`` times its share of the engines, in which case it goes to
  ``kept`` too. ``cap`` 1.0 keeps the pools' prefill in proportion to their engines (the load
  stays balanced); ``none`` lets the scratch engines take every one-shot prompt, however
  overloaded that leaves them.

The model fits traces like Mooncake's, whose prompts share at most a fleet-wide head (a
system prompt) besides their own conversation's history. Where many prompts share a long
document of their tenant, that document is the deeper match and decides the pool, and the
classifier has little left to place (on the ``chat`` workload nearly everything stays in
``kept``).

Prefill is counted as uncached prompt tokens (the decode, which both pools share alike, is
left out). The second table is what an actual classifier could see when a prompt arrives:
the share of requests whose new blocks are used again, by whether the prompt continues an
earlier one and by its length. The third is the other lever, which is the engines' and not
the router's: the pooled cache under other evictions than LRU (loadtest/evictions.py), up to
Belady's. The fourth is the one hold a router has on an LRU engine's eviction: keeping the
prefixes that came back alive by asking for them again once ``--refresh-shares`` of the
cache's turnover passed without a request for them, with at most ``--kept-shares`` of the
capacity kept (``refreshed_lru``, policies/retention.py's keeper).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.evictions import ARC, LRU, PooledCache, WTinyLFU, hit_ratio, refreshed_lru
from loadtest.help_format import DefaultsHelpFormatter
from loadtest.report import format_table
from loadtest.sim.cache import PrefixCache
from loadtest.simulate import belady_hit_ratio
from loadtest.trace import DEFAULT_TRACE, TraceError, TraceRequest, read_trace


@dataclass(frozen=True)
class Partition:
    #: Engines in the scratch pool (0: no partition, the pooled-LRU bound).
    scratch_engines: int
    #: The scratch pool's prefill share allowed, over its share of engines (None: unlimited).
    cap: float | None
    hit_ratio: float
    #: Each pool's share of the prefill over its share of the engines (1.0: its fair load).
    scratch_load: float
    kept_load: float


def reused_later(chains: Sequence[Sequence[int]]) -> list[bool]:
    """For each request: does a later request use one of the blocks it is the first to bring?

    This is the clairvoyant classifier: a prompt whose new blocks nobody asks for again only
    pollutes the cache it lands in.
    """
    uses = Counter(block for chain in chains for block in set(chain))
    seen: set[int] = set()
    verdicts = []
    for chain in chains:
        new = [block for block in chain if block not in seen]
        verdicts.append(any(uses[block] > 1 for block in new))
        seen.update(new)
    return verdicts


def partition(
    requests: Sequence[TraceRequest],
    *,
    engines: int,
    capacity_blocks: int,
    block_tokens: int,
    scratch_engines: int,
    cap: float | None,
    keep: Sequence[bool],
) -> Partition:
    """Replay ``requests`` through a fleet split into scratch and kept pools (module docstring).

    ``keep[i]`` is the classifier's verdict on request ``i``: True sends it to the kept pool
    when neither pool holds more of its prefix than the other.
    """
    if not 0 <= scratch_engines < engines:
        raise ValueError(f"scratch_engines must be in [0, {engines}), got {scratch_engines}")
    kept = PrefixCache((engines - scratch_engines) * capacity_blocks, block_tokens, 1)
    scratch = PrefixCache(scratch_engines * capacity_blocks, block_tokens, 1) if scratch_engines else None
    fair = scratch_engines / engines
    prefill = Counter[str]()
    chains = [r.chain(block_tokens) for r in requests]
    head = _shared_head(chains)
    for i, (request, chain) in enumerate(zip(requests, chains, strict=True)):
        # Both pools soon hold the blocks every prompt starts with: only a match past them
        # says where the request's own history is.
        in_kept = max(kept.peek(chain, request.input_tokens), head)
        in_scratch = max(scratch.peek(chain, request.input_tokens), head) if scratch is not None else -1
        total = prefill["kept"] + prefill["scratch"]
        scratch_full = cap is not None and total > 0 and prefill["scratch"] / total > cap * fair
        if scratch is None or in_kept > in_scratch or (in_kept == in_scratch and (keep[i] or scratch_full)):
            pool, name = kept, "kept"
        else:
            pool, name = scratch, "scratch"
        cached = pool.lookup(chain, request.input_tokens)
        pool.insert(chain)
        prefill[name] += request.input_tokens - cached * block_tokens
    queried = kept.queries_tokens + (scratch.queries_tokens if scratch is not None else 0)
    hits = kept.hits_tokens + (scratch.hits_tokens if scratch is not None else 0)
    total = prefill["kept"] + prefill["scratch"]
    return Partition(
        scratch_engines=scratch_engines,
        cap=cap,
        hit_ratio=hits / queried if queried else 0.0,
        scratch_load=prefill["scratch"] / total / fair if total and fair else 0.0,
        kept_load=prefill["kept"] / total / (1 - fair) if total else 0.0,
    )


def observable_signals(
    requests: Sequence[TraceRequest], block_tokens: int, keep: Sequence[bool]
) -> list[list[object]]:
    """(kind of prompt, length, requests, share reused later) rows: what a real classifier sees.

    A prompt "continues" an earlier one when its leading blocks seen before reach past the
    blocks every prompt starts with (a fleet-wide system prompt says nothing about reuse).
    """
    chains = [r.chain(block_tokens) for r in requests]
    head = _shared_head(chains)
    seen: set[int] = set()
    groups: Counter[tuple[str, str, bool]] = Counter()
    for request, chain, reused in zip(requests, chains, keep, strict=True):
        known = 0
        while known < len(chain) and chain[known] in seen:
            known += 1
        seen.update(chain)
        kind = "continues an earlier prompt" if known > head else "new"
        groups[kind, _length_class(request.input_tokens), reused] += 1
    rows: list[list[object]] = []
    for kind, length in sorted({(k, n) for k, n, _ in groups}):
        reused, once = groups[kind, length, True], groups[kind, length, False]
        rows.append([kind, length, reused + once, f"{reused / (reused + once):.0%}"])
    return rows


#: The LRU row of ``eviction_ratios``: the pooled-LRU bound, which the other rows are read against.
LRU_ROW = "LRU (the pooled-LRU bound)"


def eviction_ratios(
    requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int
) -> dict[str, float]:
    """Hit ratio of one cache of ``capacity_blocks`` (the fleet pooled) under each eviction."""
    chains = [r.chain(block_tokens) for r in requests]
    tokens = [r.input_tokens for r in requests]
    caches: dict[str, PooledCache] = {
        LRU_ROW: LRU(capacity_blocks),
        "ARC": ARC(capacity_blocks),
        "W-TinyLFU, 1 % window": WTinyLFU(capacity_blocks, window=0.01),
    }
    ratios = {name: hit_ratio(cache, chains, tokens, block_tokens) for name, cache in caches.items()}
    ratios["Belady (clairvoyant)"] = belady_hit_ratio(chains, tokens, capacity_blocks, block_tokens)
    return ratios


def _times(ratio: float, lru: float) -> str:
    return f"{ratio / lru:.2f}x" if lru else "-"


def refresh_rows(
    requests: Sequence[TraceRequest],
    capacity_blocks: int,
    block_tokens: int,
    refresh_shares: Sequence[float],
    kept_shares: Sequence[float],
    lru: float,
) -> list[list[object]]:
    """(refresh share, kept share, hit ratio, x LRU, refreshes a request) rows of ``refreshed_lru``;
    ``lru`` is the same cache's hit ratio without refreshes."""
    rows: list[list[object]] = []
    for refresh_share in refresh_shares:
        for kept_share in kept_shares:
            run = refreshed_lru(requests, capacity_blocks, block_tokens, refresh_share, kept_share)
            rows.append(
                [
                    f"{refresh_share:g}",
                    f"{kept_share:.0%}",
                    f"{run.hit_ratio:.1%}",
                    _times(run.hit_ratio, lru),
                    f"{run.refreshes / len(requests):.2f}",
                ]
            )
    return rows


def _length_class(tokens: int) -> str:
    return "< 8k tokens" if tokens < 8192 else "8k-32k tokens" if tokens < 32768 else ">= 32k tokens"


def _shared_head(chains: Sequence[Sequence[int]]) -> int:
    """Leading blocks that every chain has in common."""
    if not chains:
        return 0
    head = 0
    while all(head < len(c) and c[head] == chains[0][head] for c in chains):
        head += 1
    return head


def _cap_label(cap: float | None) -> str:
    return "none" if cap is None else f"{cap:g}x"


def main(argv: Sequence[str] | None = None, prog: str = "python -m loadtest.bench_partition") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace, JSONL or .jsonl.gz"
    )
    parser.add_argument("--minutes", type=float, default=20.0, help="trace minutes to replay")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=400_000, help="KV tokens per engine")
    parser.add_argument("--block-tokens", type=int, default=64, help="router block in tokens")
    parser.add_argument(
        "--caps", default="1,1.2,none", help="scratch prefill caps, over its share of engines (none: no cap)"
    )
    parser.add_argument(
        "--refresh-shares",
        default="0.25,0.5",
        help="a kept prefix is refreshed once this share of the cache's turnover passed without a request",
    )
    parser.add_argument(
        "--kept-shares", default="0.25,0.5,0.75", help="most of the capacity kept prefixes hold"
    )
    args = parser.parse_args(argv)
    try:
        caps = [None if c.strip() == "none" else float(c) for c in args.caps.split(",")]
        refresh_shares = [float(r) for r in args.refresh_shares.split(",")]
        kept_shares = [float(k) for k in args.kept_shares.split(",")]
        if any(r <= 0 for r in refresh_shares) or any(not 0 < k <= 1 for k in kept_shares):
            raise ValueError("need --refresh-shares > 0 and --kept-shares in (0, 1]")
        if args.engines < 2 or args.capacity < args.block_tokens or args.block_tokens < 1:
            raise ValueError("need --engines >= 2 and --capacity >= --block-tokens >= 1")
        requests = read_trace(args.trace, minutes=args.minutes)
    except (OSError, TraceError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print(f"{prog}: the trace slice has no requests", file=sys.stderr)
        return 2
    keep = reused_later([r.chain(args.block_tokens) for r in requests])
    common = {
        "engines": args.engines,
        "capacity_blocks": args.capacity // args.block_tokens,
        "block_tokens": args.block_tokens,
        "keep": keep,
    }
    pooled = partition(requests, scratch_engines=0, cap=None, **common)
    print(
        f"{len(requests)} requests, {args.engines} engines x {args.capacity:,} KV tokens; "
        f"{sum(keep) / len(keep):.0%} of the requests bring blocks a later one uses\n"
    )
    rows: list[list[object]] = [["0 (pooled LRU)", "-", f"{pooled.hit_ratio:.1%}", "1.00x", "-", "1.00"]]
    for scratch in range(1, args.engines):
        for cap in caps:
            run = partition(requests, scratch_engines=scratch, cap=cap, **common)
            rows.append(
                [
                    scratch,
                    _cap_label(cap),
                    f"{run.hit_ratio:.1%}",
                    f"{run.hit_ratio / pooled.hit_ratio:.2f}x" if pooled.hit_ratio else "-",
                    f"{run.scratch_load:.2f}",
                    f"{run.kept_load:.2f}",
                ]
            )
    headers = ["scratch engines", "cap", "hit ratio", "x pooled LRU", "scratch load", "kept load"]
    print("clairvoyant two-pool partition (load: a pool's prefill share over its engine share)")
    print(format_table(headers, rows))
    print("\nwhat a classifier can see on arrival")
    print(
        format_table(
            ["prompt", "length", "requests", "reused later"],
            observable_signals(requests, args.block_tokens, keep),
        )
    )
    pooled_blocks = args.engines * args.capacity // args.block_tokens
    print("\nthe fleet's memory as one cache under other evictions (the engines' lever, not placement)")
    ratios = eviction_ratios(requests, pooled_blocks, args.block_tokens)
    lru = ratios[LRU_ROW]
    rows = [[name, f"{ratio:.1%}", _times(ratio, lru)] for name, ratio in ratios.items()]
    print(format_table(["eviction", "hit ratio", "x LRU"], rows))
    print("\nthe same LRU cache, its returning prefixes kept alive by the router asking for them again")
    print(
        format_table(
            ["refresh share", "kept share", "hit ratio", "x LRU", "refreshes a request"],
            refresh_rows(requests, pooled_blocks, args.block_tokens, refresh_shares, kept_shares, lru),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
