"""The prefix index: which backends are believed to hold which block chains, keyed how.

:func:`~router.index.build.build_index` builds the one index a config asks for.
"""

from router.exports import lazy_exports

_EXPORTS = {
    "PrefixIndex": "base",
    "Candidate": "base",
    "MemoryIndex": "memory",
    "PreciseIndex": "precise",
    "RedisIndex": "redis_store",
    "SyncedIndex": "redis_sync",
    "build_index": "build",
    "PrefixHasher": "keys",
    "chain_seed": "keys",
    "block_keys": "keys",
    "BlockStored": "events",
    "BlockRemoved": "events",
    "AllBlocksCleared": "events",
    "EventBatch": "events",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
