"""Session affinity: every request of a session to the same backend, without a session table.

The session key is the configured header (``routing.session_header``) or the body's ``user``
field. The backend is chosen by rendezvous (highest-random-weight) hashing: each candidate
scores ``hash(session, backend)`` and the highest wins. Compared with a table of sessions:
no memory that grows with traffic, every router replica and every restart agrees without
sharing state, and when a backend leaves only its own sessions move (to their second-best
backend), coming back when it returns. A request without a session key goes to the least
loaded backend (ties at random).

Affinity ignores load on purpose: a session's cache lives where it was placed. For affinity
that yields under load, use ``consistent_hash`` (which keys on the session when there is one).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import RoutingPolicy
from policies.routing.stable_hash import key_hash
from policies.types import BackendView, Decision, RequestView


class SessionAffinity(RoutingPolicy):
    name = "session_affinity"

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        session = request.session_key
        if session is None:
            chosen = self.pick_min(backends, lambda b: b.load)
            return Decision(chosen.name, "no_session_least_load", chosen.matched_blocks)
        chosen = max(backends, key=lambda b: key_hash(b.name, salt=session))
        return Decision(chosen.name, "session", chosen.matched_blocks)
