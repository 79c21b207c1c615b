"""The prefix index interface, shared by the in-memory, Redis and precise (KV events) indexes.

Besides lookups, an index follows each request attempt through one belief lifecycle, driven
by the attempt (router/request_path/attempt.py) for a prompt with a block chain:

    picked -> accepted -> first_byte -> finished        (the engine served it)
    picked -> failed -> finished                        (it failed before taking the prompt)
    picked -> accepted -> failed -> finished            (a non-streamed answer broke before
                                                          any byte of it reached the client)

``picked``: a policy chose ``backend`` for ``chain``; ``accepted``: the engine answered with a
success status, so it has the prompt; ``first_byte``: a stream's first byte came back (the
prefill is done); ``failed``: the attempt failed before the engine took the prompt (the request
may go elsewhere); ``finished``: the attempt ended, on any path. Every hook does nothing by
default; each index implements the ones its beliefs need, so a new index plugs in without a
branch on the request path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class Candidate(Protocol):
    """What a lookup knows of a candidate backend (a router/fleet Backend is one)."""

    @property
    def name(self) -> str: ...

    @property
    def pending_prefill_tokens(self) -> int: ...


class PrefixIndex(ABC):
    async def start(self) -> None:  # noqa: B027 -- optional hook; the memory index needs none
        """Connect and start background work, once the event loop runs (a remote index's writer)."""

    def belief_rank(self, backend: str, block: int) -> Any:
        """Where ``block`` stands in ``backend``'s believed eviction order (None: not held, or
        an index that cannot correct its beliefs). Closed-loop beliefs (router/request_path/beliefs.py)."""
        return None

    def forget_through(self, backend: str, rank: Any) -> int:
        """The engine lost the block that ranked at ``rank``: drop ``backend``'s beliefs ranked at
        or below it, and believe it holds no more than what remains; return how many were dropped."""
        return 0

    def regrow(self, backend: str, blocks: int) -> None:  # noqa: B027 -- see belief_rank
        """The engine confirmed ``blocks`` believed blocks: let a lowered capacity grow back by as many."""

    @abstractmethod
    def add_backend(self, name: str, capacity_blocks: int) -> None:
        """Start tracking a backend with a believed capacity."""

    @abstractmethod
    def set_capacity(self, name: str, capacity_blocks: int) -> None:
        """Re-size ``name``'s believed capacity, once its engine reported its real KV cache size
        (router/fleet/capacity.py). Shrinking evicts at once, by the eviction policy; an index whose
        entries the engine bounds itself (precise mode) only records the number."""

    @abstractmethod
    def capacity_of(self, name: str) -> int | None:
        """The capacity bounding ``name``'s beliefs now, in blocks (None: not tracked)."""

    @abstractmethod
    def remove_backend(self, name: str) -> None:
        """Forget a backend and everything it was believed to hold."""

    @abstractmethod
    async def match(self, chain: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """For each of ``backends``, how many leading blocks of ``chain`` it holds.

        One call per request and one round trip for a remote index; the cost grows with the
        chain's length, never with how much the index holds.
        """

    async def match_for(self, chain: Sequence[int], candidates: Sequence[Candidate]) -> dict[str, int]:
        """:meth:`match` for the request path, which knows more of each candidate than its name
        (the prefill queued there ahead of the request, which precise mode's eviction ahead reads)."""
        return await self.match(chain, [c.name for c in candidates])

    def picked(self, backend: str, chain: Sequence[int]) -> None:  # noqa: B027 -- lifecycle hook
        """A policy chose ``backend`` for ``chain``; the request is about to be sent."""

    def accepted(self, backend: str, chain: Sequence[int]) -> None:  # noqa: B027 -- lifecycle hook
        """``backend``'s engine answered with a success status: it has taken the prompt."""

    def first_byte(self, backend: str, chain: Sequence[int]) -> None:  # noqa: B027 -- lifecycle hook
        """A stream's first byte came back from ``backend``: its engine has prefilled the prompt."""

    def failed(self, backend: str, chain: Sequence[int]) -> None:  # noqa: B027 -- lifecycle hook
        """The attempt on ``backend`` failed before its engine took the prompt."""

    def finished(self, backend: str, chain: Sequence[int]) -> None:  # noqa: B027 -- lifecycle hook
        """The attempt on ``backend`` ended, on any path (after the hooks above that applied)."""

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
