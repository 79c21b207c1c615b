"""``GET /metrics`` of a simulated engine, with vLLM's metric names and labels.

Each engine has its own ``CollectorRegistry`` (many engines share one process). Counters and
gauges are read from the scheduler and cache at scrape time, so the scheduler keeps plain integers
and ``/metrics`` and ``/sim/stats`` can never disagree; only the TTFT histogram is observed as
requests go.

Exposed (vLLM 0.33.0 names; a counter ``vllm:x`` is exposed as ``vllm:x_total`` plus
``vllm:x_created``, a histogram as ``_bucket``/``_sum``/``_count``):

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges)
* ``vllm:kv_cache_usage_perc`` (gauge, 0-1): KV blocks reserved by running requests over
  ``kv_blocks``. Blocks cached for finished requests do not count: in vLLM they sit in the free
  queue (reusable until evicted), and vLLM's usage is ``1 - free / total``.
* ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits`` (counters, in tokens)
* ``vllm:prompt_tokens``, ``vllm:generation_tokens`` (counters)
* ``vllm:request_success`` (counter, extra label ``finished_reason``; always ``length`` here)
* ``vllm:time_to_first_token_seconds`` (histogram, vLLM's buckets)
* ``vllm:cache_config_info`` (gauge = 1; labels ``block_size``, ``num_gpu_blocks``,
  ``enable_prefix_caching`` as strings, and ``engine``, like vLLM's ``log_metrics_info``)

Labels are ``model_name`` (the first served name, as vLLM labels with ``served_model_name[0]``)
and ``engine`` (vLLM's data-parallel engine index: always ``"0"``, one engine per server).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from loadtest.sim.protocol import FINISH_REASON
from loadtest.sim.scheduler import Scheduler

#: The classic text format: what vLLM serves to Prometheus scrapers, and what routers parse.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_LABELS = ["model_name", "engine"]
_ENGINE_INDEX = "0"
#: vLLM's buckets for ``time_to_first_token_seconds``.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class _SchedulerCollector:
    """Reads counters and gauges from the scheduler at scrape time."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self._scheduler = scheduler
        self._labels = [model_name, _ENGINE_INDEX]
        self._created = time.time()

    def collect(self) -> Iterator[Metric]:
        s = self._scheduler
        timing = s.timing
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", s.running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.reserved_blocks / timing.kv_blocks,
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.cache.queries_tokens,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.cache.hits_tokens,
        )
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        success.add_metric([*self._labels, FINISH_REASON], s.completed, created=self._created)
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"],
        )
        info.add_metric([str(timing.block_tokens), "True", str(timing.kv_blocks), _ENGINE_INDEX], 1)
        yield info

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, documentation, labels=_LABELS)
        gauge.add_metric(self._labels, value)
        return gauge

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        counter = CounterMetricFamily(name, documentation, labels=_LABELS)
        counter.add_metric(self._labels, value, created=self._created)
        return counter


class EngineMetrics:
    """The Prometheus registry of one engine."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(scheduler, model_name))
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _LABELS,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name, _ENGINE_INDEX)

    def observe_ttft(self, seconds: float) -> None:
        """Record one request's time to first token."""
        self._ttft.observe(seconds)

    def render(self) -> bytes:
        """The exposition text, for ``CONTENT_TYPE``."""
        return generate_latest(self.registry)
