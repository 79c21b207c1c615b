"""kvroute's proxy, in wings; the folder layout is the map.

- ``http/``: the HTTP surface (app and routes, server, processes, admin, reload, auth, limits).
- ``request_path/``: one request from parsed body to engine and back (dispatch, proxy, upstream).
- ``fleet/``: the backends and their upkeep (health, scrapes, capacity, circuit, discovery).
- ``index/``: what each backend is believed to hold (memory, Redis, precise), and the block keys.
- ``kv_events/``: precise mode's inputs, the engines' KV event streams.
- ``redis/``: Redis clients and the breaker every Redis call goes through.
- ``config``, ``metrics``, ``errors``, ``tasks``: at the bottom, used by every wing.

Imports run one way, downwards: http → request_path → kv_events → fleet → index → redis →
the bottom modules → ``policies``.
"""
