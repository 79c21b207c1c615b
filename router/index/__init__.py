"""The prefix index: which backends are believed to hold which block chains."""

from router.index.base import PrefixIndex
from router.index.memory import MemoryIndex

__all__ = ["MemoryIndex", "PrefixIndex"]
