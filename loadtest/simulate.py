"""The offline fleet simulator: a trace replayed through real policies on a model fleet, in virtual time.

``kvroute simulate`` runs the router's own decision path — the real policy object, the real
``MemoryIndex`` (its synchronous ``match_now``), the real eviction policies — against a
discrete-event model of the simulated engines in :mod:`loadtest.sim`, with their timing
parameters and rules (:class:`~loadtest.sim.timing.EngineTiming`) and their LRU prefix cache
(:class:`~loadtest.sim.cache.PrefixCache`):

* admission is FIFO, while fewer than ``max_running`` requests run and the head's KV
  reservation (prompt + output tokens) fits in the engine's KV capacity;
* one prefill lane per engine, in admission order: at its start the prefix cache is looked
  up, it lasts ``prefill_seconds(uncached tokens)``, at its end the prompt enters the cache
  and the first token is out (TTFT);
* decode runs in batched steps of ``decode_step_seconds(batch)``, one token per decoding
  request per step; a request finishes after its last token and frees its slot and KV.

Decode steps are advanced in closed form between events (the batch only changes when a
request joins or finishes), so the cost is a few events per request, not one per token:
the whole one-hour Mooncake conversation trace replays in seconds.

The router sees what the live one sees of its own: its in-flight count and pending prefill
per backend and the prefix index's matches (no scraped engine metrics). It records a
request's chain when it sends it. With ``FleetModel.replicas`` > 1 there are several routers,
each with its own policy, index and counts, taking requests round robin; each sees the
others' load as the shared load view shows it live (as of its last call, every
``load_interval_s`` under the router's own stretch and idle rules) and their beliefs
``belief_delay_s`` after their picks. A policy that learns online hears each request's outcome
at its end (``RoutingPolicy.on_outcome``), as it would live.

Where virtual time and the live fleet differ: the live router and the engines share CPUs
(their event loops add latency under load, which virtual time does not have); the model's
cache works in router blocks (``block_tokens``, 64 by default) where a live engine caches
16-token blocks (a prompt's partial last router block is never counted as cached here); and
a request joining decode mid-step is charged from that step as the live decode loop does,
but its step count is exact only up to floating-point rounding. Like the live router (every
index believes a chain at the pick), the model records a chain when it sends the request.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from loadtest import workloads
from loadtest.report import format_table, percentile
from loadtest.sim.cache import PrefixCache
from loadtest.sim.timing import EngineTiming
from loadtest.trace import TraceError, TraceRequest, read_trace, spread_arrivals
from policies.eviction import block_set_factory
from policies.retention import Keeper
from policies.routing import PolicyLoadError, build_policy
from policies.routing.base import RoutingPolicy
from policies.types import BackendView, RequestView
from policies.types import Outcome as AttemptOutcome
from router.index import MemoryIndex
from router.redis.settings import RedisConfig
from router.request_path.beliefs import ClosedLoop, Prediction
from router.request_path.retention import IN_FLIGHT as REFRESHES_IN_FLIGHT
from router.request_path.warmup import MAX_IN_FLIGHT as WARMUPS_IN_FLIGHT
from router.request_path.warmup import InFlight

#: How often the keeper looks for refreshes due, in the simulation's seconds.
KEEPER_CHECK_S = 0.1


@dataclass(frozen=True)
class FleetModel:
    """The fleet and the router's belief about it."""

    engines: int = 8
    #: KV capacity of each engine in tokens: bounds its prefix cache and its running requests.
    capacity_tokens: int = 1_000_000
    #: Engine cost model: prefill, decode and ``max_running`` are used (the KV size is ``capacity_tokens``).
    timing: EngineTiming = field(default_factory=EngineTiming)
    #: Router block in tokens (``index.block_size`` / ``index.chars_per_token``); divides 512.
    block_tokens: int = 64
    #: The router's believed capacity per backend in tokens; None believes the true capacity.
    belief_capacity_tokens: int | None = None
    #: ``index.eviction`` of the router's belief.
    eviction: str = "lru"
    ttl_s: float = 120.0
    #: Arrival times are divided by this: 10 replays ten minutes of trace in one minute.
    speedup: float = 1.0
    #: Correct beliefs from the engines' cached-token reports (``index.closed_loop``).
    closed_loop: bool = False
    closed_loop_tolerance: float = 0.5
    #: Router replicas sharing their beliefs and load (``index.redis``), requests sent to them
    #: round robin as a Kubernetes Service spreads them. Each has its own policy, its own copy
    #: of the index and its own load counts, exact and instant; it sees the others' load as
    #: of its last call of the shared load view, and their beliefs ``belief_delay_s`` after
    #: their pick.
    replicas: int = 1
    #: ``index.redis.load_interval_s`` and ``load_idle_interval_s`` (``load_interval_fleet``
    #: and ``load_ttl_s`` keep their defaults).
    load_interval_s: float = RedisConfig.load_interval_s
    load_idle_interval_s: float = RedisConfig.load_idle_interval_s
    #: From a replica's pick until the other replicas' lookups see it: a shared index's write
    #: (``lookup: shared``, about a millisecond) or the belief stream (``lookup: local``, up to
    #: two ``sync_interval_ms`` of 5 ms). The default is one ``sync_interval_ms``: the stream's,
    #: as bench_redis's replicas (e) use it.
    belief_delay_s: float = RedisConfig.sync_interval_ms / 1000
    #: ``lookup: shared`` with ``index.redis.load_on_lookup``: each lookup also reads the
    #: others' load as they last published it, and the write that follows each pick (its
    #: belief, ``belief_delay_s`` later) also publishes the replica's counts.
    load_on_lookup: bool = False
    #: The router's ``routing.retention``, which keeps returning prefixes alive by asking for
    #: them again (policies/retention.py): a kept prefix is refreshed once this
    #: share of its engine's turnover passed without a request for it (0: off), and kept
    #: prefixes hold at most ``kept_share`` of each engine's capacity.
    refresh_share: float = 0.0
    kept_share: float = 0.5

    def __post_init__(self) -> None:
        if self.engines < 1 or self.capacity_tokens < self.block_tokens:
            raise ValueError("a fleet has at least one engine and a capacity of at least one block")
        if self.block_tokens < 1 or 512 % self.block_tokens:
            raise ValueError("block_tokens must divide the trace's 512-token blocks")
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        block_set_factory(self.eviction, ttl_s=self.ttl_s)  # refuses an unknown eviction policy
        if not isinstance(self.replicas, int) or self.replicas < 1 or self.belief_delay_s < 0:
            raise ValueError("replicas must be at least 1 and belief_delay_s at least 0")
        if self.load_interval_s <= 0 or self.load_idle_interval_s <= 0:
            raise ValueError("load_interval_s and load_idle_interval_s must be positive")
        if self.replicas > 1 and self.closed_loop:
            raise ValueError("the closed loop is modelled for one router, not for replicas")
        if self.refresh_share < 0 or not 0 < self.kept_share <= 1:
            raise ValueError("refresh_share must be >= 0 and kept_share in (0, 1]")
        if self.refresh_share and self.replicas > 1:
            raise ValueError("the keeper is modelled for one router, not for replicas")
        problems = self.load_view().validate()
        if problems:
            raise ValueError("; ".join(problems))

    def load_view(self) -> RedisConfig:
        """The replicas' shared load view settings, as the router reads them."""
        return RedisConfig(
            load_interval_s=self.load_interval_s, load_idle_interval_s=self.load_idle_interval_s
        )


@dataclass(slots=True)
class _Job:
    """One request inside the model fleet."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    chain: list[int]
    backend: str
    #: The router replica that routed it, whose counts and policy hear of it.
    replica: _Replica
    #: The request as the policy saw it, for its outcome (``RoutingPolicy.on_outcome``).
    view: RequestView
    kv_blocks: int
    predicted_blocks: int
    #: The router's estimate of this request's prefill: its prompt beyond the predicted match.
    pending_tokens: int
    prediction: Prediction | None = None
    cached_tokens: int = 0
    prefill_start: float = 0.0
    first_token: float = 0.0
    finish_step: int = 0
    #: A warm-up's place among those in flight, given back when it finishes.
    warm_slot: tuple[InFlight, tuple[str, int]] | None = None


@dataclass(frozen=True)
class Outcome:
    """What one request experienced (None times for a request the engine refused)."""

    backend: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    predicted_tokens: int
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float | None


class _Engine:
    """One engine's queues, prefill lane and decode batch, driven by the simulator's events."""

    def __init__(self, name: str, model: FleetModel, sim: Simulation) -> None:
        self.name = name
        self.timing = model.timing
        self.sim = sim
        self.cache = PrefixCache(model.capacity_tokens // model.block_tokens, model.block_tokens, 1)
        self.kv_capacity = model.capacity_tokens // self.timing.block_tokens
        self.waiting: deque[_Job] = deque()
        self.prefill_queue: deque[_Job] = deque()
        self.prefilling: _Job | None = None
        self.running = 0
        self.reserved = 0
        # Decode: steps done (at the end of ``step_end - step``), the batch, and finish steps.
        self.steps = 0
        self.step_end = 0.0
        self.step = 0.0
        self.decoding: list[tuple[int, int, _Job]] = []
        self.version = 0

    def submit(self, job: _Job, now: float) -> None:
        self.waiting.append(job)
        self._admit(now)

    def _admit(self, now: float) -> None:
        while self.waiting and self.running < self.timing.max_running:
            head = self.waiting[0]
            if self.reserved + head.kv_blocks > self.kv_capacity:
                break
            self.waiting.popleft()
            self.running += 1
            self.reserved += head.kv_blocks
            self.prefill_queue.append(head)
        if self.prefilling is None and self.prefill_queue:
            self._start_prefill(now)

    def _start_prefill(self, now: float) -> None:
        job = self.prefilling = self.prefill_queue.popleft()
        job.prefill_start = now
        job.cached_tokens = self.cache.lookup(job.chain, job.prompt_tokens) * self.cache.block_tokens
        done = now + self.timing.prefill_seconds(job.prompt_tokens - job.cached_tokens)
        self.sim.schedule(done, self._prefill_done)

    def _prefill_done(self, now: float) -> None:
        job = self.prefilling
        assert job is not None
        self.prefilling = None
        self.cache.insert(job.chain)
        job.first_token = now
        self.sim.first_token(job)
        if job.output_tokens <= 1:
            self._finish(job, now)
        else:
            self._join_decode(job, now)
        if self.prefilling is None and self.prefill_queue:  # a finish may have started one
            self._start_prefill(now)

    def _advance(self, now: float) -> None:
        """Count the decode steps completed by ``now`` (no request finishes between events)."""
        if self.decoding and now >= self.step_end:
            done = 1 + math.floor((now - self.step_end) / self.step)
            self.steps += done
            self.step_end += done * self.step

    def _join_decode(self, job: _Job, now: float) -> None:
        self._advance(now)
        if not self.decoding:
            # The decode loop wakes and sleeps one step sized for the new batch.
            self.step = self.timing.decode_step_seconds(1)
            self.step_end = now + self.step
        # Its remaining tokens come at the ends of the next output_tokens - 1 steps.
        job.finish_step = self.steps + job.output_tokens - 1
        heapq.heappush(self.decoding, (job.finish_step, job.index, job))
        self.step = self.timing.decode_step_seconds(len(self.decoding))
        self._schedule_decode()

    def _schedule_decode(self) -> None:
        self.version += 1
        if self.decoding:
            steps_left = self.decoding[0][0] - self.steps
            at = self.step_end + (steps_left - 1) * self.step
            version = self.version
            self.sim.schedule(at, lambda now: self._decode_event(now, version))

    def _decode_event(self, now: float, version: int) -> None:
        if version != self.version:
            return
        self.steps = self.decoding[0][0]
        while self.decoding and self.decoding[0][0] <= self.steps:
            _, _, job = heapq.heappop(self.decoding)
            self._finish(job, now)
        self.step = self.timing.decode_step_seconds(len(self.decoding))
        self.step_end = now + self.step
        self._schedule_decode()

    def _finish(self, job: _Job, now: float) -> None:
        self.running -= 1
        self.reserved -= job.kv_blocks
        self.sim.finished(job, now)
        self._admit(now)


class _Replica:
    """One router replica: its policy, its copy of the index, its own load counts (exact and
    instant), and the others' as of its last call of the shared load view."""

    def __init__(
        self,
        number: int,
        policy: RoutingPolicy,
        model: FleetModel,
        names: list[str],
        clock: Callable[[], float],
    ) -> None:
        self.number = number
        self.policy = policy
        belief = model.belief_capacity_tokens or model.capacity_tokens
        self.index = MemoryIndex(
            belief * model.engines // model.block_tokens,
            block_set_factory(model.eviction, ttl_s=model.ttl_s, clock=clock),
        )
        for name in names:
            self.index.add_backend(name, belief // model.block_tokens)
        self.closed_loop = (
            ClosedLoop(self.index, model.block_tokens, model.closed_loop_tolerance)
            if model.closed_loop
            else None
        )
        self.in_flight = dict.fromkeys(names, 0)
        self.pending_prefill = dict.fromkeys(names, 0)
        self.prefilling = dict.fromkeys(names, 0)
        #: What this replica last published, and the others' sums it read back, per backend:
        #: (in flight, pending prefill tokens, pending prefill requests).
        self.published: dict[str, tuple[int, int, int]] = {}
        self.others: dict[str, tuple[int, int, int]] = {}
        self.last_call = -math.inf

    def own_load(self, name: str) -> tuple[int, int, int]:
        return self.in_flight[name], self.pending_prefill[name], self.prefilling[name]

    def own(self) -> dict[str, tuple[int, int, int]]:
        """Its counts per backend, as it would publish them (``SharedLoad._own``)."""
        return {name: self.own_load(name) for name in self.in_flight}

    def backend(self, name: str, matched_blocks: int) -> BackendView:
        """A backend as this replica's policy sees it: its own counts plus the others' (as
        ``Backend.own_load`` + ``Backend.set_remote_load`` add them live)."""
        count, tokens, requests = self.others.get(name, (0, 0, 0))
        return BackendView(
            name=name,
            matched_blocks=matched_blocks,
            in_flight=self.in_flight[name] + count,
            cached_blocks=self.index.blocks_of(name),
            pending_prefill_tokens=self.pending_prefill[name] + tokens,
            pending_prefill_requests=self.prefilling[name] + requests,
        )

    def idle(self) -> bool:
        """As ``SharedLoad.idle``: nothing in flight, of its own or the others' as last read,
        and its own counts published as they are."""
        if any(self.in_flight.values()) or any(count for count, _, _ in self.others.values()):
            return False
        return self.published == self.own()


def _summed(loads: Iterable[tuple[int, int, int]]) -> tuple[int, int, int]:
    count = tokens = requests = 0
    for c, t, r in loads:
        count, tokens, requests = count + c, tokens + t, requests + r
    return count, tokens, requests


class Simulation:
    """One replay of a trace through a policy (one per router replica) on a fresh model fleet."""

    def __init__(self, model: FleetModel, policies: Sequence[RoutingPolicy]) -> None:
        if len(policies) != model.replicas:
            raise ValueError(f"one policy per replica: {model.replicas} replicas, {len(policies)} policies")
        self.model = model
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self.names = [f"sim{i}" for i in range(model.engines)]
        self.engines = {name: _Engine(name, model, self) for name in self.names}
        self.replicas = [
            _Replica(number, policy, model, self.names, lambda: self.now)
            for number, policy in enumerate(policies)
        ]
        self._load_view = model.load_view()
        #: The interval of each replica's calls, and whether the view rides on lookups and
        #: writes (``SharedLoad.riding``: only on a fleet within ``load_interval_fleet``, where
        #: the interval is not stretched); both fixed for a run.
        self._interval = self._load_view.load_interval(len(self.replicas), len(self.names))
        self._riding = (
            model.load_on_lookup and len(self.replicas) > 1 and self._interval <= model.load_interval_s
        )
        self._reasons: dict[int, str] = {}
        self.outcomes: dict[int, Outcome] = {}
        #: Requests without an outcome yet: the replicas share their load while there are any.
        self._open = 0
        #: Warm-ups sent (``Decision.warmup``, and the keeper's refreshes); each is a job of
        #: negative index.
        self.warmups = 0
        capacity_blocks = model.capacity_tokens // model.block_tokens
        #: The keeper's refreshes sent.
        self.refreshes = 0
        #: The policy's warm-ups and the keeper's refreshes in flight, each kind with its limit.
        self._warming = InFlight(WARMUPS_IN_FLIGHT)
        self._refreshing = InFlight(REFRESHES_IN_FLIGHT)
        #: Blocks the keeper remembers as asked for: four times the fleet's memory.
        seen_blocks = 4 * model.engines * capacity_blocks
        self.keeper = (
            Keeper(model.refresh_share, model.kept_share, lambda _: capacity_blocks, seen_blocks)
            if model.refresh_share
            else None
        )

    def schedule(self, at: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (at, next(self._seq), action))

    def run(self, requests: Sequence[TraceRequest]) -> list[Outcome]:
        self._open = len(requests)
        for i, request in enumerate(requests):
            self.schedule(
                request.arrival_s / self.model.speedup, lambda now, i=i: self._arrive(requests[i], i)
            )
        if self.keeper is not None:
            self.schedule(KEEPER_CHECK_S, self._refresh)
        if len(self.replicas) > 1:
            # Live replicas start at unrelated instants: spread their calls over one interval.
            for replica in self.replicas:
                self.schedule(
                    replica.number * self._interval / len(self.replicas),
                    lambda now, replica=replica: self._share_load(replica, now),
                )
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action(self.now)
        return [self.outcomes[i] for i in range(len(requests))]

    def _share_load(self, replica: _Replica, now: float) -> None:
        """One replica's turn of the shared load view (``SharedLoad._run``): publish its own
        counts and read the others' last published ones, then come back one interval later."""
        if not self._open:
            return
        since = now - replica.last_call
        # A write published it lately, and nothing changed since (``SharedLoad._run``).
        ridden = self._riding and since < self._interval and replica.published == replica.own()
        if not ridden and (since >= self._load_view.load_idle_interval_s or not replica.idle()):
            self._publish(replica, now)
        self.schedule(now + self._interval, lambda t: self._share_load(replica, t))

    def _refresh(self, now: float) -> None:
        """The keeper's turn: send the refreshes due, as warm-ups, then come back a period later."""
        if not self._open or self.keeper is None:
            return
        replica = self.replicas[0]
        for backend, prefix, _ in self.keeper.due(now):
            chain = list(prefix)
            if replica.index.match_now(chain).get(backend, 0) < len(chain):
                self.keeper.forget(backend, prefix)
                continue
            view = self._view(chain, len(chain) * self.model.block_tokens + 1, max_tokens=1)
            if self._warm(replica, backend, chain, view, self._refreshing):
                self.refreshes += 1
        self.schedule(now + KEEPER_CHECK_S, self._refresh)

    def _publish(self, replica: _Replica, now: float) -> None:
        """One LOAD call: publish the replica's counts, read the others' last published sums."""
        replica.published = replica.own()
        self._read(replica)
        replica.last_call = now

    def _read(self, replica: _Replica) -> None:
        others = [other.published for other in self.replicas if other is not replica]
        replica.others = {name: _summed(p.get(name, (0, 0, 0)) for p in others) for name in self.names}

    def _arrive(self, request: TraceRequest, i: int) -> None:
        model = self.model
        replica = self.replicas[i % len(self.replicas)]
        policy = replica.policy
        chain = request.chain(model.block_tokens)
        uses_index = policy.uses_prefix_match
        matches = replica.index.match_now(chain) if uses_index else {}
        view = self._view(chain, request.input_tokens, request.output_tokens)
        riding = self._riding
        if riding and uses_index:
            self._read(replica)  # the lookup's round trip reads the fleet's sums
        backends = [replica.backend(name, matches.get(name, 0)) for name in self.names]
        decision = policy.choose(view, backends)
        kv_blocks = -(-(request.input_tokens + request.output_tokens) // model.timing.block_tokens)
        job = _Job(
            index=i,
            arrival=self.now,
            prompt_tokens=request.input_tokens,
            output_tokens=request.output_tokens,
            chain=chain,
            backend=decision.backend,
            replica=replica,
            view=view,
            kv_blocks=kv_blocks,
            predicted_blocks=decision.matched_blocks,
            pending_tokens=max(0, request.input_tokens - decision.matched_blocks * model.block_tokens),
        )
        engine = self.engines[decision.backend]
        self._reasons[i] = decision.reason
        if kv_blocks > engine.kv_capacity:
            # The live engine answers 400 (over max_model_len): nothing is recorded or queued.
            self._resolve(
                i, Outcome(decision.backend, decision.reason, request.input_tokens, 0, 0, None, None, None)
            )
            self._tell(job, status=400, ttft_s=None, cached_tokens=None)
            return
        if uses_index and chain:
            if replica.closed_loop is not None:
                job.prediction = replica.closed_loop.predict(
                    decision.backend, chain, decision.matched_blocks, request.input_tokens
                )
            self._believe(replica, decision.backend, chain)
        self._submit(job)
        if self.keeper is not None and uses_index and chain:
            self.keeper.observe(decision.backend, chain, matches.get(decision.backend, 0), self.now)
        if decision.warmup is not None and uses_index:
            self._warm(replica, decision.warmup.backend, chain[: decision.warmup.blocks], view, self._warming)
        if riding and uses_index and chain:
            # The pick's write leaves at once and carries the replica's counts.
            self.schedule(self.now + model.belief_delay_s, lambda now: self._publish(replica, now))

    def _view(self, chain: list[int], prompt_tokens: int, max_tokens: int) -> RequestView:
        """A streamed request of ``chain``, as the policy sees it."""
        return RequestView(
            model="trace",
            tenant="default",
            session_key=None,
            prompt_tokens=prompt_tokens,
            block_count=len(chain),
            block_tokens=self.model.block_tokens,
            max_tokens=max_tokens,
            stream=True,
            chain=chain,
        )

    def _believe(self, replica: _Replica, backend: str, chain: list[int]) -> None:
        """Record a pick in the picking replica's index now, in the others' once it reaches them."""
        replica.index.record(backend, chain)
        for other in self.replicas:
            if other is not replica:
                self.schedule(
                    self.now + self.model.belief_delay_s,
                    lambda now, other=other: other.index.record(backend, chain),
                )

    def _submit(self, job: _Job) -> None:
        replica = job.replica
        replica.in_flight[job.backend] += 1
        replica.pending_prefill[job.backend] += job.pending_tokens
        replica.prefilling[job.backend] += 1
        self.engines[job.backend].submit(job, self.now)

    def _warm(
        self, replica: _Replica, backend: str, prefix: list[int], view: RequestView, slots: InFlight
    ) -> bool:
        """The router's warm-up (or refresh): ``prefix`` and one output token to ``backend``,
        believed at the pick like any request; it has no outcome of its own. False: skipped,
        as the router skips one beyond ``slots``' limit."""
        key = slots.take(backend, prefix[-1])
        if key is None:
            return False
        self.warmups += 1
        block_tokens = self.model.block_tokens
        prompt_tokens = len(prefix) * block_tokens + 1
        matched = replica.index.match_now(prefix).get(backend, 0)
        job = _Job(
            index=-self.warmups,
            arrival=self.now,
            prompt_tokens=prompt_tokens,
            output_tokens=1,
            chain=prefix,
            backend=backend,
            replica=replica,
            view=view,
            kv_blocks=-(-(prompt_tokens + 1) // self.model.timing.block_tokens),
            predicted_blocks=matched,
            pending_tokens=prompt_tokens - matched * block_tokens,
            warm_slot=(slots, key),
        )
        self._believe(replica, backend, prefix)
        self._submit(job)
        return True

    def first_token(self, job: _Job) -> None:
        """The router sees the first byte: that request's prefill no longer queues anyone."""
        job.replica.pending_prefill[job.backend] -= job.pending_tokens
        job.replica.prefilling[job.backend] -= 1

    def finished(self, job: _Job, now: float) -> None:
        job.replica.in_flight[job.backend] -= 1
        if job.warm_slot is not None:  # a warm-up: no client waits for it
            slots, key = job.warm_slot
            slots.release(key)
            return
        reported = None
        closed_loop = job.replica.closed_loop
        if closed_loop is not None and job.prediction is not None:
            # A stream's usage chunk comes at its end, so that is when the live router learns.
            closed_loop.report(job.prediction, job.cached_tokens)
            reported = job.cached_tokens
        self._tell(job, status=200, ttft_s=job.first_token - job.arrival, cached_tokens=reported)
        self._resolve(
            job.index,
            Outcome(
                backend=job.backend,
                reason=self._reasons.pop(job.index),
                prompt_tokens=job.prompt_tokens,
                cached_tokens=job.cached_tokens,
                predicted_tokens=min(job.predicted_blocks * self.model.block_tokens, job.prompt_tokens),
                queue_s=job.prefill_start - job.arrival,
                ttft_s=job.first_token - job.arrival,
                e2e_s=now - job.arrival,
            ),
        )

    def _resolve(self, index: int, outcome: Outcome) -> None:
        self.outcomes[index] = outcome
        self._open -= 1

    def _tell(self, job: _Job, *, status: int, ttft_s: float | None, cached_tokens: int | None) -> None:
        """The policy's outcome for ``job``, as the live router would tell it: at the response's
        end, with the engine's cached tokens only where the live router reads them (closed loop)."""
        policy = job.replica.policy
        if policy.learns:
            policy.on_outcome(
                AttemptOutcome(
                    backend=job.backend,
                    request=job.view,
                    matched_tokens=job.predicted_blocks * self.model.block_tokens,
                    cached_tokens=cached_tokens,
                    ttft_s=ttft_s,
                    status=status,
                )
            )


@dataclass(frozen=True)
class Summary:
    """The figures ``kvroute simulate`` prints for one run."""

    requests: int
    refused: int
    hit_ratio: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    queue_mean: float
    queue_p99: float
    e2e_p50: float
    #: Largest backend's share of requests over the mean share (1.0 = perfectly even).
    imbalance: float
    #: Engine-reported cached tokens over the index's predicted ones for the chosen backends.
    belief_accuracy: float
    reasons: dict[str, int]
    wall_s: float
    #: The keeper's refreshes (``FleetModel.refresh_share``), over the requests.
    refreshes_per_request: float | None = None


def summarize(outcomes: Sequence[Outcome], engines: int, wall_s: float = 0.0) -> Summary:
    done = [o for o in outcomes if o.ttft_s is not None]
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    queues = [o.queue_s for o in done if o.queue_s is not None]
    prompt = sum(o.prompt_tokens for o in done)
    predicted = sum(o.predicted_tokens for o in done)
    shares = Counter(o.backend for o in done)
    return Summary(
        requests=len(outcomes),
        refused=len(outcomes) - len(done),
        hit_ratio=sum(o.cached_tokens for o in done) / prompt if prompt else 0.0,
        ttft_mean=sum(ttfts) / len(ttfts) if ttfts else math.nan,
        ttft_p50=percentile(ttfts, 0.50),
        ttft_p90=percentile(ttfts, 0.90),
        ttft_p99=percentile(ttfts, 0.99),
        queue_mean=sum(queues) / len(queues) if queues else math.nan,
        queue_p99=percentile(queues, 0.99),
        e2e_p50=percentile([o.e2e_s for o in done if o.e2e_s is not None], 0.50),
        imbalance=max(shares.values()) * engines / len(done) if done else math.nan,
        belief_accuracy=sum(o.cached_tokens for o in done) / predicted if predicted else math.nan,
        reasons=dict(Counter(o.reason for o in outcomes).most_common()),
        wall_s=wall_s,
    )


def simulate(
    requests: Sequence[TraceRequest],
    model: FleetModel,
    policy: str,
    params: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> tuple[list[Outcome], Summary]:
    """Replay ``requests`` through ``policy`` (built as the router builds it) on ``model``."""
    started = time.perf_counter()
    # Replica 0 keeps ``seed``, so one router replays as before; the others' seeds stay apart
    # from any other run's (seed 1's replica 1 is not seed 2's replica 0).
    policies = [build_policy(policy, params, seed=seed + 1000 * number) for number in range(model.replicas)]
    simulation = Simulation(model, policies)
    outcomes = simulation.run(requests)
    summary = summarize(outcomes, model.engines, time.perf_counter() - started)
    if simulation.keeper is not None and requests:
        summary = replace(summary, refreshes_per_request=simulation.refreshes / len(requests))
    return outcomes, summary


@dataclass(frozen=True)
class Bounds:
    """What no routing can beat on a trace and fleet, computed from the trace alone."""

    #: Hit ratio of one LRU cache as large as the whole fleet: perfect placement on LRU engines.
    pooled_lru_hit_ratio: float
    #: Hit ratio of that pooled cache under Belady's optimal (clairvoyant) eviction: what no
    #: placement on any eviction can beat with the fleet's memory.
    belady_hit_ratio: float
    #: Each request's own prefill of what that pooled cache misses, without any queueing.
    ttft_floor_mean: float
    ttft_floor_p50: float
    ttft_floor_p99: float


def _pooled_floors(requests: Sequence[TraceRequest], model: FleetModel) -> tuple[PrefixCache, list[float]]:
    """One LRU cache as large as the fleet, fed the trace, and each request's TTFT floor: its own
    prefill of what that cache misses, without any queueing."""
    pooled = PrefixCache(model.engines * model.capacity_tokens // model.block_tokens, model.block_tokens, 1)
    floors = []
    for request in requests:
        chain = request.chain(model.block_tokens)
        cached = pooled.lookup(chain, request.input_tokens) * model.block_tokens
        pooled.insert(chain)
        floors.append(model.timing.prefill_seconds(request.input_tokens - cached))
    return pooled, floors


def bounds(requests: Sequence[TraceRequest], model: FleetModel) -> Bounds:
    pooled, floors = _pooled_floors(requests, model)
    return Bounds(
        pooled_lru_hit_ratio=pooled.hits_tokens / pooled.queries_tokens if pooled.queries_tokens else 0.0,
        belady_hit_ratio=belady_hit_ratio(
            [r.chain(model.block_tokens) for r in requests],
            [r.input_tokens for r in requests],
            model.engines * model.capacity_tokens // model.block_tokens,
            model.block_tokens,
        ),
        ttft_floor_mean=sum(floors) / len(floors) if floors else math.nan,
        ttft_floor_p50=percentile(floors, 0.5),
        ttft_floor_p99=percentile(floors, 0.99),
    )


@dataclass(frozen=True)
class FloorGap:
    """How far a run's TTFT is above its requests' floors, per request on average, and why: a
    policy near its floor has little left to gain from placement, and the parts say whether
    the rest is load or cache. In this model a request's TTFT is its wait for the prefill lane
    plus its own prefill (the first token is stamped at the prefill's end), so the two parts
    are the whole gap."""

    #: Waiting for the engine's prefill lane (the requests and warm-ups ahead).
    queueing_s: float
    #: Prefill of what the pooled cache held but the chosen engine did not: a spill, a miss.
    #: Negative where engines held more than one pooled LRU cache would have.
    cache_s: float

    @property
    def total_s(self) -> float:
        return self.queueing_s + self.cache_s


def floor_gap(requests: Sequence[TraceRequest], model: FleetModel, outcomes: Sequence[Outcome]) -> FloorGap:
    """``outcomes`` (in request order) against the floors of ``requests`` on ``model``'s fleet.
    Refused requests are left out of both: no engine ever cached their prompts, so the pooled
    cache behind the floors does not hold them either."""
    served = [(r, o) for r, o in zip(requests, outcomes, strict=True) if o.ttft_s is not None]
    if not served:
        return FloorGap(math.nan, math.nan)
    _, floors = _pooled_floors([r for r, _ in served], model)
    queueing = sum(o.queue_s or 0.0 for _, o in served)
    cache = sum(
        model.timing.prefill_seconds(o.prompt_tokens - o.cached_tokens) - floor
        for (_, o), floor in zip(served, floors, strict=True)
    )
    return FloorGap(queueing / len(served), cache / len(served))


def belady_hit_ratio(
    chains: Sequence[Sequence[int]], prompt_tokens: Sequence[int], capacity_blocks: int, block_tokens: int
) -> float:
    """Hit ratio of a prefix cache of ``capacity_blocks`` that evicts the block used furthest in
    the future (Belady's MIN), and does not admit a block used later than everything it holds.

    A request hits its leading cached blocks, as in the engines. Every request that uses a
    block uses its parent too, so a parent is never needed later than its child: ties are
    broken by evicting the deeper block first, and a child never outlives a parent it needs.
    """
    never = len(chains)
    following: list[list[int]] = [[] for _ in chains]
    last: dict[int, int] = {}
    for i in range(len(chains) - 1, -1, -1):
        following[i] = [last.get(block, never) for block in chains[i]]
        for block in chains[i]:
            last[block] = i
    cached: dict[int, int] = {}  # block -> its next use
    furthest: list[tuple[int, int, int]] = []  # (-next use, -depth, block), stale entries skipped
    hits = queried = 0
    for i, chain in enumerate(chains):
        leading = 0
        while leading < len(chain) and chain[leading] in cached:
            leading += 1
        hits += min(leading * block_tokens, prompt_tokens[i])
        queried += prompt_tokens[i]
        for depth, (block, next_use) in enumerate(zip(chain, following[i], strict=True)):
            if block in cached:
                cached[block] = next_use
                heapq.heappush(furthest, (-next_use, -depth, block))
                continue
            if next_use == never:
                continue
            while len(cached) >= capacity_blocks:
                far, _, victim = furthest[0]
                if cached.get(victim) != -far:
                    heapq.heappop(furthest)  # stale: evicted or used again since
                    continue
                if -far <= next_use:
                    break  # everything held is needed sooner: do not admit
                heapq.heappop(furthest)
                del cached[victim]
            if len(cached) < capacity_blocks:
                cached[block] = next_use
                heapq.heappush(furthest, (-next_use, -depth, block))
    return hits / queried if queried else 0.0


#: FleetModel fields ``--sweep`` may vary besides the policy's own parameters.
_FLEET_KEYS = (
    "engines",
    "capacity_tokens",
    "belief_capacity_tokens",
    "eviction",
    "ttl_s",
    "speedup",
    "closed_loop",
    "closed_loop_tolerance",
    "replicas",
    "load_interval_s",
    "load_idle_interval_s",
    "belief_delay_s",
    "load_on_lookup",
    "refresh_share",
    "kept_share",
)


def sweep_runs(
    policies: Sequence[str], params: Mapping[str, Any], sweep: tuple[str, list[Any]] | None, model: FleetModel
) -> list[tuple[str, str, FleetModel, dict[str, Any]]]:
    """(policy, label, fleet, params) for every run a command asks for, in table order."""
    runs = []
    for policy in policies:
        if sweep is None:
            runs.append((policy, "", model, dict(params)))
            continue
        key, values = sweep
        for value in values:
            if key in _FLEET_KEYS:
                runs.append((policy, f"{key}={value}", replace(model, **{key: value}), dict(params)))
            else:
                runs.append((policy, f"{key}={value}", model, {**params, key: value}))
    return runs


def report(
    requests: Sequence[TraceRequest],
    runs: Sequence[tuple[str, str, FleetModel, dict[str, Any]]],
    seed: int = 0,
    out: Callable[[str], None] = print,
    slowest: int = 0,
) -> list[Summary]:
    """Run each of ``runs`` and print one table row per run, then the trace's bounds, then
    (``slowest`` > 0) each run's tail: what its slowest requests were.

    A figure a run has no value for (``cached/predicted`` of a policy that predicts nothing)
    prints as ``-``; the ``run`` column is there only with ``--sweep``, which labels the rows."""
    rows, summaries, tails, gaps = [], [], [], []
    for policy, label, model, params in runs:
        outcomes, s = simulate(requests, model, policy, params, seed)
        summaries.append(s)
        name = f"{policy} {label}".strip()
        gaps.append((name, floor_gap(requests, model, outcomes)))
        if slowest > 0:
            tails.append((name, outcomes))
        ms = [s.ttft_mean, s.ttft_p50, s.ttft_p90, s.ttft_p99, s.queue_mean, s.e2e_p50]
        rows.append(
            [
                policy,
                label,
                _figure(s.hit_ratio, ".1%"),
                *(_figure(value * 1000, ".0f") for value in ms),
                _figure(s.imbalance, ".2f"),
                _figure(s.belief_accuracy, ".2f"),
                s.refused,
                f"{s.wall_s:.1f}",
            ]
        )
    headers = ["policy", "run", "hit ratio", "TTFT mean ms", "p50", "p90", "p99", "queue mean ms"]
    headers += ["e2e p50 ms", "max/mean share", "cached/predicted", "refused", "wall s"]
    if any(s.refreshes_per_request is not None for s in summaries):
        headers.append("refreshes/request")
        for row, summary in zip(rows, summaries, strict=True):
            refreshes = summary.refreshes_per_request
            row.append(_figure(math.nan if refreshes is None else refreshes, ".2f"))
    if not any(label for _, label, _, _ in runs):
        headers.pop(1)
        rows = [row[:1] + row[2:] for row in rows]
    out(format_table(headers, rows))
    base = runs[0][2]
    b = bounds(requests, base)
    out(
        f"\nbounds for {base.engines} engines x {base.capacity_tokens:,} tokens: pooled-LRU hit ratio "
        f"{b.pooled_lru_hit_ratio:.1%}, Belady (optimal eviction) {b.belady_hit_ratio:.1%}; "
        f"TTFT floor mean {b.ttft_floor_mean * 1000:.0f} ms, "
        f"p50 {b.ttft_floor_p50 * 1000:.0f} ms, p99 {b.ttft_floor_p99 * 1000:.0f} ms"
    )
    out("\nTTFT above the floor (each run's own fleet's), ms per request: queueing + prefix prefilled again")
    for name, gap in gaps:
        parts = (gap.total_s, gap.queueing_s, gap.cache_s)
        out("  {}: {} = {} + {}".format(name, *(_figure(round(x * 1000, 2) + 0.0, ".2f") for x in parts)))
    for name, outcomes in tails:
        out(format_tail(name, outcomes, slowest))
    return summaries


def format_tail(name: str, outcomes: Sequence[Outcome], count: int) -> str:
    """A run's slowest ``count`` requests, and the decision reasons of its slowest 1 %.

    A TTFT p99 is its slowest hundredth: whether those requests queued, or each paid its own
    prefill (and whether that prefill was a miss the router chose, such as a spill to an engine
    without the prefix), says which change could move it.
    """
    done = sorted((o for o in outcomes if o.ttft_s is not None), key=lambda o: o.ttft_s or 0.0, reverse=True)
    tail = done[: max(1, math.ceil(len(done) / 100))]
    reasons = ", ".join(f"{r} {n}" for r, n in Counter(o.reason for o in tail).most_common())
    rows = [
        [
            f"{(o.ttft_s or 0.0) * 1000:.0f}",
            f"{(o.queue_s or 0.0) * 1000:.0f}",
            o.prompt_tokens,
            o.cached_tokens,
            o.reason,
            o.backend,
        ]
        for o in done[:count]
    ]
    headers = ["TTFT ms", "queue ms", "prompt tokens", "cached", "reason", "backend"]
    return f"\n{name}: slowest 1 % ({len(tail)} requests) by reason: {reasons or '-'}\n" + format_table(
        headers, rows
    )


def _figure(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


class UsageError(ValueError):
    """A ``kvroute simulate`` argument is malformed; the message says which and why."""


def parse_sweep(text: str | None) -> tuple[str, list[Any]] | None:
    """``key=v1,v2,...`` with each value read as YAML (so 2, 0.5, true and lru all mean what they say)."""
    if text is None:
        return None
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise UsageError(f"--sweep: expected key=v1,v2,..., got {text!r}")
    return key, [yaml.safe_load(v) for v in values.split(",")]


def parse_params(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--params: not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise UsageError("--params: expected a JSON object of the policy's parameters")
    return params


def load_source(
    source: str,
    *,
    minutes: float | None,
    limit: int | None,
    seed: int,
    max_output_tokens: int = 0,
    spread_s: float = 0.0,
) -> list[TraceRequest]:
    """A generated workload's requests (``source`` one of :data:`loadtest.workloads.NAMES`), else
    the trace file at ``source``; either cut to its first ``minutes`` and ``limit`` requests,
    and each output to ``max_output_tokens`` (0: as given), as ``kvroute bench routing`` does;
    arrivals spread over ``spread_s`` (:func:`~loadtest.trace.spread_arrivals`) as
    ``bench_redis --spread-s`` does."""
    if source in workloads.NAMES:
        requests = workloads.generate(source, seed, 10.0 if minutes is None else minutes)
        requests = requests[:limit] if limit is not None else requests
    else:
        requests = read_trace(source, minutes=minutes, limit=limit)
    if max_output_tokens:
        requests = [replace(r, output_tokens=min(r.output_tokens, max_output_tokens)) for r in requests]
    return spread_arrivals(requests, spread_s, seed=seed) if spread_s else requests


def run_command(
    trace: str,
    policies: Sequence[str],
    model: FleetModel,
    *,
    params: str | None = None,
    sweep: str | None = None,
    minutes: float | None = None,
    limit: int | None = None,
    seed: int = 0,
    max_output_tokens: int = 0,
    slowest: int = 0,
    spread_s: float = 0.0,
) -> int:
    """``kvroute simulate``: read the trace, run every policy (and sweep value), print the table."""
    try:
        runs = sweep_runs(policies, parse_params(params), parse_sweep(sweep), model)
        for policy, _, _, run_params in runs:
            build_policy(policy, run_params, seed=seed)  # refuse bad params before the long part
        if max_output_tokens < 0 or slowest < 0 or spread_s < 0:
            raise UsageError("--max-output-tokens, --slowest and --spread-s must be >= 0")
        requests = load_source(
            trace,
            minutes=minutes,
            limit=limit,
            seed=seed,
            max_output_tokens=max_output_tokens,
            spread_s=spread_s,
        )
    except (UsageError, PolicyLoadError, TraceError, OSError, ValueError, TypeError) as exc:
        print(f"kvroute simulate: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("kvroute simulate: the trace slice has no requests", file=sys.stderr)
        return 2
    span = requests[-1].arrival_s / model.speedup
    print(
        f"{len(requests)} requests over {span / 60:.1f} min of virtual time (speedup {model.speedup:g}), "
        f"{model.engines} engines x {model.capacity_tokens:,} KV tokens, router blocks of "
        f"{model.block_tokens} tokens, {model.eviction} beliefs"
        + (
            f", {model.replicas} router replicas (load view every "
            f"{model.load_view().load_interval(model.replicas, model.engines) * 1000:g} ms, "
            f"beliefs after {model.belief_delay_s * 1000:g} ms)"
            if model.replicas > 1
            else ""
        )
        + "\n",
        flush=True,
    )
    report(requests, runs, seed, slowest=slowest)
    return 0
