"""The system programs that the simulator's helpers, the benchmarks and the tests run, and the
Debian package each comes from, so that a missing one is named with its install command.

``scripts/test`` installs the packages the tests need (:data:`TEST_PACKAGES`) before running
them; a test that finds one missing anyway fails with :class:`MissingProgram`'s one line.
"""

from __future__ import annotations

import shutil

#: Program -> the Debian package that installs it.
PACKAGES = {
    "redis-server": "redis-server",
    "redis-cli": "redis-tools",
    "openssl": "openssl",
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "nginx": "nginx-light",
    "wrk": "wrk",
}
#: The programs the test suite runs (scripts/test installs their packages when missing).
TEST_PROGRAMS = ("redis-server", "redis-cli", "openssl", "prometheus", "promtool", "nginx", "wrk")


class MissingProgram(RuntimeError):
    """A program kvroute's tooling runs is not installed; the message says how to install it."""


def require(program: str) -> str:
    """The path of ``program``, or MissingProgram naming its package."""
    path = shutil.which(program)
    if path is None:
        package = PACKAGES.get(program, program)
        raise MissingProgram(
            f"{program} is not installed: apt-get install {package} (scripts/test installs it)"
        )
    return path
