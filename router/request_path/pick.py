"""A policy's pick among the candidates, and what happens when the policy itself fails.

Policies are code the router runs on every request, plug-ins (``module:Class``) included. One
that raises, or names a backend that is not a candidate, has a bug, but the request is not at
fault: it goes where ``least_load`` sends it, with the reason ``policy_error`` (so
``kvroute_routing_decisions_total{reason="policy_error"}`` counts them), and the error is logged with its
traceback, as an exception in ``on_outcome`` is. The router never answers 500 for a policy's bug.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView
from router.fleet.backends import Backend

log = logging.getLogger("kvroute.dispatch")

#: The decision reason of a request the policy failed to route.
POLICY_ERROR = "policy_error"


class NotACandidate(LookupError):
    """The policy named a backend outside the candidates it was shown."""


def _named(candidates: Sequence[Backend], decision: Decision) -> Backend:
    for backend in candidates:
        if backend.name == decision.backend:
            return backend
    raise NotACandidate(f"chose {decision.backend!r}, not one of {[b.name for b in candidates]}")


def pick(
    policy: RoutingPolicy,
    fallback: RoutingPolicy,
    label: str,
    request: RequestView,
    candidates: Sequence[Backend],
    views: Sequence[BackendView],
) -> tuple[Backend, Decision]:
    """``policy``'s choice among ``candidates`` (``views`` are theirs, in order); ``fallback``'s,
    reason ``policy_error``, when ``policy`` raises or names a backend not among them."""
    try:
        decision = policy.choose(request, views)
        return _named(candidates, decision), decision
    except Exception:
        if policy is fallback:
            raise
        log.exception("policy %s failed to choose a backend; %s chose instead", label, fallback.name)
    decision = dataclasses.replace(fallback.choose(request, views), reason=POLICY_ERROR)
    return _named(candidates, decision), decision
