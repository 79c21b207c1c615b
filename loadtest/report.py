"""Summaries and plain-text tables of benchmark results."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.client import Result


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; NaN for no values (a benchmark prints it as such, never a made-up 0)."""
    return sum(values) / len(values) if values else math.nan


def busiest_share(counts: Sequence[int]) -> float:
    """The busiest engine's share of requests over the mean share (1.0: perfectly even)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else math.nan


@dataclass(frozen=True)
class Latencies:
    """What every live benchmark reports of its requests, whatever else it adds."""

    ok: int
    failed: int
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    #: End to end: request sent to the last byte received.
    e2e_mean: float
    e2e_p50: float

    @staticmethod
    def fields_of(results: Sequence[Result]) -> dict[str, float | int]:
        """The fields of a :class:`Latencies` (or of a subclass's) for ``results``; failed
        requests are counted, and left out of the times."""
        good = [r for r in results if r.ok]
        ttfts = [r.ttft for r in good if r.ttft is not None]
        latencies = [r.latency for r in good]
        return {
            "ok": len(good),
            "failed": len(results) - len(good),
            "ttft_mean": mean(ttfts),
            "ttft_p50": percentile(ttfts, 0.50),
            "ttft_p99": percentile(ttfts, 0.99),
            "e2e_mean": mean(latencies),
            "e2e_p50": percentile(latencies, 0.50),
        }


def request_hit_ratio(results: Sequence[Result]) -> float:
    """Engine-reported cached prompt tokens over prompt tokens, over successful requests."""
    good = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in good)
    return sum(r.cached_tokens for r in good) / prompt if prompt else math.nan


@dataclass(frozen=True)
class Summary(Latencies):
    #: Engine-reported cached prompt tokens / prompt tokens, over successful requests.
    hit_ratio: float
    #: Fraction of successful requests per backend, by backend name.
    share: dict[str, float]


def summarize(results: Sequence[Result]) -> Summary:
    counts = Counter(r.backend or "?" for r in results if r.ok)
    good = sum(counts.values())
    return Summary(
        **Latencies.fields_of(results),
        hit_ratio=request_hit_ratio(results),
        share={name: n / good for name, n in sorted(counts.items())},
    )


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``1.23x`` for a benchmark's ratio columns; ``-`` when either is unknown."""
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "-"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A left-aligned first column and right-aligned others, as a terminal table."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])
