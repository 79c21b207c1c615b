"""Random: each request to a uniformly random candidate. A baseline with no state at all."""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView


class RandomPick(RoutingPolicy):
    """Stateless and blind to load and cache: what every other policy must beat."""

    name = "random"

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        chosen = self.rng.choice(backends)
        return Decision(chosen.name, "random", chosen.matched_blocks)
