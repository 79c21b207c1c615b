"""SGLang's ``/metrics`` (needs ``--enable-metrics``): queue, batch, KV usage, pool size.

Scheduler gauges carry ``model_name`` and ``engine_type``, from 0.5.3 ``tp_rank`` and
``pp_rank``, from 0.5.9 ``moe_ep_rank``, and ``dp_rank`` under data parallelism; ``dp_rank``
tells the independent schedulers apart.

* ``sglang:num_queue_reqs`` (waiting), ``sglang:num_running_reqs`` (gauges, all versions).
* ``sglang:token_usage``: share of the KV pool in use.
* ``sglang:max_total_num_tokens``: the pool's size in tokens (since 0.5.6). Older servers
  publish only ``sglang:num_used_tokens``; with usage above zero the size is their ratio.
* ``sglang:page_size``: tokens per KV page (recent versions; SGLang's default is 1).
"""

from __future__ import annotations

from router.fleet.engines.base import EngineAdapter, EngineStats, Samples, as_count, averaged, summed

WAITING = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"
TOKEN_USAGE = "sglang:token_usage"
MAX_TOKENS = "sglang:max_total_num_tokens"
USED_TOKENS = "sglang:num_used_tokens"
PAGE_SIZE = "sglang:page_size"


class SGLangAdapter(EngineAdapter):
    families = frozenset({WAITING, RUNNING, TOKEN_USAGE, MAX_TOKENS, USED_TOKENS, PAGE_SIZE})
    scheduler_label = "dp_rank"

    def stats(self, samples: Samples) -> EngineStats:
        scheduler_label = self.scheduler_label
        usage = averaged(samples, TOKEN_USAGE, scheduler_label)
        capacity = summed(samples, MAX_TOKENS, scheduler_label)
        if capacity is None and usage:
            used = summed(samples, USED_TOKENS, scheduler_label)
            capacity = used / usage if used is not None else None
        page = averaged(samples, PAGE_SIZE, scheduler_label)
        return EngineStats(
            waiting=as_count(summed(samples, WAITING, scheduler_label)),
            running=as_count(summed(samples, RUNNING, scheduler_label)),
            kv_usage=usage,
            capacity_tokens=as_count(capacity) or None,
            block_tokens=as_count(page) or None,
        )
