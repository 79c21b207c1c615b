"""Warm-ups: a prefix copied to an engine ahead of need, beside the request that asked for it.

A policy that would send a request to an engine holding none of a long prefix another engine
holds (``latency``'s spill of a hot document) can instead send the request to a holder and
ask, in its decision (``Decision.warmup``), for the copy to be made in the background: the
router sends the spill target the request's leading part — the fewest whole messages of a
chat, or the fewest characters of a completion's text, whose block chain starts with the
prefix — with ``max_tokens`` 1 and no stream. The next request that spills there finds the
prefix cached instead of waiting for its prefill.

A warm-up is an attempt like any other (router/request_path/attempt.py): the target's
in-flight count and pending prefill (the part of the prefix it is not believed to hold: all
of a policy's copy, none of a refresh) hold it, so the policy sees the copy under way; the index
believes the prefix there from the pick and withdraws the belief if it fails; it counts in
``kvroute_requests_total`` under its backend, as the engine served it. It has a context of
its own (no access-log line, no effect on the client's), is never retried, never tells a
learning policy an outcome, and never delays or fails the request that asked for it. At most
one warm-up per backend and prefix, and ``MAX_IN_FLIGHT`` in all, are in flight; the rest are
skipped (the refreshes of router/request_path/retention.py have their own, larger limit).
``kvroute_warmups_total`` counts them by outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import orjson

from policies.types import Decision, RequestView, Warmup
from router.fleet.backends import Backend
from router.metrics import RouterMetrics
from router.request_path.attempt import Attempt, AttemptBooks, PairSide
from router.request_path.context import REQUEST_ID_HEADER, RequestContext
from router.request_path.endpoints import CHAT, COMPLETIONS
from router.request_path.keying import Keyer
from router.request_path.prompts import chat_prompt
from router.request_path.proxy import Outgoing, Proxy, UpstreamFailed
from router.request_path.request import RoutableRequest

log = logging.getLogger("kvroute.warmup")

#: Warm-ups in flight at most, over all backends: a copy is worth making ahead only while the
#: fleet has room for it.
MAX_IN_FLIGHT = 4
#: Fields of the client's body a warm-up drops: it answers one token, unstreamed, once.
_DROPPED = ("stream_options", "max_completion_tokens", "n", "best_of", "logprobs", "top_logprobs")


def cuttable(routable: RoutableRequest) -> bool:
    """Whether :func:`leading_part` can cut the request: a chat, or a completion of one text."""
    if routable.endpoint == CHAT:
        return isinstance(routable.document.get("messages"), list)
    return routable.endpoint == COMPLETIONS and isinstance(routable.document.get("prompt"), str)


def leading_part(routable: RoutableRequest, keyer: Keyer, wanted: list[int]) -> RoutableRequest | None:
    """The request cut to the fewest whole messages (chat) or characters (a completion's text
    prompt) whose chain starts with ``wanted``, the first blocks of the request's own chain;
    None where it cannot be cut so (other endpoints, a prompt of token ids or several prompts)."""
    if not cuttable(routable):
        return None
    document = routable.document
    blocks = len(wanted)
    if routable.endpoint == CHAT:
        messages: list[Any] = document["messages"]

        def cut(n: int) -> RoutableRequest:
            part = {**document, "messages": messages[:n]}
            return replace(routable, document=part, prompt=chat_prompt(part))

        size = len(messages)
    else:
        text: str = document["prompt"]

        def cut(n: int) -> RoutableRequest:
            part = {**document, "prompt": text[:n]}
            return replace(routable, document=part, prompt=text[:n].encode())

        size = len(text)
    low, high = 1, size  # the whole request covers the prefix; find the fewest units that do
    while low < high:
        middle = (low + high) // 2
        if keyer.chain(cut(middle))[0][:blocks] == wanted:
            high = middle
        else:
            low = middle + 1
    return cut(low)


def warmup_body(part: RoutableRequest) -> bytes:
    body: dict[str, Any] = {k: v for k, v in part.document.items() if k not in _DROPPED}
    body["max_tokens"] = 1
    body["stream"] = False
    return orjson.dumps(body)


@dataclass(slots=True)
class InFlight:
    """Which warm-ups of one kind may start: one per backend and prefix (named by its last
    block) in flight, ``limit`` in all; the rest are skipped. kvroute simulate applies the same."""

    limit: int
    #: (backend, the prefix's last block) of those in flight.
    pending: set[tuple[str, int]] = field(default_factory=set)

    def take(self, backend: str, last_block: int) -> tuple[str, int] | None:
        """The warm-up's place, held until :meth:`release`; None: skip it."""
        key = (backend, last_block)
        if key in self.pending or len(self.pending) >= self.limit:
            return None
        self.pending.add(key)
        return key

    def release(self, key: tuple[str, int]) -> None:
        self.pending.discard(key)


@dataclass(frozen=True, slots=True)
class _Job:
    """One warm-up to send: the request that asked for it, and where and how much to copy."""

    request: Outgoing
    routable: RoutableRequest
    view: RequestView
    target: Backend
    warmup: Warmup
    context: RequestContext
    timeout: float


class Warmups:
    """The warm-ups of one dispatcher, started beside requests and cancelled at shutdown."""

    def __init__(
        self,
        books: AttemptBooks,
        proxy: Proxy,
        metrics: RouterMetrics,
        keyer: Keyer,
        in_flight: int = MAX_IN_FLIGHT,
        suffix: str = "warmup",
    ) -> None:
        self.books = books
        self.proxy = proxy
        self.metrics = metrics
        self.keyer = keyer
        self._tasks: set[asyncio.Task[str]] = set()
        self._in_flight = InFlight(in_flight)
        #: Appended to the id of the request it stems from: its own request id upstream.
        self.suffix = suffix

    def start(
        self,
        request: Outgoing,
        routable: RoutableRequest,
        view: RequestView,
        target: Backend,
        warmup: Warmup,
        context: RequestContext,
        timeout: float,
    ) -> bool:
        """Send the warm-up in the background (True), or count it skipped (False)."""
        fits = 0 < warmup.blocks <= len(view.chain)
        key = self._in_flight.take(target.name, view.chain[warmup.blocks - 1]) if fits else None
        if key is None:
            self.metrics.warmups.labels(target.name, "skipped").inc()
            return False
        job = _Job(request, routable, view, target, warmup, context, timeout)
        task = asyncio.create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(partial(self._booked, target.name, key))
        return True

    def _booked(self, backend: str, key: tuple[str, int], task: asyncio.Task[str]) -> None:
        """Count the warm-up's outcome once and free its prefix, however its task ended
        (here and not in the task: a task cancelled before its first step runs none of it)."""
        self._tasks.discard(task)
        self._in_flight.release(key)
        outcome = "failed" if task.cancelled() else task.result()
        self.metrics.warmups.labels(backend, outcome).inc()

    async def _run(self, job: _Job) -> str:
        """Send ``job``; its outcome, with every failure logged and counted as ``failed``."""
        try:
            return await self._send(job)
        except UpstreamFailed as exc:
            log.info("warm-up of %d blocks on %s failed: %s", job.warmup.blocks, job.target.name, exc)
        except Exception:
            log.exception("warm-up on %s failed", job.target.name)
        return "failed"

    async def _send(self, job: _Job) -> str:
        """The warm-up's outcome: ok, failed (the engine refused it), or skipped (no cut, or the
        target left rotation, e.g. another request took its half-open trial, since the pick)."""
        if not job.target.routable:
            return "skipped"
        view, target, blocks = job.view, job.target, job.warmup.blocks
        prefix = view.chain[:blocks]  # start() made sure the chain holds that many
        # Cutting the prompt hashes (or tokenizes) it a few times: in this task, once the
        # request itself is on its way.
        part = leading_part(job.routable, self.keyer, prefix)
        if part is None:
            return "skipped"
        warm_view = replace(
            view, chain=prefix, prompt_tokens=blocks * view.block_tokens, block_count=blocks, max_tokens=1
        )
        # Its own request id upstream too: engines log (and abort) requests by that header.
        own_id = f"{job.context.id}-{self.suffix}"
        headers = {**job.context.upstream_headers, REQUEST_ID_HEADER: own_id}
        own = RequestContext(own_id, time.perf_counter(), headers)
        side = PairSide(warmup_body(part), prefill=True, follows_chain=True)
        # What the target is believed to hold already is not pending prefill there: none of the
        # prefix for a policy's copy, all of it for a refresh. Counted as wholly uncached, each
        # refresh in flight stood for its whole prefix (~10k tokens on the Mooncake trace) of
        # work in front of the engine that holds it, and ``latency`` steered that engine's next
        # turns elsewhere. As kvroute simulate does, the index says which.
        held = (await self.books.index.match(prefix, [target.name])).get(target.name, 0)
        decision = Decision(target.name, "warmup", min(held, blocks))
        with Attempt(self.books, part, warm_view, target, decision, own, job.timeout, False, side) as attempt:
            status, _ = await self.proxy.fetch(job.request, attempt)
            if status >= 400:
                # Refused: the engine did not take the prefix, whatever the status.
                self.books.index.failed(target.name, prefix)
        return "ok" if status < 400 else "failed"

    async def close(self) -> None:
        """Cancel the warm-ups in flight (at shutdown): nobody waits for them."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
