"""Redis: building a client for any topology, and the breaker every call goes through.

The shared index lives in :mod:`router.index.redis_store`; the shared load view in
:mod:`router.fleet.shared_load`.
"""
