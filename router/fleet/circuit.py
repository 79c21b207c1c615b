"""Passive outlier ejection: a circuit breaker per backend, fed by real requests.

Active checks ask ``/health``, which an engine may answer while its request path fails
(out of KV memory, a wedged scheduler). The breaker watches what requests actually get:

* **closed**: in rotation. ``eject_after`` consecutive failures open it; one success in
  between resets the count, so isolated errors on a busy backend never eject it.
* **open**: out of rotation for ``open_s``; every failed re-admission doubles that, up to
  ``max_open_s``.
* **half-open**: after the wait, one trial request at a time may go there. Its success
  closes the circuit; its failure opens it again.

What counts is decided by the caller: connection errors, timeouts and 5xx are the backend's
failures; a 4xx is the client's fault and counts as a success (the backend answered). One
trial at a time is what keeps a recovering backend from being hit by a burst, and why a
retried request counts once per backend it failed on, never once per attempt overall.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class CircuitState(enum.IntEnum):
    """Lower-cased, the names are the ``state`` label of ``kvroute_backend_circuit_state``."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(
        self,
        eject_after: int,
        open_s: float,
        max_open_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.eject_after = eject_after
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self._clock = clock
        self.consecutive_failures = 0
        self._open_s = open_s
        self._opened_until = 0.0
        self._open = False
        self._trial_in_flight = False

    @property
    def state(self) -> CircuitState:
        if not self._open:
            return CircuitState.CLOSED
        if self._clock() < self._opened_until:
            return CircuitState.OPEN
        return CircuitState.HALF_OPEN

    def available(self) -> bool:
        """May a new request go there now? (Does not reserve the half-open trial.)"""
        state = self.state
        return state is CircuitState.CLOSED or (state is CircuitState.HALF_OPEN and not self._trial_in_flight)

    def begin(self) -> bool:
        """A request was sent there; True when it is the half-open trial (and reserves it)."""
        if self.state is CircuitState.HALF_OPEN:
            self._trial_in_flight = True
            return True
        return False

    def end(self, trial: bool) -> None:
        """A request ended (after its verdict, if any, was recorded): free the trial it held."""
        if trial:
            self._trial_in_flight = False

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self._open and self.state is CircuitState.HALF_OPEN:
            self._open = False
            self._open_s = self.base_open_s

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        state = self.state
        if state is CircuitState.HALF_OPEN:
            self._open_s = min(self._open_s * 2, self.max_open_s)
            self._trip()
        elif state is CircuitState.CLOSED and self.consecutive_failures >= self.eject_after:
            self._trip()

    def _trip(self) -> None:
        self._open = True
        self._opened_until = self._clock() + self._open_s
