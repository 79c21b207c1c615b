"""A wing's public names, exported from its ``__init__`` and imported on first use.

``from router.fleet import BackendPool`` should work, and importing a wing's ``settings``
module must not import the rest of the wing: ``router.config`` imports every wing's
settings, Python runs the wing's ``__init__`` first, and an ``__init__`` that imported the
wing's modules eagerly would import modules that import the config while the config is
half loaded — a circle. A module-level ``__getattr__`` (PEP 562) resolves each public name
the first time it is asked for instead, and keeps it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose public names map to the module
    (relative to the package) defining each."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
