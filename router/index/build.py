"""The one index a config asks for, built at start (restart-only: it defines what beliefs mean)."""

from __future__ import annotations

from policies.eviction import block_set_factory
from router.config import Config
from router.index.base import PrefixIndex
from router.index.memory import MemoryIndex
from router.index.precise import PreciseIndex
from router.index.redis_store import build_redis_index
from router.index.redis_sync import build_synced_index
from router.index.worker_index import WorkerIndex
from router.metrics import RouterMetrics


def build_index(config: Config, metrics: RouterMetrics, worker: bool = False) -> PrefixIndex:
    """``index.mode: events``: the precise index, fed by the engines' KV events (router/kv_events);
    else the memory index, wrapped by the Redis index with ``index.store: redis`` (the memory one
    is then its local mirror, its view while Redis is not there), or kept in step with the other
    replicas' over a Redis stream with ``index.redis.lookup: local``. A ``worker`` of ``serve
    --workers N`` with the memory store keeps the memory index in step with the other workers'
    (router/index/worker_index.py). Every configured backend is tracked from the start with its
    believed capacity."""
    index_config = config.index
    index: PrefixIndex
    if index_config.mode == "events":
        events = index_config.events
        index = PreciseIndex(
            events.block_size, events.medium_weights, events.provisional_ttl_s, index_config.max_blocks
        )
    else:
        block_sets = block_set_factory(index_config.eviction, ttl_s=index_config.ttl_s)
        if index_config.store == "redis" and index_config.redis.lookup == "local":
            index = build_synced_index(index_config, block_sets, metrics.registry)
        elif worker and index_config.store == "memory":
            index = WorkerIndex(index_config.max_blocks, block_sets)
        else:
            index = MemoryIndex(index_config.max_blocks, block_sets)
            if index_config.store == "redis":
                index = build_redis_index(index_config, index, metrics.registry)
    for backend in config.backends:
        index.add_backend(backend.name, backend.capacity_blocks or index_config.backend_capacity_blocks)
    return index
