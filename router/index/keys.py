"""Block keys: a prompt becomes a chain of block hashes, the index's one vocabulary.

Block *i*'s hash is xxh3_64 of block *i* seeded with block *i-1*'s hash, so equal hashes at
position *i* mean equal prefixes up to and including block *i*. The first seed is derived
from (tenant, model): two tenants never produce the same chain for the same prompt, so one
cannot probe, by timing, whether another's prompt is cached.

Blocks are cut from the UTF-8 bytes of the prompt as the engine sees it ("character mode":
no tokenizer needed). Only full blocks are hashed: engines cache full KV blocks only.

Token mode (precise routing) keys blocks of token ids the same way (:func:`block_keys`) from a
fixed root, so that engine KV events, mapped to these keys as they arrive
(:mod:`router.index.precise`), and requests tokenized by the router meet.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
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
        """Hashes of every full block of ``prompt``, chained from ``seed``."""
        return _chained(memoryview(prompt), self.block_size, seed)


def _chained(data: memoryview, step: int, seed: int) -> list[int]:
    """xxh3-64 of every full ``step``-byte block of ``data``, each seeded with the one before
    (the first with ``seed``): equal keys at position *i* mean equal data up to block *i*.
    Slices of a memoryview are views, never copies."""
    digest = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    key = seed
    for start in range(0, len(data) - step + 1, step):
        key = digest(data[start : start + step], seed=key)
        keys.append(key)
    return keys


#: Seed of the first block's key. Blocks keyed by more than tokens (a LoRA adapter, a salt) are
#: seeded from their namespace instead, so a plain request never matches them.
ROOT_KEY = xxhash.xxh3_64_intdigest(b"kvroute-token-blocks")


def namespace_seed(parent_key: int, namespace: str | None) -> int:
    """The seed the next block's key chains from: the parent's key, moved by a namespace."""
    if namespace is None:
        return parent_key
    return xxhash.xxh3_64_intdigest(namespace.encode(), seed=parent_key)


def block_keys(token_ids: Sequence[int], block_size: int, seed: int = ROOT_KEY) -> list[int]:
    """Chained keys of the full ``block_size``-token blocks of ``token_ids``, chained from ``seed``."""
    return _chained(memoryview(array("q", token_ids).tobytes()), block_size * 8, seed)
