"""Engine adapters: read each engine kind's ``/metrics`` into one shape, :class:`EngineStats`.

vLLM and SGLang publish the same load signals under different names and labels; an adapter
per kind (``backends[].engine``) hides that from the scraper and the policies.
"""

from __future__ import annotations

from router.fleet.engines.base import EngineAdapter, EngineStats
from router.fleet.engines.sglang import SGLangAdapter
from router.fleet.engines.vllm import VLLMAdapter
from router.fleet.settings import EngineKind

#: One adapter per engine kind (router/fleet/settings.py: EngineKind names them).
ADAPTERS: dict[EngineKind, EngineAdapter] = {"vllm": VLLMAdapter(), "sglang": SGLangAdapter()}


def engine_speaking(text: str) -> EngineKind | None:
    """The engine kind whose metric families an exposition text holds (the first, by name), or
    None: what to suggest when a backend's ``engine:`` adapter finds nothing in its /metrics."""
    return next((kind for kind, adapter in sorted(ADAPTERS.items()) if adapter.speaks(text)), None)


__all__ = ["ADAPTERS", "EngineAdapter", "EngineStats", "SGLangAdapter", "VLLMAdapter", "engine_speaking"]
