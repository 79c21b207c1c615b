"""The request path: parse once, key the prompt, match, choose, forward, record.

:mod:`~router.request_path.request` parses the body into a RoutableRequest;
:mod:`~router.request_path.dispatch` runs the steps in order; :mod:`~router.request_path.proxy`
streams the engine's answer back through kvroute's own upstream client
(:mod:`~router.request_path.upstream`).
"""
