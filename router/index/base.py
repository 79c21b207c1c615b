"""The prefix index interface, shared by the in-memory and the Redis implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence


class PrefixIndex(ABC):
    @abstractmethod
    def add_backend(self, name: str, capacity_blocks: int) -> None:
        """Start tracking a backend with a believed capacity."""

    @abstractmethod
    def remove_backend(self, name: str) -> None:
        """Forget a backend and everything it was believed to hold."""

    @abstractmethod
    async def match(self, chain: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """For each of ``backends``, how many leading blocks of ``chain`` it holds.

        One call per request and one round trip for a remote index; the cost grows with the
        chain's length, never with how much the index holds.
        """

    @abstractmethod
    def record(self, backend: str, chain: Sequence[int]) -> None:
        """Believe that ``backend`` now holds ``chain``. Never blocks: remote stores queue it."""

    @abstractmethod
    def blocks_of(self, backend: str) -> int:
        """How many blocks ``backend`` is believed to hold."""

    @abstractmethod
    def size(self) -> int:
        """Total (backend, block) entries held: what the memory budget bounds."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections and flush queued writes."""
