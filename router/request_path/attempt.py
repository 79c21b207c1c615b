"""One attempt: one try of one request on one backend, and every ledger it holds meanwhile.

An attempt takes its ledgers when it is created and gives each back exactly once when it
ends, on every path (served, failed before the first byte and retried, stream broken, client
gone, task cancelled, an unexpected exception), because its ``with`` block ends on all of them:

* the backend's **in-flight count** (what policies read as load, and /metrics shows);
* the circuit breaker's **half-open trial**, if this attempt is it, and one verdict: a 5xx, a
  connection error or a timeout is the backend's failure, any other answer (4xx included) a
  success, a client that left neither (router/fleet/circuit.py);
* its share of the backend's **pending prefill**: the prompt tokens the backend was not
  believed to hold, work standing in front of any prefill sent there next until this one's
  first byte comes back. The router knows it exactly and at once for its own requests, where
  an engine's scraped queue lags by a scrape and counts requests, not tokens; the ``cost``
  policy reads it as ``BackendView.pending_prefill_tokens``. A non-streamed response has no
  first byte before its end, so its share is held until it ends: an overestimate, never a leak;
* the index's **belief lifecycle** for the prompt's chain (router/index/base.py): picked at
  creation, then accepted, first byte, failed, finished as they happen;
* with ``index.closed_loop``, the **belief check**: the prediction, and the engine's cached
  tokens read from the response (router/request_path/beliefs.py);
* its **metrics**: requests by status, latency, time to first token, upstream errors;
* the **outcome** told to a policy that learns (``RoutingPolicy.on_outcome``);
* the request's **context** (router/request_path/context.py): backend, reason, time to first
  token and the engine's cached tokens, for the access log; with tracing, its ``upstream``
  span, whose context the engine receives as ``traceparent``.

In prefill/decode disaggregation a request holds two attempts at once, one per engine of its
pair (router/request_path/disaggregated.py), each described by a :class:`PairSide`: the prefill
side holds the pending prefill, checks the beliefs against the prefill engine's report and
gives the request its cached tokens; the decode side answers the client, so it alone observes
the request's TTFT and latency.

The proxy (router/request_path/proxy.py) reports what happens: ``answered``, ``first_byte``,
then one of ``finished``, ``interrupted`` or ``client_gone``. A failure before the client got
a byte leaves the proxy as UpstreamFailed, which ``__exit__`` books as ``failed`` (the
dispatcher then retries); anything else that ends the block without a report is booked as a
client that left (nginx's 499), the same as a cancelled handler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import TracebackType

from policies.routing.base import RoutingPolicy
from policies.types import Decision, Outcome, RequestView
from router.fleet.backends import Backend
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.request_path.beliefs import BeliefCheck, ClosedLoop
from router.request_path.context import REQUEST_ID_HEADER, RequestContext
from router.request_path.endpoints import STREAM_USAGE_OPTION
from router.request_path.pick import POLICY_ERROR
from router.request_path.proxy import UpstreamFailed
from router.request_path.request import RoutableRequest
from router.request_path.usage import CachedTokensScan, ResponseTap

log = logging.getLogger("kvroute.dispatch")

#: Status label for attempts whose client disconnected (nginx's convention).
CLIENT_CLOSED = "499"


@dataclass(frozen=True, slots=True)
class PairSide:
    """How an attempt on one side of a prefill/decode pair differs from a whole request's (a
    warm-up, router/request_path/warmup.py, is a prefill side of its own)."""

    #: What this side's engine is sent (the protocol's fields added to the client's body).
    body: bytes
    #: The prefill side (else the decode side).
    prefill: bool
    #: Whether the index follows the chain on this side's engine (always for prefill; for decode
    #: when decode engines keep prefixes, ``disaggregation.decode_caches_prefixes``).
    follows_chain: bool


class AttemptBooks:
    """What every attempt of a dispatcher books into: metrics, the index, the closed loop, and
    the policy to tell outcomes to (None when the policy does not override ``on_outcome``, so
    that no outcome is built for it)."""

    __slots__ = ("block_tokens", "closed_loop", "index", "learner", "metrics")

    def __init__(
        self, metrics: RouterMetrics, index: PrefixIndex, block_tokens: int, closed_loop: ClosedLoop | None
    ) -> None:
        self.metrics = metrics
        self.index = index
        self.block_tokens = block_tokens
        self.closed_loop = closed_loop
        self.learner: RoutingPolicy | None = None

    def follow(self, policy: RoutingPolicy) -> None:
        """Tell outcomes to ``policy`` from now on, if it listens."""
        self.learner = policy if policy.learns else None


class Attempt:
    """One try of ``routable`` on ``backend``; use as ``with Attempt(...) as attempt:``."""

    __slots__ = (
        "_books",
        "_cached",
        "_chain",
        "_check",
        "_client_facing",
        "_context",
        "_error",
        "_index",
        "_label",
        "_learner",
        "_matched_tokens",
        "_prefill",
        "_prefilling",
        "_reports_cache",
        "_routable",
        "_scan",
        "_sent",
        "_span",
        "_started",
        "_status",
        "_trial",
        "_ttft",
        "_view",
        "backend",
        "body",
        "first_byte_timeout",
        "headers",
        "tap",
        "tls",
        "upstream_headers",
        "upstream_key",
        "url",
    )

    def __init__(
        self,
        books: AttemptBooks,
        routable: RoutableRequest,
        view: RequestView,
        backend: Backend,
        decision: Decision,
        context: RequestContext,
        first_byte_timeout: float,
        learns: bool = True,
        side: PairSide | None = None,
    ) -> None:
        """``learns``: tell the policy how this attempt ended (False when the policy did not
        choose it: an endpoint balanced by load, router/request_path/endpoints.py; nor a pair's
        decode side, chosen by the decode policy; nor a ``policy_error``'s, chosen by least_load).
        ``side``: one side of a prefill/decode pair."""
        name = backend.name
        started = context.started
        chain = view.chain
        matched_tokens = decision.matched_blocks * books.block_tokens
        body, stream, pending = routable.body, routable.stream, view.prompt_tokens - matched_tokens
        self._client_facing = self._reports_cache = True
        if side is not None:
            body, stream = side.body, stream and not side.prefill
            if not side.follows_chain:
                chain = ()
            if not side.prefill:
                pending = 0
                learns = False
            self._client_facing, self._reports_cache = not side.prefill, side.prefill
        self._books = books
        self._routable = routable
        self._view = view
        self._started = started
        self._matched_tokens = matched_tokens
        # A policy that failed to choose (router/request_path/pick.py) did not choose this one.
        self._learner = books.learner if learns and decision.reason != POLICY_ERROR else None
        self._context = context
        #: When this attempt was sent, for the outcome's time to first token: a backend that
        #: took over after a failed attempt is not charged that attempt's wait. (The TTFT
        #: metric measures the whole request, from ``started``.) Read only for a learner.
        self._sent = time.perf_counter() if self._learner is not None else started
        self._label: str | None = None
        self._error: str | None = None
        self._status: int | None = None
        self._ttft: float | None = None
        self._cached: int | None = None
        self.backend = backend
        self.url = backend.url
        self.tls = backend.tls
        self.upstream_key = backend.config.upstream_api_key
        self.first_byte_timeout = first_byte_timeout
        # x-kvroute-matched-tokens: the prompt tokens the index believed cached there (its
        # prediction, to hold against the engine's usage.prompt_tokens_details.cached_tokens).
        self.headers = {
            "x-kvroute-backend": name,
            "x-kvroute-reason": decision.reason,
            "x-kvroute-matched-tokens": str(matched_tokens),
            REQUEST_ID_HEADER: context.id,
        }
        context.attempts += 1
        context.backend, context.reason, context.matched_tokens = name, decision.reason, matched_tokens
        trace = context.trace
        self._span = trace.attempt(name, backend.url, context.attempts) if trace is not None else None
        self.upstream_headers = (
            context.upstream_headers if self._span is None else self._span.headers(context.upstream_headers)
        )
        # Beliefs are about a chain: a prompt without one (a policy that does not match
        # prefixes, a prompt shorter than a block) has none to follow.
        self._chain = chain
        self._index = books.index if chain else None
        if self._index is not None:
            self._index.picked(name, chain)
        check = None
        if books.closed_loop is not None and chain and (side is None or side.prefill):
            check = BeliefCheck(
                books.closed_loop, name, chain, decision.matched_blocks, view.prompt_tokens, body,
                stream and routable.endpoint in STREAM_USAGE_OPTION,
            )  # fmt: skip
        self._check = check
        self.body = check.body if check is not None else body
        # Without the closed loop's tap, the access log still wants the engine's cached tokens.
        self._scan = CachedTokensScan() if check is None and context.wants_usage else None
        self.tap: ResponseTap | None = check.tap if check is not None else self._scan
        backend.in_flight += 1
        self._trial = backend.circuit.begin()
        self._prefill = max(0, pending)
        # The decode side of a prefill/decode pair runs no prefill: it joins the batch at once.
        self._prefilling = side is None or side.prefill
        backend.pending_prefill_tokens += self._prefill
        backend.pending_prefill_requests += self._prefilling

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._label is None:
            if isinstance(exc, UpstreamFailed):
                self.failed(exc.kind)
            elif exc is not None:
                self.client_gone()
        self._end()

    # -- what the proxy reports ----------------------------------------------------------------

    def answered(self, status: int) -> None:
        """The engine's response head (and its first body bytes) came back, about to go to the
        client; a success status means the engine has taken the prompt."""
        self._status = status
        if status < 400 and self._index is not None:
            self._index.accepted(self.backend.name, self._chain)

    def first_byte(self, at: float) -> None:
        """A stream's first byte came back at ``at`` (``time.perf_counter``): the prefill is done."""
        self._release_prefill()
        self._ttft = at - self._sent
        if self._client_facing:
            self._context.ttft = at - self._started
            routable = self._routable
            self._books.metrics.ttft_by(routable.endpoint, routable.model).observe(at - self._started)
        if self._index is not None:
            self._index.first_byte(self.backend.name, self._chain)

    def finished(self, status: int) -> None:
        """The engine's answer, whatever its ``status``, reached the client whole."""
        self._label = str(status)
        if self._check is not None:
            self._cached = self._check.settle()
        if status >= 500:
            self.backend.circuit.record_failure()
        else:
            self.backend.circuit.record_success()

    def interrupted(self, kind: str) -> None:
        """The stream broke after the client got bytes; it was ended with an error event."""
        self._label = self._error = "stream_error"
        self._books.metrics.upstream_errors.labels(self.backend.name, kind).inc()
        self.backend.circuit.record_failure()

    def client_gone(self) -> None:
        """The client left (or its handler was cancelled): not the backend's doing, no verdict."""
        self._label = CLIENT_CLOSED
        self._error = "client_gone"
        self._context.status = int(CLIENT_CLOSED)

    # -- what the dispatcher's ``with`` books --------------------------------------------------

    def failed(self, kind: str) -> None:
        """The backend failed before the client got a byte (the request may be retried elsewhere)."""
        self._label = "upstream_error"
        self._error = kind
        self._status = None
        if self._index is not None:
            self._index.failed(self.backend.name, self._chain)
        self._books.metrics.upstream_errors.labels(self.backend.name, kind).inc()
        self.backend.circuit.record_failure()

    def abandoned(self) -> None:
        """The other engine of this attempt's prefill/decode pair failed: this one is let go
        with no verdict on its backend (the request may be retried with a new pair)."""
        self._label = "abandoned"
        self._error = "pair_failed"
        self._status = None
        if self._index is not None:
            self._index.failed(self.backend.name, self._chain)

    def _release_prefill(self) -> None:
        if self._prefilling:
            self.backend.pending_prefill_tokens -= self._prefill
            self.backend.pending_prefill_requests -= 1
            self._prefill, self._prefilling = 0, False

    def _end(self) -> None:
        """Give every ledger back, once, after the verdict above was booked."""
        backend, routable, metrics = self.backend, self._routable, self._books.metrics
        self._release_prefill()
        backend.circuit.end(self._trial)
        backend.in_flight -= 1
        label = self._label or CLIENT_CLOSED
        if self._scan is not None:
            self._cached = self._scan.cached
        if self._reports_cache:
            self._context.cached_tokens = self._cached
        if self._span is not None:
            self._span.end(self._status, self._error)
        metrics.requests_by(routable.endpoint, routable.model, backend.name, label).inc()
        if self._client_facing:
            metrics.latency_by(routable.endpoint, routable.model).observe(time.perf_counter() - self._started)
        if self._index is not None:
            self._index.finished(backend.name, self._chain)
        if self._learner is not None:
            self._tell(self._learner)

    def _tell(self, learner: RoutingPolicy) -> None:
        outcome = Outcome(
            backend=self.backend.name,
            request=self._view,
            matched_tokens=self._matched_tokens,
            cached_tokens=self._cached,
            ttft_s=self._ttft,
            status=self._status,
            error=self._error,
        )
        try:
            learner.on_outcome(outcome)
        except Exception:
            # A policy's bug must not fail a request that was served, nor skip its books.
            log.exception("policy %s failed in on_outcome", type(learner).__name__)
