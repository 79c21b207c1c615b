"""Power of two choices: two distinct random candidates, the less loaded one wins.

Sampling two and keeping the better one cuts the worst queue from O(log n / log log n) to
O(log log n) over pure random, while reading the load of only two backends: the classic
result (Mitzenmacher) and what Ray Serve falls back to when queues diverge. It also keeps
several router replicas, each with a stale view, from all herding onto the one backend that
looked least loaded a moment ago, which least-load does.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView


class PowerOfTwo(RoutingPolicy):
    name = "power_of_two"

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        sample = self.rng.sample(list(backends), 2) if len(backends) > 1 else list(backends)
        chosen = self.pick_min(sample, lambda b: b.load)
        return Decision(chosen.name, "power_of_two", chosen.matched_blocks)
