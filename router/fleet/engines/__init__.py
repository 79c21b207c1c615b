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

__all__ = ["ADAPTERS", "EngineAdapter", "EngineStats", "SGLangAdapter", "VLLMAdapter"]
