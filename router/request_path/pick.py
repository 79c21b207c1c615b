"""A policy's pick among the candidates, and what happens when the policy itself fails.

Policies are code the router runs on every request, plug-ins (``module:Class``) included. One
that raises, or names a backend that is not a candidate, has a bug, but the request is not at
fault: it goes where ``least_load`` sends it, with the reason ``policy_error`` (so
``kvroute_routing_decisions_total{reason="policy_error"}`` counts them), and the error is logged
with its traceback, once a minute at most per policy: a broken policy fails every request it
sees, and a traceback per request would bury the log. The router never answers 500 for a
policy's bug, and a learning policy is not told the outcomes of requests it did not route.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView
from router.fleet.backends import Backend

log = logging.getLogger("kvroute.dispatch")

#: The decision reason of a request the policy failed to route.
POLICY_ERROR = "policy_error"


#: At most one traceback a minute per failing policy.
LOG_EVERY_S = 60.0


class NotACandidate(LookupError):
    """The policy named a backend outside the candidates it was shown."""


def _named(candidates: Sequence[Backend], decision: Decision) -> Backend:
    for backend in candidates:
        if backend.name == decision.backend:
            return backend
    raise NotACandidate(f"chose {decision.backend!r}, not one of {[b.name for b in candidates]}")


class Picker:
    """Asks a policy for its pick; ``fallback`` picks for a policy that fails."""

    def __init__(self, fallback: RoutingPolicy) -> None:
        self.fallback = fallback
        self._logged_at: dict[str, float] = {}

    def pick(
        self,
        policy: RoutingPolicy,
        label: str,
        request: RequestView,
        candidates: Sequence[Backend],
        views: Sequence[BackendView],
    ) -> tuple[Backend, Decision]:
        """``policy``'s choice among ``candidates`` (``views`` are theirs, in order); the
        fallback's, reason ``policy_error``, when ``policy`` raises or names a backend not among
        them."""
        try:
            decision = policy.choose(request, views)
            return _named(candidates, decision), decision
        except Exception:
            if policy is self.fallback:
                raise
            now = time.monotonic()
            if now - self._logged_at.get(label, -math.inf) >= LOG_EVERY_S:
                self._logged_at[label] = now
                log.exception(
                    "policy %s failed to choose a backend; %s chose instead (logged once a minute "
                    "at most: kvroute_routing_decisions_total{reason=%r} counts every one)",
                    label,
                    self.fallback.name,
                    POLICY_ERROR,
                )
        decision = dataclasses.replace(self.fallback.choose(request, views), reason=POLICY_ERROR)
        return _named(candidates, decision), decision
