"""Round robin: each request to the next backend in turn. The baseline every benchmark beats."""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView


class RoundRobin(RoutingPolicy):
    """Cycles through the candidates by name, so the rotation survives backends coming and going."""

    name = "round_robin"

    def __init__(self, params=None, *, seed=None) -> None:
        super().__init__(params, seed=seed)
        self._counter = 0

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        ordered = sorted(backends, key=lambda b: b.name)
        chosen = ordered[self._counter % len(ordered)]
        self._counter += 1
        return Decision(chosen.name, "round_robin", chosen.matched_blocks)
