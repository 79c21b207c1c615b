"""Eviction policies: which of a backend's believed blocks the engine has probably dropped."""

from policies.eviction.base import BlockSet
from policies.eviction.lru import LRUBlocks

POLICIES: dict[str, type[BlockSet]] = {"lru": LRUBlocks}

__all__ = ["POLICIES", "BlockSet", "LRUBlocks"]
