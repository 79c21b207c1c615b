"""Sample the engines' queue depth while a benchmark runs, for the report's queue plot.

Engines export how many requests wait for admission: vLLM as ``vllm:num_requests_waiting``,
SGLang as ``sglang:num_queue_reqs`` (the simulated engines use vLLM's name). Only the
benchmark reads them here; routing uses its own load signals in ``router/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.results import QueueSample

#: Waiting-request gauges, by engine.
WAITING_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")


def queue_depth(metrics_text: str) -> float | None:
    """The waiting requests in a Prometheus exposition (summed over labels), or None if absent."""
    found = None
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in WAITING_METRICS:
                found = (found or 0.0) + sample.value
    return found


async def sample_queue_depth(
    urls: dict[str, str], interval: float, stop: asyncio.Event, started: float | None = None
) -> list[QueueSample]:
    """Poll ``{backend name: base URL}``'s ``/metrics`` every ``interval`` s until ``stop`` is set.

    Times are seconds since ``started`` (a ``time.monotonic()`` value; default: now). A backend
    that does not answer is skipped for that round: the sampler must never fail the benchmark.
    """
    origin = time.monotonic() if started is None else started
    samples: list[QueueSample] = []
    timeout = aiohttp.ClientTimeout(total=max(1.0, interval))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            for name, url in urls.items():
                try:
                    async with session.get(f"{url.rstrip('/')}/metrics") as response:
                        depth = queue_depth(await response.text())
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    continue
                if depth is not None:
                    samples.append(QueueSample(time.monotonic() - origin, name, depth))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
    return samples
