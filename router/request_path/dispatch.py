"""The request path after parsing, top to bottom: filter, key, match, choose, forward, record.

    RoutableRequest -> candidates -> keyer.view -> index.match_for -> policy.choose -> Attempt -> proxy
                       (filter)      (key)         (match)            (choose)          (forward, record)

Every request reaches exactly one engine or fails with a clear error. Each try on a backend
is an Attempt (router/request_path/attempt.py): it holds the backend's counters, circuit
trial and pending prefill, follows the index's belief lifecycle and tells the policy how it
ended, and gives everything back on every path; this module only decides what to try next.

A model served by prefill and decode engines (``backends[].role``) takes one branch of its own,
router/request_path/disaggregated.py, only when the pool has such backends at all.

Endpoints without a cacheable prompt (router/request_path/endpoints.py: rerank, score,
tokenize, transcriptions...) skip the key and match steps and are chosen by least load,
whatever the configured policy. Each request's RequestContext (router/request_path/context.py)
learns what happened, for the access log and the request's span; with tracing, the routing
decision is a ``route`` span and each attempt an ``upstream`` span.

A decision may also ask for a warm-up (``Decision.warmup``): a prefix copied to another
candidate in the background, beside the request (router/request_path/warmup.py). With
``routing.retention``, every pick is also told to the refresher, which keeps the prefixes that
come back cached by sending them again (router/request_path/retention.py).

Retries: a backend that fails before the client got a byte (router/request_path/proxy.py says which
failures count) is replaced by the policy's pick among the remaining candidates, at most
``upstream.max_attempts`` backends in all and never after ``upstream.retry_deadline_s``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from policies.routing.base import RoutingPolicy
from policies.routing.least_load import LeastLoad
from policies.types import Decision, RequestView
from router.config import Config
from router.errors import OpenAIError
from router.fleet.backends import Backend, BackendPool
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.request_path.attempt import Attempt, AttemptBooks
from router.request_path.beliefs import BeliefMetrics, ClosedLoop
from router.request_path.context import RequestContext
from router.request_path.disaggregated import Pairs, is_role_split
from router.request_path.endpoints import PREFIX_ROUTED
from router.request_path.keying import build_keyer
from router.request_path.pick import Picker
from router.request_path.proxy import Proxy, UpstreamFailed
from router.request_path.request import RoutableRequest
from router.request_path.retention import IN_FLIGHT as REFRESHES_IN_FLIGHT
from router.request_path.retention import Refresher
from router.request_path.warmup import Warmups

log = logging.getLogger("kvroute.dispatch")


@dataclass(frozen=True, slots=True)
class _Route:
    """What one request is routed with: the policy, the candidates and their matches."""

    policy: RoutingPolicy
    #: The policy's ``policy`` metric label.
    label: str
    candidates: list[Backend]
    matches: dict[str, int]
    #: The endpoint's prompt is prefix-routed by the configured policy (else load-balanced).
    prefix_routed: bool
    #: When the dispatcher took the request (``time.perf_counter()``), for the decision time.
    dispatched: float
    #: The same moment as a span timestamp, for the ``route`` span; 0 without tracing.
    trace_started: int


class Dispatcher:
    def __init__(
        self,
        config: Config,
        pool: BackendPool,
        index: PrefixIndex,
        policy: RoutingPolicy,
        proxy: Proxy,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.proxy = proxy
        self.metrics = metrics
        #: How a prompt becomes a block chain: the index's mode decides, once.
        self.keyer = build_keyer(config.index)
        #: Closed-loop beliefs (router/request_path/beliefs.py): engines' cached-token reports
        #: correct the index.
        closed_loop = None
        if config.index.closed_loop:
            beliefs = BeliefMetrics(metrics.registry)
            tolerance = config.index.closed_loop_tolerance
            closed_loop = ClosedLoop(index, self.keyer.block_tokens, tolerance, beliefs)
        self.books = AttemptBooks(metrics, index, self.keyer.block_tokens, closed_loop)
        self.policy = policy
        #: The policy of endpoints balanced by load (router/request_path/endpoints.py).
        self._balancer = LeastLoad(seed=config.routing.seed)
        #: Chooses decode engines for models served by prefill/decode pairs (its own reload rule).
        self.decode_policy = config.decode_policy
        #: Asks the policy for its pick, and least_load when the policy fails (pick.py).
        self.picker = Picker(self._balancer)
        self.pairs = Pairs(self.books, proxy, metrics, self.picker)
        #: Prefix copies a policy asks for beside a request (router/request_path/warmup.py).
        self.warmups = Warmups(self.books, proxy, metrics, self.keyer)
        #: Keeps returning prefixes cached by refreshing them (``routing.retention``, read at start).
        retention = config.routing.retention
        self.refresher: Refresher | None = None
        if retention.refresh_share > 0:
            refreshes = Warmups(
                self.books, proxy, metrics, self.keyer, in_flight=REFRESHES_IN_FLIGHT, suffix="refresh"
            )
            self.refresher = Refresher(retention, pool, index, refreshes, metrics, self._first_byte_timeout_s)

    def start(self) -> None:
        """At start, in the event loop: the refresher's task."""
        if self.refresher is not None:
            self.refresher.start()

    async def close(self) -> None:
        """At shutdown: stop refreshing, cancel the warm-ups in flight."""
        if self.refresher is not None:
            await self.refresher.close()
        await self.warmups.close()

    def _first_byte_timeout_s(self) -> float:
        """The running config's, read at each use: a reload's applies at once."""
        return self.config.upstream.first_byte_timeout_s

    @property
    def policy(self) -> RoutingPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: RoutingPolicy) -> None:
        """At start, and on a reload that changed ``routing`` (router/http/reload.py)."""
        self._policy = policy
        self._policy_label = policy.name or type(policy).__name__
        self.books.follow(policy)

    async def dispatch(
        self, request: web.Request, routable: RoutableRequest, context: RequestContext
    ) -> web.StreamResponse:
        dispatched = time.perf_counter()
        context.endpoint, context.model, context.tenant = routable.endpoint, routable.model, routable.tenant
        trace = context.trace
        trace_started = trace.now() if trace is not None else 0
        candidates = self._candidates(routable.model)
        # Endpoints without a cacheable prompt are balanced by load, whatever the policy.
        prefix_routed = routable.endpoint in PREFIX_ROUTED
        if self.pool.role_split and prefix_routed and is_role_split(candidates):
            return await self._pairs(request, routable, candidates, context)
        policy, label = (
            (self._policy, self._policy_label) if prefix_routed else (self._balancer, LeastLoad.name)
        )
        keyed = policy.uses_prefix_match
        view = self.keyer.view(routable, keyed)
        context.prompt_tokens = view.prompt_tokens
        matches = await self._match(view.chain[: view.cacheable_blocks], candidates) if keyed else {}
        self.metrics.prompt_tokens_by(routable.model).inc(view.prompt_tokens)
        route = _Route(policy, label, candidates, matches, prefix_routed, dispatched, trace_started)
        return await self._forward(request, routable, view, route, context)

    async def _pairs(
        self,
        request: web.Request,
        routable: RoutableRequest,
        candidates: list[Backend],
        context: RequestContext,
    ) -> web.StreamResponse:
        """A model served by prefill/decode pairs: one index lookup over both pools, then the pair."""
        policy, decode_policy = self._policy, self.decode_policy
        keyed = policy.uses_prefix_match or decode_policy.uses_prefix_match
        view = self.keyer.view(routable, keyed)
        context.prompt_tokens = view.prompt_tokens
        matches = await self._match(view.chain, candidates) if keyed else {}
        self.metrics.prompt_tokens_by(routable.model).inc(view.prompt_tokens)
        return await self.pairs.dispatch(
            request, routable, view, candidates, matches, context, self.config, policy, decode_policy
        )

    def _candidates(self, model: str) -> list[Backend]:
        """The backends serving ``model`` that are in rotation (the filter)."""
        serving = self.pool.serving(model)
        if not serving:
            raise OpenAIError(
                404,
                f"The model '{model}' does not exist or is not served by any backend.",
                param="model",
                code="model_not_found",
            )
        healthy = [b for b in serving if b.routable]
        if not healthy:
            raise OpenAIError(
                503,
                f"No healthy backend serves the model '{model}' right now.",
                code="no_healthy_backend",
                retry_after=max(1, math.ceil(self.config.health.interval_s)),
            )
        return healthy

    async def _match(self, chain: Sequence[int], candidates: list[Backend]) -> dict[str, int]:
        """What each candidate is believed to hold of ``chain`` (the index's mode decides how):
        the part of the prompt's chain an engine can take from its cache, so that a match
        counts what the engine will report cached (``RequestView.cacheable_blocks``)."""
        matches = await self.index.match_for(chain, candidates)
        self.metrics.index_lookups_by("hit" if any(matches.values()) else "miss").inc()
        return matches

    async def _forward(
        self,
        request: web.Request,
        routable: RoutableRequest,
        view: RequestView,
        route: _Route,
        context: RequestContext,
    ) -> web.StreamResponse:
        """Choose and try backends until one answers, within the attempts and the deadline."""
        upstream = self.config.upstream
        started = context.started
        deadline = started + upstream.retry_deadline_s
        failures: list[str] = []
        candidates = route.candidates
        for number in range(upstream.max_attempts):
            remaining = deadline - time.perf_counter()
            if number:
                # Backends ejected meanwhile (perhaps by this very request's failures) are out.
                candidates = [b for b in candidates if b.routable]
            if not candidates or remaining <= 0:
                break
            backend, decision = self._choose(route, view, candidates)
            timeout = min(upstream.first_byte_timeout_s, remaining)
            if number:
                self.metrics.retries.inc()
            else:
                self.metrics.decision_time_by(routable.model).observe(time.perf_counter() - route.dispatched)
                if context.trace is not None:
                    context.trace.routed(route.trace_started, route.label, decision, view, candidates)
                if decision.warmup is not None:
                    self._warm(request, routable, view, decision, candidates, context, timeout)
                if self.refresher is not None and route.prefix_routed:
                    # At the first pick, not once served: an engine's LRU order is set when it
                    # takes the prompt, and at tight capacity its turnover is a few seconds, so a
                    # refresh timed from the response's end comes after the eviction (measured:
                    # half the refreshes, 6.5 % hit against 6.9 %). A retry's prefix stays kept on
                    # the backend that failed, refreshed there while the index believes it cached.
                    cached = route.matches.get(backend.name, 0)
                    self.refresher.observe(request, routable, view, backend.name, cached, context)
            try:
                with Attempt(
                    self.books, routable, view, backend, decision, context, timeout, route.prefix_routed
                ) as attempt:
                    return await self.proxy.forward(request, attempt)
            except UpstreamFailed as exc:
                log.warning(
                    "backend %s failed before responding (%s); %s",
                    backend.name,
                    exc,
                    "retrying" if number + 1 < upstream.max_attempts else "giving up",
                )
                failures.append(f"{backend.name}: {exc.kind}")
                candidates = [b for b in candidates if b is not backend]
        raise self._exhausted(failures, deadline)

    def _warm(
        self,
        request: web.Request,
        routable: RoutableRequest,
        view: RequestView,
        decision: Decision,
        candidates: list[Backend],
        context: RequestContext,
        timeout: float,
    ) -> None:
        """Start the warm-up the decision asks for, on a candidate other than the chosen one."""
        warmup = decision.warmup
        assert warmup is not None
        for backend in candidates:
            if backend.name == warmup.backend and backend.name != decision.backend:
                self.warmups.start(request, routable, view, backend, warmup, context, timeout)
                return
        log.warning("policy %s asked to warm %r, not another candidate", self._policy_label, warmup.backend)

    def _choose(
        self, route: _Route, view: RequestView, candidates: list[Backend]
    ) -> tuple[Backend, Decision]:
        """The policy's pick among the candidates' views (least_load's if the policy fails)."""
        blocks_of, matches = self.index.blocks_of, route.matches
        views = [b.view(matches.get(b.name, 0), blocks_of(b.name)) for b in candidates]
        backend, decision = self.picker.pick(route.policy, route.label, view, candidates, views)
        self.metrics.decisions_by(route.label, decision.reason).inc()
        self.metrics.matched_tokens_by(view.model).inc(decision.matched_blocks * view.block_tokens)
        log.debug(
            "route model=%s backend=%s reason=%s matched_blocks=%d of %d",
            view.model,
            decision.backend,
            decision.reason,
            decision.matched_blocks,
            len(view.chain),
        )
        return backend, decision

    def _exhausted(self, failures: list[str], deadline: float) -> OpenAIError:
        """The error when no attempt is left: the deadline passed (504), or no backend could (502)."""
        upstream = self.config.upstream
        if time.perf_counter() >= deadline:
            return OpenAIError(
                504,
                f"No backend sent a first byte within {upstream.retry_deadline_s:g} s "
                f"({'; '.join(failures) or 'no attempt'}).",
                code="upstream_timeout",
            )
        return OpenAIError(
            502,
            f"No backend could serve the request ({'; '.join(failures) or 'no candidates left'}).",
            code="upstream_unavailable",
        )
