"""Routing and eviction policies: small, pure, pluggable.

This package never imports ``router``: a policy sees only the typed views defined in
:mod:`policies.types`, so it can be unit tested, run in the offline simulator unchanged,
or written by a user in a module of their own and named in YAML as ``module:Class``.
"""
