"""The simulated engine fleet: vLLM-compatible engines with a real prefix cache and real time.

No GPU is needed to develop, test or benchmark kvroute. Each :class:`SimEngine` speaks vLLM's
OpenAI-compatible HTTP API and ``/metrics`` names, keeps a block-level LRU prefix cache, and charges
asyncio time for uncached prefill (one prefill lane) and for batched decode, so queueing and cache
effects are real. :class:`SimFleet` runs many engines in one process; :class:`EngineTiming` holds
the cost model.
"""

from loadtest.sim.cache import PrefixCache
from loadtest.sim.engine import SimEngine
from loadtest.sim.fleet import SimFleet, serve_fleet
from loadtest.sim.protocol import render_chat
from loadtest.sim.scheduler import RequestRecord
from loadtest.sim.timing import EngineTiming

__all__ = [
    "EngineTiming",
    "PrefixCache",
    "RequestRecord",
    "SimEngine",
    "SimFleet",
    "render_chat",
    "serve_fleet",
]
