"""The request path after parsing: hash, match, choose, forward (retrying), record.

    RoutableRequest -> hasher.chain -> index.match -> policy.choose -> proxy.forward -> engine
                                                                          |
                            index.record(backend, chain)  <-- on accept --+

Every request reaches exactly one engine or fails with a clear error, and each backend's
in-flight count is released on every path (success, upstream error, client disconnect).
"""

from __future__ import annotations

import logging
import math
import time

from aiohttp import web

from policies.routing.base import RoutingPolicy
from policies.types import Decision, RequestView
from router.backends import Backend, BackendPool
from router.config import Config
from router.errors import OpenAIError
from router.hashing import PrefixHasher, chain_seed
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.proxy import ClientGone, Proxy, StreamInterrupted, UpstreamFailed
from router.request import RoutableRequest

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

    def _candidates(self, model: str) -> list[Backend]:
        serving = self.pool.serving(model)
        if not serving:
            raise OpenAIError(
                404,
                f"The model '{model}' does not exist or is not served by any backend.",
                param="model",
                code="model_not_found",
            )
        healthy = [b for b in serving if b.healthy]
        if not healthy:
            raise OpenAIError(
                503,
                f"No healthy backend serves the model '{model}' right now.",
                code="no_healthy_backend",
                retry_after=max(1, math.ceil(self.config.health.interval_s)),
            )
        return healthy

    def _request_view(self, routable: RoutableRequest, chain: list[int]) -> RequestView:
        return RequestView(
            model=routable.model,
            tenant=routable.tenant,
            session_key=routable.session_key,
            prompt_tokens=math.ceil(len(routable.prompt) / self.config.index.chars_per_token),
            block_count=len(chain) if chain else len(routable.prompt) // self.config.index.block_size,
            block_tokens=self.block_tokens,
            max_tokens=routable.max_tokens,
            stream=routable.stream,
        )

    async def dispatch(self, request: web.Request, routable: RoutableRequest) -> web.StreamResponse:
        started = time.perf_counter()
        candidates = self._candidates(routable.model)
        chain: list[int] = []
        matches: dict[str, int] = {}
        if self.policy.uses_prefix_match:
            chain = self.hasher.chain(routable.prompt, chain_seed(routable.tenant, routable.model))
            matches = await self.index.match(chain, [b.name for b in candidates])
        view = self._request_view(routable, chain)
        self.metrics.prompt_tokens.labels(routable.model).inc(view.prompt_tokens)

        failures: list[str] = []
        for attempt in range(self.config.upstream.max_attempts):
            if not candidates:
                break
            views = [b.view(matches.get(b.name, 0), self.index.blocks_of(b.name)) for b in candidates]
            decision = self.policy.choose(view, views)
            backend = self.pool[decision.backend]
            if attempt:
                self.metrics.retries.inc()
            try:
                return await self._forward(request, routable, backend, decision, chain, started)
            except UpstreamFailed as exc:
                backend.record_failure(self.config.health.unhealthy_after)
                self.metrics.upstream_errors.labels(backend.name, exc.kind).inc()
                log.warning(
                    "backend %s failed before responding (%s); %s",
                    backend.name,
                    exc,
                    "retrying" if attempt + 1 < self.config.upstream.max_attempts else "giving up",
                )
                failures.append(f"{backend.name}: {exc.kind}")
                candidates = [b for b in candidates if b is not backend]
        raise OpenAIError(
            502,
            f"No backend could serve the request ({'; '.join(failures) or 'no candidates left'}).",
            code="upstream_unavailable",
        )

    async def _forward(
        self,
        request: web.Request,
        routable: RoutableRequest,
        backend: Backend,
        decision: Decision,
        chain: list[int],
        started: float,
    ) -> web.StreamResponse:
        policy_name = self.policy.name or type(self.policy).__name__
        self.metrics.decisions.labels(policy_name, decision.reason).inc()
        self.metrics.matched_tokens.labels(routable.model).inc(decision.matched_blocks * self.block_tokens)
        log.debug(
            "route model=%s backend=%s reason=%s matched_blocks=%d of %d",
            routable.model,
            backend.name,
            decision.reason,
            decision.matched_blocks,
            len(chain),
        )
        headers = {"x-kvroute-backend": backend.name, "x-kvroute-reason": decision.reason}
        url = backend.url + request.path

        def accepted() -> None:
            backend.record_success()
            if chain:
                self.index.record(backend.name, chain)

        def first_byte(at: float) -> None:
            self.metrics.ttft.labels(routable.endpoint).observe(at - started)

        status = CLIENT_CLOSED
        backend.in_flight += 1
        in_flight_gauge = self.metrics.in_flight.labels(backend.name)
        in_flight_gauge.inc()
        try:
            response = await self.proxy.forward(request, url, routable.body, headers, accepted, first_byte)
            status = str(response.status)
            return response
        except UpstreamFailed:
            status = "upstream_error"
            raise
        except StreamInterrupted as exc:
            self.metrics.upstream_errors.labels(backend.name, exc.kind).inc()
            status = "stream_error"
            return exc.response
        except ClientGone as exc:
            return exc.response
        finally:
            backend.in_flight -= 1
            in_flight_gauge.dec()
            self.metrics.requests.labels(routable.endpoint, routable.model, backend.name, status).inc()
            self.metrics.latency.labels(routable.endpoint).observe(time.perf_counter() - started)
