"""The simulated engine keeps its model's timeline when its event loop is late: engines share
one loop in a live run, and a GPU's time does not wait for its server's Python."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

from loadtest.sim.cache import PrefixCache
from loadtest.sim.scheduler import Scheduler
from loadtest.sim.timing import EngineTiming
from tests.helpers import wait_for

#: Prefills of ~20 ms each, so that the loop's stalls below fall inside them.
TIMING = EngineTiming(prefill_base_s=0.001, prefill_per_token_s=0.00001, decode_step_s=0.002)


async def busy_loop(stall_s: float) -> None:
    """Hold the event loop for ``stall_s`` at a time, as a request's parsing on a busy engine does."""
    while True:
        time.sleep(stall_s)
        await asyncio.sleep(0)


async def test_prefills_queued_together_run_back_to_back_on_the_models_clock_while_the_loop_is_late():
    scheduler = Scheduler(TIMING, PrefixCache(TIMING.kv_blocks, TIMING.block_tokens, TIMING.chars_per_token))
    engine = asyncio.create_task(scheduler.run())
    stalls = asyncio.create_task(busy_loop(0.003))
    requests = [
        scheduler.submit(
            request_id=str(i), model="m", prompt_tokens=2000, hashes=[i], max_tokens=3, stream=False
        )
        for i in range(6)
    ]
    try:
        await wait_for(lambda: all(r.first_token_at for r in requests), what="every first token")
    finally:
        for task in (engine, stalls):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    for previous, request in itertools.pairwise(requests):
        # Each starts where the one before ended in the model, however late the loop woke.
        assert request.prefill_start == previous.prefill_start + previous.prefill_s
    assert requests[0].prefill_s > 0.015
