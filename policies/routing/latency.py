"""Latency: the backend where the request's whole latency, and what it adds to others', is least.

``cost`` estimates time to first token: the prefill queued ahead and the request's own
uncached prefill. What it never sees is the decode. Every request added to an engine's
running batch makes each decode step of that engine longer, for every request there, for as
long as it decodes; and it decodes itself at the pace of that batch. On a fleet where a few
long shared prefixes carry most of the traffic, a cache hit of several thousand tokens
outweighs dozens of queued requests in a TTFT estimate, so each prefix's traffic lands on
the one engine that holds it: that engine's batch grows, every token there slows, and the
engines that hold nothing sit idle (issue 20 measured one engine at 0.41 of the traffic and
two of eight idle, as SGLang's ``cache_aware`` does).

So the estimate here, in prefill-token equivalents (one token of prefill is the unit of time), is::

    cost = uncached prompt tokens                      # its own prefill
         + queue weight x pending prefill tokens       # the prefill queued ahead of it
         + decode_weight x output x outstanding        # the batch slowdown it suffers and causes

The queue weight is ``queue_weight`` + ``idle_queue_weight`` x (the share of backends with no
prefill pending)³. A request that leaves its cached prefix for a shorter queue adds its own
prefill to the fleet's work: on a fleet whose prefill lanes are busy (the Mooncake trace at
10x) that work delays everyone queued after it, and a heavier weight cost a fifth of the hit
ratio there, so the weight stays low (0.06). But where most lanes are idle, a queue is a wait
the request need not have, and the lanes that would take its extra prefill have nothing
queued behind them: chat traffic at 20x waited 2-4 ms a request on the low weight alone. The
cube leaves the weight at ``queue_weight`` until most lanes are idle (half idle adds an
eighth of ``idle_queue_weight``); the share itself (power one) moved chat's TTFT p99 at 20x
both ways from seed to seed, its fourth power gained less on the mean
(docs/benchmarks/2026-12-07-routing-at-head.md).

``output`` is the request's ``max_tokens`` capped at ``output_cap`` (``default_output`` when
it gave none): the steps it will spend in that batch. ``decode_weight`` is the prefill
tokens one more member of a decode batch costs per step, counted twice (once for the
request, slowed by everyone there, and once for everyone there, slowed by it): on a GPU the
per-sequence share of a decode step is a few times the time of one prefill token (the KV
of every sequence is read each step), and in the simulated engines it is five
(``decode_per_seq_s / prefill_per_token_s``).

A hot prefix's traffic therefore goes to its holder only until the holder's batch costs more
than the prefix's prefill elsewhere; then it spills, and the engine it spills to holds the
prefix too from then on (hot prefixes are replicated where their load demands it, which a
cache-only rule never does).

A spill to an engine that holds none of the prefix makes the request that spills pay the whole
prefix's prefill: on a chat fleet over long shared documents those copies were most of the
slowest 1 % of requests (``kvroute simulate --slowest``). So a copy of at least
``warmup_blocks`` blocks to an engine holding none of it is made ahead of the request instead:
the request goes to the prefix's cheapest holder, and the decision asks the router for a
warm-up, the prompt's leading part sent to the spill target with ``max_tokens`` 1. The holder
costs more than the target by less than the (discounted) copy itself, which is what the
request no longer waits for; the next request that spills finds the copy made. A holder
whose recent share is within ``warmup_max_share`` of the mean is preferred (a request placed
there brings its session's later turns with it). When every holder is above it, the cheapest
holder still takes the request if it costs no more than the target with the copy at its full
price: the reuse discount is what the copy is worth to the requests after this one, not to the
one that would wait for it. Before, such a request made the copy itself, and on chat at 20x
those requests were among the slowest 1 % (one waited 179 ms for a prefill of 8.8k tokens its
holder would have served in 5 ms; docs/benchmarks/2026-12-08-warm-up-holders.md).

Ties go to the backend whose cache holds the least (a new prefix
displaces the least there), then at random. With no reuse in the traffic the estimate is
pending prefill plus batch load, which balances at least as well as least load.

The defaults were tuned with ``kvroute simulate`` on the workloads of
:mod:`loadtest.workloads` and the Mooncake trace, and confirmed live against SGLang's router
(docs/benchmarks/2026-12-05-routing.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from policies.params import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from policies.routing.base import RoutingPolicy
from policies.scoring import match_reason
from policies.types import BackendView, Decision, RequestView, Warmup

#: The power of the idle share in the queue weight: a cube adds little until most lanes are idle.
IDLE_SHARE_POWER = 3


@dataclass(frozen=True)
class LatencyParams:
    #: Weight of the prefill already pending on a backend (sent, no first byte yet).
    queue_weight: NonNegativeFloat = 0.06
    #: Added to ``queue_weight`` as the cube of the share of backends with no prefill pending:
    #: a queue weighs more where most prefill lanes are idle (0 turns it off).
    idle_queue_weight: NonNegativeFloat = 1.0
    #: Prefill tokens one outstanding request is worth, whatever its phase (as in ``cost``).
    load_tokens: NonNegativeFloat = 64.0
    #: Prefill tokens one more member of a decode batch costs per output token (own + imposed).
    decode_weight: NonNegativeFloat = 1.0
    #: How much a prefix's recent reuse discounts copying it: the gap's cost is divided by
    #: ``1 + reuse_weight x reuse`` (0 turns replication off).
    reuse_weight: NonNegativeFloat = 3.0
    #: Half-life of a prefix's reuse count, in routed requests.
    reuse_half_life: PositiveFloat = 256.0
    #: Prefixes whose reuse is remembered (least recently reused forgotten first).
    reuse_entries: PositiveInt = 65536
    #: Output tokens assumed for a request without ``max_tokens``.
    default_output: PositiveInt = 256
    #: Output tokens counted at most: a generous ``max_tokens`` is a cap, not a length.
    output_cap: PositiveInt = 1024
    #: A spill that would copy at least this many blocks to an engine holding none of the
    #: prefix goes to the prefix's holder, and the copy is made by a warm-up (0: never).
    warmup_blocks: NonNegativeInt = 16
    #: ... preferring a holder whose share of the recent requests is at most this many times
    #: the mean share: a request placed there brings its session's later turns with it. 1.5
    #: rather than 1.2: chat's TTFT mean 0.79x SGLang's against 0.82x live at 20x (seed 2), the
    #: others level or better, the busiest engine still under 1.25x the mean share
    #: (docs/benchmarks/2026-12-07-routing-at-head.md).
    warmup_max_share: PositiveFloat = 1.5


class Latency(RoutingPolicy):
    name = "latency"
    Params = LatencyParams
    uses_prefix_match = True
    params: LatencyParams

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        #: Deepest-match block -> (decayed count of requests whose deepest match ended there, at).
        self._reuse: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self._routed = 0
        #: Backend -> (decayed count of requests routed there, at): recent shares.
        self._shares: dict[str, tuple[float, int]] = {}

    def output_tokens(self, request: RequestView) -> int:
        """The decode steps ``request`` is expected to spend in a batch."""
        wanted = request.max_tokens if request.max_tokens is not None else self.params.default_output
        return min(wanted, self.params.output_cap)

    def reuse(self, block: int) -> float:
        """Requests that recently had their deepest match end at ``block`` (decayed)."""
        return self._decayed(self._reuse.get(block))

    def share(self, backend: str) -> float:
        """Requests recently routed to ``backend`` (decayed as reuse is)."""
        return self._decayed(self._shares.get(backend))

    def _decayed(self, entry: tuple[float, int] | None) -> float:
        """A count kept as (count, routed requests when last counted), halved every
        ``reuse_half_life`` requests routed since."""
        count, at = entry or (0.0, self._routed)
        return count * 0.5 ** ((self._routed - at) / self.params.reuse_half_life)

    def _count(self, block: int) -> None:
        self._reuse[block] = (self.reuse(block) + 1.0, self._routed)
        self._reuse.move_to_end(block)
        if len(self._reuse) > self.params.reuse_entries:
            self._reuse.popitem(last=False)

    def queue_weight(self, backends: Sequence[BackendView]) -> float:
        """The weight of the prefill pending on a backend, for a fleet whose backends are
        ``backends``: higher where most prefill lanes are idle (the module's docstring)."""
        idle = sum(1 for b in backends if not b.pending_prefill_requests) / len(backends)
        return self.params.queue_weight + self.params.idle_queue_weight * idle**IDLE_SHARE_POWER

    def cost(
        self, request: RequestView, backend: BackendView, deepest: int, discount: float, queue_weight: float
    ) -> float:
        """Latency ``request`` costs on ``backend`` (its own and others'), in prefill-token equivalents.

        Only what differs between backends counts: the part of the deepest match this backend
        lacks (discounted when that prefix is being reused: a copy made now serves the next
        ones too), the prefill queued there (``queue_weight``), and its load.
        """
        p = self.params
        gap = (deepest - backend.matched_blocks) * request.block_tokens * discount
        queued = queue_weight * backend.pending_prefill_tokens
        batch = p.decode_weight * self.output_tokens(request) * backend.decoding
        return gap + queued + batch + p.load_tokens * backend.load

    def _warm_instead(
        self,
        chosen: BackendView,
        backends: Sequence[BackendView],
        costs: dict[str, float],
        deepest: int,
        copy_at_full_price: float,
    ) -> tuple[BackendView, Warmup | None]:
        """Where a request goes when the cheapest backend, ``chosen``, holds none of the
        ``deepest`` blocks another holds: to the cheapest holder whose recent share is not
        above ``warmup_max_share`` of the mean, else to the cheapest holder costing no more than
        ``chosen`` with the copy at its full price (``copy_at_full_price``), with a warm-up
        copying the prefix to ``chosen``; else to ``chosen`` itself, the request making the copy."""
        holders = [b for b in backends if b.matched_blocks == deepest]
        limit = self.params.warmup_max_share * sum(self.share(b.name) for b in backends) / len(backends)
        candidates = [b for b in holders if self.share(b.name) <= limit] or [
            b for b in holders if costs[b.name] <= copy_at_full_price
        ]
        if not candidates:
            return chosen, None
        holder = self.pick_min(candidates, lambda b: (costs[b.name], b.cached_blocks))
        return holder, Warmup(chosen.name, deepest)

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        deepest = max(b.matched_blocks for b in backends)
        discount = 1.0
        if deepest and request.chain:
            block = request.chain[deepest - 1]
            discount = 1.0 / (1.0 + self.params.reuse_weight * self.reuse(block))
            self._count(block)
        self._routed += 1
        weight = self.queue_weight(backends)
        costs = {b.name: self.cost(request, b, deepest, discount, weight) for b in backends}
        chosen = self.pick_min(backends, lambda b: (costs[b.name], b.cached_blocks))
        warmup = None
        if chosen.matched_blocks == 0 and 0 < self.params.warmup_blocks <= deepest:
            undiscounted = deepest * request.block_tokens * (1.0 - discount)
            chosen, warmup = self._warm_instead(
                chosen, backends, costs, deepest, costs[chosen.name] + undiscounted
            )
        self._shares[chosen.name] = (self.share(chosen.name) + 1.0, self._routed)
        reason = match_reason("latency", chosen, backends)
        return Decision(chosen.name, reason, chosen.matched_blocks, warmup)
