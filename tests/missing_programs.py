"""A pytest plugin (loaded by conftest.py): a test that needs a program this machine lacks fails
with the one line of :class:`loadtest.programs.MissingProgram` (the program and the command that
installs it) instead of a traceback that buries it."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from loadtest.programs import MissingProgram


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, Any]:
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(MissingProgram):
        report.longrepr = str(call.excinfo.value)
    return report
