"""Consistent hashing with bounded loads (CHWBL; Mirrokni, Thorup and Zadimoghaddam, 2018).

Each backend owns ``virtual_nodes`` points on a 64-bit ring. A request's key (its session
when it has one, else the hash of its prompt's first ``key_blocks`` blocks) lands on the
ring, and the walk clockwise takes the first backend whose load is under the bound
``ceil(load_factor * (total load + 1) / backends)``. Equal prompt heads therefore meet on
one backend (its cache), and no backend takes more than ``load_factor`` times its fair share:
when the owner is full the key spills to the next backend on the ring, the same one every
time, so even a hot prefix's overflow stays concentrated on few caches. KubeAI routes with
this rule (``load_factor`` 1.25, 256 virtual nodes).

A prompt shorter than one block has no head to key on: it goes to the least loaded backend.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from policies.params import PositiveInt
from policies.routing.base import RoutingPolicy
from policies.routing.stable_hash import key_hash
from policies.types import BackendView, Decision, RequestView

#: Rings kept for distinct candidate sets (models x health changes): a small LRU.
_RINGS_KEPT = 32


@dataclass(frozen=True)
class ConsistentHashParams:
    #: Points per backend on the ring: more points, more even ownership (and a larger ring).
    virtual_nodes: PositiveInt = 256
    #: A backend takes a request only while its load is under this multiple of the fair share.
    load_factor: Annotated[float, msgspec.Meta(ge=1)] = 1.25
    #: Leading prompt blocks that make the key: requests sharing them meet on one backend.
    key_blocks: PositiveInt = 1
    #: Key on the session (header or ``user``) when the request has one, else on the prompt head.
    prefer_session: bool = True


class _Ring:
    """The sorted virtual-node points of one candidate set."""

    def __init__(self, names: Sequence[str], virtual_nodes: int) -> None:
        points = sorted((key_hash(f"{name}#{i}"), name) for name in names for i in range(virtual_nodes))
        self.hashes = [h for h, _ in points]
        self.owners = [name for _, name in points]

    def walk(self, key: int) -> Iterator[str]:
        """Distinct backends in ring order, from the first point at or after ``key``; lazily."""
        start = bisect.bisect_left(self.hashes, key)
        seen: set[str] = set()
        count = len(self.owners)
        for i in range(count):
            name = self.owners[(start + i) % count]
            if name not in seen:
                seen.add(name)
                yield name


class ConsistentHash(RoutingPolicy):
    name = "consistent_hash"
    Params = ConsistentHashParams
    uses_prefix_match = True
    params: ConsistentHashParams

    def __init__(self, params=None, *, seed=None) -> None:
        super().__init__(params, seed=seed)
        self._rings: OrderedDict[tuple[str, ...], _Ring] = OrderedDict()

    def _ring(self, backends: Sequence[BackendView]) -> _Ring:
        names = tuple(sorted(b.name for b in backends))
        ring = self._rings.get(names)
        if ring is None:
            ring = self._rings[names] = _Ring(names, self.params.virtual_nodes)
            if len(self._rings) > _RINGS_KEPT:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(names)
        return ring

    def _key(self, request: RequestView) -> int | None:
        if self.params.prefer_session and request.session_key is not None:
            return key_hash(request.session_key, salt="session")
        if request.chain:
            # The chain is cumulative: its k-th hash identifies the whole first k blocks.
            return key_hash(request.chain[min(self.params.key_blocks, len(request.chain)) - 1])
        return None

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        key = self._key(request)
        if key is None:
            chosen = self.pick_min(backends, lambda b: b.load)
            return Decision(chosen.name, "no_key_least_load", chosen.matched_blocks)
        by_name = {b.name: b for b in backends}
        bound = math.ceil(self.params.load_factor * (sum(b.load for b in backends) + 1) / len(backends))
        # The bound exceeds the mean load, so the least loaded backend is always under it.
        position, name = next(
            (i, name) for i, name in enumerate(self._ring(backends).walk(key)) if by_name[name].load < bound
        )
        reason = "ring_owner" if position == 0 else "ring_spill"
        return Decision(name, reason, by_name[name].matched_blocks)
