"""Prefill/decode disaggregation: each request served by a pair, a prefill engine and a decode engine.

A model whose healthy backends include ``role: prefill`` or ``role: decode`` ones is served
by pairs (the dispatcher branches here only then: a co-located fleet never pays for it)::

    prefill pool (prefill, both) --routing policy, prefix matches------> prefill engine --+
    decode pool  (decode, both)  --decode policy, load and KV usage--> decode engine  <--+
                                      handoff: SGLang bootstrap | vLLM kv_transfer_params

The prefix cache that saves prefill lives on the prefill engines, so the prefill side is
chosen by the configured routing policy over the index's matches there; the index learns
from the prefill side (its accepted requests, its KV events in precise mode, its reported
cached tokens in closed loop). The decode side is chosen by ``disaggregation.decode_routing``
(``decode_balance`` by default), which sees the decode engines' matches too when they keep
prefixes (``disaggregation.decode_caches_prefixes``). Each side is an Attempt of its own, so
every ledger (in-flight, pending prefill, circuit trial, beliefs, limits held by the request)
counts on both engines and is given back on every path.

Failures, before the client got a byte, retry the pair with the failed engine left out, within
``upstream.max_attempts`` pairs and ``upstream.retry_deadline_s``: a prefill engine that cannot
be reached or answers 502/503/504 is replaced by another prefill engine; a decode engine that
fails so is replaced too, and the pair is prefilled again (the KV went to the failed one). A
prefill engine's own error answer (a 4xx, a 500) goes to the client as it is, as a co-located
engine's would. After the first byte a broken decode stream ends with the SSE error event, as
for any stream.

Responses carry both choices: ``x-kvroute-prefill-backend``/``-reason``,
``x-kvroute-decode-backend``/``-reason``, ``x-kvroute-matched-tokens`` (the prefill side's
prediction), and ``x-kvroute-backend``/``-reason`` as for every request (the decode engine,
whose answer the client reads, and the prefill side's reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import orjson
from aiohttp import web

from policies.routing.base import RoutingPolicy
from policies.types import Decision, RequestView
from router.config import Config
from router.errors import OpenAIError
from router.fleet.backends import Backend
from router.metrics import RouterMetrics
from router.request_path.attempt import Attempt, AttemptBooks, PairSide
from router.request_path.context import REQUEST_ID_HEADER, RequestContext
from router.request_path.handoff import Handoff, SGLangHandoff, VllmHandoff, transfer_params
from router.request_path.pick import Picker
from router.request_path.proxy import Proxy, UpstreamFailed
from router.request_path.request import RoutableRequest
from router.request_path.usage import PrefillUsage, cached_tokens

log = logging.getLogger("kvroute.dispatch")

PREFILL = "prefill"
DECODE = "decode"


class PairFailed(Exception):
    """One side of a pair failed before the client got a byte; both attempts are booked."""

    def __init__(self, side: str, backend: Backend, kind: str) -> None:
        super().__init__(f"{side} {backend.name}: {kind}")
        self.side = side
        self.backend = backend
        self.kind = kind


def is_role_split(candidates: Sequence[Backend]) -> bool:
    """Whether these backends of one model are served by pairs."""
    return any(b.role != "both" for b in candidates)


class Pairs:
    """Chooses pairs and runs the handoff; the dispatcher hands it the requests of role-split models."""

    def __init__(self, books: AttemptBooks, proxy: Proxy, metrics: RouterMetrics, picker: Picker) -> None:
        self.books = books
        self.proxy = proxy
        self.metrics = metrics
        #: Asks each side's policy for its pick (router/request_path/pick.py).
        self.picker = picker

    async def dispatch(
        self,
        request: web.Request,
        routable: RoutableRequest,
        view: RequestView,
        candidates: list[Backend],
        matches: dict[str, int],
        context: RequestContext,
        config: Config,
        policy: RoutingPolicy,
        decode_policy: RoutingPolicy,
    ) -> web.StreamResponse:
        """Try pairs until one answers, within the attempts and the deadline."""
        prefills = [b for b in candidates if b.role != DECODE]
        decodes = [b for b in candidates if b.role != PREFILL]
        upstream = config.upstream
        started = context.started
        deadline = started + upstream.retry_deadline_s
        failures: list[str] = []
        for number in range(upstream.max_attempts):
            remaining = deadline - time.perf_counter()
            if number:
                # Backends ejected meanwhile (perhaps by this very request's failures) are out.
                prefills = [b for b in prefills if b.routable]
                decodes = [b for b in decodes if b.routable]
                if not prefills or not decodes:
                    break
            if remaining <= 0:
                break
            prefill, prefill_decision = self._choose(PREFILL, policy, view, prefills, matches)
            # The handoff is the prefill engine's protocol: its decode engine speaks the same.
            kind = prefill.config.engine
            partners = [b for b in decodes if b is not prefill and b.config.engine == kind]
            if not partners and any(b.config.engine != kind for b in decodes):
                raise OpenAIError(
                    503,
                    f"No decode backend speaks the handoff of prefill backend {prefill.name} ({kind}) "
                    f"for the model '{view.model}'.",
                    code="no_healthy_backend",
                    retry_after=1,
                )
            decode, decode_decision = self._choose(DECODE, decode_policy, view, partners, matches)
            if number:
                self.metrics.retries.inc()
            else:
                self.metrics.decision_time_by(routable.model).observe(time.perf_counter() - started)
            timeout = min(upstream.first_byte_timeout_s, remaining)
            pair = _Pair(self, request, routable, view, context, timeout, config)
            try:
                return await pair.run(prefill, prefill_decision, decode, decode_decision)
            except PairFailed as exc:
                log.warning(
                    "%s backend %s failed before responding (%s); %s",
                    exc.side,
                    exc.backend.name,
                    exc.kind,
                    "retrying the pair" if number + 1 < upstream.max_attempts else "giving up",
                )
                self.metrics.pair_retries.labels(exc.side).inc()
                failures.append(f"{exc.side} {exc.backend.name}: {exc.kind}")
                if exc.side == PREFILL:
                    prefills = [b for b in prefills if b is not exc.backend]
                else:
                    decodes = [b for b in decodes if b is not exc.backend]
        if time.perf_counter() >= deadline:
            raise OpenAIError(
                504,
                f"No prefill/decode pair sent a first byte within {upstream.retry_deadline_s:g} s "
                f"({'; '.join(failures) or 'no attempt'}).",
                code="upstream_timeout",
            )
        raise OpenAIError(
            502,
            f"No prefill/decode pair could serve the request ({'; '.join(failures)}).",
            code="upstream_unavailable",
        )

    def _choose(
        self,
        side: str,
        policy: RoutingPolicy,
        view: RequestView,
        candidates: list[Backend],
        matches: dict[str, int],
    ) -> tuple[Backend, Decision]:
        if not candidates:
            raise OpenAIError(
                503,
                f"No healthy {side} backend serves the model '{view.model}' right now.",
                code="no_healthy_backend",
                retry_after=1,
            )
        blocks_of = self.books.index.blocks_of
        views = [b.view(matches.get(b.name, 0), blocks_of(b.name)) for b in candidates]
        label = policy.name or type(policy).__name__
        backend, decision = self.picker.pick(policy, f"{side} {label}", view, candidates, views)
        self.metrics.pair_decisions_by(side, label, decision.reason).inc()
        if side == PREFILL:
            self.metrics.decisions_by(label, decision.reason).inc()
            self.metrics.matched_tokens_by(view.model).inc(decision.matched_blocks * view.block_tokens)
        return backend, decision


class _Pair:
    """One try of one request on one pair of engines."""

    def __init__(
        self,
        pairs: Pairs,
        request: web.Request,
        routable: RoutableRequest,
        view: RequestView,
        context: RequestContext,
        timeout: float,
        config: Config,
    ) -> None:
        self.pairs = pairs
        self.proxy = pairs.proxy
        self.request = request
        self.routable = routable
        self.view = view
        self.context = context
        self.timeout = timeout
        self.config = config
        #: The pair's x-kvroute-* response headers, and what the access log says of it (``run``).
        self.headers: dict[str, str] = {}
        self.story: tuple[str, str, int] = ("", "", 0)

    async def run(
        self, prefill: Backend, prefill_decision: Decision, decode: Backend, decode_decision: Decision
    ) -> web.StreamResponse:
        log.debug(
            "route pair model=%s prefill=%s (%s) decode=%s (%s) matched_blocks=%d of %d",
            self.view.model,
            prefill.name,
            prefill_decision.reason,
            decode.name,
            decode_decision.reason,
            prefill_decision.matched_blocks,
            len(self.view.chain),
        )
        matched_tokens = prefill_decision.matched_blocks * self.view.block_tokens
        self.headers = {
            "x-kvroute-backend": decode.name,
            "x-kvroute-reason": prefill_decision.reason,
            "x-kvroute-matched-tokens": str(matched_tokens),
            "x-kvroute-prefill-backend": prefill.name,
            "x-kvroute-prefill-reason": prefill_decision.reason,
            "x-kvroute-decode-backend": decode.name,
            "x-kvroute-decode-reason": decode_decision.reason,
            REQUEST_ID_HEADER: self.context.id,
        }
        self.story = (decode.name, prefill_decision.reason, matched_tokens)
        self.context.pair = (prefill.name, prefill_decision.reason, decode.name, decode_decision.reason)
        document = self.routable.document
        if prefill.config.engine == "sglang":
            handoff: Handoff = SGLangHandoff(document, prefill)
            return await self._concurrent(handoff, prefill, prefill_decision, decode, decode_decision)
        handoff = VllmHandoff(document, self.config.disaggregation.vllm_kv_transfer_params)
        return await self._sequential(handoff, prefill, prefill_decision, decode, decode_decision)

    def _attempt(self, backend: Backend, decision: Decision, side: PairSide) -> Attempt:
        books, context = self.pairs.books, self.context
        return Attempt(books, self.routable, self.view, backend, decision, context, self.timeout, side=side)

    def _decode_side(self, body: bytes) -> PairSide:
        return PairSide(body, prefill=False, follows_chain=self.config.disaggregation.decode_caches_prefixes)

    async def _concurrent(
        self,
        handoff: SGLangHandoff,
        prefill: Backend,
        prefill_decision: Decision,
        decode: Backend,
        decode_decision: Decision,
    ) -> web.StreamResponse:
        """SGLang: both engines at once; the prefill's answer is awaited before the decode's is relayed."""
        prefill_side = PairSide(handoff.prefill_body(), prefill=True, follows_chain=True)
        with (
            self._attempt(prefill, prefill_decision, prefill_side) as first,
            self._attempt(decode, decode_decision, self._decode_side(handoff.decode_body())) as second,
        ):
            fetching = asyncio.ensure_future(self.proxy.fetch(self.request, first))
            opening = asyncio.ensure_future(self.proxy.open(self.request, second))
            taken = False
            try:
                try:
                    status, data = await fetching
                except UpstreamFailed as exc:
                    first.failed(exc.kind)
                    second.abandoned()
                    raise PairFailed(PREFILL, prefill, exc.kind) from exc
                if status >= 400:
                    second.abandoned()
                    return await self._prefill_error(status, data)
                self._merge_usage(second, data)
                try:
                    upstream, chunk = await opening
                except UpstreamFailed as exc:
                    second.failed(exc.kind)
                    raise PairFailed(DECODE, decode, exc.kind) from exc
                taken = True
            finally:
                if not taken:
                    await _abandon(fetching, opening)
            return await self.proxy.relay(self.request, second, upstream, chunk)

    async def _sequential(
        self,
        handoff: VllmHandoff,
        prefill: Backend,
        prefill_decision: Decision,
        decode: Backend,
        decode_decision: Decision,
    ) -> web.StreamResponse:
        """vLLM: prefill first; then decode with the transfer params the prefill returned."""
        prefill_side = PairSide(handoff.prefill_body(), prefill=True, follows_chain=True)
        try:
            with self._attempt(prefill, prefill_decision, prefill_side) as first:
                status, data = await self.proxy.fetch(self.request, first)
        except UpstreamFailed as exc:
            raise PairFailed(PREFILL, prefill, exc.kind) from exc
        if status >= 400:
            return await self._prefill_error(status, data)
        reply = _json(data)
        if not transfer_params(reply):
            self.pairs.metrics.upstream_errors.labels(prefill.name, "protocol").inc()
            prefill.circuit.record_failure()
            raise PairFailed(PREFILL, prefill, "no kv_transfer_params in its answer")
        try:
            decode_side = self._decode_side(handoff.decode_body(reply))
            with self._attempt(decode, decode_decision, decode_side) as second:
                self._merge_usage(second, data)
                return await self.proxy.forward(self.request, second)
        except UpstreamFailed as exc:
            raise PairFailed(DECODE, decode, exc.kind) from exc

    def _merge_usage(self, decode: Attempt, prefill_answer: bytes) -> None:
        """The client's answer comes from the decode engine, with this pair's headers and the
        prefill engine's cached tokens in its usage; the access log tells the pair's story (each
        attempt wrote its own backend there)."""
        decode.headers = self.headers
        context = self.context
        context.backend, context.reason, context.matched_tokens = self.story
        cached = cached_tokens(_json(prefill_answer).get("usage"))
        if cached is not None:
            decode.tap = PrefillUsage(cached)

    async def _prefill_error(self, status: int, data: bytes) -> web.Response:
        """The prefill engine's own error answer, passed to the client as it is."""
        response = web.Response(
            status=status, body=data, content_type="application/json", headers=self.headers
        )
        with contextlib.suppress(ConnectionResetError):
            await response.prepare(self.request)
            await response.write_eof()
        return response


def _json(data: bytes) -> dict:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


async def _abandon(fetching: asyncio.Future[object], opening: asyncio.Future[object]) -> None:
    """A pair given up before its decode answer was relayed: cancel what still runs, close a
    decode response already opened (closing tells its engine to stop), retrieve every outcome."""
    for task in (fetching, opening):
        if not task.done():
            task.cancel()
    for task in (fetching, opening):
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await task
    if opening.done() and not opening.cancelled() and opening.exception() is None:
        upstream, _ = opening.result()  # type: ignore[misc]
        upstream.close()
