"""Weighted: a sum of normalised scorers with weights from YAML, like llm-d's scheduler.

Each scorer rates every candidate in [0, 1], higher is better:

* ``prefix``: matched blocks / the prompt's blocks (how much of the prompt it holds);
* ``queue``: outstanding requests (``BackendView.load``), min-max normalised, fewest = 1;
* ``kv_usage``: 1 - engine-reported KV usage (a backend that does not report it scores
  the mean of those that do, so a missing scrape neither helps nor hurts it);
* ``in_flight``: this router's own in-flight count, min-max normalised.

The highest weighted sum wins, ties at random. Defaults are llm-d's (prefix 3, queue 2,
KV utilisation 2): its own benchmarks show a prefix scorer without load scorers lets a hot
prefix starve the fleet. A weight of 0 switches a scorer off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.params import NonNegativeFloat
from policies.routing.base import RoutingPolicy
from policies.scoring import lower_is_better, match_reason
from policies.types import BackendView, Decision, RequestView


@dataclass(frozen=True)
class WeightedParams:
    prefix: NonNegativeFloat = 3.0
    queue: NonNegativeFloat = 2.0
    kv_usage: NonNegativeFloat = 2.0
    in_flight: NonNegativeFloat = 0.0

    def validate(self) -> list[str]:
        if not any((self.prefix, self.queue, self.kv_usage, self.in_flight)):
            return ["prefix: at least one weight must be above 0"]
        return []


def _prefix_scores(request: RequestView, backends: Sequence[BackendView]) -> list[float]:
    blocks = request.block_count
    return [min(1.0, b.matched_blocks / blocks) if blocks else 0.0 for b in backends]


def _kv_scores(backends: Sequence[BackendView]) -> list[float]:
    known = [1.0 - b.kv_usage for b in backends if b.kv_usage is not None]
    neutral = sum(known) / len(known) if known else 1.0
    return [neutral if b.kv_usage is None else 1.0 - b.kv_usage for b in backends]


class Weighted(RoutingPolicy):
    name = "weighted"
    Params = WeightedParams
    uses_prefix_match = True
    params: WeightedParams

    def scores(self, request: RequestView, backends: Sequence[BackendView]) -> list[float]:
        """The weighted sum of every scorer, per backend, in the order given."""
        p = self.params
        parts = (
            (p.prefix, _prefix_scores(request, backends)),
            (p.queue, lower_is_better([b.load for b in backends])),
            (p.kv_usage, _kv_scores(backends)),
            (p.in_flight, lower_is_better([b.in_flight for b in backends])),
        )
        return [sum(w * s[i] for w, s in parts if w) for i in range(len(backends))]

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        by_name = dict(zip((b.name for b in backends), self.scores(request, backends), strict=True))
        chosen = self.pick_min(backends, lambda b: -by_name[b.name])
        return Decision(chosen.name, match_reason("weighted", chosen, backends), chosen.matched_blocks)
