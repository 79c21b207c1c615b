"""The fleet: the backends and their upkeep (health, load scrapes, KV capacity, circuit
breakers, engine adapters, discovery, the load view shared between router replicas)."""

from router.exports import lazy_exports

_EXPORTS = {
    "Backend": "backends",
    "BackendPool": "backends",
    "FleetUpkeep": "upkeep",
    "CircuitBreaker": "circuit",
    "CircuitState": "circuit",
    "EngineStats": "engines",
    "build_discovery": "discovery",
    "ENGINE_KINDS": "settings",
    "EngineKind": "settings",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
