"""Settings of precise mode's event streams: ``index.events`` and a backend's ``kv_events``.

They sit at the bottom of the wing and import nothing of ``router`` above them, so the index
(which weighs matches by storage tier) and the fleet (a backend's ``kv_events``) may use
them. Ranges are declared on the fields and checked by ``policies.params`` at load, with the
rest of the config.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from policies.params import PositiveFloat, PositiveInt

#: Storage tiers a match can be weighted by (the engines' medium names map onto them).
Tier = Literal["gpu", "cpu", "disk"]
TIERS: tuple[Tier, ...] = typing.get_args(Tier)
#: Worth of a matched block per tier: loading from CPU or disk is cheaper than recomputing, not free.
DEFAULT_MEDIUM_WEIGHTS: dict[Tier, float] = {"gpu": 1.0, "cpu": 0.5, "disk": 0.25}

Weight = Annotated[float, msgspec.Meta(ge=0, le=1)]
ZmqEndpoint = Annotated[
    str, msgspec.Meta(pattern=r"^(tcp|ipc)://", extra={"expected": "a tcp:// or ipc:// ZMQ endpoint"})
]


@dataclass(frozen=True)
class EventsConfig:
    """``index.events``: how engines' KV event streams feed the index."""

    #: Tokens per block in the engines' events: vLLM's ``--block-size`` (16 by default on GPUs;
    #: its CPU backend takes only multiples of 32), SGLang's ``--page-size`` (1 by default).
    #: Events of another size are counted and ignored.
    block_size: PositiveInt = 16
    #: How long a pick's blocks are believed held before the engine's events mention them. An
    #: event about a block (stored or removed) replaces the belief at once, so this only bounds
    #: beliefs whose events never come (a request cancelled or failed before its prefill); it
    #: must outlast the longest queueing plus prefill, or a busy engine's picks are forgotten.
    provisional_ttl_s: PositiveFloat = 30.0
    #: Worth of one matched block per storage tier (gpu, cpu, disk), against a GPU-resident one;
    #: tiers not given keep their default.
    medium_weights: dict[Tier, Weight] = field(default_factory=lambda: dict(DEFAULT_MEDIUM_WEIGHTS))
    #: Deadline for one replay (gap fill or resync) from an engine's replay socket.
    replay_timeout_s: PositiveFloat = 2.0
    #: For backends without ``kv_events`` in config: ask the engine where it publishes
    #: (vLLM ``GET /kv_event_sources``, SGLang ``GET /server_info``), retrying at this interval.
    discovery_interval_s: PositiveFloat = 5.0
    #: A stream not connected this long after the router started following it (or since it lost
    #: its connection) is reported: a warning, the ``not_connected`` kind of
    #: ``kvroute_kv_events_errors_total`` and ``kv_events: not_connected`` in ``/admin/backends``.
    #: Routing falls back to provisional beliefs meanwhile. The usual cause is an engine whose PUB socket
    #: connects instead of binding (vLLM binds only ``tcp://*:port``, ``ipc://`` and ``inproc://``).
    connect_grace_s: PositiveFloat = 10.0


@dataclass(frozen=True)
class EndpointConfig:
    """A backend's ``kv_events``: where its engine publishes (else it is discovered)."""

    #: The PUB socket, e.g. ``tcp://10.0.0.5:5557`` (the engine's ``endpoint`` with its host).
    endpoint: ZmqEndpoint
    #: The ROUTER socket serving replay; without it, gaps cannot be filled (they are counted).
    replay_endpoint: ZmqEndpoint | None = None
    topic: str = ""
    #: Data-parallel ranks: rank r publishes on the endpoint's port + r (and replay port + r).
    dp_size: PositiveInt = 1
