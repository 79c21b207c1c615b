"""Stable 64-bit hashes for hash-based placement (session affinity, the consistent-hash ring).

Python's ``hash()`` of a string changes per process; these do not, so every router replica,
and every restart, places the same key on the same backend.
"""

from __future__ import annotations

import xxhash

_MASK64 = (1 << 64) - 1


def key_hash(key: str | int, salt: str = "") -> int:
    """xxh3-64 of ``key`` (a string, or an integer such as a block hash) under ``salt``."""
    data = key.encode() if isinstance(key, str) else (key & _MASK64).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(data, seed=xxhash.xxh3_64_intdigest(salt.encode()))
