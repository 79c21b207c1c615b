"""The request path: parse once, key the prompt, match, choose, forward, record.

:mod:`~router.request_path.request` parses the body into a RoutableRequest;
:mod:`~router.request_path.dispatch` runs the steps in order; :mod:`~router.request_path.proxy`
streams the engine's answer back through kvroute's own upstream client
(:mod:`~router.request_path.upstream`).
"""

from router.exports import lazy_exports

_EXPORTS = {
    "Dispatcher": "dispatch",
    "Attempt": "attempt",
    "AttemptBooks": "attempt",
    "Proxy": "proxy",
    "UpstreamFailed": "proxy",
    "UpstreamPool": "upstream",
    "RoutableRequest": "request",
    "parse_request": "request",
    "CHAT": "request",
    "COMPLETIONS": "request",
    "TENANT": "request",
    "Keyer": "keying",
    "build_keyer": "keying",
    "ClosedLoop": "beliefs",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
