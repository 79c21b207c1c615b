"""Prefix hashing: a prompt becomes a chain of block hashes.

Block *i*'s hash is xxh3_64 of block *i* seeded with block *i-1*'s hash, so equal hashes at
position *i* mean equal prefixes up to and including block *i*. The first seed is derived
from (tenant, model): two tenants never produce the same chain for the same prompt, so one
cannot probe, by timing, whether another's prompt is cached.

Blocks are cut from the UTF-8 bytes of the prompt as the engine sees it ("character mode":
no tokenizer needed). Only full blocks are hashed: engines cache full KV blocks only.
"""

from __future__ import annotations

from functools import lru_cache

import xxhash


@lru_cache(maxsize=4096)
def chain_seed(tenant: str, model: str) -> int:
    """The chain's starting seed for one tenant and model (cached: few distinct pairs)."""
    return xxhash.xxh3_64_intdigest(f"kvroute\x00{tenant}\x00{model}".encode())


class PrefixHasher:
    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size

    def chain(self, prompt: bytes, seed: int) -> list[int]:
        """Hashes of every full block of ``prompt``; slices are memoryviews, never copies."""
        size = self.block_size
        view = memoryview(prompt)
        digest = xxhash.xxh3_64_intdigest
        hashes: list[int] = []
        h = seed
        for start in range(0, len(prompt) - size + 1, size):
            h = digest(view[start : start + size], seed=h)
            hashes.append(h)
        return hashes
