"""``index``: how prompts become block chains, where beliefs about them are kept, and how
they are corrected (eviction, closed loop, precise mode's events and tokenizer).

The section's type lives beside the index code, at the bottom of the wing: it imports
nothing of ``router`` but other wings' settings (``index.redis``, ``index.events``,
``index.tokenizer`` are typed sections of their own), so every wing may import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from policies.eviction import EvictionName
from policies.params import PositiveFloat, PositiveInt
from router.kv_events.settings import EventsConfig
from router.redis.settings import RedisConfig
from router.request_path.settings import TokenizerConfig


@dataclass(frozen=True)
class IndexConfig:
    """``index``: the prefix index (see README "How a request is routed")."""

    #: Where beliefs live: ``memory`` (this process; the workers of ``serve --workers N`` keep their
    #: copies in step over Unix sockets) or ``redis`` (shared by replicas on any host; ``index.redis``).
    store: Literal["memory", "redis"] = "memory"
    #: Block size of the prefix chain in characters (UTF-8 bytes) of the prompt as the engine sees it.
    block_size: PositiveInt = 256
    #: Characters per token, to turn matched blocks into estimated tokens for policies and metrics.
    chars_per_token: PositiveFloat = 4.0
    #: Default believed KV capacity of one backend, in blocks (LRU beyond it).
    backend_capacity_blocks: PositiveInt = 65536
    #: Global bound on (backend, block) entries over the whole index: the memory budget.
    max_blocks: PositiveInt = 2_000_000
    #: Connection and behaviour of the shared index when ``store: redis`` (see RedisConfig).
    redis: RedisConfig = field(default_factory=RedisConfig)
    #: What each backend's believed cache drops first: lru (what engines do) | lfu | ttl.
    eviction: EvictionName = "lru"
    #: With ``eviction: ttl``, seconds a block is believed held after its last use.
    ttl_s: PositiveFloat = 120.0
    #: Correct beliefs from the cached tokens engines report (router/request_path/beliefs.py).
    closed_loop: bool = False
    #: ... when an engine reports less than this share of the predicted cached tokens.
    closed_loop_tolerance: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    #: approximate: believe what the router routed (no tokenizer); events: what the engines'
    #: KV events report (precise mode; needs ``tokenizer``, see README "Precise routing").
    mode: Literal["approximate", "events"] = "approximate"
    #: Precise mode's event handling (see EventsConfig).
    events: EventsConfig = field(default_factory=EventsConfig)
    #: Precise mode's tokenizer (see TokenizerConfig); its files are needed only in that mode.
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def validate(self) -> list[str]:
        if self.mode != "events":
            return []
        problems = [f"tokenizer.{problem}" for problem in self.tokenizer.missing()]
        if not _importable("zmq"):
            problems.append(
                "mode: events subscribes to the engines over ZMQ: needs pyzmq; install kvroute[precise]"
            )
        if self.store != "memory":
            problems.append("store: mode events keeps its index in memory (each replica subscribes)")
        return problems


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
