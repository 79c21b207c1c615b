"""The fleet: the backends and their upkeep (health, load scrapes, KV capacity, circuit
breakers, engine adapters, discovery, the load view shared between router replicas)."""
