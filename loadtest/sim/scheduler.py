"""Scheduling of one simulated engine: FIFO admission, one prefill lane, batched decode steps.

A request goes through these states::

    WAITING --admit--> QUEUED --lane free--> PREFILLING --> DECODING --> FINISHED
    WAITING --admit--> TRANSFERRING ------------------------> DECODING     (a decode engine's)
        any state before FINISHED --release--> CANCELLED

* **Admission** is FIFO. The head of the waiting queue is admitted when fewer than ``max_running``
  requests are running (admitted and not finished) *and* its KV reservation fits in the cache
  (``kv_blocks``). A request reserves the blocks of its prompt plus ``max_tokens`` outputs, as a
  vLLM scheduler must find blocks for a request before running it; a head that does not fit
  blocks the queue (no overtaking), like vLLM's FCFS policy.
* **Prefill** runs one request at a time, in admission order. At its start the prefix cache is
  looked up; it takes ``prefill_base_s + prefill_per_token_s * uncached_tokens``; at its end the
  prompt's blocks enter the cache and the first token is emitted.
* **Decode** is batched: one loop per engine sleeps one step (longer when the batch is larger),
  then every decoding request emits one token. CPU cost is one timer per engine per step, not
  one per request per token.

* **Transfer** (prefill/decode disaggregation) replaces the prefill of a request whose KV a
  prefill engine computed: once admitted (its KV reserved), the blocks this engine's own cache
  lacks cross the link (``EngineTiming.transfer_seconds``), without the prefill lane; then the
  prompt is in this engine's cache too and the first token is emitted.

**Time** is real (asyncio) time, so queueing delays and cache savings show up in measured
latency; each lane keeps the model's timeline, not the event loop's: a prefill queued while the
previous one ran starts at that one's modelled end, and a decode step at the last step's end,
however late the loop resumed. Eight engines share one loop, on a machine whose cores the
router and the client share too: timed from each resumption, every prefill and every step lost
the loop's lateness, and the fleet ran slower than its model (live TTFT 1.3x virtual time's on
the Mooncake hour at 10x), the more so the more requests the loop handled. A GPU's time does
not wait for its server's Python.
Released requests (the client went away) leave every queue at once; one interrupted mid-prefill
frees the lane at once too.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtest.sim.cache import PrefixCache
from loadtest.sim.timing import EngineTiming


class State(enum.Enum):
    """Where a request is in its life; see the module docstring."""

    WAITING = "waiting"
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class SimRequest:
    """One request inside the scheduler. Its HTTP handler waits on ``changed``.

    ``changed`` is set when the request finishes, and, for a stream, after every token, so a
    non-streamed request's handler wakes once.
    """

    id: str
    model: str
    prompt_tokens: int
    #: Chained block keys of the prompt (see :mod:`loadtest.sim.cache`).
    hashes: list[int]
    max_tokens: int
    stream: bool
    #: KV blocks reserved while running: prompt plus outputs, rounded up to whole blocks.
    kv_blocks: int
    arrival: float
    state: State = State.WAITING
    #: When it joined the prefill queue (admitted).
    queued_at: float = 0.0
    cached_tokens: int = 0
    generated: int = 0
    prefill_start: float = 0.0
    #: Prefill time charged by the cost model (deterministic, unlike measured latencies).
    prefill_s: float = 0.0
    first_token_at: float = 0.0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: The prompt's token ids, when the engine publishes KV events (they carry the tokens).
    token_ids: list[int] = field(default_factory=list)
    #: Its KV comes from a prefill engine: transferred instead of prefilled.
    transferred: bool = False


@dataclass(frozen=True)
class RequestRecord:
    """What a finished request cost; kept for the last ``history`` requests for tests and reports."""

    id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    #: Arrival to start of prefill (admission wait plus prefill-lane wait), measured.
    queue_s: float
    #: Prefill time charged by the cost model.
    prefill_s: float
    #: Arrival to first token, measured.
    ttft_s: float
    #: Arrival to last token, measured.
    e2e_s: float
    #: Whether it was streamed: tells a client's streamed request from a router's warm-up.
    stream: bool = False


def _settle(timer: asyncio.Future[None]) -> None:
    if not timer.done():
        timer.set_result(None)


class Scheduler:
    """The queues and the two loops of one engine; :meth:`run` drives it until cancelled.

    ``on_first_token`` is called with each request's time to first token (for the TTFT histogram).
    """

    def __init__(
        self,
        timing: EngineTiming,
        cache: PrefixCache,
        on_first_token: Callable[[float], None] | None = None,
        history: int = 1024,
    ) -> None:
        self.timing = timing
        self.cache = cache
        self._on_first_token = on_first_token
        self._waiting: deque[SimRequest] = deque()
        # Ordered sets (dicts), so iteration and thus output are deterministic.
        self._running: dict[SimRequest, None] = {}
        self._decoding: dict[SimRequest, None] = {}
        self._prefill_queue: deque[SimRequest] = deque()
        self._lane_wakeup = asyncio.Event()
        self._decode_wakeup = asyncio.Event()
        self._prefill_timer: asyncio.Future[None] | None = None
        self._transfers: dict[SimRequest, asyncio.TimerHandle] = {}
        #: KV blocks reserved by running requests.
        self.reserved_blocks = 0
        #: The most recent finished requests, oldest first.
        self.records: deque[RequestRecord] = deque(maxlen=history)
        self.received = 0
        self.completed = 0
        self.cancelled = 0
        #: Prompt and cache-hit tokens of requests whose prefill completed.
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        #: Prompt tokens received from prefill engines (a decode engine's).
        self.transferred_tokens = 0
        #: First tokens of streamed requests (clients'; routers' warm-ups are not streamed) and
        #: their summed TTFT here in microseconds: the engines' side of the clients' TTFT.
        self.streamed_first_tokens = 0
        self.streamed_ttft_us = 0

    @property
    def running(self) -> int:
        """Admitted requests not yet finished: queued for or in prefill, or decoding."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests not yet admitted."""
        return len(self._waiting)

    def submit(
        self,
        *,
        request_id: str,
        model: str,
        prompt_tokens: int,
        hashes: list[int],
        max_tokens: int,
        stream: bool,
        token_ids: list[int] | None = None,
        transferred: bool = False,
    ) -> SimRequest:
        """Enqueue a request; the caller must :meth:`release` it when its handler ends, on every path."""
        block_tokens = self.timing.block_tokens
        kv_blocks = -(-(prompt_tokens + max_tokens) // block_tokens)
        if kv_blocks > self.timing.kv_blocks:
            raise ValueError(f"request needs {kv_blocks} KV blocks, the engine has {self.timing.kv_blocks}")
        request = SimRequest(
            id=request_id,
            model=model,
            prompt_tokens=prompt_tokens,
            hashes=hashes,
            max_tokens=max_tokens,
            stream=stream,
            kv_blocks=kv_blocks,
            arrival=time.monotonic(),
            token_ids=token_ids or [],
            transferred=transferred,
        )
        self.received += 1
        self._waiting.append(request)
        self._admit()
        return request

    def release(self, request: SimRequest) -> None:
        """Drop a request that has not finished (its client went away); no-op once finished."""
        state = request.state
        if state in (State.FINISHED, State.CANCELLED):
            return
        if state is State.WAITING:
            self._waiting.remove(request)
        else:
            if state is State.QUEUED:
                self._prefill_queue.remove(request)
            elif state is State.TRANSFERRING:
                self._transfers.pop(request).cancel()
            elif state is State.PREFILLING and self._prefill_timer is not None:
                _settle(self._prefill_timer)
            self._decoding.pop(request, None)
            del self._running[request]
            self.reserved_blocks -= request.kv_blocks
        request.state = State.CANCELLED
        self.cancelled += 1
        self._admit()

    async def run(self) -> None:
        """Run the prefill lane and the decode loop until cancelled."""
        await asyncio.gather(self._prefill_lane(), self._decode_loop())

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.timing.max_running:
            head = self._waiting[0]
            if self.reserved_blocks + head.kv_blocks > self.timing.kv_blocks:
                return
            self._waiting.popleft()
            self._running[head] = None
            self.reserved_blocks += head.kv_blocks
            if head.transferred:
                self._transfer(head)
                continue
            head.state = State.QUEUED
            head.queued_at = time.monotonic()
            self._prefill_queue.append(head)
            self._lane_wakeup.set()

    def _transfer(self, request: SimRequest) -> None:
        """Receive the KV this engine's cache lacks; the prefill lane is not used."""
        request.state = State.TRANSFERRING
        request.prefill_start = time.monotonic()
        block_tokens = self.timing.block_tokens
        request.cached_tokens = self.cache.lookup(request.hashes, request.prompt_tokens) * block_tokens
        seconds = self.timing.transfer_seconds(request.prompt_tokens - request.cached_tokens)
        loop = asyncio.get_running_loop()
        self._transfers[request] = loop.call_later(seconds, self._transferred, request)

    def _transferred(self, request: SimRequest) -> None:
        del self._transfers[request]
        self.transferred_tokens += request.prompt_tokens - request.cached_tokens
        self._prefilled(request)

    async def _prefill_lane(self) -> None:
        loop = asyncio.get_running_loop()
        #: When the last prefill ended in the model's time (see the module's "Time").
        free_at = 0.0
        while True:
            if not self._prefill_queue:
                self._lane_wakeup.clear()
                await self._lane_wakeup.wait()
                continue
            request = self._prefill_queue.popleft()
            request.state = State.PREFILLING
            request.cached_tokens = self.cache.lookup(request.hashes, request.prompt_tokens) * (
                self.timing.block_tokens
            )
            request.prefill_start = max(free_at, request.queued_at)
            request.prefill_s = self.timing.prefill_seconds(request.prompt_tokens - request.cached_tokens)
            ends = request.prefill_start + request.prefill_s
            # A future rather than asyncio.sleep, so that release() can end the prefill early.
            timer = self._prefill_timer = loop.create_future()
            handle = loop.call_later(ends - time.monotonic(), _settle, timer)
            try:
                await timer
            finally:
                handle.cancel()
                self._prefill_timer = None
            if request.state is not State.PREFILLING:  # released meanwhile: the lane is free now
                free_at = time.monotonic()
                continue
            free_at = ends
            self._prefilled(request)

    def _prefilled(self, request: SimRequest) -> None:
        """The prompt's KV is here (prefilled or received): cache it, emit the first token."""
        self.cache.insert(request.hashes, request.token_ids)
        self.prompt_tokens += request.prompt_tokens
        self.cached_tokens += request.cached_tokens
        request.first_token_at = time.monotonic()
        ttft = request.first_token_at - request.arrival
        if request.stream:
            self.streamed_first_tokens += 1
            self.streamed_ttft_us += round(ttft * 1e6)
        if self._on_first_token is not None:
            self._on_first_token(ttft)
        request.state = State.DECODING
        self._emit(request)
        if request.state is State.DECODING:
            self._decoding[request] = None
            self._decode_wakeup.set()

    async def _decode_loop(self) -> None:
        #: When the step under way started in the model's time: the last one's end while the
        #: batch runs on, the moment it woke after an idle spell (see the module's "Time").
        starts: float | None = None
        while True:
            if not self._decoding:
                starts = None
                self._decode_wakeup.clear()
                await self._decode_wakeup.wait()
                continue
            if starts is None:
                starts = time.monotonic()
            ends = starts + self.timing.decode_step_seconds(len(self._decoding))
            await asyncio.sleep(ends - time.monotonic())
            for request in list(self._decoding):
                self._emit(request)
            starts = ends

    def _emit(self, request: SimRequest) -> None:
        """Produce one output token; finish the request after its last."""
        request.generated += 1
        self.generation_tokens += 1
        if request.generated >= request.max_tokens:
            self._finish(request)
        elif request.stream:
            request.changed.set()

    def _finish(self, request: SimRequest) -> None:
        now = time.monotonic()
        request.state = State.FINISHED
        self._decoding.pop(request, None)
        del self._running[request]
        self.reserved_blocks -= request.kv_blocks
        self.completed += 1
        self.records.append(
            RequestRecord(
                id=request.id,
                model=request.model,
                prompt_tokens=request.prompt_tokens,
                cached_tokens=request.cached_tokens,
                output_tokens=request.generated,
                queue_s=request.prefill_start - request.arrival,
                prefill_s=request.prefill_s,
                ttft_s=request.first_token_at - request.arrival,
                e2e_s=now - request.arrival,
                stream=request.stream,
            )
        )
        request.changed.set()
        self._admit()

    def stats(self) -> dict[str, int]:
        """Counters and current sizes, for ``GET /sim/stats`` and tests."""
        return {
            "received": self.received,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "running": self.running,
            "waiting": self.waiting,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generation_tokens": self.generation_tokens,
            "transferred_tokens": self.transferred_tokens,
            "streamed_first_tokens": self.streamed_first_tokens,
            "streamed_ttft_us": self.streamed_ttft_us,
            "kv_blocks_reserved": self.reserved_blocks,
            "cache_blocks": len(self.cache),
            "cache_evictions": self.cache.evictions,
            "prefix_cache_queries_tokens": self.cache.queries_tokens,
            "prefix_cache_hits_tokens": self.cache.hits_tokens,
        }
