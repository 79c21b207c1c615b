"""Eviction policies: which of a backend's believed blocks the engine has probably dropped.

``index.eviction`` in YAML names one of :data:`POLICIES`; :func:`block_set_factory` turns
the name and its parameters into the per-backend constructor the memory index takes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Literal

from policies.eviction.base import BlockSet
from policies.eviction.lfu import LFUBlocks
from policies.eviction.lru import LRUBlocks
from policies.eviction.ttl import TTLBlocks

#: The names ``index.eviction`` accepts (the keys of POLICIES), as a type the config declares.
EvictionName = Literal["lfu", "lru", "ttl"]
POLICIES: dict[EvictionName, type[BlockSet]] = {"lru": LRUBlocks, "lfu": LFUBlocks, "ttl": TTLBlocks}


def block_set_factory(
    name: str, *, ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic
) -> Callable[[int], BlockSet]:
    """``capacity -> BlockSet`` for the eviction policy ``name`` (``ttl_s`` and ``clock`` for ttl)."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}")
    if name == "ttl":
        return functools.partial(TTLBlocks, ttl_s=ttl_s, clock=clock)
    return POLICIES[name]


__all__ = ["POLICIES", "BlockSet", "EvictionName", "LFUBlocks", "LRUBlocks", "TTLBlocks", "block_set_factory"]
