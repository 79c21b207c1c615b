"""The interface of one backend's believed cache: a bounded set of block hashes.

The router cannot see inside an engine's KV cache (unless it consumes KV events), so it
keeps a model of it: a capacity in blocks and a policy for what the engine drops first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


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
