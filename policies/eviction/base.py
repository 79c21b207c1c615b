"""The interface of one backend's believed cache: a bounded set of block hashes.

The router cannot see inside an engine's KV cache (unless it consumes KV events), so it
keeps a model of it: a capacity in blocks and a policy for what the engine drops first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class BlockSet(ABC):
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...

    @abstractmethod
    def touch_chain(self, chain: Sequence[int]) -> list[int]:
        """Insert or refresh a chain's blocks; return the blocks evicted to stay in capacity.

        A chain's first blocks are shared by every longer prompt, so they must outlive its
        last blocks: implementations rank block 0 as the most valuable.
        """

    @abstractmethod
    def discard(self, block: int) -> bool:
        """Forget one block; True when it was held."""

    @abstractmethod
    def evict_one(self) -> int | None:
        """Drop and return the least valuable block (for a global budget), or None when empty."""

    @abstractmethod
    def rank(self, block: int) -> Any:
        """Where ``block`` stands in eviction order now (None when not held): a value that
        orders blocks, lower evicted first, and stays valid until the block is touched again."""

    @abstractmethod
    def drop_through(self, rank: Any) -> list[int]:
        """Drop and return every block ranked at or below ``rank``.

        Closed-loop beliefs: when an engine no longer holds a block, it has dropped everything
        its eviction order put before that block too.
        """

    def expire(self) -> list[int]:
        """Drop and return the blocks that time alone has made stale; none unless time-based."""
        return []
