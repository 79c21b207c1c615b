"""vLLM's ``/metrics``: queue, batch, KV usage and cache geometry.

Names as vLLM defines them (``vllm/v1/metrics/loggers.py``), all labelled ``model_name`` and
``engine`` (the data-parallel engine index):

* ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` (gauges, since 0.9).
* ``vllm:kv_cache_usage_perc`` (gauge, a fraction despite its name, since 0.10); before it,
  ``vllm:gpu_cache_usage_perc``, which 0.10 deprecated, 0.11 hid and 0.12 removed.
* ``vllm:cache_config_info`` (gauge = 1): the CacheConfig's fields as string labels, among
  them ``block_size`` and ``num_gpu_blocks`` (``"None"`` until the engine has profiled memory).
"""

from __future__ import annotations

from router.fleet.engines.base import EngineAdapter, EngineStats, Samples, as_count, averaged, summed

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_BEFORE_0_12 = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        value = int(labels.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


class VLLMAdapter(EngineAdapter):
    families = frozenset({WAITING, RUNNING, KV_USAGE, KV_USAGE_BEFORE_0_12, CACHE_CONFIG})
    scheduler_label = "engine"

    def stats(self, samples: Samples) -> EngineStats:
        scheduler_label = self.scheduler_label
        kv_usage = averaged(samples, KV_USAGE, scheduler_label)
        if kv_usage is None:
            kv_usage = averaged(samples, KV_USAGE_BEFORE_0_12, scheduler_label)
        block_tokens, capacity = self._geometry(samples, scheduler_label)
        return EngineStats(
            waiting=as_count(summed(samples, WAITING, scheduler_label)),
            running=as_count(summed(samples, RUNNING, scheduler_label)),
            kv_usage=kv_usage,
            capacity_tokens=capacity,
            block_tokens=block_tokens,
        )

    @staticmethod
    def _geometry(samples: Samples, scheduler_label: str) -> tuple[int | None, int | None]:
        """Block size, and capacity in tokens summed over engines (each has its own cache)."""
        block_tokens: int | None = None
        blocks_by_engine: dict[str, int] = {}
        for labels, _ in samples.get(CACHE_CONFIG, ()):
            size = _int_label(labels, "block_size")
            block_tokens = size or block_tokens
            blocks = _int_label(labels, "num_gpu_blocks")
            if size is not None and blocks is not None:
                blocks_by_engine[labels.get(scheduler_label, "")] = blocks * size
        capacity = sum(blocks_by_engine.values()) if blocks_by_engine else None
        return block_tokens, capacity
