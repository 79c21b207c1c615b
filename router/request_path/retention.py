"""Refreshes: the router keeps the prefixes that come back cached on LRU engines by sending them again.

policies/retention.py decides which prefixes and when (a request's leading blocks that an
earlier request asked for too, refreshed once ``routing.retention.refresh_share`` of the
engine's turnover passed without a request for them). This module is its hands in the router:
the dispatcher tells it every pick (:meth:`Refresher.observe`), and a task sends the refreshes
due every ``CHECK_S``, each as a warm-up (router/request_path/warmup.py) of the prefix to the
engine that holds it: the request's leading part with ``max_tokens`` 1, on the client's path
with its headers (:class:`Replay`), so an engine that checks its callers sees the same ones.

A refresh goes only where the index still believes the whole prefix cached: anywhere else it
would be the prefix's whole prefill, so the prefix stops being kept instead. At most
``IN_FLIGHT`` refreshes are in flight (apart from the policy's warm-ups): each computes one
token, but waits in its engine's queue like any request, and a loaded fleet needs a refresh
for every other request or so (the policy's four would have let through a quarter of them, in
the first live run). One over the limit is skipped and falls due again a period later.
``kvroute_refreshes_total`` counts the refreshes started, ``kvroute_warmups_total`` how each
ended. What refreshes are worth: docs/benchmarks/2026-12-07-routing-at-head.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from policies.retention import Keeper
from policies.types import RequestView, Warmup
from router.fleet.backends import BackendPool
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.request_path.context import RequestContext
from router.request_path.proxy import Replay
from router.request_path.request import RoutableRequest
from router.request_path.settings import RetentionConfig
from router.request_path.warmup import Warmups, cuttable
from router.tasks import stop_task

log = logging.getLogger("kvroute.retention")

#: How often the refreshes due are looked for, in seconds: as kvroute simulate does. At tight
#: capacity an engine's turnover is a few seconds and a refresh is due after half of it, so
#: 0.5 s let a due prefix wait a tenth of its period (the Mooncake 20 min, 8 engines of 200k:
#: hit 7.0 % -> 7.2-7.3 %, TTFT 1.08x -> 1.02-1.04x the router without refreshes). Each check
#: walks every kept prefix: 1.5 ms per 10,000 (16 engines of a million tokens hold ~6,000
#: prefixes of 20 blocks; 62,000 of two blocks, the most, took 9.6 ms a check).
CHECK_S = 0.1
#: Refreshes in flight at most.
IN_FLIGHT = 64
#: Blocks the keeper remembers as asked for (to tell a prefix that comes back from one seen
#: once): about 50 MB at most, four times a fleet of eight engines of a million tokens in
#: blocks of 64.
SEEN_BLOCKS = 1 << 19


@dataclass(frozen=True, slots=True)
class _Resend:
    """What a refresh needs of the request that made its prefix kept."""

    replay: Replay
    routable: RoutableRequest
    view: RequestView
    request_id: str
    upstream_headers: dict[str, str]


class Refresher:
    def __init__(
        self,
        config: RetentionConfig,
        pool: BackendPool,
        index: PrefixIndex,
        warmups: Warmups,
        metrics: RouterMetrics,
        timeout_s: Callable[[], float],
    ) -> None:
        """``warmups`` sends the refreshes: its own, with an ``IN_FLIGHT`` limit; ``timeout_s()``
        is the first byte's timeout, asked at each refresh (a reload changes it)."""
        self.keeper = Keeper(config.refresh_share, config.kept_share, index.capacity_of, SEEN_BLOCKS)
        self.pool = pool
        self.index = index
        self.warmups = warmups
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stop looking for refreshes due, and cancel those in flight."""
        if self._task is not None:
            await stop_task(self._task)
        await self.warmups.close()

    def observe(
        self,
        request: web.Request,
        routable: RoutableRequest,
        view: RequestView,
        backend: str,
        cached_blocks: int,
        context: RequestContext,
    ) -> None:
        """A request went to ``backend``, believed to hold ``cached_blocks`` of its chain. Only a
        prompt a warm-up can cut to a prefix is kept: a chat's messages, a completion's text."""
        if not view.chain or not cuttable(routable):
            return

        def resend() -> _Resend:
            return _Resend(Replay.of(request), routable, view, context.id, context.upstream_headers)

        self.keeper.observe(backend, view.chain, cached_blocks, time.monotonic(), resend)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                await self._refresh()
            except Exception:
                log.exception("refreshing kept prefixes failed; trying again in %g s", CHECK_S)

    async def _refresh(self) -> None:
        """Send the refreshes due; forget the prefixes no longer wholly cached where kept."""
        for backend_name, prefix, payload in self.keeper.due(time.monotonic()):
            assert isinstance(payload, _Resend)
            try:
                backend = self.pool[backend_name]
            except KeyError:
                self.keeper.forget(backend_name, prefix)
                continue
            held = await self.index.match(prefix, [backend_name])
            if held.get(backend_name, 0) < len(prefix):
                self.keeper.forget(backend_name, prefix)
                continue
            if not backend.routable:
                continue  # out of rotation for now: due again a period later
            context = RequestContext(payload.request_id, time.perf_counter(), payload.upstream_headers)
            warmup = Warmup(backend_name, len(prefix))
            if self.warmups.start(
                payload.replay, payload.routable, payload.view, backend, warmup, context, self.timeout_s()
            ):
                self.metrics.refreshes.labels(backend_name).inc()
