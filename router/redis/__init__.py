"""Redis: building a client for any topology, and the breaker every call goes through.

The shared index lives in :mod:`router.index.redis_store`; the shared load view in
:mod:`router.fleet.shared_load`.
"""

from router.exports import lazy_exports

_EXPORTS = {
    "build_client": "client",
    "RedisLink": "breaker",
    "RedisUnavailable": "breaker",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
