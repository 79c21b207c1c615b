"""The fleet as the router sees it: each backend's models, health and in-flight requests."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from policies.types import BackendView
from router.config import BackendConfig


class Backend:
    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url.rstrip("/")
        #: Configured models, or those last read from the backend's ``/v1/models``.
        self.models: frozenset[str] = frozenset(config.models or ())
        #: Out of rotation until its first successful check (done before the router listens).
        self.healthy = False
        self.consecutive_failures = 0
        #: Requests this router has sent there and not yet finished (released on every path).
        self.in_flight = 0

    def record_failure(self, unhealthy_after: int) -> None:
        """A failed check or request: after ``unhealthy_after`` in a row it leaves rotation."""
        self.consecutive_failures += 1
        if self.consecutive_failures >= unhealthy_after:
            self.healthy = False

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.healthy = True

    @property
    def discovers_models(self) -> bool:
        return self.config.models is None

    def view(self, matched_blocks: int, cached_blocks: int) -> BackendView:
        return BackendView(
            name=self.name,
            matched_blocks=matched_blocks,
            in_flight=self.in_flight,
            cached_blocks=cached_blocks,
        )


class BackendPool:
    def __init__(self, configs: Iterable[BackendConfig]) -> None:
        self._backends = {c.name: Backend(c) for c in configs}

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._backends.values())

    def __getitem__(self, name: str) -> Backend:
        return self._backends[name]

    def serving(self, model: str) -> list[Backend]:
        """Every backend that serves ``model``, healthy or not."""
        return [b for b in self._backends.values() if model in b.models]

    def models(self) -> list[str]:
        return sorted({m for b in self._backends.values() for m in b.models})

    def any_healthy(self) -> bool:
        return any(b.healthy and b.models for b in self._backends.values())
