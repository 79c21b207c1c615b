"""The request path after parsing: hash, match, choose, forward (retrying), record.

    RoutableRequest -> hasher.chain -> index.match -> policy.choose -> proxy.forward -> engine
                                                                          |
                            index.record(backend, chain)  <-- on accept --+

Every request reaches exactly one engine or fails with a clear error, and each backend's
in-flight count is released on every path (success, upstream error, client disconnect).

Retries: a backend that fails before the client got a byte (router/request_path/proxy.py says which
failures count) is replaced by the policy's pick among the remaining candidates, at most
``upstream.max_attempts`` backends in all and never after ``upstream.retry_deadline_s``.
Each outcome feeds the backend's circuit breaker once: 5xx, connection errors and timeouts
as failures, any other answer (4xx included) as a success, a client that left as neither.
"""

from __future__ import annotations

import logging
import math
import time

from aiohttp import web

from policies.routing.base import RoutingPolicy
from policies.types import Decision, RequestView
from router.config import Config
from router.errors import OpenAIError
from router.fleet.backends import Backend, BackendPool
from router.index import PrefixIndex
from router.index.keys import PrefixHasher, block_keys, chain_seed
from router.index.precise import PreciseIndex
from router.metrics import RouterMetrics
from router.request_path.beliefs import BeliefCheck, BeliefMetrics, ClosedLoop
from router.request_path.prefill import PendingPrefill
from router.request_path.proxy import ClientGone, Proxy, StreamInterrupted, UpstreamFailed, upstream_headers
from router.request_path.request import CHAT, TENANT, RoutableRequest
from router.request_path.tokenize import load_tokenizer

log = logging.getLogger("kvroute.dispatch")

#: Status label for requests whose client disconnected (nginx's convention).
CLIENT_CLOSED = "499"


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
        self.policy = policy
        self.proxy = proxy
        self.metrics = metrics
        self.hasher = PrefixHasher(config.index.block_size)
        self.block_tokens = max(1, round(config.index.block_size / config.index.chars_per_token))
        #: Token mode (``index.mode: events``): chains are block keys over the engine's token ids,
        #: in blocks of the engines' size, so they meet the keys the events produce.
        self.tokenizer = load_tokenizer(config.index.tokenizer) if config.index.mode == "events" else None
        if self.tokenizer is not None:
            self.block_tokens = config.index.events.block_size
        #: The index when it is fed by KV events: beliefs at the pick, and eviction ahead.
        self.precise = index if isinstance(index, PreciseIndex) else None
        #: Closed-loop beliefs (router/request_path/beliefs.py): engines' cached-token reports
        #: correct the index.
        self.closed_loop: ClosedLoop | None = None
        if config.index.closed_loop:
            beliefs = BeliefMetrics(metrics.registry)
            tolerance = config.index.closed_loop_tolerance
            self.closed_loop = ClosedLoop(index, self.block_tokens, tolerance, beliefs)

    def _candidates(self, model: str) -> list[Backend]:
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

    def _chain(self, routable: RoutableRequest) -> tuple[list[int], int | None]:
        """The prompt's block chain, and its exact token count in token mode."""
        if self.tokenizer is None:
            return self.hasher.chain(routable.prompt, chain_seed(routable.tenant, routable.model)), None
        ids = self.tokenizer.prompt_ids(routable.document, routable.endpoint == CHAT)
        return block_keys(ids, self.block_tokens), len(ids)

    async def _match(self, chain: list[int], candidates: list[Backend]) -> dict[str, int]:
        """What each candidate holds of ``chain``; in precise mode, what it will still hold when
        the prefills this router queued there ahead of the request have stored their blocks."""
        if self.precise is not None:
            block = self.block_tokens
            ahead = {b.name: -(-b.pending_prefill_tokens // block) for b in candidates}
            return self.precise.match_surviving(chain, ahead)
        return await self.index.match(chain, [b.name for b in candidates])

    def _request_view(self, routable: RoutableRequest, chain: list[int], tokens: int | None) -> RequestView:
        return RequestView(
            model=routable.model,
            tenant=routable.tenant,
            session_key=routable.session_key,
            prompt_tokens=tokens
            if tokens is not None
            else math.ceil(len(routable.prompt) / self.config.index.chars_per_token),
            block_count=len(chain) if chain else len(routable.prompt) // self.config.index.block_size,
            block_tokens=self.block_tokens,
            max_tokens=routable.max_tokens,
            stream=routable.stream,
            chain=chain,
        )

    async def dispatch(self, request: web.Request, routable: RoutableRequest) -> web.StreamResponse:
        started = time.perf_counter()
        candidates = self._candidates(routable.model)
        chain: list[int] = []
        tokens: int | None = None
        matches: dict[str, int] = {}
        if self.policy.uses_prefix_match:
            chain, tokens = self._chain(routable)
            matches = await self._match(chain, candidates)
            self.metrics.index_lookups_by("hit" if any(matches.values()) else "miss").inc()
        view = self._request_view(routable, chain, tokens)
        self.metrics.prompt_tokens_by(routable.model).inc(view.prompt_tokens)

        upstream = self.config.upstream
        deadline = started + upstream.retry_deadline_s
        failures: list[str] = []
        for attempt in range(upstream.max_attempts):
            remaining = deadline - time.perf_counter()
            if attempt:
                # Backends ejected meanwhile (perhaps by this very request's failures) are out.
                candidates = [b for b in candidates if b.routable]
            if not candidates or remaining <= 0:
                break
            by_name = {b.name: b for b in candidates}
            views = [b.view(matches.get(b.name, 0), self.index.blocks_of(b.name)) for b in candidates]
            decision = self.policy.choose(view, views)
            backend = by_name[decision.backend]
            if attempt:
                self.metrics.retries.inc()
            else:
                self.metrics.decision_time.observe(time.perf_counter() - started)
            first_byte_timeout = min(upstream.first_byte_timeout_s, remaining)
            if self.precise is not None and chain:
                # Precise mode believes a pick at once (provisionally, until the engine's events
                # say), so that a burst of requests sharing a prefix follows the first one.
                self.precise.record(backend.name, chain)
            try:
                return await self._forward(
                    request, routable, view, backend, decision, started, first_byte_timeout
                )
            except UpstreamFailed as exc:
                if self.precise is not None and chain:
                    self.precise.withdraw(backend.name, chain)
                self.metrics.upstream_errors.labels(backend.name, exc.kind).inc()
                log.warning(
                    "backend %s failed before responding (%s); %s",
                    backend.name,
                    exc,
                    "retrying" if attempt + 1 < upstream.max_attempts else "giving up",
                )
                failures.append(f"{backend.name}: {exc.kind}")
                candidates = [b for b in candidates if b is not backend]
        if time.perf_counter() >= deadline:
            raise OpenAIError(
                504,
                f"No backend sent a first byte within {upstream.retry_deadline_s:g} s "
                f"({'; '.join(failures) or 'no attempt'}).",
                code="upstream_timeout",
            )
        raise OpenAIError(
            502,
            f"No backend could serve the request ({'; '.join(failures) or 'no candidates left'}).",
            code="upstream_unavailable",
        )

    async def _forward(
        self,
        request: web.Request,
        routable: RoutableRequest,
        view: RequestView,
        backend: Backend,
        decision: Decision,
        started: float,
        first_byte_timeout: float,
    ) -> web.StreamResponse:
        chain, prompt_tokens = view.chain, view.prompt_tokens
        policy_name = self.policy.name or type(self.policy).__name__
        self.metrics.decisions_by(policy_name, decision.reason).inc()
        self.metrics.matched_tokens_by(routable.model).inc(decision.matched_blocks * self.block_tokens)
        log.debug(
            "route model=%s backend=%s reason=%s matched_blocks=%d of %d",
            routable.model,
            backend.name,
            decision.reason,
            decision.matched_blocks,
            len(chain),
        )
        # x-kvroute-matched-tokens: the prompt tokens the index believed cached there (its
        # prediction, to hold against the engine's usage.prompt_tokens_details.cached_tokens).
        headers = {
            "x-kvroute-backend": backend.name,
            "x-kvroute-reason": decision.reason,
            "x-kvroute-matched-tokens": str(decision.matched_blocks * self.block_tokens),
        }

        def accepted() -> None:
            if chain:
                self.index.record(backend.name, chain)
                if self.precise is not None:
                    self.precise.used(backend.name, chain)

        pending = PendingPrefill(backend, prompt_tokens - decision.matched_blocks * self.block_tokens)
        check = None
        if self.closed_loop is not None and chain:
            check = BeliefCheck(
                self.closed_loop, backend.name, chain, decision.matched_blocks, prompt_tokens, routable.body,
                routable.stream,
            )  # fmt: skip

        def first_byte(at: float) -> None:
            pending.release()
            self.metrics.ttft_by(routable.endpoint).observe(at - started)

        status = CLIENT_CLOSED
        backend.in_flight += 1
        in_flight_gauge = self.metrics.in_flight.labels(backend.name)
        in_flight_gauge.inc()
        circuit = backend.circuit
        trial = circuit.begin()
        try:
            response = await self.proxy.forward(
                request,
                backend.url,
                check.body if check is not None else routable.body,
                headers,
                accepted,
                first_byte,
                first_byte_timeout=first_byte_timeout,
                tap=check.tap if check is not None else None,
                rewrite_headers=upstream_headers(backend.config.upstream_api_key, TENANT in request),
            )
            status = str(response.status)
            if check is not None:
                check.settle()
            if response.status >= 500:
                circuit.record_failure()
            else:
                circuit.record_success()
            return response
        except UpstreamFailed:
            status = "upstream_error"
            circuit.record_failure()
            raise
        except StreamInterrupted as exc:
            self.metrics.upstream_errors.labels(backend.name, exc.kind).inc()
            status = "stream_error"
            circuit.record_failure()
            return exc.response
        except ClientGone as exc:
            return exc.response
        finally:
            pending.release()
            circuit.end(trial)
            backend.in_flight -= 1
            in_flight_gauge.dec()
            self.metrics.requests_by(routable.endpoint, routable.model, backend.name, status).inc()
            self.metrics.latency_by(routable.endpoint).observe(time.perf_counter() - started)
