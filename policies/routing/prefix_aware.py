"""Prefix aware: the longest cached match, unless taking it would pile load onto one replica.

SGLang's ``cache_aware`` checks balance across the whole fleet: only when max and min load
differ by more than both thresholds does it stop following the cache, and then it sends
everything to the least loaded replica, throwing locality away. Until that moment it keeps
sending every request with a match to the one replica that holds it (the hot-spotting its
users report). Here the guard applies to each candidate instead: a backend whose load
exceeds the least loaded one by more than ``balance_abs_threshold`` and by more than
``balance_rel_threshold`` times is not eligible, and the deepest match *among the eligible*
wins. Locality survives rebalancing, and no replica runs away with the queue. Ties go to the
less loaded, then at random.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from policies.params import NonNegativeInt
from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, RequestView


@dataclass(frozen=True)
class PrefixAwareParams:
    #: A match counts only when it covers at least this share of the prompt's blocks.
    min_match_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    #: Extra outstanding requests a backend may carry over the least loaded one and stay eligible.
    balance_abs_threshold: NonNegativeInt = 4
    #: ... or up to this multiple of the least loaded one's load (both must be exceeded to exclude).
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=1)] = 1.5


class PrefixAware(RoutingPolicy):
    name = "prefix_aware"
    Params = PrefixAwareParams
    uses_prefix_match = True
    params: PrefixAwareParams

    def _overloaded(self, backend: BackendView, min_load: int) -> bool:
        p = self.params
        return (
            backend.load - min_load > p.balance_abs_threshold
            and backend.load > p.balance_rel_threshold * min_load
        )

    def _useful(self, matched: int, request: RequestView) -> bool:
        return matched > 0 and matched >= self.params.min_match_ratio * request.block_count

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        min_load = min(b.load for b in backends)
        eligible = [b for b in backends if not self._overloaded(b, min_load)]
        best_anywhere = max(b.matched_blocks for b in backends)
        best_eligible = max(b.matched_blocks for b in eligible)

        if self._useful(best_eligible, request):
            holders = [b for b in eligible if b.matched_blocks == best_eligible]
            chosen = self.pick_min(holders, lambda b: b.load)
            reason = "prefix_hit" if best_eligible == best_anywhere else "prefix_hit_spill"
            return Decision(chosen.name, reason, chosen.matched_blocks)

        # No useful match where it may go: spread, preferring the replica whose cache holds
        # the least (a new prefix displaces the least there), as Dynamo breaks its ties.
        chosen = self.pick_min(backends, lambda b: (b.load, b.cached_blocks))
        reason = "overloaded_least_load" if self._useful(best_anywhere, request) else "no_match_least_load"
        return Decision(chosen.name, reason, chosen.matched_blocks)
