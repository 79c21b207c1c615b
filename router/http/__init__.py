"""The HTTP surface: the app and its routes, the server and its processes, the admin API,
config reloads, client authentication, per-tenant limits, protocol-level error shapes, logs.

The request path starts in :mod:`router.http.app` (``completions``) and continues in
:mod:`router.request_path`.
"""
