"""The HTTP surface: the app and its routes, the server and its processes, the admin API,
config reloads, client authentication, per-tenant limits, protocol-level error shapes, logs.

The request path starts in :mod:`router.http.app` (``completions``) and continues in
:mod:`router.request_path`.
"""

from router.exports import lazy_exports

_EXPORTS = {
    "build_app": "app",
    "RouterServer": "server",
    "serve_forever": "server",
    "serve_processes": "processes",
    "refusal": "processes",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
