"""Least load: the backend with the fewest outstanding requests, ties at random."""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView


class LeastLoad(RoutingPolicy):
    """Ignores the cache entirely: the reference point for what cache awareness costs in balance."""

    name = "least_load"

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        chosen = self.pick_min(backends, lambda b: b.load)
        return Decision(chosen.name, "least_load", chosen.matched_blocks)
